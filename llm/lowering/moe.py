"""A mixture of experts' FFN lowered to launches, for one token (the decode
step) and for the rows of a prompt chunk.

The block ``s.moe_ffn(h, e: Experts, residual)`` computes llama.cpp's
``build_moe_ffn`` (softmax gating, the file's ``norm_w``):

- the router (:mod:`ptxgen.kernels.moe.router`): the expert logits of the
  normed ``h`` (for one token the router does the RMSNorm too and writes
  ``h``), their softmax, the top ``n_used`` ids and their weights,
  written to device buffers, so which experts run is decided on the device
  and the decode step stays one graph replay;
- the experts' gate and up GEMV with SwiGLU over the selected experts only
  (:mod:`ptxgen.kernels.moe.expert_gemv`, ids read from the router's
  buffer), then the down GEMV of each expert's activations;
- the weighted sum of the experts' outputs added to the residual: for one
  token in the down GEMV's launch (``ExpertGemvSpec.combine``: the last
  CTA of each row group sums the experts' rows in slot order), for a
  chunk by its own launch (:mod:`ptxgen.kernels.moe.combine`).

For a chunk, :func:`chunk_path` (the ``moe_ffn`` tuning table, by the
chunk's rows) picks one of two ways:

- ``"gemv"``: the router, the experts' gate/up and down GEMVs and the
  combine over its rows (the experts' GEMV with
  ``tokens``: grid.z is the token), each token reading its own experts'
  rows, so a prompt's experts' weights are read once per token that chose
  them;
- ``"gemm"``: after the router, the chunk's (token, slot) pairs grouped by
  expert on the device (:mod:`ptxgen.kernels.moe.group`), then the
  experts' grouped GEMM (:mod:`ptxgen.kernels.moe.expert_gemm`) for the
  gate (its values into the activations' rows), the up projection with
  the SwiGLU epilogue (reading the gate values there) and the down
  projection, each pair's rows where the combine reads them; the grids
  are sized for the bucket and read the device counts, so there is no
  host sync.  Weight types the GEMM lacks run the GEMV.  Where the table
  says ``kernel`` ``"wgmma"`` and the GEMMs build for sm_90a
  (:func:`chunk_path`), the chunk's rows are first permuted into the
  experts' order as f16 (:mod:`ptxgen.kernels.moe.permute`) and the three
  GEMMs are the warpgroup kernel's (:mod:`ptxgen.kernels.moe.expert_wgmma`):
  the gate values and the f16 activations in that order, the down
  projection into each pair's row, where the combine reads it.

The experts' weights are the file's 3-D ``*_exps`` tensors as they are
stored (expert ``e`` at ``e`` times an expert's bytes).
"""

from __future__ import annotations

import attrs
import numpy as np

from ptxgen.driver.executor import TensorMapOf
from ptxgen.kernels import gemm as _gemm
from ptxgen.kernels import tuning as _tuning
from ptxgen.kernels.moe import (combine, expert_gemm, expert_gemv, expert_wgmma, group, permute,
                                router)
from ptxgen.kernels.spec_fields import has_griddepcontrol
from ptxgen.target import TARGETS

from . import matmul
from .common import Lowering, TensorInfo

__all__ = ["Experts", "decode_ffn", "chunk_ffn", "chunk_path"]


@attrs.frozen
class Experts:
    """A layer's mixture of experts: the router and the 3-D expert weights
    (GGUF names), and whether the chosen weights are renormalised."""

    layer: int
    router: str
    gate: str
    up: str
    down: str
    norm_w: bool = True

    @classmethod
    def of_layer(cls, i: int, norm_w: bool = True) -> "Experts":
        p = f"blk.{i}."
        return cls(i, p + "ffn_gate_inp.weight", p + "ffn_gate_exps.weight",
                   p + "ffn_up_exps.weight", p + "ffn_down_exps.weight", norm_w)

    @property
    def prefix(self) -> str:
        return f"blk.{self.layer}."


