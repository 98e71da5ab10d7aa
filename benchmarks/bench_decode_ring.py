"""Probe: does the MegaMoE decode's weight stream speed up when the weights land in shared memory by bulk copies from
a producer warp (a STAGES-deep ring) instead of each warp's two register buffers? (``probes/decode_ring.cu``; not
part of the compiler.)

Both kernels run the decode's own math (``moe_weight_stream.cuh``) over the same prepacked NVFP4 rows, T tokens
(``--tokens``), a 128-row block and one K split a CTA, so their outputs must be bitwise equal (checked);
``--decode 2`` swaps the math for an XOR of the loaded words (the loads alone). Random codes and E4M3 scales in
[2^-6, 2): the numbers do not matter, only the bytes moved. Each read starts with an L2 flush (``--flush``,
``--flush-mb``; its own time subtracted): by default a read of the flush buffer, since writing it (session 38's runs)
leaves dirty lines whose write-back lands inside the timed kernel (RESULTS.md session 39).

Prediction written before the first run (RESULTS.md session 38): the register kernel at ~26-28 GB/s an SM (the
decode's measured rate); the ring at 3 stages, 3 CTAs an SM, ~30 GB/s if its consumers' IPC stays ~0.6, 32+ (the
HBM share) if shared-memory operands lift it to >= 0.8.

Usage (H200): PYTHONPATH=. python benchmarks/bench_decode_ring.py [--experts 16] [--splits 2] [--stages 2 3 4]
    [--release 0 1] [--decode 0 2] [--tokens 1] [--same-tokens] [--soak SECONDS] [--flush read|zero|none]
    [--flush-mb 256]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from _timing import bench_graph, soak_clock, write_results

from m3c.backends import cuda_aot
from m3c.backends.cuda_aot import CudaKernelSpec, arg_types, cuda_jit_run

READ_BW = 4.28e12  # bytes/s (DESIGN.md)
SOURCE = str(Path(__file__).parent / "probes" / "decode_ring.cu")
ARGS = arg_types("*codes *scales *x16 *h rows K KS T")
STAGE_BYTES = 8 * (2048 + 256)


def spec(kernel: str, decode: int, stages: int, kc: int, early: bool = False, tokens: int = 1) -> CudaKernelSpec:
    """The probe kernel's build for T `tokens` (NT = 1 up to 8, else 2): 4 warps (regs) or 4 + a producer (bulk;
    `early`: RELEASE_EARLY); dynamic shared memory = the ring (bulk) and the token rows."""
    token = -(-(kc + 4) * 2 * tokens // 16) * 16
    ring = stages * STAGE_BYTES if kernel == "probe_bulk" else 0
    bulk = (("STAGES", stages), ("RELEASE_EARLY", int(early))) if kernel == "probe_bulk" else ()
    defines = (("DECODE", decode), ("NT", 1 if tokens <= 8 else 2), *bulk)
    return CudaKernelSpec("probe_decode_ring", SOURCE, kernel, ARGS, defines, 5 if kernel == "probe_bulk" else 4,
                          ring + token)


def resident(sp: CudaKernelSpec) -> int:
    """CTAs of the loaded kernel resident at once on an SM (the driver's occupancy query; -1 if it fails)."""
    k = cuda_aot._LOADED[sp.key()]
    try:
        err, n = k.cu.cuOccupancyMaxActiveBlocksPerMultiprocessor(k.func, k.threads, k.shared)
        return int(n) if int(err) == 0 else -1
    except Exception:  # (a cuda-python without the call: the table shows -1)
        return -1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--experts", type=int, default=16, help="experts' FC1 rows streamed (3,072 rows each)")
    ap.add_argument("--k", type=int, default=6144)
    ap.add_argument("--splits", type=int, default=2, help="K splits (a CTA each)")
    ap.add_argument("--stages", type=int, nargs="*", default=[2, 3, 4], help="probe_bulk's depths (none: regs only)")
    ap.add_argument("--tokens", type=int, default=1, help="T (1..16): the decode's math for T tokens")
    ap.add_argument("--same-tokens", action="store_true", help="every token row a copy of the first")
    ap.add_argument("--soak", type=float, default=0.0,
                    help="then replay each build this many seconds: its median SM clock and power (nvidia-smi)")
    ap.add_argument("--decode", type=int, nargs="+", default=[0, 2])
    ap.add_argument("--release", type=int, nargs="+", default=[0, 1], help="probe_bulk's RELEASE_EARLY settings")
    ap.add_argument("--flush-mb", type=int, default=256)
    ap.add_argument("--flush", choices=["zero", "read", "none"], default="read",
                    help="zero: write the flush buffer (its dirty lines are written back during the kernel, so its "
                         "time is overstated); read: sum it (clean lines); none: no flush (the rows exceed L2)")
    args = ap.parse_args()
    rows, k, ks = args.experts * 3072, args.k, args.splits
    kc = k // ks
    gen = torch.Generator(device="cuda").manual_seed(0)
    codes = torch.randint(0, 256, (rows * k // 2,), dtype=torch.uint8, device="cuda", generator=gen)
    scales = torch.randint(0x08, 0x40, (rows * k // 16,), dtype=torch.uint8, device="cuda", generator=gen)
    if not 1 <= args.tokens <= 16:
        raise SystemExit(f"--tokens {args.tokens}: the probe takes 1..16 (NT = 1 or 2)")
    x16 = torch.randn(args.tokens, k, device="cuda", generator=gen).half()
    if args.same_tokens:
        x16[1:] = x16[0]
    nbytes = codes.numel() + scales.numel()
    flush = torch.empty(args.flush_mb << 18, dtype=torch.int32, device="cuda")
    flush_fn = {"zero": flush.zero_, "read": flush.sum, "none": lambda: None}[args.flush]
    flush_ms = bench_graph(flush_fn) if args.flush != "none" else 0.0
    grid = (rows // 128 * ks,)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"{rows} rows x K {k}, {ks} splits: {nbytes / 1e6:.1f} MB, floor {nbytes / READ_BW * 1e6:.1f} us; "
          f"{grid[0]} CTAs, {args.tokens} tokens; L2 flush ({args.flush}) {flush_ms * 1e3:.1f} us alone (subtracted)")
    out_rows = []
    for decode in args.decode:
        ref = None
        builds = [("probe_regs", 0, 0), *(("probe_bulk", s, e) for s in args.stages for e in args.release)]
        for kernel, stages, early in builds:
            sp = spec(kernel, decode, stages, kc, bool(early), args.tokens)
            h = torch.full((ks, rows), float("nan"), device="cuda")
            argv = [codes, scales, x16, h, rows, k, ks, args.tokens]
            run = lambda sp=sp, argv=argv: cuda_jit_run(sp, grid, argv)  # noqa: E731
            run()
            torch.cuda.synchronize()
            if ref is None:
                ref = h.clone()
            same = bool(torch.equal(h, ref)) and not bool(h.isnan().any())
            us = (bench_graph(lambda run=run: (flush_fn(), run())) - flush_ms) * 1e3
            gbps = nbytes / us / 1e3
            row = {"kernel": kernel, "tokens": args.tokens, "decode": decode, "stages": stages, "release_early": early,
                   "us": us,
                   "gb_s": gbps,
                   "pct_floor": 100 * nbytes / READ_BW / (us * 1e-6), "gb_s_per_sm": gbps / sms,
                   "bitwise_regs": same, "smem": sp.shared_bytes, "ctas_per_sm": resident(sp)}
            clock = ""
            if args.soak > 0:
                row["sm_mhz"], row["watts"] = soak_clock(run, args.soak)
                clock = f", {row['sm_mhz']:.0f} MHz {row['watts']:.0f} W"
            out_rows.append(row)
            print(f"  decode {decode} {kernel:10s} stages {stages} early {early}: {us:7.1f} us  {gbps:7.1f} GB/s "
                  f"({row['pct_floor']:5.1f}% of 4.28 TB/s, {gbps / sms:5.1f} an SM, {row['ctas_per_sm']} CTAs an SM)  "
                  f"bitwise = regs: {same}{clock}",
                  flush=True)
    write_results("decode_ring", out_rows, weight_rows=rows, tokens=args.tokens,
                  same_tokens=args.same_tokens, k=k, splits=ks, mb=nbytes / 1e6,
                  flush_mb=args.flush_mb,
                  flush=args.flush)


if __name__ == "__main__":
    main()
