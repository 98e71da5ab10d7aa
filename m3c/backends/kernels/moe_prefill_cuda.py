"""MegaMoE prefill grouped GEMMs on Hopper's wgmma, from CUDA C++ (``cuda/moe_prefill_wgmma.cu``).

Why: the Triton grouped GEMM (:mod:`m3c.backends.kernels.moe_prefill`) ran at 0.58x bf16 ``torch._grouped_mm`` at
T >= 4096 on the H200: Triton decodes the NVFP4 weights in a blocked layout and moves them through shared memory
(and gathers the tokens element by element) before each wgmma — ~725 SASS instructions a thread per 64 x 128 K
step, 33 barriers (offline sm_90a). Here each lane decodes its own bytes of a prepacked layout straight into
wgmma's A registers (bf16, A from registers: ~3 instructions a weight, amortized over 128 tokens), and the tokens
are wgmma's B, copied to shared memory by 16-byte ``cp.async`` (gathered rows, zero-filled past a tile's end).

Tiling: a CTA = 4 warpgroups x 64 weight rows (256 rows) x 128 tokens of one expert (or of the shared expert:
tiles 0 .. ceil(T / 128) - 1 of the same launches), K in stages of 64 through a 5-deep ring (180 KiB of shared
memory, prefetch distance 3); a warpgroup issues 4 ``wgmma.m64n128k16`` a stage and decodes step t + 1 while step t
runs. H200, m3.1-small (benchmarks/RESULTS.md, session 16): T = 4096 6.9 ms vs 9.8 for the Triton kernels (FC1 345
TFLOP/s, FC2 293: ~40% of bf16 peak, stalls spread over shared-memory issue, barriers and the decode chain). The grid is
(token tiles, row blocks) with the token tiles fastest, so the tiles of one expert run side by side and read its
weights from L2. Experts without tokens own no tile. Same four steps as the Triton path: FC1 (+ SiLU·up in the
epilogue) -> act [T·k, I] in sorted pair order, FC2 (x routing weight) -> y [T, k (+1), H], the deterministic
combine (Triton's ``moe_combine_kernel``).

Weights: the routed NVFP4 experts are read in the CUDA decode kernels' prepacked layout
(:func:`m3c.backends.kernels.moe_cuda.prepack_nvfp4`), so one prepacked copy serves decode and prefill: per 16-row
tile and 64-K chunk, lane (g, j) holds rows g, g + 8 of its scale group (K 16 j .. 16 j + 15 of the chunk, one E4M3
scale per row) in 4 steps of 4 K — its wgmma A fragment when the K order inside each 64-K chunk is permuted
(:func:`k_order`): the tokens are permuted the same way once per call (``xp``, an index_select) and FC1 stores the
routed act columns in that order for FC2. The MXFP8 shared expert has its own small copy (:func:`pack_mxfp8`,
natural K order): codes ``[tile][stage][lane][step][row g: K 2j, 2j + 1, 2j + 8, 2j + 9 | row g + 8]`` bytes,
scales ``[tile][stage][16 rows][2]``. FC1's CTA owns 128 intermediate columns: warps 0-7 their gate rows, warps 8-15
the up rows, which reach the gate warps through shared memory for SiLU·up. Numerics: weights exact in bf16 (value x
E4M3 scale <= 6 significant bits; MXFP8 x E8M0 exact), float32 accumulation, the per-row NVFP4 tensor scale on the
accumulator; act rounded as the reference's bf16 model (gate, up, SiLU(gate) and the product).

``precision="fp8"`` (:data:`PRECISION` the default; the build's ``ROUTED_FP8``): the routed tiles run
``wgmma.m64n128k32`` E4M3 x E4M3 in stages of 128 K (the same 128 bytes a token row a stage, the same prepacked
weights). Each lane takes, per 64-K chunk, two 8-byte tables of E4M3(magnitude x its rows' scale x 2^-wexp)
(``cvt.rn.satfinite.e4m3x2.f16x2``; :func:`fp8_exponent` keeps 6 x the largest scale in range; :data:`LUT`: the
CTA makes the table of each of the 256 scale bytes once, into shared memory, and the loop looks them up) and turns
each NVFP4 word into two E4M3 A registers by a byte lookup and the sign bits — the rounding Blackwell's ``QMUL4``
does.
The tokens and act are E4M3 with one float32 scale a row (amax / 448, the ``moe_pf_quant`` kernel; the tokens in
:func:`fp8_k_order`); the shared expert's tiles stay bf16. H200, m3.1-small, T = 4096 (RESULTS.md, session 17):
5.1 vs 6.9 ms (FC1 455 TFLOP/s, FC2 383), ~5% relative error vs the float64 reference instead of ~0.5%: the E4M3
rounding of tokens, act and weights (~4.8%) and the tensor core's E4M3 accumulator, which keeps fewer bits than
float32 (1.7% at K = 6144, growing with K; ``PROMOTE`` sums each 128-K stage in a fresh accumulator added in
float32 — exact, but its second accumulator only fits the registers at 2 warpgroups, 7.8 ms).

Build knobs measured and left off (session 19, fp8 at T = 4096): BT 256 x 2 warpgroups (``m64n256k32``; a tile of at
most 128 tokens runs the N = 128 MMA on the accumulator's first half) 6.5-6.7 ms vs 4.9; two CTAs an SM of 2
warpgroups (``CTAS``) 5.6-5.8; padded token chunks (``XPAD`` 64, no bank conflicts in the copies) unchanged. The
per-warp decode between MMAs is the limit (:mod:`m3c.backends.kernels.moe_prefill_ws` moves it to a producer).

Since session 27 (:data:`WS_FC1`) the fp8 build's routed FC1 tiles run on that warp-specialized kernel instead (its
tokens in natural K order and as a tile image, ``token_image``). Since session 28 (:data:`WS_SHARED`) the shared
expert's FC1 tiles run in that launch too (E4M3 tokens, its weight re-encoded to E4M3 rows); without it they run on
this module's FC1 in a second launch. Since session 29 (:data:`WS_FC2`) the routed FC2 tiles run on the
warp-specialized FC2 too (act in E4M3 rows and as a tile image), with the shared expert's FC2 tiles in the same
launch (:data:`WS_SHARED_FC2`): one GEMM launch fewer than before, and this module's kernels run the bf16 build,
PROMOTE and the shapes the warp-specialized ones do not take.
"""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

