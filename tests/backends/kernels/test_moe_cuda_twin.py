"""A lane-level Python twin of the CUDA MoE kernels' GEMV (``run_tiles`` in ``cuda/moe_decode_mma.cu``): every
lane's loads at the kernel's offsets (tile, K split, super-chunk, chunk, lane) from the real prepacked buffers (or,
NATURAL, the checkpoint's own NVFP4 layout), the prmt decodes (both DECODE settings, and decode8), the mma.m16n8k16 fragment layouts for A, B and C/D, the MXFP8 post-MMA
scales — against a dense W · x. The CPU's check of the index arithmetic the GPU tests exercise only as a whole."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from m3c.backends.kernels import moe_cuda
from m3c.model_defs import quant

E4M3 = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float().numpy()
F16_LUT = (0x3E3C3800, 0x46444240)  # decode_nvfp4, DECODE 0: f16 high bytes of 0 .. 6
E4M3_LUT = (0x3C383000, 0x4C484440)  # DECODE 1: E4M3 codes of 0 .. 6, then cvt.f16x2.e4m3x2


def _u32(buf: np.ndarray, off: int) -> int:
    return int.from_bytes(bytes(buf[off:off + 4].tolist()), "little")


def _prmt(a: int, b: int, sel: int) -> int:
    src = a.to_bytes(4, "little") + b.to_bytes(4, "little")
    out = 0
    for i in range(4):
        n = (sel >> (4 * i)) & 0xF
        v = src[n & 7]
        if n & 8:
            v = 0xFF if v & 0x80 else 0
        out |= v << (8 * i)
    return out


def _f16_pair(r: int) -> list[float]:
    return [float(np.array([r & 0xFFFF], np.uint16).view(np.float16)[0]),
            float(np.array([r >> 16], np.uint16).view(np.float16)[0])]


def _e4m3_pair(r: int, half: int) -> list[float]:
    v = (r >> (16 * half)) & 0xFFFF
    return [float(E4M3[v & 0xFF]), float(E4M3[v >> 8])]


def _decode_nvfp4(w: int, sg: float, sg8: float, decode: int) -> list[list[float]]:
    """The four A registers (pairs) of one code word, times the rows' scales (the kernel's decode_nvfp4)."""
    m = w & 0x77777777
    lut = F16_LUT if decode == 0 else E4M3_LUT
    oa = _prmt(*lut, m & 0xFFFF) | (w & 0x80808080)
    ob = _prmt(*lut, (m >> 16) & 0xFFFF) | ((w << 4) & 0x80808080)
    if decode == 0:
        regs = [_f16_pair(_prmt(oa, 0, 0x1404)), _f16_pair(_prmt(oa, 0, 0x3424)),
                _f16_pair(_prmt(ob, 0, 0x1404)), _f16_pair(_prmt(ob, 0, 0x3424))]
    else:
        regs = [_e4m3_pair(oa, 0), _e4m3_pair(oa, 1), _e4m3_pair(ob, 0), _e4m3_pair(ob, 1)]
    return [[v * s for v in r] for r, s in zip(regs, (sg, sg8, sg, sg8))]


def _decode8(w: int) -> list[list[float]]:
    """ptx_common's decode8: eight E2M1 codes in natural packing -> four f16 pairs (elements 2i, 2i + 1)."""
    m = w & 0x77777777
    w4 = (w << 4) & 0xFFFFFFFF
    oa = _prmt(*F16_LUT, m & 0xFFFF) | (_prmt(w4, w, 0x5140) & 0x80808080)
    ob = _prmt(*F16_LUT, (m >> 16) & 0xFFFF) | (_prmt(w4, w, 0x7362) & 0x80808080)
    return [_f16_pair(_prmt(oa, 0, 0x1404)), _f16_pair(_prmt(oa, 0, 0x3424)), _f16_pair(_prmt(ob, 0, 0x1404)),
            _f16_pair(_prmt(ob, 0, 0x3424))]


def _mma(a_frag: list, b_frag: list) -> list[list[float]]:
    """D = A @ B of mma.m16n8k16 from per-lane fragments, returned per lane as (c0, c1, c2, c3)."""
    a, b = np.zeros((16, 16)), np.zeros((16, 8))
    for lane in range(32):
        g, j = lane >> 2, lane & 3
        (a0, a1), (a2, a3), (a4, a5), (a6, a7) = a_frag[lane]
        a[g, 2 * j], a[g, 2 * j + 1], a[g + 8, 2 * j], a[g + 8, 2 * j + 1] = a0, a1, a2, a3
        a[g, 2 * j + 8], a[g, 2 * j + 9], a[g + 8, 2 * j + 8], a[g + 8, 2 * j + 9] = a4, a5, a6, a7
        (b0, b1), (b2, b3) = b_frag[lane]
        b[2 * j, g], b[2 * j + 1, g], b[2 * j + 8, g], b[2 * j + 9, g] = b0, b1, b2, b3
    d = a @ b
    return [[d[lane >> 2, 2 * (lane & 3)], d[lane >> 2, 2 * (lane & 3) + 1], d[(lane >> 2) + 8, 2 * (lane & 3)],
             d[(lane >> 2) + 8, 2 * (lane & 3) + 1]] for lane in range(32)]