def _expert_info(lw: Lowering, name: str) -> TensorInfo:
    """One expert's matrix of the 3-D tensor ``name``: its type and ``[rows, cols]``."""
    shape = tuple(int(d) for d in lw.file.shape(name))
    if len(shape) != 3:
        raise ValueError(f"tensor {name!r} of shape {shape} is not a 3-D experts' tensor")
    return TensorInfo(name, lw.file.qtype(name), shape[1:])


def _plans(lw: Lowering, e: Experts, tuning, *, tokens: bool, pdl: bool):
    """The router, gate/up, down and combine specs of ``e``."""
    hp = lw.hp
    tg, tu, td = (_expert_info(lw, n) for n in (e.gate, e.up, e.down))
    if (tg.qtype, tg.shape) != (tu.qtype, tu.shape):
        raise ValueError(f"{e.prefix}: experts' gate {tg.qtype}{tg.shape} and up "
                         f"{tu.qtype}{tu.shape} must share a type and shape")
    rq = lw.file.qtype(e.router)
    if rq != "F32":
        raise ValueError(f"{e.router} is {rq}; the router reads F32 (llama.cpp keeps it F32)")
    rs = router.MoeRouterSpec(hp.n_expert, hp.n_expert_used, hp.hidden, rows=tokens,
                              norm_w=e.norm_w, target=lw.target, pdl=pdl)
    gp, _ = matmul.gemv_plan(tg, "swiglu", lw.target, tuning)
    dp, _ = matmul.gemv_plan(td, "none", lw.target, tuning)
    gs = expert_gemv.ExpertGemvSpec(gp, tokens=tokens, pdl=pdl)
    ds = expert_gemv.ExpertGemvSpec(dp, x_slot=True, tokens=tokens, pdl=pdl)
    cs = combine.MoeCombineSpec(hp.n_expert_used, rows=tokens, target=lw.target, pdl=pdl)
    return rs, gs, ds, cs, tg, td


def _launches(lw: Lowering, e: Experts, x, residual, bufs, specs, t_rows, n_ptr=None,
              norm=None):
    hp = lw.hp
    NU, F, H = hp.n_expert_used, hp.expert_ffn, hp.hidden
    rs, gs, ds, cs, tg, td = specs
    _, _, ids, _, act, down = bufs
    wg, wu, wd = _expert_weights(lw, e)
    rows, extra = _row_count(n_ptr)
    p = e.prefix
    _router(lw, e, x, bufs, rs, t_rows, n_ptr, norm)
    if norm is not None:
        x = norm[2]                             # the normed row the router wrote
    lw.add("MoeMulMatSwiGLU", p + "ffn_gate_up_exps", [wg, wu, x, ids] + extra, [act],
           [lw.launch("moe_gemv", gs, expert_gemv.launch_geometry(gs, F, NU, t_rows), w=wg,
                      wu=wu, x=x, y=act, m=F, ids=ids, **rows)])
    geom = expert_gemv.launch_geometry(ds, H, NU, t_rows)
    if ds.combine:
        # one token: the weighted sum into the residual in the down GEMV itself
        wts = bufs[3]
        counter = lw.g.buffer(p + "moe_down_counter", (expert_gemv.counter_words(ds, H),),
                              np.uint32, "state",
                              np.zeros(expert_gemv.counter_words(ds, H), np.uint32))
        lw.add("MoeMulMatSum", p + "ffn_down_exps", [wd, act, ids, wts, residual, counter],
               [down, residual, counter],
               [lw.launch("moe_gemv", ds, geom, w=wd, x=act, y=down, m=H, ids=ids,
                          weights=wts, r=residual, out=residual, counter=counter)])
        return residual
    lw.add("MoeMulMat", p + "ffn_down_exps", [wd, act, ids] + extra, [down],
           [lw.launch("moe_gemv", ds, geom, w=wd, x=act, y=down, m=H, ids=ids, **rows)])
    return _combine(lw, e, residual, bufs, cs, t_rows, n_ptr)


