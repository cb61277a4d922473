"""Tensor-core instruction methods of the kernel builder.

``mma.sync`` (a warp's 16x8 tile), ``ldmatrix``/``stmatrix`` (8x8 b16
matrices between shared memory and a warp's registers), the sm_90a
warpgroup path (``wgmma.fence``, ``wgmma.mma_async`` with shared-memory
matrix descriptors, ``wgmma.commit_group``/``wait_group``) and TMA
(``cp.async.bulk.tensor`` with a tensor map passed as a kernel parameter).
Fragment layouts, descriptors and the rounding model are in docs/dsl.md
("Tensor cores") and :mod:`ptxgen.smem_layout`.
"""

from __future__ import annotations

from . import types as T
from .errors import PtxBuildError, PtxTypeError
from .instr import Vec
from .smem_layout import SWIZZLE_CODE, SWIZZLES
from .values import Imm, NotPred, Reg, Symbol, TensorRef, as_operand

__all__ = ["TensorCoreMixin", "MMA_SHAPES", "wgmma_n_ok"]

#: shape -> (K, registers of A, registers of B, input types)
MMA_SHAPES = {"m16n8k16": (16, 4, 2, ("f16", "bf16")),
              "m16n8k8": (8, 2, 1, ("f16", "bf16")),
              "m16n8k32": (32, 4, 2, ("s8", "u8"))}


def wgmma_n_ok(n: int, ab_type: str) -> bool:
    """Whether ``m64nNk*`` exists for ``ab_type`` (PTX ISA, wgmma shapes)."""
    if ab_type in ("s8", "u8"):
        return n in (8, 16, 24, 32) or (n % 16 == 0 and 48 <= n <= 256)
    return n % 8 == 0 and 8 <= n <= 256


def _ty(x):
    return T.type_by_name(x)


