"""How precisely Hopper's FP8 wgmma accumulates: dense E4M3 GEMMs through ``torch._scaled_mm`` with and without
cuBLAS's fast accumulation (no promotion to float32 CUDA-core sums) against float64 on the same E4M3 values, for
K = 256 .. 6144; then the wgmma prefill's fp8 build against the float64 model of its own rounding
(``test_moe_prefill_cuda._fp8_model``) as K grows: if the gap grows with K like the fast-accumulation GEMM's, it is the
tensor core's accumulator, not the kernel's layout.

Usage (H200): PYTHONPATH=. python benchmarks/check_fp8_accumulation.py
"""
import sys

import torch

sys.path.insert(0, "tests/backends/kernels")
from test_moe_prefill import _problem, _to
from test_moe_prefill_cuda import _fp8_model

from m3c.backends.kernels import moe_prefill_cuda as pc

gen = torch.Generator(device="cuda").manual_seed(0)
one = torch.ones((), device="cuda")
print("dense E4M3 GEMM 2048 x 1024 x K, relative L2 error vs float64 of the same E4M3 values")
for k in (256, 1536, 6144):
    a = (torch.randn(2048, k, device="cuda", generator=gen) * 64).to(torch.float8_e4m3fn)
    b = (torch.randn(1024, k, device="cuda", generator=gen) * 64).to(torch.float8_e4m3fn)
    ref = a.double() @ b.double().t()
    row = []
    for fast in (False, True):
        got = torch._scaled_mm(a, b.t(), one, one, out_dtype=torch.float32, use_fast_accum=fast)
        row.append(float((got.double() - ref).norm() / ref.norm()))
    print(f"  K = {k:5d}: promoted {row[0]:.2e}   fast accumulation {row[1]:.2e}")

print("wgmma prefill fp8 build vs the float64 model of its rounding (no shared expert, T = 512, 8 experts, top 2)")
for wgs, promote in ((4, False), (2, False), (2, True)):
    pc.WGS, pc.PROMOTE = wgs, promote
    for h, inter in ((256, 256), (1024, 256), (6144, 256), (256, 1536)):
        rng = torch.Generator().manual_seed(1)
        x, ids, wts, w13, w2, sh13, sh2 = _problem(512, h, inter, 8, 2, 0, "nvfp4", None, rng)
        args = [_to(v, "cuda") for v in (x.bfloat16().float(), ids, wts, w13, w2, sh13, sh2)]
        out = pc.moe_prefill_wgmma(args[0].bfloat16(), *args[1:], precision="fp8")
        model = _fp8_model(*args)
        rel = float((out.double() - model).norm() / model.norm())
        print(f"  WGS {wgs} promote {promote!s:5}  H = {h:5d} (FC1's K), I = {inter:5d} (FC2's K): rel {rel:.2e}")
