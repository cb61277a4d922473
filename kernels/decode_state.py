"""Decode-step state advance: the last launch of a decode step.

After the step for position ``pos`` has chosen its token (the argmax
launch, or the sampler's, writes it to the ``argmax`` word), one thread
moves the state on to ``pos + 1``:

- the next token is the prompt's token at ``pos + 1`` while the prompt lasts,
  the chosen one otherwise; it is written to ``token`` and ``history[pos + 1]``;
- ``pos`` becomes ``pos + 1`` and ``kv_len`` becomes ``pos + 2`` (the
  attention length of the next step);
- at the end of the context (``pos + 1 == capacity``) nothing moves and
  ``overflow`` is set to 1, which the host checks.

Everything lives in device memory, so a CUDA graph captured once replays
every step without new launch arguments.  Launch: grid 1, block 32.

State layout (``int32[8]``): ``[token, pos, kv_len, prompt_len, overflow,
argmax, -, -]``.
"""

from __future__ import annotations

import attrs
import numpy as np

import ptxgen
from ptxgen import registry
from ptxgen.types import s32

from .plan import LaunchGeometry
from .spec_fields import pdl_field, pdl_prologue, target_field

TOKEN, POS, KV_LEN, PROMPT_LEN, OVERFLOW, ARGMAX = range(6)
STATE_WORDS = 8


@attrs.frozen
class DecodeStateSpec:
    target: str = target_field()
    pdl: bool = pdl_field()

    @property
    def kernel_name(self) -> str:
        return "decode_state_advance"


def build(spec: DecodeStateSpec) -> ptxgen.Module:
    m = ptxgen.Module(spec.target)
    with m.kernel(spec.kernel_name, maxntid=32) as k:
        pdl_prologue(k, spec)
        state = k.param_ptr("state", s32, align=16)
        prompt = k.param_ptr("prompt", s32)
        history = k.param_ptr("history", s32)
        capacity = k.param("capacity", s32)
        with k.if_(k.tid.x.eq(0)):
            pos = k.ld(state[POS], volatile=False)
            nxt = pos + 1
            with k.if_else(nxt < capacity) as (then, otherwise):
                with then:
                    tok = k.var(s32)
                    tok.set(k.ld(state[ARGMAX]))
                    with k.if_(nxt < k.ld(state[PROMPT_LEN])):
                        tok.set(k.ld(prompt[nxt]))
                    k.st(history[nxt], tok)
                    k.st(state[TOKEN], tok)
                    k.st(state[POS], nxt)
                    k.st(state[KV_LEN], nxt + 1)
                with otherwise:
                    k.st(state[OVERFLOW], 1)
    return m


def launch_geometry(spec: DecodeStateSpec):
    return LaunchGeometry(spec.kernel_name, 1, 32)


def initial_state(prompt_first: int, prompt_len: int) -> np.ndarray:
    s = np.zeros(STATE_WORDS, np.int32)
    s[TOKEN] = prompt_first
    s[POS] = 0
    s[KV_LEN] = 1
    s[PROMPT_LEN] = prompt_len
    return s


def reference(state: np.ndarray, prompt: np.ndarray, history: np.ndarray, capacity: int):
    """The same update on host arrays (in place)."""
    nxt = int(state[POS]) + 1
    if nxt < capacity:
        tok = int(prompt[nxt]) if nxt < state[PROMPT_LEN] else int(state[ARGMAX])
        history[nxt] = tok
        state[TOKEN] = tok
        state[POS] = nxt
        state[KV_LEN] = nxt + 1
    else:
        state[OVERFLOW] = 1


CANONICAL = {"decode_state": DecodeStateSpec()}

registry.register("decode_state", DecodeStateSpec, build, CANONICAL, doc=__doc__.splitlines()[0],
                  launch_geometry=launch_geometry)
