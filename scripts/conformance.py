#!/usr/bin/env python3
"""Compare ptxgen's logits with llama.cpp's on one GGUF file.

    python scripts/conformance.py MODEL.gguf [--tokens 1,2,3 | --n-tokens 8 --seed S]
                                             [--side ref|emu|cuda] [--oracle PATH] [--json OUT]

llama.cpp (a CPU build made by scripts/llamacpp_build.sh; its program
``ptxgen-logits``) evaluates the token sequence and writes the logits of every
position; ptxgen evaluates the same sequence: ``--side ref``, the float64 numpy
reference (testing/reference.py); ``--side emu`` / ``--side cuda``, the
decode step itself (:class:`Model`, one token a step through its graph) on the
CPU emulator or the GPU. A third pass, the same reference with
llama.cpp's rounding of matrix-multiply inputs emulated (Q8_K / Q8_0 / F16 / BF16
by the weight's type, and f16 queries and probabilities in attention, as
llama.cpp's CPU backend does), measures how far apart two correct
implementations are expected to be; the bounds follow from it
(docs/conformance.md):

- cosine similarity of the logits at every position >= ``1 - C * (1 - cos_emul)``
  (C = 4 by default), and never below ``--cos-floor``;
- top-1 agreement at every position where llama.cpp's two largest logits differ
  by more than the margin ``K * sqrt(2) * rms(emulated - ref)`` (K = 4).

``--bound analytic`` replaces the emulating pass (which needs the float64
reference, 8 bytes per weight) by a per-type prediction eps of the relative
logit error: ``1 - cos_emul = eps^2 / 2`` and ``rms(emulated - ref) = eps * rms(ref)``.

Exit status 0 when every position passes, 1 when one fails, 2 on bad input.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
BUILD_SCRIPT = HERE / "llamacpp_build.sh"

# llama.cpp's CPU backend converts a matrix multiply's activations to this type
# (ggml-cpu.c, type_traits_cpu[weight type].vec_dot_type) before the dot products.
ACTIVATION_TYPE = {
    "F32": "F32", "F16": "F16", "BF16": "BF16",
    "Q4_0": "Q8_0", "Q5_0": "Q8_0", "Q8_0": "Q8_0",
    "Q4_1": "Q8_1", "Q5_1": "Q8_1",
    "Q2_K": "Q8_K", "Q3_K": "Q8_K", "Q4_K": "Q8_K", "Q5_K": "Q8_K", "Q6_K": "Q8_K",
}


# ---------------------------------------------------------------------------
# llama.cpp's side

def find_oracle(path=None, build=True) -> Path:
    """The ptxgen-logits binary: ``path``, $PTXGEN_LLAMACPP_LOGITS, or built by llamacpp_build.sh."""
    path = path or os.environ.get("PTXGEN_LLAMACPP_LOGITS")
    if path:
        p = Path(path)
        if not (p.is_file() and os.access(p, os.X_OK)):
            raise FileNotFoundError(f"llama.cpp oracle {p} is not an executable file")
        return p
    if not build:
        raise FileNotFoundError("no llama.cpp oracle: pass --oracle or run scripts/llamacpp_build.sh")
    out = subprocess.run(["bash", str(BUILD_SCRIPT)], check=True, stdout=subprocess.PIPE, text=True)
    return Path(out.stdout.strip().splitlines()[-1])


def file_overrides(model) -> list[str]:
    """Metadata llama.cpp needs that the file lacks: a vocabulary model ("none" for none)."""
    import gguf
    r = gguf.GGUFReader(str(model))
    if "tokenizer.ggml.model" not in r.fields:
        return ["tokenizer.ggml.model=str:none"]
    return []


def llamacpp_logits(oracle, model, tokens, *, threads=1, kv="f16", stepwise=False) -> np.ndarray:
    """Logits (n_tokens, n_vocab) float32 of every position, from llama.cpp."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "logits.f32"
        cmd = [str(oracle), str(model), str(out), "--tokens", ",".join(map(str, tokens)),
               "--all", "--threads", str(threads), "--kv", kv]
        if stepwise:
            cmd.append("--stepwise")
        for o in file_overrides(model):
            cmd += ["--override", o]
        res = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        if res.returncode != 0:
            raise RuntimeError(f"llama.cpp failed ({res.returncode}): {res.stderr.strip()[-2000:]}")
        fields = dict(kv.split("=") for kv in res.stdout.split())
        rows, n_vocab = int(fields["rows"]), int(fields["n_vocab"])
        data = np.fromfile(out, dtype="<f4")
    if data.size != rows * n_vocab or rows != len(tokens):
        raise RuntimeError(f"llama.cpp wrote {data.size} floats, expected {len(tokens)} x {n_vocab}")
    return data.reshape(rows, n_vocab)


