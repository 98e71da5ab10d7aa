"""Device helpers that decode the narrow float codes of m3c's formats into float32, exactly.

All work on int32 tensors holding the raw bits and build float32 bit patterns, so they are exact
on every GPU and in Triton's CPU interpreter (whose float8 conversions are not trustworthy):

- ``e2m1_to_f32``: NVFP4 element codes (0..15: sign, 2 exponent bits, 1 mantissa bit);
- ``e4m3_to_f32``: E4M3 bytes (NVFP4 block scales, FP8 values; subnormals, NaN for 0x7F / 0xFF);
- ``e8m0_to_f32``: E8M0 bytes (MXFP8 block scales: 2^(byte - 127); 0xFF is NaN);
- ``e2m1_tiny`` / ``e4m3_big``: the cheap pair the NVFP4 mainloops use — a nibble as value × 2^-126 in 3
  integer ops, a scale as value × 2^119 — so value × scale = their product × 2^7, exactly;
- ``e2m1_nibble_tiny``: nibble k of a 32-bit word of 8 codes as e2m1_tiny's float, in 3 ops, no byte
  extraction (the CUDA-core FMA paths load codes as words);
- ``e4m3_value``: E4M3 bytes as their plain float32 value in ~6 ops (cheaper than ``e4m3_to_f32``);
- ``e4m3_tiny``: E4M3 bytes as value × 2^-120 in 4 ops, no NaN handling (the MXFP8 mainloops: × TWO_120).

Two register helpers the CUDA-core paths share: ``pow2`` (2^e for an int32 e, exact) and ``slices8`` (the
8 in-thread lanes of a [A, B, 8] tensor as 8 [A, B] tensors, no data movement).

And the other way, ``to_stored``: float32 results into a stored dtype, bf16 rounded to nearest-even in
integer arithmetic, because Triton's CPU interpreter truncates float32 -> bf16 casts (a bias of up to
2^-8 per store that piles up over a kernel's stores: ~0.9% on a MoE layer); on a GPU it is the same
rounding the hardware conversion does.

A packed NVFP4 byte holds element 2i in its low nibble and 2i+1 in its high nibble.
"""

from __future__ import annotations

import triton
import triton.language as tl

TWO_120 = tl.constexpr(1.329227995784916e36)
"""2^120: undoes the 2^-120 of an E4M3 byte placed into float32 bits (``e4m3_value``, the MXFP8 mainloops)."""


@triton.jit
def e2m1_to_f32(c):
    """E2M1 codes (int32, 0..15) -> float32 values."""
    e = (c >> 1) & 3
    m = c & 1
    bits = tl.where(e == 0, m * 0x3F000000, ((e + 126) << 23) | (m << 22))  # e == 0: 0 or 0.5
    mag = bits.to(tl.float32, bitcast=True)
    return tl.where(c >= 8, -mag, mag)


