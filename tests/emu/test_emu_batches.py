"""Blocks run in batches, vectorised across all their threads: per-block
shared memory, barriers, warps, errors; atomics and "last block" patterns
across the blocks of one batch."""

import numpy as np
import pytest

import ptxgen
from ptxgen import emu
from ptxgen.emu import executor
from ptxgen.kernels import argmax as A
from ptxgen.types import f32, s32, u32


@pytest.fixture(params=["default", "small"])
def batch(request, monkeypatch):
    """Default batches (all blocks in one) and tiny ones (a few blocks, a
    partial last batch)."""
    if request.param == "small":
        monkeypatch.setattr(executor, "BATCH_THREADS", 160)
    return request.param


def _line_of(text, needle):
    return [i + 1 for i, ln in enumerate(text.split("\n")) if needle in ln]


def test_batch_size_is_bounded():
    m = ptxgen.Module("sm_80")
    with m.kernel("nop") as k:
        k.param_ptr("x", u32)
    kern = emu.Module.from_ptx(m)["nop"].compiled
    assert executor.batch_blocks(kern, 32, 0, 4096) == executor.BATCH_THREADS // 32
    assert executor.batch_blocks(kern, 32, 0, 5) == 5
    assert executor.batch_blocks(kern, 1024, 0, 4096) == executor.BATCH_THREADS // 1024
    big = executor.batch_blocks(kern, 32, 200 * 1024, 4096)
    assert 1 <= big and big * 200 * 1024 <= executor.BATCH_BYTES
    assert executor.batch_blocks(kern, 1024, 227 * 1024, 1) == 1


def test_blocks_do_not_see_each_others_shared_memory(batch):
    """Even blocks fill their shared array, odd ones only read theirs: they
    must find it as undefined (0xFF bytes) whatever their neighbours wrote;
    the even blocks read a rotated copy of their own values."""
    T, grid = 64, (7, 3, 1)
    m = ptxgen.Module("sm_80")
    with m.kernel("isolated") as k:
        out = k.param_ptr("out", u32)
        buf = k.shared_array("buf", u32, T)
        t = k.tid.x
        blk = k.ctaid.x + k.ctaid.y * k.nctaid.x
        with k.if_((blk & 1).eq(0)):
            k.st(buf[t], blk * 1000 + t)
        k.bar_sync(0)
        v = k.ld(buf[(t + 1) & (T - 1)])
        k.bar_sync(0)
        k.st(buf[t], v + 1)               # write again after a barrier: no race
        k.bar_sync(0)
        k.st(out[blk * T + t], k.ld(buf[t ^ 1]))
    fn = emu.Module.from_ptx(m)["isolated"]
    nb = grid[0] * grid[1]
    out = emu.DeviceArray.empty(nb * T, np.uint32)
    emu.launch(fn, grid, T, out)
    got = out.to_numpy().reshape(nb, T)
    t = np.arange(T)
    for b in range(nb):
        rot = b * 1000 + (t + 1) % T + 1 if b % 2 == 0 else np.zeros(T, np.uint32)
        want = np.asarray(rot, np.uint32)[t ^ 1]
        np.testing.assert_array_equal(got[b], want, err_msg=f"block {b}")


def test_dynamic_shared_per_block_reduction(batch, rng):
    """A shared-memory tree reduction in every block of a batch (dynamic
    shared memory, a barrier per level), checked per block."""
    T = 128
    m = ptxgen.Module("sm_80")
    with m.kernel("tree") as k:
        x = k.param_ptr("x", f32)
        out = k.param_ptr("out", f32)
        sh = k.dynamic_shared("sh", f32)
        t = k.tid.x
        k.st(sh[t], k.ld(x[k.global_id()]))
        k.bar_sync(0)
        s = T // 2
        while s >= 1:
            with k.if_(t < s):
                k.st(sh[t], k.ld(sh[t]) + k.ld(sh[t + s]))
            k.bar_sync(0)
            s //= 2
        with k.if_(t.eq(0)):
            k.st(out[k.ctaid.x], k.ld(sh[0]))
    grid = 37
    x = rng.integers(-50, 50, grid * T).astype(np.float32)
    out = emu.DeviceArray.empty(grid, np.float32)
    emu.launch(emu.Module.from_ptx(m)["tree"], grid, T, emu.DeviceArray.from_numpy(x), out,
               shared=T * 4)
    np.testing.assert_array_equal(out.to_numpy(), x.reshape(grid, T).sum(axis=1))