class TensorCoreMixin:
    # ------------------------------------------------------------ mma.sync
    def mma(self, a, b, c, *, shape="m16n8k16", ab_type=T.f16, satfinite=False):
        """``mma.sync.aligned.<shape>.row.col``: a warp's D (16x8) = A.B + C.

        ``shape`` is ``m16n8k16`` or ``m16n8k8`` (``ab_type`` f16 or bf16, C
        and D f32) or ``m16n8k32`` (``ab_type`` s8 or u8, or a pair for mixed
        signs; C and D s32; ``satfinite`` clamps D instead of wrapping).  A is
        4 (k8: 2) b32 registers, B 2 (k8: 1), C 4; returns D's 4 registers.
        Every lane of the warp must execute it.  Fragment layouts: docs/dsl.md.
        """
        if shape not in MMA_SHAPES:
            raise PtxBuildError(f"mma shape {shape!r} is not one of {', '.join(MMA_SHAPES)}")
        kk, na, nb, kinds = MMA_SHAPES[shape]
        ta, tb = (ab_type if isinstance(ab_type, tuple) else (ab_type, ab_type))
        ta, tb = _ty(ta), _ty(tb)
        for t in (ta, tb):
            if t.name not in kinds:
                raise PtxTypeError(f"mma.{shape} multiplies {' or '.join(kinds)}, "
                                   f"got {t.name}")
        integer = ta.is_int
        if not integer and ta is not tb:
            raise PtxTypeError(f"mma.{shape}: A and B must both be {ta.name}, B is {tb.name}")
        if satfinite and not integer:
            raise PtxBuildError("mma: .satfinite is for the integer (s8/u8) shapes")
        acc = T.s32 if integer else T.f32
        frag = ("b32",) if integer else ("b32", ta.name + "x2")
        for what, regs, n, types in (("a", a, na, frag), ("b", b, nb, frag),
                                     ("c", c, 4, (acc.name,))):
            if len(regs) != n:
                raise PtxTypeError(f"mma.{shape}: {what} takes {n} registers, got {len(regs)}")
            for r in regs:
                ty = getattr(r, "type", None)
                if not isinstance(r, Reg) or ty is None or ty.name not in types:
                    raise PtxTypeError(
                        f"mma.{shape}: {what} registers must be {' or '.join(types)} "
                        f"(ptxas refuses other types here), got {r!r}")
        d = tuple(self.reg(acc) for _ in range(4))
        mods = ["sync", "aligned", shape, "row", "col"] + (["satfinite"] if satfinite else [])
        self.emit("mma", mods, [acc, ta, tb, acc], [Vec(d), Vec(a), Vec(b), Vec(c)],
                  _own_frames=1)
        return d

    def mma_m16n8k16(self, a, b, c, *, ab_type=T.f16):
        """``mma.sync.aligned.m16n8k16.row.col.f32.{f16,bf16}`` (see :meth:`mma`)."""
        return self.mma(a, b, c, shape="m16n8k16", ab_type=ab_type)

    # ----------------------------------------------------- ldmatrix/stmatrix
    def _matrix_addr(self, addr, what):
        addr = self._as_addr(addr)
        if addr.space != "shared":
            raise PtxBuildError(f"{what} works on .shared memory, got .{addr.space}")
        return addr

    def ldmatrix(self, addr, num=4, *, trans=False):
        """``ldmatrix.sync.aligned.m8n8.x{num}[.trans].shared.b16`` (sm_75):
        ``num`` (1, 2, 4) 8x8 matrices of 16-bit elements from shared memory.
        Lane ``8i + r`` gives the address of row ``r`` of matrix ``i`` (16
        contiguous, 16-byte aligned bytes); register ``i`` of lane ``l`` gets
        row ``l // 4``, columns ``2 (l % 4)`` and ``+1`` of matrix ``i`` (of
        its transpose with ``trans``).  Returns ``num`` b32 registers."""
        if num not in (1, 2, 4):
            raise PtxBuildError(f"ldmatrix loads 1, 2 or 4 matrices, got {num!r}")
        addr = self._matrix_addr(addr, "ldmatrix")
        d = tuple(self.reg(T.b32) for _ in range(num))
        mods = ["sync", "aligned", "m8n8", f"x{num}"] + (["trans"] if trans else []) + ["shared"]
        self.emit("ldmatrix", mods, [T.b16], [Vec(d), addr], _own_frames=1)
        return d

    def stmatrix(self, addr, regs, *, trans=False):
        """``stmatrix.sync.aligned.m8n8.x{n}[.trans].shared.b16`` (sm_90):
        the inverse of :meth:`ldmatrix` for ``n = len(regs)`` matrices."""
        regs = tuple(regs)
        if len(regs) not in (1, 2, 4):
            raise PtxBuildError(f"stmatrix stores 1, 2 or 4 matrices, got {len(regs)}")
        addr = self._matrix_addr(addr, "stmatrix")
        mods = ["sync", "aligned", "m8n8", f"x{len(regs)}"] + (["trans"] if trans else []) \
            + ["shared"]
        return self.emit("stmatrix", mods, [T.b16], [addr, Vec(regs)], dsts=0, _own_frames=1)

    # ------------------------------------------------------ shared layouts
    def swizzle(self, offset, mode):
        """A u32 shared byte offset with ``mode`` ("none", "32B", "64B",
        "128B") applied: the 16-byte chunk bits XORed with the bits above the
        128-byte row (see :mod:`ptxgen.smem_layout`)."""
        if mode not in SWIZZLES:
            raise PtxBuildError(f"unknown swizzle {mode!r}; one of {', '.join(SWIZZLES)}")
        if mode == "none":
            return offset
        mask = {"32B": 0x10, "64B": 0x30, "128B": 0x70}[mode]
        return offset ^ ((offset >> 3) & mask)

    def wgmma_desc(self, addr, *, lbo, sbo, swizzle="none"):
        """A wgmma matrix descriptor (a b64 register) for the matrix at shared
        address ``addr`` (a shared Address/array, or a u32 register holding a
        shared byte offset) with constant leading/stride byte offsets and
        swizzle; matrix base offset 0 (a swizzled matrix starts on its
        pattern's boundary).  See :func:`ptxgen.smem_layout.matrix_descriptor`."""
        if swizzle not in SWIZZLE_CODE:
            raise PtxBuildError(f"unknown swizzle {swizzle!r}; one of {', '.join(SWIZZLE_CODE)}")
        for what, v in (("lbo", lbo), ("sbo", sbo)):
            if not isinstance(v, int) or v < 0 or v % 16 or v >= 1 << 18:
                raise PtxBuildError(f"wgmma_desc: {what}={v!r} must be a multiple of 16 "
                                    "below 2**18")
        a = self._shared_u32(addr, "wgmma_desc")
        lo = self.cvt(T.u64, (a >> 4) & 0x3FFF)
        hi = (lbo >> 4) << 16 | (sbo >> 4) << 32 | SWIZZLE_CODE[swizzle] << 62
        return self.bitcast(T.b64, lo | hi if hi else lo)

    def _shared_u32(self, addr, what):
        if isinstance(addr, Reg) and addr.type.bits == 32 and addr.type.is_int:
            return addr
        if isinstance(addr, Symbol):
            addr = addr[0]
        addr = self._as_addr(addr)
        if addr.space != "shared":
            raise PtxBuildError(f"{what} takes a .shared address, got .{addr.space}")
        base = self.mov(addr.base, T.u32) if isinstance(addr.base, Symbol) else addr.base
        if base.type.bits != 32:
            raise PtxTypeError(f"{what} needs a 32-bit shared address, got {base!r}")
        if base.type is not T.u32:
            base = self.bitcast(T.u32, base)
        return base + addr.offset if addr.offset else base

    # --------------------------------------------------------------- wgmma
    def wgmma_fence(self):
        """``wgmma.fence.sync.aligned`` (sm_90a): before the first
        :meth:`wgmma` of a sequence, and whenever the accumulator or A
        registers were written by other instructions since."""
        return self.emit("wgmma.fence", ["sync", "aligned"], [], [], dsts=0, _own_frames=1)

    def wgmma_commit(self):
        """``wgmma.commit_group.sync.aligned`` (sm_90a): the warpgroup's
        pending :meth:`wgmma` operations form one group."""
        return self.emit("wgmma.commit_group", ["sync", "aligned"], [], [], dsts=0,
                         _own_frames=1)

    def wgmma_wait(self, pending=0):
        """``wgmma.wait_group.sync.aligned N`` (sm_90a): wait until at most
        ``pending`` committed groups are in flight; only then may the
        accumulators of the others be read or written."""
        if not isinstance(pending, int) or isinstance(pending, bool) or not 0 <= pending <= 7:
            raise PtxBuildError(f"wgmma.wait_group takes a constant 0..7, got {pending!r}")
        return self.emit("wgmma.wait_group", ["sync", "aligned"], [], [Imm(pending, T.u32)],
                         dsts=0, _own_frames=1)

    def wgmma_acc(self, n, ab_type=T.f16, init=0):
        """The ``n / 2`` accumulator registers (Vars) of an ``m64n{n}`` wgmma,
        f32 for f16/bf16 inputs, s32 for s8/u8, each set to ``init``."""
        ty = T.s32 if _ty(ab_type).is_int else T.f32
        return tuple(self.var(ty, init) for _ in range(n // 2))

    def wgmma(self, acc, a, b_desc, *, ab_type=T.f16, scale_d=True, neg_a=False, neg_b=False,
              trans_a=False, trans_b=False, satfinite=False):
        """``wgmma.mma_async.sync.aligned.m64n{N}k{K}`` (sm_90a): the
        warpgroup's (128 threads, 4 warps) D (64 x N) = A.B + D, or A.B when
        ``scale_d`` is false (a Python bool or a predicate register).

        ``acc``: the N/2 accumulator Vars (:meth:`wgmma_acc`), updated in
        place and returned; N = 2 len(acc).  ``a``: a matrix descriptor
        (:meth:`wgmma_desc`) or 4 b32 registers (f16/bf16 only); ``b_desc``:
        B's descriptor.  K = 16 for f16/bf16 (f32 accumulators), 32 for s8/u8
        (s32).  ``neg_a``/``neg_b`` negate A/B and ``trans_a``/``trans_b``
        read A/B M- or N-major (f16/bf16 only).  Asynchronous: fence before
        (:meth:`wgmma_fence`), then :meth:`wgmma_commit` and
        :meth:`wgmma_wait` before touching ``acc``."""
        acc = tuple(acc)
        ta, tb = (ab_type if isinstance(ab_type, tuple) else (ab_type, ab_type))
        ta, tb = _ty(ta), _ty(tb)
        integer = ta.is_int
        kinds = ("s8", "u8") if integer else ("f16", "bf16")
        if ta.name not in kinds or tb.name not in kinds:
            raise PtxTypeError(f"wgmma multiplies f16, bf16, s8 or u8, got "
                               f"{ta.name} and {tb.name}")
        if ta is not tb:
            raise PtxTypeError(f"wgmma with A {ta.name} and B {tb.name}: mixed types need "
                               f"PTX ISA 8.4 (ptxgen emits at most 8.0); use one type")
        n = 2 * len(acc)
        if not wgmma_n_ok(n, ta.name):
            raise PtxBuildError(f"wgmma {ta.name}: {len(acc)} accumulators make N = {n}, which "
                                f"m64nNk{32 if integer else 16} does not allow")
        dty = T.s32 if integer else T.f32
        for r in acc:
            if not getattr(r, "mutable", False) or r.type is not dty:
                raise PtxTypeError(f"wgmma accumulators must be {dty.name} Vars "
                                   f"(k.wgmma_acc), got {r!r}")
        if integer and (neg_a or neg_b or trans_a or trans_b):
            raise PtxBuildError("wgmma s8/u8 takes no negation or transposition")
        if satfinite and not integer:
            raise PtxBuildError("wgmma: .satfinite is for s8/u8")
        if isinstance(a, (tuple, list)):
            if integer:
                raise PtxBuildError("wgmma: A from registers is built for f16/bf16 only")
            if trans_a:
                raise PtxBuildError("wgmma: A from registers cannot be transposed")
            a_op = Vec(tuple(a))
        else:
            a_op = a
        scale = self._pred_of(scale_d)
        ops = [Vec(acc), a_op, b_desc, scale]
        if not integer:
            ops += [Imm(-1 if neg_a else 1, T.s32), Imm(-1 if neg_b else 1, T.s32)]
            if not isinstance(a_op, Vec):
                ops.append(Imm(int(trans_a), T.s32))
            ops.append(Imm(int(trans_b), T.s32))
        shape = f"m64n{n}k{32 if integer else 16}"
        mods = ["sync", "aligned", shape] + (["satfinite"] if satfinite else [])
        self.emit("wgmma.mma_async", mods, [dty, ta, tb], ops, _own_frames=1)
        return acc

    def _pred_of(self, v):
        if isinstance(v, bool):
            r = self.mov(Imm(int(v), T.u32), T.u32)
            return self.setp("ne", r, 0)
        if isinstance(v, NotPred) or (isinstance(v, Reg) and v.type.is_pred):
            return v
        raise PtxTypeError(f"scale_d must be a bool or a predicate register, got {v!r}")

    # ----------------------------------------------------------------- TMA
    def tensor_map_param(self, name):
        """Declare a tensor-map parameter (``.param .align 64 .b8 name[128]``,
        the by-value ``CUtensorMap`` the driver's
        :func:`ptxgen.driver.tensor_map.encode_tiled` makes, or an emulator
        :class:`ptxgen.tensor_map.TensorMap`) and return its generic address
        (a u64 register: ``mov.b64`` + ``cvta.param.u64``) for :meth:`tma_load`."""
        p = self._declare_param(name, T.b8, align=64, count=128)
        raw = self.reg(T.u64)
        self.emit("mov", [], [T.b64], [raw, p.symbol], _own_frames=1)
        out = self.reg(T.u64)
        self.emit("cvta", ["param"], [T.u64], [out, raw], _own_frames=1)
        return out

    def tma_load(self, dst, tmap, coords, mbar, *, guard=None):
        """``cp.async.bulk.tensor.{n}d.shared::cluster.global.tile.mbarrier::
        complete_tx::bytes`` (sm_90): the TMA unit copies the box of the tensor
        map ``tmap`` (from :meth:`tensor_map_param`) that starts at
        ``coords`` (n s32 element coordinates, innermost first) to shared
        ``dst`` (128-byte aligned; 1024 for a 128B swizzle), filling elements
        outside the tensor per the map, and completes the box's bytes on
        the mbarrier ``mbar``.  One thread issues it; pair it with
        :meth:`mbarrier_arrive_expect_tx` for the box's bytes."""
        coords = tuple(coords)
        if not 1 <= len(coords) <= 5:
            raise PtxBuildError(f"tma_load takes 1 to 5 coordinates, got {len(coords)}")
        cs = []
        for c in coords:
            if isinstance(c, Reg) and (c.type.bits != 32 or not c.type.is_int):
                raise PtxTypeError(f"a tensor coordinate is a 32-bit integer, got {c!r}")
            cs.append(as_operand(c, T.s32))
        if not isinstance(tmap, Reg) or tmap.type.bits != 64:
            raise PtxTypeError(f"tma_load: the tensor map is its u64 generic address "
                               f"(k.tensor_map_param), got {tmap!r}")
        dst, mbar = self._as_addr(dst), self._as_addr(mbar)
        for what, x in (("destination", dst), ("mbarrier", mbar)):
            if x.space != "shared":
                raise PtxBuildError(f"tma_load: the {what} must be in .shared memory, "
                                    f"got .{x.space}")
        mods = [f"{len(coords)}d", "shared::cluster", "global", "tile",
                "mbarrier::complete_tx::bytes"]
        return self.emit("cp.async.bulk.tensor", mods, [], [dst, TensorRef(tmap, cs), mbar],
                         guard=guard, dsts=0, _own_frames=1)
