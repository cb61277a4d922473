"""Thread-block clusters (sm_90) in the builder, the instruction table, the
emulator and the driver: ``.reqnctapercluster``, ``%cluster_ctarank``,
``mapa``, ``ld``/``st.shared::cluster`` and the cluster barrier.

The emulator runs a cluster's CTAs in one batch, so a store to a peer's
shared memory lands in the peer's window; the cluster barrier parks a thread
until every non-exited thread of its cluster waits at the same instruction."""

import numpy as np
import pytest

import ptxgen
from backends import line_of
from ptxgen import emu
from ptxgen.errors import PtxBuildError, TargetError
from ptxgen.types import f32

T = 64                  # threads per CTA


def _exchange(n=2, second_barrier=True, started=True):
    """CTA ``r`` of each cluster of ``n`` hands its slice of ``x`` to CTA
    ``(r + 1) % n``, which writes what it got to ``y``."""
    m = ptxgen.Module("sm_90")
    with m.kernel("exchange", reqntid=T, cluster=n) as k:
        x = k.param_ptr("x", f32)
        y = k.param_ptr("y", f32)
        buf = k.shared_array("buf", f32, T)
        if started:
            k.barrier_cluster_arrive("relaxed")
        rank = k.cluster_ctarank
        peer = k.rem(rank + 1, k.cluster_nctarank)
        t = k.tid.x
        g = k.global_id()
        v = k.ld(x[g], nc=True)
        if started:
            k.barrier_cluster_wait()      # the peer has started
        k.st(k.mapa(buf[t], peer), v)
        if second_barrier:
            k.cluster_sync()
        k.st(y[g], k.ld(buf[t]))
    return m


def _need_sm90(backend):
    if backend.name == "cuda":
        from ptxgen.driver import get_device
        if get_device().compute_capability < (9, 0):
            pytest.skip("thread-block clusters need sm_90")


@pytest.mark.parametrize("n", [2, 4])
def test_peers_exchange_through_shared_memory(backend, n, rng):
    """Three clusters of n CTAs, on the emulator and an sm_90 GPU."""
    _need_sm90(backend)
    grid = 3 * n
    x = rng.standard_normal(grid * T).astype(np.float32)
    dx = backend.array(x)
    dy = backend.poisoned(grid * T, np.float32)
    backend.launch_positional(backend.load(_exchange(n).to_ptx())["exchange"], grid, T, dx, dy)
    want = np.roll(x.reshape(3, n, T), 1, axis=1).reshape(-1)
    np.testing.assert_array_equal(dy.to_numpy(), want)


def test_grid_must_be_whole_clusters(backend):
    """Refused before the run (the driver: before cuLaunchKernel)."""
    _need_sm90(backend)
    f = backend.load(_exchange(2).to_ptx())["exchange"]
    dx, dy = backend.array(np.ones(5 * T, np.float32)), backend.poisoned(5 * T, np.float32)
    with pytest.raises(ValueError, match=r"grid \(5, 1, 1\) is not a whole number of "
                                         r"clusters of \(2, 1, 1\)"):
        backend.launch_positional(f, 5, T, dx, dy)
    assert f.cluster == (2, 1, 1)


def test_ptx_text_and_ptxas(ptxas):
    from ptxgen.ptxas import assemble
    text = _exchange().to_ptx()
    for s in (".reqnctapercluster 2, 1, 1", "barrier.cluster.arrive.relaxed.aligned;",
              "barrier.cluster.arrive.release.aligned;", "barrier.cluster.wait.acquire.aligned;",
              "mov.u32 \t%r1, %cluster_ctarank;", "mapa.shared::cluster.u32",
              "st.shared::cluster.f32", ".version 8.0"):
        assert s in text, s
    report = assemble(text, "sm_90")[1]
    assert report[0].spill_stores == 0
    # the explicit .release / .acquire need PTX 8.0 without a relaxed arrival too
    text = _exchange(started=False).to_ptx()
    assert ".version 8.0" in text and "relaxed" not in text
    assert assemble(text, "sm_90")[1][0].spill_stores == 0