def _router(lw: Lowering, e: Experts, x, bufs, rs, t_rows, n_ptr, norm=None):
    """The router launch: ``x``'s expert ids and weights for ``t_rows``
    rows (``n_ptr``: the device row count, None for one token); with
    ``norm = (nw, eps, h)`` (``rs.norm``) of ``x``'s RMSNorm, which it
    also writes to ``h``."""
    logits, counter, ids, wts, _, _ = bufs
    wr, _ = lw.weight(e.router)
    rows, extra = _row_count(n_ptr)
    ins, outs = [wr, x, counter] + extra, [ids, wts, counter]
    if norm is not None:
        nw, eps, h = norm
        rows = dict(rows, nw=nw, eps=float(eps), h=h)
        ins, outs = ins + [nw], outs + [h]
    lw.add("MoeRouter", e.prefix + "ffn_router", ins, outs,
           [lw.launch("moe_router", rs, router.launch_geometry(rs, t_rows), w=wr, x=x,
                      logits=logits, counter=counter, ids=ids, weights=wts, **rows)])


def _combine(lw: Lowering, e: Experts, residual, bufs, cs, t_rows, n_ptr):
    """The experts' outputs weighted and added into ``residual``."""
    _, _, _, wts, _, down = bufs
    rows, extra = _row_count(n_ptr)
    lw.add("MoeCombine", e.prefix + "ffn_moe_sum", [down, wts, residual] + extra, [residual],
           [lw.launch("moe_combine", cs, combine.launch_geometry(cs, lw.hp.hidden, t_rows),
                      y=down, weights=wts, r=residual, out=residual, m=lw.hp.hidden, **rows)])
    return residual


def _row_count(n_ptr):
    """The launches' ``t_ptr`` argument and the buffer it reads, where rows
    are counted on the device."""
    if n_ptr is None:
        return {}, []
    return {"t_ptr": n_ptr}, [n_ptr.buffer if hasattr(n_ptr, "buffer") else n_ptr]


def decode_ffn(lw: Lowering, x, e: Experts, residual, *, scratch, tuning, norm=None):
    """One token's MoE FFN: ``x`` the normed f32 ``[hidden]`` or, with
    ``norm = (nw, eps, h)``, the row the router RMSNorms (weight ``nw``)
    into ``h`` itself; added into ``residual``; ``scratch(name, shape,
    dtype)`` gives reused activations."""
    hp = lw.hp
    E, NU, F, H = hp.n_expert, hp.n_expert_used, hp.expert_ffn, hp.hidden
    rs, gs, ds, cs, tg, td = _plans(lw, e, tuning, tokens=False, pdl=False)
    if norm is not None:
        rs = attrs.evolve(rs, norm=True)
    specs = (rs, gs, ds.evolve(combine=True), cs, tg, td)
    counter = lw.g.buffer(e.prefix + "moe_counter", (1,), np.uint32, "state",
                          np.zeros(1, np.uint32))
    bufs = (scratch("moe_logits", (E,), np.float32), counter,
            scratch("moe_ids", (NU,), np.int32), scratch("moe_weights", (NU,), np.float32),
            scratch("moe_act", (NU, F), np.float32), scratch("moe_down", (NU, H), np.float32))
    return _launches(lw, e, x, residual, bufs, specs, 1, norm=norm)


