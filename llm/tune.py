"""``python -m ptxgen tune [gemv|flash_decode] [--model FILE.gguf] [--rounds N]
[--qtypes T,...] [--search]``: time candidate configs on the present GPU
and keep the fastest per call in the user's tuning cache.

The calls are a model's shapes (``--model``, a GGUF file) or an 8B Llama's;
the timing is :mod:`ptxgen.driver.tune`.
"""

from __future__ import annotations

import sys

from ptxgen.cli import ArgumentParser, HelpFormatter

from ptxgen.driver.tune import LLAMA_8B, qtype_calls, tune_flash, tune_gemv
from ptxgen.kernels import gemv, tuning

__all__ = ["tune_command", "gemv_calls", "flash_calls"]


def gemv_calls(model: str | None) -> list:
    """``(qtype, m, k, epilogue)`` of every distinct GEMV of ``model`` (the
    8B list without one)."""
    if model is None:
        return list(LLAMA_8B)
    from ptxgen.llm.gguf.file import LlamaFile
    f = LlamaFile(model)
    hp = f.hparams
    out = []
    # the stacked Q/K/V GEMV's epilogue as the decode step picks it
    # (llm/lowering/decode.py): RoPE (with the biases, in either layout),
    # but the plain product (or the bias add) ahead of Qwen3's q/k norms
    biased = any(f.has(f"blk.0.{n}.bias") for n in ("attn_q", "attn_k", "attn_v"))
    qkv_epi = ("rope" if not hp.qk_norm else "residual" if biased else "none")
    # a mixture of experts: one expert's gate/up (swiglu) and down (none, the
    # weighted sum adds the residual) matrices, the plans its experts' GEMV runs
    ffn = ((("ffn_gate_exps", "swiglu"), ("ffn_down_exps", "none")) if hp.n_expert else
           (("ffn_gate", "swiglu"), ("ffn_down", "residual")))
    for name, epi in (("attn_q", qkv_epi), ("attn_output", "residual")) + ffn:
        t = f.tensor(f"blk.0.{name}.weight")
        shape = t.shape[-2:]
        m = hp.q_dim + 2 * hp.kv_dim if name == "attn_q" else shape[0]
        out.append((t.qtype, m, shape[1], epi))
    t = f.tensor("output.weight" if f.has("output.weight") else "token_embd.weight")
    out.append((t.qtype, t.shape[0], t.shape[1], "none"))
    return sorted(set(c for c in out if c[0] in gemv.GEMV_QTYPES), key=out.index)


def flash_calls(model: str | None) -> list:
    """``(n_q_heads, n_kv_heads, head_dim)`` of the model's attention."""
    if model is None:
        return [(32, 8, 128)]
    from ptxgen.llm.gguf.file import LlamaFile
    hp = LlamaFile(model).hparams
    return [(hp.n_heads, hp.n_kv_heads, hp.head_dim)]


def tune_command(argv) -> int:
    """Time kernel configs on this GPU and keep the fastest for a model's shapes."""
    ap = ArgumentParser(prog="python -m ptxgen tune", description=__doc__.split("\n\n")[0],
                        formatter_class=HelpFormatter)
    ap.add_argument("family", nargs="?", default="gemv", choices=["gemv", "flash_decode"],
                    help="kernel family to tune")
    ap.add_argument("--model", default=None, help="a GGUF file whose shapes to tune for")
    ap.add_argument("--rounds", type=int, default=5, help="alternating timing rounds")
    ap.add_argument("--qtypes", default=None,
                    help="gemv: tune the 8B shapes with these weight types (comma-separated)")
    ap.add_argument("--search", action="store_true",
                    help="gemv: a greedy search one knob at a time beyond the neighbours")
    args = ap.parse_args(argv)
    from ptxgen.driver import is_available
    if not is_available():
        print("error: tune times kernels on a GPU, and none is available", file=sys.stderr)
        return 2
    if args.family == "gemv":
        calls = (qtype_calls([q.strip().upper() for q in args.qtypes.split(",") if q.strip()])
                 if args.qtypes else gemv_calls(args.model))
        tune_gemv(calls, rounds=args.rounds, search=args.search)
    else:
        tune_flash(flash_calls(args.model), rounds=args.rounds)
    print(f"stored in {tuning.cache_dir() / 'tuning' / (args.family + '.json')}")
    return 0
