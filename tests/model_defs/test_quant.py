"""Tests for m3c.model_defs.quant: E2M1 rounding, NVFP4 / MXFP8 / FP8 layouts, error bounds, bit-exactness vs torchao."""

from __future__ import annotations

import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from m3c.errors import QuantizationError
from m3c.model_defs.quant import (
    E2M1_VALUES,
    MXFP8Tensor,
    NVFP4Tensor,
    e2m1_decode,
    e2m1_encode,
    fp8_dequantize,
    fp8_quantize_per_tensor,
    fp8_quantize_per_token,
    mxfp8_dequantize,
    mxfp8_quantize,
    nvfp4_dequantize,
    nvfp4_global_scale,
    nvfp4_quantize,
    pack_nibbles,
    unpack_nibbles,
)

try:
    from torchao.prototype.mx_formats.mx_tensor import to_mx as ao_to_mx
    from torchao.prototype.mx_formats.nvfp4_tensor import nvfp4_quantize as ao_nvfp4
    from torchao.prototype.mx_formats.nvfp4_tensor import per_tensor_amax_to_scale as ao_tensor_scale
except ImportError:  # pragma: no cover - torchao is a test dependency
    ao_to_mx = ao_nvfp4 = ao_tensor_scale = None
needs_torchao = pytest.mark.skipif(ao_nvfp4 is None, reason="torchao not installed")

FAST = settings(max_examples=50, deadline=None)
GRID = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
TIES = [(0.25, 0), (0.75, 2), (1.25, 2), (1.75, 4), (2.5, 4), (3.5, 6), (5.0, 6)]  # midpoint -> even code
MIDPOINTS = torch.tensor([m for m, _ in TIES], dtype=torch.float64)
E4M3_TABLE = torch.arange(128, dtype=torch.uint8).view(torch.float8_e4m3fn).double()[:127]  # 0 .. 448, code = index
FLOATS = (torch.float32, torch.bfloat16)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def codes_of(t: NVFP4Tensor) -> torch.Tensor:
    return unpack_nibbles(t.data).reshape(*t.shape[:-1], -1, 16)


@st.composite
def blocked(draw, block: int, lo: int = -30, hi: int = 30, max_lead: int = 2, dtypes=FLOATS) -> torch.Tensor:
    """Random [..., K] tensor (K % block == 0): per-block magnitude spread, zero blocks, optional tie-prone grid."""
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**63 - 1)))
    lead = tuple(draw(st.lists(st.integers(1, 5), min_size=1, max_size=max_lead)))
    nblk, spread = draw(st.integers(1, 4)), draw(st.integers(0, 12))
    x = torch.randn((*lead, nblk, block), generator=g)
    if draw(st.booleans()):
        x = torch.round(x * 4) / 4  # dyadic values: many exact E2M1 midpoints
    x = x * 2.0 ** torch.randint(-spread, spread + 1, (*lead, nblk, 1), generator=g).float()
    x = x * (torch.rand((*lead, nblk, 1), generator=g) >= draw(st.sampled_from([0.0, 0.25])))
    return (x.reshape(*lead, nblk * block) * 2.0 ** draw(st.integers(lo, hi))).to(draw(st.sampled_from(dtypes)))


# ---------------------------------------------------------------- E2M1 codes and nibbles


def test_e2m1_table_and_every_code_round_trips():
    assert E2M1_VALUES.tolist() == GRID + [-v for v in GRID]
    codes = torch.arange(16, dtype=torch.uint8)
    vals = e2m1_decode(codes)
    assert torch.equal(torch.signbit(vals), codes >= 8)  # code 8 is -0.0
    assert torch.equal(e2m1_encode(vals), codes)
    t = nvfp4_quantize(vals)  # amax 6 -> scale exactly 1.0
    assert t.scale.float().item() == 1.0 and torch.equal(unpack_nibbles(t.data), codes)
    assert torch.equal(nvfp4_dequantize(t).view(torch.int32), vals.view(torch.int32))


