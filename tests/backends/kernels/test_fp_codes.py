"""The shared code decoders agree with torch's float8 / the reference quantizer on every code."""

import torch
import triton
import triton.language as tl

from m3c.backends.kernels.fp_codes import (
    TWO_120,
    e2m1_nibble_tiny,
    e2m1_to_f32,
    e4m3_tiny,
    e4m3_to_f32,
    e4m3_value,
    e8m0_to_f32,
    to_stored,
)
from m3c.model_defs import quant


@triton.jit
def _decode_kernel(src_ptr, out_ptr, N: tl.constexpr, WHICH: tl.constexpr):
    i = tl.arange(0, N)
    c = tl.load(src_ptr + i)
    if WHICH == 0:
        v = e2m1_to_f32(c)
    elif WHICH == 1:
        v = e4m3_to_f32(c)
    elif WHICH == 2:
        v = e8m0_to_f32(c)
    else:
        v = e4m3_tiny(c) * TWO_120
    tl.store(out_ptr + i, v)


def _decode(codes: torch.Tensor, which: int) -> torch.Tensor:
    out = torch.full(codes.shape, 12345.0)  # poisoned
    _decode_kernel[(1,)](codes, out, N=codes.numel(), WHICH=which)
    return out


def test_e2m1_every_code():
    codes = torch.arange(16, dtype=torch.int32)
    packed = (codes[0::2] | (codes[1::2] << 4)).to(torch.uint8)
    want = quant.nvfp4_dequantize(quant.NVFP4Tensor(packed.view(1, 8), torch.ones(1, 1).to(torch.float8_e4m3fn),
                                                    None)).flatten()
    assert torch.equal(_decode(codes, 0), want)


def test_e4m3_every_byte():
    codes = torch.arange(256, dtype=torch.int32)
    want = codes.to(torch.uint8).view(torch.float8_e4m3fn).float()
    got = _decode(codes, 1)
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan) and torch.equal(got[~nan], want[~nan])


def test_e4m3_tiny_every_byte():
    """e4m3_tiny × 2^120 is every finite E4M3 byte's value (the NaN codes read as ±480, documented)."""
    codes = torch.arange(256, dtype=torch.int32)
    want = codes.to(torch.uint8).view(torch.float8_e4m3fn).float()
    got = _decode(codes, 3)
    nan = want.isnan()
    assert torch.equal(got[~nan], want[~nan]) and torch.equal(got[nan], torch.tensor([480.0, -480.0]))


def test_e8m0_every_byte():
    codes = torch.arange(256, dtype=torch.int32)
    want = torch.exp2(codes.double() - 127).float()
    want[255] = float("nan")
    got = _decode(codes, 2)
    assert torch.isnan(got[255]) and torch.equal(got[:255], want[:255])


@triton.jit
def _fma_decode_kernel(w_ptr, s_ptr, nib_ptr, nibt_ptr, sc_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    w = tl.load(w_ptr + i)
    for k in tl.static_range(8):  # k a constant (the MSA indexer's use)
        tl.store(nib_ptr + k * N + i, e2m1_nibble_tiny(w, k))
    k8 = tl.arange(0, 8)  # k a tensor (the MoE GEMV tiles' use)
    tl.store(nibt_ptr + k8[None, :] * N + i[:, None], e2m1_nibble_tiny(w[:, None], k8[None, :]))
    tl.store(sc_ptr + i, e4m3_value(tl.load(s_ptr + i)))


def test_fma_decoders_are_exact(rng: torch.Generator) -> None:
    """The word decoders of the CUDA-core FMA paths: every E2M1 nibble at every position of a word (whatever its neighbours)
    as its value × 2^-126 (e2m1_tiny's bits, -0.0 included); every E4M3 byte as its value (0x7F / 0xFF: NaN)."""
    n = 256
    words = torch.randint(-(2**31), 2**31, (n,), dtype=torch.int64, generator=rng).to(torch.int32)
    words[:16] = torch.arange(16, dtype=torch.int32) * 0x11111111  # every code in every nibble
    nib = torch.full((8, n), 12345.0)
    nibt = torch.full((8, n), 12345.0)
    sc = torch.full((n,), 12345.0)
    _fma_decode_kernel[(1,)](words, torch.arange(n, dtype=torch.int32), nib, nibt, sc, N=n)
    assert torch.equal(nib.view(torch.int32), nibt.view(torch.int32))
    e2m1 = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], dtype=torch.float64)
    for k in range(8):
        want = (e2m1[(words.long() >> (4 * k)) & 15] * 2.0**-126).float()
        assert torch.equal(nib[k].view(torch.int32), want.view(torch.int32)), k
    want = torch.arange(n).to(torch.uint8).view(torch.float8_e4m3fn).float()
    nan = want.isnan()
    assert torch.equal(sc.isnan(), nan) and torch.equal(sc[~nan], want[~nan])


@triton.jit
def _store_kernel(src_ptr, out_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(out_ptr + i, to_stored(tl.load(src_ptr + i), out_ptr.dtype.element_ty))


def test_to_stored_rounds_bf16_to_nearest_even(rng: torch.Generator) -> None:
    """float32 -> bf16 stores equal torch's round-to-nearest-even (ties, overflow to inf, inf, NaN), also in
    the interpreter, whose own cast truncates."""
    x = torch.randn(256, generator=rng) * torch.exp2(torch.randint(-20, 20, (256,), generator=rng).float())
    ties = (0x3F800000 | (torch.randint(0, 128, (8,), generator=rng) << 16) | 0x8000).to(torch.int32)
    x[:8] = ties.view(torch.float32)  # exactly halfway between two bf16 values
    x[8:14] = torch.tensor([3.4e38, -3.4e38, float("inf"), float("-inf"), 0.0, -0.0])
    x[14] = float("nan")
    out = torch.zeros(256, dtype=torch.bfloat16)
    _store_kernel[(1,)](x, out, N=256)
    want = x.to(torch.bfloat16)
    assert torch.equal(out[:14], want[:14]) and torch.equal(out[15:], want[15:]) and out[14].isnan()
    assert torch.equal(out[8:10].float().abs(), torch.full((2,), float("inf")))  # rounds up past bf16's max
