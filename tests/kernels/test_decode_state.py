"""The decode-state advance kernel, step by step.

The oracle is written out in the test from the kernel's contract (the next
token from the prompt while it lasts, else the argmax; pos + 1, kv_len =
pos + 2; at the context's end only the overflow flag), with the state words
named by their index in the documented layout ``[token, pos, kv_len,
prompt_len, overflow, argmax, -, -]``; ``decode_state.reference`` is
checked against the same steps.
"""

import numpy as np
import pytest

from ptxgen.kernels import decode_state as D

# the documented layout, spelled out here rather than taken from the module
TOKEN, POS, KV_LEN, PROMPT_LEN, OVERFLOW, ARGMAX = 0, 1, 2, 3, 4, 5


def step(state, prompt, history, capacity):
    """One advance on Python lists."""
    pos = state[POS]
    if pos + 1 >= capacity:
        state[OVERFLOW] = 1
        return
    tok = prompt[pos + 1] if pos + 1 < state[PROMPT_LEN] else state[ARGMAX]
    history[pos + 1] = tok
    state[TOKEN], state[POS], state[KV_LEN] = tok, pos + 1, pos + 2


def test_layout_constants():
    assert (D.TOKEN, D.POS, D.KV_LEN, D.PROMPT_LEN, D.OVERFLOW, D.ARGMAX) == \
        (TOKEN, POS, KV_LEN, PROMPT_LEN, OVERFLOW, ARGMAX)
    s = D.initial_state(17, 5)
    assert s.tolist() == [17, 0, 1, 5, 0, 0, 0, 0]


def test_decode_state_steps(run, rng):
    """Advance from position 0 to past the capacity, a fresh argmax before
    every step; device state, history and the oracle agree at each step."""
    capacity = int(rng.integers(6, 12))
    prompt_len = int(rng.integers(2, capacity - 2))
    prompt = rng.integers(1, 50000, capacity).astype(np.int32)   # only prompt_len are used
    state = D.initial_state(int(prompt[0]), prompt_len)
    state[6:] = rng.integers(-9, 9, 2)                           # unused words stay as they are
    history = rng.integers(-1000, -1, capacity).astype(np.int32)
    spec = D.DecodeStateSpec()
    fn = run.function(D.build, spec)
    geo = D.launch_geometry(spec)
    d_state, d_prompt, d_hist = run.array(state), run.array(prompt), run.array(history)
    ref_state, ref_hist = state.tolist(), history.tolist()
    host_state, host_hist = state.copy(), history.copy()
    for _ in range(capacity + 1):
        argmax = int(rng.integers(0, 128256))
        s = run.get(d_state).copy()
        s[ARGMAX] = argmax
        d_state = run.array(s)
        ref_state[ARGMAX] = host_state[ARGMAX] = argmax
        run.launch(fn, geo, dict(state=d_state, prompt=d_prompt, history=d_hist,
                                 capacity=capacity))
        step(ref_state, prompt.tolist(), ref_hist, capacity)
        D.reference(host_state, prompt, host_hist, capacity)
        assert run.get(d_state).tolist() == ref_state
        assert run.get(d_hist).tolist() == ref_hist
        assert host_state.tolist() == ref_state and host_hist.tolist() == ref_hist
    assert ref_state[OVERFLOW] == 1 and ref_state[POS] == capacity - 1


@pytest.mark.parametrize("bad", [dict(target="sm_10")])
def test_decode_state_refuses(bad):
    with pytest.raises(ValueError):
        D.DecodeStateSpec(**bad)
