"""The block manager: allocation, reference counts, prefix hashing, LRU
eviction, and the pool's size from free memory."""

import pytest

from ptxgen.llm.engine.blocks import (BlockManager, NoFreeBlocks, block_hash, chain_hashes,
                                      kv_bytes_per_token, kv_pool_blocks)


def test_allocate_and_free_restore_the_pool(rng):
    m = BlockManager(10, 4)
    a = m.allocate(3)
    b = m.allocate(7)
    assert sorted(a + b) == list(range(10))
    assert m.num_free == 0 and m.num_used == 10
    with pytest.raises(NoFreeBlocks, match="1 blocks asked for, 0 of 10 available"):
        m.allocate(1)
    m.check([a, b])
    m.free(b)
    m.free(a)
    assert m.num_free == 10 and m.num_used == 0
    m.check([])


def test_a_failed_allocation_takes_nothing():
    m = BlockManager(4, 2)
    m.allocate(3)
    with pytest.raises(NoFreeBlocks):
        m.allocate(2)
    assert m.num_free == 1


def test_freeing_more_than_referenced_is_refused():
    m = BlockManager(4, 2)
    a = m.allocate(1)
    m.free(a)
    with pytest.raises(ValueError, match=f"block {a[0]} is freed more often"):
        m.free(a)


def test_chain_hash_depends_on_every_earlier_token(rng):
    toks = [int(t) for t in rng.integers(0, 1000, 12)]
    h = chain_hashes([], toks, 4, 12)
    assert len(h) == 3 and len(set(h)) == 3
    # a change in the first block changes every later block's hash
    other = list(toks)
    other[1] = (other[1] + 1) % 1000
    h2 = chain_hashes([], other, 4, 12)
    assert all(x != y for x, y in zip(h, h2))
    # the same block of tokens after a different prefix hashes differently
    assert block_hash(h[0], toks[4:8]) == h[1]
    assert block_hash(None, toks[4:8]) != h[1]
    # only full blocks are hashed; extending continues the chain
    part = chain_hashes([], toks, 4, 11)
    assert part == h[:2]
    assert chain_hashes(part, toks, 4, 12) == h


def test_registered_blocks_are_shared_by_reference():
    m = BlockManager(8, 4)
    toks = list(range(100, 112))
    hashes = chain_hashes([], toks, 4, 12)
    a = m.allocate(3)
    for blk, h in zip(a, hashes):
        assert m.register(blk, h)
    assert m.num_cached == 3
    hit = m.lookup(hashes)
    assert hit == a
    m.take(hit)
    assert [m.ref_count(b) for b in a] == [2, 2, 2]
    assert m.num_used == 3                      # shared: no new block
    m.check([a, hit])
    # a chain is found from its start only
    assert m.lookup(hashes[1:]) == a[1:]
    assert m.lookup([block_hash(None, [1, 2, 3, 4])] + hashes[1:]) == []


def test_a_second_block_with_the_same_contents_stays_unregistered():
    m = BlockManager(4, 2)
    h = block_hash(None, [5, 6])
    a, b = m.allocate(2)
    assert m.register(a, h)
    assert not m.register(b, h)
    m.free([b])
    assert m.num_cached == 1
    m.check([[a]])


def test_prefix_caching_off_registers_nothing():
    m = BlockManager(4, 2, prefix_caching=False)
    h = block_hash(None, [5, 6])
    a = m.allocate(1)
    assert not m.register(a[0], h)
    assert m.lookup([h]) == []


