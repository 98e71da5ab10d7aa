"""MegaMoE prefill: routed experts as grouped GEMMs whose weights are decoded inside the K loop (Triton; on sm_90
MegaMoE runs the CUDA C++ wgmma kernels of :mod:`m3c.backends.kernels.moe_prefill_cuda` instead where they take the
layout: same steps, same result within bf16 rounding, 1.3-1.5x faster on the H200).

Semantics: exactly ``m3c.model_defs.layers.MoE.forward`` after routing, for tokens x [T, H] with
``topk_ids`` [T, k] (int64) and ``topk_weights`` [T, k] (float32)::

    gate_up = grouped_gemm(x, ids, W13)           # W13 [E, 2I, H], rows: gate then up
    act     = silu(gate) * up                     # [T, k, I]
    down    = grouped_gemm(act, ids, W2)          # W2 [E, H, I]
    out     = sum_j down[:, j] * weights[:, j]    (+ shared[1](silu(g) * u), g, u = shared[0](x).chunk(2))

Routed weights NVFP4 (E2M1 codes, E4M3 per-16 scales, float32 per-row scale [E, N, 1]), MXFP8 or
bf16; the shared expert MXFP8 or bf16 (or absent). Activations bf16 (bf16 tensor-core dots, float32
accumulation) or float32 (IEEE dots: the tiny test models). An id outside [0, E) contributes nothing.

Design (four device steps, no host synchronization, fixed launch shapes for a given T):

1. Permutation on the GPU: a stable sort of the T·k (token, slot) pairs by expert gives ``order``
   (sorted position -> pair); ``searchsorted`` over the sorted ids gives the expert row offsets
   (:func:`expert_permutation`; the decode routing kernel makes both in its own launch and passes them
   in). The grid has room for the worst case, ``min(ceil(T·k / BLOCK_M) + E, T·k)`` routed row tiles;
   a program loads the E + 1 offsets, builds the tile table (a cumsum of ceil(count_e / BLOCK_M)) in
   registers, finds its expert by counting the entries at or below its tile index, and programs
   past the real tile count exit at once. Experts without tokens own no tile: they cost nothing.
2. FC1 (one launch): a program owns BLOCK_M rows of one expert × BLOCK_N columns of the
   intermediate dim, for gate AND up (rows n and I + n of W13), so SiLU(gate)·up happens in the
   epilogue and only act [T·k, I] (rows in sorted order) reaches HBM. The x rows are gathered
   through ``order``. NVFP4 bytes and E4M3 scale bytes are decoded in registers by bit
   placement (a code lands on a float32 subnormal, value × 2^-126; the scale is decoded × 2^119;
   their product is the weight × 2^-7, exact in bf16) and the two nibble halves are interleaved
   with ``tl.join`` into the [BLOCK_N, BLOCK_K] operand of one tensor-core dot. The per-row
   float32 scale and the 2^7 are applied to the accumulator once, in the epilogue. MXFP8 decodes
   E4M3 bytes the same way × its E8M0 power of two. The shared expert's FC1 runs as extra row
   tiles of the same launch (tiles 0 .. ceil(T / BLOCK_M) - 1, identity rows).
3. FC2 (one launch): same tiling over act × W2; the epilogue multiplies by the routing weight and
   writes each (token, slot) row to y [T, k (+1), H] (slot k: the shared expert's FC2, tiles of
   the same launch). No float atomics.
4. Combine: out[t] = sum over slots of y[t, slot] in a fixed order (float32 sum): deterministic,
   bit-identical from run to run (greedy decoding tests rely on it).

GEMV tiles (``GEMV`` constexpr; decode batches of T <= ``GEMV_MAX_TOKENS``): the same four steps, but a
tile holds BM <= 4 rows and no tensor-core dot is issued — an [M, K] × [K, N] MMA at M = 1 wastes 63/64
of a wgmma. Each K step loads the tile's weight bytes one step ahead (in flight while the previous step
computes), decodes every weight once — NVFP4 from whole 32-bit words of 8 codes with constant shifts (2
shifts + 1 LOP3 per code), × its E4M3 scale (×2^119) — and FMAs it with each row's x into float32
accumulators [BN, BK/16, 2, 8] (one FFMA per weight and row, fp-contraction on), reduced once after the
loop. Offline sm_90a SASS (Triton 3.9): ~7.2 instructions per weight in FC1's NVFP4 loop (3 integer,
FMUL, FFMA, the rest loads and a scale-layout exchange through shared memory). ``Tiles.pipe`` > 1 lets
Triton's pipeliner stream the bytes through shared memory instead (cp.async; measured 30-60% slower).
Nsight Compute at T = 1 (H200, benchmarks/RESULTS.md): FC1 110 µs at 20% of DRAM bandwidth, 1.31 waves of
programs (5 resident per SM at 96 registers), 39% issue-busy, long-scoreboard stalls; ~8.5 instructions per
weight over the launch. Two K steps of bytes in registers and 16-byte "wide" loads were measured
(sessions 11-12), did not help and were removed. A batch
is summed in a different order by the GEMV tiles (T <= 3) than by the tensor-core tiles: the same tokens
in batches of different sizes differ by float32 / bf16 rounding (~5e-4 relative in bf16), not more.

Swap tiles (``SWAP`` constexpr; GEMV_MAX_TOKENS < T <= SWAP_MAX_TOKENS): the same four steps with
:mod:`m3c.backends.kernels.moe_swap`'s weight-stationary tensor-core tiles (BN weight rows × 16 tokens of one
expert, NVFP4 decoded to bf16 by inline PTX): 7-10% faster than the GEMV at T = 4 and 11-15% faster than the
"small" tiles at T = 16 on the H200, slower at T = 1 and 64. Like every decode tiling here they reach only
20-26% of the byte floor (Nsight: neither DRAM nor issue saturated; few warps per scheduler waiting on each
step's load -> decode -> MMA chain).

FLOP / byte floor (m3.1-small: H = 6144, I = S = 1536, E = 64, k = 8, P = T·k pairs):
FLOPs = 6·P·H·I (routed) + 6·T·H·S (shared) = 54·T·H·I: 2.09 TFLOP at T = 4096 -> ~2.8 ms at
750 TFLOP/s bf16 (1.6 ms at FP8's 1,280). Bytes: NVFP4 weights of every touched expert,
E · 3·H·I · 0.5625 B = 1.02 GB (+ shared MXFP8 ~29 MB) -> 0.24 ms at 4.28 TB/s; activations
(x 2·T·H, act 2·P·I twice, y 2·(P+T)·H twice, out 2·T·H) = 1.21 GB at T = 4096 with bf16, of
which the y round trip (0.91 GB, ~0.21 ms) is the price of the deterministic combine. Prefill at
T >= 4096 is compute-bound; at T = 512 weight bytes (0.24 ms) and FLOPs (0.35 ms) are comparable.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import torch
import triton

from m3c.backends.kernels.host import derived, derived_ready, interpreting
from m3c.backends.kernels.moe_prefill_kernels import moe_combine_kernel, moe_fc1_kernel, moe_fc2_kernel
from m3c.backends.kernels.moe_routing import expert_permutation
from m3c.backends.triton_aot import KernelSpec, Runner, jit_run
from m3c.errors import ShapeError
from m3c.model_defs.quant import MXFP8Tensor, NVFP4Tensor

FMT_CODES = {"bf16": 0, "mxfp8": 1, "nvfp4": 2}
ACT_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
POISON_WORKSPACES = False  # tests: fill act / y with NaN before the launches, so unwritten rows show


# ---------------------------------------------------------------------------------------------
# Layout, tiles, specs
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Layout:
    """The static facts a compiled MoE prefill depends on."""

    hidden: int
    inter: int
    experts: int
    top_k: int
    shared_inter: int  # 0: no shared expert
    act_dtype: str  # "bf16" | "fp32"
    w13_fmt: str  # routed format: "nvfp4" | "mxfp8" | "bf16"
    shared_fmt: str | None  # "mxfp8" | "bf16" | None


@dataclass(frozen=True)
class Tiles:
    """One tiling of the three launches."""

    bm: int  # rows per tile (both GEMMs; the tile table depends on it)
    bn1: int  # FC1 intermediate columns per tile (gate and up each)
    bn2: int  # FC2 hidden columns per tile
    bk: int
    warps: int
    stages: int
    bt: int = 16  # combine: tokens × hidden columns per program
    bh: int = 256
    cwarps: int = 4
    gemv: bool = False  # CUDA-core FMA tiles (bm <= 4 rows: weights decoded once per program, no MMA)
    pipe: int = 0  # GEMV / swap tiles: 0 = next step's bytes prefetched in registers; n > 1 = tl.range(num_stages=n)
    swap: bool = False  # weight-stationary tensor-core tiles (decode): bn weight rows × bm tokens, moe_swap


def _divides(options: tuple[int, ...], *dims: int) -> int:
    """The largest option dividing every nonzero dim (0 when none does)."""
    return next((o for o in options if all(d % o == 0 for d in dims if d)), 0)


def _tile_options(lay: Layout, bucket: str, interp: bool) -> Tiles:
    """Tiles for a layout and a token bucket ("gemv1" / "gemv2" / "gemv4": FMA tiles of 1 / 2 / 4 rows — the
    dispatch uses "gemv1", see `BUCKETS` —, "swap": weight-stationary tensor-core tiles, "small": few rows per
    expert, "large")."""
    h, i, s = lay.hidden, lay.inter, lay.shared_inter
    if bucket == "swap":  # weight-stationary tensor-core tiles: bn weight rows × 16 tokens of one expert
        if interp:
            return Tiles(16, 16, 16, 32, 4, 1, 16, _divides((64, 32), h), 4, swap=True)
        return Tiles(16, _divides((64, 32), i, s), _divides((64, 32), h), _divides((128, 64, 32), h, i, s), 4, 1, 16,
                     _divides((256, 128, 64, 32), h), 4, swap=True, pipe=3)
    if bucket.startswith("gemv"):  # "gemv<rows per tile>"
        bm = int(bucket[4:])
        if bm not in (1, 2, 4):
            raise ShapeError(f"GEMV tiles hold 1, 2 or 4 rows, not {bm} (bucket {bucket!r})")
        if interp:  # the same code on small tiles
            return Tiles(bm, 16, 16, 32, 4, 1, 16, _divides((64, 32), h), 4, gemv=True)
        return Tiles(bm, 16, 16, _divides((64, 32), h, i, s), 2, 1, 16, _divides((256, 128, 64, 32), h), 4,
                     gemv=True)
    if interp:
        return Tiles(32, _divides((32, 16), i, s), _divides((64, 32, 16), h), _divides((64, 32), h, i, s), 4, 1,
                     16, _divides((64, 32), h), 4)
    bk = _divides((128, 64, 32), h, i, s)
    bh = _divides((256, 128, 64, 32), h)
    if lay.act_dtype == "fp32":  # IEEE float32 dots: small tiles (the tiny test models)
        return Tiles(32, _divides((32, 16), i, s), _divides((64, 32, 16), h), 32, 4, 2, 16, bh, 4)
    if bucket == "small":
        return Tiles(64, _divides((64, 32, 16), i, s), _divides((128, 64, 32, 16), h), bk, 4, 3, 16, bh, 4)
    return Tiles(128, _divides((64, 32, 16), i, s), _divides((128, 64, 32, 16), h), bk, 8, 3, 16, bh, 4)


GEMV_MAX_TOKENS = 3
"""Batches of at most this many tokens run the GEMV tiles with one row per tile ("gemv1"; K step 64, 2 warps:
168.4 µs at T = 1 against 177.8 for K step 128 and 4 warps, same run). Measured on the H200 (m3.1-small, bf16,
CUDA graphs, benchmarks/RESULTS.md): T = 1 168-185 µs vs 204-223 µs for the swap tiles and 229 µs for the
"small" tiles; at T = 4 the swap tiles won (474 vs 506 µs; 530 for the 64 / 2-warp GEMV). Tiles of 2 or 4
rows lost to 1-row tiles at T = 4 (598 / 818 µs)."""
SWAP_MAX_TOKENS = 16
"""Batches of GEMV_MAX_TOKENS + 1 .. this many tokens run the weight-stationary tensor-core tiles ("swap",
:mod:`m3c.backends.kernels.moe_swap`): T = 16 838-870 µs vs 938-1025 for the "small" tiles (same runs); at T =
64 the "small" tiles win (1115 vs 1247-1319)."""
BUCKETS = ("gemv1", "swap", "small", "large")
"""Token buckets the dispatch uses (``_tile_options`` also takes "gemv2" / "gemv4": FMA tiles of 2 / 4 rows)."""


def _bucket(lay: Layout, t: int) -> str:
    """Token bucket of a batch of t tokens (a host-side size: no synchronization)."""
    if t <= GEMV_MAX_TOKENS:
        return "gemv1"
    if t <= SWAP_MAX_TOKENS:
        return "swap"
    return "small" if t * lay.top_k <= 96 * lay.experts else "large"


def _ptr(fmt: str | None, data: bool) -> str:
    if fmt == "bf16":
        return "*bf16" if data else "*u8"
    return "*u8"


@functools.cache  # launches ask for the same few specs every step: build (and key) each once
def _specs(lay: Layout, tiles: Tiles, upcast: bool) -> tuple[KernelSpec, ...]:
    """KernelSpecs of FC1, FC2 and the combine for one layout and tiling."""
    act = "*" + lay.act_dtype
    dot_f32 = lay.act_dtype == "fp32" or upcast
    has_sh = lay.shared_fmt is not None and lay.shared_inter > 0
    sfmt = lay.shared_fmt if has_sh else None
    common = dict(H=lay.hidden, INTER=lay.inter, S=lay.shared_inter if has_sh else 0, TOPK=lay.top_k, E=lay.experts,
                  EP=triton.next_power_of_2(lay.experts), FMT=FMT_CODES[lay.w13_fmt],
                  SFMT=FMT_CODES[sfmt] if sfmt else 0, HAS_SHARED=has_sh, BM=tiles.bm, BK=tiles.bk, DOT_F32=dot_f32,
                  GEMV=tiles.gemv, PIPE=tiles.pipe, SWAP=tiles.swap)
    w = {"wd_ptr": _ptr(lay.w13_fmt, True), "ws_ptr": _ptr(lay.w13_fmt, False), "wg_ptr": "*fp32",
         "sd_ptr": _ptr(sfmt, True), "ss_ptr": _ptr(sfmt, False)}
    t1 = {"x_ptr": act, "order_ptr": "*i32", "offs_ptr": "*i32", **w, "act_ptr": act,
          "sact_ptr": act, "T": "i32", "n_sh": "i32"}
    t2 = {"act_ptr": act, "sact_ptr": act, "order_ptr": "*i32", "wts_ptr": "*fp32", "offs_ptr": "*i32", **w,
          "y_ptr": act, "T": "i32", "n_sh": "i32"}
    t3 = {"y_ptr": act, "ids_ptr": "*i64", "out_ptr": act, "T": "i32"}
    aligned = ("x_ptr", "act_ptr", "sact_ptr", "y_ptr", "wd_ptr", "ws_ptr", "sd_ptr", "ss_ptr", "out_ptr")
    return (
        KernelSpec("moe_prefill_fc1", moe_fc1_kernel, t1, common | {"BN": tiles.bn1}, tiles.warps, tiles.stages,
                   tuple(a for a in aligned if a in t1), enable_fp_fusion=tiles.gemv),
        KernelSpec("moe_prefill_fc2", moe_fc2_kernel, t2, common | {"BN": tiles.bn2}, tiles.warps, tiles.stages,
                   tuple(a for a in aligned if a in t2), enable_fp_fusion=tiles.gemv),
        KernelSpec("moe_prefill_combine", moe_combine_kernel, t3,
                   dict(H=lay.hidden, TOPK=lay.top_k, E=lay.experts, HAS_SHARED=has_sh, BT=tiles.bt, BH=tiles.bh),
                   tiles.cwarps, 1, tuple(a for a in aligned if a in t3)),
    )


def moe_prefill_supported(hidden: int, inter: int, experts: int, top_k: int, shared_inter: int, act_dtype: str,
                          w13_fmt: str, shared_fmt: str | None) -> str | None:
    """Why the prefill kernels cannot take this layout, or None when they can."""
    if act_dtype not in ACT_DTYPES:
        return f"activation dtype {act_dtype!r} is not one of {sorted(ACT_DTYPES)}"
    if w13_fmt not in FMT_CODES:
        return f"routed weight format {w13_fmt!r} is not one of {sorted(FMT_CODES)}"
    if shared_fmt not in (None, "mxfp8", "bf16"):
        return f"shared expert format {shared_fmt!r} is not mxfp8, bf16 or None"
    if experts < 1 or top_k < 1 or top_k > experts:
        return f"need 1 <= top_k ({top_k}) <= experts ({experts})"
    if shared_fmt is not None and shared_inter < 1:
        return f"a shared expert of format {shared_fmt} needs shared_inter >= 1, got {shared_inter}"
    dims = (hidden, inter) + ((shared_inter,) if shared_fmt else ())
    if any(d < 32 or d % 32 for d in dims):
        return f"hidden, inter and shared_inter {dims} must be multiples of 32 (MXFP8 block, tile width)"
    return None


def moe_prefill_specs(hidden: int, inter: int, experts: int, top_k: int, shared_inter: int, act_dtype: str,
                      w13_fmt: str, shared_fmt: str | None) -> list[KernelSpec]:
    """Every KernelSpec `moe_prefill` can launch for this layout (all token buckets), GPU settings."""
    why = moe_prefill_supported(hidden, inter, experts, top_k, shared_inter, act_dtype, w13_fmt, shared_fmt)
    if why:
        raise ShapeError(f"moe_prefill cannot take this layout: {why}")
    lay = Layout(hidden, inter, experts, top_k, shared_inter if shared_fmt else 0, act_dtype, w13_fmt, shared_fmt)
    out: dict[str, KernelSpec] = {}
    for bucket in BUCKETS:
        for s in _specs(lay, _tile_options(lay, bucket, False), upcast=False):
            out.setdefault(s.key(), s)
    return list(out.values())


# ---------------------------------------------------------------------------------------------
# Host launcher
# ---------------------------------------------------------------------------------------------


def _fmt_of(w: Any, who: str) -> str:
    if isinstance(w, NVFP4Tensor):
        return "nvfp4"
    if isinstance(w, MXFP8Tensor):
        return "mxfp8"
    if isinstance(w, torch.Tensor) and w.dtype == torch.bfloat16:
        return "bf16"
    raise ShapeError(f"{who}: expected an NVFP4Tensor, MXFP8Tensor or bf16 tensor, got "
                     f"{type(w).__name__}{'' if not isinstance(w, torch.Tensor) else ' ' + str(w.dtype)}")


def nvfp4_row_scales(w: NVFP4Tensor, lead: tuple[int, ...], who: str) -> torch.Tensor:
    """`w`'s float32 tensor scale per row, contiguous [*lead, 1] (lead: [E, N]): a per-tensor or per-expert
    (ModelOpt) scale is expanded once per scale-tensor version, not at every call."""
    g = w.global_scale
    rows = math.prod(lead)
    if g is None or g.numel() not in (1, lead[0], rows):
        raise ShapeError(f"{who}: NVFP4 routed weights need a float32 global_scale per tensor, per expert or "
                         f"per row ({(*lead, 1)}), got {None if g is None else tuple(g.shape)}")
    if g.numel() != rows:
        src = g
        g = derived(src, f"rows {lead}", lambda: src.to(torch.float32).reshape(-1, 1).expand(
            lead[0], rows // lead[0]).reshape(*lead, 1).contiguous())
    return g.to(torch.float32).reshape(*lead, 1).contiguous()


def nvfp4_row_scales_ready(w: NVFP4Tensor, lead: tuple[int, ...]) -> bool:
    """Whether :func:`nvfp4_row_scales` would return without building anything (per-row scales, or the expansion
    already made for this version of the scale)."""
    g = w.global_scale
    return g is not None and (g.numel() == math.prod(lead) or derived_ready(g, f"rows {lead}"))


def weight_args(w: Any, fmt: str, shape: tuple[int, ...], who: str) -> tuple[torch.Tensor, torch.Tensor,
                                                                             torch.Tensor | None]:
    """(data, block scales, per-row tensor scale) pointers of a weight of logical shape `shape` ([..., N, K]), checked
    (shapes, dtypes, contiguity, 16-byte alignment); also what the CUDA decode's NATURAL reads in place."""
    *lead, k = shape
    if fmt == "nvfp4":
        want = [((*lead, k // 2), torch.uint8, w.data), ((*lead, k // 16), torch.float8_e4m3fn, w.scale)]
        g = nvfp4_row_scales(w, tuple(lead), who)
    elif fmt == "mxfp8":
        want = [((*lead, k), torch.float8_e4m3fn, w.data), ((*lead, k // 32), torch.uint8, w.scale)]
        g = None
    else:
        want = [((*lead, k), torch.bfloat16, w)]
        g = None
    for shp, dt, t in want:
        if tuple(t.shape) != shp or t.dtype != dt:
            raise ShapeError(f"{who}: {fmt} tensor is {t.dtype} {tuple(t.shape)}, expected {dt} {shp}")
        if not t.is_contiguous() or t.data_ptr() % 16:
            raise ShapeError(f"{who}: {fmt} tensors must be contiguous and 16-byte aligned (pass .contiguous())")
    if g is not None and (g.dtype != torch.float32 or not g.is_contiguous()):
        raise ShapeError(f"{who}: global_scale must be a contiguous float32 tensor, got {g.dtype}")
    data = want[0][2]
    data = data if fmt == "bf16" else data.view(torch.uint8)
    scale = want[1][2].view(torch.uint8) if len(want) > 1 else data
    return data, scale, g


def _layout(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w13: Any, w2: Any,
            shared_w13: Any, shared_w2: Any) -> Layout:
    """Validate the arguments (shapes, dtypes, formats) and return their static layout."""
    if x.dim() != 2 or x.dtype not in (torch.bfloat16, torch.float32):
        raise ShapeError(f"x must be [T, H] bfloat16 or float32, got {x.dtype} {tuple(x.shape)}")
    t, h = x.shape
    if topk_ids.dim() != 2 or topk_ids.shape[0] != t or topk_ids.dtype not in (torch.int64, torch.int32):
        raise ShapeError(f"topk_ids must be int64 [T={t}, k], got {topk_ids.dtype} {tuple(topk_ids.shape)}")
    if tuple(topk_weights.shape) != tuple(topk_ids.shape) or not topk_weights.is_floating_point():
        raise ShapeError(f"topk_weights must be float32 {tuple(topk_ids.shape)}, got {topk_weights.dtype} "
                         f"{tuple(topk_weights.shape)}")
    fmt = _fmt_of(w13, "w13")
    if _fmt_of(w2, "w2") != fmt:
        raise ShapeError(f"w13 is {fmt} but w2 is {_fmt_of(w2, 'w2')}: routed weights must share one format")
    e, n13 = w13.shape[0], w13.shape[1]
    if len(w13.shape) != 3 or n13 % 2 or w13.shape[2] != h:
        raise ShapeError(f"w13 has logical shape {tuple(w13.shape)}: expected [E, 2·I, H={h}]")
    inter = n13 // 2
    if tuple(w2.shape) != (e, h, inter):
        raise ShapeError(f"w2 has logical shape {tuple(w2.shape)}: expected [E={e}, H={h}, I={inter}]")
    sfmt, s = None, 0
    if (shared_w13 is None) != (shared_w2 is None):
        raise ShapeError("pass both shared_w13 and shared_w2, or neither")
    if shared_w13 is not None:
        sfmt = _fmt_of(shared_w13, "shared_w13")
        if _fmt_of(shared_w2, "shared_w2") != sfmt:
            raise ShapeError("shared_w13 and shared_w2 must share one format")
        if len(shared_w13.shape) != 2 or shared_w13.shape[0] % 2 or shared_w13.shape[1] != h:
            raise ShapeError(f"shared_w13 has logical shape {tuple(shared_w13.shape)}: expected [2·S, H={h}]")
        s = shared_w13.shape[0] // 2
        if tuple(shared_w2.shape) != (h, s):
            raise ShapeError(f"shared_w2 has logical shape {tuple(shared_w2.shape)}: expected [H={h}, S={s}]")
    act = "bf16" if x.dtype == torch.bfloat16 else "fp32"
    lay = Layout(h, inter, e, topk_ids.shape[1], s, act, fmt, sfmt)
    why = moe_prefill_supported(h, inter, e, lay.top_k, s, act, fmt, sfmt)
    if why:
        raise ShapeError(f"moe_prefill cannot take this layout: {why}")
    return lay


def moe_prefill(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w13: Any, w2: Any,
                shared_w13: Any, shared_w2: Any, *, runner: Runner = jit_run, out: torch.Tensor | None = None,
                permutation: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Routed experts (+ shared expert) of a prefill batch: [T, H] in x.dtype; three launches, no host sync.

    ``w13`` / ``w2``: stacked routed weights [E, 2I, H] / [E, H, I] (NVFP4Tensor with a [E, N, 1]
    global scale, MXFP8Tensor or bf16); ``shared_w13`` [2S, H] / ``shared_w2`` [H, S] (MXFP8Tensor
    or bf16) or both None. ``out``: optional preallocated [T, H] output (CUDA graphs). ``permutation``:
    :func:`expert_permutation`'s (order, offsets) for these ids if the caller has them (the decode
    routing kernel makes them in its own launch); else they are made here.
    """
    lay = _layout(x, topk_ids, topk_weights, w13, w2, shared_w13, shared_w2)
    return _launch(x, topk_ids, topk_weights, w13, w2, shared_w13, shared_w2, lay,
                   _tile_options(lay, _bucket(lay, x.shape[0]), interpreting()), runner, out, permutation)


def _check_tiles(lay: Layout, tiles: Tiles) -> None:
    """Raise ShapeError unless `tiles` fits `lay`: the kernels' loads are unmasked along K and N."""
    h, i, s = lay.hidden, lay.inter, lay.shared_inter
    bad = [f"{name}={v} does not divide {dim}" for name, v, dims in
           (("bk", tiles.bk, (h, i, s)), ("bn1", tiles.bn1, (i, s)), ("bn2", tiles.bn2, (h,)), ("bh", tiles.bh, (h,)))
           for dim in dims if dim and dim % v]
    if tiles.gemv and tiles.bm not in (1, 2, 4):
        bad.append(f"GEMV tiles hold 1, 2 or 4 rows, not bm={tiles.bm}")
    if tiles.pipe and not (tiles.gemv or tiles.swap):
        bad.append("pipe applies to GEMV and swap tiles only (the tensor-core tiles pipeline through `stages`)")
    if tiles.swap:
        if tiles.gemv:
            bad.append("a tiling is either gemv or swap, not both")
        if tiles.bm < 16 or tiles.bm & (tiles.bm - 1):
            bad.append(f"swap tiles take a power of two >= 16 tokens (the MMA's N), not bm={tiles.bm}")
        if min(tiles.bn1, tiles.bn2) < 16 or tiles.bk < 32:
            bad.append(f"swap tiles need bn1, bn2 >= 16 and bk >= 32 (MMA shapes), got {tiles.bn1}, {tiles.bn2}, "
                       f"{tiles.bk}")
        ptx = lay.w13_fmt == "nvfp4" and lay.act_dtype == "bf16" and not interpreting()
        if ptx and min(tiles.bn1, tiles.bn2) * tiles.bk < 256 * tiles.warps:  # the PTX decodes 4 code bytes a call
            bad.append(f"swap tiles need bn · bk / 2 >= 4 code bytes per thread (bn1, bn2 = {tiles.bn1}, {tiles.bn2}, "
                       f"bk = {tiles.bk}, {tiles.warps} warps)")
    if bad:
        raise ShapeError(f"tiling {tiles} does not fit hidden={h}, inter={i}, shared_inter={s}: " + "; ".join(bad))


def checked_permutation(permutation: tuple[torch.Tensor, torch.Tensor] | None, ids: torch.Tensor,
                        experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The caller's (order, offsets) for ids [T, k], checked (int32 [T·k], int32 [E + 1]), or
    :func:`expert_permutation`'s."""
    p = ids.numel()
    order, offs = permutation if permutation is not None else expert_permutation(ids, experts)
    if order.dtype != torch.int32 or tuple(order.shape) != (p,) or offs.dtype != torch.int32 \
            or tuple(offs.shape) != (experts + 1,):
        raise ShapeError(f"permutation must be (int32 [{p}] pair order, int32 [{experts + 1}] expert offsets), got "
                         f"{order.dtype} {tuple(order.shape)}, {offs.dtype} {tuple(offs.shape)}")
    return order, offs


def _launch(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w13: Any, w2: Any,
            shared_w13: Any, shared_w2: Any, lay: Layout, tiles: Tiles, runner: Runner,
            out: torch.Tensor | None, permutation: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """The launches of `moe_prefill` for an explicit tiling (benchmarks compare tilings through this)."""
    _check_tiles(lay, tiles)
    t, h = x.shape
    k, e, i = lay.top_k, lay.experts, lay.inter
    dev = x.device
    if out is None:
        out = torch.empty((t, h), dtype=x.dtype, device=dev)
    elif tuple(out.shape) != (t, h) or out.dtype != x.dtype or not out.is_contiguous():
        raise ShapeError(f"out must be a contiguous {x.dtype} [{t}, {h}] tensor, got {out.dtype} {tuple(out.shape)}")
    if t == 0:
        return out
    if not x.is_contiguous() or x.data_ptr() % 16:
        x = x.contiguous() if not x.is_contiguous() else x.clone()
    ids = topk_ids.contiguous() if topk_ids.dtype == torch.int64 else topk_ids.long().contiguous()
    wts = topk_weights.float().contiguous().view(-1)
    wd, ws, wg = weight_args(w13, lay.w13_fmt, (e, 2 * i, h), "w13")
    vd, vs, vg = weight_args(w2, lay.w13_fmt, (e, h, i), "w2")
    has_sh = lay.shared_fmt is not None
    if has_sh:
        s = lay.shared_inter
        sd, ss, _ = weight_args(shared_w13, lay.shared_fmt, (2 * s, h), "shared_w13")
        td, ts, _ = weight_args(shared_w2, lay.shared_fmt, (h, s), "shared_w2")
    else:
        s = 0
        sd = ss = td = ts = wd.view(torch.uint8)
    wg = wg if wg is not None else wts
    vg = vg if vg is not None else wts
    bm = tiles.bm
    p = t * k
    # 1. permutation (pairs sorted stably by expert, expert row offsets): the caller's, or made here
    order, offs = checked_permutation(permutation, ids, e)
    n_sh = triton.cdiv(t, bm) if has_sh else 0
    m_tiles = n_sh + min(triton.cdiv(p, bm) + e, p)
    slots = k + int(has_sh)
    act = torch.empty((p, i), dtype=x.dtype, device=dev)
    sact = torch.empty((t, s), dtype=x.dtype, device=dev) if has_sh else act
    y = torch.empty((t, slots, h), dtype=x.dtype, device=dev)
    if POISON_WORKSPACES:
        for buf in (act, sact, y):
            buf.fill_(float("nan"))
    fc1, fc2, comb = _specs(lay, tiles, upcast=interpreting())
    n1 = triton.cdiv(max(i, s), tiles.bn1)
    runner(fc1, (m_tiles, n1), (x, order, offs, wd, ws, wg, sd, ss, act, sact, t, n_sh))
    runner(fc2, (m_tiles, h // tiles.bn2), (act, sact, order, wts, offs, vd, vs, vg, td, ts, y, t, n_sh))
    runner(comb, (triton.cdiv(t, tiles.bt), h // tiles.bh), (y, ids, out, t))
    return out
