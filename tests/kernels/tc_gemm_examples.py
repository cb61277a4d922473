"""Two small f16 GEMMs on tensor cores, written in the DSL as references for
the GEMM kernels: ``Y[M, N] = X[M, K] . W[N, K]^T`` (both operands K-major,
row-major in memory), f32 accumulation and output.

``mma_gemm`` (sm_80): one CTA of 4 warps per 64 x 64 tile of Y.  Each K
chunk of 64 is copied to shared memory with ``cp.async`` (rows padded to 72
halves, so the 8 rows an ``ldmatrix`` reads fall in different banks); warp
``w`` owns rows ``16w .. 16w + 15`` and all 64 columns: per 16-wide K step
one ``ldmatrix.x4`` gives its A fragment, four ``ldmatrix.x4`` the B
fragments of its eight 8-column tiles, and eight ``mma.m16n8k16`` accumulate.

``wgmma_gemm`` (sm_90a): one warpgroup (128 threads) per 64 x 64 tile.  Per
K chunk of 64, thread 0 has the TMA unit copy the X and W boxes (64 x 64
halves, 128-byte swizzle, 8 KB each, on one mbarrier); four
``wgmma.m64n64k16`` then read them through descriptors whose start address
advances 32 bytes per K step (SBO 1024: 8 rows of 128 bytes).  A single
stage: a ``bar.sync`` keeps the next copy from overwriting a tile still
being read.
"""

from __future__ import annotations

import ptxgen
from ptxgen import types as T
from ptxgen.values import Address

PAD = 72        # halves per shared row of the mma kernel (64 + 8)


def mma_gemm(M, N, K, target="sm_80"):
    """The ldmatrix + mma.sync GEMM; grid (N // 64, M // 64), 128 threads."""
    if M % 64 or N % 64 or K % 64:
        raise ValueError("mma_gemm takes M, N, K multiples of 64")
    m = ptxgen.Module(target)
    with m.kernel("mma_gemm", reqntid=128) as k:
        x, w = k.param_ptr("x", T.f16, align=16), k.param_ptr("w", T.f16, align=16)
        y = k.param_ptr("y", T.f32)
        xs = k.shared_array("xs", T.f16, 64 * PAD, align=16)
        ws = k.shared_array("ws", T.f16, 64 * PAD, align=16)
        t = k.tid.x
        warp, lane = t >> 5, t & 31
        row0, col0 = k.ctaid.y * 64, k.ctaid.x * 64
        acc = [[k.var(T.f32, 0.0) for _ in range(4)] for _ in range(8)]
        xbase, wbase = k.mov(xs, T.u32), k.mov(ws, T.u32)
        # ldmatrix row addresses: lane l names row l % 8 of matrix l // 8
        mi, r = lane >> 3, lane & 7
        a_row = warp * 16 + r + (mi & 1) * 8
        a_addr = xbase + (a_row * PAD + (mi >> 1) * 8) * 2
        b_addr = [wbase + (((2 * p + (mi >> 1)) * 8 + r) * PAD + (mi & 1) * 8) * 2
                  for p in range(4)]
        with k.for_range(0, K // 64) as kc:
            # 64 rows x 8 chunks of 16 bytes per operand: 4 copies per thread each
            for j in range(4):
                c = t + j * 128
                rr, cc = c >> 3, c & 7
                kcol = kc * 64 + cc * 8
                k.cp_async(xs[rr * PAD + cc * 8], x[(row0 + rr) * K + kcol])
                k.cp_async(ws[rr * PAD + cc * 8], w[(col0 + rr) * K + kcol])
            k.cp_async_commit()
            k.cp_async_wait(0)
            k.bar_sync()
            for ks in range(4):
                a = k.ldmatrix(Address(a_addr + ks * 32, 0, "shared", T.b16), 4)
                for p in range(4):
                    b = k.ldmatrix(Address(b_addr[p] + ks * 32, 0, "shared", T.b16), 4)
                    for h in range(2):
                        nt = 2 * p + h
                        d = k.mma(a, b[2 * h:2 * h + 2], tuple(acc[nt]))
                        for e in range(4):
                            acc[nt][e].set(d[e])
            k.bar_sync()
        g, tq = lane >> 2, lane & 3
        for nt in range(8):
            for e in range(4):
                row = row0 + warp * 16 + g + (8 if e >= 2 else 0)
                col = col0 + nt * 8 + tq * 2 + (e & 1)
                k.st(y[row * N + col], acc[nt][e])
    return m


def wgmma_gemm(M, N, K):
    """The TMA + wgmma GEMM (sm_90a); grid (N // 64, M // 64), 128 threads.
    Parameters: the X and W tensor maps (boxes of 64 x 64 halves, 128B
    swizzle: :func:`tensor_maps`), then ``y``."""
    if M % 64 or N % 64 or K % 64:
        raise ValueError("wgmma_gemm takes M, N, K multiples of 64")
    m = ptxgen.Module("sm_90a")
    with m.kernel("wgmma_gemm", reqntid=128) as k:
        xmap, wmap = k.tensor_map_param("xmap"), k.tensor_map_param("wmap")
        y = k.param_ptr("y", T.f32)
        xs = k.shared_array("xs", T.b8, 8192, align=1024)
        ws = k.shared_array("ws", T.b8, 8192, align=1024)
        bar = k.shared_array("bar", T.u64, 1)
        t = k.tid.x
        first = t.eq(0)
        row0, col0 = k.ctaid.y * 64, k.ctaid.x * 64
        with k.if_(first):
            k.mbarrier_init(bar[0], 1)
            k.fence_mbarrier_init()
        k.bar_sync()
        acc = k.wgmma_acc(64)
        xbase, wbase = k.mov(xs, T.u32), k.mov(ws, T.u32)
        with k.for_range(0, K // 64) as kc:
            with k.if_(first):
                k.mbarrier_arrive_expect_tx(bar[0], 2 * 8192)
                k.tma_load(xs[0], xmap, (kc * 64, row0), bar[0])
                k.tma_load(ws[0], wmap, (kc * 64, col0), bar[0])
            k.mbarrier_wait(bar[0], kc & 1)
            k.wgmma_fence()
            for ks in range(4):
                da = k.wgmma_desc(xbase + ks * 32, lbo=16, sbo=1024, swizzle="128B")
                db = k.wgmma_desc(wbase + ks * 32, lbo=16, sbo=1024, swizzle="128B")
                if ks == 0:
                    k.wgmma(acc, da, db, scale_d=kc.ne(0))
                else:
                    k.wgmma(acc, da, db)
            k.wgmma_commit()
            k.wgmma_wait(0)
            k.bar_sync()
        warp, lane = t >> 5, t & 31
        g, tq = lane >> 2, lane & 3
        for i in range(32):
            row = row0 + warp * 16 + g + (8 if (i >> 1) & 1 else 0)
            col = col0 + (i >> 2) * 8 + tq * 2 + (i & 1)
            k.st(y[row * N + col], acc[i])
    return m


def tensor_maps(x, w):
    """The X and W maps of :func:`wgmma_gemm` for device arrays ``x`` (M x K)
    and ``w`` (N x K) of f16."""
    from ptxgen.tensor_map import TensorMap
    return (TensorMap.for_array(x, (64, 64), swizzle="128B"),
            TensorMap.for_array(w, (64, 64), swizzle="128B"))
