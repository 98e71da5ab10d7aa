"""Building blocks of the reference model: quantized linear, partial RoPE, the MoE block.

All of them compute in the model's float dtype (float32 by default) from weights stored in their
checkpoint formats; the dequantization happens on the fly in every forward, through the
``torch.ops.m3c`` dequantize ops, so a traced graph shows it as its own node.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import m3c.model_defs.ops  # noqa: F401  (registers torch.ops.m3c.*)
from m3c.model_defs.config import M3Config


class QuantLinear(nn.Module):
    """``y = x @ W^T`` with W stored as bf16, MXFP8 or NVFP4 buffers (``weight``, ``weight_scale``, ``weight_scale_2``).

    Stacked weights (routed experts) put the expert index first: ``[E, out, in]``; an NVFP4 stack
    has one float32 tensor scale per expert row, shaped ``[E, out, 1]``.
    """

    def __init__(self, in_features: int, out_features: int, fmt: str, *, experts: int = 0,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features, self.fmt = in_features, out_features, fmt
        lead = (experts,) if experts else ()
        k = in_features
        if fmt == "bf16":
            self.register_buffer("weight", torch.empty(*lead, out_features, k, dtype=torch.bfloat16, device=device))
        elif fmt == "mxfp8":
            self.register_buffer("weight", torch.empty(*lead, out_features, k, dtype=torch.float8_e4m3fn, device=device))
            self.register_buffer("weight_scale", torch.empty(*lead, out_features, k // 32, dtype=torch.uint8,
                                                             device=device))
        elif fmt == "nvfp4":
            self.register_buffer("weight", torch.empty(*lead, out_features, k // 2, dtype=torch.uint8, device=device))
            self.register_buffer("weight_scale", torch.empty(*lead, out_features, k // 16, dtype=torch.float8_e4m3fn,
                                                             device=device))
            gshape = (*lead, out_features, 1) if experts else ()
            self.register_buffer("weight_scale_2", torch.empty(gshape, dtype=torch.float32, device=device))
        else:
            raise ValueError(f"unknown weight format {fmt!r}")

    def scale_tensors(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(block scales, tensor scale) of the stored weight, None where the format has none."""
        return getattr(self, "weight_scale", None), getattr(self, "weight_scale_2", None)

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight as a `dtype` matrix."""
        if self.fmt == "nvfp4":
            w = torch.ops.m3c.nvfp4_dequantize(self.weight, self.weight_scale, self.weight_scale_2)
        elif self.fmt == "mxfp8":
            w = torch.ops.m3c.mxfp8_dequantize(self.weight, self.weight_scale)
        else:
            w = self.weight
        return w.to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the linear map."""
        return F.linear(x, self.dequantized(x.dtype))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim with a (bf16-stored) weight."""
    return F.rms_norm(x, (x.shape[-1],), weight.to(x.dtype), eps)


def rope_cos_sin(positions: torch.Tensor, rotary_dim: int, theta: float, dtype: torch.dtype) -> tuple[torch.Tensor,
                                                                                                        torch.Tensor]:
    """cos, sin [T, rotary_dim/2] for absolute `positions`; angles formed in float64 (exact up to 1M tokens)."""
    inv_freq = theta ** (-torch.arange(0, rotary_dim, 2, dtype=torch.float64, device=positions.device) / rotary_dim)
    angles = positions.to(torch.float64)[:, None] * inv_freq[None, :]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Neox-style partial RoPE on x [T, heads, dim]: the first 2·cos.shape[-1] dims rotate, the rest pass."""
    half = cos.shape[-1]
    x1, x2, rest = x[..., :half], x[..., half: 2 * half], x[..., 2 * half:]
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s, rest), dim=-1)


def routing_dtype(x: torch.Tensor) -> torch.dtype:
    """The MoE router's dtype for tokens x: at least float32 (float64 models route in float64)."""
    return torch.promote_types(x.dtype, torch.float32)


def route(xr: torch.Tensor, gate_w: torch.Tensor, bias: torch.Tensor, top_k: int, norm_topk_prob: bool,
          routed_scaling_factor: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(topk_ids [T, k], topk_weights [T, k]): sigmoid router scores, top-k of scores + correction bias (ties
    to the smaller expert), the chosen scores normalized (optionally) and scaled. The tokens `xr` [T, H] and
    `gate_w` [E, H] are already in ``routing_dtype`` of the model's tokens."""
    scores = torch.sigmoid(F.linear(xr, gate_w))
    _, ids = torch.ops.m3c.topk(scores + bias, top_k)
    weights = torch.gather(scores, 1, ids)
    if norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return ids, weights * routed_scaling_factor


def routed_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w13: tuple, w2: tuple,
                   fmt: str) -> torch.Tensor:
    """sum_j weights[:, j] · W2_e (SiLU(gate) · up), (gate, up) = W13_e x, e = ids[:, j]: the routed SwiGLU
    experts. `w13` / `w2` are (weight, block scale, tensor scale) as ``torch.ops.m3c.grouped_gemm`` takes them."""
    gate, up = torch.ops.m3c.grouped_gemm(x, ids, *w13, fmt).chunk(2, dim=-1)
    down = torch.ops.m3c.grouped_gemm(F.silu(gate) * up, ids, *w2, fmt)
    return (down * weights.to(down.dtype).unsqueeze(-1)).sum(dim=1)


class MoE(nn.Module):
    """Sigmoid router with score-correction bias, top-k, normalized × scaled weights, SwiGLU experts, shared expert."""

    def __init__(self, cfg: M3Config, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        h, inter, e = cfg.hidden_size, cfg.moe_intermediate_size, cfg.n_routed_experts
        self.gate = QuantLinear(h, e, "bf16", device=device)
        self.register_buffer("e_score_correction_bias", torch.empty(e, dtype=torch.float32, device=device))
        fmt = cfg.quant.routed_expert_dtype
        self.w13 = QuantLinear(h, 2 * inter, fmt, experts=e, device=device)  # rows: gate then up
        self.w2 = QuantLinear(inter, h, fmt, experts=e, device=device)
        self.shared: nn.ModuleList | None = None
        if cfg.n_shared_experts:
            s = inter * cfg.n_shared_experts
            self.shared = nn.ModuleList([
                QuantLinear(h, 2 * s, cfg.quant.proj_dtype, device=device),
                QuantLinear(s, h, cfg.quant.proj_dtype, device=device),
            ])

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(topk_ids [T, k], topk_weights [T, k]) for tokens x [T, H]."""
        cfg = self.cfg
        xr = x.to(routing_dtype(x))
        return route(xr, self.gate.dequantized(xr.dtype), self.e_score_correction_bias, cfg.num_experts_per_tok,
                     cfg.norm_topk_prob, cfg.routed_scaling_factor)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """MoE output [T, H] for tokens x [T, H]."""
        ids, weights = self.route(x)
        out = routed_experts(x, ids, weights, (self.w13.weight, *self.w13.scale_tensors()),
                             (self.w2.weight, *self.w2.scale_tensors()), self.w13.fmt)
        if self.shared is not None:
            sg, su = self.shared[0](x).chunk(2, dim=-1)
            out = out + self.shared[1](F.silu(sg) * su)
        return out