@pytest.mark.parametrize("sign", [1.0, -1.0])
@pytest.mark.parametrize(("mid", "code"), TIES)
def test_ties_round_to_even(mid: float, code: int, sign: float):
    neg = 8 if sign < 0 else 0
    lo_code = GRID.index(max(v for v in GRID if v < mid))
    v = torch.tensor(mid * sign)
    x = torch.stack([v, torch.nextafter(v, v * 2), torch.nextafter(v, torch.tensor(0.0))])  # tie, above, below
    assert e2m1_encode(x).tolist() == [code | neg, (lo_code + 1) | neg, lo_code | neg]
    block = torch.tensor([6.0 * sign, mid * sign] + [0.0] * 14)  # through NVFP4: scale 1.0, x / (1.0 * gs) == mid
    for gs in (None, 3.0, 0.375):
        t = nvfp4_quantize(block * (gs or 1.0), gs)
        assert t.scale.float().item() == 1.0 and unpack_nibbles(t.data)[1].item() == code | neg


def test_tie_with_inexact_reciprocal_scale():
    # scale 0.9375, x / scale == 2.5 exactly: RNE gives 2.0 (code 4).  torchao computes x * (1/scale) = 2.5000002 -> 3.
    t = nvfp4_quantize(torch.tensor([[5.625, 2.34375] + [0.0] * 14]))
    assert t.scale.float().item() == 0.9375 and unpack_nibbles(t.data)[0, 1].item() == 4


@needs_torchao
def test_torchao_tie_difference_is_as_documented():
    _, data = ao_nvfp4(torch.tensor([[5.625, 2.34375] + [0.0] * 14]))
    assert unpack_nibbles(data)[0, 1].item() == 5


def test_mxfp8_tiny_blocks_use_the_stored_scale():
    x = torch.randn(3, 32) * 2.0**-124  # amax < 2**-118: scale byte 0 means 2**-127
    x[:, 0] = 2.0**-122
    m = mxfp8_quantize(x)
    assert m.scale.eq(0).all()
    assert torch.equal(bits(m.data), bits((x * 2.0**127).to(torch.float8_e4m3fn)))
    assert torch.allclose(mxfp8_dequantize(m), x, rtol=2**-4, atol=2.0**-137)


@needs_torchao
def test_torchao_tiny_mx_block_difference_is_as_documented():
    x = torch.full((1, 32), 2.0**-122)
    scale, data = ao_to_mx(x, torch.float8_e4m3fn, 32)
    assert bits(scale).item() == 0 and data.float()[0, 0].item() == 16.0  # 2**-122 / 2**-126; the scale means 2**-127
    assert mxfp8_quantize(x).data.float()[0, 0].item() == 32.0


@FAST
@given(st.lists(st.one_of(st.floats(-8, 8, width=32), st.sampled_from([m for m, _ in TIES])), min_size=1, max_size=64))
def test_e2m1_encode_is_nearest_even(vals: list[float]):
    x = torch.tensor(vals, dtype=torch.float32)
    grid = torch.tensor(GRID, dtype=torch.float64)
    d = (x.double().abs().clamp(max=6)[:, None] - grid).abs()
    tied = d == d.min(1, keepdim=True).values
    first = tied.int().argmax(1)
    want = torch.where((tied.sum(1) == 2) & (first % 2 == 1), first + 1, first).to(torch.uint8)
    assert torch.equal(e2m1_encode(x), want | (torch.signbit(x).to(torch.uint8) << 3))


def test_saturation_and_non_finite_codes():
    x = torch.tensor([6.0, 6.5, 100.0, 3e38, float("inf")])
    assert e2m1_encode(x).tolist() == [7] * 5 and e2m1_encode(-x).tolist() == [15] * 5
    assert e2m1_encode(torch.tensor([float("nan")])).item() & 7 == 7  # NaN -> max magnitude, sign from the NaN
    t = nvfp4_quantize(torch.tensor([1e6] + [-1e6] * 15))  # amax/6 > 448: scale clamps, elements saturate
    assert t.scale.float().item() == 448.0 and unpack_nibbles(t.data).tolist() == [7] + [15] * 15


def test_nibble_order_hand_built():
    codes = torch.tensor([[1, 2, 3, 4, 15, 0]], dtype=torch.uint8)
    packed = pack_nibbles(codes)
    assert packed.tolist() == [[0x21, 0x43, 0x0F]]
    assert torch.equal(unpack_nibbles(packed), codes)
    x = torch.tensor([0.5, 1.0, -6.0, 0.0] + [0.0] * 12)  # codes 1, 2, 15, 0
    assert nvfp4_quantize(x).data[:2].tolist() == [0x21, 0x0F]
    for bad in (torch.zeros(3, dtype=torch.uint8), torch.tensor([16, 0], dtype=torch.uint8), torch.zeros(2)):
        with pytest.raises(QuantizationError):
            pack_nibbles(bad)


