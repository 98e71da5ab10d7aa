"""A small run of the wide MegaMoE decode build (17..64 tokens) for Compute Sanitizer: one hot expert picked by 33 of
40 tokens (three column groups in its routed CTAs), the shared expert's CTAs a column group each; checks the output
against the reference and prints the error.

Usage (H200): PYTHONPATH=. compute-sanitizer --tool memcheck python benchmarks/check_moe_wide.py [T] [HOT]
"""

from __future__ import annotations

import sys

import torch

from m3c.backends.kernels import moe_cuda
from m3c.fused.moe import MegaMoE, hot_routing, random_moe


def main() -> None:
    """Run one call and print its error against the float32 reference."""
    t = int(sys.argv[1]) if len(sys.argv) > 1 else 40
    hot = int(sys.argv[2]) if len(sys.argv) > 2 else 33
    gen = torch.Generator(device="cuda").manual_seed(1)
    moe = random_moe(1024, 256, 16, 4, "mxfp8", gen, device="cuda")
    mm = MegaMoE.from_reference(moe)
    x = torch.randn(t, 1024, generator=gen, device="cuda").to(torch.bfloat16)
    ids, w = hot_routing(t, 16, 4, hot, torch.Generator().manual_seed(2), "cuda")
    moe.route = lambda _x: (ids, w)
    w13, w2, s13, s2 = mm.weights()
    out = torch.full_like(x, float("nan"))
    moe_cuda.moe_decode_mma(x, ids, w, w13, w2, s13, s2, out=out)
    truth = moe(x.float())
    print("T", t, "hot", hot, "finite", bool(torch.isfinite(out).all()),
          "err", float((out.float() - truth).norm() / truth.norm()))


if __name__ == "__main__":
    main()
