"""The NCCL communicator of one tensor-parallel rank, through NVIDIA's
Python bindings (``nccl4py``, imported as ``nccl.core``): one process per
GPU, the collectives issued on the rank's stream (inside a CUDA graph
capture they become graph nodes).

NVLink SHARP (NVLS, multicast objects) stays off: :func:`communicator`
sets ``NCCL_NVLS_ENABLE=0`` before NCCL starts, and nothing here creates a
multicast object (on the lent machines multicast can take the host's
shared GPUs out of service).

Start-up: rank 0 makes an id (:func:`unique_id`), the launcher hands its
bytes to every rank, and each rank calls :func:`communicator` with its
rank, the world size and the id, with its own GPU's context current.
"""

from __future__ import annotations

import os

import numpy as np

from .collective import Communicator, DeviceSpan

__all__ = ["NcclCommunicator", "communicator", "unique_id", "nccl_available"]


def _nccl():
    try:
        import nccl.core as nc
    except ImportError as e:
        raise RuntimeError("tensor parallelism over GPUs needs NVIDIA's NCCL bindings: "
                           f"pip install nccl4py (import nccl.core failed: {e})") from None
    return nc


def nccl_available() -> bool:
    """Whether ``nccl4py`` imports."""
    try:
        _nccl()
    except RuntimeError:
        return False
    return True


def unique_id() -> bytes:
    """A new NCCL id for a group (rank 0 makes it, every rank is given it)."""
    os.environ["NCCL_NVLS_ENABLE"] = "0"
    return bytes(_nccl().get_unique_id())


def communicator(rank: int, world: int, uid: bytes) -> "NcclCommunicator":
    """Rank ``rank`` of the ``world`` ranks that share ``uid`` (every rank
    calls this at start-up; it returns once all have)."""
    os.environ["NCCL_NVLS_ENABLE"] = "0"
    nc = _nccl()
    comm = nc.Communicator.init(int(world), int(rank), nc.UniqueId.from_bytes(uid))
    return NcclCommunicator(comm, rank, world)


class _DeviceArray:
    """A span as the bindings take a buffer (``__cuda_array_interface__``)."""

    def __init__(self, span: DeviceSpan):
        self.__cuda_array_interface__ = dict(shape=(span.count,),
                                             typestr=np.dtype(span.dtype).str,
                                             data=(int(span.ptr), False), strides=None,
                                             version=3)


def _stream(stream) -> int:
    return 0 if stream is None else int(getattr(stream, "ptr", stream))


class NcclCommunicator(Communicator):
    """A rank's NCCL communicator (:class:`~.collective.Communicator`)."""

    def __init__(self, comm, rank: int, world: int):
        self.comm = comm
        self.rank = int(rank)
        self.world = int(world)

    def all_reduce_sum(self, buf: DeviceSpan, stream=None) -> None:
        a = _DeviceArray(buf)
        self.comm.allreduce(a, a, _nccl().SUM, stream=_stream(stream))

    def all_gather(self, src: DeviceSpan, dst: DeviceSpan, stream=None) -> None:
        if dst.count != self.world * src.count:
            raise ValueError(f"all_gather: {dst.count} elements to receive {self.world} "
                             f"ranks' {src.count}")
        self.comm.allgather(_DeviceArray(src), _DeviceArray(dst), stream=_stream(stream))

    def destroy(self) -> None:
        """Free the communicator (every rank calls it)."""
        self.comm.destroy()
