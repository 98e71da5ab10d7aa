"""MoE routing on the device: router top-k and the per-expert token lists the decode kernel walks.

Semantics: :func:`moe_route` returns exactly ``m3c.model_defs.layers.MoE.route`` — router logits in
float32 (float64 for float64 tokens) from the stored gate weight, sigmoid, ``+ e_score_correction_bias``
for the selection only, stable top-k (ties to the smaller expert index, as ``torch.ops.m3c.topk``),
weights gathered from the sigmoid scores, normalized (``+ 1e-20``) if ``norm_topk_prob``, times
``routed_scaling_factor``. It is written with the same torch ops as the reference, so on one device
the ids and weights are bitwise those of ``MoE.route``.

:func:`expert_segments` turns ``topk_ids [T, k]`` into a compact, expert-sorted view of the T·k
(token, slot) pairs (pair ``p = t·k + j``):

- ``sorted_pairs`` int32 [T·k]: pairs ordered by expert, stably (ascending p within an expert);
- ``slot_expert`` / ``slot_start`` / ``slot_count`` int32 [A], ``A = min(E, T·k)``: the touched
  experts in ascending order (slot i < num_active), where their pairs begin in ``sorted_pairs`` and
  how many there are; slots past ``num_active`` have count 0 (their expert is an untouched one, or 0
  from :func:`fused_route`);
- ``num_active`` int32 [1]: how many experts received at least one token;
- ``offsets`` int32 [E + 1]: where each expert's pairs begin in ``sorted_pairs`` (every expert, touched
  or not; the last entry is T·k) — with ``sorted_pairs``, the grouped GEMMs' permutation.

Design: :func:`moe_route` + :func:`expert_segments` are small torch launches (~25: sort, scatter-add,
cumsum, ...), bitwise the reference's routing; :func:`fused_route` (the decode path, T <= 64) does the
same after the router GEMV in ONE single-program Triton launch (sigmoid with an accurate exp and IEEE
division, k rounds of a row max with ties to the smaller index, normalization, then a bitonic sort of
(expert, pair) keys whose run boundaries give the segments): measured in CUDA graphs on the H200,
~13 µs against ~80 µs for the torch routing at T = 1. Neither synchronizes with the host (no ``.item()``, ``nonzero``,
``bincount`` or boolean indexing); shapes are fixed for a given T, so both are CUDA-graph capturable.
Floor: the T·H activations and the E×H gate (1.5 MB float32 at E = 64, H = 6144: ~0.4 µs at
4.28 TB/s); at decode sizes routing is launch- and latency-bound.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

import m3c.model_defs.ops  # noqa: F401  (registers torch.ops.m3c.topk / mxfp8_dequantize)
from m3c.backends.kernels.host import derived, interpreting
from m3c.backends.triton_aot import KernelSpec, Runner, jit_run
from m3c.errors import ShapeError
from m3c.model_defs import quant
from m3c.model_defs.layers import route, routing_dtype


@dataclass
class ExpertSegments:
    """Expert-sorted (token, slot) pairs; see the module docstring for each field's meaning."""

    sorted_pairs: torch.Tensor
    slot_expert: torch.Tensor
    slot_start: torch.Tensor
    slot_count: torch.Tensor
    num_active: torch.Tensor
    offsets: torch.Tensor

    @property
    def max_active(self) -> int:
        """A = min(E, T·k): the number of expert slots (a static fact of the batch shape)."""
        return self.slot_expert.shape[0]