def chunk_path(lw: Lowering, e: Experts, rows: int) -> dict:
    """How a chunk of ``rows`` runs ``e``: the ``moe_ffn`` tuning table's
    config (``path`` ``"gemv"`` or ``"gemm"``, the latter with ``kernel``
    ``"wgmma"`` and the warpgroup configs ``wgmma_gate_up`` and
    ``wgmma_down`` where the table says so and the warpgroup GEMM can run
    the weights, else ``"mma"`` and the GEMM configs ``gate_up`` and
    ``down``; on both, ``router_tokens``, the router's tokens a CTA, 1
    where not given); ``"gemv"`` where the experts' GEMM has no kernel for
    the weight types or shapes."""
    hp = lw.hp
    tg, td = _expert_info(lw, e.gate), _expert_info(lw, e.down)
    call = {"rows": rows, "qtype": tg.qtype.upper(), "down_qtype": td.qtype.upper(),
            "n_expert": hp.n_expert, "n_used": hp.n_expert_used, "hidden": hp.hidden,
            "expert_ffn": hp.expert_ffn, "sm": TARGETS[lw.target].sm, "target": lw.target}
    cfg = _tuning.cascade("moe_ffn", call)
    gemv = {"path": "gemv", "router_tokens": cfg.get("router_tokens", 1)}
    if cfg.get("path") != "gemm":
        return gemv
    if cfg.get("kernel") == "wgmma" and not _wgmma_fits(lw, tg, td):
        cfg = {**cfg, "kernel": "mma"}
    if cfg.get("kernel") == "wgmma":
        return cfg
    for t, key in ((tg, "gate_up"), (td, "down")):
        if t.qtype.upper() not in _gemm.FORMATS or t.shape[1] % cfg[key]["bk"]:
            return gemv
    return {**cfg, "kernel": "mma"}


def _wgmma_fits(lw: Lowering, tg: TensorInfo, td: TensorInfo) -> bool:
    """Whether the experts' warpgroup GEMM can run ``tg`` (gate/up) and
    ``td`` (down): an sm_90a GEMM target, weight types the warpgroup
    kernel decodes, K whole super-blocks and each expert's matrix starting
    16-byte aligned."""
    if matmul.gemm_target(lw.target) != "sm_90a":
        return False
    for t in (tg, td):
        q, (m, k) = t.qtype.upper(), t.shape
        if not _gemm.supported(q, k, "sm_90a") or q not in _gemm.WGMMA_FORMATS or k % 256:
            return False
        if (m * _gemm.GemmSpec(q, k).row_bytes) % 16:
            return False
    return True


def _gemm_specs(lw: Lowering, e: Experts, cfg: dict, pdl: bool):
    hp = lw.hp
    tg, td = _expert_info(lw, e.gate), _expert_info(lw, e.down)
    NU = hp.n_expert_used

    def plan(t, key):
        c = {f: v for f, v in cfg[key].items() if f not in ("x_ahead", "packed")}
        return _gemm.GemmPlan(_gemm.GemmSpec(t.qtype.upper(), t.shape[1], target=lw.target,
                                             pdl=pdl and has_griddepcontrol(lw.target)),
                              _gemm.GemmConfig(**c))

    def extra(key):
        return dict(x_ahead=cfg[key].get("x_ahead", False),
                    n_expert=hp.n_expert if cfg[key].get("packed", False) else 0)
    gate = expert_gemm.ExpertGemmSpec(plan(tg, "gate_up"), NU, x_token=True, **extra("gate_up"))
    down = expert_gemm.ExpertGemmSpec(plan(td, "down"), NU, **extra("down"))
    return gate, attrs.evolve(gate, swiglu=True), down


