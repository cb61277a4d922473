"""CUDA graphs: capture a stream region, instantiate, replay, update kernel arguments.

::

    with capture(stream) as graph:          # cuStreamBeginCapture ... cuStreamEndCapture
        launch(f, grid, block, x, y, n, stream=stream)
    exe = graph.instantiate()               # cuGraphInstantiate
    exe.launch(stream)                      # cuGraphLaunch (replay)
    exe.set_kernel_args(graph.kernel_nodes[0], x2, y2, n)   # cuGraphExecKernelNodeSetParams

If anything fails inside the ``with`` block (a driver error, a forbidden
synchronous call, a Python exception) the capture is ended, the partial graph
destroyed, and :class:`GraphCaptureError` raised from the original error, so
the stream and context stay usable. Its message leads with the first driver
call that failed while the capture was open, from any thread, when that is
not the error that ended the block: an invalidated capture is noticed by the
next call into it, not by the call that broke it.

While the capture is open, resources released by this layer (memory freed,
modules unloaded, graphs destroyed: by the collector, another thread or
user code) are held back and released when it ends (see
:mod:`ptxgen.driver.release`, which also says what it cannot see).
"""

from __future__ import annotations

import ctypes
import weakref

from .device import call_in_context, get_device
from .errors import CUDAError, GraphCaptureError, check, cuda, error_from_result
from .launch import normalize_dims
from .module import function_for_handle
from .release import close_capture, open_capture, release
from .stream import Stream, stream_handle

__all__ = ["Graph", "GraphExec", "KernelNode", "capture"]

_MODES = {"global": "GLOBAL", "thread_local": "THREAD_LOCAL", "relaxed": "RELAXED"}


def _destroy_graph(device, handle) -> None:
    release(f"cuGraphDestroy({handle})", call_in_context, device.context, "cuGraphDestroy", handle)


def _function_by_name(func_handle):
    """Fallback when the node's CUfunction is not one we handed out: match a unique live
    Function by the kernel's name (``cuFuncGetName``)."""
    from .module import functions_by_handle

    try:
        name = check(cuda().cuFuncGetName(func_handle), "cuFuncGetName")
    except Exception:
        return None
    name = name.decode() if isinstance(name, bytes) else str(name)
    matches = [f for f in list(functions_by_handle.values()) if f.name == name]
    return matches[0] if len(matches) == 1 else None


class KernelNode:
    """A kernel launch inside a captured graph.

    Attributes
    ----------
    handle : CUgraphNode
    function : Function or None
        Our :class:`Function` for the node's kernel (None for foreign kernels).
    grid, block : tuple[int, int, int]
    shared : int
    """

    __slots__ = ("handle", "function", "func_handle", "grid", "block", "shared")

    def __init__(self, handle, params):
        self.handle = handle
        self.func_handle = params.func
        self.function = function_for_handle(params.func) or _function_by_name(params.func)
        self.grid = (int(params.gridDimX), int(params.gridDimY), int(params.gridDimZ))
        self.block = (int(params.blockDimX), int(params.blockDimY), int(params.blockDimZ))
        self.shared = int(params.sharedMemBytes)

    def __repr__(self) -> str:
        name = self.function.name if self.function is not None else "?"
        return f"<KernelNode {name} grid={self.grid} block={self.block} shared={self.shared}>"


