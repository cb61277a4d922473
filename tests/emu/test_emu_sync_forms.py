"""Every barrier, fence, control-flow, cvta and cp.async form of the
instruction table, run where it matters and checked for the values it must
deliver.

A barrier form stands between threads' shared-memory writes and other
threads' reads of them (bar.arrive between a producer warp and a consumer
warp; the emulator's race detector fails a barrier that orders nothing);
a fence, proxy fence, membar, griddepcontrol or mbarrier-init fence
stands in the same place, ordered by a bar.sync, and must change no value;
the cluster barriers run in arrive/wait pairs; both branch forms jump over
a poisoning store; exit and ret end a half of the threads each.  cvta's
conversions round-trip and address the same bytes; every cp.async form
copies 16 bytes per thread.  Which forms each table combination emits is
``isa_coverage.sync_mods``; ptxas assembles every kernel here.
"""

import numpy as np
import pytest

import isa_coverage as IC
import ptxgen
from ptxgen import types as T
from ptxgen.values import Address, Imm

NT = 64
BARRIERS = ("bar", "fence", "membar", "fence.proxy.async", "fence.mbarrier_init",
            "griddepcontrol")
FORMS = [(op, tuple(IC.sync_mods(op, c[1]))) for op in BARRIERS
         for c in sorted(IC.table_combos([op]))]
COVERED = {c for op in IC.SYNC_OPS for c in IC.table_combos([op])}


def _sync_kernel():
    """out[j, t] = the value thread t reads after form j (see the module doc)."""
    m = ptxgen.Module("sm_90")
    with m.kernel("forms", reqntid=NT, cluster=1) as k:
        xp, out = k.param_ptr("x", T.u32), k.param_ptr("out", T.u32)
        sh = k.shared_array("sh", T.u32, NT)
        t = k.tid.x
        x = k.ld(xp[t])
        nxt = (t + 1) % NT
        for j, (op, mods) in enumerate(FORMS):
            k.st(sh[t], x + j)
            if op == "bar" and "arrive" in mods:      # warp 0 produces, warp 1 consumes
                with k.if_else(t < 32) as (then, other):
                    with then:
                        k.emit("bar", list(mods), [], [Imm(1, T.u32), Imm(NT, T.u32)], dsts=0)
                    with other:
                        k.bar_sync(1, NT)
                src = k.select(t < 32, t, t - 32)
            else:
                if op == "bar":
                    k.emit("bar", list(mods), [], [Imm(0, T.u32)], dsts=0)
                else:
                    k.emit(op, list(mods), [], [], dsts=0)
                    k.bar_sync()
                src = nxt
            k.st(out[j * NT + t], k.ld(sh[src]))
            k.bar_sync()
        # the cluster barrier: each arrive form with a plain wait, each wait
        # form after a plain arrive (a cluster of one CTA here)
        for op in ("barrier.cluster.arrive", "barrier.cluster.wait"):
            for c in sorted(IC.table_combos([op])):
                mods = IC.sync_mods(op, c[1])
                arrive = mods if op == "barrier.cluster.arrive" else []
                wait = mods if op == "barrier.cluster.wait" else []
                k.emit("barrier.cluster.arrive", arrive, [], [], dsts=0)
                k.emit("barrier.cluster.wait", wait, [], [], dsts=0)
        # bra and bra.uni jump over a store of a poison value
        for j, uni in enumerate(((), ("uni",))):
            skip = k.label()
            k.emit("bra", list(uni), [], [skip], dsts=0)
            k.st(out[(len(FORMS) + j) * NT + t], 0xBAD)
            k.place(skip)
            k.st(out[(len(FORMS) + j) * NT + t], x)
        base = (len(FORMS) + 2) * NT
        k.st(out[base + t], x)
        k.exit(guard=t >= 32)           # half the threads leave with exit ...
        k.st(out[base + t], x + 1)      # ... the other half with ret
        k.ret()
    return m


def test_barrier_fence_and_control_forms(backend, rng):
    backend.require_sm(90)
    x = rng.integers(0, 1 << 30, NT, dtype=np.uint32)
    rows = len(FORMS) + 3
    out = backend.poisoned(rows * NT, np.uint32)
    mod = backend.load(_sync_kernel())
    backend.launch_positional(mod["forms"], 1, NT, backend.array(x), out)
    got = out.to_numpy().reshape(rows, NT)
    t = np.arange(NT)
    for j, (op, mods) in enumerate(FORMS):
        src = np.where(t < 32, t, t - 32) if "arrive" in mods else (t + 1) % NT
        np.testing.assert_array_equal(got[j], x[src] + np.uint32(j), err_msg=f"{op}.{mods}")
    np.testing.assert_array_equal(got[len(FORMS)], x, err_msg="bra")
    np.testing.assert_array_equal(got[len(FORMS) + 1], x, err_msg="bra.uni")
    np.testing.assert_array_equal(got[-1], np.where(t >= 32, x, x + np.uint32(1)),
                                  err_msg="exit / ret")


