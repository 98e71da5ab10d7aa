"""The MSA indexer's "int8" decode path: NVFP4 index keys against an integer-split q by ``dp4a``.

Used by ``msa_indexer_kernels._fma_loop`` (which owns the loop, the loads and the pooling) for tiles whose q is finite
(``msa_indexer_kernels._fma_tile`` runs the float32 "fma" loop for the others: its IEEE products give the reference's
±inf / NaN scores); this module holds what differs from the "fma" path:

- **q** (per (row, head) pair, once): x = q · 2^S with max|x| in [32, 64) (S from max|q|'s exponent,
  integer arithmetic; subnormal and zero rows included) is split exactly into three int8 parts,
  x = h + m / 128 + l / 128² + e (|h|, |m|, |l| <= 64, each the rounded remainder of the one before, so
  |e| <= 2^-15 and every element within 2^-12 of the row's largest is represented exactly — bf16 q has 8
  significant bits), packed four to a word.
- **keys** (per step, for all pairs): a 32-bit word holds 8 E2M1 nibbles. Per 4 of them (a word half), ``prmt``
  over the byte table of 2·|value| (0, 1, 2, 3, 4, 6, 8, 12) reads |v| for a positive nibble and 0 for a
  negative one (its set top selector bit replicates the table byte's zero sign); ``prmt`` over the negated
  table by the nibbles with their sign bits cleared reads -|v|; a third ``prmt`` gathers the sign bits (from
  w << 4 and w) as 0x00 / 0xFF bytes, and ``and`` + ``or`` pick -|v| where the nibble is negative.
- **dot**: ``dp4a`` of those lanes with each q part (int32, exact: |sum| < 2^28), combined per scale group as
  ((h·128 + m)·128 + l), converted to float32 once, times the group's E4M3 scale, summed over groups, times
  2^-(S + 15). Per 16 key values: 12 prmt + 12 dp4a + 6 and + 6 shifts + 4 or + 2 mad, then a conversion and
  a scale multiply. The prmt tables (``LUTS``) come in as operands the caller makes once, from a value the
  compiler cannot fold: as immediates inside each asm block ptxas re-materialized them from uniform registers
  at every use (115 moves per 256 values); offline sm_90a, 2 warps: 3.8 SASS instructions per value (was 4.2),
  "fma" 5.2.

The only roundings: the int32 → float32 conversion (24 bits), the scale products and the group sum (float32),
and q's split (2^-15 of 2^5, relative to the row's largest element). Triton's interpreter runs the same
integer algebra without the PTX (``UPCAST``); a GPU test checks the PTX against it.
"""

from __future__ import annotations

import triton
import triton.language as tl

from m3c.backends.kernels.fp_codes import pow2

TWO_64 = tl.constexpr(1.8446744073709552e19)
_ROUND = tl.constexpr(12582912.0)  # 1.5 × 2^23: (x + it) - it rounds |x| < 2^22 to the nearest integer, ties even
LUT_P0 = tl.constexpr(0x03020100)
LUT_P1 = tl.constexpr(0x0C080604)
"""prmt byte table of 2·|E2M1| for codes 0..7 (0, 1, 2, 3 | 4, 6, 8, 12), and its negation (0xFDFEFF00, 0xF4F8FAFC):"""
LUT_N0 = tl.constexpr(-33620224)
LUT_N1 = tl.constexpr(-185009412)
LUTS = (LUT_P0.value, LUT_P1.value, LUT_N0.value, LUT_N1.value)
"""The four table words as plain ints, in the asm's operand order ($15..$18)."""

def _half(w: int, sel: str, mag: str, sgn: str, i: int) -> str:
    """PTX for 4 nibbles of code word $w against q's quad i in each of the three parts ($(3 + i), $(7 + i),
    $(11 + i)): the signed 2·E2M1 bytes, dotted into h, d, l. ``sel`` holds the nibbles in bits 0..15, ``mag`` the
    same with sign bits cleared, ``sgn`` gathers each nibble's sign bit from {w << 4, w} as a sign-replicated byte:
    prmt of {0,1,2,3,4,6,8,12} by ``sel`` reads |v| for a positive nibble and 0 for a negative one (its set top
    selector bit replicates the table byte's zero sign), prmt of {0,-1,-2,-3,-4,-6,-8,-12} by ``mag`` reads -|v|,
    and the sign mask picks it for negative nibbles."""
    return (f"prmt.b32 p, $15, $16, {sel}; prmt.b32 n, $17, $18, {mag}; prmt.b32 m, a, ${w}, {sgn}; and.b32 n, n, m; "
            f"or.b32 v, p, n; dp4a.s32.s32 h, v, ${3 + i}, h; dp4a.s32.s32 d, v, ${7 + i}, d; "
            f"dp4a.s32.s32 l, v, ${11 + i}, l; ")


