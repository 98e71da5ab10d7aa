"""MegaMoE prefill FC1 and FC2, warp-specialized (``cuda/moe_prefill_ws.cu``), for sm_90a: the fp8 prefill's GEMMs.

Why: the register-A wgmma prefill (:mod:`m3c.backends.kernels.moe_prefill_cuda`, fp8 build) is latency-bound at
~4,000 cycles a 128-K stage against ~1,000 of E4M3 MMA (RESULTS.md, sessions 17 and 19): every warp decodes its
own A fragments between its MMAs (~245 instructions a warp a stage), so decode and MMA take turns on the same warps.
Here a producer warpgroup decodes each CTA's NVFP4 weight tile into E4M3 in shared memory (wgmma's B) and copies the
A rows (tokens for FC1, act for FC2), and two consumer warpgroups only issue ``wgmma.m64n256k32`` from shared memory,
synchronized by full / empty mbarriers a stage. Decode work a FLOP is the same (one decode a 128-row tile), but it
runs beside the MMAs instead of between them.

Measured on the H200 at m3.1-small (RESULTS.md, sessions 19, 20, 27), routed FC1 at T = 4096:
- session 19: 2.27 ms vs 2.45 for the register-A FC1. The producer is the limit; one producer warpgroup is all the
  registers allow (512 threads cap them at 128; the m64n256 consumers need >= 154).
- session 20: its tables from a shared lookup table (:data:`LUT`) 2.16 ms.
- session 27: the A rows by one bulk copy a stage from a tile image (:data:`TBULK`, :func:`token_image`) 1.95 ms
  vs 2.06-2.18 (T = 16384: 7.26 vs 8.22). The whole fp8 prefill now runs this FC1
  (``moe_prefill_cuda.WS_FC1``): 4.68 -> 4.48 ms. This FC2 (12 stages of K a CTA) measured 1.50 ms vs 1.44 for
  the register-A FC2's routed tiles; a CTA an SM looping over the work items (:data:`PERSIST`) changed neither by
  more than the noise.
- session 29 (Nsight Compute's stall sampling of FC2): a third of its samples were epilogue multiplies waiting on a
  row scale's load, which the compiler ordered after the previous stores (they might alias), so every item paid ~32
  L2 round trips; and each item searched its tile over the experts' offsets in global memory. Now the epilogues
  load every row scale before the first store, the CTA builds a tile table in shared memory once, and the items run
  tile-major (:data:`TMAJOR`) on a persistent grid (:data:`PERSIST`). T = 4096: FC1 1.94 -> 1.67 ms, FC2 1.66 ->
  1.10 ms (now on, ``moe_prefill_cuda.WS_FC2``); the whole fp8 prefill 3.89 -> 3.20 ms of kernels.

FC1: tokens in E4M3 with one float32 scale a row in natural K order (``moe_pf_quant`` with ``permute=0``), and with
TBULK as their tile image; act out in natural column order. With TBULK its launch also takes the shared expert's
FC1 (session 28): ceil(T / 128) more tiles of the image (the tokens in order), whose B is the shared weight
re-encoded to E4M3 on a power-of-two scale a row (:func:`shared_image`, made once a weight version) and bulk-copied
a stage with the A rows (no decode); its act [T, S] bf16 goes to FC2. The whole fp8 prefill 4.42 -> 4.14 ms at T =
4096, 16.8 -> 15.7 at 16384 (RESULTS.md, session 28). FC2: act in E4M3 with row scales (sorted-pair rows, natural K
order) and its tile image; y [T, slots, H] out. It takes the shared expert's items the same way (its act quantized to
E4M3 rows and imaged, its w2 re-encoded; K = S), with the routed items or in a launch of their own. Weights:
moe_cuda's prepacked NVFP4 copy (:func:`m3c.backends.kernels.moe_cuda.prepack_nvfp4`), whose lane (g, j) holds rows
g, g + 8 at K 16 j .. 16 j + 15 of each 64-K chunk — one 16-byte E4M3 row chunk each, written where B's K-major core
matrices want them.
"""

from __future__ import annotations

import functools

import torch

from m3c.backends.cuda_aot import CudaKernelSpec, arg_types
from m3c.backends.triton_aot import Runner, jit_run
from m3c.errors import ConfigError, ShapeError
from m3c.model_defs.quant import MXFP8Tensor

