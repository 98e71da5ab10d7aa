"""The shared code decoders agree with torch's float8 / the reference quantizer on every code."""

import torch
import triton
import triton.language as tl

from m3c.backends.kernels.fp_codes import e2m1_to_f32, e4m3_to_f32, e8m0_to_f32
from m3c.model_defs import quant


@triton.jit
def _decode_kernel(src_ptr, out_ptr, N: tl.constexpr, WHICH: tl.constexpr):
    i = tl.arange(0, N)
    c = tl.load(src_ptr + i)
    if WHICH == 0:
        v = e2m1_to_f32(c)
    elif WHICH == 1:
        v = e4m3_to_f32(c)
    else:
        v = e8m0_to_f32(c)
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


def test_e8m0_every_byte():
    codes = torch.arange(256, dtype=torch.int32)
    want = torch.exp2(codes.double() - 127).float()
    want[255] = float("nan")
    got = _decode(codes, 2)
    assert torch.isnan(got[255]) and torch.equal(got[:255], want[:255])