def chunk_ffn(lw: Lowering, x, e: Experts, residual, *, rows: int, n_ptr, pdl: bool, tuning):
    """The MoE FFN of up to ``rows`` tokens (``n_ptr``: the device int32
    count): ``x`` f32 ``[rows, hidden]``, added into ``residual``."""
    hp = lw.hp
    E, NU, F, H = hp.n_expert, hp.n_expert_used, hp.expert_ffn, hp.hidden
    specs = _plans(lw, e, tuning, tokens=True, pdl=pdl)
    g, B, p = lw.g, rows, e.prefix
    counter = g.buffer(f"{p}moe_counter_r{B}", (B,), np.uint32, "state",
                       np.zeros(B, np.uint32))
    bufs = (g.buffer(p + "moe_logits", (B, E), np.float32), counter,
            g.buffer(p + "moe_ids", (B, NU), np.int32),
            g.buffer(p + "moe_weights", (B, NU), np.float32),
            g.buffer(p + "moe_act", (B, NU, F), np.float32),
            g.buffer(p + "moe_down", (B, NU, H), np.float32))
    cfg = chunk_path(lw, e, B)
    specs = (attrs.evolve(specs[0], tokens=cfg.get("router_tokens", 1)),) + specs[1:]
    if cfg["path"] == "gemv":
        return _launches(lw, e, x, residual, bufs, specs, B, n_ptr)
    if cfg["kernel"] == "wgmma":
        return _chunk_wgmma(lw, x, e, residual, bufs, specs, cfg, B, n_ptr, pdl)
    rs, _, _, cs, _, _ = specs
    act, down = bufs[4], bufs[5]
    wg, wu, wd = _expert_weights(lw, e)
    counts, offsets, pairs = _sort_buffers(lw, e, B)
    gate, up, dn = _gemm_specs(lw, e, cfg, pdl)
    _router(lw, e, x, bufs, rs, B, n_ptr)
    _group(lw, e, bufs, counts, offsets, pairs, n_ptr, pdl)
    sort = dict(counts=counts, offsets=offsets, pairs=pairs)
    lw.add("MoeMulMatGate", p + "ffn_gate_exps", [wg, x, counts, offsets, pairs], [act],
           [lw.launch("moe_gemm", gate, expert_gemm.launch_geometry(gate, F, B, E), w=wg, x=x,
                      y=act, m=F, **sort)])
    lw.add("MoeMulMatUpSwiGLU", p + "ffn_up_exps", [wu, x, act, counts, offsets, pairs], [act],
           [lw.launch("moe_gemm", up, expert_gemm.launch_geometry(up, F, B, E), w=wu, x=x,
                      r=act, y=act, m=F, **sort)])
    lw.add("MoeMulMat", p + "ffn_down_exps", [wd, act, counts, offsets, pairs], [down],
           [lw.launch("moe_gemm", dn, expert_gemm.launch_geometry(dn, H, B, E), w=wd, x=act,
                      y=down, m=H, **sort)])
    return _combine(lw, e, residual, bufs, cs, B, n_ptr)


def _expert_weights(lw: Lowering, e: Experts):
    """The device buffers of the experts' gate, up and down tensors."""
    return tuple(lw.weight(n)[0] for n in (e.gate, e.up, e.down))


def _sort_buffers(lw: Lowering, e: Experts, rows: int):
    """The grouping's ``counts``, ``offsets`` and ``pairs`` of ``rows`` tokens."""
    g, p, hp = lw.g, e.prefix, lw.hp
    return (g.buffer(p + "moe_counts", (hp.n_expert,), np.uint32),
            g.buffer(p + "moe_offsets", (hp.n_expert,), np.uint32),
            g.buffer(p + "moe_pairs", (rows * hp.n_expert_used,), np.uint32))


def _group(lw: Lowering, e: Experts, bufs, counts, offsets, pairs, n_ptr, pdl: bool):
    """The launch grouping the chunk's pairs by expert."""
    ids = bufs[2]
    gs = group.MoeGroupSpec(lw.hp.n_expert, lw.hp.n_expert_used, target=lw.target, pdl=pdl)
    lw.add("MoeGroup", e.prefix + "ffn_moe_group", [ids] + _row_count(n_ptr)[1],
           [counts, offsets, pairs],
           [lw.launch("moe_group", gs, group.launch_geometry(gs), ids=ids, t_ptr=n_ptr,
                      counts=counts, offsets=offsets, pairs=pairs)])


