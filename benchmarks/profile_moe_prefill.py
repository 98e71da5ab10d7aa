"""Where the MegaMoE prefill's time goes, kernel by kernel (torch.profiler), at m3.1-small shapes: the wgmma path
(``moe_prefill_cuda``, bf16 and fp8 routed tiles) and the Triton grouped GEMM, with each GEMM kernel's TFLOP/s.
Also the target to run under ``ncu -k regex:moe_pf_fc1 --launch-count 1`` (``--once``: one call of the wgmma path,
no profiler; ``--precision`` picks its routed tiles).

Usage (H200): PYTHONPATH=. python benchmarks/profile_moe_prefill.py [--tokens 4096] [--once] [--ws 0 1 2 3]
"""

from __future__ import annotations

import argparse

import torch
from _timing import kernel_times
from bench_moe_prefill_variants import E, H, I, K, S, mxfp8_shared, nvfp4_stack

from m3c.backends.kernels import moe_prefill as mp
from m3c.backends.kernels import moe_prefill_cuda as pc


def set_ws(ws: int) -> None:
    """pc.WS_FC1, WS_FC2, WS_SHARED, WS_SHARED_FC2 from the --ws bits 1, 2, 8, 16."""
    pc.WS_FC1, pc.WS_FC2, pc.WS_SHARED, pc.WS_SHARED_FC2 = bool(ws & 1), bool(ws & 2), bool(ws & 8), bool(ws & 16)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--once", action="store_true", help="one warm call of the wgmma path (for ncu), nothing else")
    ap.add_argument("--precision", default="bf16", choices=pc.PRECISIONS, help="the wgmma routed tiles' (--once)")
    ap.add_argument("--ws", type=int, nargs="*", default=[], metavar="WS",
                    help="instead: the fp8 path's kernels at each WS = 1 * pc.WS_FC1 + 2 * pc.WS_FC2 + 8 * "
                         "pc.WS_SHARED + 16 * pc.WS_SHARED_FC2")
    args = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    w13, w2 = nvfp4_stack(2 * I, H, gen), nvfp4_stack(H, I, gen)
    sh13, sh2 = mxfp8_shared(gen)
    t = args.tokens
    x = torch.randn(t, H, device="cuda", generator=gen).bfloat16()
    ids = torch.rand(t, E, device="cuda", generator=gen).topk(K, dim=1).indices
    wts = torch.rand(t, K, device="cuda", generator=gen)
    a = (x, ids, wts, w13, w2, sh13, sh2)
    if args.once:  # (with --ws: the first value's knobs)
        if args.ws:
            set_ws(args.ws[0])
        pc.moe_prefill_wgmma(*a, precision=args.precision)
        torch.cuda.synchronize()
        pc.moe_prefill_wgmma(*a, precision=args.precision)
        torch.cuda.synchronize()
        return
    if args.ws:
        for ws in args.ws:
            set_ws(ws)
            kt = kernel_times(lambda: pc.moe_prefill_wgmma(*a, precision="fp8"), calls=5)
            print(f"T={t} WS={ws} total {sum(kt.values()):.1f} us: " + ", ".join(f"{k[:24]} {v:.1f}" for k, v in kt.items()))
        return
    fc1_flop = 2 * t * K * H * 2 * I + 2 * t * H * 2 * S
    fc2_flop = 2 * t * K * I * H + 2 * t * S * H
    for name, fn in (("wgmma", lambda: pc.moe_prefill_wgmma(*a, precision="bf16")),
                     ("wgmma fp8", lambda: pc.moe_prefill_wgmma(*a, precision="fp8")),
                     ("triton", lambda: mp.moe_prefill(*a))):
        print(f"T = {t}, {name}:")
        for k, us in kernel_times(fn, calls=10).items():
            flop = fc1_flop if "fc1" in k else fc2_flop if "fc2" in k else 0
            rate = f"  {flop / us / 1e6:7.1f} TFLOP/s" if flop else ""
            print(f"  {us:9.1f} us  {k[:70]}{rate}")


if __name__ == "__main__":
    main()
