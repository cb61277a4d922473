"""ptxas accepts every tensor-core form ptxgen builds, on each target that
has it (ldmatrix and mma.sync from sm_80, stmatrix and TMA from sm_90,
wgmma on sm_90a), and the builder refuses each on the targets that lack it."""

import pytest

import ptxgen
from ptxgen import types as T
from ptxgen.errors import TargetError
from ptxgen.ptxas import assemble


def _ldmatrix(k, sh):
    out = []
    for num in (1, 2, 4):
        for trans in (False, True):
            out += k.ldmatrix(sh[0], num, trans=trans)
    return out


def _mma(k, sh):
    a = k.ldmatrix(sh[0], 4)
    b = k.ldmatrix(sh[0], 2)
    f = tuple(k.var(T.f32, 0.0) for _ in range(4))
    i = tuple(k.var(T.s32, 0) for _ in range(4))
    res = []
    for ab in ("f16", "bf16"):
        res += k.mma(a, b, f, ab_type=ab)
        res += k.mma(a[:2], b[:1], f, shape="m16n8k8", ab_type=ab)
    for ab in ("s8", "u8", ("s8", "u8"), ("u8", "s8")):
        for sat in (False, True):
            res += k.mma(a, b, i, shape="m16n8k32", ab_type=ab, satfinite=sat)
    return res


def _stmatrix(k, sh):
    regs = k.ldmatrix(sh[0], 4)
    for num in (1, 2, 4):
        for trans in (False, True):
            k.stmatrix(sh[0], regs[:num], trans=trans)
    return []


def _tma(k, sh):
    tm = k.tensor_map_param("tmap")
    bar = k.shared_array("bar", T.u64, 1)
    k.mbarrier_init(bar[0], 1)
    k.fence_mbarrier_init()
    x = k.mov(5, T.s32)
    for rank in range(1, 6):
        k.mbarrier_arrive_expect_tx(bar[0], 1024)
        k.tma_load(sh[0], tm, [x] * (rank - 1) + [0], bar[0])
    k.mbarrier_wait(bar[0], 0)
    k.fence_proxy_async("shared::cta")
    return []


def _wgmma(k, sh):
    d = k.wgmma_desc(sh[0], lbo=16, sbo=1024, swizzle="128B")
    regs = k.ldmatrix(sh[0], 4)
    res = []
    k.wgmma_fence()
    for ab in ("f16", "bf16"):
        for n in (8, 64, 136, 256):
            acc = k.wgmma_acc(n, ab)
            k.wgmma(acc, d, d, ab_type=ab, scale_d=False, trans_a=True, neg_b=True)
            k.wgmma(acc, regs, d, ab_type=ab, trans_b=True)
            res.append(acc[0])
    for ab in ("s8", "u8"):
        for n in (16, 48, 256):
            acc = k.wgmma_acc(n, ab)
            k.wgmma(acc, d, d, ab_type=ab, scale_d=False)
            k.wgmma(acc, d, d, ab_type=ab, satfinite=True)
            res.append(acc[0])
    k.wgmma_commit()
    k.wgmma_wait(1)
    k.wgmma_wait(0)
    return res


FORMS = {"ldmatrix": (_ldmatrix, ("sm_80", "sm_90", "sm_90a")),
         "mma": (_mma, ("sm_80", "sm_90", "sm_90a")),
         "stmatrix": (_stmatrix, ("sm_90", "sm_90a")),
         "tma": (_tma, ("sm_90", "sm_90a")),
         "wgmma": (_wgmma, ("sm_90a",))}


def _build(form, target):
    m = ptxgen.Module(target)
    with m.kernel("k", maxntid=128) as k:
        out = k.param_ptr("out", T.u32)
        sh = k.shared_array("sh", T.b8, 16384, align=1024)
        res = FORMS[form][0](k, sh)
        for j, r in enumerate(res):
            k.st(out[j], k.bitcast(T.u32, r))
    return m


@pytest.mark.parametrize("target", ["sm_80", "sm_90", "sm_90a"])
@pytest.mark.parametrize("form", sorted(FORMS))
def test_tensor_core_forms_assemble_or_are_refused(ptxas, form, target):
    if target not in FORMS[form][1]:
        with pytest.raises(TargetError):
            _build(form, target)
        return
    cubin, reports = assemble(_build(form, target).to_ptx(), target)
    assert cubin[:4] == b"\x7fELF" and reports
