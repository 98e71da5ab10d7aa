"""A lane-level Python twin of the wgmma MoE prefill (``cuda/moe_prefill_wgmma.cu``): the work-tile search, every
thread's cp.async copies of a stage (tokens, codes, scales; unwritten bytes poisoned), the K-major core-matrix
reads that the B descriptor
(LBO = 16 BT, SBO = 128) describes, each lane's prepacked words and scales (the routed experts in moe_cuda's layout,
the tokens and FC1's act columns in its K order) decoded by the kernel's prmt / bf16 steps into its A fragment, the
accumulator layout and both epilogues (FC1's up rows through shared memory) — run against the dense MoE. The CPU's check
of the index arithmetic; the GPU tests run the kernels themselves."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_moe_cuda_twin import E4M3, _prmt, _u32

from m3c.backends.kernels import moe_cuda
from m3c.backends.kernels import moe_prefill_cuda as pc
from m3c.backends.kernels.moe_routing import expert_permutation
from m3c.errors import ShapeError
from m3c.model_defs import quant


def _bf16(v: float) -> float:
    return float(torch.tensor(v, dtype=torch.float32).to(torch.bfloat16).float())


def _bf16_pair(r: int) -> tuple[float, float]:
    lo = np.array([(r & 0xFFFF) << 16], np.uint32).view(np.float32)[0]
    hi = np.array([(r >> 16) << 16], np.uint32).view(np.float32)[0]
    return float(lo), float(hi)


def _nvfp4_frag(w: int, sg: float, sg8: float) -> list[tuple[float, float]]:
    """The kernel's nvfp4_frag on a moe_cuda word: A registers (row g K e0, e1; row g + 8; row g e2, e3; row g + 8)."""
    m = w & 0x77777777
    m16 = m >> 16
    w4 = (w << 4) & 0xFFFFFFFF
    hl = _prmt(0x3F3F3F00, 0x40404040, m & 0xFFFF) | (w & 0x80808080)
    hh = _prmt(0x3F3F3F00, 0x40404040, m16) | (w4 & 0x80808080)
    ll, lh = _prmt(0xC0800000, 0xC0804000, m & 0xFFFF), _prmt(0xC0800000, 0xC0804000, m16)
    regs = [_prmt(ll, hl, 0x5140), _prmt(ll, hl, 0x7362), _prmt(lh, hh, 0x5140), _prmt(lh, hh, 0x7362)]
    return [tuple(v * s for v in _bf16_pair(r)) for r, s in zip(regs, (sg, sg8, sg, sg8))]


def _mx_frag(v: tuple[int, int], sg: float, sg8: float) -> list[tuple[float, float]]:
    """mxfp8_frag: v = (row g word, row g + 8 word) of E4M3 bytes at K 2j, 2j + 1, 2j + 8, 2j + 9."""
    def pair(wd: int, half: int) -> tuple[float, float]:
        return float(E4M3[(wd >> (16 * half)) & 0xFF]), float(E4M3[(wd >> (16 * half + 8)) & 0xFF])
    regs = [pair(v[0], 0), pair(v[1], 0), pair(v[0], 1), pair(v[1], 1)]
    return [tuple(x * s for x in r) for r, s in zip(regs, (sg, sg8, sg, sg8))]


def _find_work(offs: list[int], e: int, n_sh: int, t: int, bx: int, bt: int) -> tuple[int, int, int, int]:
    if bx < n_sh:
        return 1, -1, bx * bt, min(bt, t - bx * bt)
    r, base = bx - n_sh, 0
    for ex in range(e):
        nt = (offs[ex + 1] - offs[ex] + bt - 1) // bt
        if r < base + nt:
            p0 = offs[ex] + (r - base) * bt
            return 2, ex, p0, min(bt, offs[ex + 1] - p0)
        base += nt
    return 0, -1, 0, 0


