"""The experts' GEMMs of one MoE layer on the two chunk paths, side by side
(scripts/gpu_moewg.sh; issue 56): the ``mma.sync`` experts' GEMM
(kernels/moe/expert_gemm.py: gate, up with SwiGLU, down, X f32 gathered
row by row) and the sm_90a warpgroup one (kernels/moe/permute.py, then
kernels/moe/expert_wgmma.py: gate, up with SwiGLU into f16, down into each
pair's row), both after the same grouping (kernels/moe/group.py), each with
kernels/tuning/moe_ffn.json's configs for the chunk's rows.

The shape is Qwen3-30B-A3B's (hidden 2048, 128 experts, 8 used, expert FFN
768; gate/up Q4_K, down Q6_K and Q4_K; random blocks, their f16 scales set
to 2^-8), the ids random (8 distinct experts a token).  Each launch set is
timed as a CUDA graph (median of 5 replays of 10), and the two paths'
down outputs (each pair's row) compared: "WRONG" past 1e-3 of the largest.
Then a sweep of the warpgroup GEMM's tiles (CANDIDATES), gate + up and down
timed apart, each checked against the table config's output.  One
``SUMMARY`` line per number, in microseconds.

``--tiny``: a small shape (hidden and expert FFN 256, 8 experts, 2 used,
chunks of 5 and 9 rows) run once with no timing, for a check of this
script on the emulator (``--backend emu``).
"""

from __future__ import annotations

import argparse
import statistics

import attrs
import numpy as np

from ptxgen.driver.backend import get_backend
from ptxgen.kernels import gemm as GM
from ptxgen.kernels import tuning
from ptxgen.kernels.moe import expert_gemm, expert_wgmma, group, permute
from ptxgen.kernels.quants.qtypes import qtype_of
from ptxgen.target import TARGETS

#: the warpgroup GEMM's (bm, bn, stages) the sweep times for gate + up and
#: for down: the table's (or first_tile's) first, then column tiles of
#: 16..128 pairs (an expert holds about 4, 8 and 32 pairs at 64, 128 and
#: 512 rows), one
#: warpgroup (more CTAs) and four (fewer re-reads of X), deeper rings
CANDIDATES = [(128, 16, 4), (128, 32, 4), (128, 64, 4), (128, 128, 4), (128, 64, 6),
              (64, 32, 6), (64, 64, 6), (256, 64, 3)]


def first_tile(T: int) -> dict:
    """The warpgroup tile timed first where the table has none: 16-pair
    column tiles up to 128 rows, 64 from 256 (an expert's pairs there)."""
    return {"bm": 128, "bn": 16 if T <= 128 else 64, "stages": 4}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="cuda")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--rows", default="64,128,512")
    ap.add_argument("--no-sweep", action="store_true")
    a = ap.parse_args()
    be = get_backend(a.backend)
    if a.tiny:
        E, NU, H, F, rows = 8, 2, 256, 256, (5, 9)
    else:
        E, NU, H, F, rows = 128, 8, 2048, 768, tuple(int(r) for r in a.rows.split(","))
    Bench(be, E, NU, H, F, timed=not a.tiny).run(rows, sweep=not a.no_sweep)


