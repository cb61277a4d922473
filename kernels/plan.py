"""What every family shares: how one of its kernels is launched
(:class:`LaunchGeometry`), and for the families with a tuned config a plan, a
spec (what a kernel computes) and a config (how it runs) held together, read
field by field as one object (``plan.k``, ``plan.rows``), changed through
``evolve`` or ``attrs.evolve``, and checked together by the family's
``_check``."""

from __future__ import annotations

import functools
import types

import attrs

__all__ = ["LaunchGeometry", "PlanBase"]


def _dims(what):
    """The converter of ``grid``/``block``: an int or 1-3 positive ints as ``(x, y, z)``."""
    def convert(v) -> tuple:
        t = (v,) if hasattr(v, "__index__") else tuple(v) if hasattr(v, "__iter__") else None
        if (t is None or not 1 <= len(t) <= 3
                or not all(hasattr(d, "__index__") and not isinstance(d, bool) and d > 0
                           for d in t)):
            raise ValueError(f"{what} must be an int or 1 to 3 positive ints, got {v!r}")
        return tuple(int(d) for d in t) + (1,) * (3 - len(t))
    return convert


def _shared(inst, attr, v):
    if not isinstance(v, int) or isinstance(v, bool) or v < 0:
        raise ValueError(f"shared must be a non-negative int of bytes, got {v!r}")


def _frozen_args(v) -> types.MappingProxyType:
    d = dict(v)
    for name, value in d.items():
        if not isinstance(name, str) or isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"geometry arguments are parameter names with int or float "
                             f"values, got {name!r}: {value!r}")
    return types.MappingProxyType(d)


@attrs.frozen
class LaunchGeometry:
    """How one kernel of a family is launched: what every family's
    ``launch_geometry`` returns (one per kernel; a family of several kernels
    returns a tuple of them in launch order).

    Attributes
    ----------
    kernel : str
        The PTX entry it launches.
    grid, block : tuple of 3 ints
        Blocks per grid and threads per block (an int or 1 to 3 ints are
        taken and padded with ones).
    shared : int
        Bytes of dynamic shared memory each block asks for.
    args : mapping of str to int or float
        Kernel arguments the geometry decides, by parameter name (the GEMV's
        ``rpc``, flash decode's ``n_splits``); the launch adds them to the
        caller's.
    """

    kernel: str = attrs.field(validator=attrs.validators.instance_of(str))
    grid: tuple = attrs.field(converter=_dims("grid"))
    block: tuple = attrs.field(converter=_dims("block"))
    shared: int = attrs.field(default=0, validator=_shared)
    args: types.MappingProxyType = attrs.field(factory=dict, converter=_frozen_args,
                                               hash=False)

    @property
    def threads(self) -> int:
        """Threads per block."""
        return self.block[0] * self.block[1] * self.block[2]

    def evolve(self, **changes) -> "LaunchGeometry":
        """This geometry with some fields changed (e.g. ``grid``)."""
        return attrs.evolve(self, **changes)


@functools.lru_cache(maxsize=None)
def _names(cls) -> tuple:
    return tuple(f.name for f in attrs.fields(cls))


class PlanBase:
    """Base of ``GemvPlan``, ``FlashDecodePlan``, ... (each an
    ``attrs.frozen(init=False)`` class with fields ``spec`` and ``config``).

    A family sets ``SPEC`` and ``CONFIG`` (its two classes), ``WHAT`` (its
    name in messages), ``SPEC_PROPS`` (spec properties read through the
    plan) and overrides ``_check``.  ``Plan(spec, config, **changes)``: spec
    and config fields given as keywords replace theirs; ``config=None``
    takes the config's defaults (not the tuned ones)."""

    SPEC: type
    CONFIG: type
    WHAT: str = "kernel"
    SPEC_PROPS: tuple = ()

    def __init__(self, spec, config=None, **changes):
        if config is None:
            config = self.CONFIG()
        if changes:
            s, c = self.split_fields(changes)
            spec, config = attrs.evolve(spec, **s), attrs.evolve(config, **c)
        if not isinstance(spec, self.SPEC) or not isinstance(config, self.CONFIG):
            raise TypeError(f"{type(self).__name__} takes a {self.SPEC.__name__} and a "
                            f"{self.CONFIG.__name__}, got {type(spec).__name__} and "
                            f"{type(config).__name__}")
        object.__setattr__(self, "spec", spec)
        object.__setattr__(self, "config", config)
        self._check()

    @classmethod
    def split_fields(cls, fields: dict) -> tuple:
        """``fields`` as ``(spec fields, config fields)``; an unknown name is
        refused with the valid ones."""
        sn, cn = _names(cls.SPEC), _names(cls.CONFIG)
        s = {k: v for k, v in fields.items() if k in sn}
        c = {k: v for k, v in fields.items() if k in cn}
        bad = set(fields) - set(s) - set(c)
        if bad:
            raise ValueError(f"unknown {cls.WHAT} field(s): {', '.join(sorted(bad))}; "
                             f"valid: {', '.join(sn + cn)}")
        return s, c

    def __getattr__(self, name):
        cls = type(self)
        if name in _names(cls.SPEC) or name in cls.SPEC_PROPS:
            return getattr(self.spec, name)
        if name in _names(cls.CONFIG):
            return getattr(self.config, name)
        raise AttributeError(name)

    def evolve(self, **changes):
        """This plan with some spec and config fields changed."""
        return type(self)(self.spec, self.config, **changes)

    def _check(self):
        """Refuse a config the spec cannot take (ValueError, with the reason)."""
