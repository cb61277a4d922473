"""The builder's pieces of a cross-CTA spin-wait: ``nanosleep`` (constant
or register), acquire loads, release reductions and the global timer."""

import pytest

import ptxgen
from ptxgen.errors import PtxBuildError
from ptxgen.types import u32


def _body(k):
    c = k.param_ptr("c", u32)
    t = k.param("t", u32)
    with k.while_(lambda: k.ld(c[0], sem="acquire", scope="gpu") < 3):
        k.nanosleep(20)
        k.nanosleep(t)
    k.red("add", c[1], 1, sem="release", scope="gpu")
    k.st(c[2], k.globaltimer().to(u32))


def test_spin_wait_forms_emit_their_ptx():
    m = ptxgen.Module("sm_80")
    with m.kernel("spin") as k:
        _body(k)
    text = m.to_ptx()
    for line in ("ld.acquire.gpu.global.u32", "nanosleep.u32 \t20;", "red.release.gpu.global.add.u32",
                 "mov.u64 \t%rd", "%globaltimer"):
        assert line in text, line
    assert text.count("nanosleep.u32") == 2


@pytest.mark.parametrize("bad", [-1, 1_000_001])
def test_nanosleep_refuses_a_duration_outside_its_range(bad):
    m = ptxgen.Module("sm_80")
    with pytest.raises(PtxBuildError, match="nanosleep takes 0..1000000 ns"):
        with m.kernel("k") as k:
            k.nanosleep(bad)


def test_ptxas_takes_the_spin_wait_forms(ptxas):
    from ptxgen.ptxas import assemble
    m = ptxgen.Module("sm_90")
    with m.kernel("spin") as k:
        _body(k)
    assemble(m.to_ptx(), "sm_90")
