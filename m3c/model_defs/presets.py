"""Named model presets: the full M3.1-Flash (meta tensors only), a one-GPU TP4 slice, and a CPU-sized toy.

Values marked *derived* are our arithmetic from the published figures in shared/M31_FACTS.md (or a
working guess); the real checkpoint's config.json may differ and always wins.
"""

from __future__ import annotations

from m3c.errors import ConfigError
from m3c.model_defs.config import M3Config, QuantScheme


def m31_flash() -> M3Config:
    """MiniMax-M3.1-Flash as published; for tracing and planning on meta tensors."""
    return M3Config(
        name="m3.1-flash",
        num_hidden_layers=60,  # derived: 34,560 B/token / 576 B per layer of NVFP4 K/V
        hidden_size=6144,  # derived: ~36 KB of TP all-reduce traffic per token per layer
        vocab_size=200064,  # working guess (the MiniMax-M2 tokenizer)
        num_attention_heads=64,  # working guess: 16 query heads per GQA group
        num_key_value_heads=4,  # published
        head_dim=128,  # published
        index_n_heads=4,  # published: one index query per GQA group
        index_head_dim=128,  # published
        msa_block_size=128,  # published
        msa_topk_blocks=16,  # published
        sparse_layers=tuple(range(60)),  # working guess: every layer sparse
        rope_theta=5_000_000.0,  # working guess
        rotary_dim=64,  # working guess: partial RoPE on half the head
        rms_norm_eps=1e-6,
        n_routed_experts=256,  # derived from the checkpoint sizes
        num_experts_per_tok=8,  # derived
        moe_intermediate_size=1536,  # derived
        n_shared_experts=1,  # derived
        routed_scaling_factor=2.5,  # working guess
        quant=QuantScheme("nvfp4", "nvfp4", "nvfp4", "mxfp8"),
    )


def m31_small() -> M3Config:
    """One GPU's TP4 slice of M3.1 (16 q heads, 1 KV head, 64 experts) with few layers: fits one H200."""
    full = m31_flash()
    return full.replace(
        name="m3.1-small",
        num_hidden_layers=2,
        num_attention_heads=16,
        num_key_value_heads=1,
        index_n_heads=1,
        sparse_layers=(0, 1),
        n_routed_experts=64,
    )


def m31_tiny() -> M3Config:
    """Seconds on a CPU: small widths, 8-token KV blocks and top-2 so tests reach the sparse path."""
    return M3Config(
        name="m3.1-tiny",
        num_hidden_layers=3,
        hidden_size=128,
        vocab_size=512,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,  # rotary halves of 16 keep every NVFP4 block of 16 inside one RoPE half
        index_n_heads=2,
        index_head_dim=64,
        msa_block_size=8,
        msa_topk_blocks=2,
        sparse_layers=(0, 1),  # layer 2 stays dense so both attention paths are exercised
        rope_theta=10_000.0,
        rotary_dim=32,
        rms_norm_eps=1e-6,
        n_routed_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        n_shared_experts=1,
        routed_scaling_factor=2.5,
        quant=QuantScheme("nvfp4", "nvfp4", "nvfp4", "mxfp8"),
    )


PRESETS = {"m3.1-flash": m31_flash, "m3.1-small": m31_small, "m3.1-tiny": m31_tiny}


def get_preset(name: str) -> M3Config:
    """The preset called `name`; an unknown name raises ConfigError listing the known ones."""
    try:
        return PRESETS[name]()
    except KeyError:
        raise ConfigError(f"unknown preset {name!r}; known presets: {', '.join(PRESETS)}") from None
