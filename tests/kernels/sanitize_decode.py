"""Run every decode kernel once on small shapes, then a tiny Llama model for
a few steps eagerly and from a CUDA graph (PDL launches, fused RMSNorm GEMVs,
fused RoPE + KV append; again with the persistent FFN kernel), for
compute-sanitizer.

``compute-sanitizer --tool memcheck python3 tests/kernels/sanitize_decode.py``
(and ``--tool racecheck``); prints OK when every launch finished.  The
inputs are drawn from a fresh seed, printed first; ``--seed N`` reuses one.
"""

import argparse
import secrets

import numpy as np

from ptxgen import driver
from ptxgen.driver import ops_decode as ops
from ptxgen.kernels import quants


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=None, help="input seed (default: a fresh one)")
    seed = ap.parse_args(argv).seed
    seed = secrets.randbits(32) if seed is None else seed
    print(f"seed={seed}", flush=True)
    D = driver.DeviceArray.from_numpy
    rng = np.random.default_rng(seed)
    f = lambda *s: rng.standard_normal(s).astype(np.float32)      # noqa: E731
    i32 = lambda v: D(np.array([v], np.int32))                     # noqa: E731
    ops.rmsnorm(D(f(3, 4099)), D(f(4099)), 1e-5)
    ops.rmsnorm(D(f(2, 4096)), D(f(4096)), 1e-5, residual=D(f(2, 4096)))
    ops.rope(D(f(32, 128)), D(f(8, 128)), i32(77), theta=500000.0,
             scaling=dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_context=8192))
    ops.rope(D(f(6, 64)), D(f(2, 64)), i32(5), layout="interleaved")
    ops.swiglu(D(f(14339)), D(f(14339)))
    kc = D(rng.standard_normal((8, 2048, 128)).astype(np.float16))
    vc = D(rng.standard_normal((8, 2048, 128)).astype(np.float16))
    for L in (1, 7, 1000, 2048):
        # the tensor-core split (the default here; its keys dealt round robin
        # from two rounds on, and with interleave=1 from one, which L = 2048
        # reaches) and the CUDA-core split, each with early_kv
        ops.flash_decode(D(f(32, 128)), kc, vc, i32(L))
        ops.flash_decode(D(f(32, 128)), kc, vc, i32(L), early_kv=True)
        ops.flash_decode(D(f(32, 128)), kc, vc, i32(L), interleave=1)
        ops.flash_decode(D(f(32, 128)), kc, vc, i32(L), interleave=1, early_kv=True)
        ops.flash_decode(D(f(32, 128)), kc, vc, i32(L), mma=False)
        ops.flash_decode(D(f(32, 128)), kc, vc, i32(L), mma=False, early_kv=True)
        # the L1-bypassing copy of the loop from one round on (L = 2048; the
        # default's six rounds are past this cache)
        ops.flash_decode(D(f(32, 128)), kc, vc, i32(L), bypass_from=1)
    ops.kv_append(D(f(8, 128)), D(f(8, 128)), kc, vc, i32(2047))
    for qt in ("Q4_K", "Q6_K", "Q8_0"):
        raw = quants.quantize(f(3, 512), qt)
        ops.embedding(D(raw.reshape(-1)), qt, i32(2), n=512)
    ops.embedding(D(f(3, 100).astype(np.float16)), "F16", i32(1))
    ops.argmax(D(f(128256)))
    from ptxgen.driver import ops_gemv
    q4 = lambda *s: D(quants.quantize(f(*s), "Q4_K"))             # noqa: E731
    # the default ring (part of its prologue after the x loads: ahead=1)
    ops_gemv.gemv(q4(4096 + 40, 4096), D(f(4096)), "Q4_K")
    # K = 14336: two CTAs of 448 threads per SM (the down projection's ring)
    ops_gemv.gemv(q4(300, 14336), D(f(14336)), "Q4_K", residual=D(f(300)))
    driver.get_device().synchronize()
    import tempfile
    from ptxgen.llm.gguf.synth import write_synthetic_llama
    from ptxgen.llm import Model
    with tempfile.TemporaryDirectory() as tmp:
        path = tmp + "/tiny.gguf"
        write_synthetic_llama(path, n_layers=2, hidden=256, ffn=512, n_heads=4, n_kv_heads=2,
                              vocab=512, context_length=64, seed=seed)
        m = Model.from_gguf(path, backend="cuda", capacity=16, progress=False)
        m.generate([1, 2, 3], 3, mode="eager")
        m.generate([1, 2, 3], 3, mode="graph")
        # RMSNorms folded into the GEMVs (ring, dp4a) and the CUDA-core flash decode
        m = Model.from_gguf(path, backend="cuda", capacity=16, progress=False,
                                 fuse_norm=True, flash_knobs={"mma": False})
        m.generate([1, 2, 3], 3, mode="eager")
        m.generate([1, 2, 3], 3, mode="graph")
    driver.get_device().synchronize()
    print("OK")


if __name__ == "__main__":
    main()
