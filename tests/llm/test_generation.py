"""Generation on a tiny synthetic Llama with a real (cut-down) vocabulary:
the greedy and sampler variants of the decode step, seeded reproducibility
in eager and graph mode, the sampler's penalty window read from the
model's history, continuing a cached sequence, the text path and a
three-turn chat that feeds only each turn's new tokens.

On the emulator, "graph mode" runs through a backend that records the
launches a capture issues and replays the recording, so the per-variant
capture and replay of the executor are exercised without a GPU; the GPU
tests at the end use real CUDA graphs."""

import os

import numpy as np
import pytest

pytest.importorskip("gguf")

from backends import cuda_available
from ptxgen.driver.backend import EmuBackend
from ptxgen.llm.text.chat_template import encode_chat, incremental_chat_tokens
from ptxgen.llm.generation import ContextOverflowError, SamplingSettings
from ptxgen.llm.gguf.file import GGUFError, LlamaFile
from ptxgen.llm.gguf.synth import write_synthetic_llama
from ptxgen.llm import Model
from ptxgen.llm import textgen as T

DATA = os.path.join(os.path.dirname(__file__), "..", "data", "vocab")
PHI3 = os.path.join(DATA, "ggml-vocab-phi-3.gguf")
# one Q8_0 layer of width 128 and ~860 tokens: about a second a step on the emulator
SMALL = dict(n_layers=1, hidden=128, ffn=256, n_heads=2, n_kv_heads=1, qtype="Q8_0",
             output_qtype="Q8_0", context_length=256)


class RecordingEmu(EmuBackend):
    """The emulator with "CUDA graphs": a capture records the launches it
    would issue, a replay issues the recording."""

    can_capture = True

    def __init__(self):
        super().__init__()
        self.captures = []

    def capture(self, stream, issue):
        rec = []
        self.launch_positional = lambda fn, grid, block, *args, **kw: rec.append(
            (fn, grid, block, args, kw))
        try:
            issue()
        finally:
            del self.launch_positional
        self.captures.append(rec)
        return rec

    def replay(self, graph_exec, stream):
        for fn, grid, block, args, kw in graph_exec:
            self.launch_positional(fn, grid, block, *args, **kw)


@pytest.fixture(scope="module")
def path(tmp_path_factory, module_seed):
    p = tmp_path_factory.mktemp("gen") / "tiny-phi3-vocab.gguf"
    write_synthetic_llama(p, seed=module_seed, vocab_from=PHI3, vocab_limit=700, **SMALL)
    return str(p)


@pytest.fixture(scope="module")
def model(path):
    return Model.from_gguf(path, backend=RecordingEmu(), capacity=64, progress=False)


def _launch_names(model, variant):
    return [L.kernel for op in model.graph.ops_of(variant) for L in op.launches]


def test_variants_differ_only_in_how_the_token_is_chosen(model):
    """The greedy step is the launches of a graph without a sampler, ending
    argmax -> state advance; the sampler step replaces the argmax launch
    only.  A capture records exactly its variant's launches."""
    g = model.graph
    assert g.variants == ("greedy", "sample") and g.default_variant == "greedy"
    greedy, sample = _launch_names(model, "greedy"), _launch_names(model, "sample")
    kinds = [op.kind for op in g.ops_of("greedy")]
    assert kinds[-2:] == ["Argmax", "StateAdvance"] and "Sample" not in kinds
    assert [op.kind for op in g.ops_of("sample")][-2:] == ["Sample", "StateAdvance"]
    assert greedy[:-2] == sample[:-2] and greedy[-1] == sample[-1]
    assert greedy[-2].startswith("argmax") and sample[-2].startswith("sample")
    assert g.launch_count == len(greedy) == model.graph.launch_count_of("greedy")
    # one layer: embedding, norm, QKV+RoPE, 2 attention, o-proj, norm, gate/up,
    # down, output norm, logits, argmax, advance (Q8_0 takes no fused norm)
    assert len(greedy) == 13
    ex = model.executor
    for v in ("greedy", "sample"):
        n = len(model.backend.captures)
        ex.capture(None, v)
        rec = model.backend.captures[n]
        assert [r[0] for r in rec] == [L[0] for L in ex.launches(v)]
    with pytest.raises(ValueError, match="unknown variant 'beam'"):
        ex.launches("beam")


