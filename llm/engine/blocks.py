"""The paged KV cache's bookkeeping: a pool of ``num_blocks`` blocks of
``block_size`` token slots, a free-block allocator, reference counts, and
the prefix cache.

A sequence holds a block table (its blocks, in order; its token at
position ``p`` lies in slot ``p % block_size`` of block
``table[p // block_size]``).  The device holds the K/V rows; this module
only decides which block is whose.

Prefix caching (vLLM's automatic prefix caching): once a block is full, its
contents are named by a hash that chains the previous block's hash and the
block's token ids (:func:`block_hash`), so equal hashes mean equal tokens at
equal positions from the start of the sequence, hence equal K/V.  A full
block is registered under its hash; a new sequence whose first blocks hash
the same takes those blocks by reference (:meth:`BlockManager.lookup`,
:meth:`BlockManager.take`) instead of computing them.  A freed block keeps
its contents and registration while nobody references it, until the pool
needs it back: allocation takes never-registered blocks first, then evicts
registered unreferenced ones, least recently freed first.  Freeing a table
goes from its last block to its first, so a sequence's tail is evicted
before its head (a chain is only found from its start).

Sizing the pool: :func:`kv_pool_blocks` from the free device memory.
"""

from __future__ import annotations

import array
import collections
import hashlib

__all__ = ["BlockManager", "NoFreeBlocks", "block_hash", "chain_hashes", "kv_bytes_per_token",
           "kv_pool_blocks", "DEFAULT_BLOCK_SIZE"]

#: tokens per KV block unless the runner is told otherwise (the paged
#: attention kernel takes multiples of 16)
DEFAULT_BLOCK_SIZE = 16


class NoFreeBlocks(RuntimeError):
    """An allocation asked for more blocks than the pool has available."""