# ---------------------------------------------------------------------------
# ptxgen's side

def _round_q8_k(x: np.ndarray) -> np.ndarray:
    """llama.cpp's Q8_K of float32 ``x`` (blocks of 256), decoded."""
    f32 = np.float32
    b = x.astype(f32).reshape(-1, 256)
    idx = np.abs(b).argmax(axis=1)[:, None]
    mx = np.take_along_axis(b, idx, axis=1)
    with np.errstate(divide="ignore"):
        iscale = np.where(mx != 0, f32(-127) / mx, f32(0)).astype(f32)
        d = np.where(mx != 0, f32(1) / iscale, f32(0)).astype(f32)
    q = np.minimum(np.rint(iscale * b), f32(127))
    return (q * d).reshape(x.shape)


def activation_rounding(kind: str):
    """x -> x as llama.cpp's CPU backend rounds a matrix multiply's input of this kind."""
    from ptxgen.kernels import quants

    def q8_0(x):
        x32 = x.astype(np.float32)
        return quants.dequantize(quants.quantize(x32, "Q8_0"), "Q8_0", x32.shape)

    table = {
        "F32": lambda x: x.astype(np.float32),
        "F16": lambda x: x.astype(np.float16),
        "BF16": lambda x: quants.dequantize(quants.quantize(x, "BF16"), "BF16", x.shape),
        "Q8_0": q8_0,
        "Q8_1": q8_0,          # the same rounding of x (Q8_1 adds the block sum)
        "Q8_K": _round_q8_k,
    }
    return table[kind]


class _RoundedInput:
    """A weight matrix whose ``@`` rounds its input first, as llama.cpp's CPU matmul."""

    def __init__(self, w: np.ndarray, rounding):
        self.w = w
        self.rounding = rounding
        self.shape = w.shape

    def __matmul__(self, x):
        return self.w @ self.rounding(np.asarray(x)).astype(np.float64)


class _RoundedExperts:
    """A 3-D experts' tensor whose expert ``[e]`` rounds its input first
    (llama.cpp's ``mul_mat_id`` rounds as its plain matmul does)."""

    def __init__(self, w: np.ndarray, rounding):
        self.w = w
        self.rounding = rounding

    def __getitem__(self, e):
        return _RoundedInput(self.w[e], self.rounding)


def _attention_as_llamacpp(q, k, v, scale=None):
    """Decode attention as llama.cpp's CPU graph without flash attention rounds it.

    K and V come from the f16 cache; the scores are a matmul against f16 K, so q is
    converted to f16 first, and the probabilities multiply f16 V, so they are
    converted to f16 too. Same shapes, GQA mapping and ``scale`` as the reference's
    attention.
    """
    f16 = np.float16
    n_heads, d = q.shape
    group = n_heads // k.shape[0]
    kk = np.repeat(k, group, axis=0)
    vv = np.repeat(v, group, axis=0)
    q16 = np.asarray(q).astype(f16).astype(np.float64)
    s = np.einsum("hd,hld->hl", q16, kk) * (1.0 / np.sqrt(d) if scale is None else scale)
    s -= s.max(axis=1, keepdims=True)
    p = np.exp(s)
    p /= p.sum(axis=1, keepdims=True)
    return np.einsum("hl,hld->hd", p.astype(f16).astype(np.float64), vv)