def test_divergent_barrier_in_one_block_names_that_block(batch):
    m = ptxgen.Module("sm_80")
    with m.kernel("one_bad") as k:
        x = k.param_ptr("x", u32)
        t = k.tid.x
        with k.if_(k.ctaid.x.eq(3) & (t < 16)):
            k.bar_sync(0)                 # planted: half of block 3 only
        k.st(x[k.global_id()], t)
    text = m.to_ptx()
    x = emu.DeviceArray.zeros(6 * 32, np.uint32)
    with pytest.raises(emu.BarrierError) as ei:
        emu.launch(emu.Module.from_ptx(text)["one_bad"], 6, 32, x)
    e = ei.value
    assert e.block == (3, 0, 0)
    assert e.thread[0] >= 16
    assert "bar.sync" in str(e) and "block (3, 0, 0)" in str(e)


def test_two_barriers_in_one_block_of_a_2d_grid(batch):
    m = ptxgen.Module("sm_80")
    with m.kernel("two_bars") as k:
        x = k.param_ptr("x", u32)
        t = k.tid.x
        bad = k.ctaid.x.eq(1) & k.ctaid.y.eq(2)
        with k.if_else(bad & (t < 8)) as (then, other):
            with then:
                k.bar_sync(0)
            with other:
                k.bar_sync(0)
        k.st(x[t], t)
    text = m.to_ptx()
    with pytest.raises(emu.BarrierError, match="divergent barrier") as ei:
        emu.launch(emu.Module.from_ptx(text)["two_bars"], (3, 4), 32,
                   emu.DeviceArray.zeros(32, np.uint32))
    assert ei.value.block == (1, 2, 0)
    assert ei.value.line in _line_of(text, "bar.sync")


def test_race_in_one_block_names_that_block(batch, rng):
    m = ptxgen.Module("sm_80")
    with m.kernel("racy") as k:
        x = k.param_ptr("x", f32)
        buf = k.shared_array("buf", f32, 64)
        t = k.tid.x
        k.st(buf[t], k.ld(x[t]))
        with k.if_(k.ctaid.x.ne(4)):      # planted: block 4 skips the barrier
            k.bar_sync(0)
        k.st(x[t], k.ld(buf[t ^ 1]))
    x = emu.DeviceArray.from_numpy(rng.standard_normal(64).astype(np.float32))
    with pytest.raises(emu.RaceError) as ei:
        emu.launch(emu.Module.from_ptx(m)["racy"], 6, 64, x)
    assert ei.value.block == (4, 0, 0)


def test_shared_race_in_one_block_names_that_block(batch):
    m = ptxgen.Module("sm_80")
    with m.kernel("racy2") as k:
        x = k.param_ptr("x", u32)
        buf = k.shared_array("buf", u32, 64)
        t = k.tid.x
        k.st(buf[t], t)
        k.bar_sync(0)
        # planted: block (2, 1) reads a neighbour's slot it then overwrites
        with k.if_(k.ctaid.x.eq(2) & k.ctaid.y.eq(1)):
            k.st(buf[t ^ 1], k.ld(buf[t]))
        k.bar_sync(0)
        k.st(x[k.global_id()], k.ld(buf[t]))
    x = emu.DeviceArray.zeros(3 * 64, np.uint32)
    with pytest.raises(emu.RaceError) as ei:
        emu.launch(emu.Module.from_ptx(m)["racy2"], (3, 2), 64, x)
    assert ei.value.block == (2, 1, 0)
    assert "no bar.sync between" in str(ei.value)