@triton.jit
def e4m3_to_f32(s):
    """E4M3 bytes (int32, 0..255) -> float32 values (subnormals; NaN for 0x7F / 0xFF)."""
    e = (s >> 3) & 15
    m = s & 7
    normal = (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
    mag = tl.where(e == 0, m.to(tl.float32) * 0.001953125, normal)
    mag = tl.where((s & 0x7F) == 0x7F, (s * 0 + 0x7FC00000).to(tl.float32, bitcast=True), mag)
    return tl.where(s >= 128, -mag, mag)


@triton.jit
def e8m0_to_f32(s):
    """E8M0 bytes (int32, 0..255) -> 2^(s - 127) as float32 (0 -> 2^-127, a subnormal; 255 -> NaN)."""
    normal = (s << 23).to(tl.float32, bitcast=True)
    sub = tl.full(s.shape, 0x00400000, tl.int32).to(tl.float32, bitcast=True)  # 2^-127
    nan = tl.full(s.shape, 0x7FC00000, tl.int32).to(tl.float32, bitcast=True)
    return tl.where(s == 255, nan, tl.where(s == 0, sub, normal))


@triton.jit
def e2m1_tiny(b, SHIFT: tl.constexpr):
    """The E2M1 nibble at bit SHIFT (0 or 4) of bytes b (int32) as float32 × 2^-126, exactly, in 3 ops.

    The code's bits (s, e1 e0, m) become the float's sign, lowest two exponent bits and top mantissa
    bit, so e = 0 (0 and 0.5) lands on subnormals and every code gets the same factor 2^-126.
    """
    bits = ((b << (22 - SHIFT)) & 0x01C00000) | ((b << (28 - SHIFT)) & -2147483648)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def e4m3_big(byte):
    """E4M3 bytes (int32, 0..255) -> float32 × 2^119, exactly (NaN for 0x7F / 0xFF; 448 × 2^119 < 2^128)."""
    e = (byte >> 3) & 15
    m = byte & 7
    normal = (((e + 239) << 23) | (m << 20)).to(tl.float32, bitcast=True)
    mag = tl.where(e == 0, m.to(tl.float32) * 1.2980742146337069e33, normal)  # subnormal: m × 2^-9 × 2^119
    nan = tl.full(byte.shape, 0x7FC00000, tl.int32).to(tl.float32, bitcast=True)
    mag = tl.where((byte & 0x7F) == 0x7F, nan, mag)
    return tl.where(byte >= 128, -mag, mag)


@triton.jit
def e2m1_nibble_tiny(w, k):
    """Nibble k (0..7: an int or an int32 tensor) of int32 words w as float32 value × 2^-126, exactly (e2m1_tiny's
    bits), in 3 ops (2 for k = 7). Nibble k holds element k of the word's 8 codes (low nibble of byte i: 2i).

    Moved to bits 28..31, an arithmetic shift by 6 puts (e1 e0 m) on bits 22..24 and keeps the sign on bit 31.
    """
    return (((w << (28 - 4 * k)) >> 6) & -2118123520).to(tl.float32, bitcast=True)  # 0x81C00000


@triton.jit
def e4m3_value(b):
    """E4M3 bytes (int32, 0..255) -> float32 values, exactly (NaN for 0x7F / 0xFF), in ~6 ops.

    Moved to bits 24..31, an arithmetic shift by 4 puts (e, m) on the float's exponent LSBs and mantissa MSBs
    and keeps the sign: value × 2^-120 (e = 0 lands on subnormals, as in E4M3), times 2^120 the value (normal).
    """
    tiny = (((b << 24) >> 4) & -2014314496).to(tl.float32, bitcast=True)  # 0x87F00000
    return tl.where((b & 0x7F) == 0x7F, float("nan"), tiny * TWO_120)


@triton.jit
def e4m3_tiny(b):
    """E4M3 bytes (int32) placed into float32 bits: value × 2^-120 for normals and subnormals alike (the NaN codes
    0x7F / 0xFF read as ±480 × 2^-120: MXFP8 weights from a quantizer never hold them)."""
    return (((b & 0x7F) << 20) | ((b & 0x80) << 24)).to(tl.float32, bitcast=True)


@triton.jit
def to_stored(x, ty: tl.constexpr):
    """float32 x in dtype `ty`; bf16 rounds to nearest-even on the GPU and in the interpreter alike (NaN kept,
    overflow to ±inf)."""
    if ty == tl.bfloat16:
        bits = x.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
        x = tl.where(x != x, x, bits.to(tl.float32, bitcast=True))  # now exact in bf16
    return x.to(ty)


@triton.jit
def pow2(e):
    """2^e as float32 for int32 e in [-126, 127] (a normal power of two, exact)."""
    return ((e + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def slices8(x):
    """x[..., 0], ..., x[..., 7] of x [A, B, 8] as a tuple (in-thread registers: no data movement)."""
    a, b = tl.split(tl.reshape(x, [x.shape[0], x.shape[1], 4, 2]))  # even, odd k
    a0, a1 = tl.split(tl.reshape(a, [x.shape[0], x.shape[1], 2, 2]))  # k = 0, 4 / 2, 6
    b0, b1 = tl.split(tl.reshape(b, [x.shape[0], x.shape[1], 2, 2]))  # k = 1, 5 / 3, 7
    k0, k4 = tl.split(a0)
    k2, k6 = tl.split(a1)
    k1, k5 = tl.split(b0)
    k3, k7 = tl.split(b1)
    return k0, k1, k2, k3, k4, k5, k6, k7
