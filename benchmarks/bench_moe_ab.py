"""Same-run A/B of two source trees for the MegaMoE decode: run this script once per tree (PYTHONPATH picks the
tree), alternating, with the same seed: each T's whole op (``MegaMoE`` from a CUDA graph) and, where the CUDA decode
kernels take T, the expert launches alone over the same routing; the error against the float32 reference and a hash
of the output (equal hashes: bitwise the same result).

Usage (H200): PYTHONPATH=<tree> python benchmarks/bench_moe_ab.py --tag new --tokens 1,4,16,64 >> ab.jsonl
A knob of one tree instead: ... --tag d1 --knob DECODE=1 (moe_cuda's module attributes, ints); the programmatic
launches of one NT build: ... --tag fc2 --pdl 1=moe_fc2 (``--pdl 1=`` none; ``--pdl fold=...`` the folded calls';
moe_cuda.PDL); --kernels: each expert launch's profiler µs too; --soak S: the SM clock and power over S seconds of
replays.
Then: python benchmarks/bench_moe_ab.py --summarize ab.jsonl (a line per T and tag, the runs side by side).
"""

from __future__ import annotations

import argparse
import hashlib
import json

import torch
from _timing import bench_graph, kernel_times, soak_clock

from m3c.backends.kernels import moe_cuda
from m3c.backends.kernels.moe_routing import moe_route
from m3c.fused.moe import MegaMoE, random_moe

H, INTER, E, K, S = 6144, 1536, 64, 8, 1536


def point(tag: str, t: int, moe, mm: MegaMoE, gen: torch.Generator, kernels: bool = False, soak: float = 0.0) -> dict:
    """One T: error, output hash, the whole op and (where the CUDA decode kernels take T) the experts alone (with
    `kernels`, also each of their launches' profiler µs: a kernel's own time, the gaps between them left out; with
    `soak`, the median SM clock and board power while the whole op's CUDA graph replays for that many seconds)."""
    w13, w2, s13, s2 = mm.weights()
    cfg = moe.cfg
    x = torch.randn(t, H, generator=gen, device="cuda").to(torch.bfloat16)
    ids, w = moe_route(x, moe.gate.weight, moe.e_score_correction_bias, top_k=K,
                       routed_scaling_factor=cfg.routed_scaling_factor, norm_topk_prob=cfg.norm_topk_prob)
    w = w.float()
    out = mm(x)
    truth = moe(x.float())
    row = {"tag": tag, "T": t, "experts": int(torch.unique(ids).numel()),
           "err": float((out.float() - truth).norm() / truth.norm()),
           "hash": hashlib.sha256(out.float().cpu().numpy().tobytes()).hexdigest()[:12],
           "megamoe_us": bench_graph(lambda: mm(x)) * 1e3}
    if soak > 0:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            mm(x)
        row["sm_mhz"], row["watts"] = soak_clock(graph.replay, soak)
    if t <= moe_cuda.MAX_TOKENS:
        row["experts_us"] = bench_graph(lambda: moe_cuda.moe_decode_mma(x, ids, w, w13, w2, s13, s2)) * 1e3
        if kernels:
            row["kernels_us"] = kernel_times(lambda: moe_cuda.moe_decode_mma(x, ids, w, w13, w2, s13, s2))
    return row


def set_knobs(knobs: list[str]) -> None:
    """Set moe_cuda's int / bool knobs from NAME=INT strings (an unknown name raises AttributeError)."""
    for kv in knobs:
        name, value = kv.split("=")
        setattr(moe_cuda, name, type(getattr(moe_cuda, name))(int(value)))


def summarize(path: str) -> None:
    """One line per (T, tag) of a JSON-lines file of runs: each run's whole op / experts µs in file order, the
    output hashes (one hash across every tag of a T: the settings are bitwise the same) and the error."""
    rows: dict[tuple[int, str], list[dict]] = {}
    with open(path) as f:
        for line in f:
            if line.startswith("{"):
                r = json.loads(line)
                rows.setdefault((r["T"], r["tag"]), []).append(r)
    print(f"{'T':>3} {'tag':<24} {'megamoe us (runs)':<24} {'experts us (runs)':<24} {'hash':<14} err")
    for (t, tag), rs in sorted(rows.items(), key=lambda kv: kv[0][0]):
        mm = " / ".join(f"{r['megamoe_us']:.1f}" for r in rs)
        ex = " / ".join(f"{r['experts_us']:.1f}" for r in rs if "experts_us" in r)
        hashes = ",".join(sorted({r["hash"] for r in rs}))
        print(f"{t:>3} {tag:<24} {mm:<24} {ex:<24} {hashes:<14} {rs[0]['err']:.2e}")
        if "kernels_us" in rs[0]:  # the first run's launches
            print("      " + ", ".join(f"{k} {v:.1f}" for k, v in rs[0]["kernels_us"].items()))


def main() -> None:
    """Time every T in this tree and print one JSON line per T (or, with --summarize FILE, summarize such lines)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--summarize", metavar="JSONL", help="print the table of a file of runs and exit")
    ap.add_argument("--tag")
    ap.add_argument("--tokens", default="1,4,16,64")
    ap.add_argument("--knob", action="append", default=[], metavar="NAME=INT",
                    help="set moe_cuda.NAME (an int or bool knob, e.g. DECODE=1) before timing")
    ap.add_argument("--pdl", action="append", default=[], metavar="NT=K1,K2",
                    help="launch these kernels of the NT (or 'fold') builds programmatically (moe_cuda.PDL; empty: none)")
    ap.add_argument("--kernels", action="store_true", help="also each expert launch's profiler µs")
    ap.add_argument("--soak", type=float, default=0.0,
                    help="also the SM clock and power (nvidia-smi) while the whole op replays this many seconds")
    args = ap.parse_args()
    if args.summarize:
        summarize(args.summarize)
        return
    if not args.tag:
        ap.error("--tag is required to time")
    set_knobs(args.knob)
    for kv in args.pdl:
        nt, names = kv.split("=")
        kernels = tuple(k for k in names.split(",") if k)
        known = (*moe_cuda.PDL_KERNELS, "moe_experts")  # (moe_experts: QUEUE's one launch, for fold=)
        unknown = set(kernels) - set(known)
        if unknown:
            ap.error(f"--pdl {kv}: {sorted(unknown)} not in {known}")
        moe_cuda.PDL = {**moe_cuda.PDL, (nt if nt == "fold" else int(nt)): kernels}
    gen = torch.Generator(device="cuda").manual_seed(0)
    moe = random_moe(H, INTER, E, K, "mxfp8", gen, device="cuda")
    mm = MegaMoE.from_reference(moe)
    for t in (int(v) for v in args.tokens.split(",")):
        print(json.dumps(point(args.tag, t, moe, mm, gen, args.kernels, args.soak)), flush=True)


if __name__ == "__main__":
    main()
