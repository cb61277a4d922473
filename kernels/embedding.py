"""Embedding row gather: ``out[:] = dequantize(table[token_ptr[0], :])`` (f32).

The token id is read from device memory (an int32), so a replayed CUDA
graph gathers the current token.  An id outside ``[0, n_vocab)`` writes
nothing.  The table is a row-major ``[n_vocab, n]`` tensor in one of the
types the registry says the gather reads (kernels/quants/qtypes.py):

- ``F32`` / ``F16``: plain values (``cvt.f32.f16``);
- ``Q8_0`` (34-byte blocks of 32): ``d:f16 | q:s8[32]``; ``w = d * q``;
- ``Q4_K`` (144-byte blocks of 256): ``d:f16 | dmin:f16 | scales:u8[12] |
  qs:u8[128]``; ``w = (d * sc) * q - (dmin * m)`` with GGML's 6-bit
  ``get_scale_min_k4`` packing;
- ``Q6_K`` (210-byte blocks of 256): ``ql:u8[128] | qh:u8[64] |
  scales:s8[16] | d:f16``; ``w = (d * sc) * (q - 32)``;
- ``BF16``: the top half of an f32;
- ``Q4_0``, ``Q5_0`` (blocks of 32: ``d:f16 [| qh:u32] | qs:u8[16]``):
  ``w = d * (q - 8)``, ``d * (q - 16)``; ``Q4_1``, ``Q5_1`` (``d:f16 |
  m:f16 [| qh:u32] | qs:u8[16]``): ``w = d * q + m``;
- ``Q5_K`` (176-byte blocks of 256): Q4_K's with a plane of fifth bits.

The float operations are those of ``gguf.quants.dequantize`` in the same
order (``mul.rn``/``sub.rn``, no contraction), so the rows match it exactly.
Launch: one thread per output element, ``grid = ceil(n / block)``; ``n``
(a launch parameter) must be a multiple of the format's block size.

With ``rows``, one launch gathers ``R`` rows: ``out[r, :] =
dequantize(table[token_ptr[r], :])`` for ``r = ctaid.y`` in ``[0, R)``,
``grid = (ceil(n / block), R)`` (the prefill's chunk of tokens).

With ``scaled``, every value is multiplied (``mul.rn``) by an f32 parameter
``scale`` after the row is decoded (Gemma's ``sqrt(d_model)``).
"""

from __future__ import annotations

import attrs
import numpy as np

import ptxgen
from ptxgen import registry
from ptxgen.types import f16, f32, s32, u8, u16, u32

from .plan import LaunchGeometry
from .quants.qtypes import names_for, qtype_of
from .spec_fields import block_field, pdl_field, pdl_prologue, target_field

#: the weight types the gather reads (the registry's)
EMBEDDING_QTYPES = names_for("embedding")
#: the 32-weight formats: (offset of m or None, of qh or None, of qs, q's offset)
_LEGACY = {"Q4_0": (None, None, 2, 8), "Q4_1": (2, None, 4, 0), "Q5_0": (None, 2, 6, 16),
           "Q5_1": (2, 4, 8, 0)}


def _canon_qtype(v):
    """GGML's names, given in any case."""
    return v.upper() if isinstance(v, str) else v


@attrs.frozen
class EmbeddingSpec:
    """An embedding-gather kernel.

    Parameters
    ----------
    qtype : str
        One of :data:`EMBEDDING_QTYPES` (GGML's names: "F32", "F16", "BF16",
        "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"), in
        any case.
    rows : bool
        Gather one row per ``ctaid.y`` (token ``token_ptr[ctaid.y]`` into
        ``out + ctaid.y * n``) instead of the one row of ``token_ptr[0]``.
    block : int
    target : str
    scaled : bool
        Multiply the row by the parameter ``scale`` (after ``n_vocab``).
    """

    qtype: str = attrs.field(default="Q4_K", converter=_canon_qtype,
                             validator=attrs.validators.in_(EMBEDDING_QTYPES))
    rows: bool = attrs.field(default=False, validator=attrs.validators.instance_of(bool))
    block: int = block_field(256)
    target: str = target_field()
    pdl: bool = pdl_field()
    scaled: bool = attrs.field(default=False, validator=attrs.validators.instance_of(bool))

    @property
    def kernel_name(self) -> str:
        return (f"embedding_{self.qtype.lower()}" + ("_rows" if self.rows else "")
                + ("_scaled" if self.scaled else ""))

    def row_bytes(self, n: int) -> int:
        """Bytes per table row of ``n`` weights (refuses a bad ``n``)."""
        q = qtype_of(self.qtype)
        bs, ts = q.block_size, q.type_size
        if n <= 0 or n % bs:
            raise ValueError(f"{self.qtype}: row length {n} is not a positive multiple of {bs}")
        return n // bs * ts


