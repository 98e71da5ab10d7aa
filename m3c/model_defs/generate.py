"""Greedy generation over the paged cache: the reference serving loop (prefill, then decode steps).

Any callable with the model's `forward` signature works as the step function, so the same loop
drives the reference model, a compiled graph and (later) a GPU executor.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from m3c.model_defs.config import M3Config
from m3c.model_defs.kv_cache import PagedKVCache

StepFn = Callable[..., torch.Tensor]


@dataclass
class GenerationResult:
    """Generated tokens per request and the time spent in prefill and decode."""

    tokens: list[list[int]]
    prefill_s: float = 0.0
    decode_s: float = 0.0
    decode_steps: int = 0
    step_times_s: list[float] = field(default_factory=list)


def make_cache(cfg: M3Config, max_tokens_per_seq: int, num_seqs: int = 1,
               device: torch.device | str = "cpu") -> PagedKVCache:
    """A paged cache big enough for `num_seqs` requests of `max_tokens_per_seq` tokens."""
    max_blocks = -(-max_tokens_per_seq // cfg.msa_block_size)
    return PagedKVCache(cfg, num_blocks=max_blocks * num_seqs, max_blocks_per_seq=max_blocks, device=device)


@torch.no_grad()
def greedy_generate(step: StepFn, cache: PagedKVCache, prompts: list[list[int]], decode_steps: int,
                    prefill_chunk: int | None = None) -> GenerationResult:
    """Prefill every prompt (in chunks of `prefill_chunk` tokens if given), then `decode_steps` greedy steps.

    `step(input_ids, positions, slot_mapping, block_table, query_start_loc, seq_lens, kv_caches)`
    returns logits [T, vocab]. Requests get ids 0..len(prompts)-1 in `cache`.
    """
    device = cache.device
    for r in range(len(prompts)):
        cache.add_request(r)
    result = GenerationResult(tokens=[[] for _ in prompts])

    def run(new: dict[int, list[int]]) -> dict[int, int]:
        meta = cache.prepare({r: len(t) for r, t in new.items()})
        ids = torch.tensor([tok for t in new.values() for tok in t], dtype=torch.int64, device=device)
        logits = step(ids, meta.positions, meta.slot_mapping, meta.block_table, meta.query_start_loc,
                      meta.seq_lens, cache.layers)
        last = meta.query_start_loc[1:].long() - 1
        return dict(zip(new, logits[last].argmax(-1).tolist()))

    t0 = time.perf_counter()
    chunk = prefill_chunk or max(len(p) for p in prompts)
    pending = {r: list(p) for r, p in enumerate(prompts)}
    nxt: dict[int, int] = {}
    while pending:
        out = run({r: p[:chunk] for r, p in pending.items()})
        pending = {r: p[chunk:] for r, p in pending.items() if len(p) > chunk}
        nxt.update({r: tok for r, tok in out.items() if r not in pending})
    _sync(device)
    result.prefill_s = time.perf_counter() - t0
    for r, tok in nxt.items():
        result.tokens[r].append(tok)
    for _ in range(decode_steps):
        t = time.perf_counter()
        nxt = run({r: [result.tokens[r][-1]] for r in range(len(prompts))})
        _sync(device)
        result.step_times_s.append(time.perf_counter() - t)
        for r, tok in nxt.items():
            result.tokens[r].append(tok)
    result.decode_steps = decode_steps
    result.decode_s = sum(result.step_times_s)
    return result


def _sync(device: torch.device | str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