def test_greedy_is_the_argmax_in_every_mode(model, rng):
    """Greedy settings run the greedy step; every new token is the argmax
    of the step's logits; graph mode, eager mode, generate and decode agree."""
    prompt = [int(t) for t in rng.integers(0, model.hp.vocab, 2)]
    res, logits = model.generate(prompt, 3, mode="graph", return_logits=True)
    assert res.seed is None and len(logits) == 4
    seq = prompt + res.tokens
    for i in range(1, 4):
        assert seq[i + 1] == int(np.argmax(logits[i]))
    again = model.generate(prompt, 3, mode="eager", sampling=SamplingSettings())
    assert again.tokens == res.tokens
    dec = model.decode(prompt, mode="graph")
    assert [next(dec) for _ in range(3)] == res.tokens
    assert model.position == len(prompt) + 2


def test_seed_reproduces_in_eager_and_graph_mode(model, seed):
    """A seed gives the same tokens in eager mode, graph mode and again;
    top_k = 1 gives the greedy tokens through the sampler kernel."""
    prompt = [model.tokenizer.bos_id, 5]
    chain = SamplingSettings(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, seed=seed)
    a = model.generate(prompt, 2, mode="eager", sampling=chain)
    b = model.generate(prompt, 2, mode="graph", sampling=chain)
    c = model.generate(prompt, 2, mode="graph", sampling=chain)
    assert a.tokens == b.tokens == c.tokens and a.seed == seed
    one = model.generate(prompt, 2, sampling=SamplingSettings(temperature=0.9, top_k=1, seed=seed))
    greedy = model.generate(prompt, 2)
    assert one.seed == seed and one.tokens == greedy.tokens


def test_different_seeds_draw_different_tokens(model, seed):
    """Pure temperature sampling over the whole vocabulary, one token from
    the same prompt under four seeds.  The model is nearly flat: from its
    logits, the chance that four independent draws agree is sum(p^4); the
    test asserts that is below 1e-5 and that the draws are not all equal."""
    prompt = [model.tokenizer.bos_id]
    _, logits = model.generate(prompt, 1, return_logits=True)
    p = np.exp(logits[0] - logits[0].max())
    p /= p.sum()
    assert float(np.sum(p ** 4)) < 1e-5
    firsts = []
    for s in range(4):
        settings = SamplingSettings(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0,
                                    seed=(seed + 7919 * s) % (1 << 64))
        firsts.append(model.generate(prompt, 1, sampling=settings).tokens[0])
    assert len(set(firsts)) > 1, firsts


def _penalised(y, window, rep, freq, pres):
    """llama.cpp's penalties in float64 over the tokens of ``window``."""
    y = y.astype(np.float64).copy()
    ids, counts = np.unique(np.asarray(window), return_counts=True)
    for t, c in zip(ids, counts):
        y[t] = y[t] * rep if y[t] <= 0 else y[t] / rep
        y[t] -= c * freq + pres
    return y


def test_penalty_window_comes_from_the_sequence(model, rng):
    """Temperature 0 with penalties: each token is the argmax of the
    penalised logits, the window being the last repeat_last_n tokens of the
    sequence (the sampler reads the model's history at the state's
    position).  Negative frequency and presence penalties lift the window's
    tokens above the rest, so the choice depends on the window (the test
    checks it differs from the plain argmax)."""
    v = model.hp.vocab
    prompt = [model.tokenizer.bos_id] + [int(t) for t in rng.integers(0, v, 3)]
    s = SamplingSettings(temperature=0.0, repeat_penalty=1.3, repeat_last_n=3,
                         frequency_penalty=-2.0, presence_penalty=-5.0)
    res, logits = model.generate(prompt, 3, sampling=s, mode="graph", return_logits=True)
    assert res.seed is not None
    seq = prompt + res.tokens
    changed = 0
    for i in range(len(prompt) - 1, len(seq) - 1):
        window = seq[max(0, i - 2):i + 1]
        y = _penalised(logits[i], window, 1.3, -2.0, -5.0)
        assert seq[i + 1] == int(np.argmax(y)), i
        changed += int(np.argmax(logits[i])) != seq[i + 1]
    assert changed >= 1


