"""Fused ops the fusion passes build. Each declares the ops it replaces and its reference is that composition.

``qkv_norm_rope_kvinsert``: the attention front of one layer — one projection over the
concatenated q/k/v/index-q/index-k weights, per-head RMSNorm on q, k, index-q, index-k, partial
RoPE on the four, NVFP4 quantization of K, V and index-K and their paged-cache writes. Outputs q
and (sparse layers) index-q; effects: the cache writes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from m3c.ir.ops.infer import require
from m3c.ir.ops.model import dequantize, paged_write
from m3c.ir.ops.rope import rope
from m3c.ir.registry import REQUIRED, IRTypeError, defop
from m3c.ir.types import DType, TensorType
from m3c.model_defs import quant

Types = Sequence[TensorType | None]

QKV_OPERANDS = ("x", "w", "q_norm", "k_norm", "index_q_norm?", "index_k_norm?", "cos", "sin", "slot_mapping",
                "k_cache", "v_cache", "index_k_cache?")
QKV_ATTRS = {"num_q_heads": REQUIRED, "num_kv_heads": REQUIRED, "num_index_heads": 0, "head_dim": REQUIRED,
             "eps": REQUIRED}


def _qkv_infer(types: Types, attrs: dict[str, Any]) -> list[TensorType]:
    x, w = require(types[0], "x"), require(types[1], "w")
    hq, hkv, g, d = attrs["num_q_heads"], attrs["num_kv_heads"], attrs["num_index_heads"], attrs["head_dim"]
    n = (hq + 2 * hkv) * d + ((g + 1) * d if g else 0)
    if w.rank != 2 or w.shape[0] != n:
        raise IRTypeError(f"qkv_norm_rope_kvinsert: weight {w} must have {n} rows for heads {hq}/{hkv}/{g}×{d}")
    for i, name in ((9, "k_cache"), (10, "v_cache")):
        if require(types[i], name).dtype != DType.nvfp4:
            raise IRTypeError(f"qkv_norm_rope_kvinsert: {name} must be an nvfp4 cache, got {types[i]}")
    if g and (len(types) < 12 or types[11] is None):
        raise IRTypeError("qkv_norm_rope_kvinsert: a layer with index heads needs index_k_cache")
    t = x.shape[0]
    outs = [TensorType(x.dtype, (t, hq, d))]
    if g:
        outs.append(TensorType(x.dtype, (t, g, d)))
    return outs


@defop("qkv_norm_rope_kvinsert", QKV_OPERANDS, QKV_ATTRS, infer=_qkv_infer,
       writes=("k_cache", "v_cache", "index_k_cache"),
       replaces=("dequantize", "linear", "split", "view", "cast", "rms_norm", "rope", "quantize", "paged_write"))
def qkv_norm_rope_kvinsert(x: torch.Tensor, w: Any, q_norm: torch.Tensor, k_norm: torch.Tensor,
                           index_q_norm: torch.Tensor | None, index_k_norm: torch.Tensor | None, cos: torch.Tensor,
                           sin: torch.Tensor, slot_mapping: torch.Tensor, k_cache: Any, v_cache: Any,
                           index_k_cache: Any = None, *, num_q_heads: int, num_kv_heads: int,
                           num_index_heads: int, head_dim: int, eps: float) -> tuple[torch.Tensor, ...]:
    """Projection → split → per-head RMSNorm → RoPE → NVFP4 K/V/index-K into the paged caches; returns q (, index-q)."""
    t, d = x.shape[0], head_dim
    weight = dequantize(w) if isinstance(w, (quant.NVFP4Tensor, quant.MXFP8Tensor)) else w
    y = F.linear(x, weight.to(x.dtype))
    sizes = [num_q_heads * d, num_kv_heads * d, num_kv_heads * d]
    if num_index_heads:
        sizes += [num_index_heads * d, d]
    parts = torch.split(y, sizes, dim=1)

    def normed(part: torch.Tensor, heads: int, weight: torch.Tensor) -> torch.Tensor:
        return rope(F.rms_norm(part.reshape(t, heads, d), (d,), weight.to(x.dtype), eps), cos, sin)

    q = normed(parts[0], num_q_heads, q_norm)
    paged_write(quant.nvfp4_quantize(normed(parts[1], num_kv_heads, k_norm)), slot_mapping, k_cache)
    paged_write(quant.nvfp4_quantize(parts[2].reshape(t, num_kv_heads, d)), slot_mapping, v_cache)
    if not num_index_heads:
        return (q,)
    assert index_q_norm is not None and index_k_norm is not None
    iq = normed(parts[3], num_index_heads, index_q_norm)
    paged_write(quant.nvfp4_quantize(normed(parts[4], 1, index_k_norm)), slot_mapping, index_k_cache)
    return q, iq
