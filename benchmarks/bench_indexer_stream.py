"""Benchmark: how fast can the MSA indexer's decode grid merely READ its keys? (the data-movement ceiling).

A kernel with the indexer's decode geometry (grid = requests × block chunks from ``pick_chunk_blocks``, the
block table walked block by block, the keys loaded by the "fma" / "int8" paths' own ``_fma_load``: [FK, D/16, 2]
int32 code words + [FK, D/16] scale bytes per step) that only XORs what it loads, against the index-key byte
floor (72 B/token at 4.28 TB/s) and a plain torch read of the same bytes. If the indexer's time sits at this
ceiling, its math is not what bounds it: the loads are. Variants: keys per step (FK), warps, pipeline stages
(Triton's cp.async; 1: loads issued in the step that uses them) and "prefetch" (register prefetch one step
ahead, as the MMA paths now do).

Usage (H200): PYTHONPATH=. python benchmarks/bench_indexer_stream.py [--contexts 1048576] [--batches 1 8]
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl
from _timing import bench_graph, record_point, write_results

from m3c.backends.kernels.msa_indexer import pick_chunk_blocks
from m3c.backends.kernels.msa_indexer_kernels import _fma_load

READ_BW = 4.28e12
D, BS = 128, 128
NG = D // 16


@triton.jit
def stream_kernel(kd_ptr, ks_ptr, bt_ptr, out_ptr, stride_bt, n_blk, chunk, FK: tl.constexpr, BS: tl.constexpr,
                  NG: tl.constexpr, STAGES: tl.constexpr, PREFETCH: tl.constexpr):
    """XOR of every code word and scale byte of request program_id(0)'s blocks in chunk program_id(1)."""
    r = tl.program_id(0)
    c_lo = tl.program_id(1) * chunk
    c_hi = tl.minimum(c_lo + chunk, n_blk)
    bt_row = bt_ptr + r * stride_bt
    kw_ptr = kd_ptr.to(tl.pointer_type(tl.int32), bitcast=True)
    kk = tl.arange(0, FK)
    g = tl.arange(0, NG)
    w_off = g[None, :, None] * 2 + tl.arange(0, 2)[None, None, :]
    acc = tl.zeros([FK, NG, 2], tl.int32)
    SUB: tl.constexpr = BS // FK
    if PREFETCH:
        words, sbyte = _fma_load(kw_ptr, ks_ptr, bt_row, c_lo, 0, kk, g, w_off, c_hi, 16 * NG, BS, 1, FK, NG, True)
        for i in tl.range(c_lo * SUB, c_hi * SUB, num_stages=1):
            nxt = tl.minimum(i + 1, c_hi * SUB - 1)
            words_n, sbyte_n = _fma_load(kw_ptr, ks_ptr, bt_row, nxt // SUB, nxt % SUB, kk, g, w_off, c_hi, 16 * NG, BS,
                                         1, FK, NG, True)
            acc ^= words ^ sbyte.to(tl.int32)[:, :, None]
            words = words_n
            sbyte = sbyte_n
    else:
        for i in tl.range(c_lo * SUB, c_hi * SUB, num_stages=STAGES):
            words, sbyte = _fma_load(kw_ptr, ks_ptr, bt_row, i // SUB, i % SUB, kk, g, w_off, c_hi, 16 * NG, BS, 1, FK,
                                     NG, False)
            acc ^= words ^ sbyte.to(tl.int32)[:, :, None]
    tl.store(out_ptr + r * tl.num_programs(1) + tl.program_id(1), tl.xor_sum(tl.reshape(acc, [FK * NG * 2]), 0))


def run(ctx: int, batch: int, fk: int, warps: int, stages: int, prefetch: bool) -> dict:
    """One variant at one (context, batch) point."""
    gen = torch.Generator(device="cuda").manual_seed(ctx + batch)
    nbps = ctx // BS
    nb = nbps * batch
    kd = torch.randint(0, 256, (nb, BS, 1, D // 2), dtype=torch.uint8, device="cuda", generator=gen)
    ks = torch.randint(0, 127, (nb, BS, 1, NG), dtype=torch.uint8, device="cuda", generator=gen)
    table = torch.randperm(nb, device="cuda", generator=gen).view(batch, nbps).to(torch.int32)
    chunk = pick_chunk_blocks(batch, nbps, 1, torch.cuda.get_device_properties(0).multi_processor_count)
    n_chunks = triton.cdiv(nbps, chunk)
    out = torch.empty(batch * n_chunks, dtype=torch.int32, device="cuda")

    def fn() -> None:
        stream_kernel[(batch, n_chunks)](kd, ks, table, out, table.stride(0), nbps, chunk, FK=fk, BS=BS, NG=NG,
                                         STAGES=stages, PREFETCH=prefetch, num_warps=warps)

    fn()
    torch.cuda.synchronize()
    ms = bench_graph(fn)
    plain = bench_graph(lambda: (kd.view(torch.int32).sum(), ks.view(torch.int32).sum()))
    floor_ms = batch * ctx * (D // 2 + NG) / READ_BW * 1e3
    row = {"context": ctx, "batch": batch, "fk": fk, "warps": warps, "stages": stages, "prefetch": prefetch,
           "chunk_blocks": chunk, "us": ms * 1e3, "floor_us": floor_ms * 1e3, "pct_of_floor": 100 * floor_ms / ms,
           "torch_sum_us": plain * 1e3}
    print(row, flush=True)
    return row


def main() -> None:
    """Every variant at every point; JSON and a short table."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--contexts", type=int, nargs="+", default=[1 << 20])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    args = ap.parse_args()
    variants = [(64, 4, 3, False), (64, 4, 1, False), (128, 4, 3, False), (64, 4, 1, True), (128, 8, 1, True),
                (128, 4, 6, False)]
    rows: list[dict] = []
    for ctx in args.contexts:
        for b in args.batches:
            for fk, w, s, pf in variants:
                record_point(rows, {"context": ctx, "batch": b, "fk": fk, "warps": w, "stages": s, "prefetch": pf},
                             lambda c=ctx, b=b, fk=fk, w=w, s=s, pf=pf: run(c, b, fk, w, s, pf))
    write_results("indexer_stream", rows)
    print(f"\n{'ctx':>8} {'B':>2} {'FK':>4} {'W':>2} {'S':>2} {'pf':>3} {'us':>8} {'floor':>7} {'%floor':>7} {'torch':>7}")
    for r in rows:
        if "error" in r:
            print(r)
            continue
        print(f"{r['context']:>8} {r['batch']:>2} {r['fk']:>4} {r['warps']:>2} {r['stages']:>2} {int(r['prefetch']):>3} "
              f"{r['us']:>8.1f} {r['floor_us']:>7.1f} {r['pct_of_floor']:>6.1f}% {r['torch_sum_us']:>7.1f}")


if __name__ == "__main__":
    main()
