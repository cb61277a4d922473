"""The batched engine: many requests at once on one model (issue 54).

* :mod:`.blocks`: the paged KV cache's block manager (reference counts,
  prefix caching by chained block hashes, LRU eviction) and the pool's size.
* :mod:`.scheduler`: continuous batching (admission, chunked prefill beside
  decode steps, preemption by recompute, finishing).
* :mod:`.engine`: :class:`Engine`, the public API (an offline ``generate``
  and a thread-safe asynchronous interface), with :mod:`.stream` (a
  request's handle and text) and :mod:`.requests` (the request and output
  types).
* :mod:`.rows`: the runner's interface (``DecodeRow``, ``PrefillChunk``,
  ``RowOutput``); ``runner.py`` is the device side.

Nothing here imports the device side until :meth:`Engine.from_gguf` loads a model.
"""

from .blocks import BlockManager, NoFreeBlocks, kv_bytes_per_token, kv_pool_blocks
from .engine import Engine
from .requests import (EngineOverloaded, EngineStats, RequestEvent, RequestOutput,
                       RequestSettings)
from .rows import DecodeRow, PrefillChunk, RowOutput
from .scheduler import Scheduler, Sequence
from .stream import Request

__all__ = ["Engine", "Request", "RequestSettings", "RequestEvent", "RequestOutput",
           "EngineStats", "EngineOverloaded", "Scheduler", "Sequence", "BlockManager",
           "NoFreeBlocks", "kv_bytes_per_token", "kv_pool_blocks", "DecodeRow", "PrefillChunk",
           "RowOutput"]