SOURCE = "moe_prefill_ws.cu"
STAGES = 3  # A / B buffers (48 KiB each)
RAW = 3  # raw code / scale buffers (20 KiB each)
BT = 128  # sorted pair rows a work item (a tile of one expert's pairs: FC1's tokens, FC2's act rows)
COLS = 128  # intermediate columns a CTA (its 256 gate and up rows)
KS = 128
IMAGE_SPLIT = 8  # CTAs a tile in token_image (each writes every IMAGE_SPLIT-th stage)
PERSIST = True  # a CTA an SM looping over the (tile, row block) items, instead of a CTA an item
LUT = True  # the E4M3 product tables looked up by scale byte in a shared table built once a CTA (2.30 -> 2.16 ms)
TBULK = True  # the tokens by one 16 KiB bulk copy a stage from a tile image (:func:`token_image`), not cp.async
TMAJOR = True  # the work items tile-major (a tile's row blocks consecutive), else row-block-major
MAX_EXPERTS = 1024  # the most experts fc1 / fc2 take (the kernels' tile table in shared memory)
SKIP = 0  # timing probes (wrong results): 1 = the consumers issue no MMAs, 2 = the producer decodes nothing, 3 = both


def smem_bytes(stages: int, raw: int, tbulk: bool = False) -> int:
    """Dynamic shared memory: the A (tokens) and B (decoded weights) buffers (8 K chunks of 16 bytes a row, each
    chunk's rows padded by 64 / 32 bytes against bank conflicts; A unpadded with ``tbulk``) and the raw code / scale
    ring."""
    return stages * 8 * ((BT * 16 + (0 if tbulk else 64)) + (2 * COLS * 16 + 32)) + raw * (16 * 1024 + 16 * 256)


_ARGS = {"moe_ws_fc1": "*xq *xs *order *offs *rcode *rscale *rrow *act *xt *sb *srow *sact T H I S E topk wexp ntiles "
                       "nsh",
         "moe_ws_fc2": "*act8 *as *order *wts *offs *rcode *rscale *rrow *y *xt *st *sas *sb *srow T H I S E topk "
                       "slots wexp ntiles nsh"}


def smem_limit() -> int:
    """The dynamic shared memory a GEMM build may take: 227 KiB less the static arrays (the barriers, the tile table's
    4 KiB for :data:`MAX_EXPERTS`, and with :data:`LUT` the lookup table's 2 KiB)."""
    return 227 * 1024 - 2048 - 4 * (MAX_EXPERTS + 1) - 2048 * LUT


def fc1_spec() -> CudaKernelSpec:
    """The FC1 kernel's spec at the current :data:`STAGES` / :data:`RAW`."""
    return _gemm_spec("moe_ws_fc1", TBULK)


def fc2_spec() -> CudaKernelSpec:
    """The FC2 kernel's spec (always :data:`TBULK`: its A rows come from the act's tile image)."""
    return _gemm_spec("moe_ws_fc2", True)


def _gemm_spec(kernel: str, tbulk: bool) -> CudaKernelSpec:
    """FC1's or FC2's spec at the current build knobs, checked."""
    if not 2 <= STAGES <= 4 or not 2 <= RAW <= 4 or smem_bytes(STAGES, RAW, tbulk) > smem_limit():
        raise ConfigError(f"moe_prefill_ws: STAGES {STAGES}, RAW {RAW} (2..4 each, at most {smem_limit() // 1024} KiB "
                          f"of dynamic shared memory)")
    return _spec(kernel, STAGES, RAW, SKIP, LUT, tbulk, TMAJOR, MAX_EXPERTS)


@functools.cache
def _spec(kernel: str, stages: int, raw: int, skip: int, lut: bool, tbulk: bool, tmajor: bool,
          max_experts: int) -> CudaKernelSpec:
    flags = (("SKIP", skip),) * bool(skip) + (("LUT", 1),) * lut + (("TBULK", 1),) * tbulk + (("TMAJOR", 1),) * tmajor
    d = (("STAGES", stages), ("RAW", raw), ("MAXE", max_experts), *flags)
    return CudaKernelSpec("megamoe_prefill_ws", SOURCE, kernel, arg_types(_ARGS[kernel]), d, 12,
                          smem_bytes(stages, raw, tbulk))


def supports(hidden: int, inter: int, experts: int = 1) -> bool:
    """Whether :func:`fc1` takes H, I and E (H a multiple of 256: whole scale super-chunks; I of :data:`COLS`; E at
    most :data:`MAX_EXPERTS`)."""
    return hidden % 256 == 0 and inter % COLS == 0 and 0 < experts <= MAX_EXPERTS