@FAST
@given(st.integers(0, 2**63 - 1), st.lists(st.integers(1, 4), min_size=1, max_size=3))
def test_nibble_round_trip(seed: int, lead: list[int]):
    codes = torch.randint(
        0, 16, (*lead, 2 * lead[-1]), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed)
    )
    packed = pack_nibbles(codes)
    assert packed.shape[-1] * 2 == codes.shape[-1] and torch.equal(unpack_nibbles(packed), codes)
    assert torch.equal(packed & 0xF, codes[..., 0::2])


# ---------------------------------------------------------------- zeros, NaN, inf, errors


def test_zero_blocks_and_underflow():
    x = torch.zeros(4, 16)
    x[1] = -0.0
    x[2, 3] = 1e-9  # amax/6 far below the smallest E4M3 subnormal: scale 0, codes +-0, no 0/0
    x[3] = torch.linspace(-1, 1, 16)
    for gs in (None, 0.5):
        t = nvfp4_quantize(x, gs)
        assert t.scale.float()[:3].tolist() == [[0.0]] * 3 and t.scale.float()[3].item() > 0
        codes = unpack_nibbles(t.data)
        assert codes[0].eq(0).all() and codes[1].eq(8).all() and codes[2].eq(0).all()
        out = nvfp4_dequantize(t)
        assert out[:3].eq(0).all() and torch.signbit(out[1]).all() and not out.isnan().any()
    m = mxfp8_quantize(torch.zeros(2, 32))
    assert m.scale.eq(0).all() and bits(m.data).eq(0).all() and mxfp8_dequantize(m).eq(0).all()
    d, s = fp8_quantize_per_tensor(torch.zeros(3, 5))
    assert s.item() == 1.0 and s.dtype == torch.float32 and s.ndim == 0 and d.float().eq(0).all()
    d, s = fp8_quantize_per_token(torch.stack([torch.zeros(8), torch.full((8,), 4.48)]))
    assert s.flatten().tolist() == [1.0, pytest.approx(0.01)] and fp8_dequantize(d, s)[0].eq(0).all()
    assert nvfp4_global_scale(torch.zeros(5)).item() == 1.0


def test_nvfp4_nan_and_inf():
    x = torch.randn(3, 32)
    x[0, 5], x[1, 20] = float("nan"), float("-inf")
    t = nvfp4_quantize(x, nvfp4_global_scale(x[2]))
    assert bits(t.scale)[0, 0].item() == 0x7F  # NaN block -> NaN scale
    out = nvfp4_dequantize(t)
    assert out[0, :16].isnan().all() and not out[0, 16:].isnan().any() and not out[1:].isnan().any()
    assert t.scale.float()[1, 1].item() == 448.0 and unpack_nibbles(t.data)[1, 20].item() == 15  # -inf saturates
    ref = nvfp4_quantize(x[2:], t.global_scale)
    assert torch.equal(t.data[2:], ref.data) and torch.equal(bits(t.scale[2:]), bits(ref.scale))


def test_mxfp8_nan_and_inf():
    x = torch.randn(2, 64)
    x[0, 3], x[1, 40] = float("nan"), float("inf")
    m = mxfp8_quantize(x)
    assert m.scale[0, 0].item() == 255 and m.scale[1, 1].item() == 127 + 120  # inf: amax read as 2**128
    assert m.data[1, 40].float().item() == 448.0
    out = mxfp8_dequantize(m)
    assert out[0, :32].isnan().all() and not out[0, 32:].isnan().any()
    assert out[1, 40].item() == float("inf") and out[1].isfinite().sum() == 63  # 448 * 2**120 overflows: back to inf
    if ao_to_mx is not None:
        s, d = ao_to_mx(x, torch.float8_e4m3fn, 32)
        assert torch.equal(bits(s).reshape(m.scale.shape), m.scale)
        assert torch.equal(m.data.float().isnan(), d.float().isnan())
        assert torch.equal(bits(m.data)[~d.float().isnan()], bits(d)[~d.float().isnan()])


