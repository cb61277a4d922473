"""The graph executor: tensor ops -> kernel launches -> one CUDA graph.

A :class:`ComputeGraph` is a list of tensor ops in topological order (each
op's inputs exist before it).  Every op lowers to one or more kernel
launches (:class:`Launch`): a kernel family spec, the family's
:class:`~ptxgen.kernels.plan.LaunchGeometry` and the kernel's arguments by
parameter name, each a buffer, a pointer into one or a scalar.  Buffers are
of three kinds:

``weight``      uploaded once (model parameters),
``state``       persistent device memory (KV cache, position, token ids),
``activation``  per-step intermediates, placed by :func:`plan_activations`
                into one arena, reusing bytes whose tensor is dead.

:class:`Executor` compiles each distinct spec once, allocates the arena and
resolves every argument to a device pointer.  ``run_eager()`` issues the
launches one by one from Python; ``capture()`` records the same sequence
into a CUDA graph that ``replay()`` launches with one call.  Because every
argument is a fixed pointer or constant, and per-token values (position,
KV length, token id) live in ``state`` buffers that kernels read and the
graph itself advances, eager and replay run exactly the same kernels on
exactly the same memory.

Variants.  An op may belong to a named *variant* of the step (``Op.variant``,
e.g. the decode step's ``"greedy"`` argmax and its ``"sample"`` sampler, two
ways of choosing the next token).  Ops without a variant run in every
variant; an op of one variant runs only in that one.  ``run_eager``,
``capture`` and ``replay`` take the variant (default: the graph's
``default_variant``), and the executor keeps one CUDA graph per variant, so
each replay issues only its own variant's launches.

Shared memory.  Several graphs of one model (the decode step, the prompt
chunk of each size) read the same weights and write the same KV cache: a
:class:`Store` holds those persistent buffers by name, each graph made with
it (``ComputeGraph(store=...)``) takes them from it, and a
:class:`DeviceMemory` uploads each once for every executor given it.  The
graphs of one model never run at the same time (one stream), so their
executors can share one activation arena too (:class:`Arena`).

Collectives.  A rank of a tensor-parallel model has ops with no launches
that name a :class:`~.collective.Collective` (an all-reduce, an
all-gather); the executor, given the rank's communicator, issues each in
its place among the launches (:mod:`.collective`).

Arguments.  A launch's arguments are a mapping from the kernel's declared
parameter names to buffers, buffer references or scalars; the executor
orders them by the kernel's PTX signature and refuses a missing or unknown
name, naming the kernel.
"""

from __future__ import annotations

import types
from typing import Any, Mapping, Sequence

import attrs
import numpy as np

from ptxgen import registry
from ptxgen.kernels.plan import LaunchGeometry

from .collective import Collective, DeviceSpan
from .launch import named_args

__all__ = ["Buffer", "BufRef", "TensorMapOf", "Launch", "Op", "Store", "ComputeGraph",
           "plan_activations", "DeviceMemory", "Arena", "Executor"]

_ALIGN = 256


@attrs.define(eq=False)
class Buffer:
    """A device buffer of the graph (identity matters, not value)."""

    name: str
    shape: tuple
    dtype: Any
    kind: str = "activation"          # weight | state | activation
    data: Any = None                  # host data to upload (weight/state)
    nbytes: int = 0
    offset: int | None = None         # arena offset of an activation

    def at(self, byte_offset: int) -> "BufRef":
        """A launch argument pointing ``byte_offset`` bytes into this buffer."""
        if not 0 <= byte_offset < self.nbytes:
            raise ValueError(f"offset {byte_offset} is outside buffer {self.name!r} "
                             f"({self.nbytes} bytes)")
        return BufRef(self, byte_offset)

    def __attrs_post_init__(self):
        if self.kind not in ("weight", "state", "activation"):
            raise ValueError(f"buffer {self.name!r}: unknown kind {self.kind!r}")
        self.dtype = np.dtype(self.dtype)
        if not self.nbytes:
            self.nbytes = int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize


@attrs.frozen(eq=False)
class BufRef:
    """A pointer into a buffer at a byte offset (e.g. one word of a state
    buffer)."""

    buffer: Buffer
    offset: int


def _buffers_of(args):
    if isinstance(args, dict):
        args = args.values()
    for a in args:
        if isinstance(a, TensorMapOf):
            a = a.source
        if isinstance(a, Buffer):
            yield a
        elif isinstance(a, BufRef):
            yield a.buffer


