"""The reference run: build a model, prefill random prompts, decode greedily, report tokens and timing.

This is what `m3c run --preset ...` does today on the reference path (the plain PyTorch model).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from m3c.errors import ShapeError
from m3c.model_defs.checkpoint import build_model, load_checkpoint
from m3c.model_defs.config import M3Config
from m3c.model_defs.generate import GenerationResult, greedy_generate, make_cache
from m3c.model_defs.kv_cache import indexer_bytes_per_token, kv_bytes_per_token
from m3c.model_defs.presets import get_preset


@dataclass
class RunReport:
    """What one run produced and how long it took."""

    cfg: M3Config
    device: str
    prompt_tokens: int
    batch: int
    result: GenerationResult

    def text(self) -> str:
        """A short human-readable report."""
        r, cfg = self.result, self.cfg
        kv, idx = kv_bytes_per_token(cfg), indexer_bytes_per_token(cfg)
        lines = [
            f"model     {cfg.name}: {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, "
            f"{cfg.n_routed_experts} experts (top-{cfg.num_experts_per_tok}), KV {cfg.quant.kv_cache_dtype}, "
            f"indexer KV {cfg.quant.indexer_kv_dtype}, path: reference on {self.device}",
            f"KV cache  {kv:,} B/token K/V + {idx:,} B/token index keys = {kv + idx:,} B/token",
        ]
        for i, toks in enumerate(r.tokens):
            lines.append(f"tokens[{i}] {toks}")
        steps = max(r.decode_steps, 1)
        lines.append(
            f"timing    prefill {self.batch}×{self.prompt_tokens} tokens: {r.prefill_s * 1e3:.1f} ms "
            f"({self.batch * self.prompt_tokens / max(r.prefill_s, 1e-9):,.0f} tok/s); decode {r.decode_steps} "
            f"steps: {r.decode_s / steps * 1e3:.2f} ms/step ({self.batch * r.decode_steps / max(r.decode_s, 1e-9):,.1f} tok/s)"
        )
        return "\n".join(lines)


def resolve_device(device: str) -> str:
    """'auto' -> 'cuda' when a GPU is present, else 'cpu'."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ShapeError(f"--device {device}: no CUDA device is visible; use --device cpu")
    return device


def run_reference(preset: str | M3Config | None = "m3.1-tiny", checkpoint: str | None = None, prompt_tokens: int = 40,
                  decode_steps: int = 16, batch: int = 1, prefill_chunk: int | None = None,
                  kv_cache_dtype: str | None = None, seed: int = 0, device: str = "auto",
                  dtype: str = "float32") -> RunReport:
    """Build the model (a preset name or a config, random weights from `seed`; or a checkpoint) in `dtype`
    (float32 or bfloat16), prefill `batch` random prompts and decode greedily on the reference path."""
    if prompt_tokens < 1 or decode_steps < 0 or batch < 1:
        raise ShapeError("--prompt-tokens and --batch must be >= 1 and --decode-steps >= 0")
    dev = resolve_device(device)
    if checkpoint:
        cfg, tensors = load_checkpoint(checkpoint)
    else:
        cfg = preset if isinstance(preset, M3Config) else get_preset(preset or "m3.1-tiny")
        tensors = None
    if kv_cache_dtype:
        cfg = cfg.replace(kv_cache_dtype=kv_cache_dtype)
    model = build_model(cfg, tensors, seed=seed, device=dev, dtype=dtype)  # (a dtype name is checked there)
    gen = torch.Generator().manual_seed(seed + 1)
    prompts = [torch.randint(0, cfg.vocab_size, (prompt_tokens,), generator=gen).tolist() for _ in range(batch)]
    cache = make_cache(cfg, prompt_tokens + decode_steps + 1, batch, device=dev)
    result = greedy_generate(model, cache, prompts, decode_steps, prefill_chunk)
    return RunReport(cfg, dev, prompt_tokens, batch, result)
