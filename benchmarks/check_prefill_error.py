"""Element-wise error of the MegaMoE prefill paths against the float64 reference at m3.1-small shapes (T = 2048,
uniform random routing): the wgmma kernels (``moe_prefill_cuda``) and the Triton grouped GEMM, each against the
reference (relative L2, worst token, elements beyond 2 / 8 bf16 ulps), and against each other.

Usage (H200): PYTHONPATH=. python benchmarks/check_prefill_error.py
"""
import sys

import torch

sys.path.insert(0, "benchmarks")
sys.path.insert(0, "tests/backends/kernels")
from bench_moe_prefill_variants import E, H, I, K, mxfp8_shared, nvfp4_stack
from test_moe_prefill import _reference

from m3c.backends.kernels import moe_prefill as mp
from m3c.backends.kernels import moe_prefill_cuda as pc

gen = torch.Generator(device="cuda").manual_seed(1)
w13, w2 = nvfp4_stack(2 * I, H, gen), nvfp4_stack(H, I, gen)
sh13, sh2 = mxfp8_shared(gen)
t = 2048
x = torch.randn(t, H, device="cuda", generator=gen).bfloat16()
ids = torch.rand(t, E, device="cuda", generator=gen).topk(K, dim=1).indices
wts = torch.rand(t, K, device="cuda", generator=gen)
ref = _reference(x.float(), ids, wts, w13, w2, sh13, sh2, "nvfp4", "mxfp8", dtype=torch.float64)
outs = {"wgmma": pc.moe_prefill_wgmma(x, ids, wts, w13, w2, sh13, sh2), "triton": mp.moe_prefill(x, ids, wts, w13, w2, sh13, sh2)}
for name, out in outs.items():
    d = out.double() - ref
    tok = d.norm(dim=1) / ref.norm(dim=1)
    ulp = (d.abs() / (ref.abs() * 2.0**-8 + 1e-30)).flatten()
    print(f"{name}: rel {float(d.norm() / ref.norm()):.3e}  worst token rel {float(tok.max()):.3e}  "
          f"max |d|/max|ref| {float(d.abs().max() / ref.abs().max()):.3e}  elems > 2 bf16 ulps {int((ulp > 2).sum())} "
          f"> 8 ulps {int((ulp > 8).sum())} of {ulp.numel()}")
d = outs["wgmma"].double() - outs["triton"].double()
print(f"wgmma vs triton: rel {float(d.norm() / outs['triton'].double().norm()):.3e}")
