"""Where the MegaMoE prefill's time goes, kernel by kernel (torch.profiler), at m3.1-small shapes: the wgmma path
(``moe_prefill_cuda``, bf16 and fp8 routed tiles) and the Triton grouped GEMM, with each GEMM kernel's TFLOP/s.
Also the target to run under ``ncu -k regex:moe_pf_fc1 --launch-count 1`` (``--once``: one call of the wgmma path,
no profiler; ``--precision`` picks its routed tiles).

Usage (H200): PYTHONPATH=. python benchmarks/profile_moe_prefill.py [--tokens 4096 16384] [--once]
    [--ws 25 27:1:1 27:0:0:3]   (WS bits[:PERSIST[:TMAJOR[:SKIP]]]; writes $OUT/moe_prefill_knobs.json)
"""

from __future__ import annotations

import argparse

import torch
from _timing import kernel_times, write_results
from bench_moe_prefill_variants import E, H, I, K, S, mxfp8_shared, nvfp4_stack

from m3c.backends.kernels import moe_prefill as mp
from m3c.backends.kernels import moe_prefill_cuda as pc
from m3c.backends.kernels import moe_prefill_ws as ws_mod


def set_ws(ws: int | str) -> None:
    """pc.WS_FC1, WS_FC2, WS_SHARED, WS_SHARED_FC2 from the --ws bits 1, 2, 8, 16; a string "WS[:P[:T[:S]]]" also
    sets moe_prefill_ws's PERSIST, TMAJOR and SKIP (the timing probes; missing ones as shipped)."""
    v = [int(x) for x in str(ws).split(":")]
    bits = v[0]
    pc.WS_FC1, pc.WS_FC2, pc.WS_SHARED, pc.WS_SHARED_FC2 = bool(bits & 1), bool(bits & 2), bool(bits & 8), bool(bits & 16)
    ws_mod.PERSIST, ws_mod.TMAJOR, ws_mod.SKIP = (bool(v[1]) if len(v) > 1 else SHIPPED[0],
                                                  bool(v[2]) if len(v) > 2 else SHIPPED[1], v[3] if len(v) > 3 else 0)


SHIPPED = (ws_mod.PERSIST, ws_mod.TMAJOR)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="+", default=[4096])
    ap.add_argument("--once", action="store_true", help="one warm call of the wgmma path (for ncu), nothing else")
    ap.add_argument("--precision", default="bf16", choices=pc.PRECISIONS, help="the wgmma routed tiles' (--once)")
    ap.add_argument("--ws", nargs="*", default=[], metavar="WS[:PERSIST[:TMAJOR[:SKIP]]]",
                    help="instead: the fp8 path's kernels at each WS = 1 * pc.WS_FC1 + 2 * pc.WS_FC2 + 8 * "
                         "pc.WS_SHARED + 16 * pc.WS_SHARED_FC2, with moe_prefill_ws's PERSIST, TMAJOR (0 / 1) and "
                         "SKIP (timing probes, wrong results)")
    args = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    w13, w2 = nvfp4_stack(2 * I, H, gen), nvfp4_stack(H, I, gen)
    sh13, sh2 = mxfp8_shared(gen)
    rows: list[dict] = []
    for t in args.tokens:
        x = torch.randn(t, H, device="cuda", generator=gen).bfloat16()
        ids = torch.rand(t, E, device="cuda", generator=gen).topk(K, dim=1).indices
        wts = torch.rand(t, K, device="cuda", generator=gen)
        a = (x, ids, wts, w13, w2, sh13, sh2)
        if args.once:  # (the first --tokens value; with --ws: the first value's knobs)
            if args.ws:
                set_ws(args.ws[0])
            for _ in range(2):
                pc.moe_prefill_wgmma(*a, precision=args.precision)
                torch.cuda.synchronize()
            return
        if args.ws:
            rows += knob_rows(t, a, args.ws)
            continue
        fc1_flop = 2 * t * K * H * 2 * I + 2 * t * H * 2 * S
        fc2_flop = 2 * t * K * I * H + 2 * t * S * H
        for name, fn in (("wgmma", lambda a=a: pc.moe_prefill_wgmma(*a, precision="bf16")),
                         ("wgmma fp8", lambda a=a: pc.moe_prefill_wgmma(*a, precision="fp8")),
                         ("triton", lambda a=a: mp.moe_prefill(*a))):
            print(f"T = {t}, {name}:")
            for k, us in kernel_times(fn, calls=10).items():
                flop = fc1_flop if "fc1" in k else fc2_flop if "fc2" in k else 0
                rate = f"  {flop / us / 1e6:7.1f} TFLOP/s" if flop else ""
                print(f"  {us:9.1f} us  {k[:70]}{rate}")
    if rows:
        write_results("moe_prefill_knobs", rows, shape={"H": H, "I": I, "E": E, "top_k": K, "S": S})


def knob_rows(t: int, a: tuple, configs: list[str]) -> list[dict]:
    """The fp8 path's kernel times (µs) at each --ws config, and each output's difference from the first full
    (SKIP 0) config's (the knobs should move work, not arithmetic: equal differences for builds that group K alike)."""
    rows, first = [], None
    for c in configs:
        set_ws(c)
        out = pc.moe_prefill_wgmma(*a, precision="fp8")
        torch.cuda.synchronize()
        rel = None
        if not ws_mod.SKIP:
            first = out.clone() if first is None else first
            rel = float((out.float() - first.float()).norm() / first.float().norm())
        kt = kernel_times(lambda: pc.moe_prefill_wgmma(*a, precision="fp8"), calls=5)
        rows.append({"T": t, "config": c, "total_us": sum(kt.values()), "rel_vs_first": rel, "kernels_us": kt})
        print(f"T={t} WS={c} total {sum(kt.values()):.1f} us rel {rel}: "
              + ", ".join(f"{k.split('(')[0][:24]} {v:.1f}" for k, v in kt.items() if v > 30), flush=True)
    ws_mod.SKIP = 0
    return rows


if __name__ == "__main__":
    main()