def kv_bytes_per_token(n_layers: int, n_kv_heads: int, head_dim: int,
                       dtype_bytes: int = 2) -> int:
    """Bytes of K and V for one token over every layer:
    ``n_layers * 2 * n_kv_heads * head_dim * dtype_bytes`` (f16: 2 bytes)."""
    for name, v in (("n_layers", n_layers), ("n_kv_heads", n_kv_heads), ("head_dim", head_dim),
                    ("dtype_bytes", dtype_bytes)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    return n_layers * 2 * n_kv_heads * head_dim * dtype_bytes


def kv_pool_blocks(free_bytes: int, utilization: float, bytes_per_token: int,
                   block_size: int) -> int:
    """How many KV blocks fit in ``utilization`` of ``free_bytes``.

    Parameters
    ----------
    free_bytes : int
        Device memory free once the weights and the step's buffers are in
        place.
    utilization : float
        The fraction of it the pool may take, in (0, 1].
    bytes_per_token : int
        :func:`kv_bytes_per_token`.
    block_size : int
        Tokens per block.

    Returns
    -------
    int
        ``floor(free_bytes * utilization / (bytes_per_token * block_size))``
        (0 when nothing fits).
    """
    if isinstance(free_bytes, bool) or not isinstance(free_bytes, int) or free_bytes < 0:
        raise ValueError(f"free_bytes must be a non-negative int, got {free_bytes!r}")
    if not isinstance(utilization, (int, float)) or not 0.0 < utilization <= 1.0:
        raise ValueError(f"utilization must be in (0, 1], got {utilization!r}")
    for name, v in (("bytes_per_token", bytes_per_token), ("block_size", block_size)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    return int(free_bytes * utilization) // (bytes_per_token * block_size)


def block_hash(parent: bytes | None, tokens) -> bytes:
    """The name of a full block's contents: a 128-bit BLAKE2b digest of the
    previous block's hash (None for the first block) and the block's token
    ids."""
    h = hashlib.blake2b(digest_size=16)
    if parent is not None:
        h.update(parent)
    h.update(array.array("q", tokens).tobytes())
    return h.digest()


def chain_hashes(hashes: list, tokens, block_size: int, n_tokens: int) -> list:
    """Extend ``hashes`` (those of the first blocks of ``tokens``) with the
    hashes of every block that ``tokens[:n_tokens]`` fills; returns it."""
    for i in range(len(hashes), n_tokens // block_size):
        hashes.append(block_hash(hashes[-1] if hashes else None,
                                 tokens[i * block_size:(i + 1) * block_size]))
    return hashes


class BlockManager:
    """The pool's blocks: who references each, which are free, which are cached.

    Parameters
    ----------
    num_blocks : int
        Blocks in the pool (block ids are ``0 .. num_blocks - 1``).
    block_size : int
        Tokens per block.
    prefix_caching : bool
        Register full blocks by hash and hand them out again (default on).

    Every block is in exactly one state: referenced (count > 0), free
    (unreferenced, unregistered), or cached (unreferenced, registered:
    found by :meth:`lookup`, evicted by :meth:`allocate` when the free
    list is empty).
    """

    def __init__(self, num_blocks: int, block_size: int, *, prefix_caching: bool = True):
        for name, v in (("num_blocks", num_blocks), ("block_size", block_size)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_caching = bool(prefix_caching)
        self._refs = [0] * num_blocks
        self._hash: list = [None] * num_blocks
        self._free = collections.deque(range(num_blocks))
        self._lru: collections.OrderedDict = collections.OrderedDict()   # oldest first
        self._by_hash: dict = {}
        #: registered blocks reused for their contents (by :meth:`take`) and evicted
        self.hits = 0
        self.evictions = 0

    # ------------------------------------------------------------ counts
    @property
    def num_free(self) -> int:
        """Blocks an allocation can take: free ones and cached unreferenced ones."""
        return len(self._free) + len(self._lru)

    @property
    def num_used(self) -> int:
        """Blocks referenced by at least one table."""
        return self.num_blocks - self.num_free

    @property
    def num_cached(self) -> int:
        """Registered blocks (referenced or not)."""
        return len(self._by_hash)

    def ref_count(self, block: int) -> int:
        return self._refs[block]

    # ------------------------------------------------------------ prefix cache
    def lookup(self, hashes) -> list:
        """The registered blocks of the longest run of ``hashes`` from its
        start (not yet referenced: :meth:`take` them)."""
        out = []
        if not self.prefix_caching:
            return out
        for h in hashes:
            b = self._by_hash.get(h)
            if b is None:
                break
            out.append(b)
        return out

    def cost_of_taking(self, blocks) -> int:
        """How many of ``blocks`` are unreferenced (taking them lowers
        :attr:`num_free`)."""
        return sum(1 for b in blocks if self._refs[b] == 0)

    def take(self, blocks) -> None:
        """Reference registered ``blocks`` (from :meth:`lookup`) once more each."""
        for b in blocks:
            if self._hash[b] is None:
                raise ValueError(f"block {b} holds no registered contents to share")
            if self._refs[b] == 0:
                del self._lru[b]
            self._refs[b] += 1
            self.hits += 1

    def register(self, block: int, h: bytes) -> bool:
        """Name the contents of ``block``, now full, by ``h`` (from
        :func:`block_hash`).  Returns False, leaving it unregistered, when
        prefix caching is off or another block already holds ``h``."""
        if self._refs[block] < 1:
            raise ValueError(f"block {block} is not referenced: only a table's block is registered")
        if self._hash[block] is not None:
            return self._hash[block] == h
        if not self.prefix_caching or h in self._by_hash:
            return False
        self._hash[block] = h
        self._by_hash[h] = block
        return True

    # ------------------------------------------------------------ allocation
    def allocate(self, n: int) -> list:
        """``n`` blocks, each referenced once; free blocks first, then the
        least recently freed cached ones (evicted).

        Raises
        ------
        NoFreeBlocks
            Fewer than ``n`` are available (nothing is taken then).
        """
        if n > self.num_free:
            raise NoFreeBlocks(f"{n} blocks asked for, {self.num_free} of {self.num_blocks} "
                               "available")
        out = []
        for _ in range(n):
            if self._free:
                b = self._free.popleft()
            else:
                b, _ = self._lru.popitem(last=False)
                del self._by_hash[self._hash[b]]
                self._hash[b] = None
                self.evictions += 1
            self._refs[b] = 1
            out.append(b)
        return out

    def free(self, blocks) -> None:
        """Drop one reference to each of ``blocks`` (a table, in order),
        last block first; an unreferenced block becomes free, or cached when
        it is registered."""
        for b in reversed(blocks):
            if self._refs[b] < 1:
                raise ValueError(f"block {b} is freed more often than it was referenced")
            self._refs[b] -= 1
            if self._refs[b] == 0:
                if self._hash[b] is None:
                    self._free.append(b)
                else:
                    self._lru[b] = None

    # ------------------------------------------------------------ checks
    def check(self, tables=None) -> None:
        """Assert the bookkeeping is consistent; with ``tables`` (every
        live block table), also that each block's count is the number of
        times the tables hold it.

        Raises
        ------
        AssertionError
            Naming the first inconsistency found.
        """
        free, lru = set(self._free), set(self._lru)
        assert len(free) == len(self._free), "a block is twice in the free list"
        assert not free & lru, f"blocks {sorted(free & lru)[:5]} are both free and cached"
        for b in range(self.num_blocks):
            r, h = self._refs[b], self._hash[b]
            assert r >= 0, f"block {b} has reference count {r}"
            if r == 0:
                assert (b in free) != (b in lru), \
                    f"unreferenced block {b} is neither free nor cached"
                assert (b in lru) == (h is not None), f"block {b}: cached iff registered"
            else:
                assert b not in free and b not in lru, f"referenced block {b} is listed as free"
            if h is not None:
                assert self._by_hash.get(h) == b, f"block {b}'s hash maps elsewhere"
        assert len(self._by_hash) == sum(h is not None for h in self._hash), \
            "the hash map names blocks that are not registered"
        if tables is not None:
            counts = collections.Counter(b for t in tables for b in t)
            for b in range(self.num_blocks):
                assert counts.get(b, 0) == self._refs[b], \
                    f"block {b} is in {counts.get(b, 0)} tables but counted {self._refs[b]} times"
