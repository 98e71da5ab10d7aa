"""Reference number formats: NVFP4, MXFP8 and FP8 E4M3 (per tensor / per token), in plain vectorized torch.

Everything is computed in float32 (float16 / bfloat16 / float64 / integer inputs are cast first) and is
bit-exact and deterministic on any device.  Kernels and saved artifacts depend on these layouts:

NVFP4 (``NVFP4Tensor``), logical shape ``[..., K]`` with ``K % 16 == 0``:
  * ``data``: uint8 ``[..., K/2]``.  Byte ``j`` holds element ``2j`` in its LOW nibble (bits 0-3) and element
    ``2j+1`` in its HIGH nibble (bits 4-7).  A nibble is an E2M1 code: bit 3 sign, bits 2-1 exponent (bias 1),
    bit 0 mantissa; codes 0..7 are 0, 0.5, 1, 1.5, 2, 3, 4, 6 and codes 8..15 their negatives (8 is -0).
  * ``scale``: float8_e4m3fn ``[..., K/16]``, one per 16 consecutive elements of the last dim.
  * ``global_scale``: float32 tensor broadcastable to ``[..., 1]`` (a 0-d per-tensor scale, ``[N, 1]`` per row,
    ``[E, 1, 1]`` per expert), or ``None`` meaning 1.0 (the MSA KV-cache layout has no per-tensor scale).
  * value = e2m1(code) * float(scale) * global_scale, evaluated as ``(e2m1 * scale) * global_scale`` in float32.
  * quantize: ``scale = e4m3_rne(min(amax_block / 6 / global_scale, 448))``; ``code = e2m1_rne(x / (scale *
    global_scale))`` saturating at +-6.  Subnormal E4M3 scales are kept; a block whose scale is 0 (all zeros, or
    so small that the scale underflows) gets +-0 codes.  The sign bit of a code always follows the input's sign
    bit, so -0.0 (and a negative value that rounds to zero) encodes as code 8, as torchao does.

MXFP8 (``MXFP8Tensor``, OCP MX v1.0), logical shape ``[..., K]`` with ``K % 32 == 0``:
  * ``data``: float8_e4m3fn ``[..., K]``; ``scale``: uint8 ``[..., K/32]`` E8M0 biased exponents, bias 127:
    byte ``b`` means ``2**(b - 127)`` (byte 0 is ``2**-127``), byte 255 is NaN.
  * quantize: ``scale = 2**(floor(log2 amax_block) - 8)`` (8 = E4M3's largest exponent) clamped to the E8M0 range;
    ``data = e4m3_rne(clamp(x / scale, -448, 448))``.  An all-zero block gets byte 0 and zero data (as torchao).

FP8 E4M3 per tensor / per token: ``data`` float8_e4m3fn with ``x ~= data * scale``; scale float32, 0-d or ``[..., 1]``,
``amax / 448`` (1.0 when amax is 0).  Values are saturated to +-448 before the cast.

Non-finite inputs (scales handled as torchao does):
  * NaN: a block (NVFP4, MXFP8) / tensor / token containing NaN gets a NaN scale (E4M3 0x7F, E8M0 255, float NaN),
    so the whole block dequantizes to NaN.  ``e2m1_encode(NaN)`` gives code 7 | sign bit of the NaN (torchao's
    bit trick gives 3 | sign); all codes of an NVFP4 NaN block are such NaN codes.
  * +-inf: NVFP4 saturates (scale 448, the inf element becomes code +-6).  MXFP8 reads inf's amax as ``2**128``
    (scale byte 247), the inf element saturates to +-448 and dequantizes back to +-inf (448 * 2**120 overflows).
    FP8 with an explicit scale saturates inf to +-448; with a computed scale the scale becomes inf (finite
    elements -> 0, inf elements -> NaN).

Known differences from torchao 0.18 (``torchao/prototype/mx_formats``), kept on purpose:
  * ``nvfp4_tensor.nvfp4_quantize`` clamps block scales to >= 2**-6 (``E4M3_EPS``, the smallest normal E4M3) before
    the cast; here they round to E4M3 subnormals (or 0) instead.
  * It multiplies by the reciprocal, ``x * (1/scale)`` or ``x * ((1/global_scale) / scale)``, instead of dividing,
    so values exactly on an E2M1 midpoint can round away from even (e.g. scale 0.9375, x 2.34375 -> 3, not 2).
  * ``mx_tensor.to_mx`` divides by ``max(scale, 2**-126)``, so blocks with scale byte 0 but nonzero amax
    (amax < 2**-118) get elements twice too small for the stored ``2**-127`` scale; here they are consistent.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from m3c.errors import QuantizationError

NVFP4_BLOCK = 16
MXFP8_BLOCK = 32
E2M1_MAX = 6.0
E4M3_MAX = 448.0
E8M0_BIAS = 127
E8M0_NAN = 255
_E4M3_MAX_EXP = 8

E2M1_VALUES = torch.tensor(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], dtype=torch.float32
)
"""The value of each E2M1 code 0..15 (code 8 is -0.0)."""

# Midpoints between adjacent E2M1 magnitudes.  A tie goes to the even code: the midpoints that should round UP
# (0.75 -> 1, 1.75 -> 2, 3.5 -> 4) are replaced by the float32 just below them, so the number of boundaries strictly
# below |x| is the round-to-nearest-even magnitude code.  It is counted as 7 - #(|x| <= b), so NaN counts as 7.
_E2M1_BOUNDS: tuple[float, ...] = tuple(
    torch.nextafter(torch.tensor(m), torch.tensor(0.0)).item() if up else m
    for m, up in ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))
)


@dataclass
class NVFP4Tensor:
    """NVFP4 tensor: packed E2M1 codes, E4M3 block scales (16 elements) and an optional float32 global scale."""

    data: torch.Tensor
    scale: torch.Tensor
    global_scale: torch.Tensor | None

    @property
    def shape(self) -> torch.Size:
        """Logical (unpacked) shape ``[..., K]``."""
        return torch.Size((*self.data.shape[:-1], self.data.shape[-1] * 2))


@dataclass
class MXFP8Tensor:
    """MXFP8 tensor: E4M3 elements and uint8 E8M0 block scales (32 elements)."""

    data: torch.Tensor
    scale: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        """Logical shape ``[..., K]``."""
        return self.data.shape


def _as_float32(x: torch.Tensor, who: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise QuantizationError(f"{who}: expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype == torch.bool or x.is_complex():
        raise QuantizationError(f"{who}: cannot quantize a {x.dtype} tensor; pass a real floating or integer tensor")
    return x.to(torch.float32)


def _blocks(x: torch.Tensor, block: int, who: str) -> torch.Tensor:
    """View ``x [..., K]`` as ``[..., K/block, block]`` or raise QuantizationError."""
    if x.ndim == 0 or x.shape[-1] % block:
        raise QuantizationError(
            f"{who}: last dim of shape {tuple(x.shape)} is not divisible by the block size {block}; "
            f"pad it to a multiple of {block}"
        )
    return x.reshape(*x.shape[:-1], x.shape[-1] // block, block)


def e2m1_encode(x: torch.Tensor) -> torch.Tensor:
    """E2M1 codes (uint8, 0..15) of ``x``: round to nearest, ties to even, saturating at +-6; sign bit kept."""
    xf = _as_float32(x, "e2m1_encode")
    a = xf.abs()
    below = (a <= _E2M1_BOUNDS[0]).to(torch.uint8)
    for bound in _E2M1_BOUNDS[1:]:
        below += a <= bound
    return (7 - below) | (torch.signbit(xf).to(torch.uint8) << 3)


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """Float32 values of E2M1 codes (uint8, 0..15)."""
    if codes.dtype != torch.uint8:
        raise QuantizationError(f"e2m1_decode: codes must be uint8, got {codes.dtype}")
    if codes.numel() and int(codes.max()) > 15:
        raise QuantizationError(f"e2m1_decode: codes must be 0..15, got a maximum of {int(codes.max())}")
    return E2M1_VALUES.to(codes.device)[codes.to(torch.int64)]


def _pack(codes: torch.Tensor) -> torch.Tensor:
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """Pack 4-bit codes uint8 ``[..., K]`` into uint8 ``[..., K/2]``: element 2i low nibble, 2i+1 high nibble."""
    if codes.dtype != torch.uint8 or codes.ndim == 0 or codes.shape[-1] % 2:
        raise QuantizationError(
            f"pack_nibbles: need uint8 codes with an even last dim, got {codes.dtype} of shape {tuple(codes.shape)}"
        )
    if codes.numel() and int(codes.max()) > 15:
        raise QuantizationError(f"pack_nibbles: codes must be 0..15, got a maximum of {int(codes.max())}")
    return _pack(codes)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of ``pack_nibbles``: uint8 ``[..., K/2]`` -> codes uint8 ``[..., K]``."""
    if packed.dtype != torch.uint8 or packed.ndim == 0:
        raise QuantizationError(
            f"unpack_nibbles: need a uint8 tensor, got {packed.dtype} of shape {tuple(packed.shape)}"
        )
    return torch.stack((packed & 0x0F, packed >> 4), dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def _global_scale(global_scale: float | torch.Tensor | None, x: torch.Tensor) -> torch.Tensor | None:
    """Validate ``global_scale`` (positive, finite, broadcastable to ``x.shape[:-1] + (1,)``) as float32."""
    if global_scale is None:
        return None
    gs = torch.as_tensor(global_scale, dtype=torch.float32, device=x.device)
    target = (*x.shape[:-1], 1)
    try:
        ok = torch.broadcast_shapes(gs.shape, target) == target
    except RuntimeError:
        ok = False
    if not ok:
        raise QuantizationError(
            f"nvfp4: global_scale of shape {tuple(gs.shape)} does not broadcast to {target} for input {tuple(x.shape)}"
        )
    if not bool(((gs > 0) & torch.isfinite(gs)).all()):
        raise QuantizationError("nvfp4: global_scale must be positive and finite")
    return gs


def nvfp4_global_scale(x: torch.Tensor) -> torch.Tensor:
    """Per-tensor NVFP4 scale ``amax(|x|) / (6 * 448)`` (0-d float32) so block scales use the E4M3 range; 1.0 if amax is 0."""
    xf = _as_float32(x, "nvfp4_global_scale")
    if xf.numel() == 0:
        return torch.ones((), dtype=torch.float32, device=xf.device)
    amax = xf.abs().amax()
    return torch.where(amax == 0, torch.ones_like(amax), amax / (E4M3_MAX * E2M1_MAX))


def nvfp4_quantize(x: torch.Tensor, global_scale: float | torch.Tensor | None = None) -> NVFP4Tensor:
    """Quantize ``x [..., K]`` (K % 16 == 0) to NVFP4; see the module docstring for the exact layout and rounding."""
    xf = _as_float32(x, "nvfp4_quantize")
    blocks = _blocks(xf, NVFP4_BLOCK, "nvfp4_quantize")
    gs = _global_scale(global_scale, xf)
    target = blocks.abs().amax(dim=-1) / E2M1_MAX
    if gs is not None:
        target = target / gs
    scale = target.clamp(max=E4M3_MAX).to(torch.float8_e4m3fn)
    denom = scale.to(torch.float32)
    if gs is not None:
        denom = denom * gs
    denom = denom.unsqueeze(-1)
    q = torch.where(denom == 0, blocks * 0.0, blocks / denom)  # scale 0: +-0 codes, never 0/0
    codes = e2m1_encode(q).reshape(xf.shape)
    return NVFP4Tensor(data=_pack(codes), scale=scale, global_scale=gs)


def nvfp4_dequantize(t: NVFP4Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Dequantize an ``NVFP4Tensor`` (computed in float32, then cast to ``dtype``)."""
    if t.data.dtype != torch.uint8 or t.scale.dtype != torch.float8_e4m3fn:
        raise QuantizationError(
            f"nvfp4_dequantize: need uint8 data and float8_e4m3fn scale, got {t.data.dtype}, {t.scale.dtype}"
        )
    shape = t.shape
    if shape[-1] % NVFP4_BLOCK or tuple(t.scale.shape) != (*shape[:-1], shape[-1] // NVFP4_BLOCK):
        raise QuantizationError(
            f"nvfp4_dequantize: data {tuple(t.data.shape)} and scale {tuple(t.scale.shape)} do not match "
            f"(scale must be [..., K/{NVFP4_BLOCK}] for logical shape {tuple(shape)})"
        )
    vals = e2m1_decode(unpack_nibbles(t.data)).reshape(*shape[:-1], -1, NVFP4_BLOCK)
    out = vals * t.scale.to(torch.float32).unsqueeze(-1)
    if t.global_scale is not None:
        out = out * t.global_scale.to(device=out.device, dtype=torch.float32).unsqueeze(-1)
    return out.reshape(shape).to(dtype)


def mxfp8_quantize(x: torch.Tensor) -> MXFP8Tensor:
    """Quantize ``x [..., K]`` (K % 32 == 0) to OCP MXFP8 (E4M3 elements, E8M0 scales, floor scaling)."""
    xf = _as_float32(x, "mxfp8_quantize")
    blocks = _blocks(xf, MXFP8_BLOCK, "mxfp8_quantize")
    amax = blocks.abs().amax(dim=-1)
    # floor(log2 amax) from the float32 exponent field: -127 for 0 / subnormals (clamped anyway), 128 for inf.
    exp = ((amax.view(torch.int32) >> 23) & 0xFF) - E8M0_BIAS
    unbiased = (exp - _E4M3_MAX_EXP).clamp(min=-E8M0_BIAS, max=E8M0_BIAS)  # here always <= 120
    nan = torch.isnan(amax)
    scale = torch.where(nan, E8M0_NAN, unbiased + E8M0_BIAS).to(torch.uint8)
    # 1/scale = 2**-unbiased, built from its exponent bits (exact, a normal float32 for unbiased in [-127, 120]);
    # NaN blocks multiply by 0 (as x / inf in torchao): NaN/inf elements stay NaN, the rest become +-0.
    inv = ((E8M0_BIAS - unbiased) << 23).view(torch.float32)
    inv = torch.where(nan, torch.zeros_like(inv), inv)
    data = (blocks * inv.unsqueeze(-1)).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return MXFP8Tensor(data=data.reshape(xf.shape), scale=scale)


def mxfp8_dequantize(t: MXFP8Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Dequantize an ``MXFP8Tensor`` (computed in float32, then cast to ``dtype``)."""
    if t.data.dtype != torch.float8_e4m3fn or t.scale.dtype != torch.uint8:
        raise QuantizationError(
            f"mxfp8_dequantize: need float8_e4m3fn data and uint8 scale, got {t.data.dtype}, {t.scale.dtype}"
        )
    blocks = _blocks(t.data.to(torch.float32), MXFP8_BLOCK, "mxfp8_dequantize")
    if tuple(t.scale.shape) != tuple(blocks.shape[:-1]):
        raise QuantizationError(f"mxfp8_dequantize: scale {tuple(t.scale.shape)} must be {tuple(blocks.shape[:-1])}")
    scale = t.scale.view(torch.float8_e8m0fnu).to(torch.float32)  # 2**(b - 127); byte 255 -> NaN
    return (blocks * scale.unsqueeze(-1)).reshape(t.data.shape).to(dtype)


def _fp8_cast(xf: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (xf / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def _amax_scale(amax: torch.Tensor) -> torch.Tensor:
    return torch.where(amax == 0, torch.ones_like(amax), amax / E4M3_MAX)


def fp8_quantize_per_tensor(
    x: torch.Tensor, scale: float | torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 E4M3 with one scale: returns (data, 0-d float32 scale); scale None -> amax/448 (1.0 if amax is 0)."""
    xf = _as_float32(x, "fp8_quantize_per_tensor")
    if scale is None:
        s = _amax_scale(xf.abs().amax()) if xf.numel() else torch.ones((), device=xf.device)
    else:
        s = torch.as_tensor(scale, dtype=torch.float32, device=xf.device)
        if s.numel() != 1:
            raise QuantizationError(f"fp8_quantize_per_tensor: scale must hold one value, got shape {tuple(s.shape)}")
        s = s.reshape(())
    return _fp8_cast(xf, s), s


def fp8_quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 E4M3 with one scale per row of the last dim: returns (data, float32 scale ``[..., 1]`` = amax/448)."""
    xf = _as_float32(x, "fp8_quantize_per_token")
    if xf.ndim == 0 or xf.shape[-1] == 0:
        raise QuantizationError(f"fp8_quantize_per_token: need a non-empty last dim, got shape {tuple(xf.shape)}")
    s = _amax_scale(xf.abs().amax(dim=-1, keepdim=True))
    return _fp8_cast(xf, s), s


def fp8_dequantize(data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``data * scale`` in float32, cast to ``dtype`` (scale 0-d or broadcastable, e.g. ``[..., 1]``)."""
    if data.dtype != torch.float8_e4m3fn:
        raise QuantizationError(f"fp8_dequantize: data must be float8_e4m3fn, got {data.dtype}")
    return (data.to(torch.float32) * torch.as_tensor(scale, dtype=torch.float32, device=data.device)).to(dtype)