def _gelu_as_llamacpp(x):
    """GELU (tanh) as llama.cpp's CPU GEGLU computes it (``GGML_GELU_FP16``,
    ggml-cpu vec.h): x rounded to f16 and looked up in a table of f16 values of
    the f32 formula; 0 at or below -10, x at or above 10."""
    x32 = np.asarray(x, np.float32)
    h = x32.astype(np.float16).astype(np.float32)
    c = np.float32(0.79788456080286535587989211986876)
    g = np.float32(0.5) * h * (np.float32(1) + np.tanh(c * h * (np.float32(1)
                                                               + np.float32(0.044715) * h * h)))
    g = g.astype(np.float16).astype(np.float64)
    return np.where(x32 <= -10, 0.0, np.where(x32 >= 10, x32.astype(np.float64), g))


def tensor_types(model) -> dict[str, str]:
    import gguf
    return {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(model)).tensors}


def reference_logits(model, tokens, *, emulate_llamacpp=False, experts=None,
                     routes=None) -> np.ndarray:
    """Logits (n_tokens, n_vocab) float64 from the numpy reference (f16 KV cache).

    A mixture of experts: ``experts`` (per token, per layer) are run instead
    of the reference's own choice; ``routes``, a list, gets per token the
    reference's ``(own expert ids, router logits)`` of every layer."""
    from unittest import mock

    from ptxgen.testing import reference as llama_ref
    ref = llama_ref.LlamaReference(model, kv_dtype=np.float16, max_context=len(tokens))

    def run():
        out = []
        for i, t in enumerate(tokens):
            out.append(ref.step(t, experts=None if experts is None else experts[i]))
            if routes is not None:
                routes.append(list(zip(ref.last_experts, ref.last_router)))
        return np.stack(out)
    if not emulate_llamacpp:
        return run()
    types = tensor_types(model)
    out_type = types.get("output.weight", types["token_embd.weight"])
    for name, w in list(ref.weights.items()):
        if w.ndim not in (2, 3) or name == "token_embd.weight":
            continue
        t = out_type if name == "output.weight" else types[name]
        wrap = _RoundedInput if w.ndim == 2 else _RoundedExperts
        ref.weights[name] = wrap(w, activation_rounding(ACTIVATION_TYPE[t]))
    with mock.patch.object(llama_ref, "attention", _attention_as_llamacpp), \
            mock.patch.object(llama_ref, "gelu_tanh", _gelu_as_llamacpp):
        return run()


def near_ties(own_routes, forced_routes, tol) -> tuple[int, float]:
    """How many of the reference's expert choices the forced ones changed,
    and the largest router-logit shortfall of a forced expert below the
    reference's own last chosen one, in units of the logits' rms (a near
    tie is a shortfall within ``tol``: AssertionError otherwise)."""
    changed, worst = 0, 0.0
    for pos, (own, forced) in enumerate(zip(own_routes, forced_routes)):
        for layer, ((ids, z), (fids, _)) in enumerate(zip(own, forced)):
            if set(ids.tolist()) == set(fids.tolist()):
                continue
            changed += 1
            short = float((z[ids].min() - z[fids].min()) / np.sqrt(np.mean(z * z)))
            worst = max(worst, short)
            assert short <= tol, (f"position {pos} layer {layer}: llama.cpp's experts "
                                  f"{sorted(fids.tolist())} are no near tie of ours "
                                  f"{sorted(ids.tolist())} ({short:.4f} rms below, bound {tol})")
    return changed, worst


