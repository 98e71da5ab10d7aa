"""Benchmark: MegaMoE prefill kernel variants (tilings) vs bf16 ``torch._grouped_mm``, m3.1-small shapes.

64 routed experts of 6144×1536 (NVFP4, per-row global scale), top-8, one MXFP8 shared expert of
intermediate 1536; bf16 tokens; T = 512, 4096, 16384 with uniform random routing. For each T:

* ``ours[<tiles>]``: ``moe_prefill``'s three launches + device permutation, per tiling (the default
  tiling is the one ``moe_prefill`` picks), also replayed from a CUDA graph; each variant's output is
  checked against the default's (relative L2);
* ``grouped_mm``: the same MoE in bf16 through ``torch._grouped_mm`` (bf16 weights dequantized once,
  offsets from the same sorted routing): sort + gather + FC1 + SiLU·mul + FC2 + weight + index_add
  combine + the shared expert as a dense bf16 SwiGLU; ``grouped_mm_gemms`` times the two grouped
  GEMMs alone;
* the FLOP floor at 750 TFLOP/s (bf16) and the NVFP4 weight byte floor at 4.28 TB/s.

``--wgmma-precision bf16 fp8`` times each wgmma build with bf16 and with E4M3 routed tiles.

Goal: ours >= 1.5× grouped_mm at T >= 4096. Writes JSON to $OUT (or benchmarks/results).

Usage (H200): PYTHONPATH=. python benchmarks/bench_moe_prefill_variants.py [--tokens 512 4096 16384]
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F
from _timing import bench, bench_graph, write_results

from m3c.backends.kernels import moe_prefill as mp
from m3c.backends.kernels import moe_prefill_cuda as pc
from m3c.backends.kernels import moe_prefill_ws as ws
from m3c.model_defs import quant

H, I, E, K, S = 6144, 1536, 64, 8, 1536  # noqa: E741
# as shipped (the builds below set them and restore them); WS bits: 1 pc.WS_FC1, 2 pc.WS_FC2, 4 moe_prefill_ws.PERSIST,
# 8 pc.WS_SHARED, 16 pc.WS_SHARED_FC2
DEFAULT_LUT = pc.LUT
DEFAULT_WS = int(pc.WS_FC1) + 2 * int(pc.WS_FC2) + 4 * int(ws.PERSIST) + 8 * int(pc.WS_SHARED) + \
    16 * int(pc.WS_SHARED_FC2)
READ_BW, BF16_FLOPS = 4.28e12, 750e12

VARIANTS = [  # Tiles(bm, bn1, bn2, bk, warps, stages); None = moe_prefill's own pick for the T
    None,
    mp.Tiles(128, 64, 128, 128, 8, 3),
    mp.Tiles(128, 64, 128, 64, 8, 4),
    mp.Tiles(128, 128, 128, 64, 8, 3),
    mp.Tiles(128, 64, 256, 64, 8, 3),
    mp.Tiles(64, 64, 128, 128, 4, 3),
    mp.Tiles(64, 128, 128, 64, 4, 3),
    mp.Tiles(128, 32, 128, 128, 4, 3),
]


WGMMA_VARIANTS = [(128, 4, 5), (128, 4, 4), (256, 2, 5), (64, 4, 5)]  # moe_prefill_cuda (BT, WGS, STAGES)


def nvfp4_stack(n: int, k: int, gen: torch.Generator) -> quant.NVFP4Tensor:
    """Random [E, n, k] NVFP4 weights with a per-row global scale, quantized one expert at a time."""
    parts = []
    for _ in range(E):
        w = torch.randn(n, k, device="cuda", generator=gen) / k**0.5
        parts.append(quant.nvfp4_quantize(w, w.abs().amax(-1, keepdim=True) / (6 * 448)))
    return quant.NVFP4Tensor(torch.stack([p.data for p in parts]), torch.stack([p.scale for p in parts]),
                             torch.stack([p.global_scale for p in parts]))


def mxfp8_shared(gen: torch.Generator) -> tuple[quant.MXFP8Tensor, quant.MXFP8Tensor]:
    """Random MXFP8 shared-expert weights ([2S, H], [H, S])."""
    return (quant.mxfp8_quantize(torch.randn(2 * S, H, device="cuda", generator=gen) / H**0.5),
            quant.mxfp8_quantize(torch.randn(H, S, device="cuda", generator=gen) / S**0.5))


def bf16_stack(w: quant.NVFP4Tensor) -> torch.Tensor:
    return torch.stack([quant.nvfp4_dequantize(quant.NVFP4Tensor(w.data[e], w.scale[e], w.global_scale[e]),
                                               torch.bfloat16) for e in range(E)])


def grouped_mm_moe(x, ids, wts, w13_t, w2_t, s13, s2, gemms_only: bool = False):
    """The bf16 baseline: sorted routing -> two torch._grouped_mm -> weighted index_add combine + dense shared."""
    t = x.shape[0]
    flat = ids.view(-1)
    sorted_ids, order = torch.sort(flat, stable=True)
    offs = torch.searchsorted(sorted_ids, torch.arange(1, E + 1, device=x.device), out_int32=True)
    tok = order // K
    xs = x.index_select(0, tok)
    gu = torch._grouped_mm(xs, w13_t, offs=offs)
    g, u = gu.chunk(2, dim=-1)
    a = F.silu(g) * u
    down = torch._grouped_mm(a, w2_t, offs=offs)
    if gemms_only:
        return down
    down = down * wts.view(-1)[order].to(down.dtype)[:, None]
    out = torch.zeros(t, x.shape[1], dtype=torch.float32, device=x.device)
    out.index_add_(0, tok, down.float())
    sg, su = F.linear(x, s13).chunk(2, dim=-1)
    return (out + F.linear(F.silu(sg) * su, s2).float()).to(x.dtype)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="+", default=[512, 4096, 16384])
    ap.add_argument("--triton-default-only", action="store_true", help="of the Triton tilings, time the default")
    ap.add_argument("--no-wgmma", action="store_true", help="skip the CUDA C++ wgmma kernels (moe_prefill_cuda)")
    ap.add_argument("--wgmma-builds", nargs="+", default=None, metavar="BT,WGS,STAGES[,INFLIGHT[,PROMOTE[,CTAS[,XPAD[,LUT[,WS]]]]]]",
                    help="wgmma builds to time (default: WGMMA_VARIANTS; LUT, WS (1 pc.WS_FC1 + 2 pc.WS_FC2 + 4 "
                         "PERSIST + 8 pc.WS_SHARED + 16 pc.WS_SHARED_FC2): as shipped)")
    ap.add_argument("--wgmma-precision", nargs="+", default=["bf16"], choices=pc.PRECISIONS,
                    help="routed-tile precisions of each wgmma build (fp8 builds take BT 128 or 256)")
    args = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    t0 = time.time()
    w13, w2 = nvfp4_stack(2 * I, H, gen), nvfp4_stack(H, I, gen)
    sh13, sh2 = mxfp8_shared(gen)
    w13_t = bf16_stack(w13).transpose(-2, -1)  # [E, H, 2I] column-major, as _grouped_mm wants
    w2_t = bf16_stack(w2).transpose(-2, -1)
    s13, s2 = quant.mxfp8_dequantize(sh13, torch.bfloat16), quant.mxfp8_dequantize(sh2, torch.bfloat16)
    print(f"weights built in {time.time() - t0:.1f}s", flush=True)
    weight_bytes = E * 3 * H * I * 0.5625 + 3 * S * H * (1 + 1 / 32)
    rows = []
    for t in args.tokens:
        x = torch.randn(t, H, device="cuda", generator=gen).bfloat16()
        ids = torch.rand(t, E, device="cuda", generator=gen).topk(K, dim=1).indices
        wts = torch.rand(t, K, device="cuda", generator=gen)
        flops = 6 * t * K * H * I + 6 * t * H * S
        row: dict = {"T": t, "flop_floor_ms": flops / BF16_FLOPS * 1e3, "byte_floor_ms": weight_bytes / READ_BW * 1e3}
        ref = mp.moe_prefill(x, ids, wts, w13, w2, sh13, sh2)
        base = grouped_mm_moe(x, ids, wts, w13_t, w2_t, s13, s2)
        row["grouped_mm_vs_ours_rel"] = float((base.float() - ref.float()).norm() / base.float().norm())
        base_args = (x, ids, wts, w13_t, w2_t, s13, s2)
        row["grouped_mm_ms"] = bench(lambda a=base_args: grouped_mm_moe(*a))
        row["grouped_mm_gemms_ms"] = bench(lambda a=base_args: grouped_mm_moe(*a, True))
        lay = mp._layout(x, ids, wts, w13, w2, sh13, sh2)
        default = mp._tile_options(lay, mp._bucket(lay, t), False)
        row["default_tiles"] = str(default)
        variants = {}

        def measure(run, got: torch.Tensor, ref=ref, flops=flops, row=row) -> dict:
            """One variant's row: plain and graph-replayed ms, difference from the default tiling, rates."""
            ms = bench(run)
            return {"ms": ms, "graph_ms": bench_graph(run),
                    "rel_vs_default": float((got.float() - ref.float()).norm() / ref.float().norm()),
                    "tflops": flops / ms / 1e9, "speedup_vs_grouped_mm": row["grouped_mm_ms"] / ms}
        for tiles in VARIANTS[:1] if args.triton_default_only else VARIANTS:
            tiles = tiles or default
            name = f"bm{tiles.bm}_bn{tiles.bn1}x{tiles.bn2}_bk{tiles.bk}_w{tiles.warps}_s{tiles.stages}"
            if name in variants:
                continue
            out = torch.empty_like(x)

            def run(tiles=tiles, out=out, a=(x, ids, wts, w13, w2, sh13, sh2, lay)):
                return mp._launch(*a, tiles, mp.jit_run, out)
            try:
                got = run()
                torch.cuda.synchronize()
            except Exception as e:  # a tiling that does not compile (smem) is reported, not fatal
                variants[name] = {"error": str(e)[:300]}
                print(t, name, "failed:", str(e)[:200], flush=True)
                continue
            variants[name] = measure(run, got)
            print(t, name, variants[name], flush=True)
        builds = [tuple(int(v) for v in b.split(",")) for b in args.wgmma_builds] if args.wgmma_builds else \
            WGMMA_VARIANTS
        # INFLIGHT 1, PROMOTE 0, CTAS 1, XPAD 0, LUT and WS as shipped (pc.LUT; pc.WS_FC1, pc.WS_FC2, ws.PERSIST)
        builds = [(*b, *(1, 0, 1, 0, int(DEFAULT_LUT), int(DEFAULT_WS))[len(b) - 3:]) for b in builds]
        firsts: dict[str, torch.Tensor] = {}  # each precision's first build's output (are the others bitwise equal?)
        for bt, wgs, stages, inflight, promote, ctas, xpad, lut, wsb, prec in [] if args.no_wgmma else [
                (*b, pr) for b in builds for pr in args.wgmma_precision if pr == "bf16" or b[0] != 64]:
            name = f"wgmma_bt{bt}_wg{wgs}_s{stages}" + (f"_f{inflight}" if inflight > 1 else "") + \
                ("" if prec == "bf16" else f"_{prec}") + ("_promote" if promote and prec == "fp8" else "") + \
                (f"_c{ctas}" if ctas > 1 else "") + (f"_x{xpad}" if xpad else "") + \
                ("_lut" if lut and prec == "fp8" else "") + (f"_ws{wsb}" if wsb and prec == "fp8" else "")
            name += f"_run{sum(k.startswith(name) for k in variants) + 1}" if name in variants else ""
            saved = (pc.BT, pc.WGS, pc.STAGES, pc.INFLIGHT, pc.PROMOTE, pc.CTAS, pc.XPAD, pc.LUT, pc.WS_FC1, pc.WS_FC2,
                     ws.PERSIST, pc.WS_SHARED, pc.WS_SHARED_FC2)
            pc.BT, pc.WGS, pc.STAGES, pc.INFLIGHT, pc.PROMOTE, pc.CTAS, pc.XPAD, pc.LUT, pc.WS_FC1, pc.WS_FC2, \
                ws.PERSIST, pc.WS_SHARED, pc.WS_SHARED_FC2 = bt, wgs, stages, inflight, bool(promote), ctas, xpad, \
                bool(lut), bool(wsb & 1), bool(wsb & 2), bool(wsb & 4), bool(wsb & 8), bool(wsb & 16)
            out = torch.empty_like(x)

            def run_w(out=out, a=(x, ids, wts, w13, w2, sh13, sh2), prec=prec):
                return pc.moe_prefill_wgmma(*a, out=out, precision=prec)
            try:
                got = run_w()
                torch.cuda.synchronize()
                variants[name] = measure(run_w, got)
                variants[name]["bitwise_equal_to_first"] = bool(torch.equal(got, firsts.setdefault(prec, got.clone())))
            except Exception as e:  # reported, not fatal
                variants[name] = {"error": str(e)[:300]}
            finally:
                pc.BT, pc.WGS, pc.STAGES, pc.INFLIGHT, pc.PROMOTE, pc.CTAS, pc.XPAD, pc.LUT, pc.WS_FC1, pc.WS_FC2, \
                    ws.PERSIST, pc.WS_SHARED, pc.WS_SHARED_FC2 = saved
            print(t, name, variants[name], flush=True)
        row["variants"] = variants
        best = min((v["ms"], k) for k, v in variants.items() if "ms" in v)
        row["best"] = {"name": best[1], "ms": best[0], "speedup_vs_grouped_mm": row["grouped_mm_ms"] / best[0]}
        print(json.dumps({k: v for k, v in row.items() if k != "variants"}), flush=True)
        rows.append(row)
    write_results("moe_prefill_variants", rows, shape={"H": H, "I": I, "E": E, "top_k": K, "shared_inter": S})


if __name__ == "__main__":
    main()