def test_fault_and_uninitialised_register_name_block_and_thread(batch):
    m = ptxgen.Module("sm_80")
    with m.kernel("maybe") as k:
        x = k.param_ptr("x", u32)
        t = k.tid.x
        v = k.var(u32)
        with k.if_(k.ctaid.x.ne(5) | (t < 7)):
            v.set(7)
        k.st(x[k.global_id()], v)          # planted: block 5, threads >= 7
    with pytest.raises(emu.UninitializedRegister) as ei:
        emu.launch(emu.Module.from_ptx(m)["maybe"], 8, 32, emu.DeviceArray.zeros(256, np.uint32))
    assert ei.value.block == (5, 0, 0) and ei.value.thread == (7, 0, 0)


def test_shared_bounds_are_per_block(batch):
    m = ptxgen.Module("sm_80")
    with m.kernel("oob") as k:
        k.param_ptr("x", u32)
        buf = k.shared_array("buf", u32, 32)
        t = k.tid.x
        i = k.select(k.ctaid.x.eq(2) & t.eq(9), k.mov(32, u32), t)
        k.st(buf[i], t)                    # planted: block 2 thread 9 writes buf[32]
    with pytest.raises(emu.MemoryFault, match="outside the block's 128 bytes") as ei:
        emu.launch(emu.Module.from_ptx(m)["oob"], 4, 32, emu.DeviceArray.zeros(1, np.uint32))
    assert ei.value.block == (2, 0, 0) and ei.value.thread == (9, 0, 0)


def test_global_atomics_across_blocks_serialise_in_thread_order(batch, rng):
    T, grid = 64, 50
    m = ptxgen.Module("sm_80")
    with m.kernel("count") as k:
        cnt = k.param_ptr("cnt", u32)
        old = k.param_ptr("old", u32)
        fs = k.param_ptr("fs", f32)
        x = k.param_ptr("x", f32)
        g = k.global_id()
        k.st(old[g], k.atom("add", cnt[0], 1))
        k.atom("add", fs[0], k.ld(x[g]))
    n = T * grid
    x = rng.uniform(-1, 1, n).astype(np.float32)
    cnt = emu.DeviceArray.zeros(1, np.uint32)
    old = emu.DeviceArray.empty(n, np.uint32)
    fs = emu.DeviceArray.zeros(1, np.float32)
    emu.launch(emu.Module.from_ptx(m)["count"], grid, T, cnt, old, fs,
               emu.DeviceArray.from_numpy(x))
    assert cnt.to_numpy()[0] == n
    np.testing.assert_array_equal(old.to_numpy(), np.arange(n))     # lane order
    want = np.float32(0)
    for v in x:                                                       # serial f32 sum
        want = np.float32(want + v)
    assert fs.to_numpy()[0] == want


