"""Kernel launches.

``launch(function, grid, block, *args, shared=0, stream=None)`` checks the
geometry against the kernel's own limits and packs ``args`` by the kernel's
declared parameter types before calling ``cuLaunchKernel``; anything wrong is
refused with :class:`LaunchConfigError` or
:class:`ptxgen.abi.LaunchArgumentError` and the driver is never called.

That is the positional form, arguments in declaration order.  Ops, the
graph executor and the model give arguments by parameter name with a
family's :class:`~ptxgen.kernels.plan.LaunchGeometry` instead (a backend's
``launch``, :mod:`.backend`); :func:`named_args` puts them in order.
"""

from __future__ import annotations

from threading import get_ident

from ptxgen.abi import LaunchArgumentError

from .errors import CUDAError, LaunchConfigError, cuda, error_from_result
from .stream import Stream, stream_handle

__all__ = ["launch", "named_args", "normalize_dims"]

_driver = None


def _d():
    global _driver
    if _driver is None:
        _driver = cuda()
    return _driver


def normalize_dims(dims, what: str) -> tuple[int, int, int]:
    """``int`` or a 1-3 tuple of positive ints -> ``(x, y, z)``.

    Raises
    ------
    LaunchConfigError
        A non-integer or non-positive extent, or more than three.
    """
    if isinstance(dims, int) and not isinstance(dims, bool):
        dims = (dims,)
    try:
        dims = tuple(dims)
    except TypeError:
        raise LaunchConfigError(f"{what} must be an int or a tuple of 1-3 ints, got {dims!r}") from None
    if not 1 <= len(dims) <= 3:
        raise LaunchConfigError(f"{what} must have 1 to 3 dimensions, got {dims!r}")
    out = []
    for v in dims:
        if isinstance(v, bool) or not hasattr(v, "__index__"):
            raise LaunchConfigError(f"{what} extents must be ints, got {dims!r}")
        v = int(v)
        if v < 1:
            raise LaunchConfigError(f"{what} extents must be positive, got {dims!r}")
        out.append(v)
    while len(out) < 3:
        out.append(1)
    return out[0], out[1], out[2]


def named_args(function, geometry, args) -> tuple:
    """The arguments of ``function`` launched with ``geometry`` (a
    :class:`~ptxgen.kernels.plan.LaunchGeometry`) in declaration order:
    ``args`` (a mapping of parameter name to value) and those the geometry
    decides.

    Raises
    ------
    LaunchConfigError
        ``geometry`` is another kernel's.
    ptxgen.abi.LaunchArgumentError
        A parameter without an argument, a name that is no parameter, or
        an argument the geometry decides given again.
    """
    if geometry.kernel != function.name:
        raise LaunchConfigError(f"{function.name}: launched with the geometry of kernel "
                                f"{geometry.kernel!r}")
    if geometry.args:
        given = [n for n in geometry.args if n in args]
        if given:
            raise LaunchArgumentError(
                f"{function.name}(): {', '.join(map(repr, given))} "
                f"{'is' if len(given) == 1 else 'are'} decided by the launch geometry "
                f"({', '.join(f'{n}={geometry.args[n]}' for n in given)}); do not pass "
                f"{'it' if len(given) == 1 else 'them'}")
        args = {**args, **geometry.args}
    return function.packer.order(args)


def check_geometry(function, g, b, shared) -> None:
    dev = function.module.device
    nthreads = b[0] * b[1] * b[2]
    if nthreads > function.max_threads_per_block:
        raise LaunchConfigError(
            f"{function.name}: block {b} has {nthreads} threads but this kernel allows at most "
            f"{function.max_threads_per_block} per block ({function.num_regs} registers per thread)"
        )
    for axis, v, lim in zip("xyz", b, dev.max_block_dims):
        if v > lim:
            raise LaunchConfigError(f"{function.name}: block.{axis} = {v} exceeds the device limit {lim}")
    for axis, v, lim in zip("xyz", g, dev.max_grid_dims):
        if v > lim:
            raise LaunchConfigError(f"{function.name}: grid.{axis} = {v} exceeds the device limit {lim}")
    if function.cluster is not None and any(v % c for v, c in zip(g, function.cluster)):
        raise LaunchConfigError(f"{function.name}: grid {tuple(g)} is not a whole number of "
                                f"clusters of {function.cluster} (.reqnctapercluster)")
    if isinstance(shared, bool) or not isinstance(shared, int) or shared < 0:
        raise LaunchConfigError(f"{function.name}: shared must be a non-negative int of bytes, got {shared!r}")
    if shared > function.max_dynamic_shared:
        optin = dev.shared_per_block_optin - function.shared_size_bytes
        hint = (f"; call {function.name}.set_max_dynamic_shared({shared}) first"
                if shared <= optin else f"; the device allows at most {optin} for this kernel")
        raise LaunchConfigError(
            f"{function.name}: requests {shared} bytes of dynamic shared memory but the kernel "
            f"allows {function.max_dynamic_shared}{hint}"
        )