def test_fp8_nan_and_inf():
    x = torch.tensor([[1.0, float("inf"), -float("inf")], [1.0, 2.0, float("nan")], [1.0, 2.0, 3.0]])
    d, s = fp8_quantize_per_tensor(x, scale=0.5)  # explicit scale: inf saturates, NaN stays NaN
    assert d.float()[0].tolist() == [2.0, 448.0, -448.0] and d.float()[1, 2].isnan()
    assert fp8_quantize_per_tensor(x[[0, 2]])[1].isinf()
    assert fp8_quantize_per_tensor(x[1:])[1].isnan()
    d, s = fp8_quantize_per_token(x)
    assert s[0].isinf().all() and s[1].isnan().all() and s[2].item() == (torch.tensor(3.0) / 448).item()
    assert fp8_dequantize(d, s)[1].isnan().all() and fp8_dequantize(d, s)[2].isfinite().all()


@pytest.mark.parametrize(
    ("fn", "shape", "block"),
    [
        (nvfp4_quantize, (3, 20), 16),
        (nvfp4_quantize, (8,), 16),
        (mxfp8_quantize, (2, 48), 32),
        (mxfp8_quantize, (), 32),
    ],
)
def test_block_size_errors(fn, shape: tuple[int, ...], block: int):
    with pytest.raises(QuantizationError, match=re.escape(str(tuple(shape))) + f".*block size {block}"):
        fn(torch.ones(shape))


def test_bad_arguments():
    x = torch.ones(4, 16)
    for gs in (
        torch.ones(3, 1),
        torch.ones(4, 2),
        torch.ones(2, 4, 1),
        0.0,
        -1.0,
        float("inf"),
        torch.tensor(float("nan")),
    ):
        with pytest.raises(QuantizationError):
            nvfp4_quantize(x, gs)
    with pytest.raises(QuantizationError):
        nvfp4_quantize(torch.ones(16, dtype=torch.bool))
    with pytest.raises(QuantizationError):
        nvfp4_dequantize(
            NVFP4Tensor(torch.zeros(4, 8, dtype=torch.uint8), torch.zeros(4, 2, dtype=torch.float8_e4m3fn), None)
        )
    with pytest.raises(QuantizationError):
        mxfp8_dequantize(
            MXFP8Tensor(torch.zeros(2, 32, dtype=torch.float8_e4m3fn), torch.zeros(2, 2, dtype=torch.uint8))
        )
    with pytest.raises(QuantizationError):
        fp8_quantize_per_tensor(x, torch.ones(2))
    with pytest.raises(QuantizationError):
        e2m1_decode(torch.tensor([16], dtype=torch.uint8))


# ---------------------------------------------------------------- bit-exactness against torchao


@needs_torchao
@FAST
@given(blocked(16, lo=-40, hi=40), st.sampled_from(["none", "tensor", "lead"]), st.floats(-3, 3))
def test_nvfp4_matches_torchao(x: torch.Tensor, mode: str, log2f: float):
    if mode == "none":
        x, gs = x * 2.0 ** (-x.float().abs().amax().clamp(min=1e-30).log2().floor().item()), None  # amax in [1, 2)
    else:
        amax = x.float().abs().amax(dim=tuple(range(1 if mode == "lead" else 0, x.ndim)), keepdim=mode == "lead")
        gs = torch.where(amax == 0, 1.0, ao_tensor_scale(amax) * 2.0**log2f)
    ours = nvfp4_quantize(x, gs)
    ao_scale, ao_data = ao_nvfp4(x.contiguous(), 16, per_tensor_scale=gs)
    blocks = x.float().reshape(*ours.scale.shape, 16)
    g = torch.ones(()) if gs is None else gs.reshape(*gs.shape, *[1] * (x.ndim - gs.ndim))  # broadcasts to scale
    ok = blocks.abs().amax(-1) / 6 / g >= 2**-6  # torchao clamps smaller block scales up to 2**-6 (documented)
    assert ok.any() or x.float().abs().amax() == 0
    assert torch.equal(bits(ours.scale)[ok], bits(ao_scale).reshape(ours.scale.shape)[ok])
    q = blocks.double() / (ours.scale.double() * g.double()).unsqueeze(-1)
    near_tie = ((q.abs()[..., None] - MIDPOINTS).abs() <= 1e-5 * MIDPOINTS).any(-1)  # torchao's 1/scale can tip ties
    differ = codes_of(ours) != unpack_nibbles(ao_data).reshape(codes_of(ours).shape)
    assert not (differ & ok[..., None] & ~near_tie).any()


