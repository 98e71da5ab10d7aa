"""`from m3c.fused import FusedQKVNormRopeKVInsert` on a user's own tensors and caches equals the reference layer."""

from __future__ import annotations

import pytest
import torch

from m3c.errors import ShapeError
from m3c.fused import FusedQKVNormRopeKVInsert
from m3c.model_defs import quant
from m3c.model_defs.checkpoint import build_model
from m3c.model_defs.kv_cache import allocate_layer_cache
from m3c.model_defs.layers import apply_rope, rms_norm, rope_cos_sin
from m3c.model_defs.presets import get_preset


def _nvfp4(cache: dict[str, torch.Tensor], name: str) -> quant.NVFP4Tensor:
    return quant.NVFP4Tensor(cache[f"{name}_data"], cache[f"{name}_scale"], None)


@pytest.mark.parametrize("layer", [0, 2], ids=["sparse", "dense"])
def test_fused_module_equals_reference_layer(layer: int, rng: torch.Generator) -> None:
    cfg = get_preset("m3.1-tiny")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = build_model(cfg, seed=int(torch.randint(0, 2**31 - 1, (1,), generator=rng)), device=device)
    attn = model.layers[layer].self_attn
    mod = FusedQKVNormRopeKVInsert.from_attention(attn, dtype=torch.float32)
    t = 11
    x = torch.randn(t, cfg.hidden_size, generator=rng).to(device)
    pos = torch.randint(0, 4096, (t,), generator=rng).to(device)
    slots = torch.randperm(16 * cfg.msa_block_size, generator=rng)[:t].to(device)
    got_cache = allocate_layer_cache(cfg, layer, 16, device)
    want_cache = allocate_layer_cache(cfg, layer, 16, device)
    q, iq = mod(x, pos, slots, _nvfp4(got_cache, "k"), _nvfp4(got_cache, "v"),
                _nvfp4(got_cache, "index_k") if attn.sparse else None)
    # the reference layer's own ops
    cos, sin = rope_cos_sin(pos, cfg.rotary_dim, cfg.rope_theta, torch.float32)
    parts = torch.split(attn.qkv_proj(x), attn.split_sizes, dim=-1)
    d = cfg.head_dim
    want_q = apply_rope(rms_norm(parts[0].view(t, -1, d), attn.q_norm, cfg.rms_norm_eps), cos, sin)
    attn._write("k", apply_rope(rms_norm(parts[1].view(t, -1, d), attn.k_norm, cfg.rms_norm_eps), cos, sin), slots,
                want_cache)
    attn._write("v", parts[2].view(t, -1, d), slots, want_cache)
    torch.testing.assert_close(q, want_q, rtol=1e-5, atol=1e-5)
    if attn.sparse:
        want_iq = apply_rope(rms_norm(parts[3].view(t, -1, d), attn.index_q_norm, cfg.rms_norm_eps), cos, sin)
        torch.testing.assert_close(iq, want_iq, rtol=1e-5, atol=1e-5)
        attn._write("index_k", apply_rope(rms_norm(parts[4].view(t, 1, d), attn.index_k_norm, cfg.rms_norm_eps),
                                          cos, sin), slots, want_cache)
    else:
        assert iq is None
    for name, want in want_cache.items():
        same = got_cache[name].view(torch.uint8) == want.view(torch.uint8)
        assert int((~same).sum()) <= (0 if device == "cpu" else want.numel() // 200), name


def test_fused_module_refuses_bad_shapes() -> None:
    cfg = get_preset("m3.1-tiny")
    d, n = cfg.head_dim, (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * cfg.head_dim
    norm = torch.ones(d)
    with pytest.raises(ShapeError, match="weight has shape"):
        FusedQKVNormRopeKVInsert(cfg, torch.randn(n + 1, cfg.hidden_size), norm, norm)
    mod = FusedQKVNormRopeKVInsert(cfg, torch.randn(n, cfg.hidden_size), norm, norm)
    cache = allocate_layer_cache(cfg, 2, 4)
    with pytest.raises(ShapeError, match="x must be"):
        mod(torch.randn(3, cfg.hidden_size + 1), torch.arange(3), torch.arange(3), _nvfp4(cache, "k"),
            _nvfp4(cache, "v"))
