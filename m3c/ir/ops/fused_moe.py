"""``megamoe``: one MoE block as one op — router, top-k, routed SwiGLU experts, weighted combine, shared expert.

Operands are the parameters as stored: the bf16 router weight ``gate_w [E, H]``, the score-correction
bias ``[E]``, the expert stacks ``w13 [E, 2I, H]`` (gate rows, then up) and ``w2 [E, H, I]``
(nvfp4, mxfp8 or a float dtype), and optionally the shared expert ``shared_w13 [2S, H]`` /
``shared_w2 [H, S]``. The reference is the composition the fusion pass replaces
(:class:`m3c.model_defs.layers.MoE`), op for op through the same op references, so the
interpreter gives bit-identical results before and after the fusion.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from m3c.ir.ops.core import split
from m3c.ir.ops.infer import require_dims_equal, require_rank
from m3c.ir.ops.model import RuntimeTensor, dequantize, grouped_gemm, topk
from m3c.ir.registry import REQUIRED, IRTypeError, defop
from m3c.ir.types import DType, TensorType
from m3c.model_defs import quant

Types = Sequence[TensorType | None]

MOE_OPERANDS = ("x", "gate_w", "correction_bias", "w13", "w2", "shared_w13?", "shared_w2?")
MOE_ATTRS = {"top_k": REQUIRED, "routed_scaling_factor": REQUIRED, "norm_topk_prob": REQUIRED,
             "router_dtype": REQUIRED, "renorm_eps": 1e-20}
_EXPERT_DTYPES = (DType.nvfp4, DType.mxfp8, DType.bf16, DType.f16, DType.f32, DType.f64)


def _float(t: TensorType, what: str) -> None:
    if not t.dtype.is_float or t.dtype.is_quantized:
        raise IRTypeError(f"megamoe: {what} must be a float tensor, got {t}")


def _weight_dtype(t: TensorType, what: str) -> None:
    if t.dtype not in _EXPERT_DTYPES:
        raise IRTypeError(f"megamoe: {what} must be nvfp4, mxfp8 or float, got {t}")


def _check_attrs(attrs: dict[str, Any], experts: Any) -> None:
    k = attrs["top_k"]
    if not isinstance(k, int) or isinstance(k, bool) or k < 1 or (isinstance(experts, int) and k > experts):
        raise IRTypeError(f"megamoe: top_k={k!r} must be an int in [1, {experts}]")
    try:
        router = DType(attrs["router_dtype"])
    except ValueError:
        router = None
    if router is None or not router.is_float or router.is_quantized:
        raise IRTypeError(f"megamoe: router_dtype={attrs['router_dtype']!r} must be a float dtype such as 'f32'")
    if not isinstance(attrs["norm_topk_prob"], bool):
        raise IRTypeError(f"megamoe: norm_topk_prob={attrs['norm_topk_prob']!r} must be a bool")
    for name in ("routed_scaling_factor", "renorm_eps"):
        if isinstance(attrs[name], bool) or not isinstance(attrs[name], (int, float)):
            raise IRTypeError(f"megamoe: {name}={attrs[name]!r} must be a number")


def _megamoe_infer(types: Types, attrs: dict[str, Any]) -> list[TensorType]:
    x, gate = require_rank(types[0], "megamoe: x", 2), require_rank(types[1], "megamoe: gate_w", 2)
    bias = require_rank(types[2], "megamoe: correction_bias", 1)
    w13, w2 = require_rank(types[3], "megamoe: w13", 3), require_rank(types[4], "megamoe: w2", 3)
    _float(x, "x")
    _float(gate, "gate_w")
    _float(bias, "correction_bias")
    _weight_dtype(w13, "w13")
    _weight_dtype(w2, "w2")
    h, e = x.shape[1], gate.shape[0]
    require_dims_equal(gate.shape[1], h, f"megamoe: gate_w {gate} vs x {x} (hidden)")
    require_dims_equal(bias.shape[0], e, f"megamoe: correction_bias {bias} vs gate_w {gate} (experts)")
    require_dims_equal(w13.shape[0], e, f"megamoe: w13 {w13} vs gate_w {gate} (experts)")
    require_dims_equal(w13.shape[2], h, f"megamoe: w13 {w13} vs x {x} (hidden)")
    require_dims_equal(w2.shape[0], e, f"megamoe: w2 {w2} vs gate_w {gate} (experts)")
    require_dims_equal(w2.shape[1], h, f"megamoe: w2 {w2} vs x {x} (hidden)")
    if not isinstance(w13.shape[1], int) or w13.shape[1] % 2 or not isinstance(w2.shape[2], int) \
            or w13.shape[1] != 2 * w2.shape[2]:
        raise IRTypeError(f"megamoe: w13 {w13} must have 2·I rows for w2 {w2} ([E, H, I])")
    shared = [types[i] if len(types) > i else None for i in (5, 6)]
    if (shared[0] is None) != (shared[1] is None):
        raise IRTypeError("megamoe: shared_w13 and shared_w2 come together (both or neither)")
    if shared[0] is not None:
        s13, s2 = require_rank(shared[0], "megamoe: shared_w13", 2), require_rank(shared[1], "megamoe: shared_w2", 2)
        _weight_dtype(s13, "shared_w13")
        _weight_dtype(s2, "shared_w2")
        require_dims_equal(s13.shape[1], h, f"megamoe: shared_w13 {s13} vs x {x} (hidden)")
        require_dims_equal(s2.shape[0], h, f"megamoe: shared_w2 {s2} vs x {x} (hidden)")
        if not isinstance(s13.shape[0], int) or not isinstance(s2.shape[1], int) or s13.shape[0] != 2 * s2.shape[1]:
            raise IRTypeError(f"megamoe: shared_w13 {s13} must have 2·S rows for shared_w2 {s2} ([H, S])")
    _check_attrs(attrs, e)
    return [TensorType(x.dtype, x.shape)]


def _as(w: RuntimeTensor, dtype: torch.dtype) -> torch.Tensor:
    """A stored weight as a `dtype` matrix (dequantize, then cast; as the traced shared expert does)."""
    full = dequantize(w) if isinstance(w, (quant.NVFP4Tensor, quant.MXFP8Tensor)) else w
    return full.to(dtype)


def _swiglu(y: torch.Tensor, dim: int) -> torch.Tensor:
    half = y.shape[dim] // 2
    gate, up = split(y, sizes=[half, half], dim=dim)
    return F.silu(gate) * up


@defop("megamoe", MOE_OPERANDS, MOE_ATTRS, infer=_megamoe_infer,
       replaces=("cast", "linear", "sigmoid", "add", "topk", "gather", "sum", "div", "mul", "grouped_gemm",
                 "split", "silu", "unsqueeze", "dequantize"), host_sync=True)
def megamoe(x: torch.Tensor, gate_w: torch.Tensor, correction_bias: torch.Tensor, w13: RuntimeTensor,
            w2: RuntimeTensor, shared_w13: RuntimeTensor | None = None, shared_w2: RuntimeTensor | None = None, *,
            top_k: int, routed_scaling_factor: float, norm_topk_prob: bool, router_dtype: str,
            renorm_eps: float = 1e-20) -> torch.Tensor:
    """Sigmoid router + bias → top-k → (renormalized) × scale weights → SwiGLU experts → combine (+ shared)."""
    rdt = DType(router_dtype).to_torch()
    scores = torch.sigmoid(F.linear(x.to(rdt), gate_w.to(rdt)))
    _, ids = topk(torch.add(scores, correction_bias), k=top_k)
    weights = torch.gather(scores, 1, ids)
    if norm_topk_prob:
        weights = torch.div(weights, torch.add(torch.sum(weights, [1], keepdim=True), renorm_eps))
    weights = torch.mul(weights, routed_scaling_factor)  # ×1.0 is exact (the traced graph drops it)
    down = grouped_gemm(_swiglu(grouped_gemm(x, ids, w13), 2), ids, w2)
    out = torch.sum(torch.mul(down, weights.to(down.dtype).unsqueeze(2)), [1])
    if shared_w13 is None:
        return out
    assert shared_w2 is not None
    act = _swiglu(F.linear(x, _as(shared_w13, x.dtype)), 1)
    return torch.add(out, F.linear(act, _as(shared_w2, x.dtype)))
