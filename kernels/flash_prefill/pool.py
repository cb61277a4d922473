"""Key rows of the paged mode (``FlashPrefillSpec.paged``): where a key of
the chunk's sequence sits in the pools, through its block-table row."""

from __future__ import annotations

from ptxgen.types import u32

__all__ = ["PoolRows"]


class PoolRows:
    """Rows of KV head ``h`` in pools ``[num_blocks, n_kv_heads, bs,
    head_dim]`` seen as ``num_blocks * n_kv_heads * bs`` rows of
    ``head_dim`` (the tensor maps' view): key ``p`` of the sequence is row
    ``(entry * n_kv_heads + h) * bs + p % bs`` with ``entry =
    table[p // bs]``, clamped to ``num_blocks - 1`` (a bad entry reads
    inside the pool, as the paged decode kernel does)."""

    def __init__(self, k, bs: int, table, max_blocks, num_blocks, h, n_kv):
        self.k, self.bs, self.lg = k, bs, bs.bit_length() - 1
        self.table, self.max_blocks = table, max_blocks
        self.last_block = num_blocks - 1
        self.block_rows = n_kv * bs              # rows of one pool block (every head)
        self.head_row = h * bs                   # head h's first row inside a block

    def load(self, index, clamp: bool = False, volatile: bool = False):
        """The table's entry at ``index`` as read (u32; with ``clamp`` the
        index first limited to the table's last, for reads ahead of the keys
        a block walks).  :meth:`block` makes it a pool block; kept apart so
        that a read ahead is not waited for until its use.  ``volatile``
        keeps the load where it is written: ptxas moves a plain load that is
        used only past a branch (the kernel's early exit) below it."""
        k = self.k
        if clamp:
            index = k.min(index, self.max_blocks - 1)
        return k.ld(self.table[index], u32, volatile=volatile)

    def block(self, entry):
        """The pool block of a table entry (clamped into the pool)."""
        return self.k.min(entry, self.last_block)

    def entry(self, index):
        """The pool block at table index ``index``."""
        return self.block(self.load(index))

    def block_row(self, block):
        """Row of head ``h``'s first key in pool block ``block``."""
        return block * self.block_rows + self.head_row

    def row(self, key):
        """Row of key ``key`` (one table load)."""
        return self.block_row(self.entry(key >> self.lg)) + (key & (self.bs - 1))

    def offset(self, key):
        """``key``'s offset inside its block."""
        return key & (self.bs - 1)