def model_logits(model, tokens, *, backend) -> np.ndarray:
    """Logits (n_tokens, n_vocab) of ptxgen's decode step on ``backend``
    ("emu" or "cuda"): every token fed through the step, one at a time."""
    from ptxgen.llm import Model
    m = Model.from_gguf(str(model), backend=backend, capacity=max(16, len(tokens) + 1),
                             progress=False)
    _, logits = m.generate(list(tokens), 1, return_logits=True)
    return np.stack(logits[:len(tokens)]).astype(np.float64)


SIDES = {"ref": reference_logits,
         "emu": lambda model, tokens: model_logits(model, tokens, backend="emu"),
         "cuda": lambda model, tokens: model_logits(model, tokens, backend="cuda")}


# ---------------------------------------------------------------------------
# the comparison

def cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a = a.astype(np.float64)
    b = b.astype(np.float64)
    return (a * b).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))


# Relative RMS rounding error of llama.cpp's activation types (measured on 4096 x 4096
# samples; docs/conformance.md): on Gaussian vectors (normed hidden states, attention
# outputs) and on SwiGLU products silu(g)*u of Gaussians (the input of ffn_down).
RHO_GAUSSIAN = {"F32": 0.0, "F16": 2.1e-4, "BF16": 1.7e-3, "Q8_0": 5.4e-3, "Q8_1": 5.4e-3,
                "Q8_K": 7.0e-3}
RHO_SWIGLU = {"F32": 0.0, "F16": 2.1e-4, "BF16": 1.7e-3, "Q8_0": 8.9e-3, "Q8_1": 8.9e-3,
              "Q8_K": 1.54e-2}


def analytic_error(model) -> float:
    """Predicted relative RMS error of llama.cpp's logits from its activation rounding.

    Each matrix multiply's output is off by about its rounded input's relative error
    (random weights keep norms); the errors of the 4 rounded inputs per layer (attention
    input, attention output, FFN input, SwiGLU product) and of the output projection's
    enter independently: eps^2 = sum of rho^2.  A mixture of experts' FFN rounds its
    input and SwiGLU product as a dense one does, by its experts' types.
    """
    types = tensor_types(model)
    out_type = types.get("output.weight", types["token_embd.weight"])
    act = lambda name: ACTIVATION_TYPE[types[name]]          # noqa: E731
    n_layers = sum(1 for n in types if n.endswith(".attn_q.weight"))
    e2 = RHO_GAUSSIAN[ACTIVATION_TYPE[out_type]] ** 2
    for i in range(n_layers):
        b = f"blk.{i}."
        ffn = "ffn_{}_exps.weight" if b + "ffn_gate_exps.weight" in types else "ffn_{}.weight"
        e2 += (RHO_GAUSSIAN[act(b + "attn_q.weight")] ** 2 + RHO_GAUSSIAN[act(b + "attn_output.weight")] ** 2
               + RHO_GAUSSIAN[act(b + ffn.format("gate"))] ** 2
               + RHO_SWIGLU[act(b + ffn.format("down"))] ** 2)
    return float(np.sqrt(e2))