def launch(function, grid, block, *args, shared: int = 0, stream=None, pdl: bool = False) -> None:
    """Launch ``function`` on a ``grid`` of ``block``-sized thread blocks.

    Parameters
    ----------
    function : Function
        From ``Module.function(name)``.
    grid, block : int or tuple of 1-3 ints
        Blocks per grid and threads per block.
    *args
        One per declared kernel parameter: ints/floats for scalars; for pointers
        an int address, a ``DeviceArray``, or any object with
        ``__cuda_array_interface__`` (torch, cupy) or an integer ``.ptr``.
    shared : int
        Dynamic shared memory in bytes.
    stream : Stream, optional
        Defaults to the legacy default stream.
    pdl : bool
        Programmatic dependent launch (sm_90+): the kernel may start while
        the previous kernel in the stream is still running, and orders
        itself with ``griddepcontrol.wait``.  Only kernels whose code
        executes that instruction (specs built with ``pdl=True``) are
        accepted; a CUDA graph captured from such launches keeps the
        programmatic edges.

    Raises
    ------
    ptxgen.abi.LaunchArgumentError
        Wrong argument count, kind, or range, or a freed array.
    LaunchConfigError
        Non-positive or oversized grid/block, too many threads for the kernel,
        more dynamic shared memory than the kernel allows, a grid that is
        not a whole number of the kernel's clusters, or ``pdl=True`` for a
        kernel that never waits for its predecessors.
    CUDAError
        The driver refused the launch.
    """
    # fast path: plain ints within the kernel's limits; anything else goes through the checks
    if (type(grid) is int and 0 < grid < 2147483648 and function.cluster is None
            and type(block) is int and 0 < block <= function.max_threads_per_block
            and (shared == 0 or (type(shared) is int and 0 < shared <= function.max_dynamic_shared))):
        gx, gy, gz = grid, 1, 1
        bx, by, bz = block, 1, 1
    else:
        gx, gy, gz = normalize_dims(grid, f"{function.name}: grid")
        bx, by, bz = normalize_dims(block, f"{function.name}: block")
        check_geometry(function, (gx, gy, gz), (bx, by, bz), shared)
    handle = function.handle
    if handle is None:
        raise CUDAError(f"{function.name}: its module was unloaded")
    if stream is None:
        hs = 0
    elif type(stream) is Stream:
        hs = stream.handle
    else:
        hs = stream_handle(stream)
    if pdl and not function.waits_for_grids:
        raise LaunchConfigError(
            f"{function.name}: pdl=True, but the kernel never executes griddepcontrol.wait, so "
            f"it could read its inputs before the previous kernel has written them; build it "
            f"with pdl=True (sm_90 or newer) or launch it without pdl")
    packer = function.packer
    if packer._n:
        if get_ident() == function._owner:
            buf, kp = function._buf, function._kp
        else:
            buf, _ptrs, kp = function.param_buffer()   # _ptrs: alive until the call returns
        packer._pack_into(buf, args)  # checks every argument, then packs
    else:
        if args:
            packer.values(args)  # raises the count error
        kp = 0
    d = _driver or _d()
    if pdl:
        cfg = function.pdl_config()
        cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = gx, gy, gz
        cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = bx, by, bz
        cfg.sharedMemBytes = shared
        cfg.hStream = hs
        err = d.cuLaunchKernelEx(cfg, handle, kp, 0)[0]
        if err:
            _retry_or_raise(function, err, "cuLaunchKernelEx", (cfg, handle, kp, 0))
        return
    err = d.cuLaunchKernel(handle, gx, gy, gz, bx, by, bz, shared, hs, kp, 0)[0]
    if err:
        _retry_or_raise(function, err, "cuLaunchKernel",
                        (handle, gx, gy, gz, bx, by, bz, shared, hs, kp, 0))


def _retry_or_raise(function, err, call: str, call_args) -> None:
    """Retry once when the thread had no current context; otherwise raise.

    (Kept out of ``launch`` as a plain function: a closure there would turn every
    local of the hot path into a cell variable.)
    """
    d = _d()
    if err == d.CUresult.CUDA_ERROR_INVALID_CONTEXT:
        function.module.device.activate(force=True)
        err = getattr(d, call)(*call_args)[0]
        if not err:
            return
    raise error_from_result(err, f"{call}({function.name})")