def test_continuing_the_cache_equals_feeding_everything(model, seed):
    """decode(keep_cache=True) feeds the last chosen token and the new ones
    after the cached sequence: the tokens then chosen are those of a fresh
    sequence of all the tokens (seeded sampling: the draw is keyed by the
    position, the penalty window reads the history)."""
    s = SamplingSettings(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, repeat_penalty=1.5,
                         seed=seed)
    first = model.decode([3, 14], sampling=s)
    g = [next(first), next(first)]
    assert model.position == 3
    more = model.decode([92], sampling=s, keep_cache=True)
    cont = [next(more), next(more)]
    assert more.start == 3 and more.n_fed == 2 and model.position == 6
    fresh = model.generate([3, 14] + g + [92], 2, sampling=s)
    assert fresh.tokens == cont


def test_text_generation_streams_the_decoded_tokens(model):
    tok = model.tokenizer
    stream = model.stream("Hi", max_new_tokens=3)
    pieces = list(stream)
    r = stream.result
    # the raw greedy tokens, up to and including an end-of-generation token
    # (the random weights choose one now and then: the stream ends there)
    raw = list(model.generate(tok.encode("Hi"), 3).tokens)
    eog = next((i for i, t in enumerate(raw) if tok.is_eog(t)), None)
    assert r.tokens == tuple(raw if eog is None else raw[:eog + 1])
    dec = tok.stream_decoder()
    want = "".join(dec.feed(t) for t in r.tokens if not tok.is_eog(t)) + dec.flush()
    assert "".join(pieces) == r.text == want
    assert r.prompt_tokens == len(tok.encode("Hi")) and r.generated_tokens == len(r.tokens)
    assert r.stop_reason == (T.STOP_LENGTH if eog is None else T.STOP_EOG)
    # the first token comes with the prompt; decode steps only after it
    assert r.prompt_seconds > 0 and (r.decode_seconds > 0) == (len(r.tokens) > 1)


def test_three_turn_chat_feeds_only_new_tokens(model):
    """Turns two and three feed the previous reply's last token, the
    end-of-turn token when the reply stopped without one, and the tokens
    the template adds: fewer than the whole conversation; the cache then
    holds the conversation token for token."""
    tok = model.tokenizer
    chat = model.chat_session(max_new_tokens=2)
    r = chat.send("Hi")
    first = encode_chat(tok, [{"role": "user", "content": "Hi"}])
    assert r.prompt_tokens == len(first)
    seq = first + list(r.tokens)
    for q in ("How are you?", "Bye"):
        before = list(chat.messages)
        closed = r.stop_reason == T.STOP_EOG
        r = chat.send(q)
        new = incremental_chat_tokens(tok, before, before + [{"role": "user", "content": q}])
        assert r.prompt_tokens == 1 + (not closed) + len(new)
        assert r.prompt_tokens < len(encode_chat(tok, chat.messages[:-1]))
        seq += ([] if closed else [tok.eot_id]) + new + list(r.tokens)
    assert [m["role"] for m in chat.messages] == ["user", "assistant"] * 3
    hist = model.executor.read(model.step_graph.history)[:model.position + 1]
    assert hist.tolist() == seq
    # another sequence in between: the next turn would encode the whole conversation
    nxt = chat.messages + [{"role": "user", "content": "Again"}]
    assert chat._ids(nxt)[1] is True
    model.generate([1, 2], 1)
    assert chat._ids(nxt) == (encode_chat(tok, nxt), False)


def test_chat_renders_the_template(model):
    msgs = [{"role": "user", "content": "Hi"}]
    r = model.chat(msgs, max_new_tokens=1)
    assert r.prompt_tokens == len(encode_chat(model.tokenizer, msgs)) and r.generated_tokens == 1