def test_shared_atomics_stay_in_their_block(batch):
    T, grid = 96, 11
    m = ptxgen.Module("sm_80")
    with m.kernel("hist") as k:
        out = k.param_ptr("out", u32)
        olds = k.param_ptr("olds", u32)
        sh = k.shared_array("c", u32, 2)
        t = k.tid.x
        with k.if_(t < 2):
            k.st(sh[t], 0, ty=u32)
        k.bar_sync(0)
        k.st(olds[k.global_id()], k.atom("add", sh[t & 1], k.ctaid.x + 1))
        k.bar_sync(0)
        with k.if_(t < 2):
            k.st(out[k.ctaid.x * 2 + t], k.ld(sh[t]))
    out = emu.DeviceArray.empty(2 * grid, np.uint32)
    olds = emu.DeviceArray.empty(grid * T, np.uint32)
    emu.launch(emu.Module.from_ptx(m)["hist"], grid, T, out, olds)
    b = np.arange(grid)
    np.testing.assert_array_equal(out.to_numpy().reshape(grid, 2),
                                  np.stack([(b + 1) * T // 2] * 2, axis=1))
    t = np.arange(T)
    np.testing.assert_array_equal(olds.to_numpy().reshape(grid, T),
                                  (b[:, None] + 1) * (t[None, :] // 2))


def test_warps_do_not_span_blocks(batch):
    """48-thread blocks: warp 1 of each block has 16 lanes, and shuffles and
    votes stay inside the block."""
    T, grid = 48, 9
    m = ptxgen.Module("sm_80")
    with m.kernel("warps") as k:
        out = k.param_ptr("out", u32)
        bal = k.param_ptr("bal", u32)
        t = k.tid.x
        v = k.ctaid.x * 1000 + t
        k.st(out[k.global_id()], k.shfl_xor(v, 8))
        k.st(bal[k.global_id()], k.vote_sync("ballot", (t & 1).eq(1) | k.ctaid.x.eq(3)))
    out = emu.DeviceArray.empty(grid * T, np.uint32)
    bal = emu.DeviceArray.empty(grid * T, np.uint32)
    emu.launch(emu.Module.from_ptx(m)["warps"], grid, T, out, bal)
    b, t = np.meshgrid(np.arange(grid), np.arange(T), indexing="ij")
    np.testing.assert_array_equal(out.to_numpy().reshape(grid, T), b * 1000 + (t ^ 8))
    want = np.where(t < 32, 0xAAAAAAAA, 0xAAAA)
    want = np.where(b == 3, np.where(t < 32, 0xFFFFFFFF, 0xFFFF), want)
    np.testing.assert_array_equal(bal.to_numpy().reshape(grid, T), want)


@pytest.mark.parametrize("n,grid,block", [(5000, 5, 64), (777, 3, 32), (40000, 9, 128)])
def test_argmax_last_block_pattern(batch, n, grid, block, rng):
    x = rng.standard_normal(n).astype(np.float32)
    x[rng.integers(0, n, 3)] = 7.5                     # ties: the lowest index wins
    spec = A.ArgmaxSpec(block=block)
    fn = emu.Module.from_ptx(A.build(spec))[spec.kernel_name]
    dx = emu.DeviceArray.from_numpy(x)
    out = emu.DeviceArray.empty(1, np.int32)
    scratch = emu.DeviceArray.empty(grid, np.uint64)
    counter = emu.DeviceArray.zeros(1, np.uint32)
    for _ in range(2):                                 # the counter must be reset
        out.fill(-1)
        emu.launch(fn, grid, block, dx, n, out, scratch, counter)
        assert int(out.to_numpy()[0]) == int(np.argmax(x))
        assert int(counter.to_numpy()[0]) == 0


def test_later_block_sees_earlier_blocks_stores(batch):
    """A block that polls a flag set by a block running at a lower PC (in
    the same lockstep batch or an earlier batch) finds it set."""
    m = ptxgen.Module("sm_80")
    with m.kernel("handoff") as k:
        flag = k.param_ptr("flag", u32)
        out = k.param_ptr("out", s32)
        with k.if_else(k.ctaid.x.eq(0)) as (then, other):
            with then:
                k.st(flag[0], 1, ty=u32)
            with other:
                seen = k.var(u32, 0)
                with k.while_(lambda: seen.eq(0)):
                    seen.set(k.ld(flag[0], volatile=True))
                k.st(out[k.ctaid.x * 32 + k.tid.x], seen.bitcast(s32))
    flag = emu.DeviceArray.zeros(1, np.uint32)
    out = emu.DeviceArray.zeros(8 * 32, np.int32)
    emu.launch(emu.Module.from_ptx(m)["handoff"], 8, 32, flag, out)
    np.testing.assert_array_equal(out.to_numpy()[32:], 1)


def test_spin_wait_on_another_block_hits_the_step_limit(batch, monkeypatch):
    """Block 0 waits for a flag block 1 sets later in program order: the
    emulator cannot run that (nor can a GPU guarantee it); the step limit
    stops it with an error naming a spinning block."""
    monkeypatch.setattr(executor, "MAX_STEPS", 20_000)
    m = ptxgen.Module("sm_80")
    with m.kernel("spin") as k:
        flag = k.param_ptr("flag", u32)
        with k.if_else(k.ctaid.x.eq(0)) as (then, other):
            with then:
                seen = k.var(u32, 0)
                with k.while_(lambda: seen.eq(0)):
                    seen.set(k.ld(flag[0], volatile=True))
            with other:
                k.st(flag[0], 1, ty=u32)
    with pytest.raises(emu.EmulatorError, match="too many instructions") as ei:
        emu.launch(emu.Module.from_ptx(m)["spin"], 2, 32, emu.DeviceArray.zeros(1, np.uint32))
    assert ei.value.block == (0, 0, 0)
    assert "spin-wait on another block" in str(ei.value)


def test_batched_results_equal_block_by_block(monkeypatch, rng):
    """One launch with batches of every size from 1 block to all of them
    gives the same bytes (a kernel with divergence, barriers, shuffles)."""
    T, grid = 64, 13
    m = ptxgen.Module("sm_80")
    with m.kernel("mix") as k:
        x = k.param_ptr("x", f32)
        out = k.param_ptr("out", f32)
        buf = k.shared_array("buf", f32, T)
        t = k.tid.x
        g = k.global_id()
        v = k.var(f32, 0.0)
        v.set(k.ld(x[g]))
        with k.for_range(0, k.ctaid.x & 3):        # a per-block trip count
            v.set(v * 0.75 + 1.0)
        k.st(buf[t], v)
        k.bar_sync(0)
        w = k.ld(buf[(t + k.ctaid.x) & (T - 1)])
        w = w + k.shfl_down(w.bitcast(u32), 1).bitcast(f32)
        k.st(out[g], w)
    fn = emu.Module.from_ptx(m)["mix"]
    x = emu.DeviceArray.from_numpy(rng.standard_normal(grid * T).astype(np.float32))
    results = []
    for per in (T, 3 * T, 1 << 16):
        monkeypatch.setattr(executor, "BATCH_THREADS", per)
        out = emu.DeviceArray.empty(grid * T, np.float32)
        emu.launch(fn, grid, T, x, out)
        results.append(out.to_numpy())
    for r in results[1:]:
        np.testing.assert_array_equal(r.view(np.uint32), results[0].view(np.uint32))


def _loop_kernel(planted):
    m = ptxgen.Module("sm_80")
    with m.kernel("loop") as k:
        out = k.param_ptr("out", u32)
        buf = k.shared_array("buf", u32, 64)
        t = k.tid.x
        acc = k.var(u32, 0)
        with k.for_range(0, k.ctaid.x + 1) as i:          # blocks leave at different times
            k.st(buf[t], acc + t * 3 + i)
            k.bar_sync(0)
            acc.set(acc + k.ld(buf[t ^ 1]))
            if planted:                                   # block 3 skips it once
                with k.if_(k.ctaid.x.ne(3) | i.ne(2)):
                    k.bar_sync(0)
            else:
                k.bar_sync(0)
        k.st(out[k.global_id()], acc)
    return emu.Module.from_ptx(m)["loop"]


def test_barriers_in_loops_with_per_block_trip_counts(batch):
    T, grid = 64, 7
    out = emu.DeviceArray.empty(grid * T, np.uint32)
    emu.launch(_loop_kernel(False), grid, T, out)
    want = np.zeros((grid, T), np.uint32)
    t = np.arange(T, dtype=np.uint32)
    for b in range(grid):
        acc = np.zeros(T, np.uint32)
        for i in range(b + 1):
            buf = acc + t * 3 + i
            acc = acc + buf[t ^ 1]
        want[b] = acc
    np.testing.assert_array_equal(out.to_numpy().reshape(grid, T), want)


def test_race_in_a_late_iteration_of_one_block(batch):
    with pytest.raises(emu.RaceError) as ei:
        emu.launch(_loop_kernel(True), 7, 64, emu.DeviceArray.empty(7 * 64, np.uint32))
    assert ei.value.block == (3, 0, 0)