def compare(ours, theirs, emulated=None, *, analytic_eps=None, c_cos=4.0, k_margin=4.0,
            cos_floor=0.99, cos_slack=1e-6) -> dict:
    """Per-position metrics and the pass/fail of each, as a JSON-able dict.

    The expected disagreement comes from ``emulated`` (the reference with llama.cpp's
    rounding) when given: 1 - cos(ours, emulated) and rms(emulated - ours); otherwise
    from ``analytic_eps``, a predicted relative RMS logit error eps: eps^2/2 and
    eps * rms(ours).
    """
    ours = np.asarray(ours, np.float64)
    theirs = np.asarray(theirs, np.float64)
    cos = cosine(ours, theirs)
    if emulated is not None:
        emulated = np.asarray(emulated, np.float64)
        cos_emul = cosine(ours, emulated)
        cos_emul_llama = cosine(emulated, theirs)
        noise = np.sqrt(np.mean((emulated - ours) ** 2, axis=-1))
    elif analytic_eps is not None:
        cos_emul = np.full(len(ours), 1 - analytic_eps ** 2 / 2)
        cos_emul_llama = np.full(len(ours), np.nan)
        noise = analytic_eps * np.sqrt(np.mean(ours ** 2, axis=-1))
    else:
        raise ValueError("compare needs emulated logits or analytic_eps")
    cos_min = np.maximum(1 - c_cos * (1 - cos_emul) - cos_slack, cos_floor)
    margin = k_margin * np.sqrt(2) * noise
    top2 = np.sort(theirs, axis=-1)[:, -2:]
    gap = top2[:, 1] - top2[:, 0]
    same_top1 = ours.argmax(-1) == theirs.argmax(-1)
    decided = gap > margin
    rows = []
    for p in range(ours.shape[0]):
        ok = bool(cos[p] >= cos_min[p] and (same_top1[p] or not decided[p]))
        rows.append(dict(pos=p, cos=float(cos[p]), cos_emulated=float(cos_emul[p]),
                         cos_emulated_llamacpp=float(cos_emul_llama[p]),
                         cos_min=float(cos_min[p]), top1_ours=int(ours[p].argmax()),
                         top1_llamacpp=int(theirs[p].argmax()), gap=float(gap[p]),
                         margin=float(margin[p]), decided=bool(decided[p]),
                         rel_rms=float(np.sqrt(np.mean((ours[p] - theirs[p]) ** 2)
                                               / np.mean(ours[p] ** 2))),
                         ok=ok))
    return dict(ok=all(r["ok"] for r in rows), positions=rows,
                top1_agree=int(same_top1.sum()), decided=int(decided.sum()),
                min_cos=float(cos.min()), min_cos_emulated=float(cos_emul.min()),
                min_cos_emulated_llamacpp=float(np.min(cos_emul_llama)))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="scripts/conformance.py", description=__doc__.split("\n")[0])
    ap.add_argument("model", help="a GGUF file")
    ap.add_argument("--tokens", help="comma-separated token ids (default: random, see --seed)")
    ap.add_argument("--n-tokens", type=int, default=8, help="random sequence length (default 8)")
    ap.add_argument("--seed", type=int, default=None, help="seed of the random tokens (default: fresh)")
    ap.add_argument("--side", choices=sorted(SIDES), default="ref", help="the ptxgen implementation")
    ap.add_argument("--oracle", help="the ptxgen-logits binary (default: build/find it)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--stepwise", action="store_true", help="llama.cpp decodes one token per call")
    ap.add_argument("--c-cos", type=float, default=4.0, help="cosine bound factor C")
    ap.add_argument("--k-margin", type=float, default=4.0, help="top-1 margin factor K")
    ap.add_argument("--cos-floor", type=float, default=0.99)
    ap.add_argument("--cos-slack", type=float, default=1e-6,
                    help="added to 1 - cos_min: float32 against float64 arithmetic")
    ap.add_argument("--bound", choices=("emulated", "analytic"), default="emulated",
                    help="expected disagreement from the emulating reference pass (default) "
                         "or from the per-type estimate (models too large for the reference)")
    ap.add_argument("--json", help="write the results here")
    a = ap.parse_args(argv)

    model = Path(a.model)
    if not model.is_file():
        print(f"conformance: no such file {model}", file=sys.stderr)
        return 2
    import gguf
    n_vocab = None
    r = gguf.GGUFReader(str(model))
    for t in r.tensors:
        if t.name == "token_embd.weight":
            n_vocab = int(t.shape[-1])
    if a.tokens:
        try:
            tokens = [int(t) for t in a.tokens.split(",")]
        except ValueError:
            print(f"conformance: --tokens must be comma-separated integers, got {a.tokens!r}",
                  file=sys.stderr)
            return 2
    else:
        seed = a.seed if a.seed is not None else int.from_bytes(os.urandom(4), "little")
        print(f"token seed: {seed}")
        tokens = np.random.default_rng(seed).integers(0, n_vocab, size=a.n_tokens).tolist()
    if n_vocab is not None and any(not 0 <= t < n_vocab for t in tokens):
        print(f"conformance: token ids must be in 0..{n_vocab - 1}", file=sys.stderr)
        return 2
    print(f"tokens: {','.join(map(str, tokens))}")

    oracle = find_oracle(a.oracle)
    theirs = llamacpp_logits(oracle, model, tokens, threads=a.threads, stepwise=a.stepwise)
    try:
        ours = SIDES[a.side](model, tokens)
    except ValueError as e:          # the loader's refusals (GGUFError) name the key or tensor
        print(f"conformance: ptxgen ({a.side}) cannot run {model}: {e}", file=sys.stderr)
        return 2
    eps = analytic_error(model)
    print(f"predicted relative logit error from llama.cpp's activation rounding: {eps:.4f}")
    moe = any(t.name.endswith("ffn_gate_inp.weight") for t in r.tensors)
    if a.bound == "emulated" and moe and a.side == "ref":
        # a mixture of experts: a router near tie that llama.cpp's rounding
        # decides the other way changes the logits by far more than the
        # rounding; the reference runs the experts the emulating pass chose
        # (which are llama.cpp's where emulated ~ llama.cpp), each checked
        # to be a near tie of its own choice
        routes, own = [], []
        emulated = reference_logits(model, tokens, emulate_llamacpp=True, routes=routes)
        ours = reference_logits(model, tokens, experts=[[ids for ids, _ in layer]
                                                        for layer in routes], routes=own)
        changed, worst = near_ties(own, routes, tol=4 * eps)
        print(f"experts: {changed} of the reference's choices were near ties llama.cpp's "
              f"rounding decided otherwise (largest shortfall {worst:.4f} rms of the logits)")
    if a.bound == "emulated":
        if not (moe and a.side == "ref"):
            emulated = reference_logits(model, tokens, emulate_llamacpp=True)
        res = compare(ours, theirs, emulated, c_cos=a.c_cos, k_margin=a.k_margin,
                      cos_floor=a.cos_floor, cos_slack=a.cos_slack)
    else:
        res = compare(ours, theirs, analytic_eps=eps, c_cos=a.c_cos, k_margin=a.k_margin,
                      cos_floor=a.cos_floor, cos_slack=a.cos_slack)
    res.update(predicted_eps=eps, bound=a.bound)
    res.update(model=str(model), side=a.side, tokens=tokens)

    print(f"{'pos':>3} {'cos':>10} {'cos_emul':>10} {'cos_min':>10} {'emul~llama':>10} {'rel_rms':>8} "
          f"{'top1 ours/llama':>16} {'gap':>7} {'margin':>7}  ok")
    for p in res["positions"]:
        print(f"{p['pos']:>3} {p['cos']:.8f} {p['cos_emulated']:.8f} {p['cos_min']:.8f} "
              f"{p['cos_emulated_llamacpp']:.8f} "
              f"{p['rel_rms']:8.5f} {p['top1_ours']:>7}/{p['top1_llamacpp']:<8} "
              f"{p['gap']:7.4f} {p['margin']:7.4f}  {'ok' if p['ok'] else 'FAIL'}"
              f"{'' if p['decided'] else ' (undecided)'}")
    print(f"top-1 agreement {res['top1_agree']}/{len(tokens)} ({res['decided']} decided by the "
          f"margin); min cosine {res['min_cos']:.8f} (emulated {res['min_cos_emulated']:.8f}; "
          f"emulated vs llama.cpp {res['min_cos_emulated_llamacpp']:.8f}): "
          f"{'PASS' if res['ok'] else 'FAIL'}")
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1))
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
