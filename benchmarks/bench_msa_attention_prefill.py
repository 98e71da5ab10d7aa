"""Benchmark: the MSA sparse-attention PREFILL kernel on one GPU's TP4 slice, vs dense SDPA and the decode kernel.

16 query heads, 1 KV head, D = 128, block 128, top-16, NVFP4 K/V, bf16 queries. One request: a chunk of
4,096 query rows at the end of a context of 32K / 128K / 512K / 1M tokens. Selections: "shared" (every
64 consecutive rows share 15 random earlier blocks + their own block, as a chunk's rows mostly do) and
"random" (every row its own 15 random blocks: the union per tile is ROWS × 16, the worst case).
Times (CUDA-graph replays, median):
- prefill: ``msa_sparse_attention(max_q_rows=0)`` (the prefill kernel);
- decode: the decode kernel over the same 4,096 rows (one program set per row);
- sdpa: torch SDPA, bf16 dense K/V over the whole context, GQA 16:1 (enable_gqa, else expanded K/V),
  not causal (the chunk sits at the end of the context, so causality only trims its last 4K keys: the
  dense work is within 0.2-12% of this);
- floors: FLOPs 4 × rows × heads × visible selected keys × D at 750 TFLOP/s; bytes (q + out + K/V of the
  distinct selected blocks) at 4.28 TB/s.
Also checks 4 rows against the reference. JSON to $OUT (or benchmarks/results); a short table last.

Usage (H200): PYTHONPATH=. python benchmarks/bench_msa_attention_prefill.py [--rows 4096]
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
from _timing import bench_graph, record_point, write_results

from m3c.backends.kernels.msa_attention import msa_sparse_attention, msa_sparse_attention_decode
from m3c.model_defs import ops as mops

READ_BW, MMA_FLOPS = 4.28e12, 750e12
H, KVH, D, BS, TOPK = 16, 1, 128, 128, 16


def selections(ctx: int, rows: int, mode: str, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(selected int64 [rows, 1, TOPK], positions int64 [rows]) for a chunk at the end of the context."""
    dev = "cuda"
    pos = torch.arange(ctx - rows, ctx, device=dev)
    own = pos // BS
    first_own = int(own[0])
    group = 64 if mode == "shared" else 1
    n = -(-rows // group)
    base = torch.randint(0, max(first_own, 1), (n, TOPK - 1), device=dev, generator=gen)
    base = base.repeat_interleave(group, 0)[:rows]
    sel = torch.cat([base, own[:, None]], 1).sort(1).values
    return sel.view(rows, 1, TOPK), pos


def run(ctx: int, rows: int, mode: str) -> dict:
    """One (context, selection mode) point."""
    dev = "cuda"
    nb = ctx // BS
    gen = torch.Generator(device=dev).manual_seed(ctx + len(mode))
    kd = torch.randint(0, 256, (nb, BS, KVH, D // 2), dtype=torch.uint8, device=dev, generator=gen)
    vd = torch.randint(0, 256, (nb, BS, KVH, D // 2), dtype=torch.uint8, device=dev, generator=gen)

    def scales() -> torch.Tensor:  # E4M3 scales around 2^-4..2^-2, positive, finite
        return (torch.rand((nb, BS, KVH, D // 16), device=dev, generator=gen) * 0.2 + 0.05).to(torch.float8_e4m3fn)

    ks, vs = scales(), scales()
    table = torch.randperm(nb, device=dev, generator=gen).view(1, nb).to(torch.int32)
    seq = torch.tensor([ctx], dtype=torch.int32, device=dev)
    qsl = torch.tensor([0, rows], dtype=torch.int32, device=dev)
    sel, pos = selections(ctx, rows, mode, gen)
    q = torch.randn((rows, H, D), device=dev, generator=gen).bfloat16()
    out = torch.empty_like(q)
    args = (q, kd, ks, vd, vs, sel, pos, qsl, seq, table, BS, D**-0.5)
    row: dict = {"context": ctx, "rows": rows, "selection": mode}

    msa_sparse_attention(*args, out=out, max_q_rows=0)
    check = torch.tensor([0, 1, rows // 2, rows - 1], device=dev)
    qsl4 = torch.tensor([0, 4], dtype=torch.int32, device=dev)
    ref = mops.sparse_attention(q[check], kd, ks, vd, vs, "nvfp4", sel[check], pos[check], qsl4, seq, table, BS,
                                D**-0.5)
    row["max_rel_err_vs_reference"] = float((out[check].float() - ref.float()).abs().max() / ref.float().abs().max())

    row["prefill_ms"] = bench_graph(lambda: msa_sparse_attention(*args, out=out, max_q_rows=0))
    out2 = torch.empty_like(q)
    row["decode_kernel_ms"] = bench_graph(lambda: msa_sparse_attention_decode(*args, out=out2))

    # Floors: visible selected keys per row (distinct blocks, keys <= position), distinct blocks of the chunk.
    blocks = sel.view(rows, TOPK)
    first_dup = torch.zeros_like(blocks, dtype=torch.bool)
    first_dup[:, 1:] = blocks[:, 1:] == blocks[:, :-1]
    keys = torch.where(first_dup, 0, torch.clamp(pos[:, None] - blocks * BS + 1, 0, BS)).sum()
    flops = 4.0 * float(keys) * H * D
    distinct = int(torch.unique(blocks).numel())
    bytes_ = 2 * rows * H * D * 2 + distinct * BS * KVH * 2 * (D // 2 + D // 16)
    row["distinct_blocks"] = distinct
    row["flop_floor_ms"] = flops / MMA_FLOPS * 1e3
    row["byte_floor_ms"] = bytes_ / READ_BW * 1e3
    row["floor_ms"] = max(row["flop_floor_ms"], row["byte_floor_ms"])
    row["prefill_over_floor"] = row["prefill_ms"] / row["floor_ms"]
    row["prefill_tflops"] = flops / (row["prefill_ms"] * 1e-3) / 1e12

    if mode == "shared":  # dense SDPA does not depend on the selection
        kdense = torch.randn((1, KVH, ctx, D), device=dev, dtype=torch.bfloat16)
        vdense = torch.randn_like(kdense)
        qd = q.transpose(0, 1).unsqueeze(0)  # [1, H, rows, D]
        try:
            F.scaled_dot_product_attention(qd, kdense, vdense, enable_gqa=True)
            row["sdpa_ms"] = bench_graph(lambda: F.scaled_dot_product_attention(qd, kdense, vdense, enable_gqa=True))
            row["sdpa_gqa"] = "enable_gqa"
        except Exception:  # older torch or no GQA kernel: expanded K/V
            ke, ve = kdense.expand(1, H, ctx, D).contiguous(), vdense.expand(1, H, ctx, D).contiguous()
            row["sdpa_ms"] = bench_graph(lambda: F.scaled_dot_product_attention(qd, ke, ve))
            row["sdpa_gqa"] = "expanded"
            del ke, ve
        row["speedup_vs_sdpa"] = row["sdpa_ms"] / row["prefill_ms"]
        del kdense, vdense
    row["speedup_vs_decode_kernel"] = row["decode_kernel_ms"] / row["prefill_ms"]
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    """All points; JSON and a short table."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--contexts", default="32768,131072,524288,1048576")
    a = ap.parse_args()
    rows_out = []
    for ctx in (int(c) for c in a.contexts.split(",")):
        for mode in ("shared", "random"):
            record_point(rows_out, {"context": ctx, "selection": mode}, lambda c=ctx, m=mode: run(c, a.rows, m))
    write_results("msa_attention_prefill", rows_out)
    print(f"\n{'ctx':>8} {'sel':>6} {'prefill':>9} {'decode-k':>9} {'sdpa':>9} {'floor':>8} {'x floor':>7} "
          f"{'TFLOP/s':>7} {'x sdpa':>7} {'x dec':>6} {'blocks':>6} {'err':>8}")
    for r in rows_out:
        if "error" in r:
            print(f"{r['context']:>8} {r['selection']:>6} {r['error']}")
            continue
        print(f"{r['context']:>8} {r['selection']:>6} {r['prefill_ms']:>7.3f}ms {r['decode_kernel_ms']:>7.3f}ms "
              f"{r.get('sdpa_ms', float('nan')):>7.3f}ms {r['floor_ms']:>6.3f}ms {r['prefill_over_floor']:>7.2f} "
              f"{r['prefill_tflops']:>7.1f} {r.get('speedup_vs_sdpa', float('nan')):>7.1f} "
              f"{r['speedup_vs_decode_kernel']:>6.2f} {r['distinct_blocks']:>6} {r['max_rel_err_vs_reference']:>8.1e}")


if __name__ == "__main__":
    main()
