"""Run one hot kernel family at one m3.1-small point, for Nsight Compute (``ncu``) to profile.

Targets: ``moe1`` (MegaMoE T = 1: routing + grouped GEMMs), ``moe16`` (T = 16), ``indexer1m`` (MSA indexer
decode, 1M tokens, batch 1), ``attn1m`` (MSA sparse-attention decode at 1M). Each target runs its call
3 times (warm-up and JIT compiles first), then synchronizes; profile the last launch with e.g.
``ncu --kernel-name regex:moe_prefill_fc1 --launch-skip 2 --launch-count 1 --set full``.

Usage (H200): PYTHONPATH=. python benchmarks/profile_targets.py moe1 [--trace]

``--trace`` runs the target under torch.profiler instead (no ncu) and prints every GPU kernel's mean
device time over the timed calls, plus the sum: it shows which launches a step is made of and how long
each one runs, apart from the launch gaps between them.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_msa import BS, TOPK, D, make_batch

from m3c.backends.kernels.megamoe import megamoe
from m3c.backends.kernels.msa_attention import msa_sparse_attention
from m3c.backends.kernels.msa_indexer import msa_indexer
from m3c.fused.moe import MegaMoE, random_moe


def moe(t: int, calls: int = 3) -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    m = random_moe(6144, 1536, 64, 8, "mxfp8", gen, "cuda")
    w13, w2, s13, s2 = MegaMoE.from_reference(m).weights()
    x = torch.randn(t, 6144, device="cuda", generator=gen).bfloat16()
    for _ in range(calls):
        megamoe(x, m.gate.weight, m.e_score_correction_bias, w13, w2, s13, s2, top_k=8, routed_scaling_factor=2.5,
                norm_topk_prob=True)


def msa(part: str, calls: int = 3) -> None:
    b = make_batch(1 << 20, 1, 1)
    scores = torch.empty((1, 1, (1 << 20) // BS), dtype=torch.float32, device="cuda")
    sel = torch.empty((1, 1, TOPK), dtype=torch.int64, device="cuda")
    for _ in range(calls):
        msa_indexer(b["iq"], b["ikd"], b["iks"], b["pos"], b["qsl"], b["seq"], b["table"], BS, TOPK,
                    scores_out=scores, selected_out=sel)
        if part == "attn":
            msa_sparse_attention(b["q"], b["kd"], b["ks"], b["vd"], b["vs"], sel, b["pos"], b["qsl"], b["seq"],
                                 b["table"], BS, D**-0.5)


TARGETS = {"moe1": lambda n: moe(1, n), "moe16": lambda n: moe(16, n), "indexer1m": lambda n: msa("indexer", n),
           "attn1m": lambda n: msa("attn", n)}


def trace(which: str, calls: int = 20) -> None:
    """Print each GPU kernel's mean device time per call of the target (after a warm-up run)."""
    from torch.profiler import ProfilerActivity, profile

    TARGETS[which](3)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        TARGETS[which](calls)
        torch.cuda.synchronize()
    rows = [(e.key, e.device_time_total / calls, e.count / calls) for e in prof.key_averages()
            if e.device_time_total > 0]
    rows.sort(key=lambda r: -r[1])
    print(f"{which}: per call, mean over {calls} calls (µs of device time)")
    for name, us, n in rows:
        print(f"  {us:9.2f}  x{n:4.1f}  {name[:100]}")
    print(f"  {sum(r[1] for r in rows):9.2f}  total")


if __name__ == "__main__":
    which = sys.argv[1]
    if "--trace" in sys.argv:
        trace(which)
    else:
        TARGETS[which](3)
        torch.cuda.synchronize()
    print("done", which)
