"""The candidate sets of ``python -m ptxgen tune gemv`` (CPU: no timing)."""

import attrs

from ptxgen.driver import tune
from ptxgen.kernels import gemv


def test_qtype_calls_are_the_8b_shapes_per_type():
    calls = tune.qtype_calls(["Q4_0", "Q5_K"])
    shapes = [(m, k) for _, m, k, _ in tune.LLAMA_8B]
    assert calls == [(q, m, k, "none") for q in ("Q4_0", "Q5_K") for m, k in shapes]


def test_search_moves_change_one_knob_and_build():
    spec = gemv.GemvSpec("Q5_0", 4096, target="sm_90")
    base = gemv.select_config(spec, 14336, 132)
    moves = tune.search_moves(spec, base, 14336, 132)
    assert len(moves) >= 5
    knobs = set(tune.SEARCH)
    base0 = attrs.asdict(attrs.evolve(base, per_sm=0))
    for c in moves:
        gemv.GemvPlan(spec, c)                       # every move builds
        d = attrs.asdict(c)
        changed = {f for f in d if f not in ("per_sm", "ahead") and d[f] != base0[f]}
        assert len(changed) == 1 and changed <= knobs, (c, changed)
    # both dot products and at least two row counts are among the moves
    assert {c.dot for c in moves} | {base.dot} == {"fma", "dp4a"}
    assert len({c.rows for c in moves}) >= 2