def _f16_at(k, addr):
    return k.ld(addr, ty=f16, nc=True).to(f32)


def _mul(k, a, b):
    return k.mul(a, b, rnd="rn")


def _q8_0(k, row, i):
    blk = k.ptr_add(row, k.mul_wide(i >> 5, k.mov(34, u32)))
    d = _f16_at(k, blk[0])
    q = k.ld(blk[(i & 31) + 2], ty="s8", nc=True).to(f32)
    return _mul(k, d, q)


def _q4_k(k, row, i, q5=False):
    """Q4_K, or with ``q5`` Q5_K (176-byte blocks: the fifth bit of weight
    ``32 s + l`` is bit ``s`` of ``qh[l]``, bytes 16..47; qs from byte 48)."""
    blk = k.ptr_add(row, k.mul_wide(i >> 8, k.mov(176 if q5 else 144, u32)))
    j = i & 255
    d = _f16_at(k, blk[0])
    dmin = _f16_at(k, blk[2])
    chunk = j >> 6                   # 64 weights share 32 bytes of qs
    hi = (j >> 5) & 1                # low or high nibbles
    sub = j >> 5                     # sub-block 0..7 (is = 2*chunk + hi)
    byte = k.ld(blk[(48 if q5 else 16) + (chunk << 5) + (j & 31)], ty=u8, nc=True)
    q = k.bfe(byte, hi << 2, 4)
    if q5:
        top = k.ld(blk[16 + (j & 31)], ty=u8, nc=True)
        q = q | (k.bfe(top, sub, 1) << 4)
    s = sub & 3
    a = k.ld(blk[4 + s], ty=u8, nc=True)     # scales[is] (is < 4) / scales[is - 4]
    b = k.ld(blk[8 + s], ty=u8, nc=True)     # scales[is + 4] / scales[is]
    c = k.ld(blk[12 + s], ty=u8, nc=True)    # scales[is + 4] for is >= 4
    low = sub < 4
    sc = k.select(low, a & 63, (c & 15) | ((a >> 6) << 4))
    mn = k.select(low, b & 63, (c >> 4) | ((b >> 6) << 4))
    return _q4_k_value(k, d, dmin, sc, mn, q)


def _q4_k_value(k, d, dmin, sc, mn, q):
    ds = _mul(k, d, sc.to(f32))
    dm = _mul(k, dmin, mn.to(f32))
    return k.sub(_mul(k, ds, q.to(f32)), dm, rnd="rn")


def _legacy(name):
    """The 32-weight formats: ``d (q - zero)``, or ``d q + m`` (``mul.rn``
    then ``add.rn``, as gguf computes them)."""
    m_off, qh_off, qs_off, zero = _LEGACY[name]
    bb = qtype_of(name).type_size

    def value(k, row, i):
        blk = k.ptr_add(row, k.mul_wide(i >> 5, k.mov(bb, u32)))
        j = i & 31
        d = _f16_at(k, blk[0])
        byte = k.ld(blk[qs_off + (j & 15)], ty=u8, nc=True)
        q = k.bfe(byte, (j >> 4) << 2, 4)        # weight j < 16: low nibble of qs[j]
        if qh_off is not None:
            top = k.ld(blk[qh_off + (j >> 3)], ty=u8, nc=True)
            q = q | (k.bfe(top, j & 7, 1) << 4)
        if m_off is None:
            return _mul(k, d, (q.bitcast(s32) - zero).to(f32))
        return k.add(_mul(k, d, q.to(f32)), _f16_at(k, blk[m_off]), rnd="rn")
    return value