def _wgmma_specs(lw: Lowering, e: Experts, cfg: dict, pdl: bool):
    """The permutation's and the gate, up (SwiGLU) and down warpgroup
    GEMMs' specs of ``cfg`` (its ``wgmma_gate_up`` and ``wgmma_down``
    configs)."""
    hp = lw.hp
    tg, td = _expert_info(lw, e.gate), _expert_info(lw, e.down)
    tgt = matmul.gemm_target(lw.target)
    wpdl = pdl and has_griddepcontrol(tgt)

    def plan(t, key):
        return _gemm.GemmPlan(_gemm.GemmSpec(t.qtype.upper(), t.shape[1], x_type="f16",
                                             target=tgt, pdl=wpdl),
                              _gemm.GemmConfig(kernel="wgmma", **cfg[key]))
    ps = permute.MoePermuteSpec(hp.n_expert_used, hp.hidden, target=lw.target, pdl=pdl)
    gate = expert_wgmma.ExpertWgmmaSpec(plan(tg, "wgmma_gate_up"), hp.n_expert, "sorted")
    up = attrs.evolve(gate, out="swiglu")
    down = expert_wgmma.ExpertWgmmaSpec(plan(td, "wgmma_down"), hp.n_expert, "pairs")
    return ps, gate, up, down


def _chunk_wgmma(lw: Lowering, x, e: Experts, residual, bufs, specs, cfg, rows, n_ptr, pdl):
    """The chunk's experts on sm_90a warpgroups: the router, the grouping,
    X's rows permuted into the experts' order as f16 (``moe_xs``), the
    gate GEMM (its values into ``moe_act`` in that order), the up GEMM with
    the SwiGLU epilogue (f16 activations, ``moe_act16``, in that order) and
    the down GEMM (each pair's row of ``moe_down``, where the combine reads
    it), then the combine."""
    hp = lw.hp
    NU, F, H, B, p, g = hp.n_expert_used, hp.expert_ffn, hp.hidden, rows, e.prefix, lw.g
    rs, _, _, cs, _, _ = specs
    act, down = bufs[4], bufs[5]
    wg, wu, wd = _expert_weights(lw, e)
    counts, offsets, pairs = _sort_buffers(lw, e, B)
    ps, gate, up, dn = _wgmma_specs(lw, e, cfg, pdl)
    xs = g.buffer(p + "moe_xs", (B * NU, H), np.float16)
    act16 = g.buffer(p + "moe_act16", (B * NU, F), np.float16)
    _router(lw, e, x, bufs, rs, B, n_ptr)
    _group(lw, e, bufs, counts, offsets, pairs, n_ptr, pdl)
    rows_arg, extra = _row_count(n_ptr)
    lw.add("MoePermute", p + "ffn_moe_permute", [x, pairs] + extra, [xs],
           [lw.launch("moe_permute", ps, permute.launch_geometry(ps, B), x=x, pairs=pairs,
                      xs=xs, **rows_arg)])
    srt = dict(counts=counts, offsets=offsets)

    def xmap(spec, src):
        return TensorMapOf(src, lambda addr: _gemm.x_map(spec.plan, addr, B * NU))

    def geo(spec, m):
        return expert_wgmma.launch_geometry(spec, m, B, NU)
    lw.add("MoeMulMatGate", p + "ffn_gate_exps", [wg, xs, counts, offsets], [act],
           [lw.launch("moe_wgmma", gate, geo(gate, F), w=wg, y=act, m=F,
                      xmap=xmap(gate, xs), **srt)])
    lw.add("MoeMulMatUpSwiGLU", p + "ffn_up_exps", [wu, xs, act, counts, offsets], [act16],
           [lw.launch("moe_wgmma", up, geo(up, F), w=wu, r=act, y=act16, m=F,
                      xmap=xmap(up, xs), **srt)])
    lw.add("MoeMulMat", p + "ffn_down_exps", [wd, act16, counts, offsets, pairs], [down],
           [lw.launch("moe_wgmma", dn, geo(dn, H), w=wd, y=down, m=H, pairs=pairs,
                      xmap=xmap(dn, act16), **srt)])
    return _combine(lw, e, residual, bufs, cs, B, n_ptr)
