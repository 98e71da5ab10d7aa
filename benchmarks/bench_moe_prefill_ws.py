"""The warp-specialized FC1 prototype (``moe_prefill_ws``) against the register-A fp8 FC1 (``moe_prefill_cuda``,
its routed tiles only) in one run, m3.1-small shapes: device ms, TFLOP/s, and the two outputs' difference (the same
E4M3 inputs; the MMAs sum K in different groupings, so bf16 roundings of act may flip).

Usage (H200): PYTHONPATH=. python benchmarks/bench_moe_prefill_ws.py [--tokens 512 4096 16384] [--builds 3,3 2,2]
"""

from __future__ import annotations

import argparse

import torch
from _timing import bench, bench_graph, write_results
from bench_moe_prefill_variants import E, H, I, K, nvfp4_stack

from m3c.backends.kernels import moe_cuda
from m3c.backends.kernels import moe_prefill as mp
from m3c.backends.kernels import moe_prefill_cuda as pc
from m3c.backends.kernels import moe_prefill_ws as ws
from m3c.backends.triton_aot import jit_run

FP8_FLOPS = 1280e12
DEFAULT_LUT, DEFAULT_TBULK = ws.LUT, ws.TBULK  # as shipped (set_build changes them): a build string without them gets them


def set_build(b: str) -> None:
    """moe_prefill_ws's build knobs from "STAGES,RAW[,SKIP[,LUT[,TBULK]]]"."""
    v = [int(x) for x in b.split(",")]
    ws.STAGES, ws.RAW, ws.SKIP, lut, tbulk = (v + [0, int(DEFAULT_LUT), int(DEFAULT_TBULK)][len(v) - 2:])[:5]
    ws.LUT, ws.TBULK = bool(lut), bool(tbulk)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="+", default=[512, 4096, 16384])
    ap.add_argument("--builds", nargs="+", default=["3,3"], metavar="STAGES,RAW[,SKIP[,LUT[,TBULK]]]",
                    help="LUT 0 / 1 (default: as shipped); SKIP 1: no MMAs, 2: no decode, 3: neither (timing probes, "
                         "wrong results); TBULK 0 / 1: the tokens by cp.async / one bulk copy a stage (default: as shipped)")
    ap.add_argument("--once", action="store_true", help="two calls of the first build, nothing else (for ncu)")
    args = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    w13 = nvfp4_stack(2 * I, H, gen)
    c13, s13 = moe_cuda.packed_pair(w13)
    g13 = mp.nvfp4_row_scales(w13, (E, 2 * I), "w13")
    wexp = pc.fp8_exponent(w13)
    fc1, _, quant = pc.specs("fp8")
    rows = []
    for t in args.tokens:
        x = torch.randn(t, H, device="cuda", generator=gen).bfloat16()
        ids = torch.rand(t, E, device="cuda", generator=gen).topk(K, dim=1).indices
        order, offs = mp.checked_permutation(None, ids, E)
        p = t * K
        xq_n = torch.empty(t, H, dtype=torch.uint8, device="cuda")
        xq_p, xs = torch.empty_like(xq_n), torch.empty(t, device="cuda")
        jit_run(quant, (t,), [x, xq_n, xs, H, 0])
        jit_run(quant, (t,), [x, xq_p, xs, H, 1])
        xt = ws.token_image(xq_n, order, offs, K)
        act_ref = torch.full((p, I), float("nan"), dtype=torch.bfloat16, device="cuda")
        m_tiles = min(-(-p // pc.BT) + E, p)

        def run_ref(act=act_ref, a=(x, xq_p, xs, order, offs), grid=(m_tiles, 2 * I // (64 * pc.WGS)), t=t):
            jit_run(fc1, grid, [*a, c13, s13, g13, c13, s13, act, act, t, 0, H, I, 0, E, K, wexp])
        if args.once:
            set_build(args.builds[0])
            act = torch.empty((p, I), dtype=torch.bfloat16, device="cuda")
            for _ in range(2):
                ws.fc1(xq_n, xs, order, offs, c13, s13, g13, act, top_k=K, wexp=wexp, xt=xt)
            torch.cuda.synchronize()
            return
        run_ref()
        act_ref = act_ref.index_select(1, pc.fp8_k_order(I, "cuda"))  # its routed act columns in fp8 K order
        flops = 2 * p * H * 2 * I
        row = {"T": t, "fc1_flop_floor_ms": flops / FP8_FLOPS * 1e3,
               "register_a_ms": bench(run_ref), "register_a_graph_ms": bench_graph(run_ref),
               "token_image_ms": bench(lambda a=(xq_n, order, offs): ws.token_image(*a, K))}
        first = None
        for b in args.builds:
            set_build(b)
            name = f"ws_s{ws.STAGES}_r{ws.RAW}" + (f"_skip{ws.SKIP}" if ws.SKIP else "") + ("_lut" if ws.LUT else "")
            name += "_tbulk" if ws.TBULK else ""
            name += f"_run{sum(k.startswith(name) for k in row) + 1}" if name in row else ""
            act = torch.full((p, I), float("nan"), dtype=torch.bfloat16, device="cuda")

            def run_ws(act=act, a=(xq_n, xs, order, offs, c13, s13, g13), xt=xt):
                ws.fc1(*a, act, top_k=K, wexp=wexp, xt=xt)
            try:
                run_ws()
                torch.cuda.synchronize()
                d = (act.float() - act_ref.float())
                ms = bench(run_ws)
                row[name] = {
                    "ms": ms, "graph_ms": bench_graph(run_ws), "tflops": flops / ms / 1e9,
                    "nan": int(act.isnan().sum()), "rel_vs_register_a": float(d.norm() / act_ref.float().norm()),
                    "max_abs_diff": float(d.abs().max()), "speedup": row["register_a_ms"] / ms,
                    "equal_to_first_full_build": None}
                if not ws.SKIP:  # the copies' knobs change nothing but time: bitwise the first full build's act
                    first = act.clone() if first is None else first
                    row[name]["equal_to_first_full_build"] = bool(torch.equal(act, first))
            except Exception as e:  # reported, not fatal
                row[name] = {"error": str(e)[:400]}
            print(t, b, row[name], flush=True)
        print({k: v for k, v in row.items() if not k.startswith("ws_")}, flush=True)
        rows.append(row)
    write_results("moe_prefill_ws", rows, shape={"H": H, "I": I, "E": E, "top_k": K})


if __name__ == "__main__":
    main()