def test_builder_misuse_names_the_line():
    m = ptxgen.Module("sm_90")
    with m.kernel("plain", reqntid=T) as k:
        buf = k.shared_array("buf", f32, T)
        with pytest.raises(PtxBuildError) as e:
            k.mapa(buf[0], 1)  # MARK-mapa
        assert "not built with cluster" in str(e.value)
        assert e.value.loc.lineno == line_of(__file__, "MARK-mapa")
        with pytest.raises(PtxBuildError, match="sem='release' or 'relaxed'"):
            k.barrier_cluster_arrive("acquire")
        k.exit()
    with pytest.raises(TargetError, match="clusters need sm_90"):
        ptxgen.Module("sm_80").kernel("old", reqntid=T, cluster=2)
    with pytest.raises(PtxBuildError, match="portable limit is 8"):
        ptxgen.Module("sm_90").kernel("big", reqntid=T, cluster=(4, 4))
    m = ptxgen.Module("sm_90")
    with m.kernel("glob", reqntid=T, cluster=2) as k:
        x = k.param_ptr("x", f32)
        with pytest.raises(PtxBuildError, match="maps a .shared address, got .global"):
            k.mapa(x[0], 1)
        k.exit()


def test_missing_barrier_after_the_remote_store_is_a_race(emu_backend):
    """Without the second cluster barrier the owner reads its buffer while
    the peer may still be writing it."""
    f = emu_backend.load(_exchange(2, second_barrier=False).to_ptx())["exchange"]
    dx = emu_backend.array(np.ones(2 * T, np.float32))
    dy = emu_backend.poisoned(2 * T, np.float32)
    with pytest.raises(emu.RaceError, match="shared-memory race"):
        emu_backend.launch_positional(f, 2, T, dx, dy)


def _kernel(body, n=2):
    m = ptxgen.Module("sm_90")
    with m.kernel("k", reqntid=T, cluster=n) as k:
        y = k.param_ptr("y", f32)
        buf = k.shared_array("buf", f32, T)
        body(k, y, buf)
    return m


def _launch_emu(m, grid=2):
    f = emu.Module.from_ptx(m)["k"]
    emu.launch(f, grid, T, emu.DeviceArray.from_numpy(np.zeros(grid * T, np.float32)))


def test_wait_without_arrive_is_refused():
    def body(k, y, buf):
        k.barrier_cluster_wait()
    with pytest.raises(emu.BarrierError, match="without a barrier.cluster.arrive"):
        _launch_emu(_kernel(body))


def test_second_arrive_before_the_wait_is_refused():
    def body(k, y, buf):
        k.barrier_cluster_arrive("relaxed")
        k.barrier_cluster_arrive("release")
        k.barrier_cluster_wait()
    with pytest.raises(emu.BarrierError, match="a second time before its barrier.cluster.wait"):
        _launch_emu(_kernel(body))


def test_exit_while_the_cluster_waits_is_refused():
    def body(k, y, buf):
        k.barrier_cluster_arrive("release")
        with k.if_(k.cluster_ctarank.eq(0)):
            k.barrier_cluster_wait()
            k.st(y[k.global_id()], 1.0)
    with pytest.raises(emu.BarrierError, match="exits while 64 threads of its cluster wait"):
        _launch_emu(_kernel(body))


def test_rank_outside_the_cluster_is_a_fault():
    def body(k, y, buf):
        k.cluster_sync()
        k.st(k.mapa(buf[k.tid.x], 2), 1.0)
        k.cluster_sync()
    with pytest.raises(emu.MemoryFault, match="rank 2 is outside the cluster of 2 CTAs"):
        _launch_emu(_kernel(body))


def test_store_to_an_exited_peer_is_a_fault():
    def body(k, y, buf):
        rank = k.cluster_ctarank
        k.exit(guard=rank.eq(1))
        k.barrier_cluster_arrive("relaxed")
        k.barrier_cluster_wait()
        k.st(k.mapa(buf[k.tid.x], 1), 1.0)
    with pytest.raises(emu.MemoryFault, match="whose threads have all exited"):
        _launch_emu(_kernel(body))