class Graph:
    """A captured CUDA graph (filled in when its :class:`capture` block ends).

    Attributes
    ----------
    handle : CUgraph or None
    kernel_nodes : list[KernelNode]
        Kernel nodes in the driver's node order (the order they were captured).
    """

    __slots__ = ("handle", "device", "kernel_nodes", "num_nodes", "_finalizer", "__weakref__")

    def __init__(self, device):
        self.handle = None
        self.device = device
        self.kernel_nodes: list[KernelNode] = []
        self.num_nodes = 0
        self._finalizer = None

    def _adopt(self, handle) -> None:
        d = cuda()
        self.handle = handle
        self._finalizer = weakref.finalize(self, _destroy_graph, self.device, handle)
        n = check(d.cuGraphGetNodes(handle, 0), "cuGraphGetNodes")[1]
        nodes = check(d.cuGraphGetNodes(handle, n), "cuGraphGetNodes")[0] if n else []
        self.num_nodes = int(n)
        K = d.CUgraphNodeType.CU_GRAPH_NODE_TYPE_KERNEL
        for node in nodes:
            if check(d.cuGraphNodeGetType(node), "cuGraphNodeGetType") == K:
                params = check(d.cuGraphKernelNodeGetParams(node), "cuGraphKernelNodeGetParams")
                self.kernel_nodes.append(KernelNode(node, params))

    def instantiate(self) -> "GraphExec":
        """Instantiate an executable graph (``cuGraphInstantiate``)."""
        if self.handle is None:
            raise CUDAError("graph is empty: use it after its capture block has ended")
        self.device.activate()
        h = check(cuda().cuGraphInstantiate(self.handle, 0), "cuGraphInstantiate")
        return GraphExec(self, h)

    def nodes_for(self, function) -> list[KernelNode]:
        """Kernel nodes that launch ``function``, in capture order."""
        return [n for n in self.kernel_nodes if n.function is function]

    def __repr__(self) -> str:
        return f"<Graph {self.num_nodes} nodes, {len(self.kernel_nodes)} kernels>"


class GraphExec:
    """An instantiated graph: replay it with :meth:`launch`."""

    __slots__ = ("handle", "graph", "_finalizer", "__weakref__")

    def __init__(self, graph: Graph, handle):
        self.graph = graph
        self.handle = handle
        self._finalizer = weakref.finalize(self, release, f"cuGraphExecDestroy({handle})", call_in_context,
                                           graph.device.context, "cuGraphExecDestroy", handle)

    def launch(self, stream) -> None:
        """Replay the graph on ``stream`` (``cuGraphLaunch``)."""
        err = cuda().cuGraphLaunch(self.handle, stream_handle(stream))[0]
        if err:
            check((err,), "cuGraphLaunch")

    replay = launch

    def upload(self, stream) -> None:
        """Upload the graph's work ahead of the first launch (``cuGraphUpload``)."""
        check(cuda().cuGraphUpload(self.handle, stream_handle(stream)), "cuGraphUpload")

    def set_kernel_args(self, node, *args, grid=None, block=None, shared=None) -> None:
        """Change one kernel node's arguments (and optionally geometry) in place.

        Parameters
        ----------
        node : KernelNode or int
            A node of ``graph.kernel_nodes`` or its index there.
        *args
            New arguments, checked against the kernel's declared parameters.
        grid, block, shared : optional
            New geometry; defaults to the captured one.

        Raises
        ------
        ptxgen.abi.LaunchArgumentError
            Arguments that do not fit the kernel (the graph is left unchanged).
        CUDAError
            The driver refused the update.
        """
        if isinstance(node, int):
            node = self.graph.kernel_nodes[node]
        f = node.function
        if f is None:
            raise CUDAError("this kernel node was not launched through ptxgen: its parameters are unknown")
        from .launch import check_geometry

        g = normalize_dims(grid, "grid") if grid is not None else node.grid
        b = normalize_dims(block, "block") if block is not None else node.block
        sh = node.shared if shared is None else shared
        check_geometry(f, g, b, sh)
        blob = f.packer.pack(args)
        d = cuda()
        buf = ctypes.create_string_buffer(blob, max(len(blob), 8))
        base = ctypes.addressof(buf)
        n = len(f.params)
        ptrs = (ctypes.c_void_p * max(n, 1))(*[base + off for off in f.packer.offsets])
        # start from the node's own recorded parameters so the function,
        # kernel and context handles are the ones the driver captured
        p = check(d.cuGraphKernelNodeGetParams(node.handle), "cuGraphKernelNodeGetParams")
        p.gridDimX, p.gridDimY, p.gridDimZ = g
        p.blockDimX, p.blockDimY, p.blockDimZ = b
        p.sharedMemBytes = sh
        p.kernelParams = ctypes.addressof(ptrs) if n else 0
        check(d.cuGraphExecKernelNodeSetParams(self.handle, node.handle, p), "cuGraphExecKernelNodeSetParams")
        node.grid, node.block, node.shared = g, b, sh