@attrs.frozen(eq=False)
class TensorMapOf:
    """A launch argument: the tensor map ``describe(address)`` (a
    :class:`ptxgen.tensor_map.TensorMap`) of the buffer ``source`` once it
    has an address, as the backend encodes it (a ``CUtensorMap`` on the GPU)."""

    source: Any
    describe: Any


@attrs.frozen
class Launch:
    """One kernel launch of an op: kernel ``geometry.kernel`` of
    ``family``'s ``build(spec)`` (found through :mod:`ptxgen.registry`),
    launched with ``geometry`` and ``args``: parameter name -> a
    :class:`Buffer`, a :class:`BufRef`, a :class:`TensorMapOf` or a scalar
    (the geometry adds the arguments it decides)."""

    family: str
    spec: Any
    geometry: LaunchGeometry
    args: Mapping = attrs.field(converter=lambda a: types.MappingProxyType(dict(a)))

    @property
    def kernel(self) -> str:
        return self.geometry.kernel

    def values(self) -> tuple:
        """The arguments, without their names."""
        return tuple(self.args.values())


@attrs.define(eq=False)
class Op:
    """A tensor op: its kind (``MulMat``, ``RmsNorm`` ...), the buffers it
    reads and writes, the launches it lowers to, and the variant of the
    step it belongs to (None: every variant)."""

    kind: str
    name: str
    inputs: tuple
    outputs: tuple
    launches: tuple
    variant: str | None = None
    #: a :class:`~.collective.Collective` the executor's communicator runs
    #: (an op with no launches)
    collective: Any = None

    def runs_in(self, variant) -> bool:
        """Whether this op is part of the step's ``variant``."""
        return self.variant is None or self.variant == variant


class Store:
    """Persistent buffers (weights and state) by name, shared by the graphs
    of one model."""

    def __init__(self):
        self.buffers: dict[str, Buffer] = {}

    def get(self, name, shape, dtype, kind, data=None, nbytes=0, make=None) -> Buffer:
        """The buffer ``name``, made on first use (``data`` may be a function
        of no arguments, called then); a later request must agree on shape,
        dtype and kind."""
        b = self.buffers.get(name)
        if b is None:
            if callable(data):
                data = data()
            b = self.buffers[name] = Buffer(name, tuple(shape), dtype, kind, data, nbytes)
        elif (b.shape, b.dtype, b.kind) != (tuple(shape), np.dtype(dtype), kind):
            raise ValueError(f"buffer {name!r} is {b.kind} {b.shape} {b.dtype}; asked for "
                             f"{kind} {tuple(shape)} {np.dtype(dtype)}")
        return b


