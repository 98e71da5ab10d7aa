"""A lane-level emulation of the whole CUDA attention decode kernel (``msa_attn_decode`` in
cuda/msa_attention_mma.cu; a helper's review wrote it): every lane's loads, byte permutes, f16 roundings, the MMA
fragments assembled by the PTX layouts, the online softmax, a CTA's warps (in random order) merged through shared
memory, the splits in a random arrival order and the last-arrive merge through global memory (sm_89, more than 8
splits; on sm_90 up to 8 splits merge in a thread-block cluster: the same partials summed in the same order),
against the reference ``ops.sparse_attention`` — CPU CI's check of the kernel's whole algebra (it runs only on a
GPU). Keep it in step with the kernel."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from test_msa_attention import _case, _reference, _rel

M32 = 0xFFFFFFFF
NEG = -np.inf
L = np.arange(32)
G = L >> 2
C = L & 3


def prmt(a, b, sel):
    a = np.asarray(a, np.int64)
    b = np.broadcast_to(np.asarray(b, np.int64), a.shape)
    sel = np.broadcast_to(np.asarray(sel, np.int64), a.shape)
    src = [(a >> (8 * i)) & 0xFF for i in range(4)] + [(b >> (8 * i)) & 0xFF for i in range(4)]
    src = np.stack(src, 0)
    out = np.zeros(a.shape, np.int64)
    for i in range(4):
        nib = (sel >> (4 * i)) & 0xF
        byte = np.take_along_axis(src, (nib & 7)[None], 0)[0]
        byte = np.where(nib & 8, np.where(byte & 0x80, 0xFF, 0), byte)
        out |= byte << (8 * i)
    return out


def decode8(w):
    w = np.asarray(w, np.int64) & M32
    m = w & 0x77777777
    oa = prmt(np.full(w.shape, 0x3E3C3800), 0x46444240, m)
    ob = prmt(np.full(w.shape, 0x3E3C3800), 0x46444240, m >> 16)
    w4 = (w << 4) & M32
    oa |= prmt(w4, w, 0x5140) & 0x80808080
    ob |= prmt(w4, w, 0x7362) & 0x80808080
    return [prmt(oa, 0, 0x1404), prmt(oa, 0, 0x3424), prmt(ob, 0, 0x1404), prmt(ob, 0, 0x3424)]


def interleave(a, b, sel):
    x = prmt(a, b, sel)
    lo4, hi4 = x & 0x0F0F0F0F, (x >> 4) & 0x0F0F0F0F
    return (prmt(lo4, hi4, 0x6240) | (prmt(lo4, hi4, 0x7351) << 4)) & M32


def h2f(p):  # f16x2 word -> (lo, hi) float64
    p = np.asarray(p, np.int64)
    lo = (p & 0xFFFF).astype(np.uint16).view(np.float16).astype(np.float64)
    hi = ((p >> 16) & 0xFFFF).astype(np.uint16).view(np.float16).astype(np.float64)
    return lo, hi


def f2h(lo, hi):  # cvt.rn.f16x2.f32 (lo -> low half)
    lo16 = np.asarray(lo, np.float32).astype(np.float16).view(np.uint16).astype(np.int64)
    h = np.asarray(hi, np.float32).astype(np.float16).view(np.uint16).astype(np.int64)
    return lo16 | (h << 16)


def e4m3(byte):
    return torch.tensor(np.asarray(byte, np.int64).astype(np.uint8)).view(torch.float8_e4m3fn).double().numpy()


def e4m3x2_lo(v):
    v = np.asarray(v, np.int64)
    return f2h(e4m3(v & 0xFF), e4m3((v >> 8) & 0xFF))


def hmul2(a, b):
    al, ah = h2f(a)
    bl, bh = h2f(b)
    return f2h((al * bl).astype(np.float16), (ah * bh).astype(np.float16))


def scale_pair(w, i):
    return e4m3x2_lo(prmt(w, 0, i | (i << 4)))


def mma(d, a0, a1, a2, a3, b0, b1):
    """d [32,4] float64 per lane; fragments [32] words: assemble A [16,16], B [16,8] by the PTX layout."""
    A = np.full((16, 16), np.nan)
    B = np.full((16, 8), np.nan)
    for lane in range(32):
        g, c = lane >> 2, lane & 3
        for w, r, k in ((a0, g, 2 * c), (a1, g + 8, 2 * c), (a2, g, 2 * c + 8), (a3, g + 8, 2 * c + 8)):
            lo, hi = h2f(w[lane])
            A[r, k] = lo
            A[r, k + 1] = hi
        for w, k in ((b0, 2 * c), (b1, 2 * c + 8)):
            lo, hi = h2f(w[lane])
            B[k, g] = lo
            B[k + 1, g] = hi
    with np.errstate(invalid="ignore"):
        Cm = A @ B
    out = d.copy()
    for lane in range(32):
        g, c = lane >> 2, lane & 3
        out[lane, 0] += Cm[g, 2 * c]
        out[lane, 1] += Cm[g, 2 * c + 1]
        out[lane, 2] += Cm[g + 8, 2 * c]
        out[lane, 3] += Cm[g + 8, 2 * c + 1]
    return out


def quad_max(x):
    x = np.maximum(x, x[L ^ 1])
    return np.maximum(x, x[L ^ 2])


def quad_sum(x):
    x = x + x[L ^ 1]
    return x + x[L ^ 2]


def ld(buf, off, n):  # bytes buf (flat uint8) -> n little-endian u32 words
    return [int.from_bytes(bytes(buf[off + 4 * i : off + 4 * i + 4]), "little") for i in range(n)]


def run(H, KVH, BS, TOPK, SPLIT, WARPS, q, kd, ks, vd, vs, sel, pos, qsl, seq, bt, scale, order_seed=0):
    D = 128
    HG = H // KVH
    STEPS = BS // 64
    UNITS = TOPK * STEPS
    WORKERS = SPLIT * WARPS
    PER = (UNITS + WORKERS - 1) // WORKERS
    T = q.shape[0]
    qb = q.view(torch.int16).numpy().astype(np.int64) & 0xFFFF  # bf16 bits [T,H,128]
    kd = kd.contiguous().view(-1).numpy()
    ks = ks.contiguous().view(torch.uint8).view(-1).numpy()
    vd = vd.contiguous().view(-1).numpy()
    vs = vs.contiguous().view(torch.uint8).view(-1).numpy()
    sel = sel.contiguous().view(-1).numpy()
    pos = pos.numpy()
    qsl = qsl.numpy()
    seq = seq.numpy()
    bt_stride = bt.stride(0)
    bt = bt.contiguous().view(-1).numpy()
    n_req = len(seq)
    out = np.full(T * H * D, np.nan)
    ws = np.full(T * KVH * SPLIT * 16 * D, np.nan)
    ml = np.full(T * KVH * SPLIT * 32, np.nan)
    cnt = np.zeros(T * KVH, np.int64)
    rng = np.random.default_rng(order_seed)
    blocks = rng.permutation(T * KVH * SPLIT)  # arrival order
    for bid in blocks:
        sp = bid % SPLIT
        tile = bid // SPLIT
        t = tile // KVH
        kg = tile % KVH
        r = 0
        for r0 in range(0, n_req, 32):
            r += sum(1 for ln in range(32) if r0 + ln < n_req and qsl[r0 + ln + 1] <= t)
        pad = r >= n_req
        r = n_req - 1 if pad else r
        p_t = int(pos[t])
        s_len = int(seq[r])
        last = -1 if pad else min(p_t, s_len - 1)
        n_blocks = (s_len + BS - 1) // BS
        sel_v = [int(sel[tile * TOPK + ln]) if ln < TOPK else -2 - ln for ln in range(32)]
        keep = []
        for ln in range(32):
            same = [m for m in range(32) if sel_v[m] == sel_v[ln]]
            keep.append(
                ln < TOPK
                and sel_v[ln] >= 0
                and sel_v[ln] < n_blocks
                and sel_v[ln] * BS <= last
                and not any(m < ln for m in same)
            )
        kept = sum(1 << ln for ln in range(32) if keep[ln])
        # Q staging
        qa = np.zeros((8, 4, 32), np.int64)
        fr = np.zeros((2, 32))
        for hh in range(2):
            h = G + 8 * hh
            ok = h < HG
            x = np.zeros((32, 32))
            for ln in range(32):
                if ok[ln]:
                    bits = qb[t, kg * HG + h[ln], 32 * C[ln] : 32 * C[ln] + 32]
                    x[ln] = (bits << 16).astype(np.uint32).view(np.float32)
            m = quad_max(np.abs(x).max(1))
            e = np.array([(math.frexp(mm)[1] - 1 - 14) if mm > 0 else 0 for mm in m])
            e = np.clip(e, -126, 126)
            down = np.float32(2.0) ** (-e.astype(np.float64))
            fr[hh] = (2.0**e) * np.float32(scale) * np.float32(1.4426950408889634)
            for s in range(8):
                qa[s][hh] = f2h(x[:, 4 * s] * down, x[:, 4 * s + 1] * down)
                qa[s][2 + hh] = f2h(x[:, 4 * s + 2] * down, x[:, 4 * s + 3] * down)
        so = np.zeros((WARPS, 16, D))  # the CTA's shared O rows (logical layout; the kernel pads them)
        sml = np.zeros((WARPS, 32))
        for wid in rng.permutation(WARPS):  # warps in any order: the merge below reads them in a fixed one
          o = np.zeros((16, 32, 4))
          mrow = np.full((2, 32), NEG)
          lrow = np.zeros((2, 32))
          bt_row = r * bt_stride
          me = sp * WARPS + wid
          for i in range(PER):
            u = me + WORKERS * i
            if u >= UNITS:
                break
            idx, st = u // STEPS, u % STEPS
            if not ((kept >> idx) & 1):
                continue
            b = sel_v[idx]
            first = b * BS + st * 64
            if first > last:
                continue
            phys = int(bt[bt_row + b])
            if True:
                row0 = (phys * BS + st * 64) * KVH + kg
                s = np.zeros((8, 32, 4))
                for j in range(8):
                    krow = row0 + (8 * j + G) * KVH
                    kw = np.array([ld(kd, int(krow[ln]) * 64 + 16 * int(C[ln]), 4) for ln in range(32)])  # [32,4]
                    ksc = np.array(
                        [
                            int(ks[int(krow[ln]) * 8 + 2 * C[ln]]) | (int(ks[int(krow[ln]) * 8 + 2 * C[ln] + 1]) << 8)
                            for ln in range(32)
                        ]
                    )
                    s0, s1 = scale_pair(ksc, 0), scale_pair(ksc, 1)
                    for w in range(4):
                        p = decode8(kw[:, w])
                        sc = s0 if w < 2 else s1
                        for e2 in range(2):
                            s[j] = mma(
                                s[j],
                                qa[2 * w + e2][0],
                                qa[2 * w + e2][1],
                                qa[2 * w + e2][2],
                                qa[2 * w + e2][3],
                                hmul2(p[2 * e2], sc),
                                hmul2(p[2 * e2 + 1], sc),
                            )
                mx = np.full((2, 32), NEG)
                for j in range(8):
                    for k in range(4):
                        kp = first + 8 * j + 2 * C + (k & 1)
                        s[j][:, k] = np.where(kp <= last, s[j][:, k] * fr[k >> 1], NEG)
                        mx[k >> 1] = np.maximum(mx[k >> 1], s[j][:, k])
                alpha = np.zeros((2, 32))
                mnew = np.zeros((2, 32))
                for hh in range(2):
                    mx[hh] = quad_max(mx[hh])
                    mnew[hh] = np.maximum(mrow[hh], mx[hh])
                    assert np.isfinite(mnew[hh]).all()
                    alpha[hh] = np.exp2(mrow[hh] - mnew[hh])
                    mrow[hh] = mnew[hh]
                    lrow[hh] *= alpha[hh]
                o[:, :, 0] *= alpha[0]
                o[:, :, 1] *= alpha[0]
                o[:, :, 2] *= alpha[1]
                o[:, :, 3] *= alpha[1]
                pa = np.zeros((4, 4, 32), np.int64)
                for j in range(8):
                    p = [np.exp2(s[j][:, k] - mnew[k >> 1]) for k in range(4)]
                    for k in range(4):
                        lrow[k >> 1] += p[k]
                    pa[j >> 1][(j & 1) * 2] = f2h(p[0], p[1])
                    pa[j >> 1][(j & 1) * 2 + 1] = f2h(p[2], p[3])
                for kk in range(4):
                    v = []
                    vsc = []
                    for q4 in range(4):
                        key = 16 * kk + 2 * C + (q4 & 1) + 8 * (q4 >> 1)
                        vrow = row0 + key * KVH
                        vis = first + key <= last
                        v.append(
                            np.array(
                                [
                                    ld(vd, int(vrow[ln]) * 64 + 8 * int(G[ln]), 2) if vis[ln] else [0, 0]
                                    for ln in range(32)
                                ]
                            )
                        )
                        vsc.append(np.array([int(vs[int(vrow[ln]) * 8 + G[ln]]) if vis[ln] else 0 for ln in range(32)]))

                    def v_pairs(va, vb, sab):
                        words = [
                            interleave(va[:, 0], vb[:, 0], 0x5140),
                            interleave(va[:, 0], vb[:, 0], 0x7362),
                            interleave(va[:, 1], vb[:, 1], 0x5140),
                            interleave(va[:, 1], vb[:, 1], 0x7362),
                        ]
                        spv = e4m3x2_lo(sab)
                        res = []
                        for w in range(4):
                            p = decode8(words[w])
                            for ii in range(4):
                                res.append(hmul2(p[ii], spv))
                        return res

                    b0 = v_pairs(v[0], v[1], vsc[0] | (vsc[1] << 8))
                    b1 = v_pairs(v[2], v[3], vsc[2] | (vsc[3] << 8))
                    for jd in range(16):
                        o[jd] = mma(o[jd], pa[kk][0], pa[kk][1], pa[kk][2], pa[kk][3], b0[jd], b1[jd])
          for hh in range(2):
            lrow[hh] = quad_sum(lrow[hh])
            for ln in range(32):
                g, c = ln >> 2, ln & 3
                for jd in range(16):
                    for e2 in range(2):
                        so[wid, g + 8 * hh, 16 * (2 * c + e2) + jd] = o[jd][ln][2 * hh + e2]
                if c == 0:
                    sml[wid, g + 8 * hh] = mrow[hh][ln]
                    sml[wid, 16 + g + 8 * hh] = lrow[hh][ln]
        # The CTA's merge over its warps (fixed order), per head row.
        part = tile * SPLIT + sp
        for h in range(HG):
            mall = sml[:, h].max()
            mref = 0.0 if mall == NEG else mall
            wt = np.exp2(sml[:, h] - mref)
            acc = (wt[:, None] * so[:, h]).sum(0)
            lsum = float((wt * sml[:, 16 + h]).sum())
            if SPLIT == 1:
                inv = 1 / lsum if lsum > 0 else 0.0
                out[(t * H + kg * HG + h) * D : (t * H + kg * HG + h) * D + D] = acc * inv
            else:
                ws[(part * 16 + h) * D : (part * 16 + h) * D + D] = acc
                ml[part * 32 + h] = mall
                ml[part * 32 + 16 + h] = lsum
        if SPLIT == 1:
            continue
        old = cnt[tile]
        cnt[tile] += 1
        if old != SPLIT - 1:
            continue
        cnt[tile] = 0
        for h in range(HG):
            mall = NEG
            for k in range(SPLIT):
                mall = max(mall, ml[(tile * SPLIT + k) * 32 + h])
            mref = 0.0 if mall == NEG else mall
            acc = np.zeros(128)
            lsum = 0.0
            for k in range(SPLIT):
                pk = tile * SPLIT + k
                w = 2.0 ** (ml[pk * 32 + h] - mref)
                lsum += w * ml[pk * 32 + 16 + h]
                acc += w * ws[(pk * 16 + h) * D : (pk * 16 + h) * D + 128]
            inv = 1 / lsum if lsum > 0 else 0.0
            out[(t * H + kg * HG + h) * D : (t * H + kg * HG + h) * D + 128] = acc * inv
    assert (cnt == 0).all()
    return torch.tensor(out.reshape(T, H, D))


def _go(hg: int, kvh: int, bs: int, top_k: int, split: int, warps: int, reqs: list, seed: int, edit=None) -> None:
    gen = torch.Generator().manual_seed(seed)
    c = _case(gen, 128, bs, hg, kvh, top_k, reqs, q_dtype=torch.bfloat16, device="cpu", share_p=0.5)
    if edit:
        edit(c)
    ref = _reference(c).double()
    out = run(
        hg * kvh,
        kvh,
        bs,
        top_k,
        split,
        warps,
        c["q"],
        c["k_data"],
        c["k_scale"],
        c["v_data"],
        c["v_scale"],
        c["selected"].to(torch.int64),
        c["positions"].to(torch.int64),
        c["query_start_loc"].to(torch.int32),
        c["seq_lens"].to(torch.int32),
        c["block_table"].to(torch.int32),
        c["scale"],
        order_seed=seed,
    )
    assert torch.isfinite(out).all()
    assert _rel(out, ref) <= 1e-2, _rel(out, ref)  # f16 P, ex2
    assert (out[ref.abs().amax((1, 2)) == 0] == 0).all()  # rows with no visible key: zeros


def _edge(c: dict) -> None:
    c["selected"][0] = -1  # row 0: nothing selected
    c["selected"][1, :, :] = c["selected"][1, :, :1]  # row 1: every entry the same block


@pytest.mark.parametrize("case", ["edge", "groups", "unsplit", "split16"])
def test_kernel_emulation_matches_reference(case: str) -> None:
    seed = int(torch.randint(0, 2**31, ()))
    if case == "edge":  # -1 rows, duplicates, a request without rows, 64-token blocks, 2 splits of 2 warps
        _go(16, 1, 64, 5, 2, 2, [(300, 3), (200, 0), (150, 1)], seed, _edge)
    elif case == "groups":  # two KV groups of 8 heads, split 2 of 4 warps (one 64-key step a warp)
        _go(8, 2, 128, 4, 2, 4, [(900, 2)], seed)
    elif case == "unsplit":  # one CTA of 4 warps a row (several blocks a warp)
        _go(16, 1, 128, 16, 1, 4, [(5000, 2)], seed)
    else:  # top-32 over 16 splits of one warp, a single head
        _go(1, 1, 64, 32, 16, 1, [(2600, 1)], seed)
