"""The swap tiles' NVFP4 -> bf16 inline PTX (``moe_swap``), read by a PTX-subset interpreter on the CPU.

The kernels themselves are tested against the MoE reference in ``test_moe_prefill.py`` (interpreter: the float32
twin of this decode, with the same column permutation); this file checks that the PTX text computes exactly
that twin: each code word's nibbles as E2M1 value × scale × 2^-9 in bf16, in ``swap_cols`` order.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from ptx_subset import run_ptx

from m3c.backends.kernels import moe_swap

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


@triton.jit
def _cols_kernel(out_ptr, HB: tl.constexpr):
    tl.store(out_ptr + tl.arange(0, HB), moe_swap.swap_cols(HB))


@triton.jit
def _perm_kernel(out_ptr, HB: tl.constexpr):
    nat = tl.arange(0, HB)[None, :] * 2  # natural order: element e of the low operand is column 2e
    tl.store(out_ptr + tl.arange(0, HB)[None, :], moe_swap._perm4(nat, 1, HB))


def _dev() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


@functools.cache
def _swap_cols(hb: int) -> list[int]:
    """The kernels' own column order: moe_swap.swap_cols run by Triton (element i of the low operand -> column)."""
    out = torch.full((hb,), -1, dtype=torch.int32, device=_dev())
    _cols_kernel[(1,)](out, HB=hb)
    return out.cpu().tolist()


def _bf16_bits(v: float) -> int:
    return int(torch.tensor([v]).to(torch.bfloat16).view(torch.int16).to(torch.int32)[0]) & 0xFFFF


def test_float_twin_permutation_matches_swap_cols() -> None:
    """The float32 twin's _perm4 puts natural low-nibble element (column 2e) where swap_cols says."""
    out = torch.full((1, 16), -1, dtype=torch.int32, device=_dev())
    _perm_kernel[(1,)](out, HB=16)
    assert out[0].cpu().tolist() == _swap_cols(16)


def test_swap_cols_is_the_documented_permutation() -> None:
    """Within each 8-column group: low nibbles c0, c4, c2, c6 (the high ones + 1); groups stay in order."""
    assert _swap_cols(16) == [0, 4, 2, 6, 8, 12, 10, 14, 16, 20, 18, 22, 24, 28, 26, 30]


def test_nvfp4_bf16_ptx_decodes_every_nibble(rng: torch.Generator) -> None:
    """Random code words (and the words with every nibble equal, so all 16 codes meet every position) times
    random E4M3 scales (normal, subnormal, 448): both calls' four outputs equal value × scale × 2^-9, exactly,
    at the columns swap_cols names."""
    words = torch.randint(0, 2**32, (64,), generator=rng, dtype=torch.int64).tolist()
    words += [0x11111111 * n for n in range(16)]
    scales = [2.0**-9, 3 * 2.0**-9, 1.0, 1.75, 448.0, 0.0625, -3.0, -448.0, float("nan")]
    scales += (torch.rand(8, generator=rng) * 400).tolist()
    for w in words:
        for sc in scales:
            s = float(torch.tensor([sc]).to(torch.float8_e4m3fn).float())
            f = _bf16_bits(s * 2.0**117)
            pair = f | (f << 16)
            for asm, hi in ((moe_swap._ASM_LO.value, 0), (moe_swap._ASM_HI.value, 1)):
                r0, r1 = run_ptx(asm, [w, pair, pair, pair, pair], 2)
                got = [r0 & 0xFFFF, r0 >> 16, r1 & 0xFFFF, r1 >> 16]
                for lane, col in zip(got, _swap_cols(16)[:4], strict=True):
                    nib = (w >> (4 * (col + hi))) & 15
                    want = _bf16_bits(float(E2M1[nib]) * s * 2.0**-9)
                    if s != s:  # NaN scale: a NaN weight (any NaN bits)
                        assert lane & 0x7F80 == 0x7F80 and lane & 0x7F, (hex(w), col + hi, hex(lane))
                    else:
                        assert lane == want, (hex(w), s, col + hi, hex(lane), hex(want))