class ComputeGraph:
    """Tensor ops in execution (topological) order.  With a :class:`Store`,
    weight and state buffers are the store's, shared with its other graphs."""

    def __init__(self, store: Store | None = None):
        self.buffers: list[Buffer] = []
        self.ops: list[Op] = []
        self._names: set[str] = set()
        self.store = store
        #: the variant run when none is named (see the module docstring)
        self.default_variant: str | None = None

    def buffer(self, name, shape, dtype, kind="activation", data=None, nbytes=0) -> Buffer:
        """A new buffer; with a store, a weight or state buffer is the
        store's (asking for it again gives it again)."""
        shared = self.store is not None and kind != "activation"
        if name in self._names:
            if shared and name in self.store.buffers:
                return self.store.get(name, shape, dtype, kind)
            raise ValueError(f"buffer name {name!r} is used twice")
        self._names.add(name)
        if shared:
            b = self.store.get(name, shape, dtype, kind, data, nbytes)
        else:
            b = Buffer(name, tuple(shape), dtype, kind, data() if callable(data) else data, nbytes)
        self.buffers.append(b)
        return b

    def shared(self, name) -> Buffer:
        """The store's buffer ``name`` (made by another graph), now also this graph's."""
        b = self.store.buffers[name]
        if name not in self._names:
            self._names.add(name)
            self.buffers.append(b)
        return b

    def add(self, kind: str, name: str, inputs: Sequence[Buffer], outputs: Sequence[Buffer],
            launches: Sequence[Launch], variant: str | None = None) -> Op:
        inputs, outputs = tuple(_buffers_of(inputs)), tuple(_buffers_of(outputs))
        known = set(map(id, self.buffers))
        for b in inputs + outputs:
            if id(b) not in known:
                raise ValueError(f"op {name}: buffer {b.name!r} is not part of this graph")
        for L in launches:
            for a in _buffers_of(L.values()):
                if id(a) not in known:
                    raise ValueError(f"op {name}: launch argument {a.name!r} is not part of this graph")
        if variant is not None and (not isinstance(variant, str) or not variant):
            raise ValueError(f"op {name}: variant must be a non-empty str or None, got {variant!r}")
        op = Op(kind, name, inputs, outputs, tuple(launches), variant)
        self.ops.append(op)
        return op

    def add_collective(self, kind: str, name: str, collective: Collective,
                       variant: str | None = None) -> Op:
        """An op that runs ``collective`` between the ranks (no launches)."""
        op = self.add(kind, name, collective.inputs, collective.outputs, (), variant=variant)
        op.collective = collective
        return op

    @property
    def has_collectives(self) -> bool:
        return any(op.collective is not None for op in self.ops)

    @property
    def variants(self) -> tuple:
        """The named variants of the step, in order of appearance."""
        return tuple(dict.fromkeys(op.variant for op in self.ops if op.variant is not None))

    def resolve_variant(self, variant=None):
        """``variant``, or the default one when None; an unknown name is refused."""
        if variant is None:
            return self.default_variant
        if variant not in self.variants:
            known = ", ".join(map(repr, self.variants)) or "none"
            raise ValueError(f"unknown variant {variant!r}; this graph has {known}")
        return variant

    def ops_of(self, variant=None) -> list:
        """The ops one step of ``variant`` runs (default: the default variant)."""
        v = self.resolve_variant(variant)
        return [op for op in self.ops if op.runs_in(v)]

    @property
    def launch_count(self) -> int:
        """Launches of one step of the default variant."""
        return self.launch_count_of()

    def launch_count_of(self, variant=None) -> int:
        """Launches of one step of ``variant``."""
        return sum(len(op.launches) for op in self.ops_of(variant))

    def summary(self) -> str:
        """A printable table: ops by kind, launches, buffer bytes by kind."""
        by_kind: dict[str, list[int]] = {}
        for op in self.ops:
            label = op.kind if op.variant is None else f"{op.kind} [{op.variant}]"
            c = by_kind.setdefault(label, [0, 0])
            c[0] += 1
            c[1] += len(op.launches)
        lines = [f"{'op':<24}{'count':>8}{'launches':>10}"]
        for kind, (n, nl) in by_kind.items():
            lines.append(f"{kind:<24}{n:>8}{nl:>10}")
        variants = self.variants
        for v in (variants or (None,)):
            label = "total" if v is None else f"total [{v}]"
            lines.append(f"{label:<24}{len(self.ops_of(v)):>8}{self.launch_count_of(v):>10}")
        for kind in ("weight", "state", "activation"):
            bs = [b for b in self.buffers if b.kind == kind]
            lines.append(f"{kind} buffers: {len(bs)}, {sum(b.nbytes for b in bs) / 1e6:.2f} MB")
        arena = plan_activations(self)
        lines.append(f"activation arena after reuse: {arena / 1e6:.3f} MB")
        return "\n".join(lines)


