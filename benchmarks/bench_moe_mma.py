"""Benchmark + check: the CUDA C++ MegaMoE decode (m3c/backends/kernels/moe_cuda.py) vs the Triton path, m3.1-small.

Same block as bench_moe.py (64 NVFP4 experts of 6144x1536, top-8, MXFP8 shared expert, bf16 tokens). For each T:
the CUDA kernels' output vs the reference MoE in float32 (relative Frobenius error, beside the Triton path's), and
CUDA-graph times of (a) the expert launches alone over precomputed routing (CUDA C++ and Triton grouped-GEMM
tiles), (b) the whole op (routing + experts) as megamoe runs it, side by side with megamoe.CUDA_ROUTE on (one
launch: router GEMV + routing + token staging, moe_cuda.route_stage) and off (cuBLAS GEMV + fused_route +
moe_stage_x), and those routing + staging launches alone, (c) the old routing + CUDA C++ experts; the byte floor
(touched NVFP4 + MXFP8 bytes at 4.28 TB/s) and each path's fraction of it. Settings to compare: --decode
(0: prmt to f16, 1: prmt to E4M3 + cvt, 2: the weight loads alone, no decode or MMA: a probe of what the kernels'
streaming, staging and grids allow, whose output is wrong), --natural (1: the routed experts read in their own
layout, no prepacked copy; with decode 0 only) and --pdl (the kernels launched as programmatic dependent launches, at every T:
"fc1,act,fc2,combine", "none" or "default" for moe_cuda.PDL's per-NT choice) and --fc1-min-ctas (-1, the
default: moe_cuda.FC1_MIN_CTAS's per-build choice; 0: FC1's own register choice; n: n CTAs an SM forced, at every
T) and --nt1-max (moe_cuda.NT1_MAX_TOKENS: up to this many tokens the NT = 1 build, looping over 8-column
groups above 8, the shared expert's groups as more CTAs; above, the NT = 2 build looping over groups of 16) and
--early (moe_cuda.EARLY_LOAD: 1, every build's FC1 / FC2 issue their first weight loads before staging the tokens;
0 none; -1 the module's per-build choice); each
setting's whole op (megamoe with its routing launch, "megamoe") is timed
too, and its experts' output compared bitwise with the first setting's of the same decode / natural.

Usage (H200): PYTHONPATH=. python benchmarks/bench_moe_mma.py [--tokens 1,2,4,8] [--decode 0 1] [--natural 0 1]
    [--pdl none default fc1,act,fc2,combine] [--fc1-min-ctas 0 4] [--nt1-max 8 32] [--early 0 1] [--repeat 2]
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
from _timing import bench_graph, kernel_times, token_sweep

from m3c.backends.kernels import megamoe as megamoe_mod
from m3c.backends.kernels import moe_cuda
from m3c.backends.kernels.megamoe import megamoe
from m3c.backends.kernels.moe_prefill import moe_prefill
from m3c.backends.kernels.moe_routing import fused_route
from m3c.backends.triton_aot import jit_run
from m3c.fused.moe import MegaMoE, random_moe

READ_BW = 4.28e12
H, INTER, E, K, S = 6144, 1536, 64, 8, 1536


def decode_point(t: int, moe, mm: MegaMoE, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    """T random bf16 tokens routed as megamoe routes them: (x, ids, weights, experts touched, byte floor in ms,
    the float32 reference output)."""
    x = torch.randn(t, H, generator=gen, device="cuda").to(torch.bfloat16)
    cfg = moe.cfg
    ids, w, _ = fused_route(F.linear(x.float(), mm.gate_w32), mm.bias, top_k=K,
                            routed_scaling_factor=cfg.routed_scaling_factor, norm_topk_prob=cfg.norm_topk_prob)
    touched = int(torch.unique(ids).numel())
    floor_ms = (touched * 3 * H * INTER * 0.5625 + 3 * H * S * 1.03125) / READ_BW * 1e3
    return x, ids, w, touched, floor_ms, moe(x.float())


def pdl_setting(pdl: str, default: dict[int | str, tuple[str, ...]]) -> dict[int | str, tuple[str, ...]]:
    """moe_cuda.PDL for a --pdl value: "default" (`default`, the module's own), "none", or kernels comma-separated
    ("fc1,act,fc2,combine") launched programmatically in every build (folded or not)."""
    if pdl == "default":
        return default
    kernels = tuple(f"moe_{k}" for k in pdl.replace("moe_", "").split(",") if k != "none")
    return {1: kernels, 2: kernels}


def early_setting(early: int, default: frozenset) -> frozenset:
    """moe_cuda.EARLY_LOAD for an --early value: -1 `default` (the module's own), 0 no build, 1 every decode build."""
    if early < 0:
        return default
    return frozenset((nt, wide) for nt in (1, 2) for wide in (False, True)) if early else frozenset()


def run(t: int, moe, mm: MegaMoE, gen: torch.Generator, settings: list[tuple[int, int, str, int, int, int]]
        ) -> list[dict]:
    """One T: check and time every setting."""
    x, ids, w, touched, floor_ms, truth = decode_point(t, moe, mm, gen)
    cfg = moe.cfg
    w13, w2, s13, s2 = mm.weights()
    triton_out = moe_prefill(x, ids, w, w13, w2, s13, s2)
    stage_x = moe_cuda.mma_specs(H, INTER, S, "bf16", *moe_cuda.decode_build(t))[0]

    def route_new():
        return moe_cuda.route_stage(x, mm.gate_w32, mm.bias, K, cfg.routed_scaling_factor, cfg.norm_topk_prob)

    def route_old():
        i2, w2_, _ = fused_route(F.linear(x.float(), mm.gate_w32), mm.bias, top_k=K,
                                 routed_scaling_factor=cfg.routed_scaling_factor, norm_topk_prob=cfg.norm_topk_prob)
        x16, xmult = torch.empty(t, H, dtype=torch.float16, device="cuda"), torch.empty(t, device="cuda")
        jit_run(stage_x, (t,), [x, H, x16, xmult])
        return i2, w2_, x16, xmult

    def whole_op(cuda_route: bool) -> float:
        megamoe_mod.CUDA_ROUTE = cuda_route
        try:
            return bench_graph(lambda: megamoe(x, mm.gate_w32, mm.bias, w13, w2, s13, s2, top_k=K,
                                               routed_scaling_factor=cfg.routed_scaling_factor,
                                               norm_topk_prob=cfg.norm_topk_prob))
        finally:
            megamoe_mod.CUDA_ROUTE = True

    one_launch = t <= moe_cuda.ROUTE_MAX_TOKENS  # above, megamoe routes with the GEMV + fused_route either way
    new_r, old_r = route_new() if one_launch else None, route_old()
    base = {"T": t, "experts": touched, "floor_ms": floor_ms,
            "triton_err": float((triton_out.float() - truth).norm() / truth.norm()),
            "triton_experts_ms": bench_graph(lambda: moe_prefill(x, ids, w, w13, w2, s13, s2)),
            "megamoe_ms": whole_op(True), "megamoe_old_route_ms": whole_op(False),
            "route_stage_ms": bench_graph(route_new) if new_r else float("nan"),
            "route_old_ms": bench_graph(route_old)}
    if new_r:
        base.update(route_ids_equal=bool(torch.equal(new_r[0], old_r[0])),
                    route_w_maxrel=float(((new_r[1] - old_r[1]).abs() / old_r[1].abs()).max()),
                    staging_equal=bool(torch.equal(new_r[2], old_r[2]) and torch.equal(new_r[3], old_r[3])))
    rows = []
    saved = (moe_cuda.DECODE, moe_cuda.NATURAL, moe_cuda.PDL, moe_cuda.FC1_MIN_CTAS, moe_cuda.NT1_MAX_TOKENS,
             moe_cuda.EARLY_LOAD)
    first: dict[tuple[int, int], torch.Tensor] = {}
    try:
        for dec, nat, pdl, mc, nt1, early in settings:
            moe_cuda.EARLY_LOAD = early_setting(early, saved[5])
            moe_cuda.NT1_MAX_TOKENS = saved[4] if nt1 < 0 else nt1
            moe_cuda.FC1_MIN_CTAS = saved[3] if mc < 0 else {1: mc, 2: mc, "wide": mc}
            moe_cuda.DECODE, moe_cuda.NATURAL = dec, bool(nat)
            moe_cuda.PDL = pdl_setting(pdl, saved[2])
            out = moe_cuda.moe_decode_mma(x, ids, w, w13, w2, s13, s2)
            ref = first.setdefault((dec, nat), out)
            row = dict(base, decode=dec, natural=nat, pdl=pdl, fc1_min_ctas=mc, nt1_max=moe_cuda.NT1_MAX_TOKENS,
                       early=early, err=float((out.float() - truth).norm() / truth.norm()),
                       max_vs_triton=float((out.float() - triton_out.float()).abs().max()),
                       equal_to_first=bool(torch.equal(out, ref)))
            row["experts_ms"] = bench_graph(lambda: moe_cuda.moe_decode_mma(x, ids, w, w13, w2, s13, s2))
            row["megamoe_ms"] = whole_op(True)

            def whole():
                lg = F.linear(x.float(), mm.gate_w32)
                i2, w2_, _ = fused_route(lg, mm.bias, top_k=K, routed_scaling_factor=cfg.routed_scaling_factor,
                                         norm_topk_prob=cfg.norm_topk_prob)
                return moe_cuda.moe_decode_mma(x, i2, w2_, w13, w2, s13, s2)
            row["whole_ms"] = bench_graph(whole)
            row["kernels_us"] = {k[:40]: v for k, v in list(kernel_times(
                lambda: moe_cuda.moe_decode_mma(x, ids, w, w13, w2, s13, s2)).items())[:6]}
            row["bw_fraction"] = floor_ms / row["experts_ms"]
            print(json.dumps(row), flush=True)
            rows.append(row)
    finally:  # the module settings as they were, whatever happened
        (moe_cuda.DECODE, moe_cuda.NATURAL, moe_cuda.PDL, moe_cuda.FC1_MIN_CTAS, moe_cuda.NT1_MAX_TOKENS,
         moe_cuda.EARLY_LOAD) = saved
    return rows


def main() -> None:
    """Every T and setting; JSON and a short table."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="1,2,4,8")
    ap.add_argument("--decode", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--natural", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--pdl", nargs="+", default=["default"],
                    help="kernels launched programmatically, comma-separated (fc1,act,fc2,combine), none or default")
    ap.add_argument("--fc1-min-ctas", type=int, nargs="+", default=[-1])
    ap.add_argument("--nt1-max", type=int, nargs="+", default=[-1], help="moe_cuda.NT1_MAX_TOKENS (-1: its own)")
    ap.add_argument("--early", type=int, nargs="+", default=[-1],
                    help="moe_cuda.EARLY_LOAD: 1 every build, 0 none, -1 its own")
    ap.add_argument("--repeat", type=int, default=1, help="the settings' sequence this many times (alternations)")
    args = ap.parse_args()
    settings = [(d, n, p, m, b, q) for n in args.natural for d in args.decode if not (n and d) for p in args.pdl
                for m in args.fc1_min_ctas for b in args.nt1_max for q in args.early] * args.repeat
    gen = torch.Generator(device="cuda").manual_seed(0)
    moe = random_moe(H, INTER, E, K, "mxfp8", gen, device="cuda")
    mm = MegaMoE.from_reference(moe)
    rows = token_sweep("moe_mma", args.tokens, lambda t: run(t, moe, mm, gen, settings), shape=[H, INTER, E, K, S])
    print(f"\n{'T':>3} {'exp':>4} {'dec':>3} {'nat':>3} {'pdl':>22} {'mc':>2} {'nt1':>3} {'ea':>2} {'cuda':>8} "
          f"{'triton':>8} {'floor':>7} {'%bw':>5} {'whole':>8} "
          f"{'megamoe':>8} {'old rt':>8} {'route':>7} {'old rt':>7} {'err':>8} {'tri err':>8}")
    for r in rows:
        if "error" in r:
            print(f"{r['T']:>3} {r['error']}")
            continue
        print(f"{r['T']:>3} {r['experts']:>4} {r['decode']:>3} {r['natural']:>3} {r['pdl']:>22} {r['fc1_min_ctas']:>2} "
              f"{r['nt1_max']:>3} {r['early']:>2} {r['experts_ms'] * 1e3:>7.1f}u "
              f"{r['triton_experts_ms'] * 1e3:>7.1f}u {r['floor_ms'] * 1e3:>6.1f}u {100 * r['bw_fraction']:>5.1f} "
              f"{r['whole_ms'] * 1e3:>7.1f}u {r['megamoe_ms'] * 1e3:>7.1f}u {r['megamoe_old_route_ms'] * 1e3:>7.1f}u "
              f"{r['route_stage_ms'] * 1e3:>6.1f}u {r['route_old_ms'] * 1e3:>6.1f}u {r['err']:>8.1e} "
              f"{r['triton_err']:>8.1e}{'' if r['equal_to_first'] else ' DIFFERS'}")


if __name__ == "__main__":
    main()
