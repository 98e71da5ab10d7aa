"""`MegaMoE`: the whole MoE block (router, NVFP4 routed experts, MXFP8 / bf16 shared expert) as one nn.Module.

Semantics: ``MegaMoE(...)(x)`` equals ``m3c.model_defs.layers.MoE.forward(x)`` (up to float rounding of the
activation dtype). On a GPU (or under Triton's interpreter) it runs the MegaMoE kernels through
:func:`m3c.backends.kernels.megamoe.megamoe`: device routing, then for T <= 64 on an sm_89+ GPU the CUDA C++
decode kernels (:mod:`m3c.backends.kernels.moe_cuda`; their prepacked weights are built at the first call, so
call once before capturing a CUDA graph), else the grouped-GEMM expert kernels (``decode_kernel=True`` picks
the one-launch Triton decode kernel for T <= 64, with a workspace kept per token count); elsewhere (plain CPU)
it runs the reference composition. The default path allocates its small per-call buffers from torch's caching
allocator (CUDA-graph safe).
:func:`random_moe` builds a random reference block for tests and benchmarks, :func:`hot_routing` a routing with one hot
expert.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from m3c.backends.kernels.host import interpreting
from m3c.backends.kernels.megamoe import megamoe, megamoe_supported
from m3c.backends.kernels.moe_decode import MAX_DECODE_TOKENS, DecodeWorkspace, shared_format
from m3c.backends.kernels.moe_prefill_cuda import check_precision
from m3c.backends.kernels.moe_routing import gate_weight
from m3c.errors import ShapeError
from m3c.model_defs import quant
from m3c.model_defs.config import M3Config, QuantScheme
from m3c.model_defs.layers import MoE, routed_experts
from m3c.model_defs.presets import m31_small, m31_tiny


def _as_shared(lin: nn.Module) -> Any:
    return quant.MXFP8Tensor(lin.weight, lin.weight_scale) if lin.fmt == "mxfp8" else lin.weight


class MegaMoE(nn.Module):
    """Fused MoE block: ``forward(x [T, H]) -> [T, H]`` in x's dtype (bf16 or float32).

    ``w13`` NVFP4 [E, 2I, H] (gate rows then up), ``w2`` NVFP4 [E, H, I], ``gate_w`` bf16 [E, H] (or MXFP8),
    ``bias`` float32 [E]; shared weights MXFP8Tensor / bf16 ([2S, H], [H, S]) or None. ``prefill_precision``
    ("bf16" / "fp8", None: the default): the wgmma prefill's routed tiles (see :func:`megamoe`).
    """

    def __init__(self, gate_w: torch.Tensor | quant.MXFP8Tensor, bias: torch.Tensor, w13: quant.NVFP4Tensor,
                 w2: quant.NVFP4Tensor, shared_w13: Any = None, shared_w2: Any = None, *, top_k: int,
                 routed_scaling_factor: float = 1.0, norm_topk_prob: bool = True, decode_kernel: bool = False,
                 prefill_precision: str | None = None) -> None:
        super().__init__()
        self.decode_kernel = decode_kernel  # see megamoe(): kept for tuning; the default paths are faster
        check_precision(prefill_precision, "prefill_precision")
        self.prefill_precision = prefill_precision  # see megamoe(): the wgmma prefill's routed tiles
        if not isinstance(w13, quant.NVFP4Tensor) or not isinstance(w2, quant.NVFP4Tensor):
            raise ShapeError("MegaMoE takes NVFP4 routed experts (quant.NVFP4Tensor for w13 and w2)")
        e, n1, h = w13.data.shape[0], w13.data.shape[1], w13.data.shape[2] * 2
        self.hidden, self.inter, self.experts = h, n1 // 2, e
        self.top_k, self.routed_scaling_factor, self.norm_topk_prob = top_k, routed_scaling_factor, norm_topk_prob
        self.shared_fmt = shared_format(shared_w13)
        if shared_format(shared_w2) != self.shared_fmt:
            raise ShapeError("shared_w13 and shared_w2 must have the same format (or both be None)")
        self.shared_inter = 0 if shared_w13 is None else shared_w13.shape[0] // 2
        why = megamoe_supported(h, self.inter, e, top_k, self.shared_inter, "bf16", "nvfp4", self.shared_fmt)
        if why is not None:
            raise ShapeError(f"MegaMoE cannot run this block: {why}")
        if tuple(gate_w.shape) != (e, h) or tuple(bias.shape) != (e,):
            raise ShapeError(f"gate_w {tuple(gate_w.shape)} / bias {tuple(bias.shape)}: expected [{e}, {h}] / [{e}]")
        self.register_buffer("gate_w32", gate_weight(gate_w, torch.float32))  # the router GEMV's operand
        self.register_buffer("bias", bias.to(torch.float32))
        for name, t in (("w13", w13), ("w2", w2)):
            self.register_buffer(f"{name}_data", t.data)
            self.register_buffer(f"{name}_scale", t.scale)
            self.register_buffer(f"{name}_global_scale", t.global_scale)
        for name, t in (("shared_w13", shared_w13), ("shared_w2", shared_w2)):
            if isinstance(t, quant.MXFP8Tensor):
                self.register_buffer(f"{name}_data", t.data)
                self.register_buffer(f"{name}_scale", t.scale)
            else:
                self.register_buffer(f"{name}_data", t)
                self.register_buffer(f"{name}_scale", None)
        self._workspaces: dict[tuple[int, torch.dtype, torch.device], DecodeWorkspace] = {}

    @classmethod
    def from_reference(cls, moe: MoE, decode_kernel: bool = False, prefill_precision: str | None = None) -> MegaMoE:
        """From a reference ``m3c.model_defs.layers.MoE`` block (its buffers are shared, not copied)."""
        if moe.w13.fmt != "nvfp4":
            raise ShapeError(f"the reference block's experts are {moe.w13.fmt}; MegaMoE takes NVFP4 experts")
        cfg: M3Config = moe.cfg
        w13 = quant.NVFP4Tensor(moe.w13.weight, moe.w13.weight_scale, moe.w13.weight_scale_2)
        w2 = quant.NVFP4Tensor(moe.w2.weight, moe.w2.weight_scale, moe.w2.weight_scale_2)
        s13 = s2 = None
        if moe.shared is not None:
            s13, s2 = _as_shared(moe.shared[0]), _as_shared(moe.shared[1])
        return cls(moe.gate.weight, moe.e_score_correction_bias, w13, w2, s13, s2, top_k=cfg.num_experts_per_tok,
                   routed_scaling_factor=cfg.routed_scaling_factor, norm_topk_prob=cfg.norm_topk_prob,
                   decode_kernel=decode_kernel, prefill_precision=prefill_precision)

    def weights(self) -> tuple[quant.NVFP4Tensor, quant.NVFP4Tensor, Any, Any]:
        """(w13, w2, shared_w13, shared_w2) as the kernels take them."""
        w13 = quant.NVFP4Tensor(self.w13_data, self.w13_scale, self.w13_global_scale)
        w2 = quant.NVFP4Tensor(self.w2_data, self.w2_scale, self.w2_global_scale)
        shared = []
        for name in ("shared_w13", "shared_w2"):
            data, scale = getattr(self, f"{name}_data"), getattr(self, f"{name}_scale")
            shared.append(None if data is None else quant.MXFP8Tensor(data, scale) if scale is not None else data)
        return w13, w2, shared[0], shared[1]

    def _reference(self, x: torch.Tensor) -> torch.Tensor:
        """The reference composition (plain CPU without the Triton interpreter)."""
        from m3c.backends.kernels.moe_routing import moe_route

        ids, weights = moe_route(x, self.gate_w32, self.bias, top_k=self.top_k,
                                 routed_scaling_factor=self.routed_scaling_factor, norm_topk_prob=self.norm_topk_prob)
        w13, w2, s13, s2 = self.weights()
        out = routed_experts(x, ids, weights, (w13.data, w13.scale, w13.global_scale),
                             (w2.data, w2.scale, w2.global_scale), "nvfp4")
        if s13 is not None:
            def deq(w: Any) -> torch.Tensor:
                return (quant.mxfp8_dequantize(w) if isinstance(w, quant.MXFP8Tensor) else w).to(x.dtype)

            sg, su = F.linear(x, deq(s13)).chunk(2, dim=-1)
            out = out + F.linear(F.silu(sg) * su, deq(s2))
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """MoE output [T, H] for tokens x [T, H] (bf16 or float32)."""
        if x.dim() != 2 or x.shape[1] != self.hidden:
            raise ShapeError(f"x has shape {tuple(x.shape)}: expected [T, {self.hidden}]")
        if x.dtype not in (torch.bfloat16, torch.float32):
            raise ShapeError(f"x is {x.dtype}: MegaMoE takes bf16 or float32 activations")
        if not (x.is_cuda or interpreting()):
            return self._reference(x)
        t = x.shape[0]
        ws = None
        if self.decode_kernel and 1 <= t <= MAX_DECODE_TOKENS:
            key = (t, x.dtype, x.device)
            ws = self._workspaces.get(key)
            if ws is None:
                ws = DecodeWorkspace.create(t, self.hidden, self.inter, self.shared_inter, self.experts, self.top_k,
                                            x.dtype, x.device)
                self._workspaces[key] = ws
        w13, w2, s13, s2 = self.weights()
        return megamoe(x, self.gate_w32, self.bias, w13, w2, s13, s2, top_k=self.top_k,
                       routed_scaling_factor=self.routed_scaling_factor, norm_topk_prob=self.norm_topk_prob,
                       workspace=ws, decode_kernel=self.decode_kernel, prefill_precision=self.prefill_precision)


def random_moe(hidden: int, inter: int, experts: int, top_k: int, shared: str, generator: torch.Generator,
               device: str | torch.device = "cpu", *, norm_topk_prob: bool = True,
               routed_scaling_factor: float = 2.5) -> MoE:
    """A reference MoE block with random weights: NVFP4 experts (per-row tensor scales), router in bf16,
    and an MXFP8 ("mxfp8"), bf16 ("bf16") or no ("none") shared expert of the same intermediate size.

    Values are drawn on the generator's device (a CUDA generator makes m3.1-small shapes take seconds).
    """
    base = m31_small() if hidden >= 1024 else m31_tiny()
    cfg = base.replace(hidden_size=hidden, moe_intermediate_size=inter, n_routed_experts=experts,
                       num_experts_per_tok=top_k, n_shared_experts=0 if shared == "none" else 1,
                       norm_topk_prob=norm_topk_prob, routed_scaling_factor=routed_scaling_factor,
                       quant=QuantScheme("nvfp4", "nvfp4", "nvfp4", "mxfp8" if shared == "none" else shared))
    moe = MoE(cfg, device=device)

    def randn(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=generator, device=generator.device) / shape[-1] ** 0.5).to(device)

    def rand(*shape: int) -> torch.Tensor:
        return torch.rand(*shape, generator=generator, device=generator.device).to(device)

    with torch.no_grad():
        moe.gate.weight.copy_(randn(experts, hidden).bfloat16())
        moe.e_score_correction_bias.copy_(0.1 * randn(experts) * experts ** 0.5)
        for lin, n, k in ((moe.w13, 2 * inter, hidden), (moe.w2, hidden, inter)):
            for e in range(experts):  # one expert at a time keeps the float32 staging small at big shapes
                w = randn(n, k) * (1 + rand(n, 1))
                gs = w.abs().amax(dim=-1, keepdim=True) / (448.0 * 6.0)
                q = quant.nvfp4_quantize(w, gs)
                lin.weight[e].copy_(q.data)
                lin.weight_scale[e].copy_(q.scale)
                lin.weight_scale_2[e].copy_(gs)
        if moe.shared is not None:
            for lin, n, k in ((moe.shared[0], 2 * inter, hidden), (moe.shared[1], hidden, inter)):
                w = randn(n, k)
                if shared == "mxfp8":
                    q8 = quant.mxfp8_quantize(w)
                    lin.weight.copy_(q8.data)
                    lin.weight_scale.copy_(q8.scale)
                else:
                    lin.weight.copy_(w.bfloat16())
    return moe


def hot_routing(tokens: int, experts: int, top_k: int, hot: int, generator: torch.Generator,
                device: str | torch.device = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Routing (ids int64 [T, k], weights float32 [T, k]) for tests and benchmarks with one hot expert: the first
    `hot` tokens pick expert 0 in slot 0, every other slot a distinct random expert of 1..E-1; random positive
    weights summing to 1 per token. ``generator`` is a CPU generator; the results go to ``device``."""
    if not 0 <= hot <= tokens or not 1 <= top_k < experts:
        raise ShapeError(f"hot_routing: hot = {hot} of T = {tokens}, top-{top_k} of {experts} experts")
    ids = torch.stack([torch.randperm(experts - 1, generator=generator)[:top_k] + 1 for _ in range(tokens)])
    ids[:hot, 0] = 0
    w = torch.rand(tokens, top_k, generator=generator) + 0.1
    return ids.to(device), (w / w.sum(dim=1, keepdim=True)).to(device)
