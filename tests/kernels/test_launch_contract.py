"""The launch contract every family keeps: ``launch_geometry`` gives one
:class:`LaunchGeometry` per kernel, naming a kernel its module has, and the
arguments it decides are parameters of that kernel."""

import pytest

from ptxgen import registry
from ptxgen.abi import parse_entries
from ptxgen.kernels.plan import LaunchGeometry

# the family's launch_geometry arguments after the spec, for its canonical specs
SIZES = {
    "argmax": (100_000, 132),
    "block_reduce": (5000, 3),
    "decode_state": (),
    "embedding": (512,),
    "flash_decode": (8, 5),
    "flash_prefill": (32, 300),
    "gemm": (1000, 77),
    "gemv": (1000,),
    "kv_append": (8,),
    "moe_combine": (2048,),
    "moe_gemm": (768, 512, 128),
    "moe_gemv": (768, 8),
    "moe_permute": (512,),
    "moe_wgmma": (768, 512, 8),
    "moe_group": (),
    "moe_router": (1,),
    "paged_attention": (5, 8, 3),
    "rmsnorm": (3,),
    "rope": (32, 8),
    "sampling": (32_000,),
    "stream_read": (1 << 20,),
    "swiglu": (14336,),
    "vector_add": (1000,),
}


def _geometries(fam, spec):
    rows = SIZES[fam.name]
    if fam.name in ("embedding", "sampling") and spec.rows:
        rows += (4,)
    if fam.name == "gemv" and spec.epilogue == "rope":
        rows = (spec.rope_rows,)
    geo = fam.launch_geometry(spec, *rows)
    return geo if isinstance(geo, tuple) else (geo,)


@pytest.mark.parametrize("name", sorted(registry.canonical_specs()))
def test_geometry_names_its_kernel_and_parameters(name):
    fam, spec = registry.canonical_specs()[name]
    assert fam.launch_geometry is not None, f"{fam.name} registers no launch_geometry"
    entries = parse_entries(fam.build(spec).to_ptx())
    geos = _geometries(fam, spec)
    assert all(isinstance(g, LaunchGeometry) for g in geos)
    # several kernels: one geometry each, in the module's order
    assert [g.kernel for g in geos] == list(entries)
    for g in geos:
        params = {p.name: p for p in entries[g.kernel]}
        for arg, value in g.args.items():
            assert arg in params, f"{g.kernel}: geometry argument {arg!r} is no parameter"
            assert isinstance(value, int) and params[arg].type in ("u32", "s32")
        assert len(g.grid) == len(g.block) == 3 and g.threads <= 1024


def test_every_family_is_covered():
    assert set(SIZES) == set(registry.families())


def test_geometry_refuses_bad_fields():
    g = LaunchGeometry("k", (4, 2), 128, 1024, {"rpc": 8})
    assert (g.grid, g.block, g.shared, dict(g.args)) == ((4, 2, 1), (128, 1, 1), 1024, {"rpc": 8})
    assert g.evolve(grid=7).grid == (7, 1, 1) and g.threads == 128
    for bad, match in ((dict(grid=0), "grid must be"), (dict(block=(1, 2, 3, 4)), "block must be"),
                       (dict(grid=(2.0,)), "grid must be"), (dict(block=True), "block must be"),
                       (dict(shared=-1), "shared must be"),
                       (dict(args={"n": "x"}), "int or float values")):
        with pytest.raises(ValueError, match=match):
            g.evolve(**bad)