import torch
import triton

from m3c.backends.cuda_aot import CudaKernelSpec, arg_types
from m3c.backends.kernels import moe_prefill as mp
from m3c.backends.kernels import moe_prefill_ws as ws
from m3c.backends.kernels.host import derived, derived_ready, persistent, persistent_ready
from m3c.backends.kernels.moe_cuda import CaptureError, is_prepacked, packed_pair
from m3c.backends.options import MOE_PREFILL_PRECISIONS
from m3c.backends.triton_aot import Runner, jit_run
from m3c.errors import ConfigError, ShapeError, TargetError
from m3c.model_defs.quant import MXFP8Tensor, NVFP4Tensor

SOURCE = "moe_prefill_wgmma.cu"
WGS = 4  # warpgroups a CTA (64 weight rows each)
BT = 128  # tokens a CTA (wgmma N: 64, 128 or 256)
STAGES = 5  # cp.async ring depth (stages of 128 bytes a token row; prefetch distance STAGES - 2)
INFLIGHT = 1  # wgmma groups a warpgroup leaves in flight after each step (1, 2 or 3)
XPAD = 0  # bytes of padding between the token tile's 16-byte K chunks (64: bank-conflict-free cp.async)
CTAS = 1  # CTAs an SM the kernels' registers are held to (launch bounds); their shared memory must fit as many
LUT = True  # fp8: the E4M3 product tables looked up by scale byte in a shared table built once a CTA (bitwise the
# tables the loop would make; 4.7 vs 4.9 ms at T = 4096, RESULTS.md session 20)
WS_FC1 = True  # fp8: the routed FC1 tiles on the warp-specialized kernel (moe_prefill_ws, tokens by bulk copies from
# their tile image; the shared expert's with them under WS_SHARED, else on this module's FC1 in a second launch); act
# then re-ordered by the quantizer.
# The whole fp8 prefill 4.68 -> 4.48 ms at T = 4096, 17.5 -> 16.6 at 16384 (RESULTS.md, session 27)
WS_SHARED = True  # fp8 with WS_FC1: the shared expert's FC1 tiles as extra items of the warp-specialized FC1's
# launch, its weights re-encoded to E4M3 with a power-of-two scale a row (moe_prefill_ws.shared_image: bulk-copied, no
# decode) and its tokens in E4M3, instead of bf16 tiles on this module's FC1 in a second launch
WS_SHARED_FC2 = True  # fp8: the shared expert's FC2 tiles on the warp-specialized FC2 (its act in E4M3, its weight
# re-encoded to E4M3 rows like WS_SHARED's): with the routed ones where WS_FC2 runs them, else in a launch of its own.
# The whole fp8 prefill 4.19 / 4.21 -> 3.97 / 4.02 ms at T = 4096, 15.46 / 15.67 -> 15.17 / 15.12 at 16384 (RESULTS.md,
# session 28)
WS_FC2 = True  # fp8: the same for FC2 (its A rows from the E4M3 act's tile image). Session 27 measured it slower (1.50
# vs 1.44 ms at T = 4096); session 29 found its epilogue waiting on each row scale's load (ordered after the stores)
# and took the tile search out of its items: 1.10 ms with ws.PERSIST and ws.TMAJOR, the whole prefill -14%
PROMOTE = False  # fp8: each 128-K stage summed in a fresh accumulator, added in float32 (needs WGS <= 2: registers)
KST = 64
ROW_ALIGN = 256  # H and I must be multiples of 256 (the routed prepack's super-chunks; FC2's 256-row CTAs), S of 128
PRECISIONS = MOE_PREFILL_PRECISIONS
PRECISION = "bf16"
"""The routed tiles' MMA inputs by default: "bf16" (the weights exact, the tokens and act as given) or "fp8" (the
NVFP4 weights x their E4M3 scale rounded to E4M3 as Blackwell's QMUL4 rounds, the tokens and act in E4M3 with a
float32 scale a row: twice the MMA rate, ~2-3% error a product)."""
_TAG = "wgmma prefill"
_WEXP_TAG = "wgmma prefill fp8 exponent"
_WS_SHARED_TAG = "ws prefill shared image"


