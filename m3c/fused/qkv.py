"""`FusedQKVNormRopeKVInsert`: the fused attention front of one layer as an nn.Module for users' scripts.

Built from the projection weight + norms (or straight from a reference layer), called on the
user's own activations, positions, slots and paged NVFP4 caches. On a GPU it runs the Triton kernel
(one launch); on the CPU it runs the op's reference (the composition it replaces).
"""

from __future__ import annotations

import torch
from torch import nn

from m3c.backends.kernels.qkv_fused_launch import QKVShape, launch_fused, prepack_weight
from m3c.errors import ShapeError
from m3c.ir.ops.fused import qkv_norm_rope_kvinsert
from m3c.model_defs import quant
from m3c.model_defs.config import M3Config
from m3c.model_defs.layers import rope_cos_sin


class FusedQKVNormRopeKVInsert(nn.Module):
    """q (, index-q) = fused(x); K, V (, index-K) quantized to NVFP4 and written into the paged caches.

    `weight` is the concatenated projection [N, hidden] (rows q, k, v, index-q, index-k), as a
    tensor or an NVFP4/MXFP8 quantized value; norms are per-head RMSNorm weights [head_dim].
    """

    def __init__(self, cfg: M3Config, weight: torch.Tensor | quant.NVFP4Tensor | quant.MXFP8Tensor,
                 q_norm: torch.Tensor, k_norm: torch.Tensor, index_q_norm: torch.Tensor | None = None,
                 index_k_norm: torch.Tensor | None = None, dtype: torch.dtype = torch.bfloat16) -> None:
        super().__init__()
        sparse = index_q_norm is not None
        self.cfg, self.dtype = cfg, dtype
        self.shape = QKVShape(cfg.num_attention_heads, cfg.num_key_value_heads, cfg.index_n_heads if sparse else 0,
                              cfg.head_dim, cfg.rotary_dim)
        w = weight if isinstance(weight, torch.Tensor) else (
            quant.nvfp4_dequantize(weight) if isinstance(weight, quant.NVFP4Tensor) else quant.mxfp8_dequantize(weight))
        n = self.shape.num_heads * cfg.head_dim
        if tuple(w.shape) != (n, cfg.hidden_size):
            raise ShapeError(f"weight has shape {tuple(w.shape)}, expected [{n}, {cfg.hidden_size}] "
                             "(q, k, v, index-q, index-k rows)")
        self.register_buffer("weight", w.to(dtype).contiguous())
        self.register_buffer("weight_packed", prepack_weight(w.to(dtype), self.shape))
        norms = [q_norm, k_norm] + ([index_q_norm, index_k_norm] if sparse else [])
        for name, t in zip(("q_norm", "k_norm", "index_q_norm", "index_k_norm"), norms):
            if t is None or tuple(t.shape) != (cfg.head_dim,):
                raise ShapeError(f"{name} must have shape [{cfg.head_dim}]")
            self.register_buffer(name, t.to(torch.bfloat16).contiguous())

    @classmethod
    def from_attention(cls, attn: nn.Module, dtype: torch.dtype = torch.bfloat16) -> FusedQKVNormRopeKVInsert:
        """From a reference `m3c.model_defs.minimax_m3.Attention` layer."""
        sparse = attn.sparse
        return cls(attn.cfg, attn.qkv_proj.dequantized(torch.float32), attn.q_norm, attn.k_norm,
                   attn.index_q_norm if sparse else None, attn.index_k_norm if sparse else None, dtype)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                k_cache: quant.NVFP4Tensor, v_cache: quant.NVFP4Tensor,
                index_k_cache: quant.NVFP4Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """q [T, heads, head_dim] and index-q [T, index heads, head_dim] (None on dense layers)."""
        cfg, s = self.cfg, self.shape
        if x.dim() != 2 or x.shape[1] != cfg.hidden_size or positions.shape != (x.shape[0],) \
                or slot_mapping.shape != (x.shape[0],):
            raise ShapeError(f"x must be [T, {cfg.hidden_size}] with positions and slot_mapping of shape [T]; got "
                             f"{tuple(x.shape)}, {tuple(positions.shape)}, {tuple(slot_mapping.shape)}")
        if s.num_index_heads and index_k_cache is None:
            raise ShapeError("this layer has index heads: pass index_k_cache")
        cos, sin = rope_cos_sin(positions, cfg.rotary_dim, cfg.rope_theta, torch.float32)
        norms = (self.q_norm, self.k_norm) + ((self.index_q_norm, self.index_k_norm) if s.num_index_heads else ())
        if x.is_cuda and s.supported() is None:
            return launch_fused(x.to(self.dtype).contiguous(), self.weight_packed, cos, sin, slot_mapping, norms,
                                k_cache, v_cache, index_k_cache, s, cfg.rms_norm_eps)
        outs = qkv_norm_rope_kvinsert(
            x.to(self.dtype).float(), self.weight.float(), *norms[:2], *(norms[2:] or (None, None)), cos, sin,
            slot_mapping, k_cache, v_cache, index_k_cache, num_q_heads=s.num_q_heads, num_kv_heads=s.num_kv_heads,
            num_index_heads=s.num_index_heads, head_dim=s.head_dim, eps=cfg.rms_norm_eps)
        q = outs[0].to(self.dtype)
        return q, (outs[1].to(self.dtype) if s.num_index_heads else None)