def _b_frag(xs: np.ndarray, k: int, k_lane: int, t: int) -> list:
    """load_b + token_rows: lane (g, j) reads staged column min(g, cnt - 1) at K k + k_lane j .. + 3 (here the
    columns are the tokens themselves; the kernels' compaction of columns is checked on the GPU)."""
    out = []
    for lane in range(32):
        n, kk = min(lane >> 2, t - 1), k + k_lane * (lane & 3)
        out.append(([xs[n, kk], xs[n, kk + 1]], [xs[n, kk + 2], xs[n, kk + 3]]))
    return out


def _twin(fmt: str, experts: int, rows: int, k: int, ks_count: int, t: int, gen: torch.Generator,
          decode: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(what run_tiles would store, dense W x) for every expert row and token."""
    x = torch.randn(t, k, generator=gen, dtype=torch.float64).numpy()
    if fmt in ("nvfp4", "nvfp4_natural"):
        q = quant.nvfp4_quantize(torch.randn(experts * rows, k, generator=gen), None)
        dense = (quant.e2m1_decode(quant.unpack_nibbles(q.data)) * q.scale.float().repeat_interleave(16, -1)).numpy()
        if fmt == "nvfp4":
            codes, scales = (v.numpy() for v in moe_cuda.prepack_nvfp4(q.data.reshape(experts, rows, k // 2),
                                                                       q.scale.reshape(experts, rows, k // 16)))
        else:  # the checkpoint's own layout
            codes, scales = q.data.reshape(-1).numpy(), q.scale.view(torch.uint8).reshape(-1).numpy()
    else:
        data = torch.randint(0, 256, (experts * rows, k), generator=gen, dtype=torch.int32).to(torch.uint8)
        data[(data & 0x7F) == 0x7F] = 0  # no NaN codes
        sc = torch.randint(120, 135, (experts * rows, k // 32), generator=gen, dtype=torch.int32).to(torch.uint8)
        dense = E4M3[data.numpy()] * np.repeat(2.0 ** (sc.numpy().astype(np.float64) - 127), 32, axis=-1)
        codes = moe_cuda.prepack_mxfp8(data.view(torch.float8_e4m3fn).reshape(experts, rows, k)).numpy()
        scales = sc.numpy().reshape(-1)
    kc = k // ks_count
    out = np.zeros((experts, rows, t))
    for e in range(experts):
        for row in range(0, rows, 32):  # one warp: tiles row, row + 16
            tile = row // 16 + e * (rows // 16)
            for ks in range(ks_count):
                xs = x[:, ks * kc:(ks + 1) * kc]
                acc = [[[0.0] * 4 for _ in range(32)] for _ in range(2)]
                if fmt == "nvfp4":
                    tb, tsb = k * 8, k
                    for sc_i in range(kc // 256):
                        for c in range(4):
                            for s in range(4):
                                b = _b_frag(xs, (sc_i * 4 + c) * 64 + 4 * s, 16, t)
                                for tt in range(2):
                                    a = []
                                    for lane in range(32):
                                        cb = tile * tb + ks * kc * 8 + lane * 16 + tt * tb + sc_i * 2048 + c * 512
                                        sb = tile * tsb + ks * kc + lane * 8 + tt * tsb + sc_i * 256
                                        sw = _u32(scales, sb + (0 if c < 2 else 4))
                                        i = (c & 1) * 2
                                        sg = _e4m3_pair(_prmt(sw, 0, i | (i << 4)), 0)[0]
                                        sg8 = _e4m3_pair(_prmt(sw, 0, (i + 1) | ((i + 1) << 4)), 0)[0]
                                        a.append(_decode_nvfp4(_u32(codes, cb + 4 * s), sg, sg8, decode))
                                    d = _mma(a, b)
                                    for lane in range(32):
                                        for i in range(4):
                                            acc[tt][lane][i] += d[lane][i]
                elif fmt == "nvfp4_natural":  # Nvfp4NaturalStream: load() then mma(), as the kernel writes them
                    rb, rsb = k // 2, k // 16
                    for sc_i in range(kc // 256):
                        # load(): c[t][2r + q] = 16 bytes of row 16t + 8r (+ g), piece q; s[t] = packed u16 scales
                        lanes = []
                        for tt in range(2):
                            per = []
                            for lane in range(32):
                                g, j = lane >> 2, lane & 3
                                code0 = (e * rows + row + g) * rb + ks * kc // 2 + 16 * j
                                scale0 = (e * rows + row + g) * rsb + ks * kc // 16 + 2 * j
                                c, sw = [], []
                                for r in range(2):
                                    for q_i in range(2):
                                        rr = 16 * tt + 8 * r
                                        off = code0 + rr * rb + sc_i * 128 + 64 * q_i
                                        c.append([_u32(codes, off + 4 * w) for w in range(4)])
                                        so = scale0 + rr * rsb + sc_i * 16 + 8 * q_i
                                        sw.append(int(scales[so]) | (int(scales[so + 1]) << 8))
                                per.append((c, sw[0] | (sw[1] << 16), sw[2] | (sw[3] << 16)))
                            lanes.append(per)
                        for q_i in range(2):
                            for w in range(4):
                                for e2 in range(2):
                                    b = _b_frag(xs, sc_i * 256 + 128 * q_i + 8 * w + 4 * e2, 32, t)
                                    for tt in range(2):
                                        a = []
                                        for lane in range(32):
                                            c, sx, sy = lanes[tt][lane]
                                            i = 2 * q_i + (w >> 1)  # scale_pair(s.x / s.y, 2q + w / 2)
                                            sg = _e4m3_pair(_prmt(sx, 0, i | (i << 4)), 0)[0]
                                            sg8 = _e4m3_pair(_prmt(sy, 0, i | (i << 4)), 0)[0]
                                            pg, pg8 = _decode8(c[q_i][w]), _decode8(c[2 + q_i][w])
                                            a.append([[v * sg for v in pg[2 * e2]], [v * sg8 for v in pg8[2 * e2]],
                                                      [v * sg for v in pg[2 * e2 + 1]],
                                                      [v * sg8 for v in pg8[2 * e2 + 1]]])
                                        d = _mma(a, b)
                                        for lane in range(32):
                                            for i in range(4):
                                                acc[tt][lane][i] += d[lane][i]
                else:
                    tb, tsb, srow = k * 16, k // 2, k // 32
                    for sc_i in range(kc // 128):
                        for q in range(8):
                            b = _b_frag(xs, sc_i * 128 + q * 16, 4, t)
                            for tt in range(2):
                                a, sc_rows = [], []
                                for lane in range(32):
                                    g = lane >> 2
                                    base = tile * tb + ks * kc * 16 + lane * 16 + tt * tb + sc_i * 2048 + (q >> 1) * 512
                                    w0 = _u32(codes, base + (8 if q & 1 else 0))
                                    w1 = _u32(codes, base + (12 if q & 1 else 4))
                                    a.append([_e4m3_pair(w0, 0), _e4m3_pair(w0, 1), _e4m3_pair(w1, 0),
                                              _e4m3_pair(w1, 1)])
                                    sbase = (e * rows + row + g) * srow + ks * kc // 32 + tt * tsb + sc_i * 4
                                    sx, sy = _u32(scales, sbase), _u32(scales, sbase + 8 * srow)
                                    sc_rows.append((2.0 ** (((sx >> (8 * (q >> 1))) & 0xFF) - 127),
                                                    2.0 ** (((sy >> (8 * (q >> 1))) & 0xFF) - 127)))
                                d = _mma(a, b)
                                for lane in range(32):
                                    for i in range(4):
                                        acc[tt][lane][i] += sc_rows[lane][i >= 2] * d[lane][i]
                for tt in range(2):  # the epilogue's (row, token) of each accumulator
                    for lane in range(32):
                        g, j = lane >> 2, lane & 3
                        for i in range(4):
                            r, n = row + 16 * tt + g + (8 if i >= 2 else 0), 2 * j + (i & 1)
                            if n < t:
                                out[e, r, n] += acc[tt][lane][i]
    return out, dense.reshape(experts, rows, k) @ x.T


@pytest.mark.parametrize("fmt,experts,rows,k,ks,t,decode", [
    ("nvfp4", 2, 32, 512, 2, 5, 0), ("nvfp4", 1, 32, 256, 1, 8, 1), ("mxfp8", 2, 32, 256, 2, 3, 0),
    ("nvfp4_natural", 2, 32, 512, 2, 6, 0), ("nvfp4_natural", 2, 64, 1024, 2, 8, 0)])
def test_run_tiles_twin_matches_dense(fmt: str, experts: int, rows: int, k: int, ks: int, t: int,
                                      decode: int) -> None:
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    got, want = _twin(fmt, experts, rows, k, ks, t, gen, decode)
    assert np.abs(got - want).max() <= 1e-9 * np.abs(want).max()


def test_prepack_in_row_chunks_equals_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    """prepack_nvfp4 builds its tile-major layout a chunk of rows at a time: the same bytes as in one piece."""
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, (1,))))
    q = quant.nvfp4_quantize(torch.randn(3 * 48, 512, generator=gen), None)
    data, scale = q.data.reshape(3, 48, 256), q.scale.reshape(3, 48, 32)
    whole = moe_cuda.prepack_nvfp4(data, scale)
    monkeypatch.setattr(moe_cuda, "_PREPACK_ROWS", 32)
    chunked = moe_cuda.prepack_nvfp4(data, scale)
    assert all(torch.equal(a, b) for a, b in zip(whole, chunked))

