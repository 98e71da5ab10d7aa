"""Benchmark: how fast can a GEMV grid merely READ the touched experts' NVFP4 weights? (the MoE decode's ceiling).

The MegaMoE decode at T = 1 must stream 8 experts' FC1 (2·I × H) and FC2 (H × I) NVFP4 weights once: packed
E2M1 codes (K/2 bytes a row) plus E4M3 scales (K/16 bytes a row). This script times kernels with the GEMV's
geometry — a program per (touched expert, BN-row tile, K split) — that only XOR what they load, so the only
question is how the loads are issued:

- ``regs``: plain ``tl.load`` of [BN, BK/8] int32 code words + [BN, BK/16] scale bytes a step, the next AHEAD
  steps held in registers (the current GEMV's way);
- ``cpasync``: the same loads through Triton's software pipeline (``tl.range(num_stages=S)``, cp.async).

(TMA tensor descriptors were tried once: 84-91% at FC1's shape, no better than plain loads, and an illegal
instruction at FC2's shape under Triton 3.6 — not kept.)

against the byte floor at 4.28 TB/s and a torch read of the same bytes. Whatever reaches ~90% here is how the
real GEMV should load; the gap between this and the GEMV is then its math.

``--alu N ...`` adds N dependent xorshift-multiply rounds per 32-bit word (3N/8 instructions per weight): how much
decode work a grid can afford per weight and still stream at full bandwidth (the GEMV's budget, measured).

``--flush-mb N`` writes an N MB buffer before every timed read (inside the CUDA graph), so the read starts with
none of its bytes in L2 (50 MB on the H200); the write's own time, timed alone, is subtracted. Without it, graph
replays re-read the same bytes and L2 may serve part of them (session 24: 111.6% of the floor over 170 MB).

Usage (H200): PYTHONPATH=. python benchmarks/bench_moe_stream.py [--rows 3072 --k 6144] [--alu 0 16 32 48]
    [--touched 16] [--flush-mb 256]
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl
from _timing import bench_graph, record_point, write_results

READ_BW = 4.28e12


@triton.jit
def _load_step(cw_ptr, s_ptr, rows, k0, K: tl.constexpr, BK: tl.constexpr):
    """A [BN, BK/8] tile of int32 code words and the [BN, BK/16] scale bytes of columns [k0, k0 + BK)."""
    cw = tl.load(cw_ptr + rows[:, None] * (K // 8) + k0 // 8 + tl.arange(0, BK // 8)[None, :])
    sb = tl.load(s_ptr + rows[:, None] * (K // 16) + k0 // 16 + tl.arange(0, BK // 16)[None, :])
    return cw, sb


@triton.jit
def _fold(acc, cw, sb, BK: tl.constexpr, ALU: tl.constexpr):
    """acc ^= the tile's words, each [BN, BK/8] word xor'ed with its group's scale byte (keeps every load live),
    after ALU dependent xorshift-multiply rounds per word (shift, xor, multiply: 3·ALU/8 instructions per weight,
    which the compiler cannot fold: a stand-in for decode work)."""
    sw = tl.reshape(tl.broadcast_to(sb.to(tl.int32)[:, :, None], [sb.shape[0], BK // 16, 2]), [sb.shape[0], BK // 8])
    v = cw ^ sw
    for i in tl.static_range(ALU):
        v = (v ^ (v >> (7 + i % 5))) * -1640531535
    return acc ^ v


@triton.jit
def stream_regs_kernel(cw_ptr, s_ptr, ids_ptr, out_ptr, R: tl.constexpr, K: tl.constexpr, BN: tl.constexpr,
                       BK: tl.constexpr, KS: tl.constexpr, AHEAD: tl.constexpr, STAGES: tl.constexpr,
                       ALU: tl.constexpr):
    """XOR of expert ids[program_id(0)]'s rows tile program_id(1), K split program_id(2)."""
    e = tl.load(ids_ptr + tl.program_id(0)).to(tl.int64)
    rows = e * R + tl.program_id(1) * BN + tl.arange(0, BN)
    KC: tl.constexpr = K // KS
    k_lo = tl.program_id(2) * KC
    acc = tl.zeros([BN, BK // 8], tl.int32)
    if AHEAD == 0:  # Triton's pipeliner (cp.async for STAGES > 1)
        for k0 in tl.range(k_lo, k_lo + KC, BK, num_stages=STAGES):
            cw, sb = _load_step(cw_ptr, s_ptr, rows, k0, K, BK)
            acc = _fold(acc, cw, sb, BK, ALU)
    elif AHEAD == 1:
        cw, sb = _load_step(cw_ptr, s_ptr, rows, k_lo, K, BK)
        for k0 in tl.range(k_lo, k_lo + KC, BK, num_stages=1):
            cw_n, sb_n = _load_step(cw_ptr, s_ptr, rows, tl.minimum(k0 + BK, k_lo + KC - BK), K, BK)
            acc = _fold(acc, cw, sb, BK, ALU)
            cw = cw_n
            sb = sb_n
    else:
        cw, sb = _load_step(cw_ptr, s_ptr, rows, k_lo, K, BK)
        cw1, sb1 = _load_step(cw_ptr, s_ptr, rows, tl.minimum(k_lo + BK, k_lo + KC - BK), K, BK)
        for k0 in tl.range(k_lo, k_lo + KC, BK, num_stages=1):
            cw_n, sb_n = _load_step(cw_ptr, s_ptr, rows, tl.minimum(k0 + 2 * BK, k_lo + KC - BK), K, BK)
            acc = _fold(acc, cw, sb, BK, ALU)
            cw = cw1
            sb = sb1
            cw1 = cw_n
            sb1 = sb_n
    pid = (tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)) * KS + tl.program_id(2)
    tl.store(out_ptr + pid, tl.xor_sum(tl.reshape(acc, [BN * BK // 8]), 0))


def run(kind: str, rows: int, k: int, bn: int, bk: int, ks: int, warps: int, ahead: int, stages: int,
        tensors: dict, alu: int = 0) -> dict:  # kind: "regs" (AHEAD >= 1) or "cpasync" (AHEAD = 0, STAGES > 1)
    """One loading variant: µs, GB/s and % of the floor, plus the torch read of the same bytes."""
    cw, sc, ids = tensors["cw"], tensors["sc"], tensors["ids"]
    grid = (ids.numel(), rows // bn, ks)
    out = torch.empty(grid[0] * grid[1] * grid[2], dtype=torch.int32, device="cuda")
    def fn() -> None:
        stream_regs_kernel[grid](cw, sc, ids, out, R=rows, K=k, BN=bn, BK=bk, KS=ks, AHEAD=ahead, STAGES=stages,
                                 ALU=alu, num_warps=warps)

    fn()
    torch.cuda.synchronize()
    flush = tensors.get("flush")
    if flush is None:
        ms = bench_graph(fn)
    else:  # the read after an L2-clearing write, less the write alone
        ms = bench_graph(lambda: (flush.zero_(), fn())) - tensors["flush_ms"]
    nbytes = ids.numel() * rows * (k // 2 + k // 16)
    floor_us = nbytes / READ_BW * 1e6
    return {"kind": kind, "rows": rows, "k": k, "bn": bn, "bk": bk, "ks": ks, "warps": warps, "ahead": ahead,
            "flushed": flush is not None, "stages": stages, "alu_per_weight": 3 * alu / 8,
            "ctas": grid[0] * grid[1] * grid[2], "us": ms * 1e3, "floor_us": floor_us,
            "pct_floor": floor_us / (ms * 1e3) * 100, "gbps": nbytes / (ms * 1e-3) / 1e9}


VARIANTS = [  # kind, bn, bk, ks, warps, ahead, stages
    ("regs", 16, 128, 1, 4, 1, 1), ("regs", 16, 256, 1, 4, 1, 1), ("regs", 16, 256, 4, 4, 1, 1),
    ("regs", 16, 256, 4, 4, 2, 1), ("regs", 32, 256, 4, 4, 1, 1), ("regs", 32, 512, 4, 8, 1, 1),
    ("regs", 16, 512, 4, 4, 1, 1), ("regs", 64, 256, 8, 4, 1, 1),
    ("cpasync", 16, 256, 4, 4, 0, 3), ("cpasync", 32, 256, 4, 4, 0, 4), ("cpasync", 32, 512, 2, 4, 0, 3),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=3072, help="rows a touched expert streams (FC1: 2·I)")
    ap.add_argument("--k", type=int, default=6144, help="K (FC1: H)")
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--touched", type=int, default=8)
    ap.add_argument("--alu", type=int, nargs="+", default=[0],
                    help="xorshift-multiply rounds per 8-weight word (3 instructions each; decode stand-in)")
    ap.add_argument("--flush-mb", type=int, default=0, help="write this many MB before each timed read (0: none)")
    args = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    e, r, k = args.experts, args.rows, args.k
    cw = torch.randint(-2**31, 2**31 - 1, (e, r, k // 8), dtype=torch.int32, device="cuda", generator=gen)
    sc = torch.randint(0, 127, (e, r, k // 16), dtype=torch.uint8, device="cuda", generator=gen)
    ids = torch.randperm(e, device="cuda", generator=gen)[: args.touched].to(torch.int32).contiguous()
    tensors = {"cw": cw, "sc": sc, "ids": ids}
    if args.flush_mb:
        flush = torch.empty(args.flush_mb << 18, dtype=torch.int32, device="cuda")
        tensors.update(flush=flush, flush_ms=bench_graph(flush.zero_))
        print(f"L2 flush: {args.flush_mb} MB written before each read, {tensors['flush_ms'] * 1e3:.1f} us alone")
    rows: list[dict] = []
    for alu in args.alu:
        for v in VARIANTS:
            key = dict(zip(("kind", "bn", "bk", "ks", "warps", "ahead", "stages"), v, strict=True)) | {"alu": alu}
            record_point(rows, key, lambda v=v, alu=alu: run(v[0], r, k, *v[1:], tensors, alu))
    sel_cw, sel_sc = cw[ids.long()], sc[ids.long()]
    torch_ms = bench_graph(lambda: (sel_cw.sum(), sel_sc.view(torch.int32).sum()))
    write_results("moe_stream", rows, torch_read_us=torch_ms * 1e3, flush_mb=args.flush_mb,
                  flush_us=tensors.get("flush_ms", 0.0) * 1e3)
    print(f"touched {args.touched} experts × {r} rows × K {k}: torch read of the same bytes {torch_ms * 1e3:.1f} us")
    print(f"{'kind':>8} {'bn':>4} {'bk':>4} {'ks':>3} {'w':>2} {'ah':>2} {'st':>2} {'alu/w':>5} {'ctas':>6} {'us':>8} "
          f"{'floor':>7} {'%floor':>7}")
    for x in sorted(rows, key=lambda x: "error" not in x):
        if "error" in x:
            print(f"{x['kind']:>8} {x['bn']:>4} {x['bk']:>4} {x['ks']:>3} error: {x['error'][:150]}")
            continue
        print(f"{x['kind']:>8} {x['bn']:>4} {x['bk']:>4} {x['ks']:>3} {x['warps']:>2} {x['ahead']:>2} "
              f"{x['stages']:>2} {x['alu_per_weight']:5.1f} {x['ctas']:>6} {x['us']:8.1f} {x['floor_us']:7.1f} "
              f"{x['pct_floor']:6.1f}%")


if __name__ == "__main__":
    main()
