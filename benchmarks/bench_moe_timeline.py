"""Benchmark: where the MegaMoE decode's CUDA-graph time goes between its kernels, with and without programmatic
dependent launches (PDL), from the device timestamps of every kernel of every replay.

Session 25 measured, at T = 1 from CUDA graphs, the expert launches alone (stage_x, FC1, act, FC2, combine) at
59.7-62.5 µs with plain launches and 67.9-68.1 with all four launched programmatically, while the kernels' own
profiler times (eager) sum to 59.2 either way: ~1.5-2 µs per programmatic edge, cause unknown. (At NT = 2, T = 16,
the same launches are 2-3% faster.) This script captures each setting's launches in one CUDA graph, replays it under
torch.profiler (CUPTI records the kernels inside graph replays) and, per replay, prints each kernel's start relative
to the replay's first kernel, its duration and its gap from its predecessor's end (negative: overlap), as medians
over the replays. If PDL's kernels start early but end late, or a gap appears where none was, it shows where.

Usage (H200): PYTHONPATH=. python benchmarks/bench_moe_timeline.py [--tokens 1,4,16] [--pdl none fc1,act,fc2,combine]
    [--whole]   (--whole: the whole op, the MegaMoE module with its routing launch, not the expert launches alone)
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import tempfile
from pathlib import Path

import torch
from _timing import write_results
from bench_moe_mma import INTER, E, H, K, S, decode_point, pdl_setting

from m3c.backends.kernels import moe_cuda
from m3c.fused.moe import MegaMoE, random_moe

REPLAYS, WARM = 30, 5


def kernel_spans(fn, replays: int = REPLAYS) -> list[list[tuple[str, float, float]]]:
    """fn captured in a CUDA graph and replayed WARM + `replays` times under torch.profiler: per timed replay, its
    kernels as (name, start µs, end µs) in start order (replays told apart by the first kernel's name recurring).
    The capture happens inside the profiler, so CUPTI sees the graph's kernel nodes however the torch build traces
    graphs; the first WARM replays are dropped."""
    from torch.profiler import ProfilerActivity, profile

    fn()  # warm-up: compiles, prepacked weights
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        for _ in range(WARM + replays):
            graph.replay()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "trace.json"
        prof.export_chrome_trace(str(path))
        events = json.loads(path.read_text())["traceEvents"]
    kernels = sorted(((e["name"].split("(")[0], float(e["ts"]), float(e["ts"]) + float(e["dur"]))
                      for e in events if e.get("cat") == "kernel"), key=lambda k: k[1])
    if not kernels:
        raise RuntimeError("the profiler recorded no kernels inside the graph replays")
    first = kernels[0][0]
    runs: list[list[tuple[str, float, float]]] = []
    for k in kernels:
        if k[0] == first or not runs:
            runs.append([])
        runs[-1].append(k)
    runs = runs[WARM:] if len(runs) > WARM else runs
    return [r for r in runs if len(r) == len(runs[0])]


def summarize(runs: list[list[tuple[str, float, float]]]) -> dict:
    """Medians over the replays: each kernel's start (from the replay's first start), duration and gap from the
    previous kernel's end; the replay's span (first start to last end) and the gap to the next replay."""
    names = [k[0] for k in runs[0]]
    rows = []
    for i, name in enumerate(names):
        rows.append({"kernel": name,
                     "start_us": statistics.median(r[i][1] - r[0][1] for r in runs),
                     "dur_us": statistics.median(r[i][2] - r[i][1] for r in runs),
                     "gap_us": statistics.median(r[i][1] - r[i - 1][2] for r in runs) if i else 0.0})
    between = [b[0][1] - a[-1][2] for a, b in itertools.pairwise(runs)]
    return {"kernels": rows, "span_us": statistics.median(r[-1][2] - r[0][1] for r in runs),
            "between_replays_us": statistics.median(between) if between else float("nan"), "replays": len(runs)}


def _call(whole: bool, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, mm: MegaMoE):
    """The call to time: the whole op (the MegaMoE module: its routing launch included) or the expert launches
    alone over precomputed routing."""
    if whole:
        return lambda: mm(x)
    w13, w2, s13, s2 = mm.weights()
    return lambda: moe_cuda.moe_decode_mma(x, ids, w, w13, w2, s13, s2)


def main() -> None:
    """Every T and PDL setting: the per-kernel timeline (JSON under $OUT) and a table."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="1,4,16")
    ap.add_argument("--pdl", nargs="+", default=["none", "fc1,act,fc2,combine"],
                    help="kernels launched programmatically, comma-separated, or none / default (moe_cuda.PDL's)")
    ap.add_argument("--whole", action="store_true", help="the whole op (megamoe with its routing launch)")
    args = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    moe = random_moe(H, INTER, E, K, "mxfp8", gen, device="cuda")
    mm = MegaMoE.from_reference(moe)
    saved = moe_cuda.PDL
    results = []
    try:
        for t in (int(v) for v in args.tokens.split(",")):
            x, ids, w, touched, floor_ms, _ = decode_point(t, moe, mm, gen)
            for pdl in args.pdl:
                moe_cuda.PDL = pdl_setting(pdl, saved)
                row = {"T": t, "pdl": pdl, "whole": args.whole, "experts": touched, "floor_us": floor_ms * 1e3,
                       **summarize(kernel_spans(_call(args.whole, x, ids, w, mm)))}
                print(json.dumps(row), flush=True)
                results.append(row)
    finally:
        moe_cuda.PDL = saved
    write_results("moe_timeline", results, shape=[H, INTER, E, K, S])
    for r in results:
        print(f"\nT = {r['T']}, pdl {r['pdl']}{' (whole op)' if r['whole'] else ''}: span {r['span_us']:.1f} µs "
              f"(floor {r['floor_us']:.1f}), {r['between_replays_us']:.1f} µs to the next replay, "
              f"{r['replays']} replays")
        print(f"  {'kernel':<22} {'start':>8} {'dur':>8} {'gap':>8}")
        for k in r["kernels"]:
            print(f"  {k['kernel'][:22]:<22} {k['start_us']:>7.1f}u {k['dur_us']:>7.1f}u {k['gap_us']:>7.1f}u")


if __name__ == "__main__":
    main()
