"""Every (opcode, modifier, types) of the instruction table is either run
against an exact oracle or named, with the PTX ISA's reason, as a form PTX
does not define (tests/emu/isa_coverage.py, float_modifiers.py)."""

from collections import Counter

import float_modifiers as FM
import isa_coverage as IC
import test_emu_cvt_modifiers as CVT
import test_emu_int_modifiers as INT
import test_emu_memory_modifiers as MEM
import test_emu_sync_forms as SYNC
import test_emu_modifiers as FLT

# the shfl and vote forms tests/emu/test_emu_warp_memory.py runs: each mode
# (with the .sync it needs) on its one type
WARP = {("shfl", m, "b32"): "test_emu_warp_memory.py::test_shfl_modes_with_clamp_and_segments"
        for m in ("", "sync", "up", "down", "bfly", "idx")}
WARP.update({("vote", m, "pred"): "test_emu_warp_memory.py::test_vote"
             for m in ("", "sync", "all", "any", "uni")})
WARP.update({("vote", m, "b32"): "test_emu_warp_memory.py::test_vote"
             for m in ("", "sync", "ballot")})


#: opcodes whose forms (every table combination not named as not PTX) an
#: existing test runs against its oracle; the builder emits each
#: combination as the full form those tests run (mma: every shape and type
#: pair of test_emu_mma.py; wgmma: every N of each type in one kernel; the
#: asynchronous copies, mbarriers and TMA: tests/emu/test_emu_bulk_copy.py,
#: test_emu_async_copy.py, test_emu_tma.py with ranks 1 to 5)
BY_TEST = {
    "mma": ("test_emu_mma.py::test_mma_float_shapes",
            "test_emu_mma.py::test_mma_int8_is_exact",
            "test_emu_mma.py::test_mma_int8_signs_with_satfinite"),
    "wgmma.mma_async": ("test_emu_wgmma.py::test_wgmma_every_shape",
                        "test_emu_wgmma.py::test_wgmma_int8_satfinite"),
    "wgmma.fence": ("test_emu_wgmma.py::test_wgmma_every_shape",),
    "wgmma.commit_group": ("test_emu_wgmma.py::test_wgmma_every_shape",),
    "wgmma.wait_group": ("test_emu_wgmma.py::test_wgmma_every_shape",),
    "ldmatrix": ("test_emu_mma.py::test_ldmatrix",),
    "stmatrix": ("test_emu_mma.py::test_stmatrix",),
    "cp.async.commit_group": ("test_emu_async_copy.py::test_wait_group_leaves_the_newest_groups_pending",),
    "cp.async.wait_group": ("test_emu_async_copy.py::test_wait_group_leaves_the_newest_groups_pending",),
    "cp.async.wait_all": ("test_emu_sync_forms.py::test_cp_async_forms",),
    "cp.async.bulk": ("test_emu_bulk_copy.py::test_copies_land_for_the_waiters",),
    "cp.async.bulk.prefetch.L2": ("test_emu_async_copy.py::test_bulk_prefetch_emits_ptx_8_and_changes_nothing",),
    "cp.async.bulk.tensor": ("test_emu_tma.py::test_tma_box_matches_numpy",),
    "mbarrier.init": ("test_emu_bulk_copy.py::test_copies_land_for_the_waiters",
                      "test_emu_tma.py::test_tma_box_matches_numpy"),
    "mbarrier.arrive.expect_tx": ("test_emu_bulk_copy.py::test_copies_land_for_the_waiters",),
    "mbarrier.try_wait.parity": ("test_emu_bulk_copy.py::test_copies_land_for_the_waiters",),
    "fence.proxy.async": ("test_emu_sync_forms.py::test_barrier_fence_and_control_forms",),
    "mapa": ("test_emu_cluster.py::test_peers_exchange_through_shared_memory",),
    "nanosleep": ("test_emu_spin.py::test_ctas_wait_for_each_other_in_order",),
}