def _word(w: int, i: int) -> str:
    """PTX for code word $w (8 elements: q quads i, i + 1)."""
    return (f"and.b32 g, ${w}, 0x77777777; shl.b32 a, ${w}, 4; shr.b32 s, ${w}, 16; shr.b32 gs, g, 16; "
            + _half(w, f"${w}", "g", "0xD9C8", i) + _half(w, "s", "gs", "0xFBEA", i + 1))


# dp4a of the E2M1 values of two code words ($1, $2: a scale group's 16 elements) with three int8 parts of q
# (part p's word i = elements 4i..4i+3 is $(3 + 4p + i)), combined as ((h·128 + m)·128 + l); the tables of
# |v| and -|v| (LUTS) in $15, $16 and $17, $18.
_ASM_DP4A = tl.constexpr(
    "{ .reg .b32 g, a, s, gs, p, n, m, v, h, d, l; "
    "mov.b32 h, 0; mov.b32 d, 0; mov.b32 l, 0; "
    + _word(1, 0) + _word(2, 2) + "mad.lo.s32 h, h, 128, d; mad.lo.s32 $0, h, 128, l; }")


@triton.jit
def _rint(x):
    """x (float32, |x| < 2^22) rounded to the nearest integer, ties to even, exactly."""
    return (x + _ROUND) - _ROUND


@triton.jit
def _words(p, NG: tl.constexpr):
    """int32 parts [NG, 16] (each in [-128, 127]) -> four [1, NG] words (word i: bytes = elements 4i..4i+3)."""
    lane = tl.arange(0, 4)
    w = tl.sum((tl.reshape(p, [NG, 4, 4]) & 255) << (8 * lane)[None, None, :], axis=2)  # disjoint bits: sum = or
    ev, od = tl.split(tl.reshape(w, [1, NG, 2, 2]))  # words 0, 2 / 1, 3
    w0, w2 = tl.split(ev)
    w1, w3 = tl.split(od)
    return w0, w1, w2, w3


@triton.jit
def q_int8_words(q, NG: tl.constexpr):
    """A pair's finite q [NG, 16] (float32) -> (12 words: part-major, then element quad; 2^-(S + 15) as two
    factors)."""
    amax = tl.max(tl.abs(q))
    tiny = amax < 8.673617379884035e-19  # 2^-60: exponent read at amax · 2^64 (subnormal and zero rows)
    a2 = tl.where(tiny, amax * TWO_64, amax)
    sh = 132 - ((a2.to(tl.int32, bitcast=True) >> 23) & 255) + tl.where(tiny, 64, 0)  # S in [-122, 196]
    s1 = tl.minimum(sh, 127)
    x = q * pow2(s1) * pow2(sh - s1)  # max|x| in [32, 64): exact
    h = _rint(x)
    r = (x - h) * 128.0
    m = _rint(r)
    lo = _rint((r - m) * 128.0)
    e = -(sh + 15)
    e1 = tl.maximum(e, -126)
    return (_words(h.to(tl.int32), NG) + _words(m.to(tl.int32), NG) + _words(lo.to(tl.int32), NG), pow2(e1),
            pow2(e - e1))


@triton.jit
def _two_v(w, k: tl.constexpr):
    """Nibble k of int32 words w as 2 × its E2M1 value (int32 in [-12, 12])."""
    n = (w >> (4 * k)) & 15
    mag = n & 7
    e = mag >> 1
    v = tl.where(e == 0, mag & 1, (2 + (mag & 1)) << tl.maximum(e - 1, 0))
    return tl.where(n >= 8, -v, v)


@triton.jit
def _byte(w, i: tl.constexpr):
    """Signed byte i of int32 words w."""
    return (w << (24 - 8 * i)) >> 24


@triton.jit
def group_sums(w0, w1, qw, luts, UPCAST: tl.constexpr):
    """Per (key, group): ((h·128 + m)·128 + l) · 2 of the group's 16 E2M1 values (words w0, w1) against q's
    three parts (int32, exact); ``luts``: the four ``LUTS`` words as values. UPCAST (Triton's interpreter): the
    same integers without the PTX."""
    if UPCAST:
        s = tl.zeros(w0.shape, tl.int32)
        for p in tl.static_range(3):
            part = tl.zeros(w0.shape, tl.int32)
            for i in tl.static_range(4):
                for lane in tl.static_range(4):
                    if i < 2:
                        part += _two_v(w0, (i % 2) * 4 + lane) * _byte(qw[4 * p + i], lane)
                    else:
                        part += _two_v(w1, (i % 2) * 4 + lane) * _byte(qw[4 * p + i], lane)
            s = s * 128 + part
        return s
    else:
        return tl.inline_asm_elementwise(_ASM_DP4A, "=r" + ",r" * 18, [w0, w1, qw[0], qw[1], qw[2], qw[3], qw[4], qw[5], qw[6], qw[7],
                                          qw[8], qw[9], qw[10], qw[11], luts[0], luts[1], luts[2], luts[3]], dtype=tl.int32, is_pure=True,
                                         pack=1)
