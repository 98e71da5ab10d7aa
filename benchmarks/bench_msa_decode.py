"""Benchmark (first look): MSA decode kernels vs dense SDPA and the NVFP4 byte floor, one GPU's TP4 slice.

16 query heads, 1 KV head, 1 index head, D = 128, block 128, top-16, NVFP4 K/V and index keys,
bf16 queries; contexts 32K / 128K / 1M tokens, batch 1 and 8 (where memory allows), 1 query row.
Times the indexer (scores + top-k), the sparse attention, their sum, torch SDPA over a dense bf16
KV (GQA, the same context) and the byte floor (index keys of the whole context + K/V of the
selected blocks at the measured 4.28 TB/s). Also checks the selection against the reference on
the first request. Writes JSON to $OUT (or benchmarks/results).

Usage (H200): PYTHONPATH=. python benchmarks/bench_msa_decode.py
"""

from __future__ import annotations

import json

import torch
import torch.nn.functional as F
from _timing import bench, bench_graph, record_point, write_results

from m3c.backends.kernels.msa_attention import msa_sparse_attention_decode
from m3c.backends.kernels.msa_indexer import msa_indexer
from m3c.model_defs import ops as mops

READ_BW = 4.28e12
H, KVH, D, BS, TOPK = 16, 1, 128, 128, 16


def run(ctx: int, batch: int) -> dict:
    """One (context, batch) point."""
    dev = "cuda"
    nbps = ctx // BS
    nb = nbps * batch
    gen = torch.Generator(device=dev).manual_seed(ctx + batch)
    kd = torch.randint(0, 256, (nb, BS, KVH, D // 2), dtype=torch.uint8, device=dev, generator=gen)
    vd = torch.randint(0, 256, (nb, BS, KVH, D // 2), dtype=torch.uint8, device=dev, generator=gen)
    ikd = torch.randint(0, 256, (nb, BS, 1, D // 2), dtype=torch.uint8, device=dev, generator=gen)

    def scales(h: int) -> torch.Tensor:  # E4M3 scales around 2^-4..2^-2, positive, finite
        return (torch.rand((nb, BS, h, D // 16), device=dev, generator=gen) * 0.2 + 0.05).to(torch.float8_e4m3fn)

    ks, vs, iks = scales(KVH), scales(KVH), scales(1)
    table = torch.randperm(nb, device=dev, generator=gen).view(batch, nbps).to(torch.int32)
    seq = torch.full((batch,), ctx, dtype=torch.int32, device=dev)
    qsl = torch.arange(batch + 1, dtype=torch.int32, device=dev)
    pos = (seq - 1).long()
    q = torch.randn((batch, H, D), device=dev, generator=gen).bfloat16()
    iq = torch.randn((batch, 1, D), device=dev, generator=gen).bfloat16()
    row: dict = {"context": ctx, "batch": batch}
    scores, sel = msa_indexer(iq, ikd, iks, pos, qsl, seq, table, BS, TOPK)
    ref_scores = mops.indexer_block_scores(iq[:1].float(), ikd, iks, "nvfp4", pos[:1], qsl[:2], seq[:1], table[:1], BS)
    ref_sel = mops.select_blocks(ref_scores, pos[:1], BS, TOPK)
    row["selection_equals_reference"] = bool(torch.equal(sel[:1], ref_sel))
    row["score_max_abs_diff"] = float((scores[:1] - ref_scores).abs().max())
    row["indexer_ms"] = bench(lambda: msa_indexer(iq, ikd, iks, pos, qsl, seq, table, BS, TOPK))
    row["attention_ms"] = bench(lambda: msa_sparse_attention_decode(q, kd, ks, vd, vs, sel, pos, qsl, seq, table, BS,
                                                                     D**-0.5))
    row["msa_total_ms"] = row["indexer_ms"] + row["attention_ms"]
    row["indexer_graph_ms"] = bench_graph(lambda: msa_indexer(iq, ikd, iks, pos, qsl, seq, table, BS, TOPK))
    row["attention_graph_ms"] = bench_graph(lambda: msa_sparse_attention_decode(
        q, kd, ks, vd, vs, sel, pos, qsl, seq, table, BS, D**-0.5))
    row["msa_graph_total_ms"] = row["indexer_graph_ms"] + row["attention_graph_ms"]
    floor_bytes = batch * (ctx * D * 9 / 16 + TOPK * BS * 2 * KVH * D * 9 / 16)
    row["floor_ms"] = floor_bytes / READ_BW * 1e3
    if batch * ctx * KVH * D * 2 * 2 <= 40e9:  # dense bf16 K/V for SDPA
        kdense = torch.randn((batch, KVH, ctx, D), device=dev, dtype=torch.bfloat16)
        vdense = torch.randn_like(kdense)
        qd = q.view(batch, H, 1, D)
        row["sdpa_dense_ms"] = bench(lambda: F.scaled_dot_product_attention(qd, kdense, vdense, enable_gqa=True))
        row["speedup_vs_dense"] = row["sdpa_dense_ms"] / row["msa_total_ms"]
        del kdense, vdense
    row["msa_over_floor"] = row["msa_total_ms"] / row["floor_ms"]
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    """All points; JSON and a short table."""
    rows = []
    for ctx, batch in ((32768, 1), (131072, 1), (1048576, 1), (32768, 8), (131072, 8)):
        record_point(rows, {"context": ctx, "batch": batch}, lambda c=ctx, b=batch: run(c, b))
    write_results("msa_decode", rows)
    print(f"\n{'ctx':>8} {'B':>2} {'indexer':>9} {'attn':>9} {'total':>9} {'graph':>9} {'floor':>8} {'sdpa':>9} "
          f"{'xdense':>7} sel==ref")
    for r in rows:
        if "error" in r:
            print(f"{r['context']:>8} {r['batch']:>2} {r['error']}")
            continue
        print(f"{r['context']:>8} {r['batch']:>2} {r['indexer_ms'] * 1e3:>8.1f}u {r['attention_ms'] * 1e3:>8.1f}u "
              f"{r['msa_total_ms'] * 1e3:>8.1f}u {r['msa_graph_total_ms'] * 1e3:>8.1f}u {r['floor_ms'] * 1e3:>7.1f}u "
              f"{r.get('sdpa_dense_ms', float('nan')) * 1e3:>8.1f}u {r.get('speedup_vs_dense', float('nan')):>7.2f} "
              f"{r['selection_equals_reference']}")


if __name__ == "__main__":
    main()
