"""Benchmark: MSA (indexer + top-k + sparse attention) on one GPU's TP4 slice vs dense SDPA, the plain
PyTorch MSA of model_defs (eager and torch.compile) and the NVFP4 byte floor — issue 5's table.

Slice: 16 query heads, 1 KV head, 1 index head, D = 128, block 128, top-16, NVFP4 K/V and index keys,
bf16 queries. Decode: contexts 32K / 128K / 512K / 1M × batch 1 / 8 / 32 (where memory allows) × 1 and
4 query rows per request (speculative decoding). Prefill: one 4K-token chunk at the end of each context.
Every time is the median of CUDA-graph replays (the kernels never synchronize with the host), and the
indexer's two kernels (scores, top-k) and the attention are also timed alone (a runner that launches
only one family, on buffers the full run filled). Floor = bytes that must move at the measured read
bandwidth (4.28 TB/s): index keys of the whole context (72 B/token) + K/V of the selected blocks (distinct
per request; 2 × 72 B/token) per request. Dense SDPA reads bf16 K/V of the whole context (GQA path);
its prefill row is the chunk's queries against the whole context without a mask (within 0.4% of the
causal FLOPs at these sizes). Selection agreement with the reference is checked on the first request.

Usage (H200): PYTHONPATH=. python benchmarks/bench_msa.py [--quick]; writes $OUT/msa.json (or
benchmarks/results/msa.json) and prints a table last.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F
from _timing import bench, bench_graph, record_point, write_results

from m3c.backends.kernels import msa_attention
from m3c.backends.kernels.msa_attention import msa_sparse_attention
from m3c.backends.kernels.msa_indexer import msa_indexer
from m3c.backends.triton_aot import jit_run
from m3c.model_defs import ops as mops

READ_BW = 4.28e12
H, KVH, D, BS, TOPK = 16, 1, 128, 128, 16
NVFP4_ROW = D * 9 // 16  # 72 B per token and head: 64 B codes + 8 B scales


def graph_ms(fn) -> float:
    """Median ms of fn replayed from a CUDA graph; NaN (printed) if capture fails."""
    return bench_graph(fn, rep=60)


def eager_ms(fn) -> float:
    """Median ms with host launches (for baselines that cannot be captured)."""
    return bench(fn, warmup=3, rep=30)


def only(*families: str):
    """A runner launching only the kernels of `families` (the others' outputs stay as the last full run left them)."""
    return lambda spec, grid, args: jit_run(spec, grid, args) if spec.family.startswith(families) else None


def make_batch(ctx: int, batch: int, rows: int, dev: str = "cuda") -> dict:
    """Random NVFP4 caches of `batch` requests of `ctx` tokens (shuffled blocks) and `rows` query rows each."""
    nbps = ctx // BS
    nb = nbps * batch
    gen = torch.Generator(device=dev).manual_seed(ctx + batch + rows)

    def codes(h: int) -> torch.Tensor:
        return torch.randint(0, 256, (nb, BS, h, D // 2), dtype=torch.uint8, device=dev, generator=gen)

    def scales(h: int) -> torch.Tensor:  # E4M3 scales 0.05..0.25: positive, finite, varied
        return (torch.rand((nb, BS, h, D // 16), device=dev, generator=gen) * 0.2 + 0.05).to(torch.float8_e4m3fn)

    t = batch * rows
    seq = torch.full((batch,), ctx, dtype=torch.int32, device=dev)
    pos = (ctx - rows + torch.arange(rows, device=dev)).repeat(batch).long()
    return {"kd": codes(KVH), "vd": codes(KVH), "ikd": codes(1), "ks": scales(KVH), "vs": scales(KVH),
            "iks": scales(1), "seq": seq, "pos": pos,
            "table": torch.randperm(nb, device=dev, generator=gen).view(batch, nbps).to(torch.int32),
            "qsl": torch.arange(batch + 1, dtype=torch.int32, device=dev) * rows,
            "q": torch.randn((t, H, D), device=dev, generator=gen).bfloat16(),
            "iq": torch.randn((t, 1, D), device=dev, generator=gen).bfloat16()}


def run_point(ctx: int, batch: int, rows: int, reference: bool) -> dict:
    """One (context, batch, rows) point: kernels, parts, floor, baselines."""
    b = make_batch(ctx, batch, rows)
    t = batch * rows
    mb = ctx // BS
    scores = torch.empty((t, 1, mb), dtype=torch.float32, device="cuda")
    sel = torch.empty((t, 1, TOPK), dtype=torch.int64, device="cuda")
    out = torch.empty_like(b["q"])

    def indexer(runner=jit_run):
        msa_indexer(b["iq"], b["ikd"], b["iks"], b["pos"], b["qsl"], b["seq"], b["table"], BS, TOPK,
                    runner=runner, scores_out=scores, selected_out=sel)

    def attention(runner=jit_run):
        msa_sparse_attention(b["q"], b["kd"], b["ks"], b["vd"], b["vs"], sel, b["pos"], b["qsl"], b["seq"],
                             b["table"], BS, D**-0.5, runner=runner, out=out)

    def msa():
        indexer()
        attention()

    row: dict = {"context": ctx, "batch": batch, "rows": rows, "tokens": t}
    msa()
    torch.cuda.synchronize()
    n_ref = min(rows, 64)  # the reference loops in Python: check the first request's first rows
    r_scores = mops.indexer_block_scores(b["iq"][:n_ref].float(), b["ikd"], b["iks"], "nvfp4", b["pos"][:n_ref],
                                         torch.tensor([0, n_ref], dtype=torch.int32, device="cuda"), b["seq"][:1],
                                         b["table"][:1], BS)
    r_sel = mops.select_blocks(r_scores, b["pos"][:n_ref], BS, TOPK)
    row["selection_equals_reference"] = bool(torch.equal(sel[:n_ref], r_sel))
    row["selection_rows_differing"] = int((sel[:n_ref] != r_sel).any(-1).sum())
    row["msa_ms"] = graph_ms(msa)
    row["indexer_ms"] = graph_ms(indexer)
    row["scores_ms"] = graph_ms(lambda: indexer(only("msa_indexer_scores", "msa_indexer_mma")))  # Triton / CUDA
    row["topk_ms"] = graph_ms(lambda: indexer(only("msa_topk")))
    row["attention_ms"] = graph_ms(attention)
    sel_blocks = sum(torch.unique(sel[r * rows:(r + 1) * rows].clamp(min=0)).numel() for r in range(batch))
    floor_bytes = batch * ctx * NVFP4_ROW + sel_blocks * BS * 2 * KVH * NVFP4_ROW
    row["floor_ms"] = floor_bytes / READ_BW * 1e3
    row["msa_over_floor"] = row["msa_ms"] / row["floor_ms"]
    if batch * ctx * KVH * D * 4 <= 24e9:  # dense bf16 K and V
        kd = torch.randn((batch, KVH, ctx, D), device="cuda", dtype=torch.bfloat16)
        vd = torch.randn_like(kd)
        qd = b["q"].view(batch, rows, H, D).transpose(1, 2)
        row["sdpa_dense_ms"] = graph_ms(lambda: F.scaled_dot_product_attention(qd, kd, vd, enable_gqa=True))
        row["speedup_vs_dense"] = row["sdpa_dense_ms"] / row["msa_ms"]
        del kd, vd
    if reference:
        row.update(reference_times(b, rows, compile_too=ctx in (131072, 1048576)))
    torch.cuda.empty_cache()
    print(json.dumps(row), flush=True)
    return row


def reference_times(b: dict, rows: int, compile_too: bool) -> dict:
    """The plain PyTorch MSA of model_defs on the first request, eager and under torch.compile."""
    iq, q = b["iq"][:rows], b["q"][:rows]
    pos, qsl, seq, table = b["pos"][:rows], b["qsl"][:2], b["seq"][:1], b["table"][:1]

    def ref():
        s = mops.indexer_block_scores(iq, b["ikd"], b["iks"], "nvfp4", pos, qsl, seq, table, BS)
        sel = mops.select_blocks(s, pos, BS, TOPK)
        return mops.sparse_attention(q, b["kd"], b["ks"], b["vd"], b["vs"], "nvfp4", sel, pos, qsl, seq, table, BS,
                                     D**-0.5)

    out = {"reference_eager_ms": eager_ms(ref)}
    if not compile_too:
        return out
    try:
        compiled = torch.compile(ref)
        t0 = time.time()
        compiled()
        out["reference_compile_s"] = time.time() - t0
        out["reference_torch_compile_ms"] = eager_ms(compiled)
    except Exception as e:  # recorded, not hidden
        out["reference_torch_compile_error"] = f"{type(e).__name__}: {str(e)[:200]}"
    return out


def main() -> None:
    """The whole grid; JSON and a short table."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="batch 1 and 8, 1 row, plus the prefill chunks")
    ap.add_argument("--no-reference", action="store_true", help="skip the plain-PyTorch MSA baselines")
    ap.add_argument("--attn-triton", action="store_true",
                    help="attention through the Triton kernels only (ATTN_CUDA off; default: the CUDA C++ decode kernel)")
    args = ap.parse_args()
    msa_attention.ATTN_CUDA = msa_attention.ATTN_CUDA and not args.attn_triton
    contexts = (32768, 131072, 524288, 1048576)
    points = [(c, b, r) for c in contexts for b in ((1, 8) if args.quick else (1, 8, 32))
              for r in ((1,) if args.quick else (1, 4)) if b * c <= 32 * 1048576]
    points += [(c, 1, 4096) for c in contexts]  # prefill chunks
    rows = []
    for ctx, batch, nrows in points:
        ref = not args.no_reference and batch == 1 and nrows == 1
        record_point(rows, {"context": ctx, "batch": batch, "rows": nrows},
                     lambda c=ctx, b=batch, n=nrows, ref=ref: run_point(c, b, n, reference=ref))
    write_results("msa", rows)
    print(f"\n{'ctx':>8} {'B':>3} {'rows':>5} {'msa':>9} {'scores':>9} {'topk':>8} {'attn':>9} {'floor':>8} "
          f"{'/floor':>6} {'sdpa':>9} {'xdense':>7} {'ref':>9} sel==ref")
    us = lambda r, k: f"{r.get(k, float('nan')) * 1e3:>8.1f}u"  # noqa: E731
    for r in rows:
        if "error" in r:
            print(f"{r['context']:>8} {r['batch']:>3} {r['rows']:>5} {r['error'][:80]}")
            continue
        print(f"{r['context']:>8} {r['batch']:>3} {r['rows']:>5} {us(r, 'msa_ms')} {us(r, 'scores_ms')} "
              f"{us(r, 'topk_ms')[1:]} {us(r, 'attention_ms')} {us(r, 'floor_ms')[1:]} {r['msa_over_floor']:>6.2f} "
              f"{us(r, 'sdpa_dense_ms')} {r.get('speedup_vs_dense', float('nan')):>7.2f} "
              f"{us(r, 'reference_eager_ms')} {r['selection_equals_reference']}")


if __name__ == "__main__":
    main()