def gate_weight(gate_w: torch.Tensor | quant.MXFP8Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The router weight [E, H] as a `dtype` matrix (bf16 / float tensors, or MXFP8 dequantized).

    A tensor's conversion is made once per weight version (:func:`~m3c.backends.kernels.host.derived`): the
    per-step routing does not convert the same weight again (1.5 MB at 64 experts × 6144 per layer).
    """
    if isinstance(gate_w, quant.MXFP8Tensor):
        return torch.ops.m3c.mxfp8_dequantize(gate_w.data, gate_w.scale).to(dtype)
    if isinstance(gate_w, torch.Tensor):
        return gate_w if gate_w.dtype == dtype else derived(gate_w, f"as {dtype}", lambda: gate_w.to(dtype))
    raise ShapeError(f"gate weight of type {type(gate_w).__name__}: pass a bf16 tensor [E, H] or an MXFP8Tensor")


def moe_route(x: torch.Tensor, gate_w: torch.Tensor | quant.MXFP8Tensor, bias: torch.Tensor, *, top_k: int,
              routed_scaling_factor: float, norm_topk_prob: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(topk_ids int64 [T, k], topk_weights [T, k]) exactly as ``MoE.route`` (the same
    :func:`m3c.model_defs.layers.route`; float32, float64 for float64 x), after checking the shapes."""
    if x.dim() != 2:
        raise ShapeError(f"x has shape {tuple(x.shape)}: expected [T, H] tokens")
    w = gate_weight(gate_w, routing_dtype(x))
    if w.dim() != 2 or w.shape[1] != x.shape[1]:
        raise ShapeError(f"gate weight {tuple(w.shape)} does not match x {tuple(x.shape)}: expected [E, {x.shape[1]}]")
    e = w.shape[0]
    if tuple(bias.shape) != (e,):
        raise ShapeError(f"e_score_correction_bias has shape {tuple(bias.shape)}: expected ({e},)")
    if not 1 <= top_k <= e:
        raise ShapeError(f"top_k={top_k} must be in [1, {e}] (the number of experts)")
    return route(x.to(w.dtype), w, bias, top_k, norm_topk_prob, routed_scaling_factor)


def expert_permutation(topk_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(order int32 [T·k]: the (token, slot) pairs p = t·k + j sorted stably by expert; offsets int32 [E + 1]:
    where each expert's pairs begin in ``order``), by torch on the device (a sort and a search, no sync)."""
    sorted_ids, order = torch.sort(topk_ids.reshape(-1).to(torch.int64), stable=True)
    offs = torch.searchsorted(sorted_ids, torch.arange(num_experts + 1, device=topk_ids.device), out_int32=True)
    return order.to(torch.int32), offs


def expert_segments(topk_ids: torch.Tensor, num_experts: int) -> ExpertSegments:
    """Expert-sorted pairs and the compact list of touched experts for ``topk_ids [T, k]`` (no host sync)."""
    if topk_ids.dim() != 2 or topk_ids.dtype not in (torch.int32, torch.int64):
        raise ShapeError(f"topk_ids {tuple(topk_ids.shape)} {topk_ids.dtype}: expected int32/int64 [T, k]")
    dev = topk_ids.device
    a = min(num_experts, topk_ids.numel())
    order, offsets = expert_permutation(topk_ids, num_experts)
    counts = offsets[1:] - offsets[:-1]
    starts = offsets[:-1]
    ar = torch.arange(num_experts, device=dev)
    active = counts > 0
    _, perm = torch.sort(torch.where(active, ar, ar + num_experts))  # touched experts first, ascending
    slot_expert = perm[:a]
    return ExpertSegments(
        sorted_pairs=order,
        slot_expert=slot_expert.to(torch.int32),
        slot_start=starts[slot_expert],
        slot_count=counts[slot_expert],
        num_active=active.sum(dtype=torch.int32).reshape(1),
        offsets=offsets,
    )


# ------------------------------------------------------------------ fused decode routing (one small launch)


@triton.jit
def _sigmoid(v, NATIVE: tl.constexpr):
    """1 / (1 + exp(-v)) with an accurate exp and an IEEE division on the GPU (as torch.sigmoid)."""
    if NATIVE:
        return tl.math.div_rn(tl.full(v.shape, 1.0, tl.float32), 1.0 + libdevice.exp(-v))
    return 1.0 / (1.0 + tl.exp(-v))


@triton.jit
def moe_route_kernel(logits_ptr, bias_ptr, ids_ptr, w_ptr, pairs_ptr, slot_expert_ptr, slot_start_ptr,
                     slot_count_ptr, num_active_ptr, offs_ptr, T, A, scale,
                     E: tl.constexpr, EP: tl.constexpr, TOPK: tl.constexpr, KP: tl.constexpr, TP: tl.constexpr,
                     NORM: tl.constexpr, NATIVE: tl.constexpr):
    """One program: sigmoid + bias, stable top-k, weights, and the expert segments of T <= TP tokens."""
    PB: tl.constexpr = TP * KP  # pair-index range (power of two)
    t = tl.arange(0, TP)
    c = tl.arange(0, EP)
    kk = tl.arange(0, KP)
    ok = (t < T)[:, None] & (c < E)[None, :]
    s = _sigmoid(tl.load(logits_ptr + t[:, None] * E + c[None, :], mask=ok, other=0.0), NATIVE)
    corr = tl.where(ok, s + tl.load(bias_ptr + c, mask=c < E, other=0.0)[None, :], float("-inf"))
    ids = tl.zeros([TP, KP], tl.int32)
    ws = tl.zeros([TP, KP], tl.float32)
    for j in tl.static_range(TOPK):  # largest first; among equal values the smallest expert index
        best = tl.max(corr, axis=1)
        idx = tl.min(tl.where(corr == best[:, None], c[None, :], EP), axis=1)
        sel = c[None, :] == idx[:, None]
        ids = tl.where(kk[None, :] == j, idx[:, None], ids)
        ws = tl.where(kk[None, :] == j, tl.sum(tl.where(sel, s, 0.0), axis=1)[:, None], ws)
        corr = tl.where(sel, float("-inf"), corr)
    if NORM:
        den = tl.sum(ws, axis=1) + 1e-20
        if NATIVE:
            ws = tl.math.div_rn(ws, tl.broadcast_to(den[:, None], [TP, KP]))
        else:
            ws = ws / den[:, None]
    ws = ws * scale
    valid = (t < T)[:, None] & (kk < TOPK)[None, :]
    tl.store(ids_ptr + t[:, None] * TOPK + kk[None, :], ids.to(tl.int64), mask=valid)
    tl.store(w_ptr + t[:, None] * TOPK + kk[None, :], ws, mask=valid)
    # expert segments: sort (expert, pair) keys; the pair index p = t·k + j breaks ties (stable)
    pair = t[:, None] * TOPK + kk[None, :]
    key = tl.reshape(tl.where(valid, ids * PB + pair, 2147483647), [PB])
    key = tl.sort(key)
    pos = tl.arange(0, PB)
    n = T * TOPK
    live = pos < n
    es = key // PB
    # expert row offsets [E + 1]: pairs of smaller experts before each expert (the grouped GEMMs' input)
    before = tl.sum(((es[:, None] < c[None, :]) & live[:, None]).to(tl.int32), axis=0)
    tl.store(offs_ptr + c, before, mask=c < E)
    tl.store(offs_ptr + E, T * TOPK)
    tl.store(pairs_ptr + pos, es, mask=live)  # pairs_ptr as scratch: neighbours' experts
    tl.store(slot_count_ptr + c, tl.zeros([EP], tl.int32), mask=c < A)
    tl.store(slot_expert_ptr + c, tl.zeros([EP], tl.int32), mask=c < A)
    tl.store(slot_start_ptr + c, tl.zeros([EP], tl.int32), mask=c < A)
    tl.debug_barrier()
    prev = tl.load(pairs_ptr + pos - 1, mask=live & (pos > 0), other=-1)
    nxt = tl.load(pairs_ptr + pos + 1, mask=live & (pos < n - 1), other=-1)
    tl.debug_barrier()
    tl.store(pairs_ptr + pos, key % PB, mask=live)
    first = live & (es != prev)
    last = live & (es != nxt)
    slot = tl.cumsum(first.to(tl.int32), 0) - 1
    tl.store(slot_expert_ptr + slot, es, mask=first)
    tl.store(slot_start_ptr + slot, pos, mask=first)
    tl.store(slot_count_ptr + slot, pos + 1, mask=last)  # segment end for now
    na = tl.sum(first.to(tl.int32), 0)
    tl.store(num_active_ptr, na)
    tl.debug_barrier()
    act = c < na
    st = tl.load(slot_start_ptr + c, mask=act, other=0)
    en = tl.load(slot_count_ptr + c, mask=act, other=0)
    tl.store(slot_count_ptr + c, en - st, mask=act)


def route_specs(experts: int, top_k: int) -> list[KernelSpec]:
    """KernelSpecs of :func:`fused_route` (token buckets 16, 32, 64 × norm_topk_prob), GPU settings.

    The pair range TP × KP is padded to >= 128 (one element per thread of the 4 warps): with fewer
    (e.g. 8 experts top-2 at 16 tokens: 32 pairs) the sort faulted on the H200 (Triton 3.6).
    """
    return [_route_spec(experts, top_k, tp, norm, True) for tp in (16, 32, 64) for norm in (True, False)]


@functools.cache  # launches ask for the same few specs every step: build (and key) each once
def _route_spec(experts: int, top_k: int, tp: int, norm: bool, native: bool) -> KernelSpec:
    types = {"logits_ptr": "*fp32", "bias_ptr": "*fp32", "ids_ptr": "*i64", "w_ptr": "*fp32", "pairs_ptr": "*i32",
             "slot_expert_ptr": "*i32", "slot_start_ptr": "*i32", "slot_count_ptr": "*i32",
             "num_active_ptr": "*i32", "offs_ptr": "*i32", "T": "i32", "A": "i32", "scale": "fp32"}
    consts = dict(E=experts, EP=triton.next_power_of_2(experts), TOPK=top_k,
                  KP=max(2, triton.next_power_of_2(top_k), 128 // tp), TP=tp, NORM=norm, NATIVE=native)
    return KernelSpec("moe_route", moe_route_kernel, types, consts, num_warps=4, num_stages=1)


def fused_route(logits: torch.Tensor, bias: torch.Tensor, *, top_k: int, routed_scaling_factor: float,
                norm_topk_prob: bool, runner: Runner = jit_run) -> tuple[torch.Tensor, torch.Tensor, ExpertSegments]:
    """(topk_ids int64 [T, k], topk_weights float32 [T, k], ExpertSegments) from float32 router logits [T, E]
    for T <= 64, in ONE launch (the decode path's routing; the logits come from one float32 GEMV).

    Same selection rule as ``MoE.route`` (sigmoid, + bias, stable top-k, normalize, scale); sigmoid
    uses an accurate exp and IEEE division as torch does, the normalization sums in its own order
    (weights may differ from the reference by an ulp; ids only where corrected scores tie within one).
    """
    if logits.dim() != 2 or logits.dtype != torch.float32:
        raise ShapeError(f"logits {tuple(logits.shape)} {logits.dtype}: expected float32 [T, E]")
    t, e = logits.shape
    if not 1 <= t <= 64:
        raise ShapeError(f"fused_route takes 1..64 tokens, got {t}; use moe_route + expert_segments")
    if not 1 <= top_k <= e or tuple(bias.shape) != (e,):
        raise ShapeError(f"top_k={top_k} must be in [1, {e}] and bias [{e}] (got {tuple(bias.shape)})")
    a = min(e, t * top_k)
    dev = logits.device
    ids = torch.empty((t, top_k), dtype=torch.int64, device=dev)
    w = torch.empty((t, top_k), dtype=torch.float32, device=dev)
    i32 = dict(dtype=torch.int32, device=dev)
    seg = ExpertSegments(torch.empty(t * top_k, **i32), torch.empty(a, **i32), torch.empty(a, **i32),
                         torch.empty(a, **i32), torch.empty(1, **i32), torch.empty(e + 1, **i32))
    spec = _route_spec(e, top_k, max(16, triton.next_power_of_2(t)), bool(norm_topk_prob), not interpreting())
    runner(spec, (1,), [logits.contiguous(), bias.to(torch.float32).contiguous(), ids, w, seg.sorted_pairs,
                        seg.slot_expert, seg.slot_start, seg.slot_count, seg.num_active, seg.offsets, t, a,
                        float(routed_scaling_factor)])
    return ids, w, seg