class Bench:
    def __init__(self, be, E, NU, H, F, timed):
        self.be, self.E, self.NU, self.H, self.F, self.timed = be, E, NU, H, F, timed
        self.s = be.stream()
        self.rng = np.random.default_rng(0)
        self.w = {"gate": self.experts("Q4_K", F, H), "up": self.experts("Q4_K", F, H),
                  "Q6_K": self.experts("Q6_K", H, F), "Q4_K": self.experts("Q4_K", H, F)}
        self.wg_target = "sm_90a" if be.target == "sm_90" else be.target

    def experts(self, q, m, k):
        """Random ``q`` blocks of the experts, their f16 scales 2^-8."""
        qt = qtype_of(q)
        rb, bb = qt.row_bytes(k), qt.type_size
        w = self.rng.integers(0, 256, (self.E, m, rb // bb, bb), dtype=np.uint8)
        for o in {"Q4_K": (0, 2), "Q6_K": (208,)}[q]:
            w[..., o:o + 2] = np.frombuffer(np.float16(2.0 ** -8).tobytes(), np.uint8)
        return self.be.from_numpy(w.reshape(self.E, m, rb))

    def fn(self, build, spec):
        return self.be.function(build, spec)

    def time_us(self, issue, reps=10, repeats=5):
        """The median time of ``issue()`` as a CUDA graph; once, untimed,
        where not timed."""
        be, s = self.be, self.s
        issue()
        be.synchronize(s)
        if not self.timed:
            return float("nan")
        from ptxgen.driver import Event
        graph = be.capture(s, lambda: [issue() for _ in range(reps)])
        be.replay(graph, s)
        be.synchronize(s)
        ts = []
        for _ in range(repeats):
            t0, t1 = Event(), Event()
            t0.record(s)
            be.replay(graph, s)
            t1.record(s)
            t1.synchronize()
            ts.append(t0.elapsed_ms(t1) * 1000.0 / reps)
        return statistics.median(ts)

    def launch(self, build, spec, geo, **args):
        self.be.launch(self.fn(build, spec), geo, args, stream=self.s)

    def table(self, T, down_q):
        call = {"rows": max(T, 64), "qtype": "Q4_K", "down_qtype": down_q, "n_expert": self.E,
                "n_used": self.NU, "hidden": self.H, "expert_ffn": self.F,
                "sm": TARGETS[self.be.target].sm, "target": self.be.target}
        return tuning.cascade("moe_ffn", call)

    def mma_specs(self, cfg, down_q):
        def spec(q, k, key, **kw):
            c = dict(cfg[key])
            xa, packed = c.pop("x_ahead", False), c.pop("packed", False)
            return expert_gemm.ExpertGemmSpec(
                GM.GemmPlan(GM.GemmSpec(q, k, target=self.be.target), GM.GemmConfig(**c)),
                self.NU, x_ahead=xa, n_expert=self.E if packed else 0, **kw)
        gate = spec("Q4_K", self.H, "gate_up", x_token=True)
        return gate, attrs.evolve(gate, swiglu=True), spec(down_q, self.F, "down")

    def wg_spec(self, q, k, tile, out):
        bm, bn, st = tile
        plan = GM.GemmPlan(GM.GemmSpec(q, k, x_type="f16", target=self.wg_target),
                           GM.GemmConfig(kernel="wgmma", bm=bm, bn=bn, stages=st))
        return expert_wgmma.ExpertWgmmaSpec(plan, self.E, out)

    def xmap(self, spec, arr, rows):
        return self.be.tensor_map(GM.x_map(spec.plan, self.be.ptr(arr), rows))

    def run(self, rows, sweep):
        be, E, NU, H, F = self.be, self.E, self.NU, self.H, self.F
        for T in rows:
            P = T * NU
            ids = np.argsort(self.rng.random((T, E)), axis=1)[:, :NU].astype(np.int32)
            x = be.from_numpy(self.rng.standard_normal((T, H)).astype(np.float32))
            t_ptr = be.from_numpy(np.array([T], np.uint32))
            srt = dict(counts=be.zeros((E,), np.uint32), offsets=be.zeros((E,), np.uint32),
                       pairs=be.zeros((P,), np.uint32))
            grs = group.MoeGroupSpec(E, NU, target=be.target)

            def grouping():
                self.launch(group.build, grs, group.launch_geometry(grs),
                            ids=be.from_numpy(ids), t_ptr=t_ptr, **srt)
            t_group = self.time_us(grouping)
            ps = permute.MoePermuteSpec(NU, H, target=be.target)
            xs = be.zeros((P, H), np.float16)

            def permuting():
                self.launch(permute.build, ps, permute.launch_geometry(ps, T), x=x,
                            pairs=srt["pairs"], t_ptr=t_ptr, xs=xs)
            t_perm = self.time_us(permuting)
            print(f"SUMMARY moewg T={T:3d} grouping {t_group:7.1f} us, permute {t_perm:7.1f} us")
            act_m = be.zeros((P, F), np.float32)
            act16 = be.zeros((P, F), np.float16)
            gate_w = be.zeros((P, F), np.float32)
            for down_q in ("Q6_K", "Q4_K"):
                cfg = self.table(T, down_q)
                g, u, d = self.mma_specs(cfg, down_q)
                down_m = be.zeros((P, H), np.float32)
                down_w = be.zeros((P, H), np.float32)
                wd = self.w[down_q]

                def mma_gate_up():
                    self.launch(expert_gemm.build, g, expert_gemm.launch_geometry(g, F, T, E),
                                w=self.w["gate"], x=x, y=act_m, m=F, **srt)
                    self.launch(expert_gemm.build, u, expert_gemm.launch_geometry(u, F, T, E),
                                w=self.w["up"], x=x, r=act_m, y=act_m, m=F, **srt)

                def mma_down():
                    self.launch(expert_gemm.build, d, expert_gemm.launch_geometry(d, H, T, E),
                                w=wd, x=act_m, y=down_m, m=H, **srt)
                wgu, wdn = (tuple(cfg.get(key, first_tile(T))[f] for f in ("bm", "bn", "stages"))
                            for key in ("wgmma_gate_up", "wgmma_down"))
                wg_gu = self.wg_gate_up(T, wgu, xs, gate_w, act16, srt)
                wg_dn = self.wg_down(T, down_q, wdn, act16, down_w, srt)
                tm_gu, tm_dn = self.time_us(mma_gate_up), self.time_us(mma_down)
                tw_gu, tw_dn = self.time_us(wg_gu), self.time_us(wg_dn)
                diff = rel(be, down_w, down_m)
                mma = t_group + tm_gu + tm_dn
                wgm = t_group + t_perm + tw_gu + tw_dn
                print(f"SUMMARY moewg T={T:3d} down {down_q} mma.sync gate+up {tm_gu:7.1f} us "
                      f"down {tm_dn:7.1f} us | wgmma gate+up {tw_gu:7.1f} us down {tw_dn:7.1f} "
                      f"us | outputs differ by {diff:.1e}{'' if diff < 1e-3 else ' WRONG'}")
                print(f"SUMMARY moewg T={T:3d} down {down_q} experts a layer (grouping, "
                      f"permute): mma.sync {mma:7.1f} us, wgmma {wgm:7.1f} us, "
                      f"{mma / wgm:5.2f}x; 48 layers (experts only) "
                      f"{T / (48 * mma * 1e-6):8.0f} -> {T / (48 * wgm * 1e-6):8.0f} tokens/s")
                if sweep:
                    self.sweep(T, down_q, xs, act16, down_w, gate_w, srt)

    def wg_gate_up(self, T, tile, xs, gate_w, act16, srt):
        """The warpgroup gate and up (SwiGLU) launches of ``tile``."""
        E, NU, H, F = self.E, self.NU, self.H, self.F
        g = self.wg_spec("Q4_K", H, tile, "sorted")
        u = attrs.evolve(g, out="swiglu")
        cs = dict(counts=srt["counts"], offsets=srt["offsets"])
        gm, um = self.xmap(g, xs, T * NU), self.xmap(u, xs, T * NU)

        def issue():
            self.launch(expert_wgmma.build, g, expert_wgmma.launch_geometry(g, F, T, NU),
                        w=self.w["gate"], y=gate_w, m=F, xmap=gm, **cs)
            self.launch(expert_wgmma.build, u, expert_wgmma.launch_geometry(u, F, T, NU),
                        w=self.w["up"], r=gate_w, y=act16, m=F, xmap=um, **cs)
        return issue

    def wg_down(self, T, down_q, tile, act16, down_w, srt):
        """The warpgroup down launch of ``tile``."""
        d = self.wg_spec(down_q, self.F, tile, "pairs")
        dm = self.xmap(d, act16, T * self.NU)

        def issue():
            self.launch(expert_wgmma.build, d,
                        expert_wgmma.launch_geometry(d, self.H, T, self.NU),
                        w=self.w[down_q], y=down_w, m=self.H, xmap=dm, **srt)
        return issue

    def sweep(self, T, down_q, xs, act16, down_w, gate_w, srt):
        """Each candidate tile against the outputs of the tile timed first
        (the table's, or :func:`first_tile`'s)."""
        be, P = self.be, T * self.NU
        best = {}
        for part in (("gate_up",) if down_q == "Q6_K" else ()) + ("down",):
            for tile in CANDIDATES:
                if part == "gate_up":
                    out, ref = be.zeros((P, self.F), np.float16), act16
                    gw = be.zeros((P, self.F), np.float32)
                    launches = lambda: self.wg_gate_up(T, tile, xs, gw, out, srt)  # noqa: E731
                else:
                    out, ref = be.zeros((P, self.H), np.float32), down_w
                    launches = lambda: self.wg_down(T, down_q, tile, act16, out, srt)  # noqa: E731
                try:
                    issue = launches()
                except ValueError as e:
                    print(f"T={T} {part} {tile}: not a config: {e}")
                    continue
                try:
                    t = self.time_us(issue)
                except Exception as e:          # a launch the device refuses (resources)
                    print(f"T={T} {part} {tile}: failed: {type(e).__name__}: {e}")
                    continue
                diff = rel(be, out, ref)
                ok = diff < 1e-3
                print(f"T={T} {part} {down_q if part == 'down' else 'Q4_K'} bm,bn,stages={tile}: "
                      f"{t:8.1f} us, differs from the first tile's by {diff:.1e}"
                      f"{'' if ok else ' (WRONG: not counted)'}")
                if ok and (part not in best or t < best[part][0]):
                    best[part] = (t, tile)
        for part, (t, tile) in best.items():
            print(f"SUMMARY moewg sweep T={T:3d} best wgmma {part:7s} "
                  f"{down_q if part == 'down' else 'Q4_K'} {t:8.1f} us: bm,bn,stages={tile}")


def rel(be, got, want):
    a = be.to_numpy(got).astype(np.float64)
    b = be.to_numpy(want).astype(np.float64)
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


if __name__ == "__main__":
    main()
