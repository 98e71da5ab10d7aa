"""Run one hot kernel family at one m3.1-small point, for Nsight Compute (``ncu``) to profile.

Targets: ``moe1`` (MegaMoE T = 1: routing + grouped GEMMs), ``moe16`` (T = 16), ``indexer1m`` / ``indexer1m8`` (MSA
indexer decode, 1M tokens, batch 1 / 8), ``attn1m`` (MSA sparse-attention decode at 1M). Each target runs its call
3 times (warm-up and JIT compiles first), then synchronizes; profile the last launch with e.g.
``ncu --kernel-name regex:moe_prefill_fc1 --launch-skip 2 --launch-count 1 --set full``.

Usage (H200): PYTHONPATH=. python benchmarks/profile_targets.py moe1 [--trace] [--knob PTXAS_OPT=1 ...]

``--knob NAME=INT`` sets a ``moe_cuda`` knob first (as ``bench_moe_ab.py --knob``), to profile another decode build.

``--trace`` runs the target under torch.profiler instead (no ncu) and prints every GPU kernel's mean
device time over the timed calls, plus the sum: it shows which launches a step is made of and how long
each one runs, apart from the launch gaps between them.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from _timing import kernel_times
from bench_moe_ab import set_knobs
from bench_msa import BS, TOPK, D, make_batch

from m3c.backends.kernels.megamoe import megamoe
from m3c.backends.kernels.msa_attention import msa_sparse_attention
from m3c.backends.kernels.msa_indexer import msa_indexer
from m3c.fused.moe import MegaMoE, random_moe


def moe(t: int) -> Callable[[], None]:
    """MegaMoE at t tokens (weights and inputs made once): one call = routing + grouped GEMMs."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    m = random_moe(6144, 1536, 64, 8, "mxfp8", gen, "cuda")
    w13, w2, s13, s2 = MegaMoE.from_reference(m).weights()
    x = torch.randn(t, 6144, device="cuda", generator=gen).bfloat16()
    return lambda: megamoe(x, m.gate.weight, m.e_score_correction_bias, w13, w2, s13, s2, top_k=8,
                           routed_scaling_factor=2.5, norm_topk_prob=True)


def msa(part: str, batch: int = 1) -> Callable[[], None]:
    """MSA decode at 1M tokens (caches made once): the indexer, plus the attention for "attn"."""
    b = make_batch(1 << 20, batch, 1)
    scores = torch.empty((batch, 1, (1 << 20) // BS), dtype=torch.float32, device="cuda")
    sel = torch.empty((batch, 1, TOPK), dtype=torch.int64, device="cuda")

    def call() -> None:
        msa_indexer(b["iq"], b["ikd"], b["iks"], b["pos"], b["qsl"], b["seq"], b["table"], BS, TOPK,
                    scores_out=scores, selected_out=sel)
        if part == "attn":
            msa_sparse_attention(b["q"], b["kd"], b["ks"], b["vd"], b["vs"], sel, b["pos"], b["qsl"], b["seq"],
                                 b["table"], BS, D**-0.5)
    return call


TARGETS = {"moe1": lambda: moe(1), "moe16": lambda: moe(16), "indexer1m": lambda: msa("indexer"),
           "indexer1m8": lambda: msa("indexer", 8),
           "attn1m": lambda: msa("attn")}


def trace(which: str, calls: int = 20) -> None:
    """Print each GPU kernel's mean device time per call of the target."""
    times = kernel_times(TARGETS[which](), calls)
    print(f"{which}: per call, mean over {calls} calls (µs of device time)")
    for name, us in times.items():
        print(f"  {us:9.2f}  {name[:100]}")
    print(f"  {sum(times.values()):9.2f}  total")


if __name__ == "__main__":
    which = sys.argv[1]
    set_knobs([sys.argv[i + 1] for i, a in enumerate(sys.argv[:-1]) if a == "--knob"])
    if "--trace" in sys.argv:
        trace(which)
    else:
        call = TARGETS[which]()
        for _ in range(3):
            call()
        torch.cuda.synchronize()
    print("done", which)