def test_freed_registered_blocks_stay_cached_until_evicted_lru():
    """Unreferenced cached blocks are found again; allocation takes free
    blocks first, then evicts cached ones, least recently freed first, a
    table's tail before its head."""
    m = BlockManager(6, 2)
    toks = [1, 2, 3, 4, 5, 6]
    hashes = chain_hashes([], toks, 2, 6)
    t1 = m.allocate(3)
    for blk, h in zip(t1, hashes):
        m.register(blk, h)
    m.free(t1)
    assert m.num_free == 6 and m.num_cached == 3
    assert m.lookup(hashes) == t1
    # three never-registered blocks go first
    t2 = m.allocate(3)
    assert not set(t2) & set(t1) and m.num_cached == 3
    # then the tail of t1, then its middle
    t3 = m.allocate(2)
    assert t3 == [t1[2], t1[1]]
    assert m.evictions == 2 and m.num_cached == 1
    assert m.lookup(hashes) == [t1[0]]
    m.check([t2, t3])


def test_taking_a_cached_block_takes_it_off_the_eviction_list():
    m = BlockManager(2, 2)
    h = block_hash(None, [7, 8])
    a = m.allocate(1)
    m.register(a[0], h)
    m.free(a)
    assert m.cost_of_taking(a) == 1
    m.take(m.lookup([h]))
    assert m.num_free == 1
    b = m.allocate(1)                           # must not evict the taken block
    assert b != a
    with pytest.raises(NoFreeBlocks):
        m.allocate(1)
    m.check([a, b])


def test_take_refuses_an_unregistered_block():
    m = BlockManager(2, 2)
    a = m.allocate(1)
    with pytest.raises(ValueError, match="holds no registered contents"):
        m.take(a)


def test_check_finds_a_wrong_count():
    m = BlockManager(3, 2)
    a = m.allocate(2)
    with pytest.raises(AssertionError, match=f"block {a[1]} is in 0 tables but counted 1 times"):
        m.check([a[:1]])


def test_random_churn_keeps_the_books(rng):
    """Random allocations, shares and frees: the counts always match the
    tables, and freeing everything returns the pool."""
    m = BlockManager(32, 4)
    tables = []
    for _ in range(2000):
        op = rng.integers(0, 3)
        if op == 0 and m.num_free:
            t = m.allocate(int(rng.integers(1, m.num_free + 1)))
            for blk in t[:int(rng.integers(0, len(t) + 1))]:
                m.register(blk, bytes(rng.integers(0, 256, 16, dtype="u1")))
            tables.append(t)
        elif op == 1 and tables:
            t = tables[int(rng.integers(0, len(tables)))]
            shared = [b for b in t if m._hash[b] is not None]
            m.take(shared)
            tables.append(shared)
        elif tables:
            m.free(tables.pop(int(rng.integers(0, len(tables)))))
        m.check(tables)
    for t in tables:
        m.free(t)
    m.check([])
    assert m.num_free == 32


def test_kv_bytes_per_token_and_pool_blocks():
    per = kv_bytes_per_token(32, 8, 128)            # an 8B Llama, f16
    assert per == 32 * 2 * 8 * 128 * 2
    free = 40 << 30
    n = kv_pool_blocks(free, 0.9, per, 16)
    assert n == int(free * 0.9) // (per * 16)
    assert n * 16 * per <= free * 0.9 < (n + 1) * 16 * per
    assert kv_pool_blocks(100, 1.0, per, 16) == 0


@pytest.mark.parametrize("args, msg", [
    ((-1, 0.9, 10, 16), "free_bytes must be a non-negative int"),
    ((100, 0.0, 10, 16), r"utilization must be in \(0, 1\]"),
    ((100, 1.5, 10, 16), r"utilization must be in \(0, 1\]"),
    ((100, 0.5, 0, 16), "bytes_per_token must be a positive int"),
    ((100, 0.5, 10, 0), "block_size must be a positive int"),
])
def test_pool_blocks_refuses_bad_arguments(args, msg):
    with pytest.raises(ValueError, match=msg):
        kv_pool_blocks(*args)


def test_block_manager_refuses_bad_sizes():
    with pytest.raises(ValueError, match="num_blocks must be a positive int"):
        BlockManager(0, 16)
    with pytest.raises(ValueError, match="block_size must be a positive int"):
        BlockManager(8, True)
    with pytest.raises(ValueError, match="head_dim must be a positive int"):
        kv_bytes_per_token(2, 2, 0)
