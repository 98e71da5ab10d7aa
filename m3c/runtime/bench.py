"""Timing of generation: one warm-up run, then a timed prefill + greedy decode on a fresh cache.

Used by `m3c bench` and benchmarks/bench_e2e.py, for a compiled program (Executor) or the reference model.
"""

from __future__ import annotations

from typing import Any

import torch

from m3c.model_defs.config import M3Config
from m3c.model_defs.generate import greedy_generate, make_cache


def timed_generation(step: Any, cfg: M3Config, prompts: list[list[int]], steps: int, device: str,
                     warmup_steps: int = 2) -> dict[str, Any]:
    """Prefill seconds and tokens/s, decode ms/step (steady: the steps after the first) and tokens/s, the first
    decode step's ms apart, and the generated tokens."""
    if warmup_steps:
        greedy_generate(step, make_cache(cfg, len(prompts[0]) + warmup_steps + 1, len(prompts), device), prompts,
                        warmup_steps)
    r = greedy_generate(step, make_cache(cfg, len(prompts[0]) + steps + 1, len(prompts), device), prompts, steps)
    n = len(prompts)
    # The first decode step on a fresh cache may capture a CUDA graph (or warm caches): report it apart and
    # average the steady steps after it (all steps when there is only one).
    steady = r.step_times_s[1:] or r.step_times_s
    per_step = sum(steady) / max(len(steady), 1)
    return {"prefill_s": r.prefill_s, "prefill_tok_s": n * len(prompts[0]) / r.prefill_s,
            "decode_ms_per_step": 1e3 * per_step, "decode_first_step_ms": 1e3 * (r.step_times_s or [0.0])[0],
            "decode_tok_s": n / max(per_step, 1e-9), "tokens": r.tokens}


def random_prompts(cfg: M3Config, batch: int, tokens: int, seed: int = 1) -> list[list[int]]:
    """`batch` random prompts of `tokens` tokens (seeded)."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, cfg.vocab_size, (tokens,), generator=gen).tolist() for _ in range(batch)]