def _smem(bt: int, wgs: int, stages: int, xpad: int = 0) -> int:
    """Dynamic shared memory of the kernels: per stage the tokens (bt x 64 bf16 in 8 chunks of 16 bytes, each
    padded by xpad), codes and scales of 4 wgs tiles."""
    return stages * (bt * KST * 2 + 8 * xpad + 4 * wgs * 1024 + 4 * wgs * 256)


def supported(hidden: int, inter: int, shared_inter: int, act_dtype: str, w13_fmt: str,
              shared_fmt: str | None) -> str | None:
    """None if the wgmma prefill kernels take this layout, else the reason (the Triton grouped GEMM then runs)."""
    if w13_fmt != "nvfp4":
        return f"routed experts are {w13_fmt}: the wgmma prefill takes NVFP4"
    if shared_fmt not in (None, "none", "mxfp8"):
        return f"shared expert is {shared_fmt}: the wgmma prefill takes MXFP8 or none"
    if act_dtype != "bf16":
        return f"activations are {act_dtype}: the wgmma prefill takes bf16"
    if hidden % ROW_ALIGN or inter % ROW_ALIGN:
        return f"H = {hidden}, I = {inter}: both must be multiples of {ROW_ALIGN}"
    if shared_fmt == "mxfp8" and shared_inter % (ROW_ALIGN // 2):
        return f"shared I = {shared_inter}: must be a multiple of {ROW_ALIGN // 2}"
    return None


def check_precision(precision: str | None, name: str = "precision") -> str:
    """`precision` (None: :data:`PRECISION`) if it is one of :data:`PRECISIONS`, else a ConfigError naming `name`."""
    p = PRECISION if precision is None else precision
    if p not in PRECISIONS:
        raise ConfigError(f"{name}={p!r}: expected one of {PRECISIONS}")
    return p


def ws_specs(precision: str | None, hidden: int, inter: int, shared_inter: int = 0) -> tuple[CudaKernelSpec, ...]:
    """The warp-specialized kernels' specs (and their tile image's) where a call would run them (:func:`_plan`, any
    expert count it takes): fp8 without PROMOTE, H, I and the shared expert's S (0: none)."""
    plan = _plan(check_precision(precision) == "fp8", hidden, inter, 1, shared_inter)
    fc2 = plan.ws_fc2 or plan.ws_sh2
    return (*((ws.fc1_spec(),) if plan.ws_fc1 else ()), *((ws.fc2_spec(),) if fc2 else ()),
            *((ws.image_spec(),) if (plan.ws_fc1 and ws.TBULK) or fc2 else ()))


def specs(precision: str | None = None) -> tuple[CudaKernelSpec, ...]:
    """The CudaKernelSpecs of the current build settings (WGS, BT, STAGES; one build serves every layout: the sizes
    are runtime arguments): (FC1, FC2), and for ``precision="fp8"`` (default :data:`PRECISION`) the row quantizer
    that makes the E4M3 tokens and act."""
    fp8 = check_precision(precision) == "fp8"
    if BT not in (64, 128, 256) or WGS not in (1, 2, 4) or not 3 <= STAGES <= 8 or (fp8 and BT == 64) \
            or INFLIGHT not in (1, 2, 3) or (PROMOTE and fp8 and (WGS > 2 or BT != 128)):
        raise ConfigError(f"moe_prefill_cuda: BT {BT} (64 / 128 / 256; 128 or 256 for fp8), WGS {WGS} (1, 2, 4), "
                          f"STAGES {STAGES} (3..8), INFLIGHT {INFLIGHT} (1..3), PROMOTE {PROMOTE} (WGS <= 2, BT 128)")
    if CTAS not in (1, 2, 3, 4) or CTAS * WGS > 8:
        raise ConfigError(f"moe_prefill_cuda: CTAS {CTAS} (1..4 CTAs an SM, at most 8 warpgroups with WGS {WGS})")
    if XPAD % 16 or not 0 <= XPAD <= 112:
        raise ConfigError(f"moe_prefill_cuda: XPAD {XPAD} (a multiple of 16 in 0..112)")
    # an SM's 228 KiB holds CTAS x (the ring, 1 KiB the system reserves a CTA, the kernels' static arrays: 20 B a
    # token and the fp8 lookup table's 2 KiB)
    need = _smem(BT, WGS, STAGES, XPAD) + 1024 + 20 * BT + (2048 if LUT and fp8 else 0)
    if CTAS * need > 228 * 1024:
        raise ConfigError(f"moe_prefill_cuda: {STAGES} stages of BT {BT}, WGS {WGS} need {need} bytes of shared "
                          f"memory a CTA, more than {CTAS} CTA(s) of an H200 SM have")
    return _specs(BT, WGS, STAGES, fp8, INFLIGHT, PROMOTE and fp8, CTAS, XPAD, LUT and fp8)


@functools.cache
def _specs(bt: int, wgs: int, stages: int, fp8: bool, inflight: int, promote: bool,
           ctas: int, xpad: int, lut: bool = False) -> tuple[CudaKernelSpec, ...]:
    d = (("WGS", wgs), ("BT", bt), ("STAGES", stages), ("ROUTED_FP8", int(fp8)), ("INFLIGHT", inflight),
         ("PROMOTE", int(promote)), *((("CTAS", ctas),) if ctas > 1 else ()), *((("XPAD", xpad),) if xpad else ()),
         *((("LUT", 1),) if lut else ()))
    smem = _smem(bt, wgs, stages, xpad)

    def spec(kernel: str, args: str, warps: int = 4 * wgs, shared: int = smem) -> CudaKernelSpec:
        return CudaKernelSpec("megamoe_prefill_wgmma", SOURCE, kernel, arg_types(args), d, warps, shared)

    mm = (spec("moe_pf_fc1", "*x *xq *xs *order *offs *rcode *rscale *rrow *scode *sscale *act *sact T n_sh H I S E "
               "topk wexp"),
          spec("moe_pf_fc2", "*act *sact *as *order *wts *offs *rcode *rscale *rrow *scode *sscale *y T n_sh H I S E "
               "topk slots wexp"))
    return (*mm, spec("moe_pf_quant", "*src *dst *scale K permute", 8, 0)) if fp8 else mm


def k_order(k: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The K index at each position of moe_cuda's prepacked K order (k a multiple of 64): in each 64-K chunk, MMA
    step s, slot 2j + e % 2 + 8 (e // 2) holds K 16 j + 4 s + e."""
    pos = torch.arange(k, device=device)
    slot, step, base = pos % 16, (pos // 16) % 4, pos - pos % 64
    j, e = (slot % 8) // 2, slot % 2 + 2 * (slot // 8)
    return base + 16 * j + 4 * step + e


def fp8_k_order(k: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The K index at each position of the fp8 build's K order (k a multiple of 64; its own inverse): in each 64-K
    chunk, K 16 j + 4 t + e sits at 16 t + 4 j + e (the E4M3 k32 step's slots 4 j + e, 16 + 4 j + e hold what the
    bf16 steps 2 v, 2 v + 1 hold at lane j)."""
    n = torch.arange(k, device=device)
    return n - n % 64 + 16 * ((n // 4) % 4) + 4 * ((n // 16) % 4) + n % 4


def fp8_exponent(w: NVFP4Tensor) -> int:
    """The smallest wexp in [-14, 14] with 6 x (largest E4M3 scale of w) x 2^-wexp <= 448: the fp8 build decodes
    value x scale x 2^-wexp (the largest products near E4M3's top, small ones clear of its subnormals) and multiplies
    2^wexp back on the accumulator. Computed once per weight version (one host sync at the first call)."""
    def make() -> torch.Tensor:
        top = float(w.scale.float().abs().amax()) if w.scale.numel() else 0.0
        e = math.ceil(math.log2(6.0 * top / 448.0)) if top > 0 else 0
        return torch.tensor(min(14, max(-14, e)))
    return int(derived(w.scale, _WEXP_TAG, make))


def pack_mxfp8(data: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, scales) uint8 in the kernels' MXFP8 layout (module docstring) from E4M3 codes [R, K] and E8M0 scales
    [R, K/32] (R a multiple of 16, K of 64)."""
    rows, k = math.prod(data.shape[:-1]), data.shape[-1]
    if rows % 16 or k % KST or tuple(scale.shape[:-1]) != tuple(data.shape[:-1]) or scale.shape[-1] * 32 != k:
        raise ShapeError(f"pack_mxfp8: codes {tuple(data.shape)} / scales {tuple(scale.shape)} must be [R, K] / "
                         f"[R, K/32] with R % 16 == 0 and K % {KST} == 0")
    return _mx_codes(data), _mx_scales(scale)


def _mx_codes(data: torch.Tensor) -> torch.Tensor:
    rows, k = math.prod(data.shape[:-1]), data.shape[-1]
    d = data.view(torch.uint8).reshape(rows // 16, 2, 8, k // KST, 4, 2, 4, 2)  # tile, h, g, stage, step, half, j, e
    return d.permute(0, 3, 2, 6, 4, 1, 5, 7).contiguous().reshape(-1)  # tile, stage, g, j, step, h, half, e


def _mx_scales(scale: torch.Tensor) -> torch.Tensor:
    rows, groups = math.prod(scale.shape[:-1]), scale.shape[-1]
    s = scale.view(torch.uint8).reshape(rows // 16, 16, groups // 2, 2)  # tile, row, stage, group
    return s.permute(0, 2, 1, 3).contiguous().reshape(-1)


def _packed_shared(w: MXFP8Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernels' (codes, scales) of the shared expert's MXFP8 weight: each built once per version of its source."""
    return derived(w.data, _TAG, lambda: _mx_codes(w.data)), derived(w.scale, _TAG, lambda: _mx_scales(w.scale))


def _ws_shared(w: MXFP8Tensor, gate_up: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """The warp-specialized kernels' (image, row scales) of the shared expert's w13 (``gate_up``) or w2
    (:func:`moe_prefill_ws.shared_image`), built once per version of its codes and scales."""
    return derived(w.data, _WS_SHARED_TAG, lambda: ws.shared_image(w, gate_up), also=(w.scale,))


class _Plan(NamedTuple):
    """Which kernels one call runs (:func:`_plan`): the routed FC1 / FC2 tiles on the warp-specialized kernels, the
    shared expert's FC1 / FC2 tiles there (else on this module's kernels, which then need its MXFP8 pack)."""

    ws_fc1: bool
    ws_fc2: bool
    ws_sh: bool
    ws_sh2: bool
    has_sh: bool  # a shared expert (S > 0)

    @property
    def register_a_sh(self) -> bool:
        """Whether this module's FC1 runs the shared expert's tiles (and needs :func:`_packed_shared` of its w13)."""
        return self.has_sh and not self.ws_sh

    @property
    def register_a_sh2(self) -> bool:
        """Whether this module's FC2 runs the shared expert's tiles (and needs :func:`_packed_shared` of its w2)."""
        return self.has_sh and not self.ws_sh2


def _plan(fp8: bool, hidden: int, inter: int, experts: int, shared_inter: int) -> _Plan:
    """The kernels a call runs, from the knobs and shapes (S = shared_inter, 0: no shared expert);
    :func:`moe_prefill_wgmma`, :func:`state_ready` and :func:`ws_specs` all decide by it (PROMOTE asks for float32
    sums of each stage: only the register-A kernels do that)."""
    ws_fc1 = fp8 and WS_FC1 and not PROMOTE and ws.supports(hidden, inter, experts)
    ws_fc2 = fp8 and WS_FC2 and not PROMOTE and ws.supports_fc2(hidden, inter, experts)
    has_sh = shared_inter > 0
    ws_sh = has_sh and ws_fc1 and WS_SHARED and ws.TBULK and shared_inter % ws.COLS == 0
    ws_sh2 = has_sh and fp8 and WS_SHARED_FC2 and not PROMOTE and hidden % 256 == 0 and shared_inter % ws.KS == 0
    return _Plan(ws_fc1, ws_fc2, ws_sh, ws_sh2, has_sh)


def _k_order_key(device: torch.device, k: int) -> tuple:
    return ("moe_prefill_cuda k_order", str(device), k)


def _k_order_on(device: torch.device, k: int) -> torch.Tensor:
    """:func:`k_order` on a device, built once per (device, k)."""
    return persistent(_k_order_key(device, k), lambda: k_order(k, device))


def state_ready(x: torch.Tensor, w13: NVFP4Tensor, w2: NVFP4Tensor, shared_w13: Any, shared_w2: Any,
                precision: str | None = None) -> bool:
    """Whether everything a first call builds for these weights exists and is current (the routed prepacked copy, the
    shared expert's, the per-row tensor scales' expansion, the tokens' K order; for fp8 the weights' exponents): a
    call inside CUDA-graph capture must not build any of it (its values would exist only from the first replay on)."""
    e, two_i, h = w13.shape
    if check_precision(precision) == "fp8":
        ok = is_prepacked(w13, w2) and derived_ready(w13.scale, _WEXP_TAG) and derived_ready(w2.scale, _WEXP_TAG)
    else:
        ok = is_prepacked(w13, w2) and persistent_ready(_k_order_key(x.device, h))
    ok = ok and mp.nvfp4_row_scales_ready(w13, (e, two_i)) and mp.nvfp4_row_scales_ready(w2, (e, h))
    s = shared_w13.shape[0] // 2 if shared_w13 is not None else 0
    plan = _plan(check_precision(precision) == "fp8", h, two_i // 2, e, s)
    for w, used in ((shared_w13, plan.register_a_sh), (shared_w2, plan.register_a_sh2)):
        ok = ok and (not used or (derived_ready(w.data, _TAG) and derived_ready(w.scale, _TAG)))
    if plan.ws_sh:
        ok = ok and derived_ready(shared_w13.data, _WS_SHARED_TAG, also=(shared_w13.scale,))
    if plan.ws_sh2:
        ok = ok and derived_ready(shared_w2.data, _WS_SHARED_TAG, also=(shared_w2.scale,))
    return ok


def call_support(x: torch.Tensor, w13: Any, shared_w13: Any) -> str | None:
    """:func:`supported` for the tensors of one call."""
    fmt = "nvfp4" if isinstance(w13, NVFP4Tensor) else type(w13).__name__
    sfmt = None if shared_w13 is None else "mxfp8" if isinstance(shared_w13, MXFP8Tensor) else type(shared_w13).__name__
    act = "bf16" if x.dtype == torch.bfloat16 else str(x.dtype)
    if fmt != "nvfp4":
        return supported(0, 0, 0, act, fmt, sfmt)
    s = shared_w13.shape[0] // 2 if shared_w13 is not None else 0
    return supported(x.shape[1], w13.shape[1] // 2, s, act, fmt, sfmt)


def moe_prefill_wgmma(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w13: NVFP4Tensor,
                      w2: NVFP4Tensor, shared_w13: Any, shared_w2: Any, *, runner: Runner = jit_run,
                      out: torch.Tensor | None = None,
                      permutation: tuple[torch.Tensor, torch.Tensor] | None = None,
                      precision: str | None = None) -> torch.Tensor:
    """:func:`m3c.backends.kernels.moe_prefill.moe_prefill` (same arguments and result) on the wgmma kernels: routed
    NVFP4 experts + MXFP8 (or no) shared expert, bf16 tokens; the routed tiles in ``precision`` (default
    :data:`PRECISION`; the shared expert's are bf16, or for fp8 under :data:`WS_SHARED` / :data:`WS_SHARED_FC2` E4M3
    on the warp-specialized kernels). The prepacked weights are built at the first call per weight (outside
    CUDA-graph capture)."""
    precision = check_precision(precision)
    fp8 = precision == "fp8"
    lay = mp._layout(x, topk_ids, topk_weights, w13, w2, shared_w13, shared_w2)
    why = supported(lay.hidden, lay.inter, lay.shared_inter, lay.act_dtype, lay.w13_fmt, lay.shared_fmt)
    if why:
        raise ShapeError(f"moe_prefill_wgmma: {why}")
    t, h = x.shape
    k, e, i, s = lay.top_k, lay.experts, lay.inter, lay.shared_inter
    if out is None:
        out = torch.empty((t, h), dtype=x.dtype, device=x.device)
    elif tuple(out.shape) != (t, h) or out.dtype != x.dtype or not out.is_contiguous():
        raise ShapeError(f"out must be a contiguous {x.dtype} [{t}, {h}] tensor, got {out.dtype} {tuple(out.shape)}")
    if t == 0:
        return out
    if not x.is_contiguous() or x.data_ptr() % 16:
        x = torch.empty((t, h), dtype=x.dtype, device=x.device).copy_(x)
    ids = topk_ids.to(torch.int64).contiguous()
    wts = topk_weights.float().contiguous().view(-1)
    p = t * k
    order, offs = mp.checked_permutation(permutation, ids, e)
    if not x.is_cuda or torch.cuda.get_device_capability(x.device) != (9, 0):
        raise TargetError(f"moe_prefill_wgmma: the wgmma kernels run on sm_90 (H100 / H200) only, x is on {x.device}"
                          " (megamoe runs moe_prefill there)")
    for name, v in (("pair order", order), ("expert offsets", offs)):
        if v.device != x.device or not v.is_contiguous():
            raise ShapeError(f"permutation: the {name} must be a contiguous tensor on {x.device}, got {v.device}")
    if torch.cuda.is_current_stream_capturing() and not state_ready(x, w13, w2, shared_w13, shared_w2, precision):
        raise CaptureError("moe_prefill_wgmma: the prepacked weights (and the tokens' K order) are built at the first "
                           "call, which must run outside CUDA-graph capture: call once eagerly (a warm-up) first")
    mp.weight_args(w13, "nvfp4", (e, 2 * i, h), "w13")  # shape / dtype checks
    mp.weight_args(w2, "nvfp4", (e, h, i), "w2")
    c13, s13 = packed_pair(w13)  # the CUDA decode kernels' copy
    c2, s2 = packed_pair(w2)
    g13 = mp.nvfp4_row_scales(w13, (e, 2 * i), "w13")
    g2 = mp.nvfp4_row_scales(w2, (e, h), "w2")
    plan = _plan(fp8, h, i, e, s)
    has_sh = plan.has_sh
    sc13 = ss13 = sc2 = ss2 = c13  # (placeholders where no register-A kernel runs the shared expert's tiles)
    if has_sh:
        mp.weight_args(shared_w13, "mxfp8", (2 * s, h), "shared_w13")
        mp.weight_args(shared_w2, "mxfp8", (h, s), "shared_w2")
        if plan.register_a_sh:
            sc13, ss13 = _packed_shared(shared_w13)
        if plan.register_a_sh2:
            sc2, ss2 = _packed_shared(shared_w2)
    fc1, fc2, *quant = specs(precision)
    bt, rows = BT, 64 * WGS
    slots = k + int(has_sh)
    n_sh = triton.cdiv(t, bt) if has_sh else 0
    m_tiles = n_sh + min(triton.cdiv(p, bt) + e, p)
    act = torch.empty((p, i), dtype=x.dtype, device=x.device)
    sact = torch.empty((t, s), dtype=x.dtype, device=x.device) if has_sh else act
    y = torch.empty((t, slots, h), dtype=x.dtype, device=x.device)
    if mp.POISON_WORKSPACES:
        for buf in (act, sact, y):
            buf.fill_(float("nan"))
    ws_fc1, ws_fc2 = plan.ws_fc1, plan.ws_fc2
    if fp8:  # E4M3 rows with a float32 scale each: the tokens (in the fp8 K order; natural for ws_fc1), then act
        xq = torch.empty((t, h), dtype=torch.uint8, device=x.device)
        xs = torch.empty((t,), dtype=torch.float32, device=x.device)
        act8 = torch.empty((p, i), dtype=torch.uint8, device=x.device)
        a_s = torch.empty((p,), dtype=torch.float32, device=x.device)
        if mp.POISON_WORKSPACES:
            for buf in (xq, act8):
                buf.fill_(0x7F)  # E4M3 NaN
            for buf in (xs, a_s):
                buf.fill_(float("nan"))
        e13, e2 = fp8_exponent(w13), fp8_exponent(w2)
        runner(quant[0], (t,), [x, xq, xs, h, int(not ws_fc1)])
    else:
        xq, xs, act8, a_s, e13, e2 = x.index_select(1, _k_order_on(x.device, h)), wts, act, wts, 0, 0
    fc1_args = [x, xq, xs, order, offs, c13, s13, g13, sc13, ss13, act, sact, t, n_sh, h, i, s, e, k, e13]
    if ws_fc1:  # routed tiles on the warp-specialized kernel (act in natural column order), shared ones too or here
        ws_sh = plan.ws_sh
        xt = ws.token_image(xq, order, offs, k, shared=ws_sh, runner=runner) if ws.TBULK else None
        ws.fc1(xq, xs, order, offs, c13, s13, g13, act, top_k=k, wexp=e13, xt=xt,
               shared=(*_ws_shared(shared_w13), sact) if ws_sh else None, runner=runner)
        if n_sh and not ws_sh:
            runner(fc1, (n_sh, 2 * s // rows), fc1_args)
    else:
        runner(fc1, (m_tiles, max(2 * i, 2 * s) // rows), fc1_args)
    if fp8:  # (register-A FC1 writes act in the fp8 K order and its FC2 reads that; the ws kernels the natural one)
        runner(quant[0], (p,), [act, act8, a_s, i, int(ws_fc1 != ws_fc2)])
    ws_sh2 = plan.ws_sh2
    sh2 = None
    if ws_sh2:  # the shared expert's act in E4M3 with row scales, as a tile image
        sact8 = torch.empty((t, s), dtype=torch.uint8, device=x.device)
        sas = torch.empty((t,), dtype=torch.float32, device=x.device)
        if mp.POISON_WORKSPACES:
            sact8.fill_(0x7F)
            sas.fill_(float("nan"))
        runner(quant[0], (t,), [sact, sact8, sas, s, 0])
        st = ws.token_image(sact8, order[:0], offs, 1, shared=True, runner=runner)
        sh2 = (st, sas, *_ws_shared(shared_w2, gate_up=False))
    fc2_args = [act8, sact, a_s, order, wts, offs, c2, s2, g2, sc2, ss2, y, t, 0 if ws_sh2 else n_sh, h, i, s, e, k,
                slots, e2]
    if ws_fc2:  # routed tiles on the warp-specialized kernel, shared ones too or here
        rows_img = ws.token_image(act8, torch.arange(p, dtype=torch.int32, device=x.device), offs, 1, runner=runner)
        ws.fc2(act8, a_s, order, wts, offs, c2, s2, g2, y, rows_img, top_k=k, wexp=e2, shared=sh2, runner=runner)
        if n_sh and not ws_sh2:
            runner(fc2, (n_sh, h // rows), fc2_args)
    else:  # routed tiles here (and the shared ones, or those in a warp-specialized launch of their own)
        runner(fc2, (m_tiles - (n_sh if ws_sh2 else 0), h // rows), fc2_args)
        if ws_sh2:
            ws.fc2(act8, a_s, order, wts, offs, c2, s2, g2, y, sh2[0], top_k=k, wexp=e2, shared=sh2, routed=False,
                   runner=runner)
    tiles = mp._tile_options(lay, "large", False)  # the deterministic combine: moe_prefill's Triton kernel
    runner(mp._specs(lay, tiles, upcast=False)[2], (triton.cdiv(t, tiles.bt), h // tiles.bh), (y, ids, out, t))
    return out