def test_capacity_and_overflow(path, monkeypatch):
    """A full KV cache ends a generation (stop reason kv_capacity); a prompt
    or a turn that cannot fit is refused before anything runs.  The random
    model may pick an end-of-generation token within the three steps (seed
    150712800 did), so no token ends it here."""
    m = Model.from_gguf(path, backend="emu", capacity=6, progress=False)
    monkeypatch.setattr(type(m.tokenizer), "is_eog", lambda self, t: False)
    r = m.generate_text([1, 2, 3], max_new_tokens=10)
    assert r.stop_reason == T.STOP_CAPACITY and r.generated_tokens == 3
    assert m.position == 5
    with pytest.raises(ContextOverflowError, match="6 tokens leave no room"):
        m.decode([1, 2, 3, 4, 5, 6])
    next(m.decode([1, 2]))
    with pytest.raises(ContextOverflowError, match="7 tokens leave no room"):
        m.decode([4, 5, 6, 7], keep_cache=True)
    with pytest.raises(ContextOverflowError, match="need 7 positions; the KV cache holds 6"):
        m.generate([1, 2, 3], 4)


def test_tokenizer_comes_with_the_file(path, tmp_path):
    f = LlamaFile(path)
    tok = f.tokenizer()
    assert tok.n_vocab == f.hparams.vocab and tok.chat_template
    bare = tmp_path / "bare.gguf"
    write_synthetic_llama(bare, vocab=64, seed=3, **SMALL)
    assert LlamaFile(bare).tokenizer() is None
    import attrs
    f.hparams = attrs.evolve(f.hparams, vocab=f.hparams.vocab + 1)
    with pytest.raises(GGUFError, match="vocabulary has .* tokens but the model"):
        f.tokenizer()
    with pytest.raises(GGUFError, match="is a directory"):
        LlamaFile(tmp_path)


gpu = pytest.mark.skipif(not cuda_available(), reason="no NVIDIA GPU / driver available")


@pytest.fixture(scope="module")
def gpu_path(tmp_path_factory, module_seed):
    """A Q4_K model with phi-3's whole vocabulary (32,064 tokens)."""
    p = tmp_path_factory.mktemp("gen_gpu") / "tiny-phi3.gguf"
    write_synthetic_llama(p, n_layers=2, hidden=256, ffn=512, n_heads=4, n_kv_heads=2,
                          context_length=512, seed=module_seed, vocab_from=PHI3)
    return str(p)


@pytest.mark.gpu
@gpu
def test_gpu_sampling_eager_equals_graph(gpu_path, seed):
    """Real CUDA graphs: 40 tokens of seeded sampling (llama.cpp's default
    chain with penalties) are the same in eager and graph mode and again;
    a different seed gives a different sequence."""
    m = Model.from_gguf(gpu_path, backend="cuda", capacity=128, progress=False)
    prompt = m.tokenizer.encode("Once upon a time")
    s = SamplingSettings(temperature=0.8, repeat_penalty=1.1, seed=seed)
    a = m.generate(prompt, 40, mode="eager", sampling=s)
    b = m.generate(prompt, 40, mode="graph", sampling=s)
    c = m.generate(prompt, 40, mode="graph", sampling=s)
    assert a.tokens == b.tokens == c.tokens
    other = m.generate(prompt, 40, mode="graph", sampling=SamplingSettings(
        temperature=0.8, repeat_penalty=1.1, seed=(seed + 1) % (1 << 64)))
    assert other.tokens != a.tokens
    g1 = m.generate(prompt, 40, mode="graph")
    g2 = m.generate(prompt, 40, mode="eager")
    k1 = m.generate(prompt, 40, mode="graph", sampling=SamplingSettings(temperature=0.7,
                                                                       top_k=1, seed=seed))
    assert g1.tokens == g2.tokens == k1.tokens
    assert b.launches_per_token == g1.launches_per_token


@pytest.mark.gpu
@gpu
def test_gpu_text_and_chat(gpu_path):
    m = Model.from_gguf(gpu_path, backend="cuda", capacity=256, progress=False)
    r = m.generate_text("Hello", max_new_tokens=16, temperature=0.8, seed=1)
    assert r.generated_tokens <= 16 and r.decode_tokens_per_second > 0
    chat = m.chat_session(max_new_tokens=8, temperature=0.7, seed=2)
    for q in ("Hi", "What is 2+2?", "Thanks"):
        chat.send(q)
    assert len(chat.messages) == 6
