"""Structured control flow as context managers.

``if_``, ``if_else``, ``for_range`` and ``while_`` generate branches to
unique labels; ``break_``/``continue_`` jump out of or around the innermost
loop; ``guarded`` predicates every instruction built inside it.  Python
loops unroll: write ``for j in range(4):`` to repeat code four times.
"""

from __future__ import annotations

from contextlib import contextmanager

from . import types as T
from .errors import PtxBuildError, PtxTypeError
from .values import NotPred, Reg

__all__ = ["ControlFlowMixin"]


def _negate(p):
    if isinstance(p, NotPred):
        return p.pred
    if isinstance(p, Reg) and p.type.is_pred:
        return NotPred(p)
    raise PtxTypeError(f"a condition must be a predicate register (from a comparison), "
                       f"got {p!r}")


class _Loop:
    __slots__ = ("top", "cont", "end")

    def __init__(self, top, cont, end):
        self.top, self.cont, self.end = top, cont, end


class _Branch:
    """One arm of ``if_else``: runs ``on_enter``/``on_exit`` around the arm."""

    def __init__(self, on_enter, on_exit):
        self.on_enter = on_enter
        self.on_exit = on_exit
        self.used = False

    def __enter__(self):
        if self.used:
            raise PtxBuildError("each if_else arm can be entered once")
        self.on_enter()
        self.used = True
        return self

    def __exit__(self, et, ev, tb):
        if et is None:
            self.on_exit()
        return False


class ControlFlowMixin:
    @contextmanager
    def if_(self, cond, *, uniform=False):
        """Run the block only where ``cond`` holds: ``@!cond bra END``.
        ``uniform``: ``cond`` is the same in every thread of a warp (``bra.uni``;
        ptxas then treats the block as non-divergent, which warpgroup MMA
        needs to stay asynchronous)."""
        end = self._auto_label("endif")
        self.bra(end, guard=_negate(cond), uni=uniform)
        self._open_blocks += 1
        try:
            yield
        finally:
            self._open_blocks -= 1
        self.place(end)

    @contextmanager
    def if_else(self, cond, *, uniform=False):
        """Two arms; use as ``with k.if_else(p) as (then, otherwise):`` and
        enter ``then`` first, then ``otherwise``.  ``uniform`` as for
        :meth:`if_`."""
        other = self._auto_label("else")
        end = self._auto_label("endif")
        self.bra(other, guard=_negate(cond), uni=uniform)
        state = {"then": False}

        def then_done():
            self.bra(end, uni=True)
            self.place(other)
            state["then"] = True

        def else_enter():
            if not state["then"]:
                raise PtxBuildError("enter the 'then' arm of if_else before 'otherwise'")

        then = _Branch(lambda: None, then_done)
        otherwise = _Branch(else_enter, lambda: None)
        self._open_blocks += 1
        try:
            yield then, otherwise
        finally:
            self._open_blocks -= 1
        if not state["then"]:
            raise PtxBuildError("if_else: the 'then' arm was never entered")
        self.place(end)

    @contextmanager
    def for_range(self, start, stop=None, step=1, ty=T.u32):
        """A counted loop; yields the counter (a :class:`Var` of ``ty``).

        ``for_range(n)`` counts 0..n-1; ``start``/``stop`` may be registers or
        ints; ``step`` is a positive int or register.  The test is at the top,
        so an empty range runs no iteration.
        """
        if stop is None:
            start, stop = 0, start
        if isinstance(step, int) and step <= 0:
            raise PtxBuildError(f"for_range needs a positive step, got {step}")
        ty = _loop_type(ty, start, stop)
        i = self.var(ty, start)
        top = self._auto_label("loop")
        cont = self._auto_label("loop_next")
        end = self._auto_label("loop_end")
        self.place(top)
        done = self.setp("ge", i, stop)
        self.bra(end, guard=done)
        self._loops.append(_Loop(top, cont, end))
        self._open_blocks += 1
        try:
            yield i
        finally:
            self._open_blocks -= 1
            self._loops.pop()
        self.place(cont)
        self.add(i, step, out=i)
        self.bra(top, uni=True)
        self.place(end)

    def strided(self, first, n, step):
        """Items ``first, first + step, ...`` below ``n`` (ints known when
        building, ``first`` a register such as ``tid``), unrolled: yields
        each item as a register, the last round inside ``if_(item < n)``
        where some threads may be past ``n`` (the earlier rounds need no
        test).  Use as ``for i in k.strided(tid, n, nthreads):``."""
        if not isinstance(n, int) or not isinstance(step, int) or step <= 0:
            raise PtxBuildError(f"strided needs an int count and a positive int step, "
                                f"got n={n!r}, step={step!r}")
        for c in range(-(-n // step)):
            item = first + c * step if c else first
            if (c + 1) * step > n:
                with self.if_(item < n):
                    yield item
            else:
                yield item

    @contextmanager
    def while_(self, cond_fn):
        """Loop while ``cond_fn()`` (called once, emitting the test at the top
        of every iteration) gives a true predicate."""
        if not callable(cond_fn):
            raise PtxBuildError("while_ takes a function that builds the condition, "
                                "e.g. k.while_(lambda: i < n)")
        top = self._auto_label("while")
        end = self._auto_label("while_end")
        self.place(top)
        p = cond_fn()
        self.bra(end, guard=_negate(p))
        self._loops.append(_Loop(top, top, end))
        self._open_blocks += 1
        try:
            yield
        finally:
            self._open_blocks -= 1
            self._loops.pop()
        self.bra(top, uni=True)
        self.place(end)

    def break_(self, *, guard=None):
        """Leave the innermost loop."""
        if not self._loops:
            raise PtxBuildError("break_ outside a loop")
        self.bra(self._loops[-1].end, guard=guard)

    def continue_(self, *, guard=None):
        """Go to the next iteration of the innermost loop."""
        if not self._loops:
            raise PtxBuildError("continue_ outside a loop")
        self.bra(self._loops[-1].cont, guard=guard)

    @contextmanager
    def guarded(self, p):
        """Predicate each instruction built inside with ``@p`` (or ``@!p``)."""
        if not (isinstance(p, NotPred) or isinstance(p, Reg) and p.type.is_pred):
            raise PtxTypeError(f"guarded needs a predicate, got {p!r}")
        self._guards.append(p)
        try:
            yield
        finally:
            self._guards.pop()


def _loop_type(ty, start, stop):
    for x in (start, stop):
        if isinstance(x, Reg):
            if x.type is not ty and ty is T.u32:
                return x.type
            if x.type is not ty:
                raise PtxTypeError(f"for_range over {ty.name} got a {x.type.name} bound")
    return T.type_by_name(ty)