def plan_activations(graph: ComputeGraph) -> int:
    """Give every activation an arena offset, reusing the bytes of tensors
    whose last use is over (greedy first fit in op order).  Returns the
    arena size in bytes."""
    acts = [b for b in graph.buffers if b.kind == "activation"]
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    for t, op in enumerate(graph.ops):
        touched = list(op.inputs) + list(op.outputs)
        for L in op.launches:
            touched += list(_buffers_of(L.values()))
        for b in touched:
            if b.kind == "activation":
                first.setdefault(id(b), t)
                last[id(b)] = t
    live: list[tuple[int, int, int]] = []   # (offset, end, last_use)
    size = 0
    for b in sorted(acts, key=lambda b: (first.get(id(b), 0), -b.nbytes)):
        if id(b) not in first:
            b.offset = None
            continue
        t0 = first[id(b)]
        live = [x for x in live if x[2] >= t0]
        need = -(-b.nbytes // _ALIGN) * _ALIGN
        off = 0
        for lo, hi, _ in sorted(live):
            if off + need <= lo:
                break
            off = max(off, hi)
        b.offset = off
        live.append((off, off + need, last[id(b)]))
        size = max(size, off + need)
    return size


class DeviceMemory:
    """The device arrays of persistent buffers, uploaded once for every
    executor that shares this object (see the module docstring)."""

    def __init__(self, backend):
        self.backend = backend
        self.arrays: dict[int, Any] = {}

    def upload(self, buffers, progress=None):
        """Allocate (and fill from ``data``, else zero) the buffers not yet on the device."""
        be = self.backend
        todo = [b for b in buffers if id(b) not in self.arrays]
        total = sum(b.nbytes for b in todo)
        done = 0
        for b in todo:
            if b.data is not None:
                arr = be.from_numpy(np.ascontiguousarray(b.data))
            else:
                arr = be.empty((b.nbytes,), np.uint8)
                be.fill_zero(arr)
            self.arrays[id(b)] = arr
            done += b.nbytes
            if progress is not None:
                progress(done, total, b.name)

    def ptr(self, b: Buffer) -> int:
        return self.backend.ptr(self.arrays[id(b)])


class Arena:
    """Device bytes for the activations of graphs that never run at the same
    time (one stream): every graph's size is reserved before the first one
    runs, and the arena is allocated once, at the largest (captured graphs
    hold its address)."""

    def __init__(self, backend):
        self.backend = backend
        self.nbytes = 0
        self._array = None

    def reserve(self, nbytes: int):
        if nbytes > self.nbytes:
            if self._array is not None:
                raise RuntimeError(f"the activation arena ({self.nbytes} bytes) is in use and "
                                   f"cannot grow to {nbytes}: reserve every graph's size first")
            self.nbytes = nbytes

    @property
    def array(self):
        if self._array is None:
            self._array = self.backend.empty((max(self.nbytes, _ALIGN),), np.uint8)
        return self._array


class Executor:
    """Compiles, allocates and runs a :class:`ComputeGraph` on a backend.

    Parameters
    ----------
    graph : ComputeGraph
    backend : ptxgen.driver.backend.Backend
        Module loading, launches, arrays, graph capture.
    progress : callable, optional
        ``progress(done_bytes, total_bytes, buffer_name)`` as weights upload.
    memory : DeviceMemory, optional
        Shared with other executors of the same model (its persistent
        buffers); default: this executor's own.
    arena : Arena, optional
        Shared with executors of graphs that never run at the same time,
        each graph's size reserved before the first runs; default: this
        executor's own.
    comm : ptxgen.driver.collective.Communicator, optional
        The rank's communicator, which runs the graph's collective ops
        (required where it has any).

    Each launch's family is found through :func:`ptxgen.registry.family`.
    """

    def __init__(self, graph: ComputeGraph, backend, progress=None,
                 memory: DeviceMemory | None = None, arena: Arena | None = None, comm=None):
        if comm is None and graph.has_collectives:
            first = next(op for op in graph.ops if op.collective is not None)
            raise ValueError(f"the graph's collective op {first.name!r} needs a communicator "
                             "(Executor(..., comm=...))")
        self.graph = graph
        self.backend = backend
        self.comm = comm
        self.arena_bytes = plan_activations(graph)
        self.memory = memory if memory is not None else DeviceMemory(backend)
        self._arena = arena if arena is not None else Arena(backend)
        self._arena.reserve(self.arena_bytes)
        self._modules: dict = {}
        self._graph_execs: dict = {}
        self._alloc(progress)
        self._compile()
        resolved = {id(L): self._resolve(L) for op in graph.ops for L in op.launches}
        # the launch sequence of each variant (one, None, when there are none)
        self._resolved = {v: [resolved[id(L)] for op in graph.ops if op.runs_in(v)
                              for L in op.launches]
                          for v in (graph.variants or (None,))}
        # the launches and collectives of each variant, in issue order
        self._steps = {v: [item for op in graph.ops if op.runs_in(v)
                           for item in ([op.collective] if op.collective is not None
                                        else [resolved[id(L)] for L in op.launches])]
                       for v in (graph.variants or (None,))}

    # ------------------------------------------------------------- set-up
    def _alloc(self, progress):
        self.memory.upload([b for b in self.graph.buffers if b.kind != "activation"], progress)
        self.arena = self._arena.array
        self.arrays = self.memory.arrays

    def _compile(self):
        for op in self.graph.ops:
            for L in op.launches:
                key = (L.family, L.spec)
                if key not in self._modules:
                    build = registry.family(L.family).build
                    self._modules[key] = self.backend.load(build(L.spec))

    def ptr(self, b: Buffer) -> int:
        if b.kind == "activation":
            if b.offset is None:
                raise ValueError(f"activation {b.name!r} is never used by an op")
            return self.backend.ptr(self.arena) + b.offset
        return self.backend.ptr(self.arrays[id(b)])

    def _resolve(self, L: Launch):
        geo = L.geometry
        fn = self._modules[(L.family, L.spec)].function(geo.kernel)
        fn.require_dynamic_shared(geo.shared)
        args = named_args(fn, geo, {n: self._value(a) for n, a in L.args.items()})
        # the arguments are checked now, not at the first run
        fn.packer.values(args)
        return fn, geo.grid, geo.block, args, geo.shared, bool(getattr(L.spec, "pdl", False))

    def _value(self, a):
        if isinstance(a, Buffer):
            return self.ptr(a)
        if isinstance(a, BufRef):
            return self.ptr(a.buffer) + a.offset
        if isinstance(a, TensorMapOf):
            return self.backend.tensor_map(a.describe(self._value(a.source)))
        return a

    # ------------------------------------------------------------- running
    def launches(self, variant=None) -> list:
        """The resolved launches of one step of ``variant``: ``(function,
        grid, block, args, shared, pdl)`` tuples in issue order."""
        return self._resolved[self.graph.resolve_variant(variant)]

    def run_eager(self, stream=None, pdl: bool = False, variant=None):
        """One launch per op of ``variant``, from Python.  With ``pdl`` the
        launches whose spec has ``pdl=True`` use programmatic dependent
        launch; eager decoding leaves it off (the host, not the GPU, sets the
        pace there, and ``cuLaunchKernelEx`` costs more host time than
        ``cuLaunchKernel``)."""
        launch = self.backend.launch_positional
        for item in self._steps[self.graph.resolve_variant(variant)]:
            if isinstance(item, Collective):
                self._collective(item, stream)
                continue
            fn, grid, block, args, shared, fn_pdl = item
            launch(fn, grid, block, *args, shared=shared, stream=stream, pdl=pdl and fn_pdl)

    def span(self, b: Buffer) -> DeviceSpan:
        """Buffer ``b`` as a communicator takes it."""
        if b.kind == "activation":
            array, offset = self.arena, b.offset
        else:
            array, offset = self.arrays[id(b)], 0
        return DeviceSpan(self.ptr(b), int(np.prod(b.shape)), np.dtype(b.dtype), array, offset,
                          self.backend)

    def _collective(self, c: Collective, stream):
        if c.kind == "all_reduce_sum":
            self.comm.all_reduce_sum(self.span(c.src), stream)
        else:
            self.comm.all_gather(self.span(c.src), self.span(c.dst), stream)

    def capture(self, stream, variant=None):
        """Record ``variant``'s launch sequence into a CUDA graph, with
        programmatic dependent launch where the specs have it.  Each variant
        keeps its own graph."""
        v = self.graph.resolve_variant(variant)
        g = self.backend.capture(stream, lambda: self.run_eager(stream, pdl=True, variant=v))
        self._graph_execs[v] = g
        return g

    def is_captured(self, variant=None) -> bool:
        return self.graph.resolve_variant(variant) in self._graph_execs

    def replay(self, stream, variant=None):
        """Launch ``variant``'s captured graph."""
        v = self.graph.resolve_variant(variant)
        g = self._graph_execs.get(v)
        if g is None:
            raise RuntimeError(f"capture() the graph (variant {v!r}) before replay()")
        self.backend.replay(g, stream)

    # ---------------------------------------------------------- buffers I/O
    def read(self, b: Buffer) -> np.ndarray:
        """Copy a buffer to the host (activations read from the arena)."""
        if b.kind == "activation":
            raw = self.backend.to_numpy(self.arena)[b.offset:b.offset + b.nbytes]
        else:
            raw = self.backend.to_numpy(self.arrays[id(b)]).view(np.uint8).reshape(-1)[:b.nbytes]
        return raw.view(b.dtype).reshape(b.shape).copy()

    def write(self, b: Buffer, value: np.ndarray, stream=None):
        """Overwrite a state buffer from the host (ordered on ``stream`` when
        given: work queued there before still sees the old value)."""
        if b.kind != "state":
            raise ValueError(f"only state buffers are written from the host, not {b.name!r}")
        data = np.ascontiguousarray(value, dtype=b.dtype).reshape(-1).view(np.uint8)
        if data.nbytes != b.nbytes:
            raise ValueError(f"{b.name}: {data.nbytes} bytes given, buffer holds {b.nbytes}")
        self.backend.copy_from_host(self.arrays[id(b)], data, stream=stream)