def _vote_not_ptx(op, mod, ty):
    if op == "vote" and (ty == "b32") != (mod == "ballot") and mod not in ("", "sync"):
        return "vote.ballot writes a .b32; all/any/uni write a predicate"
    return None


def _float_split(c):
    op, mod, ty = c
    return op in FM.FLOAT_OPS and ty in FM.FLOAT_TYPES


def _status(c):
    if _float_split(c):
        return "tested" if c in FLT.COVERED else "not PTX" if c in FM.NOT_PTX else None
    if c[0] in IC.ALU_OPS + IC.MEM_OPS + ("mma", "wgmma.mma_async") and IC.not_ptx(*c) \
            or _vote_not_ptx(*c):
        return "not PTX"
    if c in INT.COVERED or c in CVT.COVERED or c in MEM.COVERED or c in SYNC.COVERED \
            or c in WARP or c[0] in BY_TEST:
        return "tested"
    return None


ALU = IC.table_combos(list(IC.ALU_OPS) + list(FM.FLOAT_OPS))


def test_every_arithmetic_bit_compare_conversion_combination_is_tested():
    missing = sorted(c for c in ALU if _status(c) is None)
    assert not missing, f"table combinations with no test: {missing}"
    assert INT.COVERED <= ALU and FLT.COVERED <= ALU and CVT.COVERED <= ALU
    assert not {c for c in INT.COVERED | CVT.COVERED if IC.not_ptx(*c)}


def test_registered_tests_exist():
    import importlib
    for name in set(WARP.values()) | {n for names in BY_TEST.values() for n in names}:
        mod, fn = name.split("::")
        assert hasattr(importlib.import_module(mod[:-3]), fn), name


def test_every_table_combination_is_tested():
    """Every (opcode, modifier, types) of the whole table is run against an
    oracle or named as not PTX; no opcode of the table is left out."""
    combos = IC.table_combos()
    missing = sorted(c for c in combos if _status(c) is None)
    by_op = Counter(c[0] for c in missing)
    assert not missing, f"untested combinations per opcode: {dict(sorted(by_op.items()))}: " \
        f"{missing[:10]}"
    assert {c[0] for c in combos} == set(IC.TABLE), "an opcode has no combination"
    stale = set(BY_TEST) - {c[0] for c in combos}
    assert not stale, f"BY_TEST names opcodes the table lacks: {stale}"


def _ptx_of(combos):
    import ptxgen
    m = ptxgen.Module("sm_90")
    with m.kernel("combos") as k:
        for j, (op, mod, ty) in enumerate(combos):
            tys = IC.type_tuple(ty)
            mods = IC.emitted_mods(op, mod, ty)
            _, stys = IC.operand_types(op, mods, tys)
            IC.emit_combo(k, op, mods, tys, IC.load_sources(k, stys, tag=f"c{j}_"))
    return m.to_ptx()


def test_ptxas_agrees_with_the_int_split(ptxas):
    """ptxas assembles every integer/compare/conversion form run here and
    refuses a sample of those named as not PTX, one per (opcode, reason)."""
    from ptxgen.ptxas import assemble
    tested = sorted(INT.COVERED | {c for c in CVT.COVERED if c[0] == "cvt"})
    for i in range(0, len(tested), 100):        # kernels within the parameter space
        assemble(_ptx_of(tested[i:i + 100]), "sm_90")
    seen, forms = set(), []
    for c in sorted(c for c in IC.table_combos(IC.ALU_OPS) if IC.not_ptx(*c)):
        key = (c[0], IC.not_ptx(*c))
        if key not in seen:                     # one form per reason
            seen.add(key)
            forms.append(c)
    accepted = IC.ptxas_takes(forms, lambda c: _ptx_of([c]), (ValueError,))
    assert not accepted, f"named as not PTX, but ptxas takes them: {accepted}"