def supports_fc2(hidden: int, inter: int, experts: int = 1) -> bool:
    """Whether :func:`fc2`'s routed tiles take H, I and E (H a multiple of 256: its 256-row CTAs; I of 256: whole
    scale super-chunks; E at most :data:`MAX_EXPERTS`)."""
    return hidden % 256 == 0 and inter % 256 == 0 and 0 < experts <= MAX_EXPERTS


def grid(items: int, device: torch.device) -> tuple[int]:
    """The kernels' 1-D grid for ``items`` (tile, row block) work items: one CTA each, or with :data:`PERSIST` one
    CTA an SM (at most), each looping over every gridDim-th item."""
    return (min(items, _sms(device)) if PERSIST else items,)


@functools.cache
def _sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132


def max_tiles(pairs: int, experts: int) -> int:
    """The bound on tiles of BT sorted pairs that FC1, FC2 and the tile image take: at most one partial tile an
    expert beyond ceil(pairs / BT)."""
    return min(-(-pairs // BT) + experts, pairs)


def image_shape(pairs: int, experts: int, k: int, shared_rows: int = 0) -> tuple[int, int]:
    """:func:`token_image`'s shape for rows of K bytes: a BT x KS-byte A buffer image a tile and 128-K stage (the
    routed tiles' bound, then ceil(shared_rows / BT) tiles of the shared expert's rows)."""
    return max_tiles(pairs, experts) + -(-shared_rows // BT), k // KS * BT * KS


B_BYTES = 8 * (2 * COLS * 16 + 32)  # a stage's B buffer: 8 K chunks of 16 bytes x 256 MMA columns, each padded by 32


def shared_image(w: MXFP8Tensor, gate_up: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """The shared expert's FC1 weight [2S, H] (``gate_up``; else its FC2 weight [H, S]; MXFP8: E4M3 codes, an E8M0
    scale a 32-K block) as the kernels' shared items bulk-copy it: (image, row scales).

    Each row is re-encoded on one power-of-two scale, 2^(emax - 127) with emax its largest block exponent among blocks
    holding a nonzero code (float32 [N]; 2^0 for an all-zero row, NaN where that block's scale is E8M0's NaN): code x
    2^(e - emax) rounded to E4M3, exact where the value stays within E4M3's normals (>= 2^-6 x the row scale), else
    rounded to its subnormal step (an error <= 2^-10 x the row scale: values > 2^14 below the row's largest, in
    blocks under it). The image, uint8 [N / 256, K / 128 x B_BYTES] for the [N, K] weight: row block rb's stage s is
    a B buffer, 128 K in 8 chunks of 16 (MMA column n's bytes at chunk kc, 16 n; 32 zero bytes after each chunk); its
    256 MMA columns are FC1's 128 gate and 128 up rows (column 16 m + r: gate row 128 rb + 8 m + r, 16 m + 8 + r: its
    up row), or FC2's rows 256 rb + n."""
    rows_n, k = w.data.shape  # (FC1: 2S, H; FC2: H, S)
    if rows_n % (2 * COLS) or k % KS or w.data.dtype != torch.float8_e4m3fn or w.scale.shape != (rows_n, k // 32):
        raise ShapeError(f"moe_prefill_ws.shared_image: need float8_e4m3fn [N, K] codes with N a multiple of "
                         f"{2 * COLS} and K of {KS} ([2S, H] or [H, S]), scales [N, K / 32]; got {w.data.dtype} "
                         f"{tuple(w.data.shape)}, {tuple(w.scale.shape)}")
    nst, nrb = k // KS, rows_n // (2 * COLS)
    codes = w.data.float().view(rows_n, k // 32, 32)
    e = w.scale.view(torch.uint8).to(torch.int32)
    emax = torch.where((codes != 0).any(-1), e, -1).amax(-1)
    emax = torch.where(emax < 0, 127, emax)
    shift = torch.ldexp(torch.ones_like(codes[..., 0]), (e - emax[:, None]).clamp(-60, 0))
    q = (codes * shift[..., None]).view(rows_n, k).to(torch.float8_e4m3fn).view(torch.uint8)
    srow = torch.ldexp(torch.ones(rows_n, device=q.device), emax - 127)
    srow = torch.where(emax == 255, torch.full_like(srow, float("nan")), srow)
    n = torch.arange(2 * COLS, device=q.device)
    if gate_up:  # MMA column n's row in row block rb: rb x step + rows[n]
        rows, step = (n // 16) * 8 + n % 8 + rows_n // 2 * ((n % 16) // 8), COLS
    else:
        rows, step = n, 2 * COLS
    g = q[torch.arange(nrb, device=q.device)[:, None] * step + rows]  # [rb, n, K]
    img = torch.zeros(nrb, nst, 8, 2 * COLS * 16 + 32, dtype=torch.uint8, device=q.device)
    img[..., :2 * COLS * 16] = g.view(nrb, 2 * COLS, nst, 8, 16).permute(0, 2, 3, 1, 4).reshape(nrb, nst, 8, -1)
    return img.view(nrb, nst * B_BYTES), srow


def _check_tensors(where: str, device: torch.device, tensors: tuple[tuple[str, torch.Tensor, torch.dtype], ...]
                   ) -> None:
    """Each (name, tensor, dtype): that dtype, contiguous, on ``device``; else a ShapeError naming it."""
    for name, v, dt in tensors:
        if v.dtype != dt or not v.is_contiguous() or v.device != device:
            raise ShapeError(f"{where}: {name} must be a contiguous {dt} tensor on {device}, got {v.dtype} on "
                             f"{v.device}")


@functools.cache
def image_spec() -> CudaKernelSpec:
    """The spec of ``moe_ws_image``, which writes :func:`token_image`."""
    return CudaKernelSpec("megamoe_prefill_ws", SOURCE, "moe_ws_image",
                          arg_types("*xq *order *offs *xt H E topk ntiles T"), (), 8, 0)


def token_image(xq: torch.Tensor, order: torch.Tensor, offs: torch.Tensor, top_k: int, *, shared: bool = False,
                out: torch.Tensor | None = None, runner: Runner = jit_run) -> torch.Tensor:
    """The tokens as :data:`TBULK`'s copies read them (``moe_ws_image``, :data:`IMAGE_SPLIT` CTAs a tile): for each
    tile of BT sorted pairs (the experts' tiles in expert order, as FC1's grid numbers them) and each stage, the 16
    KiB image of the A buffer (K chunk kc of tile row n at 2048 kc + 16 n); rows past an expert's last pair, and
    tiles past the last, are zero. ``shared``: then ceil(T / BT) tiles of xq's rows in order (FC1's shared-expert
    items). No host sync (capturable). uint8 :func:`image_shape` (``out`` if given)."""
    h = xq.shape[-1]
    p, e = order.numel(), offs.numel() - 1
    if xq.dim() != 2 or h % KS or xq.dtype != torch.uint8 or order.dtype != torch.int32 or offs.dtype != torch.int32:
        raise ShapeError(f"moe_prefill_ws.token_image: xq must be uint8 [T, H] with H a multiple of {KS}, order and "
                         f"offs int32; got xq {xq.dtype} {tuple(xq.shape)}, order {order.dtype}, offs {offs.dtype}")
    t = xq.shape[0] if shared else 0
    shape = image_shape(p, e, h, t)
    img = torch.empty(shape, dtype=torch.uint8, device=xq.device) if out is None else out
    if img.shape != shape or img.dtype != torch.uint8 or not img.is_contiguous() or img.device != xq.device:
        raise ShapeError(f"moe_prefill_ws.token_image: out must be a contiguous uint8 {list(shape)} tensor on "
                         f"{xq.device}, got {img.dtype} {tuple(img.shape)} on {img.device}")
    if img.shape[0]:
        runner(image_spec(), (img.shape[0], min(h // KS, IMAGE_SPLIT)),
               [xq, order, offs, img, h, e, top_k, max_tiles(p, e), t])
    return img


def fc1(xq: torch.Tensor, xs: torch.Tensor, order: torch.Tensor, offs: torch.Tensor, rcode: torch.Tensor,
        rscale: torch.Tensor, rrow: torch.Tensor, act: torch.Tensor, *, top_k: int, wexp: int,
        xt: torch.Tensor | None = None, shared: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
        runner: Runner = jit_run) -> torch.Tensor:
    """act[p, c] = SiLU(gate) * up of sorted pair p (order[p] = token * top_k + slot) for the routed experts:
    xq [T, H] E4M3 codes (uint8) with row scales xs [T]; offs [E + 1] the experts' pair offsets; (rcode, rscale)
    moe_cuda's prepacked w13 [E, 2I, H]; rrow (E x 2I float32) its per-row tensor scales; wexp its fp8 exponent
    (:func:`m3c.backends.kernels.moe_prefill_cuda.fp8_exponent`); act [T * top_k, I] bf16 (written). With
    :data:`TBULK` the tokens are read from ``xt`` (:func:`token_image` of xq, order, offs), which it needs.
    ``shared`` = (image, srow, sact) (TBULK only): also the shared expert's act [T, S] bf16 in the same launch, from
    its :func:`shared_image` (image, srow) and xt made with ``shared=True``."""
    t, h = xq.shape
    p, inter = act.shape
    e = offs.numel() - 1
    where = f"moe_prefill_ws.fc1: xq {tuple(xq.shape)}, act {tuple(act.shape)}"
    if not supports(h, inter, e):  # (the prepacked scales come in 256-K super-chunks)
        raise ShapeError(f"{where}, {e} experts: H must be a multiple of 256, I of {COLS}, the experts at most "
                         f"{MAX_EXPERTS}")
    if p != t * top_k or xs.shape != (t,) or rrow.numel() != e * 2 * inter or order.shape != (p,):
        raise ShapeError(f"{where}, xs {tuple(xs.shape)}, order {tuple(order.shape)}, rrow {tuple(rrow.shape)}, "
                         f"top_k {top_k}: act must be [T * top_k, I], xs [T], order [T * top_k], rrow E x 2I")
    _check_tensors("moe_prefill_ws.fc1", act.device, (
        ("xq", xq, torch.uint8), ("xs", xs, torch.float32), ("order", order, torch.int32),
        ("offs", offs, torch.int32), ("rrow", rrow, torch.float32), ("act", act, torch.bfloat16)))
    sb, srow, sact = shared if shared is not None else (xq, xs, act)
    s = 0
    if shared is not None:
        if (sb.dim(), srow.dim(), sact.dim()) != (2, 1, 2):
            raise ShapeError(f"{where}: the shared expert's image, srow and act must be 2-D, 1-D and 2-D tensors, got "
                             f"{sb.dim()}-D, {srow.dim()}-D, {sact.dim()}-D")
        s = sact.shape[1]
        if not TBULK:
            raise ConfigError("moe_prefill_ws.fc1: the shared expert's items need TBULK (their tokens come from the "
                              "tile image); run them on moe_prefill_cuda's FC1 instead")
        want = (s // COLS, h // KS * B_BYTES)
        if s % COLS or sact.shape[0] != t or srow.shape != (2 * s,) or sb.shape != want:
            raise ShapeError(f"{where}: the shared expert's act {tuple(sact.shape)} must be [T, S] with S a multiple "
                             f"of {COLS}, srow [2S], its image {list(want)} (shared_image); got srow "
                             f"{tuple(srow.shape)}, image {tuple(sb.shape)}")
        _check_tensors("moe_prefill_ws.fc1", act.device, (
            ("the shared image", sb, torch.uint8), ("srow", srow, torch.float32), ("sact", sact, torch.bfloat16)))
    shape = image_shape(p, e, h, t if s else 0)
    tiles = max_tiles(p, e)
    if TBULK and (xt is None or xt.dtype != torch.uint8 or xt.shape != shape
                  or not xt.is_contiguous() or xt.device != act.device):
        got = None if xt is None else f"{xt.dtype} {tuple(xt.shape)} on {xt.device}"
        made = ", shared=True" if shared is not None else ""
        raise ShapeError(f"moe_prefill_ws.fc1: TBULK reads the tokens' tile image: xt must be a contiguous uint8 "
                         f"{list(shape)} tensor on {act.device} (token_image(xq, order, offs, top_k{made})), got {got}")
    if p == 0:
        return act
    nsh = shape[0] - tiles
    runner(fc1_spec(), grid((tiles + nsh) * (max(inter, s) // COLS), act.device),
           [xq, xs, order, offs, rcode, rscale, rrow, act, xt if TBULK else xq, sb, srow, sact, t, h, inter, s, e,
            top_k, wexp, tiles, nsh])
    return act


def fc2(act8: torch.Tensor, a_s: torch.Tensor, order: torch.Tensor, wts: torch.Tensor, offs: torch.Tensor,
        rcode: torch.Tensor, rscale: torch.Tensor, rrow: torch.Tensor, y: torch.Tensor, xt: torch.Tensor, *,
        top_k: int, wexp: int, shared: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
        routed: bool = True, runner: Runner = jit_run) -> torch.Tensor:
    """y[pair / top_k, pair % top_k] = (act[p] . W2[e]) x rrow[e] x wts[pair] for every sorted pair p (pair =
    order[p]) of the routed experts: act8 [T * top_k, I] E4M3 codes (uint8, natural K order, sorted-pair rows) with
    row scales a_s; xt its :func:`token_image` (rows = pairs: order arange, top_k 1); wts the flat [T * top_k]
    routing weights; (rcode, rscale) moe_cuda's prepacked w2 [E, H, I], rrow (E x H float32) its per-row tensor
    scales, wexp its fp8 exponent; y [T, slots, H] bf16 (the routed slots written; slots > top_k leaves the rest).
    ``shared`` = (st, sas, image, srow): also y[:, top_k] = the shared expert's FC2 in the same launch, from its E4M3
    act [T, S] as a tile image st (``token_image(sact8, order[:0], offs, 1, shared=True)``) with row scales sas [T],
    and its w2's :func:`shared_image` (``gate_up=False``: image, srow). ``routed=False``: the shared items only."""
    p, inter = act8.shape
    t, slots, h = y.shape
    e = offs.numel() - 1
    shape = image_shape(p, e, inter)
    tiles = shape[0] if routed else 0
    where = f"moe_prefill_ws.fc2: act8 {tuple(act8.shape)}, y {tuple(y.shape)}"
    if not supports_fc2(h, inter, e if routed else min(e, 1)) or p != t * top_k \
            or slots < top_k + (shared is not None):  # (E only sizes the routed tiles' table: the shared ones take any)
        raise ShapeError(f"{where}, top_k {top_k}, {e} experts: H and I must be multiples of 256, act8 [T * top_k, "
                         f"I], y [T, >= top_k, H] (> top_k with the shared expert), the routed experts at most "
                         f"{MAX_EXPERTS}")
    if a_s.shape != (p,) or wts.shape != (p,) or order.shape != (p,) or rrow.numel() != e * h \
            or (routed and xt.shape != shape):
        raise ShapeError(f"{where}: a_s, wts and order must be [{p}], rrow E x H, xt {list(shape)} "
                         f"(token_image); got {tuple(a_s.shape)}, {tuple(wts.shape)}, {tuple(order.shape)}, "
                         f"{tuple(rrow.shape)}, {tuple(xt.shape)}")
    _check_tensors("moe_prefill_ws.fc2", y.device, (
        ("act8", act8, torch.uint8), ("a_s", a_s, torch.float32), ("order", order, torch.int32),
        ("wts", wts, torch.float32), ("offs", offs, torch.int32), ("rrow", rrow, torch.float32),
        ("y", y, torch.bfloat16), ("xt", xt, torch.uint8)))
    st, sas, sb, srow = shared if shared is not None else (xt, a_s, xt, a_s)
    s = nsh = 0
    if shared is not None:
        if (st.dim(), sas.dim(), sb.dim(), srow.dim()) != (2, 1, 2, 1):
            raise ShapeError(f"{where}: the shared expert's st, sas, w2 image and srow must be 2-D, 1-D, 2-D and 1-D "
                             f"tensors, got {st.dim()}-D, {sas.dim()}-D, {sb.dim()}-D, {srow.dim()}-D")
        s, nsh = sb.shape[1] // B_BYTES * KS, -(-t // BT)
        if s == 0 or sb.shape != (h // (2 * COLS), s // KS * B_BYTES) or sas.shape != (t,) or srow.shape != (h,) \
                or st.shape != (nsh, s * BT):
            raise ShapeError(f"{where}: the shared expert's w2 image must be [H / 256, S / 128 x {B_BYTES}] "
                             f"(shared_image(w2, gate_up=False)), sas [T], srow [H], st [ceil(T / 128), S x 128] "
                             f"(token_image of its E4M3 act); got {tuple(sb.shape)}, {tuple(sas.shape)}, "
                             f"{tuple(srow.shape)}, {tuple(st.shape)}")
        _check_tensors("moe_prefill_ws.fc2", y.device, (
            ("the shared image", sb, torch.uint8), ("st", st, torch.uint8), ("sas", sas, torch.float32),
            ("srow", srow, torch.float32)))
    if p and tiles + nsh:
        runner(fc2_spec(), grid((tiles + nsh) * (h // 256), y.device),
               [act8, a_s, order, wts, offs, rcode, rscale, rrow, y, xt, st, sas, sb, srow, t, h, inter, s,
                e if routed else 0, top_k, slots, wexp, tiles, nsh])  # (E only sizes the routed tiles' table)
    return y
