"""The swap tiles' NVFP4 -> bf16 inline PTX (``moe_swap``), read by a PTX-subset interpreter on the CPU.

The kernels themselves are tested against the MoE reference in ``test_moe_prefill.py`` (interpreter: the float32
twin of this decode, with the same column permutation); this file checks that the PTX text computes exactly
that twin: each code word's nibbles as E2M1 value × scale × 2^-9 in bf16, in ``swap_cols`` order.
"""

from __future__ import annotations

import torch
from ptx_subset import run_ptx

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def _swap_cols(hb: int) -> list[int]:
    """moe_swap.swap_cols in plain Python (element i of the low operand -> weight column)."""
    return [(i - i % 4) * 2 + ((i % 4 % 2) * 2 + i % 4 // 2) * 2 for i in range(hb)]


def _bf16_bits(v: float) -> int:
    return int(torch.tensor([v]).to(torch.bfloat16).view(torch.int16).to(torch.int32)[0]) & 0xFFFF


def test_swap_cols_is_the_documented_permutation() -> None:
    """Within each 8-column group: low nibbles c0, c4, c2, c6 (the high ones + 1); groups stay in order."""
    assert _swap_cols(8) == [0, 4, 2, 6, 8, 12, 10, 14]


def test_nvfp4_bf16_ptx_decodes_every_nibble(rng: torch.Generator) -> None:
    """Random code words (and the words with every nibble equal, so all 16 codes meet every position) times
    random E4M3 scales (normal, subnormal, 448): both calls' four outputs equal value × scale × 2^-9, exactly,
    at the columns swap_cols names."""
    from m3c.backends.kernels import moe_swap

    words = torch.randint(0, 2**32, (64,), generator=rng, dtype=torch.int64).tolist()
    words += [0x11111111 * n for n in range(16)]
    scales = [2.0**-9, 3 * 2.0**-9, 1.0, 1.75, 448.0, 0.0625]
    scales += (torch.rand(8, generator=rng) * 400).tolist()
    for w in words:
        for sc in scales:
            s = float(torch.tensor([sc]).to(torch.float8_e4m3fn).float())
            f = _bf16_bits(s * 2.0**117)
            pair = f | (f << 16)
            for asm, hi in ((moe_swap._ASM_LO.value, 0), (moe_swap._ASM_HI.value, 1)):
                r0, r1 = run_ptx(asm, [w, pair, pair, pair, pair], 2)
                got = [r0 & 0xFFFF, r0 >> 16, r1 & 0xFFFF, r1 >> 16]
                for lane, col in zip(got, _swap_cols(4), strict=True):
                    nib = (w >> (4 * (col + hi))) & 15
                    want = _bf16_bits(float(E2M1[nib]) * s * 2.0**-9)
                    assert lane == want, (hex(w), s, col + hi, hex(lane), hex(want))
