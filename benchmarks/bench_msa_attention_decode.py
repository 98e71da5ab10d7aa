"""Benchmark: where the MSA sparse-attention decode's time goes — its split, pipeline stages and warps.

One GPU's TP4 slice (16 q heads, 1 KV head, D = 128, block 128, top-16, NVFP4 K/V, bf16 q), one query row
per request, a selection of 16 random distinct blocks per row (the own block included). For each tiling:
the CUDA-graph median of the kernel launch alone (``graph_us``), the kernel's device time from the profiler
(``kernel_us``: start to end on the GPU, without launch work) and its max relative difference to the
default tiling's output. The byte floor of a row (its 16 blocks' K and V, 288 KiB) is ~0.07 µs: this
kernel is latency-bound, so the interesting column is how far kernel_us is above a few DRAM round trips.

Usage (H200): PYTHONPATH=. python benchmarks/bench_msa_attention_decode.py [--contexts 32768 1048576]
[--batches 1 8] [--cuda] (``--cuda``: also the CUDA C++ kernel of msa_attention_cuda at each split and
``--cuda-warps`` CTA size, its output
compared with the first Triton tiling's); writes $OUT/msa_attention_decode.json (or benchmarks/results/) and prints a table.
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
from _timing import bench_graph, kernel_times, record_point, write_results
from bench_msa import BS, TOPK, D, make_batch

from m3c.backends.kernels import msa_attention_cuda
from m3c.backends.kernels.msa_attention import msa_sparse_attention_decode, split_buckets
from m3c.backends.triton_aot import jit_run


def random_selection(ctx: int, batch: int, gen: torch.Generator) -> torch.Tensor:
    """int64 [batch, 1, TOPK]: the own (last) block and TOPK - 1 other distinct random blocks per row."""
    nbps = ctx // BS
    others = torch.rand((batch, nbps - 1), device="cuda", generator=gen).argsort(dim=1)[:, : TOPK - 1]
    own = torch.full((batch, 1), nbps - 1, device="cuda")
    return torch.cat([others, own], dim=1).sort(dim=1).values.view(batch, 1, TOPK)


def measure(fn, out: torch.Tensor, ref: torch.Tensor | None, key: dict) -> dict:
    """Run ``fn`` once (it writes ``out``), then `key` plus its max relative difference to ``ref`` (0 when None: the
    first tiling is the reference), its device time from the profiler and its CUDA-graph time; printed as JSON."""
    fn()
    torch.cuda.synchronize()
    diff = 0.0 if ref is None else float(((out.float() - ref).abs().max() / ref.abs().max()).nan_to_num(float("inf")))
    times = kernel_times(fn)
    row = dict(key, graph_us=bench_graph(fn) * 1e3, kernel_us=sum(times.values()), max_rel_diff_vs_first=diff)
    print(json.dumps(row), flush=True)
    return row


def run(ctx: int, batch: int, args: argparse.Namespace) -> list[dict]:
    """Every (split, stages, warps, block_n) tiling asked for at one point."""
    b = make_batch(ctx, batch, 1)
    gen = torch.Generator(device="cuda").manual_seed(7)
    sel = random_selection(ctx, batch, gen)
    ref = None
    rows = []
    for split, stages, warps, bn in itertools.product(args.splits, args.stages, args.warps, args.block_n):
        out = torch.full_like(b["q"], float("nan"))

        def fn(split: int = split, stages: int = stages, warps: int = warps, bn: int = bn,
               out: torch.Tensor = out) -> None:
            msa_sparse_attention_decode(b["q"], b["kd"], b["ks"], b["vd"], b["vs"], sel, b["pos"], b["qsl"],
                                        b["seq"], b["table"], BS, D**-0.5, split=split,
                                        num_warps=warps, num_stages=stages, block_n=bn, out=out)

        rows.append(measure(fn, out, ref, {"context": ctx, "batch": batch, "kernel": "triton", "split": split,
                                           "stages": stages, "warps": warps, "block_n": bn}))
        ref = out.float().clone() if ref is None else ref
    cuda = [(s, w) for w in args.cuda_warps for s in msa_attention_cuda.splits(TOPK, BS, w)] if args.cuda else []
    for split, cwarps in cuda:  # the CUDA C++ kernel (msa_attention_cuda) at each split and CTA size
        out = torch.full_like(b["q"], float("nan"))

        def cu(split: int = split, cwarps: int = cwarps, out: torch.Tensor = out) -> None:
            msa_attention_cuda.launch(jit_run, b["q"], b["kd"], b["ks"], b["vd"], b["vs"], sel, b["pos"], b["qsl"],
                                      b["seq"], b["table"], out, BS, D**-0.5, split, cwarps)

        rows.append(measure(cu, out, ref, {"context": ctx, "batch": batch, "kernel": "cuda", "split": split,
                                           "stages": 0, "warps": cwarps, "block_n": 64}))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--contexts", type=int, nargs="+", default=[32768, 1 << 20])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--splits", type=int, nargs="+", default=split_buckets(TOPK))
    ap.add_argument("--stages", type=int, nargs="+", default=[1, 3])
    ap.add_argument("--warps", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--block-n", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--cuda", action="store_true", help="also the CUDA C++ kernel (msa_attention_cuda) at each split")
    ap.add_argument("--cuda-warps", type=int, nargs="+", default=[4, 2], help="the CUDA kernel's warps a CTA")
    args = ap.parse_args()
    rows: list[dict] = []
    for ctx in args.contexts:
        for batch in args.batches:
            record_point(rows, {"context": ctx, "batch": batch}, lambda c=ctx, b=batch: run(c, b, args))
    write_results("msa_attention_decode", rows)
    print(f"\n{'ctx':>8} {'B':>2} {'kernel':>6} {'split':>5} {'stages':>6} {'warps':>5} {'bn':>4} {'graph us':>9} {'kernel us':>9} "
          f"{'diff':>8}")
    for r in rows:
        if "error" in r:
            print(f"{r['context']:>8} {r['batch']:>2} {r['error']}")
            continue
        print(f"{r['context']:>8} {r['batch']:>2} {r['kernel']:>6} {r['split']:>5} {r['stages']:>6} {r['warps']:>5} {r['block_n']:>4} "
              f"{r['graph_us']:>9.1f} "
              f"{r['kernel_us']:>9.1f} {r['max_rel_diff_vs_first']:>8.1e}")


if __name__ == "__main__":
    main()
