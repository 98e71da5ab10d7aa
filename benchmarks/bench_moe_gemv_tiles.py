"""Benchmark: MegaMoE GEMV tiles (CUDA-core FMAs, few rows per expert) vs the tensor-core "small" tiles.

m3.1-small shapes (64 NVFP4 experts of 6144×1536, top-8, MXFP8 shared expert of 1536), bf16 tokens,
uniform random routing, T = 1, 2, 4, 8, 16. Each variant is ``moe_prefill``'s permutation + FC1 + FC2 +
combine for an explicit tiling, replayed from a CUDA graph; its output is checked against the "small"
tiles' (relative L2). The byte floor is the touched experts' NVFP4 weights + the shared expert's MXFP8
weights at 4.28 TB/s. Writes JSON to $OUT (or benchmarks/results) and prints one line per variant.

Usage (H200): PYTHONPATH=. python benchmarks/bench_moe_gemv_tiles.py [--tokens 1 4 16]
"""

from __future__ import annotations

import argparse
import json

import torch
from _timing import bench_graph, write_results
from bench_moe_prefill_variants import READ_BW, E, H, I, K, S, nvfp4_stack

from m3c.backends.kernels import moe_prefill as mp
from m3c.model_defs import quant


def variants(t: int) -> list[mp.Tiles]:
    """GEMV tilings to try at t tokens: 1-row tiles with their bytes prefetched in registers 1 or 2 K steps ahead
    (``ahead``), one wide-path and one Triton-pipelined tiling for reference (both lost at session 11 / 10), and
    2-row tiles when t > 1."""
    def g(bm: int, bn1: int, bn2: int, bk: int, w: int, pipe: int, wide: int = 0, ahead: int = 1) -> mp.Tiles:
        return mp.Tiles(bm, bn1, bn2, bk, w, 1, 16, 256, 4, gemv=True, pipe=pipe, wide_bk=wide, ahead=ahead)
    out = [g(1, 16, 16, 128, 4, 0), g(1, 16, 16, 64, 2, 0)]
    # 2 K steps in flight (sm_90a registers FC1 / FC2: 128 / 72 at bk 128, 4 warps; 72 / 40 at bk 64, 4 warps;
    # 125 / 70 at bk 64, 2 warps): bytes in flight per SM ~18 KB against ~9 KB for the default tiles
    out += [g(1, 16, 16, 128, 4, 0, ahead=2), g(1, 16, 16, 64, 4, 0, ahead=2), g(1, 16, 16, 64, 2, 0, ahead=2)]
    out += [g(1, 16, 16, 128, 4, 0, 256), g(1, 16, 16, 128, 4, 3)]  # wide path; Triton-pipelined
    if t > 1:
        out += [g(2, 16, 16, 64, 4, 0), g(2, 16, 16, 64, 4, 0, ahead=2)]
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--defaults-only", action="store_true", help="only the tiles moe_prefill picks, and the small tiles")
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
            name = (f"{'gemv' if tiles.gemv else 'mma'} bm{tiles.bm} bn{tiles.bn1}x{tiles.bn2} bk{tiles.bk} "
                    f"w{tiles.warps} s{tiles.stages} p{tiles.pipe} a{tiles.ahead}"
                    + (f" wide{tiles.wide_bk}" if tiles.wide_bk else ""))
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
            print(json.dumps(row), flush=True)
            rows.append(row)
    write_results("moe_gemv_tiles", rows, shape={"H": H, "I": I, "E": E, "top_k": K, "shared_inter": S})
    print(f"{'T':>3} {'variant':<36} {'us':>8} {'% floor':>8} {'rel':>8}")
    for r in rows:
        print(f"{r['T']:>3} {r['variant']:<36} {r['us']:8.1f} {r['pct_of_floor']:8.1f} {r['rel_vs_small']:8.1e}")


if __name__ == "__main__":
    main()