def _bf16_bits(v: np.ndarray) -> np.ndarray:
    """bf16 bit patterns (uint16) of bf16-exact float values."""
    return torch.from_numpy(np.ascontiguousarray(v, np.float32)).to(torch.bfloat16).view(torch.int16).numpy().view(
        np.uint16)


def _stage(src16: np.ndarray, xoff: list[int], codes: np.ndarray, scales: np.ndarray, tile0: int, tile1: int,
           k: int, s: int, mx: bool, bt: int, wgs: int) -> np.ndarray:
    """One ring buffer after stage s's cp.async copies, issued thread by thread as the kernel's issue() does (this
    thread's XN token chunks, CN code chunks, one scale chunk); bytes nobody writes stay 0xFF (bf16 NaN)."""
    threads, tiles = 128 * wgs, 4 * wgs
    cb, sb = (1024, 32) if mx else (512, 256)
    x_bytes, w_bytes = bt * 128, tiles * 1024
    nst = k // 64
    buf = np.full(x_bytes + w_bytes + tiles * 256, 0xFF, np.uint8)

    def tile_of(t: int) -> int:
        return tile0 + t if t < tiles // 2 else tile1 + t - tiles // 2

    xn, cn = -(-bt * 8 // threads), cb // 512
    for tid in range(threads):
        for q in range(xn):
            i = tid + q * threads
            if i >= bt * 8:
                continue
            n, kc = (i // 2) % bt, 2 * (i // (2 * bt)) + (i & 1)
            d = (kc * (bt // 8) + n // 8) * 128 + (n % 8) * 16
            chunk = src16[xoff[n] + s * 64 + 8 * kc:][:8] if xoff[n] >= 0 else np.zeros(8, np.uint16)
            buf[d:d + 16] = chunk.view(np.uint8)
        for q in range(cn):
            i = tid + q * threads
            t, c = i // (cb // 16), i % (cb // 16)
            o = tile_of(t) * nst * cb + s * cb + c * 16
            buf[x_bytes + t * cb + c * 16:][:16] = codes[o:o + 16]
        if tid < tiles * (sb // 16):
            t, c = tid // (sb // 16), tid % (sb // 16)
            o = tile_of(t) * (nst * sb if mx else k) + (s * sb if mx else (s >> 2) * sb) + c * 16
            buf[x_bytes + w_bytes + t * sb + c * 16:][:16] = scales[o:o + 16]
    return buf


def _mainloop(src: np.ndarray, xoff: list[int], codes: np.ndarray, scales: np.ndarray, tile0: int, tile1: int,
              k: int, mx: bool, bt: int, wgs: int) -> np.ndarray:
    """acc [64 wgs, bt] of one CTA, as the kernel's stages and steps compute it (float64 sums) from its shared
    memory: the tokens through the B descriptor's core matrices, each lane's codes and scales at its offsets."""
    tiles = 4 * wgs
    cb, sb = (1024, 32) if mx else (512, 256)
    x_bytes, w_bytes = bt * 128, tiles * 1024
    src16 = _bf16_bits(src)
    acc = np.zeros((64 * wgs, bt))
    for s in range(k // 64):
        buf = _stage(src16, xoff, codes, scales, tile0, tile1, k, s, mx, bt, wgs)
        xs = torch.from_numpy(buf[:x_bytes].view(np.int16).copy()).view(torch.bfloat16).double().numpy()
        for step in range(4):  # the descriptor's reads: core matrix (K chunk kc, token group) at kc LBO + ng SBO
            b = np.zeros((16, bt))
            for kk in range(16):
                for n in range(bt):
                    b[kk, n] = xs[(step * bt * 32 + (kk // 8) * bt * 16 + (n // 8) * 128 + (n % 8) * 16
                                   + (kk % 8) * 2) // 2]
            a = np.zeros((64 * wgs, 16))
            for warp in range(tiles):
                wb, sbase = x_bytes + warp * cb, x_bytes + w_bytes + warp * sb
                for lane in range(32):
                    g, j = lane >> 2, lane & 3
                    if mx:
                        c0 = wb + lane * 32 + 8 * step
                        frag = _mx_frag((_u32(buf, c0), _u32(buf, c0 + 4)),
                                        2.0 ** (int(buf[sbase + 2 * g + step // 2]) - 127),
                                        2.0 ** (int(buf[sbase + 2 * (g + 8) + step // 2]) - 127))
                    else:  # moe_cuda's scales: [super-chunk][lane][chunk][row g, g + 8] of the tile
                        o = sbase + lane * 8 + (s % 4) * 2
                        frag = _nvfp4_frag(_u32(buf, wb + lane * 16 + 4 * step), float(E4M3[buf[o]]),
                                           float(E4M3[buf[o + 1]]))
                    r0 = warp * 16
                    (a[r0 + g, 2 * j], a[r0 + g, 2 * j + 1]), (a[r0 + g + 8, 2 * j], a[r0 + g + 8, 2 * j + 1]) = \
                        frag[0], frag[1]
                    (a[r0 + g, 2 * j + 8], a[r0 + g, 2 * j + 9]) = frag[2]
                    (a[r0 + g + 8, 2 * j + 8], a[r0 + g + 8, 2 * j + 9]) = frag[3]
            acc += a @ b
    return acc


def _mma_pos(n: int) -> int:
    return (n & ~63) + 16 * ((n >> 2) & 3) + 2 * ((n >> 4) & 3) + (n & 1) + 8 * ((n >> 1) & 1)


def _twin(x, ids, wts, w13, w2, s13, s2, bt: int, wgs: int) -> np.ndarray:
    """What the two kernels and the combine produce (float64, bf16 rounding where the kernels round)."""
    t, h = x.shape
    e, k = w13.data.shape[0], ids.shape[1]
    inter, s = w13.data.shape[1] // 2, s13.data.shape[0] // 2
    rows, half = 64 * wgs, 32 * wgs
    order, offs = expert_permutation(ids, e)
    order, offs = order.tolist(), offs.tolist()
    c13, sc13 = (v.numpy() for v in moe_cuda.prepack_nvfp4(w13.data, w13.scale))
    c2, sc2 = (v.numpy() for v in moe_cuda.prepack_nvfp4(w2.data, w2.scale))
    m13, ms13 = (v.numpy() for v in pc.pack_mxfp8(s13.data, s13.scale))
    m2, ms2 = (v.numpy() for v in pc.pack_mxfp8(s2.data, s2.scale))
    g13, g2 = w13.global_scale.reshape(e, -1).numpy(), w2.global_scale.reshape(e, -1).numpy()
    xs = x.float().numpy()
    xps = xs[:, pc.k_order(h).numpy()].reshape(-1)  # the routed tiles' tokens, in moe_cuda's K order
    xs = xs.reshape(-1)
    p = t * k
    n_sh = -(-t // bt)
    m_tiles = n_sh + min(-(-p // bt) + e, p)
    act = np.full((p, inter), np.nan)
    sact = np.full((t, s), np.nan)
    slots = k + 1
    y = np.full((t, slots, h), np.nan)
    for bx in range(m_tiles):
        kind, ex, p0, count = _find_work(offs, e, n_sh, t, bx, bt)
        n_cols = s if kind == 1 else inter
        for rb in range(max(inter, s) // half):
            if kind == 0 or (rb + 1) * half > n_cols:
                continue
            xoff = [((p0 + n) if kind == 1 else order[p0 + n] // k) * h if n < count else -1 for n in range(bt)]
            g0 = rb * half // 16
            if kind == 2:
                e0 = ex * (2 * inter // 16)
                acc = _mainloop(xps, xoff, c13, sc13, e0 + g0, e0 + inter // 16 + g0, h, False, bt, wgs)
            else:
                acc = _mainloop(xs, xoff, m13, ms13, g0, s // 16 + g0, h, True, bt, wgs)
            for r in range(half):  # gate row r, up row half + r of the CTA
                n = rb * half + r
                fg, fu = (g13[ex, n], g13[ex, inter + n]) if kind == 2 else (1.0, 1.0)
                for col in range(count):
                    gv = _bf16(acc[r, col] * fg)
                    uv = _bf16(acc[half + r, col] * fu)
                    v = _bf16(_bf16(gv / (1 + np.exp(-gv))) * uv)
                    if kind == 2:
                        act[p0 + col, _mma_pos(n)] = v
                    else:
                        sact[p0 + col, n] = v
    acts = act.reshape(-1)
    sacts = sact.reshape(-1)
    for bx in range(m_tiles):
        kind, ex, p0, count = _find_work(offs, e, n_sh, t, bx, bt)
        kdim = s if kind == 1 else inter
        for rb in range(h // rows):
            if kind == 0:
                continue
            xoff = [(p0 + n) * kdim if n < count else -1 for n in range(bt)]
            t0 = rb * rows // 16 + (ex * (h // 16) if kind == 2 else 0)
            if kind == 2:
                acc = _mainloop(acts, xoff, c2, sc2, t0, t0 + 2 * wgs, inter, False, bt, wgs)
            else:
                acc = _mainloop(sacts, xoff, m2, ms2, t0, t0 + 2 * wgs, s, True, bt, wgs)
            for col in range(count):
                if kind == 2:
                    pair = order[p0 + col]
                    tok, slot, wt = pair // k, pair % k, float(wts.reshape(-1)[pair])
                else:
                    tok, slot, wt = p0 + col, k, 1.0
                for r in range(rows):
                    hh = rb * rows + r
                    f = g2[ex, hh] if kind == 2 else 1.0
                    y[tok, slot, hh] = _bf16(acc[r, col] * f * wt)
    return y.sum(axis=1)


def _dense(x, ids, wts, w13, w2, s13, s2) -> np.ndarray:
    """The MoE in float64 from dequantized weights, rounding as the bf16 model (act, each slot's output)."""
    w13d = quant.nvfp4_dequantize(w13, torch.float64).numpy()
    w2d = quant.nvfp4_dequantize(w2, torch.float64).numpy()
    sw13 = quant.mxfp8_dequantize(s13, torch.float64).numpy()
    sw2 = quant.mxfp8_dequantize(s2, torch.float64).numpy()
    xs = x.double().numpy()
    inter, s = w13d.shape[1] // 2, sw13.shape[0] // 2

    def swiglu(v: np.ndarray, w1: np.ndarray, w2_: np.ndarray, half: int) -> np.ndarray:
        gu = w1 @ v
        return w2_ @ (gu[:half] / (1 + np.exp(-gu[:half])) * gu[half:])

    out = np.zeros_like(xs)
    for tok in range(xs.shape[0]):
        out[tok] = swiglu(xs[tok], sw13, sw2, s)
        for j in range(ids.shape[1]):
            ex = int(ids[tok, j])
            out[tok] += float(wts[tok, j]) * swiglu(xs[tok], w13d[ex], w2d[ex], inter)
    return out


def _weights(e: int, h: int, inter: int, s: int, gen: torch.Generator):
    def nv(n: int, kk: int) -> quant.NVFP4Tensor:
        parts = [quant.nvfp4_quantize(w, w.abs().amax(-1, keepdim=True) / (6 * 448))
                 for w in (torch.randn(n, kk, generator=gen) / kk ** 0.5 for _ in range(e))]
        return quant.NVFP4Tensor(torch.stack([q.data for q in parts]), torch.stack([q.scale for q in parts]),
                                 torch.stack([q.global_scale for q in parts]))

    def mx(n: int, kk: int) -> quant.MXFP8Tensor:
        return quant.mxfp8_quantize(torch.randn(n, kk, generator=gen) / kk ** 0.5)

    return nv(2 * inter, h), nv(h, inter), mx(2 * s, h), mx(h, s)


@pytest.mark.parametrize("bt, wgs", [(16, 1), (8, 2), (128, 4)])
def test_twin_matches_dense_moe(bt: int, wgs: int) -> None:
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, (1,))))
    e, h, k, inter, s = 3, 256, 2, 256, 128  # K of the routed weights: whole 256-K super-chunks
    t = bt + 5  # a full and a partial shared tile; routed tiles of several sizes
    w13, w2, s13, s2 = _weights(e, h, inter, s, gen)
    x = torch.randn(t, h, generator=gen).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)])
    wts = torch.rand(t, k, generator=gen)
    got = _twin(x, ids, wts, w13, w2, s13, s2, bt, wgs)
    want = _dense(x, ids, wts, w13, w2, s13, s2)
    assert np.isfinite(got).all()
    rel = np.linalg.norm(got - want) / np.linalg.norm(want)
    assert rel < 1e-2, rel


def test_k_order_is_moe_cuda_mma_order() -> None:
    """k_order lists, position by position, the K the prepacked weights hold there: decoding a prepacked row with the
    kernel's lane mapping gives the dense row at k_order."""
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, (1,))))
    q = quant.nvfp4_quantize(torch.randn(16, 256, generator=gen), None)
    dense = quant.nvfp4_dequantize(q).numpy()
    codes, scales = (v.numpy() for v in moe_cuda.prepack_nvfp4(q.data, q.scale))
    order = pc.k_order(256).numpy()
    assert sorted(order.tolist()) == list(range(256))
    got = np.zeros((16, 256))
    for s_ in range(4):
        for step in range(4):
            for lane in range(32):
                g, j = lane >> 2, lane & 3
                sb = (s_ // 4) * 256 + lane * 8 + (s_ % 4) * 2
                fr = _nvfp4_frag(_u32(codes, s_ * 512 + lane * 16 + 4 * step), float(E4M3[scales[sb]]),
                                 float(E4M3[scales[sb + 1]]))
                base = 64 * s_ + 16 * step
                got[g, base + 2 * j: base + 2 * j + 2] = fr[0]
                got[g + 8, base + 2 * j: base + 2 * j + 2] = fr[1]
                got[g, base + 2 * j + 8: base + 2 * j + 10] = fr[2]
                got[g + 8, base + 2 * j + 8: base + 2 * j + 10] = fr[3]
    g_scale = float(q.global_scale) if q.global_scale is not None else 1.0
    np.testing.assert_array_equal(got * g_scale, dense[:, order])
    assert [_mma_pos(int(n)) for n in order] == list(range(256))


def test_pack_rejects_bad_shapes() -> None:
    with pytest.raises(ShapeError, match="R % 16"):
        pc.pack_mxfp8(torch.zeros(8, 64, dtype=torch.uint8), torch.zeros(8, 2, dtype=torch.uint8))
    with pytest.raises(ShapeError, match="K % 64"):
        pc.pack_mxfp8(torch.zeros(16, 32, dtype=torch.uint8), torch.zeros(16, 1, dtype=torch.uint8))


def test_supported_names_what_it_cannot_take() -> None:
    assert pc.supported(6144, 1536, 1536, "bf16", "nvfp4", "mxfp8") is None
    assert pc.supported(6144, 1536, 0, "bf16", "nvfp4", None) is None
    assert "NVFP4" in pc.supported(6144, 1536, 1536, "bf16", "mxfp8", "mxfp8")
    assert "bf16" in pc.supported(6144, 1536, 1536, "fp32", "nvfp4", "mxfp8")
    assert "multiple" in pc.supported(6000, 1536, 1536, "bf16", "nvfp4", "mxfp8")
    assert "multiples of 256" in pc.supported(6144, 1536 + 128, 1536, "bf16", "nvfp4", "mxfp8")
    assert "shared I" in pc.supported(6144, 1536, 100, "bf16", "nvfp4", "mxfp8")


def _e4m3_byte(v: float) -> int:
    """v rounded to E4M3 (nearest even, as cvt.rn.satfinite does below 448), as its byte."""
    return int(torch.tensor(v, dtype=torch.float32).to(torch.float8_e4m3fn).view(torch.uint8))


def _e4m3_tables(scale: float) -> tuple[int, int]:
    """e4m3_tables for one row: bytes E4M3(magnitude x scale) of the magnitudes 0, .5, 1, 1.5 | 2, 3, 4, 6."""
    b = [_e4m3_byte(m * scale) for m in (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)]
    return (b[0] | b[1] << 8 | b[2] << 16 | b[3] << 24, b[4] | b[5] << 8 | b[6] << 16 | b[7] << 24)


def _nvfp4_e4m3(w: int, tg: tuple[int, int], tg8: tuple[int, int]) -> tuple[int, int]:
    """The kernel's nvfp4_e4m3: a moe_cuda word -> (row g, row g + 8) registers of 4 E4M3 bytes (K e = 0..3)."""
    m, w4 = w & 0x77777777, (w << 4) & 0xFFFFFFFF
    rg = _prmt(tg[0], tg[1], _prmt(m, 0, 0x0020)) | (_prmt(w, w4, 0x5410) & 0x80808080)
    rg8 = _prmt(tg8[0], tg8[1], _prmt(m, 0, 0x0031)) | (_prmt(w, w4, 0x7632) & 0x80808080)
    return rg, rg8


@pytest.mark.parametrize("top", [448.0, 3.0])  # the largest block scale: wexp 3, or -4 (products scaled up)
def test_fp8_decode_gives_e4m3_of_each_weight_at_fp8_k_order(top: float, rng: torch.Generator) -> None:
    """The fp8 build's lane decode (product tables, byte lookups, sign bits) of moe_cuda's prepacked words, placed in
    wgmma's E4M3 A fragment (row g / g + 8 at K slots 4 j + e, 16 + 4 j + e of each k32 step), holds at fp8
    position q exactly E4M3(value x scale x 2^-wexp) of the weight at K fp8_k_order[q]."""
    w = torch.randn(16, 256, generator=rng) * torch.rand(16, 1, generator=rng) * 4
    q = quant.nvfp4_quantize(w, w.abs().amax(-1, keepdim=True) / (6 * top))  # each row's largest scale: top
    wexp = pc.fp8_exponent(q)
    assert wexp == (3 if top == 448.0 else -4)
    qs = quant.nvfp4_dequantize(quant.NVFP4Tensor(q.data, q.scale, None)) * 2.0**-wexp
    want = qs.to(torch.float8_e4m3fn).float().numpy()[:, pc.fp8_k_order(256).numpy()]
    codes, scales = (v.numpy() for v in moe_cuda.prepack_nvfp4(q.data, q.scale))
    got = np.full((16, 256), np.nan)
    for s8 in range(2):  # 128-K stages
        for lane in range(32):
            g, j = lane >> 2, lane & 3
            sb = (s8 >> 1) * 256 + lane * 8 + (s8 & 1) * 4  # the u32 of chunks 2 (s8 % 2), + 1: (row g, g + 8) each
            tabs = [(_e4m3_tables(float(E4M3[scales[sb + 2 * c]]) * 2.0**-wexp),
                     _e4m3_tables(float(E4M3[scales[sb + 2 * c + 1]]) * 2.0**-wexp)) for c in range(2)]
            for t in range(4):
                chunk = 2 * s8 + (t >> 1)
                w0, w1 = (_u32(codes, chunk * 512 + lane * 16 + 4 * (2 * (t & 1) + h)) for h in range(2))
                regs = [*_nvfp4_e4m3(w0, *tabs[t >> 1]), *_nvfp4_e4m3(w1, *tabs[t >> 1])]  # a0 .. a3
                for r, (row, slot) in enumerate(((g, 4 * j), (g + 8, 4 * j), (g, 16 + 4 * j), (g + 8, 16 + 4 * j))):
                    for e in range(4):
                        got[row, 128 * s8 + 32 * t + slot + e] = float(E4M3[(regs[r] >> (8 * e)) & 0xFF])
    np.testing.assert_array_equal(got, want)
