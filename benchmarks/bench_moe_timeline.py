"""Benchmark: what each of the MegaMoE decode's expert launches costs inside a CUDA graph, with and without
programmatic dependent launches (PDL), by omission: the graph of all five launches (stage_x, FC1, act, FC2,
combine) against the graphs with one launch left out, and the graphs of each prefix (stage_x; + FC1; + act; ...).
A launch's cost in the graph is full minus the graph without it; a prefix's increments say when each launch ends.
Outputs with a launch left out are wrong (nothing checks them): this measures time only. Where the decode folds act
and combine into FC1 / FC2 (``moe_cuda.FOLD_ACT``: one token at m3.1-small's width) their rows read ~0.

Why: session 25 measured, at T = 1, the expert launches alone at 59.7-62.5 µs plain and 67.9-68.1 with all four
programmatic, while the kernels' own profiler times (eager) are the same either way: ~1.5-2 µs a programmatic edge,
cause unknown. Its first form (torch.profiler over graph replays) recorded no kernel inside the replays on the H200's
torch 2.11 (session 26), so it was rewritten to need nothing but graph timings. The omission costs also bound what
fusing a small launch (act, combine) into its neighbour could save.

Usage (H200): PYTHONPATH=. python benchmarks/bench_moe_timeline.py [--tokens 1,4,16] [--pdl none fc1,act,fc2,combine]
    [--early 0 1]   (moe_cuda.EARLY_LOAD)
"""

from __future__ import annotations

import argparse
import json

import torch
from _timing import bench_graph, write_results
from bench_moe_mma import INTER, E, H, K, S, decode_point, early_setting, pdl_setting

from m3c.backends.kernels import moe_cuda
from m3c.backends.triton_aot import jit_run
from m3c.fused.moe import MegaMoE, random_moe

LAUNCHES = ("moe_stage_x", "moe_fc1", "moe_act", "moe_fc2", "moe_combine")


def timed(call, keep: set[str]) -> float:
    """Graph µs of `call(runner)` launching only the kernels named in `keep` (moe_cuda's launch order kept)."""
    def runner(spec, grid, args):
        if spec.kernel in keep:
            jit_run(spec, grid, args)
    return bench_graph(lambda: call(runner)) * 1e3


def point(t: int, pdl: str, early: int, tokens: tuple, mm: MegaMoE) -> dict:
    """One T (its tokens and routing: `decode_point`'s, the same for every setting) and PDL setting: the full graph,
    each launch left out, each prefix."""
    x, ids, w, touched, floor_ms, _ = tokens
    w13, w2, s13, s2 = mm.weights()

    def call(runner):
        return moe_cuda.moe_decode_mma(x, ids, w, w13, w2, s13, s2, runner=runner)
    call(jit_run)  # prepacked weights and cubins before any capture
    torch.cuda.synchronize()
    full = timed(call, set(LAUNCHES))
    without = {k: full - timed(call, set(LAUNCHES) - {k}) for k in LAUNCHES}
    prefix = [timed(call, set(LAUNCHES[:i + 1])) for i in range(len(LAUNCHES))]
    return {"T": t, "pdl": pdl, "early": early, "experts": touched, "floor_us": floor_ms * 1e3, "full_us": full,
            "cost_in_graph_us": without, "prefix_us": dict(zip(LAUNCHES, prefix, strict=True))}


def main() -> None:
    """Every T and PDL setting: JSON under $OUT and a table."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="1,4,16")
    ap.add_argument("--pdl", nargs="+", default=["none", "fc1,act,fc2,combine"],
                    help="kernels launched programmatically, comma-separated, or none / default (moe_cuda.PDL's)")
    ap.add_argument("--early", type=int, nargs="+", default=[-1],
                    help="moe_cuda.EARLY_LOAD: 1 every build, 0 none, -1 its own")
    args = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    moe = random_moe(H, INTER, E, K, "mxfp8", gen, device="cuda")
    mm = MegaMoE.from_reference(moe)
    saved, saved_early = moe_cuda.PDL, moe_cuda.EARLY_LOAD
    results = []
    try:
        for t in (int(v) for v in args.tokens.split(",")):
            tokens = decode_point(t, moe, mm, gen)
            for pdl, early in ((p, e) for p in args.pdl for e in args.early):
                moe_cuda.PDL, moe_cuda.EARLY_LOAD = pdl_setting(pdl, saved), early_setting(early, saved_early)
                results.append(point(t, pdl, early, tokens, mm))
                print(json.dumps(results[-1]), flush=True)
    finally:
        moe_cuda.PDL, moe_cuda.EARLY_LOAD = saved, saved_early
    write_results("moe_timeline", results, shape=[H, INTER, E, K, S])
    print(f"\n{'T':>3} {'pdl':>20} {'ea':>2} {'full':>7} | cost in the graph (full - without it), µs | prefix ends, µs")
    for r in results:
        cost = " ".join(f"{k[4:]} {v:5.1f}" for k, v in r["cost_in_graph_us"].items())
        ends = " ".join(f"{v:5.1f}" for v in r["prefix_us"].values())
        print(f"{r['T']:>3} {r['pdl']:>20} {r['early']:>2} {r['full_us']:6.1f}u | {cost} | {ends}")


if __name__ == "__main__":
    main()