@needs_torchao
@FAST
@given(blocked(32, lo=-140, hi=120))
def test_mxfp8_matches_torchao(x: torch.Tensor):
    ours = mxfp8_quantize(x)
    ao_scale, ao_data = ao_to_mx(x.contiguous(), torch.float8_e4m3fn, 32)
    assert ao_scale.dtype == torch.float8_e8m0fnu and ao_data.dtype == torch.float8_e4m3fn
    assert torch.equal(ours.scale, bits(ao_scale).reshape(ours.scale.shape))
    # torchao divides by max(scale, 2**-126): blocks with scale byte 0 and amax > 0 differ (documented)
    amax = x.float().reshape(*ours.scale.shape, 32).abs().amax(-1)
    ok = ((ours.scale > 0) | (amax == 0))[..., None].expand(*ours.scale.shape, 32).reshape(x.shape)
    assert torch.equal(bits(ours.data)[ok], bits(ao_data)[ok])


# ---------------------------------------------------------------- scale definitions and error bounds


@FAST
@given(blocked(16, lo=-25, hi=25), st.one_of(st.none(), st.floats(1e-6, 1e3)))
def test_nvfp4_scale_is_nearest_e4m3_and_error_bounded(x: torch.Tensor, gs: float | None):
    t = nvfp4_quantize(x, gs)
    g = 1.0 if gs is None else t.global_scale.double().item()
    blocks = x.float().reshape(*t.scale.shape, 16)
    amax = blocks.abs().amax(-1)
    target = (amax / 6 / (1.0 if gs is None else t.global_scale)).double().clamp(max=448)
    d = (target[..., None] - E4M3_TABLE).abs()
    tied = d == d.min(-1, keepdim=True).values
    first = tied.int().argmax(-1)
    want = torch.where((tied.sum(-1) == 2) & (first % 2 == 1), first + 1, first)
    assert torch.equal(bits(t.scale).long(), want)
    s = t.scale.double()[..., None] * g
    q = (blocks.double() / s).nan_to_num(0.0).abs()
    half_step = torch.where(q < 2, 0.25, torch.where(q < 4, 0.5, 1.0)) + (q - 6).clamp(min=0)
    err = (nvfp4_dequantize(t).double().reshape(blocks.shape) - blocks.double()).abs()
    bound = torch.where(s == 0, blocks.double().abs(), half_step * s)  # scale underflowed to 0: everything -> 0
    assert (err <= bound * (1 + 1e-6) + 2**-149).all()
    normal = (t.scale.float() >= 2**-6) & (target < 448)  # normal, unclamped scale: error <= amax * (1 + 2**-4) / 6
    assert (err.amax(-1)[normal] <= amax.double()[normal] * (17 / 16) / 6 * (1 + 1e-6)).all()
    assert nvfp4_dequantize(t, torch.bfloat16).equal(nvfp4_dequantize(t).to(torch.bfloat16))


@FAST
@given(blocked(32, lo=-140, hi=110))
def test_mxfp8_scale_and_error_bound(x: torch.Tensor):
    m = mxfp8_quantize(x)
    assert m.shape == x.shape and m.data.dtype == torch.float8_e4m3fn and m.scale.dtype == torch.uint8
    blocks = x.double().reshape(*m.scale.shape, 32)
    amax = blocks.abs().amax(-1)
    _, e = torch.frexp(amax)  # amax = mant * 2**e, mant in [0.5, 1): floor(log2 amax) = e - 1
    want = torch.where(amax == 0, 0, (e - 1 - 8 + 127).clamp(min=0))
    assert torch.equal(m.scale.long(), want.long())
    scale = 2.0 ** (m.scale.double() - 127)[..., None]
    err = (mxfp8_dequantize(m).double().reshape(blocks.shape) - blocks).abs()
    bound = torch.maximum(blocks.abs() * 2**-4, scale * 2**-10)
    bound = torch.maximum(bound, blocks.abs() - 448 * scale)  # (448, 512) * scale saturates, the known MX floor issue
    assert (err <= bound * (1 + 1e-9)).all()
    assert mxfp8_dequantize(m, torch.bfloat16).equal(mxfp8_dequantize(m).to(torch.bfloat16))


