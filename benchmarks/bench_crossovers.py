"""Which kernel to launch: MoE decode kernel vs grouped-GEMM (prefill) kernels by token count, and MSA
attention prefill vs decode kernel on a 4K-row chunk — the measurements behind the dispatch defaults of
``m3c.backends.kernels.megamoe.megamoe`` and ``msa_attention.msa_sparse_attention``.

m3.1-small shapes (64 experts of 6144×1536, top-8, MXFP8 shared expert; 16 heads / 1 KV head, d = 128,
block 128, top-16), bf16, CUDA-graph replay medians. The MSA chunk uses bench_msa.py's random caches
(independent random selections per row: the worst case for the prefill kernel's union of blocks).

Usage (H200): PYTHONPATH=. python benchmarks/bench_crossovers.py; prints one line per point.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from _timing import bench_graph
from bench_msa import BS, TOPK, D, make_batch

from m3c.backends.kernels.megamoe import megamoe
from m3c.backends.kernels.moe_prefill import moe_prefill
from m3c.backends.kernels.moe_routing import moe_route
from m3c.backends.kernels.msa_attention import msa_sparse_attention
from m3c.backends.kernels.msa_indexer import msa_indexer
from m3c.fused.moe import MegaMoE, random_moe


def graph_us(fn) -> float:
    """Median µs of fn replayed from a CUDA graph (NaN, printed, if it fails)."""
    return bench_graph(fn, rep=40) * 1e3


def moe_points(tokens: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)) -> None:
    """Decode kernel (one persistent launch) vs grouped-GEMM kernels, same routing and weights."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    moe = random_moe(6144, 1536, 64, 8, "mxfp8", gen, "cuda")
    w13, w2, s13, s2 = MegaMoE.from_reference(moe).weights()
    kw = dict(top_k=8, routed_scaling_factor=2.5, norm_topk_prob=True)
    for t in tokens:
        x = torch.randn(t, 6144, device="cuda", generator=gen).bfloat16()
        ids, w = moe_route(x, moe.gate.weight, moe.e_score_correction_bias, **kw)
        w = w.float()

        def decode(x=x):
            return megamoe(x, moe.gate.weight, moe.e_score_correction_bias, w13, w2, s13, s2, **kw,
                           decode_kernel=True)

        def default(x=x):  # the same routing launch, then the grouped-GEMM kernels
            return megamoe(x, moe.gate.weight, moe.e_score_correction_bias, w13, w2, s13, s2, **kw)

        def grouped_only(x=x, ids=ids, w=w):
            return moe_prefill(x, ids, w, w13, w2, s13, s2)

        diff = float((decode().float() - default().float()).abs().max())
        print(f"moe T={t}: routing + decode kernel {graph_us(decode):.1f} us, routing + grouped-GEMM kernels "
              f"{graph_us(default):.1f} us (grouped GEMMs alone {graph_us(grouped_only):.1f} us), max |diff| "
              f"{diff:.2e}", flush=True)


def msa_points(contexts: tuple[int, ...] = (131072, 1048576)) -> None:
    """A 4K-row chunk through the prefill kernel vs the decode kernel (one program per row)."""
    for ctx in contexts:
        b = make_batch(ctx, 1, 4096)
        _, sel = msa_indexer(b["iq"], b["ikd"], b["iks"], b["pos"], b["qsl"], b["seq"], b["table"], BS, TOPK)
        out = torch.empty_like(b["q"])
        for name, rows in (("prefill kernel", 0), ("decode kernel", 4096)):
            def run(rows=rows, b=b, sel=sel, out=out):
                return msa_sparse_attention(b["q"], b["kd"], b["ks"], b["vd"], b["vs"], sel, b["pos"], b["qsl"],
                                            b["seq"], b["table"], BS, D**-0.5, out=out, max_q_rows=rows)

            print(f"attention 4K rows at {ctx // 1024}K ({name}): {graph_us(run):.1f} us", flush=True)
        del b
        torch.cuda.empty_cache()


if __name__ == "__main__":
    moe_points()
    msa_points()
