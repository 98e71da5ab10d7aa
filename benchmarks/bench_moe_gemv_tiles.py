"""Benchmark: MegaMoE decode tiles (CUDA-core GEMV, weight-stationary tensor-core "swap") vs the "small" tiles.

m3.1-small shapes (64 NVFP4 experts of 6144×1536, top-8, MXFP8 shared expert of 1536), bf16 tokens,
uniform random routing, T = 1, 2, 4, 8, 16 (default; --tokens). Each variant is ``moe_prefill``'s permutation + FC1 + FC2 +
combine for an explicit tiling, replayed from a CUDA graph; its output is checked against the "small"
tiles' (relative L2). The byte floor is the touched experts' NVFP4 weights + the shared expert's MXFP8
weights at 4.28 TB/s. Writes JSON to $OUT (or benchmarks/results) and prints one line per variant.

Usage (H200): PYTHONPATH=. python benchmarks/bench_moe_gemv_tiles.py [--tokens 1 4 16]
"""

from __future__ import annotations

import argparse
import json

import torch
from _timing import bench_graph, kernel_times, write_results
from bench_moe_prefill_variants import READ_BW, E, H, I, K, S, nvfp4_stack

from m3c.backends.kernels import moe_prefill as mp
from m3c.model_defs import quant


def variants(t: int) -> list[mp.Tiles]:
    """Decode tilings to try at t tokens: 1-row GEMV tiles (CUDA-core FMAs; the default and the previous one) and the weight-stationary
    tensor-core "swap" tiles (``moe_swap``: bn weight rows × 16 tokens) over rows per program, warps, K step and
    load pipelining (``pipe`` 0: next step's bytes in registers; n: Triton's pipeliner, n stages)."""
    def g(bm: int, bn1: int, bn2: int, bk: int, w: int, pipe: int) -> mp.Tiles:
        return mp.Tiles(bm, bn1, bn2, bk, w, 1, 16, 256, 4, gemv=True, pipe=pipe)

    def sw(bn: int, bk: int, w: int, pipe: int, bm: int = 16) -> mp.Tiles:
        return mp.Tiles(bm, bn, bn, bk, w, 1, 16, 256, 4, swap=True, pipe=pipe)
    out = [g(1, 16, 16, 64, 2, 0), g(1, 16, 16, 128, 4, 0)] if t <= 4 else []  # (2-row tiles, 2 steps ahead, "wide": lost, sessions 10-12)
    out += [sw(64, 128, 4, 3), sw(64, 128, 4, 6), sw(64, 128, 4, 8), sw(64, 256, 4, 4), sw(128, 64, 4, 3),
            sw(128, 64, 4, 6), sw(128, 128, 8, 4), sw(32, 128, 2, 6)]
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--defaults-only", action="store_true", help="only the tiles moe_prefill picks, and the small tiles")
    ap.add_argument("--kernels", action="store_true", help="also record each launch's device time (torch.profiler)")
    args = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    w13, w2 = nvfp4_stack(2 * I, H, gen), nvfp4_stack(H, I, gen)
    sh13 = quant.mxfp8_quantize(torch.randn(2 * S, H, device="cuda", generator=gen) / H**0.5)
    sh2 = quant.mxfp8_quantize(torch.randn(H, S, device="cuda", generator=gen) / S**0.5)
    rows = []
    for t in args.tokens:
        x = torch.randn(t, H, device="cuda", generator=gen).bfloat16()
        ids = torch.rand(t, E, device="cuda", generator=gen).topk(K, dim=1).indices
        wts = torch.rand(t, K, device="cuda", generator=gen)
        touched = int(ids.unique().numel())
        floor_us = (touched * 3 * H * I * 0.5625 + 3 * S * H * (1 + 1 / 32)) / READ_BW * 1e6
        lay = mp._layout(x, ids, wts, w13, w2, sh13, sh2)
        a = (x, ids, wts, w13, w2, sh13, sh2, lay)
        small = mp._tile_options(lay, "small", False)
        ref = mp._launch(*a, small, mp.jit_run, None)
        pick = mp._tile_options(lay, mp._bucket(lay, t), False)
        for tiles in [small, pick] if args.defaults_only else [small, *variants(t)]:
            name = (f"{'gemv' if tiles.gemv else 'swap' if tiles.swap else 'mma'} bm{tiles.bm} bn{tiles.bn1}x{tiles.bn2} bk{tiles.bk} "
                    f"w{tiles.warps} s{tiles.stages} p{tiles.pipe}")
            out = torch.empty_like(x)
            try:
                got = mp._launch(*a, tiles, mp.jit_run, out)
                torch.cuda.synchronize()
            except Exception as e:  # a tiling that does not compile is reported, not fatal
                print(f"T={t} {name}: failed {str(e)[:200]}", flush=True)
                continue
            us = bench_graph(lambda tiles=tiles, out=out, a=a: mp._launch(*a, tiles, mp.jit_run, out)) * 1e3
            row = {"T": t, "variant": name, "us": us, "floor_us": floor_us, "pct_of_floor": 100 * floor_us / us,
                   "touched_experts": touched,
                   "rel_vs_small": float((got.float() - ref.float()).norm() / ref.float().norm())}
            if args.kernels:  # where the time goes: permutation, FC1, FC2, combine
                row["kernels_us"] = kernel_times(lambda tiles=tiles, out=out, a=a: mp._launch(*a, tiles, mp.jit_run, out))
            print(json.dumps(row), flush=True)
            rows.append(row)
    write_results("moe_gemv_tiles", rows, shape={"H": H, "I": I, "E": E, "top_k": K, "shared_inter": S})
    print(f"{'T':>3} {'variant':<36} {'us':>8} {'% floor':>8} {'rel':>8}")
    for r in rows:
        ks = " ".join(f"{n.split('_kernel')[0][-9:]}={v:.1f}" for n, v in r.get("kernels_us", {}).items() if v > 1)
        print(f"{r['T']:>3} {r['variant']:<36} {r['us']:8.1f} {r['pct_of_floor']:8.1f} {r['rel_vs_small']:8.1e} {ks}")


if __name__ == "__main__":
    main()