@FAST
@given(blocked(8, lo=-60, hi=60), st.one_of(st.none(), st.floats(1e-3, 10.0)))
def test_fp8_round_trips(x: torch.Tensor, explicit: float | None):
    xd = x.double()
    d, s = fp8_quantize_per_tensor(x, explicit)
    amax = x.float().abs().amax()
    assert s.ndim == 0 and s.dtype == torch.float32
    want = torch.tensor(explicit) if explicit is not None else (torch.ones(()) if amax == 0 else amax / 448)
    assert s.item() == want.item()
    err = (fp8_dequantize(d, s).double() - xd).abs()
    bound = torch.maximum(torch.maximum(xd.abs() * 2**-4, s.double() * 2**-10), xd.abs() - 448 * s.double())
    assert (err <= bound * (1 + 1e-6)).all()
    dt, st_ = fp8_quantize_per_token(x)
    assert st_.shape == (*x.shape[:-1], 1)
    flat, rows = x.reshape(-1, x.shape[-1]), st_.reshape(-1)
    for i in range(flat.shape[0]):  # per token == per tensor on that token
        di, si = fp8_quantize_per_tensor(flat[i])
        assert si.item() == rows[i].item() and torch.equal(bits(di), bits(dt.reshape(flat.shape)[i]))


# ---------------------------------------------------------------- global scales, dtypes, shapes


@FAST
@given(blocked(16, lo=-10, hi=10, max_lead=1), st.integers(1, 4), st.floats(-2, 2))
def test_stacked_expert_scales_equal_per_expert(x: torch.Tensor, experts: int, log2f: float):
    w = torch.stack([x * (i + 1) for i in range(experts)])  # [E, N, K]
    per_expert = torch.stack([nvfp4_global_scale(w[i]) * 2.0**log2f for i in range(experts)]).reshape(experts, 1, 1)
    t = nvfp4_quantize(w, per_expert)
    assert t.shape == w.shape and t.data.shape == (*w.shape[:-1], w.shape[-1] // 2)
    assert t.scale.shape == (*w.shape[:-1], w.shape[-1] // 16) and t.global_scale.shape == (experts, 1, 1)
    for i in range(experts):
        ref = nvfp4_quantize(w[i], per_expert[i, 0, 0].item())
        assert torch.equal(t.data[i], ref.data) and torch.equal(bits(t.scale[i]), bits(ref.scale))
        assert torch.equal(nvfp4_dequantize(t)[i], nvfp4_dequantize(ref))
    rows = nvfp4_quantize(w, per_expert.expand(experts, w.shape[1], 1))  # per-row scales, same values
    assert torch.equal(rows.data, t.data) and torch.equal(nvfp4_dequantize(rows), nvfp4_dequantize(t))


@FAST
@given(blocked(32, lo=-8, hi=8, dtypes=(torch.float32,)), st.sampled_from([torch.float16, torch.bfloat16, torch.int32]))
def test_input_dtypes_compute_in_float32(x: torch.Tensor, dtype: torch.dtype):
    xl = (x * 100).round().to(dtype) if dtype == torch.int32 else x.to(dtype)
    xf = xl.float()
    assert torch.equal(nvfp4_quantize(xl).data, nvfp4_quantize(xf).data)
    assert torch.equal(bits(nvfp4_quantize(xl, 0.01).scale), bits(nvfp4_quantize(xf, 0.01).scale))
    assert torch.equal(bits(mxfp8_quantize(xl).data), bits(mxfp8_quantize(xf).data))
    assert torch.equal(bits(fp8_quantize_per_token(xl)[0]), bits(fp8_quantize_per_token(xf)[0]))


@FAST
@given(blocked(16))
def test_nvfp4_global_scale(x: torch.Tensor):
    gs = nvfp4_global_scale(x)
    amax = x.float().abs().amax()
    assert gs.ndim == 0 and gs.dtype == torch.float32
    assert gs.item() == (1.0 if amax == 0 else (amax / 2688).item())
    if ao_tensor_scale is not None and amax > 0:
        assert gs.item() == ao_tensor_scale(amax).item()
    t = nvfp4_quantize(x, gs)
    assert t.scale.float().max().item() == (448.0 if amax > 0 else 0.0)  # the largest block uses the E4M3 max