class capture:
    """Context manager capturing the work queued on ``stream`` into a :class:`Graph`.

    Parameters
    ----------
    stream : Stream
        A created stream (the legacy default stream cannot be captured).
    mode : {"global", "thread_local", "relaxed"}
        ``cuStreamBeginCapture`` mode; "global" (the default) makes unsafe
        calls from any thread (e.g. a synchronous copy) fail the capture.
        Releases of this layer's resources are held while any capture is
        open, whatever its mode (:mod:`ptxgen.driver.release`).

    Yields
    ------
    Graph
        Empty inside the block, filled when it ends.
    """

    __slots__ = ("stream", "mode", "graph", "_h", "_watch")

    def __init__(self, stream, mode: str = "global"):
        if stream is None or int(stream_handle(stream)) in (0, 1, 2):
            raise ValueError("capture needs a created Stream, not the default stream")
        if mode not in _MODES:
            raise ValueError(f"mode must be one of {sorted(_MODES)}, got {mode!r}")
        self.stream = stream
        self.mode = mode
        self.graph = None
        self._h = None
        self._watch = None

    def __enter__(self) -> Graph:
        if self._watch is not None:
            raise RuntimeError("this capture is already open; make a new capture(stream) to nest")
        dev = self.stream.device if isinstance(self.stream, Stream) else get_device()
        dev.activate()
        d = cuda()
        self._h = stream_handle(self.stream)
        mode = getattr(d.CUstreamCaptureMode, "CU_STREAM_CAPTURE_MODE_" + _MODES[self.mode])
        self.graph = Graph(dev)
        self._watch = open_capture()  # before the driver's capture opens: releases are held from here
        try:
            check(d.cuStreamBeginCapture(self._h, mode), "cuStreamBeginCapture")
        except BaseException:
            self._close()
            raise
        return self.graph

    def _end(self):
        """End the capture; returns ``(CUresult, CUgraph or None)``."""
        d = cuda()
        ret = d.cuStreamEndCapture(self._h)
        graph = ret[1] if len(ret) > 1 else None
        if graph is not None and int(graph) == 0:
            graph = None
        return ret[0], graph

    def _close(self):
        """Count the capture as ended (the held releases are made here); its watch."""
        watch, self._watch = self._watch, None
        close_capture(watch)
        return watch

    def __exit__(self, exc_type, exc, tb):
        try:
            err, handle = self._end()
        finally:
            watch = self._close()
        dev = self.graph.device
        held = watch.held_note()
        if exc is not None:
            if handle is not None:
                _destroy_graph(dev, handle)
            noticed = f"{exc_type.__name__}: {exc}"
            cause = watch.cause(str(exc))
            parts = [f"stream capture failed: {cause}; then {noticed}" if cause
                     else f"stream capture failed: {noticed}"]
            if held:
                parts.append(held)
            parts.append("the capture was ended and the partial graph discarded "
                         "(the stream and context remain usable)")
            codes = (exc.code, exc.name, exc.text) if isinstance(exc, CUDAError) else ()
            raise GraphCaptureError("; ".join(parts), *codes, first_failure=watch.first_message) from exc
        if err:
            if handle is not None:
                _destroy_graph(dev, handle)
            cause = watch.cause()
            e = error_from_result(err, "cuStreamEndCapture")
            if cause:
                parts = [f"stream capture failed: {cause}; then {e}"]
            else:
                parts = [f"stream capture failed: {e}; the capture was invalidated (often by a "
                         "synchronous call or a use of the legacy default stream while capturing)"]
            if held:
                parts.append(held)
            parts.append("it has been discarded")
            raise GraphCaptureError("; ".join(parts), e.code, e.name, e.text,
                                    first_failure=watch.first_message)
        self.graph._adopt(handle)
        return False
