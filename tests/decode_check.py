"""Checking a decode's logits and cached K/V rows against the float64
reference, step by step (shared by the model tests)."""

import numpy as np

from ptxgen.testing.reference import LlamaReference


def check_logits(model, path, prompt, res, logits, bound=1e-4):
    """Step the float64 reference beside the model's logits.

    The model's K/V rows (read back from its f16 cache) must lie within one
    f16 ulp of the reference's unrounded rows; the reference then caches the
    model's rows, so a value that rounds the other way at an f16 midpoint
    (the two sides compute it in different orders) does not spread into every
    later step's logits.  Cache bound: one f16 ulp of the reference value plus
    1e-5 of the row's largest magnitude (the kernels' f32 error where the
    GEMV sum cancels).  The logits bound is relative (L2 norm) per step:
    fed the model's rows, the f32 kernels stay at 1e-6 ... 4e-5 on the test
    models (docs/llm.md, "The decode step"), so a flip in the cache no
    longer counts against it and a wrong kernel still does."""
    ref = LlamaReference(path, kv_dtype=np.float16)
    caches = [tuple(model.executor.read(c) for c in pair) for pair in model.kv_caches]
    seq = list(prompt) + res.tokens
    worst = 0.0
    for i, got in enumerate(logits):
        rows = [(kc[:, i, :], vc[:, i, :]) for kc, vc in caches]
        want = ref.step(seq[i], kv=rows)
        for layer, (mine, theirs) in enumerate(zip(rows, ref.last_kv)):
            for name, a, b in zip("KV", mine, theirs):
                ulp = np.spacing(np.abs(b).astype(np.float16)).astype(np.float64)
                err = np.abs(a.astype(np.float64) - b)
                ulp = ulp + 1e-5 * np.max(np.abs(b), axis=-1, keepdims=True)
                assert np.all(err <= ulp), (
                    f"step {i} layer {layer}: cached {name} off by "
                    f"{float(np.max(err / ulp)):.2f} f16 ulp")
        worst = max(worst, float(np.linalg.norm(got - want) / np.linalg.norm(want)))
        # greedy: the token chosen after step i is the argmax of the logits
        # (where the prompt no longer dictates it); ties are vanishingly rare
        if i + 1 >= len(prompt):
            assert seq[i + 1] == int(np.argmax(got))
    assert worst <= bound, worst
    return worst


def greedy_agrees(path, prompt, want, got, *, tie=0.02):
    """Check two greedy continuations of ``prompt`` (``want``, ``got``) that
    two code paths produced, and return how many leading tokens they share.

    Paths that add in different orders round differently (f16 activations,
    a GEMM's tiles against a GEMV's warps), so where the two best logits
    nearly tie they may pick different tokens, and after that the
    continuations are unrelated.  Where they part, the float64 reference,
    fed the prompt and the shared tokens, must rank the two choices within
    ``tie`` of its logits' standard deviation of each other and of its
    maximum; a difference anywhere else fails."""
    n = min(len(want), len(got))
    d = next((i for i in range(n) if want[i] != got[i]), n)
    if d == n:
        assert len(want) == len(got), (len(want), len(got))
        return n
    ref = LlamaReference(path, kv_dtype=np.float16)
    for t in list(prompt) + list(want[:d]):
        lg = ref.step(t)
    top, scale = float(np.max(lg)), float(np.std(lg))
    a, b = float(lg[want[d]]), float(lg[got[d]])
    assert top - min(a, b) <= tie * scale, (
        f"token {d}: {want[d]} against {got[d]}, not a near tie: the reference's logits "
        f"{a:.5f} and {b:.5f}, its best {top:.5f}, bound {tie} x std {scale:.4f}")
    return d


def route_margin(ref, tokens, n_new: int = 0) -> float:
    """The smallest gap, over ``tokens`` and the float64 reference's (``ref``,
    a :class:`LlamaReference`, reset first) greedy continuation of ``n_new``
    tokens after them, and over every layer,
    between a mixture of experts' router logits of its last chosen expert
    and the best one left out, in units of those logits' standard deviation
    (inf for a file without experts).

    Where that gap is about the paths' rounding (f16 activations in a chunk,
    f32 in a GEMV), two correct paths choose different experts, and the
    outputs differ by whole experts, not by rounding: the MoE tests draw
    inputs whose margin clears a bound rather than compare at such ties."""
    ref.reset()
    worst, lg, seq = np.inf, None, list(tokens)
    for i in range(len(seq) + n_new):
        if i >= len(seq):
            seq.append(int(np.argmax(lg)))
        lg = ref.step(seq[i])
        for z, ids in zip(ref.last_router, ref.last_experts):
            zs = np.sort(z)[::-1]
            worst = min(worst, float((zs[len(ids) - 1] - zs[len(ids)]) / np.std(z)))
    return worst


def lead_margin(ref, tokens) -> float:
    """The gap between the float64 reference's two best next-token logits
    after ``tokens`` (``ref`` reset first), in units of the logits' root
    mean square: the scale of ``test_prefill.same_continuation``'s near-tie
    bound (2e-2)."""
    ref.reset()
    for t in tokens:
        lg = ref.step(t)
    top = np.sort(lg)[::-1]
    return float((top[0] - top[1]) / np.sqrt(np.mean(lg * lg)))


def tie_free_prompt(rng, path, n: int, vocab: int, n_new: int, bound: float = 0.01,
                    tries: int = 50, lead: float = 0.0) -> list:
    """A prompt of ``n`` random tokens whose :func:`route_margin` (with
    ``n_new`` tokens after it) is at least ``bound`` and whose first greedy
    token leads the next by at least ``lead`` (:func:`lead_margin`), so a
    test that asks the first token to agree is not drawn at a near tie."""
    ref = LlamaReference(path, kv_dtype=np.float16)
    for _ in range(tries):
        p = [int(t) for t in rng.integers(0, vocab, n)]
        if route_margin(ref, p, n_new) >= bound and (lead <= 0 or lead_margin(ref, p) >= lead):
            return p
    raise AssertionError(f"no {n}-token prompt in {tries} draws routes {bound} clear of a tie"
                         + (f" with its first token {lead} ahead" if lead > 0 else ""))
