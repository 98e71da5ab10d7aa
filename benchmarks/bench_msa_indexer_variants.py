"""Benchmark: the MSA indexer's decode dequant paths and its prefill tiling on one GPU (TP4 slice).

m3.1-small layout: 1 index head, D = 128, block 128, top-16, NVFP4 index keys, bf16 index q.
Decode: contexts 32K / 128K / 512K / 1M tokens × batch 1 and 8, 1 query row per request, each
``deq`` path of :func:`m3c.backends.kernels.msa_indexer.msa_indexer` ("cuda": the CUDA C++ kernel, ``--cuda-*``
knobs; ``DEQ_MODES``: "f32scale", "groupdot", "fp8", "fma", "int8"; ``--fma-keys`` / ``--fma-warps`` / ``--fma-rows`` / ``--fma-stages`` override the
"fma" and "int8" paths' FMA_KEYS / FMA_WARPS / FMA_ROWS / FMA_STAGES for tuning, recorded in their rows).
Prefill: a 4K-row chunk (the last 4,096 positions) at 128K and 1M tokens (always the "f32scale" tile).
Each point reports the CUDA-graph replay time (µs, median), the floor (decode: 72 B/token of index keys
at 4.28 TB/s; prefill: 2·T·ctx·D FLOPs at 750 TFLOP/s bf16) and its % of the floor, dense SDPA over a
bf16 K/V of the same context (16 query heads, GQA) for scale, and selection agreement with the
reference (``ops.select_blocks(ops.indexer_block_scores(...))`` on request 0; prefill on 64 sampled
rows): the fraction of equal selected-block entries and of rows whose whole selection matches.
Writes JSON to $OUT (or benchmarks/results) and prints a short table last.

Usage (H200): PYTHONPATH=. python benchmarks/bench_msa_indexer_variants.py [--quick]
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
import triton.testing
from _timing import bench_graph, record_point, write_results

from m3c.backends.kernels import msa_indexer as mi
from m3c.backends.kernels import msa_indexer_cuda as mc
from m3c.backends.kernels.msa_indexer import (
    DECODE_PATHS,
    DEQ_MODES,
    _topk_spec,
    _topk_workspace,
    msa_indexer,
    topk_plan,
)
from m3c.backends.triton_aot import jit_run
from m3c.model_defs import ops as mops

READ_BW = 4.28e12
BF16_FLOPS = 750e12
H, D, BS, TOPK = 16, 128, 128, 16


def make_cache(ctx: int, batch: int, gen: torch.Generator) -> dict:
    """A shuffled paged NVFP4 index-key cache holding `batch` contexts of `ctx` tokens."""
    nbps = ctx // BS
    nb = nbps * batch
    dev = "cuda"
    kd = torch.randint(0, 256, (nb, BS, 1, D // 2), dtype=torch.uint8, device=dev, generator=gen)
    ks = (torch.rand((nb, BS, 1, D // 16), device=dev, generator=gen) * 0.2 + 0.05).to(torch.float8_e4m3fn)
    table = torch.randperm(nb, device=dev, generator=gen).view(batch, nbps).to(torch.int32)
    return {"k_data": kd, "k_scale": ks, "seq_lens": torch.full((batch,), ctx, dtype=torch.int32, device=dev),
            "block_table": table}


def agreement(sel: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """(fraction of equal entries, fraction of rows with an identical selection)."""
    eq = sel == ref
    return float(eq.float().mean()), float(eq.all(dim=-1).float().mean())


def dense_sdpa_ms(rows: int, ctx: int, batch: int) -> float:
    """torch SDPA over dense bf16 K/V (16 q heads, 1 KV head, GQA), no mask (flash kernel; a 4K chunk's own
    causal triangle is <= 1.6% of its keys at 128K); NaN if the K/V would not fit."""
    if batch * ctx * D * 2 * 2 > 40e9:
        return float("nan")
    k = torch.randn((batch, 1, ctx, D), device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    q = torch.randn((batch, H, rows, D), device="cuda", dtype=torch.bfloat16)
    ms = float(triton.testing.do_bench(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True),
                                       warmup=5, rep=50, return_mode="median"))
    return ms


def time_topk(scores: torch.Tensor, pos: torch.Tensor, sel: torch.Tensor) -> float:
    """Graph-replay ms of kernel 2 alone (the top-k over [T, 1, max_blocks] scores; the same in every path)."""
    t, _, mb = scores.shape
    ch, n_sl = topk_plan(t, mb, torch.cuda.get_device_properties(0).multi_processor_count)
    spec = _topk_spec(1, BS, TOPK, ch)
    cand, cnt = _topk_workspace(scores.device, t, spec.constexprs["KO"], n_sl > 1)
    return bench_graph(lambda: jit_run(spec, (t, n_sl), (scores, pos, sel, cand, cnt, mb)))


def run_decode(ctx: int, batch: int, max_q_rows: int, modes: tuple[str, ...] = DEQ_MODES) -> list[dict]:
    """The dequant paths `modes` at one (context, batch) point, 1 row per request (tiles sized for max_q_rows)."""
    gen = torch.Generator(device="cuda").manual_seed(ctx + batch)
    c = make_cache(ctx, batch, gen)
    qsl = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
    pos = (c["seq_lens"] - 1).long()
    iq = torch.randn((batch, 1, D), device="cuda", generator=gen).bfloat16()
    mb = c["block_table"].shape[1]
    ref_scores = mops.indexer_block_scores(iq[:1].float(), c["k_data"], c["k_scale"], "nvfp4", pos[:1], qsl[:2],
                                           c["seq_lens"][:1], c["block_table"][:1], BS)
    ref_sel = mops.select_blocks(ref_scores, pos[:1], BS, TOPK)
    floor_ms = batch * ctx * (D // 2 + D // 16) / READ_BW * 1e3
    sdpa = dense_sdpa_ms(1, ctx, batch)
    rows = []
    for deq in modes:
        scores = torch.empty((batch, 1, mb), dtype=torch.float32, device="cuda")
        sel = torch.empty((batch, 1, TOPK), dtype=torch.int64, device="cuda")

        def fn(deq: str = deq, scores: torch.Tensor = scores, sel: torch.Tensor = sel) -> None:
            msa_indexer(iq, c["k_data"], c["k_scale"], pos, qsl, c["seq_lens"], c["block_table"], BS, TOPK,
                        max_q_rows=max_q_rows, deq=deq, scores_out=scores, selected_out=sel)

        fn()
        torch.cuda.synchronize()
        ent, full = agreement(sel[:1], ref_sel)
        ms = bench_graph(fn)
        topk_ms = time_topk(scores, pos, sel)
        tune = ({"fma_keys": mi.FMA_KEYS, "fma_warps": mi.FMA_WARPS, "fma_rows": mi.FMA_ROWS,
                 "fma_stages": mi.FMA_STAGES} if deq in ("fma", "int8") else {})
        tune |= {"chunk_waves": mi.CHUNK_WAVES, "chunk_max": mi.CHUNK_MAX}
        if deq == "cuda":
            tune = {"cuda_ctas_per_sm": mc.CTAS_PER_SM, "cuda_min_ctas": mc.MIN_CTAS[1], "cuda_warps": mc.WARPS}
        tune |= {"topk_ch": mi.TOPK_CH[0], "topk_slices": mi.TOPK_SLICES, "topk_warps": mi.TOPK_WARPS,
                 "topk_rank_merge": mi.TOPK_RANK_MERGE}
        row = {"phase": "decode", "context": ctx, "batch": batch, "deq": deq, "max_q_rows": max_q_rows, **tune,
               "us": ms * 1e3, "topk_us": topk_ms * 1e3,
               "floor_us": floor_ms * 1e3, "pct_of_floor": 100 * floor_ms / ms, "sdpa_dense_us": sdpa * 1e3,
               "x_dense": sdpa / ms, "sel_entries_equal": ent, "sel_rows_equal": full,
               "score_max_rel_diff": float(((scores[:1] - ref_scores).abs().nan_to_num(0)).max()
                                           / ref_scores[torch.isfinite(ref_scores)].abs().max())}
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def run_prefill(ctx: int, chunk: int = 4096) -> dict:
    """A `chunk`-row prefill chunk at the end of one `ctx`-token context."""
    gen = torch.Generator(device="cuda").manual_seed(ctx + chunk)
    c = make_cache(ctx, 1, gen)
    qsl = torch.tensor([0, chunk], dtype=torch.int32, device="cuda")
    pos = torch.arange(ctx - chunk, ctx, device="cuda")
    iq = torch.randn((chunk, 1, D), device="cuda", generator=gen).bfloat16()
    mb = c["block_table"].shape[1]
    scores = torch.empty((chunk, 1, mb), dtype=torch.float32, device="cuda")
    sel = torch.empty((chunk, 1, TOPK), dtype=torch.int64, device="cuda")

    def fn() -> None:
        msa_indexer(iq, c["k_data"], c["k_scale"], pos, qsl, c["seq_lens"], c["block_table"], BS, TOPK,
                    scores_out=scores, selected_out=sel)

    fn()
    torch.cuda.synchronize()
    pick = torch.randperm(chunk, device="cuda", generator=gen)[:64].sort().values
    sub = torch.tensor([0, 64], dtype=torch.int32, device="cuda")
    ref_scores = mops.indexer_block_scores(iq[pick].float(), c["k_data"], c["k_scale"], "nvfp4", pos[pick], sub,
                                           c["seq_lens"], c["block_table"], BS)
    ent, full = agreement(sel[pick], mops.select_blocks(ref_scores, pos[pick], BS, TOPK))
    ms = bench_graph(fn)
    topk_ms = time_topk(scores, pos, sel)
    floor_ms = 2 * chunk * ctx * D / BF16_FLOPS * 1e3
    sdpa = dense_sdpa_ms(chunk, ctx, 1)
    row = {"phase": "prefill", "context": ctx, "batch": 1, "rows": chunk, "deq": "f32scale", "us": ms * 1e3,
           "topk_us": topk_ms * 1e3,
           "floor_us": floor_ms * 1e3, "pct_of_floor": 100 * floor_ms / ms, "tflops": 2 * chunk * ctx * D / ms / 1e9,
           "sdpa_dense_us": sdpa * 1e3, "x_dense": sdpa / ms, "sel_entries_equal": ent, "sel_rows_equal": full}
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    """All points; JSON and a short table."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="32K and 1M decode at batch 1, prefill at 128K only")
    ap.add_argument("--max-q-rows", type=int, default=1, help="decode row tile (1: plain decode; 8: spec. decoding)")
    ap.add_argument("--fma-keys", type=int, default=mi.FMA_KEYS, help='"fma": keys per step (a power of two)')
    ap.add_argument("--fma-warps", type=int, default=mi.FMA_WARPS, help='"fma": warps per program')
    ap.add_argument("--fma-rows", type=int, default=mi.FMA_ROWS, help='"fma": query rows per tile (at most)')
    ap.add_argument("--fma-stages", type=int, default=mi.FMA_STAGES,
                    help='"fma": software-pipeline stages of the block loop (1: none)')
    ap.add_argument("--deq", nargs="+", choices=DECODE_PATHS, default=["cuda", *DEQ_MODES],
                    help="decode paths to time (\"cuda\": the CUDA C++ scores kernel)")
    ap.add_argument("--cuda-ctas", type=int, default=mc.CTAS_PER_SM, help='"cuda": CTAs per SM the chunks aim at')
    ap.add_argument("--cuda-min-ctas", type=int, default=mc.MIN_CTAS[1], help='"cuda": __launch_bounds__ min CTAs (NT=1)')
    ap.add_argument("--cuda-warps", type=int, default=mc.WARPS, help='"cuda": warps per CTA')
    ap.add_argument("--topk-ch", type=int, default=mi.TOPK_CH[0], help="top-k slice width in blocks (a power of 2)")
    ap.add_argument("--topk-slices", type=int, default=mi.TOPK_SLICES, help="most top-k slices a row (a power of 2)")
    ap.add_argument("--topk-warps", type=int, default=mi.TOPK_WARPS, help="top-k warps (0: by the chunk width)")
    ap.add_argument("--topk-rank-merge", type=int, default=mi.TOPK_RANK_MERGE,
                    help="merge a row's slices by pairwise ranks up to this many candidates (0: by max-reductions)")
    ap.add_argument("--no-prefill", action="store_true", help="decode points only")
    ap.add_argument("--batches", type=int, nargs="+", default=None, help="decode batch sizes (default: 1, or 1 8)")
    ap.add_argument("--contexts", type=int, nargs="+", default=None, help="decode contexts in tokens")
    ap.add_argument("--chunk-waves", type=int, default=mi.CHUNK_WAVES, help="decode scores programs per SM aimed at")
    ap.add_argument("--chunk-max", type=int, default=mi.CHUNK_MAX, help="most blocks per decode scores program")
    args = ap.parse_args()
    # read by the spec builder and the launcher
    mi.FMA_KEYS, mi.FMA_WARPS, mi.FMA_ROWS, mi.FMA_STAGES = args.fma_keys, args.fma_warps, args.fma_rows, args.fma_stages
    mi.CHUNK_WAVES, mi.CHUNK_MAX = args.chunk_waves, args.chunk_max
    mc.CTAS_PER_SM, mc.MIN_CTAS[1], mc.WARPS = args.cuda_ctas, args.cuda_min_ctas, args.cuda_warps
    mi.TOPK_CH, mi.TOPK_SLICES, mi.TOPK_WARPS = (args.topk_ch, mi.TOPK_CH[-1]), args.topk_slices, args.topk_warps
    mi.TOPK_RANK_MERGE = args.topk_rank_merge
    ctxs = args.contexts or ((32768, 1 << 20) if args.quick else (32768, 131072, 524288, 1 << 20))
    batches = args.batches or ((1,) if args.quick else (1, 8))
    rows: list[dict] = []
    points = [("decode", c, b) for b in batches for c in ctxs]
    if not args.no_prefill:
        points += [("prefill", c, 1) for c in ((131072,) if args.quick else (131072, 1 << 20))]
    for phase, ctx, batch in points:
        record_point(rows, {"phase": phase, "context": ctx, "batch": batch},
                     lambda p=phase, c=ctx, b=batch: run_decode(c, b, args.max_q_rows, tuple(args.deq)) if p == "decode" else run_prefill(c))
    write_results("msa_indexer_variants", rows)
    print(f"\n{'phase':>7} {'ctx':>8} {'B':>2} {'deq':>9} {'us':>9} {'topk':>7} {'floor':>8} {'%floor':>7} "
          f"{'xdense':>7} {'sel==':>6} {'rows==':>6}")
    for r in rows:
        if "error" in r:
            print(f"{r['phase']:>7} {r['context']:>8} {r['batch']:>2} {r['error']}")
            continue
        print(f"{r['phase']:>7} {r['context']:>8} {r['batch']:>2} {r['deq']:>9} {r['us']:>9.1f} {r['topk_us']:>7.1f} "
              f"{r['floor_us']:>8.1f} "
              f"{r['pct_of_floor']:>6.1f}% {r['x_dense']:>7.2f} {r['sel_entries_equal']:>6.3f} "
              f"{r['sel_rows_equal']:>6.3f}")


if __name__ == "__main__":
    main()
