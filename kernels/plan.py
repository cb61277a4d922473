"""What every family's plan shares: a spec (what a kernel computes) and a
config (how it runs) held together, read field by field as one object
(``plan.k``, ``plan.rows``), changed through ``evolve`` or ``attrs.evolve``,
and checked together by the family's ``_check``."""

from __future__ import annotations

import functools

import attrs

__all__ = ["PlanBase"]


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
