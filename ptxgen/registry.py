"""The kernel registry: kernel families and their canonical specs.

A family module registers itself with :func:`register`; the CLI and the
golden/ptxas tests iterate :func:`canonical_specs`, and the graph executor
and the model find a family's ``build`` and ``launch_geometry`` by name
(:func:`family`).  Families are discovered
through the ``ptxgen.kernels`` entry-point group (the built-in ones from
``ptxgen.kernels``), so ptxgen itself never imports a kernel module by name
and other packages can add families the same way.
"""

from __future__ import annotations

import threading
from importlib.metadata import entry_points
from typing import Callable

import attrs

__all__ = ["Family", "register", "families", "family", "canonical_specs",
           "spec_fields", "spec_with"]

_lock = threading.Lock()
_families: dict[str, "Family"] = {}
_loaded = False


@attrs.frozen
class Family:
    """A kernel family: its spec class, builder, launch geometry and
    canonical specs.

    ``canonical`` maps a short name (the one ``python -m ptxgen dump`` takes
    and the golden file is named after) to a spec instance;
    ``launch_geometry(spec, ...)`` gives a ``LaunchGeometry`` per kernel
    (its arguments are the family's own; None for a family without one).
    """

    name: str
    spec_cls: type
    build: Callable
    canonical: dict = attrs.field(factory=dict, eq=False)
    doc: str = ""
    launch_geometry: Callable | None = attrs.field(default=None, eq=False)


def register(name: str, spec_cls: type, build: Callable, canonical: dict, doc: str = "",
             launch_geometry: Callable | None = None) -> Family:
    """Add a family; names of families and canonical specs must be unique."""
    fam = Family(name, spec_cls, build, dict(canonical), doc, launch_geometry)
    with _lock:
        if name in _families and _families[name].build is not build:
            raise ValueError(f"kernel family {name!r} is registered twice")
        for cname in canonical:
            for other in _families.values():
                if other.name != name and cname in other.canonical:
                    raise ValueError(f"canonical spec {cname!r} of {name!r} is already "
                                     f"registered by {other.name!r}")
        _families[name] = fam
    return fam


def _load():
    global _loaded
    if _loaded:
        return
    _loaded = True
    for ep in sorted(entry_points(group="ptxgen.kernels"), key=lambda e: e.name):
        ep.load()


def families() -> dict[str, Family]:
    _load()
    return dict(sorted(_families.items()))


def family(name: str) -> Family:
    """The family registered as ``name`` (KeyError naming the known ones)."""
    fams = families()
    try:
        return fams[name]
    except KeyError:
        raise KeyError(f"no kernel family {name!r}; families: {', '.join(fams)}") from None


def canonical_specs() -> dict[str, tuple[Family, object]]:
    """Every canonical spec, by its unique name, sorted."""
    out = {}
    for fam in families().values():
        for cname, spec in fam.canonical.items():
            out[cname] = (fam, spec)
    return dict(sorted(out.items()))


def spec_fields(spec_cls) -> dict[str, attrs.Attribute]:
    return {a.name: a for a in attrs.fields(spec_cls)}


def _is_plan(obj) -> bool:
    """A plan: a family's spec and config together (attrs fields ``spec``
    and ``config``), changed field by field through its ``evolve``."""
    return attrs.has(type(obj)) and set(spec_fields(type(obj))) == {"spec", "config"}


def _settable(spec) -> tuple[dict, object]:
    """The fields ``spec_with`` may set on ``spec``, and the object that
    holds each one's current value (a name -> holder dict)."""
    if _is_plan(spec):
        fields = {**spec_fields(type(spec.spec)), **spec_fields(type(spec.config))}
        return fields, {n: spec for n in fields}
    own = spec_fields(type(spec))
    inner = getattr(spec, "plan", None)
    if "plan" in own and _is_plan(inner):
        # a spec over a plan (the experts' GEMV): its own fields and the plan's
        pf, _ = _settable(inner)
        fields = {**{n: f for n, f in own.items() if n != "plan"}, **pf}
        return fields, {n: (inner if n in pf else spec) for n in fields}
    return own, {n: spec for n in own}


def spec_with(spec, overrides: dict[str, str]):
    """A copy of ``spec`` with fields set from ``key=value`` strings.

    Values are converted to the field's current type (int, float, bool,
    str, or a tuple of ints written ``1,2,3``); unknown keys raise KeyError
    listing the valid ones, bad values raise ValueError.  A plan's fields are
    its spec's and config's; a spec holding a plan (field ``plan``) takes
    the plan's fields besides its own, through its ``evolve``."""
    fields, holder = _settable(spec)
    changes = {}
    for key, raw in overrides.items():
        if key not in fields:
            raise KeyError(f"{type(spec).__name__} has no field {key!r}; "
                           f"valid: {', '.join(fields)}")
        cur = getattr(holder[key], key)
        changes[key] = _convert(key, raw, cur)
    try:
        return spec.evolve(**changes) if hasattr(spec, "evolve") else attrs.evolve(spec, **changes)
    except (TypeError, ValueError) as e:
        raise ValueError(f"invalid spec: {validator_message(e)}") from None


def validator_message(e: Exception) -> str:
    """The message of a spec validator's error.  attrs' own validators
    (``in_``, ``instance_of``) raise with the field's ``Attribute`` among the
    arguments; their message is rewritten as ``NAME must be one of A, B, got
    'X'`` (or ``must be a T``) instead of the argument tuple."""
    args = e.args
    if len(args) >= 4 and isinstance(args[1], attrs.Attribute):
        name, allowed, value = args[1].name, args[2], args[3]
        if isinstance(allowed, type) or (isinstance(allowed, tuple)
                                         and all(isinstance(t, type) for t in allowed)):
            types = allowed if isinstance(allowed, tuple) else (allowed,)
            return (f"{name} must be a {' or '.join(t.__name__ for t in types)}, "
                    f"got {value!r}")
        try:
            choices = ", ".join(map(str, allowed))
        except TypeError:
            choices = str(allowed)
        return f"{name} must be one of {choices}, got {value!r}"
    return str(e)


def _convert(key, raw, cur):
    try:
        if isinstance(cur, bool):
            if raw.lower() in ("1", "true", "yes", "on"):
                return True
            if raw.lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError(raw)
        if isinstance(cur, int):
            return int(raw, 0)
        if isinstance(cur, float):
            return float(raw)
        if isinstance(cur, tuple):
            return tuple(int(x, 0) for x in raw.split(",") if x)
        return raw
    except ValueError:
        raise ValueError(f"{key}={raw!r}: expected a {type(cur).__name__} "
                         f"like {cur!r}") from None