def _q6_k(k, row, i):
    blk = k.ptr_add(row, k.mul_wide(i >> 8, k.mov(210, u32)))
    j = i & 255
    half = j >> 7
    l = j & 127
    g = l >> 5                       # which of the four 32-groups
    l2 = l & 31
    ql = k.ld(blk[(half << 6) + ((g & 1) << 5) + l2], ty=u8, nc=True)
    qh = k.ld(blk[128 + (half << 5) + l2], ty=u8, nc=True)
    lo4 = k.bfe(ql, (g >> 1) << 2, 4)
    hi2 = k.bfe(qh, g << 1, 2)
    q = (lo4 | (hi2 << 4)).bitcast(s32) - 32
    sc = k.ld(blk[192 + (half << 3) + (l2 >> 4) + (g << 1)], ty="s8", nc=True)
    d = _f16_at(k, blk[208])
    return _mul(k, _mul(k, d, sc.to(f32)), q.to(f32))


def build(spec: EmbeddingSpec) -> ptxgen.Module:
    """PTX for ``spec``; parameters
    ``table: u8*, token_ptr: s32*, out: f32*, n: u32, n_vocab: u32[, scale: f32]``."""
    m = ptxgen.Module(spec.target)
    q = qtype_of(spec.qtype)
    bs, ts = q.block_size, q.type_size
    with m.kernel(spec.kernel_name, maxntid=spec.block) as k:
        pdl_prologue(k, spec)
        table = k.param_ptr("table", u8, align=4)
        token_ptr = k.param_ptr("token_ptr", s32)
        out = k.param_ptr("out", f32, align=4)
        n = k.param("n", u32)
        n_vocab = k.param("n_vocab", u32)
        scale = k.param("scale", f32) if spec.scaled else None
        if spec.rows:
            r = k.ctaid.y
            tok = k.ld(token_ptr[r])
            out = k.ptr_add(out, k.mul_wide(r, n))        # f32 elements
        else:
            tok = k.ld(token_ptr[0])
        i = k.global_id()
        ok = k.setp("lt", i, n, combine=("and", tok >= 0))
        ok = k.setp("lt", tok.bitcast(u32), n_vocab, combine=("and", ok))
        with k.if_(ok):
            row_bytes = (n // bs) * ts if bs > 1 else n * ts
            row = k.ptr_add(table, k.mul_wide(tok.bitcast(u32), row_bytes))
            if spec.qtype == "F32":
                val = k.ld(row[i << 2], ty=f32, nc=True)
            elif spec.qtype == "F16":
                val = _f16_at(k, row[i << 1])
            elif spec.qtype == "BF16":
                # the top half of an f32
                val = (k.ld(row[i << 1], ty=u16, nc=True).to(u32) << 16).bitcast(f32)
            elif spec.qtype in _LEGACY:
                val = _legacy(spec.qtype)(k, row, i)
            elif spec.qtype == "Q5_K":
                val = _q4_k(k, row, i, q5=True)
            else:
                val = {"Q8_0": _q8_0, "Q4_K": _q4_k, "Q6_K": _q6_k}[spec.qtype](k, row, i)
            if scale is not None:
                val = _mul(k, val, scale)
            k.st(out[i], val)
    return m


def launch_geometry(spec: EmbeddingSpec, n: int, rows: int = 1):
    """The launch for ``rows`` rows (``spec.rows``; else one) of ``n`` weights."""
    if rows != 1 and not spec.rows:
        raise ValueError(f"{rows} rows need EmbeddingSpec(rows=True)")
    return LaunchGeometry(spec.kernel_name, ((n + spec.block - 1) // spec.block, rows), spec.block)


def reference(table_rows: np.ndarray, token: int) -> np.ndarray:
    """float64 copy of the already-dequantized row ``token``."""
    return np.asarray(table_rows[token], dtype=np.float64)


CANONICAL = {
    "embedding_q4_k": EmbeddingSpec(),
    "embedding_q6_k": EmbeddingSpec(qtype="Q6_K"),
    "embedding_f16": EmbeddingSpec(qtype="F16"),
    "embedding_q4_k_rows": EmbeddingSpec(rows=True),
    "embedding_q6_k_scaled": EmbeddingSpec(qtype="Q6_K", scaled=True),
}

registry.register("embedding", EmbeddingSpec, build, CANONICAL, doc=__doc__.splitlines()[0],
                  launch_geometry=launch_geometry)
