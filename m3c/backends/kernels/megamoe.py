"""MegaMoE host dispatcher: routing on the device, then the routed experts with the shared expert fused in.

Semantics: ``megamoe(x, ...)`` equals ``m3c.model_defs.layers.MoE.forward(x)`` for a block whose routed
experts are NVFP4 and whose shared expert (if any) is MXFP8 or bf16: sigmoid router + correction bias,
stable top-k, normalized × scaled weights, SwiGLU experts, weighted combine, + shared expert.

Dispatch (by measurement on the H200, benchmarks/RESULTS.md): on a CUDA device, T <= 64 tokens run the CUDA C++
decode kernels of :mod:`m3c.backends.kernels.moe_cuda` (prepacked NVFP4 decoded by byte permutes straight into
mma.sync fragments; T = 1: 61 vs 170 µs for the experts) where the layout allows them; otherwise the experts run
grouped GEMMs (NVFP4 decoded in the mainloop, the shared expert as extra tiles): above 64 tokens on sm_90 the
CUDA C++ wgmma kernels of :mod:`m3c.backends.kernels.moe_prefill_cuda` (:data:`PREFILL_WGMMA`), else the Triton
kernels of :mod:`m3c.backends.kernels.moe_prefill`: CUDA-core GEMV tiles for T <= 3, weight-stationary
tensor-core tiles to 16, above that token tiles.
Routing for T <= 64: on the CUDA decode path (module flag ``CUDA_ROUTE``, on by default; up to 256 experts) ONE CUDA C++
launch (:func:`m3c.backends.kernels.moe_cuda.route_stage`: the float32 router GEMV split over ~200 CTAs, the last
CTA merges in a fixed order and routes, T more CTAs stage the tokens for the expert kernels), so the whole op is 5
launches; otherwise the router GEMV (float32, cuBLAS) + ONE launch
(:func:`m3c.backends.kernels.moe_routing.fused_route`, ~13 µs), which also makes the grouped GEMMs'
permutation (expert-sorted pairs and offsets: no sort / search launches); above, or with ``exact_routing``, the
torch routing (bitwise ``MoE.route``, ~25 small launches, ~80 µs at T = 1). ``decode_kernel=True`` runs
the persistent one-launch :func:`m3c.backends.kernels.moe_decode.moe_decode` for T <= 64 instead (kept
for tuning; the offline lowering does not compile it). No host synchronization: the whole call is
CUDA-graph capturable for a fixed T. Byte floor: every touched expert's NVFP4 weights once (29.7 µs for
8 experts of 6144×1536 at 4.28 TB/s).
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from m3c.backends.cuda_aot import CudaKernelSpec
from m3c.backends.kernels import moe_prefill_cuda
from m3c.backends.kernels.host import cuda_kernel_device
from m3c.backends.kernels.moe_cuda import MAX_TOKENS as MMA_MAX_TOKENS
from m3c.backends.kernels.moe_cuda import (
    ROUTE_BUILD_TOKENS,
    call_build,
    call_support,
    mma_specs,
    mma_supported,
    moe_decode_mma,
    route_nt,
    route_stage,
    route_stage_spec,
    route_supported,
)
from m3c.backends.kernels.moe_decode import MAX_DECODE_TOKENS, DecodeWorkspace, moe_decode, shared_format
from m3c.backends.kernels.moe_prefill import moe_prefill, moe_prefill_specs, moe_prefill_supported
from m3c.backends.kernels.moe_routing import expert_segments, fused_route, gate_weight, moe_route, route_specs
from m3c.backends.triton_aot import KernelSpec, Runner, jit_run
from m3c.errors import ShapeError
from m3c.model_defs import quant

CUDA_ROUTE = True  # the CUDA decode path routes + stages in one launch (route_stage); False: GEMV + fused_route
PREFILL_WGMMA = True
"""Batches above the CUDA decode kernels' 64 tokens run the routed experts on the wgmma kernels of
:mod:`m3c.backends.kernels.moe_prefill_cuda` (sm_90 only, NVFP4 experts, MXFP8 / no shared expert, bf16 tokens)
where they take the layout; else the Triton grouped GEMM. H200, m3.1-small (benchmarks/RESULTS.md, session 16):
T = 4096 6.7 vs 9.9 ms, T = 512 1.37 vs 1.75 ms, T = 16384 26.1 vs 36.1 ms (same runs)."""


def megamoe_supported(hidden: int, inter: int, experts: int, top_k: int, shared_inter: int, act_dtype: str,
                      w13_fmt: str, shared_fmt: str | None) -> str | None:
    """None if the MegaMoE kernels take this layout, else the reason (the lowering then keeps the reference).

    ``shared_fmt``: "mxfp8", "bf16", or "none" / None for a block without a shared expert.
    """
    shared_fmt = shared_fmt or "none"
    if w13_fmt != "nvfp4":
        return f"routed experts are stored {w13_fmt}; the MegaMoE kernels take NVFP4 experts only"
    if act_dtype not in ("bf16", "fp32"):
        return f"activations are {act_dtype}; the MegaMoE kernels take bf16 or fp32 activations"
    if shared_fmt not in ("mxfp8", "bf16", "none"):
        return f"the shared expert is stored {shared_fmt}; the kernels take MXFP8, bf16 or no shared expert"
    if shared_fmt != "none" and shared_inter <= 0:
        return f"shared inter={shared_inter} must be positive"
    if not 1 <= top_k <= experts:
        return f"top_k={top_k} must be in [1, {experts}]"
    why = moe_prefill_supported(hidden, inter, experts, top_k, shared_inter, act_dtype, w13_fmt, _prefill_fmt(shared_fmt))
    return None if why is None else f"prefill path: {why}"


def _prefill_fmt(shared_fmt: str) -> str | None:
    """moe_prefill names "no shared expert" None."""
    return None if shared_fmt == "none" else shared_fmt


def prefill_wgmma_unsupported(hidden: int, inter: int, shared_inter: int, act_dtype: str, w13_fmt: str,
                              shared_fmt: str | None) -> str | None:
    """None if the grouped GEMMs of this layout run on the wgmma kernels on sm_90 (:data:`PREFILL_WGMMA` on, a layout
    :func:`m3c.backends.kernels.moe_prefill_cuda.supported` takes), else the reason."""
    if not PREFILL_WGMMA:
        return "the wgmma prefill is off (megamoe.PREFILL_WGMMA)"
    return moe_prefill_cuda.supported(hidden, inter, shared_inter, act_dtype, w13_fmt, _prefill_fmt(shared_fmt or "none"))


def megamoe_specs(hidden: int, inter: int, experts: int, top_k: int, shared_inter: int, act_dtype: str,
                  w13_fmt: str, shared_fmt: str | None,
                  prefill_precision: str | None = None) -> list[KernelSpec | CudaKernelSpec]:
    """Every kernel spec :func:`megamoe` launches for this layout by default (GPU settings): the routing
    (3 token buckets × norm_topk_prob), the CUDA C++ decode kernels for T <= 64 where the layout allows them (their
    builds for 1..8, 9..NT1_MAX_TOKENS and more tokens, each folded or not as
    :func:`~m3c.backends.kernels.moe_cuda.call_build` says for the token counts it runs, then the one-launch routing +
    staging kernel's for 8, 16 and 64 where that takes the router, the router weight in float32) and the
    grouped-GEMM kernels, the wgmma ones in ``prefill_precision`` (as :func:`megamoe` takes it; ``decode_kernel=True`` launches
    :func:`m3c.backends.kernels.moe_decode.decode_specs` too; they are not listed here)."""
    shared_fmt = shared_fmt or "none"
    why = megamoe_supported(hidden, inter, experts, top_k, shared_inter, act_dtype, w13_fmt, shared_fmt)
    if why is not None:
        raise ShapeError(f"MegaMoE does not support this layout: {why}")
    mma: list[CudaKernelSpec] = []
    s_decode = shared_inter if shared_fmt != "none" else 0
    builds = dict.fromkeys(  # the decode builds: 1..8, 9..NT1_MAX_TOKENS, above; folded where the grids fit one wave
        call_build(t, hidden, inter, experts, top_k, s_decode) for t in range(1, MMA_MAX_TOKENS + 1)
        if mma_supported(hidden, inter, experts, top_k, s_decode, act_dtype, w13_fmt, shared_fmt, t) is None)
    for build in builds:
        mma += mma_specs(hidden, inter, s_decode, act_dtype, *build)  # (no shared weights: launched with S = 0)
    for tokens in ROUTE_BUILD_TOKENS:  # the routing launch's builds: 8, 16 and 64 tokens
        if route_supported(hidden, experts, top_k, act_dtype, tokens) is None and mma_supported(
                hidden, inter, experts, top_k, s_decode, act_dtype, w13_fmt, shared_fmt, tokens) is None:
            mma.append(route_stage_spec(hidden, experts, act_dtype, route_nt(tokens)))
    if prefill_wgmma_unsupported(hidden, inter, shared_inter, act_dtype, w13_fmt, shared_fmt) is None:
        mma += moe_prefill_cuda.specs(prefill_precision)
        mma += moe_prefill_cuda.ws_specs(prefill_precision, hidden, inter, shared_inter if shared_fmt != "none" else 0)
    return route_specs(experts, top_k) + mma + list(moe_prefill_specs(
        hidden, inter, experts, top_k, shared_inter, act_dtype, w13_fmt, _prefill_fmt(shared_fmt)))


def _mma_ok(x: torch.Tensor, w13: Any, shared_w13: Any, top_k: int) -> bool:
    """Whether the CUDA C++ decode kernels take this call (a CUDA device, T <= 64, NVFP4 experts, MXFP8 / no shared
    expert, a layout they support)."""
    if x.shape[0] > MMA_MAX_TOKENS or not isinstance(w13, quant.NVFP4Tensor) or cuda_kernel_device(x):
        return False
    return call_support(x, w13, shared_w13, top_k) is None


def _prefill(x: torch.Tensor, w13: Any, shared_w13: Any, precision: str | None) -> Callable[..., torch.Tensor]:
    """The grouped-GEMM launcher for this call: the wgmma kernels where they take it (:data:`PREFILL_WGMMA`, an sm_90
    device, the layout; their routed tiles in `precision`), else the Triton ones (bf16; both take moe_prefill's
    arguments)."""
    if PREFILL_WGMMA and x.is_cuda and torch.cuda.get_device_capability(x.device) == (9, 0) \
            and moe_prefill_cuda.call_support(x, w13, shared_w13) is None:
        return functools.partial(moe_prefill_cuda.moe_prefill_wgmma, precision=precision)
    if precision == "fp8":
        warnings.warn("megamoe: prefill_precision='fp8' runs only on the sm_90 wgmma kernels (NVFP4 experts, bf16 "
                      "tokens, a layout they take); this call runs the bf16 Triton grouped GEMM", stacklevel=3)
    return moe_prefill


def _route_ok(x: torch.Tensor, gate_w: Any, top_k: int) -> bool:
    """Whether :func:`route_stage` takes this call's router (the shape only: the gate goes in as float32)."""
    e, hidden = gate_w.shape[0], gate_w.shape[-1]
    act = "bf16" if x.dtype == torch.bfloat16 else "fp32"
    return hidden == x.shape[1] and route_supported(hidden, e, top_k, act, x.shape[0]) is None


def megamoe(x: torch.Tensor, gate_w: torch.Tensor | quant.MXFP8Tensor, bias: torch.Tensor, w13: quant.NVFP4Tensor,
            w2: quant.NVFP4Tensor, shared_w13: Any, shared_w2: Any, *, top_k: int, routed_scaling_factor: float,
            norm_topk_prob: bool, runner: Runner = jit_run, out: torch.Tensor | None = None,
            workspace: DecodeWorkspace | None = None, exact_routing: bool = False,
            decode_kernel: bool = False, prefill_precision: str | None = None) -> torch.Tensor:
    """MoE output [T, H] in x's dtype (bf16 / float32): device routing, then decode (T <= 64) or prefill.

    ``gate_w`` bf16 [E, H] (or MXFP8Tensor), ``bias`` float32 [E]; ``w13`` NVFP4 [E, 2I, H] (gate rows then
    up), ``w2`` NVFP4 [E, H, I]; shared weights MXFP8Tensor / bf16 ([2S, H], [H, S]) or both None.
    ``workspace`` (decode only) may be reused across calls with the same T. Decode routes with
    :func:`~m3c.backends.kernels.moe_cuda.route_stage` on the CUDA decode path (one launch, also staging the tokens;
    ``CUDA_ROUTE``), else :func:`fused_route` (router GEMV + one launch); pass ``gate_w`` in float32 to skip a
    conversion;
    ``exact_routing`` (and every prefill batch) uses the torch routing, bitwise ``MoE.route``.
    ``prefill_precision`` ("bf16" / "fp8", default :data:`m3c.backends.kernels.moe_prefill_cuda.PRECISION`): the
    wgmma grouped GEMMs' routed tiles (fp8: E4M3 weights, tokens and act, ~1.3x faster at T >= 4096 on the H200,
    ~5% relative error instead of ~0.5%; benchmarks/RESULTS.md); other paths are bf16 whatever it says.

    Which path: on a CUDA device, T <= 64 runs the CUDA C++ decode kernels
    (:func:`m3c.backends.kernels.moe_cuda.moe_decode_mma`: NVFP4 decoded by byte permutes into mma.sync fragments,
    ~60% of the byte floor; 2.8x the Triton tiles at T = 1 on the H200, benchmarks/RESULTS.md) where the layout
    allows them; otherwise the grouped-GEMM (prefill) kernels, which beat the one-launch Triton decode kernel at every
    T measured. ``decode_kernel=True`` selects that decode kernel for T <= 64 (kept for tuning).
    """
    if x.dim() != 2 or x.dtype not in (torch.bfloat16, torch.float32):
        raise ShapeError(f"x {tuple(x.shape)} {x.dtype}: expected bf16 / float32 tokens [T, H]")
    moe_prefill_cuda.check_precision(prefill_precision, "prefill_precision")
    t = x.shape[0]
    parts = [gate_w, bias, w13, w2, shared_w13, shared_w2]
    devices = {str(getattr(p, "data", p).device) for p in parts if p is not None}
    if devices - {str(x.device)}:
        raise ShapeError(f"x is on {x.device} but the weights are on {sorted(devices)}: move them to one device")
    if t == 0:
        return out if out is not None else x.new_empty((0, x.shape[1]))
    shared_format(shared_w13)  # raises on an unsupported shared format
    if t <= MAX_DECODE_TOKENS and not exact_routing:
        if CUDA_ROUTE and not decode_kernel and _mma_ok(x, w13, shared_w13, top_k) and _route_ok(x, gate_w, top_k):
            ids, weights, x16, xmult = route_stage(x, gate_weight(gate_w, torch.float32), bias, top_k,
                                                   routed_scaling_factor, norm_topk_prob, runner=runner)
            return moe_decode_mma(x, ids, weights, w13, w2, shared_w13, shared_w2, runner=runner, out=out, x16=x16,
                                  xmult=xmult)
        logits = F.linear(x.to(torch.float32), gate_weight(gate_w, torch.float32))
        ids, weights, seg = fused_route(logits, bias, top_k=top_k, routed_scaling_factor=routed_scaling_factor,
                                        norm_topk_prob=norm_topk_prob, runner=runner)
        if decode_kernel:
            return moe_decode(x, seg, weights, w13, w2, shared_w13, shared_w2, runner=runner, out=out,
                              workspace=workspace)
        if _mma_ok(x, w13, shared_w13, top_k):
            return moe_decode_mma(x, ids, weights, w13, w2, shared_w13, shared_w2, runner=runner, out=out)
        grouped = _prefill(x, w13, shared_w13, prefill_precision)
        return grouped(x, ids, weights, w13, w2, shared_w13, shared_w2, runner=runner, out=out,
                       permutation=(seg.sorted_pairs, seg.offsets))
    ids, weights = moe_route(x, gate_w, bias, top_k=top_k, routed_scaling_factor=routed_scaling_factor,
                             norm_topk_prob=norm_topk_prob)
    weights = weights.to(torch.float32)
    if not decode_kernel and _mma_ok(x, w13, shared_w13, top_k):
        return moe_decode_mma(x, ids, weights, w13, w2, shared_w13, shared_w2, runner=runner, out=out)
    if decode_kernel and t <= MAX_DECODE_TOKENS:
        seg = expert_segments(ids, w13.data.shape[0])
        return moe_decode(x, seg, weights, w13, w2, shared_w13, shared_w2, runner=runner, out=out,
                          workspace=workspace)
    grouped = _prefill(x, w13, shared_w13, prefill_precision)
    return grouped(x, ids, weights, w13, w2, shared_w13, shared_w2, runner=runner, out=out)