def _cvta_kernel():
    m = ptxgen.Module("sm_90")
    with m.kernel("cv", reqntid=NT) as k:
        g = k.param("g", T.u64)               # the host's (generic) pointer
        out = k.param_ptr("out", T.u64)
        sh = k.shared_array("sh", T.u32, NT)
        t = k.tid.x
        off = k.cvt(T.u64, t * 4)

        def cvta(mods, x):
            d = k.reg(T.u64)
            k.emit("cvta", mods, [T.u64], [d, x])
            return d
        row = 0

        def put(v):
            nonlocal row
            k.st(out[row * NT + t], v if v.type is T.u64 else k.cvt(T.u64, v))
            row += 1
        glob = cvta(["to", "global"], g)
        put(cvta(["global"], glob) - g)                                   # 0
        put(k.ld(Address(k.add(glob, off), 0, "global"), T.u32))        # x[t]
        k.st(sh[t], k.ld(Address(k.add(g, off), 0, "generic"), T.u32) + 1)
        k.bar_sync()
        s = k.mov(sh, T.u64)
        gen = cvta(["shared"], s)
        put(cvta(["to", "shared"], gen) - s)                              # 0
        put(k.ld(Address(k.add(gen, off), 0, "generic"), T.u32))        # x[t] + 1
        raw = k.reg(T.u64)
        k.emit("mov", [], [T.b64], [raw, k.param_symbol("g")])
        gp = cvta(["param"], raw)
        put(cvta(["to", "param"], gp) - raw)                              # 0
    return m


def test_cvta_forms_round_trip(backend, rng):
    x = rng.integers(0, 1 << 31, NT, dtype=np.uint32)
    xs = backend.array(x)
    out = backend.poisoned(5 * NT, np.uint64)
    backend.launch_positional(backend.load(_cvta_kernel())["cv"], 1, NT, np.uint64(xs.ptr), out)
    got = out.to_numpy().reshape(5, NT)
    want = [np.zeros(NT), x, np.zeros(NT), x + 1, np.zeros(NT)]
    for r, w in enumerate(want):
        np.testing.assert_array_equal(got[r], np.asarray(w, np.uint64), err_msg=f"row {r}")


CP_FORMS = sorted({tuple(IC.sync_mods("cp.async", c[1])) for c in IC.table_combos(["cp.async"])})


def _cp_async_kernel():
    m = ptxgen.Module("sm_90")
    with m.kernel("cp", reqntid=NT) as k:
        src, out = k.param_ptr("src", T.u32), k.param_ptr("out", T.u32)
        sh = k.shared_array("sh", T.u32, 4 * NT * len(CP_FORMS), align=16)
        t = k.tid.x
        for j, mods in enumerate(CP_FORMS):
            dst = Address(k.element(sh, (t + j * NT) * 4).base, 0, "shared")
            k.emit("cp.async", list(mods), [], [dst, Address(k.element(src, t * 4).base, 0,
                                                              "global"), Imm(16, T.u32)], dsts=0)
        k.emit("cp.async.wait_all", [], [], [], dsts=0)
        k.bar_sync()
        for j in range(len(CP_FORMS)):
            for e in range(4):
                k.st(out[(j * NT + t) * 4 + e], k.ld(sh[(t + j * NT) * 4 + e]))
    return m


def test_cp_async_forms(backend, rng):
    x = rng.integers(0, 1 << 32, 4 * NT, dtype=np.uint32)
    out = backend.poisoned(4 * NT * len(CP_FORMS), np.uint32)
    backend.launch_positional(backend.load(_cp_async_kernel())["cp"], 1, NT, backend.array(x), out)
    got = out.to_numpy().reshape(len(CP_FORMS), 4 * NT)
    for j, mods in enumerate(CP_FORMS):
        np.testing.assert_array_equal(got[j], x, err_msg=f"cp.async.{'.'.join(mods)}")


def test_ptxas_takes_every_form(ptxas):
    from ptxgen.ptxas import assemble
    for build in (_sync_kernel, _cvta_kernel, _cp_async_kernel):
        assemble(build().to_ptx(), "sm_90")
