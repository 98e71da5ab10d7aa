"""MSA sparse-attention decode over the paged NVFP4 K/V caches: Triton device code and host launcher.

Semantics are those of :func:`m3c.model_defs.ops.sparse_attention` (the reference): every query head
attends, with an exact softmax, to the keys ``j <= position`` of the blocks its GQA group selected
(request-relative ids, ``-1`` ignored, duplicates counted once); a head with no such key outputs zeros.

Design.
- One program per (query row t, KV group g, split sp), split fastest. The group's ``H / KVH`` query
  heads (16 on M3.1's TP4 slice; padded to BLOCK_H >= 16 rows for the MMA) are the M dimension, so one
  pass over a block serves all of them: QK^T is a [heads, BLOCK_N] dot, P·V a [heads, D] dot, over
  BLOCK_N-key sub-tiles of each selected block (bounds the registers).
- NVFP4 is dequantized in registers from the packed bytes (E2M1 and E4M3 decoded by bit arithmetic,
  exact in the interpreter too); dequantized K/V never reach HBM. The low/high nibbles are kept
  apart: even and odd head-dim columns form two half-width dots (q_even·k_even + q_odd·k_odd, and
  P·v_even, P·v_odd), so no nibble interleaving shuffles are needed; the output store re-interleaves.
- Flash-decoding: the top-k selection is dealt strided over SPLIT programs (entry i goes to split
  i % SPLIT, so ``-1`` padding spreads evenly); each runs an online softmax over its blocks and writes
  (m, l, unnormalized acc) into a float32 workspace; the last split to finish (an atomic counter,
  reset to 0 again, so CUDA-graph replays work) merges all partials exactly in a fixed order
  (rescale by exp(m_i - m)). SPLIT == 1 writes the output directly.
- The loop is branch-free so Triton's pipeliner can prefetch the next sub-tile (cp.async): entries
  that are ``-1``, out of the request's range, duplicates (counted once, as in the reference) or in
  the query's future, and keys past the position inside the own block, are masked out of the loads
  (no memory traffic; their arithmetic is wasted, which matters only for the own block's tail and
  short contexts with fewer than top_k blocks).
- Dots: float32 ``ieee`` in the interpreter (its bf16 dots are wrong); on a GPU bf16 tensor-core dots
  for bf16 q (dequantized K/V have <= 6 significant bits, so they are exact in bf16; P is rounded to
  bf16), ``tf32x3`` for float32 q. Tiles are not measured on a GPU; they come from offline sm_90a
  compiles (D=128, block 128, 16 heads, 3 stages, no spills): bf16 q BLOCK_N=64 with 4 warps (~170-200
  registers, code bytes and scale tiles both cp.async-pipelined); float32 q BLOCK_N=32 with 8 warps
  (~180 registers). BLOCK_N=128 spills.

Byte floor per decode step and KV head: the selected blocks' K and V, e.g. 16 blocks × 128 tokens ×
2 (K, V) × 72 B (64 B codes + 8 B scales at D=128) = 294,912 B (288 KiB) per query row; q and out are
negligible. The host launcher never synchronizes (no .item()/.tolist()): the token→request map is a
device searchsorted (or passed in, computed once per step for all layers).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from m3c.errors import ShapeError


@triton.jit
def _e2m1(c):
    """E2M1 codes (int32, 0..15) -> float32 values, by building the float32 bits."""
    e = (c >> 1) & 3
    m = c & 1
    bits = tl.where(e == 0, m * 0x3F000000, ((e + 126) << 23) | (m << 22))  # e == 0: 0 or 0.5
    mag = bits.to(tl.float32, bitcast=True)
    return tl.where(c >= 8, -mag, mag)


@triton.jit
def _e4m3(s):
    """E4M3 bytes (int32, 0..255) -> float32 values (subnormals, NaN 0x7F/0xFF), exactly."""
    e = (s >> 3) & 15
    m = s & 7
    normal = (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
    mag = tl.where(e == 0, m.to(tl.float32) * 0.001953125, normal)
    mag = tl.where((s & 0x7F) == 0x7F, (s * 0 + 0x7FC00000).to(tl.float32, bitcast=True), mag)
    return tl.where(s >= 128, -mag, mag)


@triton.jit
def _dequant_rows(data_ptr, scale_ptr, tok, rmask, BLOCK_N: tl.constexpr, D2: tl.constexpr):
    """Dequantized (even columns, odd columns) float32 [BLOCK_N, D/2] of cache rows `tok` (token·KVH + head)."""
    j = tl.arange(0, D2)
    byte = tl.load(data_ptr + tok[:, None] * D2 + j[None, :], mask=rmask[:, None], other=0).to(tl.int32)
    sc = tl.load(scale_ptr + tok[:, None] * (D2 // 8) + tl.arange(0, D2 // 8)[None, :], mask=rmask[:, None], other=0)
    s = _e4m3(sc.to(tl.int32))  # [BLOCK_N, D/16]: one contiguous load, decoded once, broadcast to its 8 bytes
    s = tl.reshape(tl.broadcast_to(s[:, :, None], [BLOCK_N, D2 // 8, 8]), [BLOCK_N, D2])
    return _e2m1(byte & 15) * s, _e2m1(byte >> 4) * s


@triton.jit
def _to_out(x, ty: tl.constexpr):
    """float32 -> the output dtype; bf16 rounds to nearest-even in integer arithmetic (the interpreter truncates)."""
    if ty == tl.bfloat16:
        bits = x.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
        x = tl.where(x != x, x, bits.to(tl.float32, bitcast=True))  # now exact in bf16
    return x.to(ty)


@triton.jit
def _store_out(out_ptr, q_off, hmask, o_lo, o_hi, l_sum):
    """Normalize by l (rows with l == 0, i.e. no visible key, give 0) and store even/odd columns."""
    ok = l_sum > 0.0
    den = tl.where(ok, l_sum, 1.0)[:, None]
    ty: tl.constexpr = out_ptr.dtype.element_ty
    lo = tl.where(ok[:, None], tl.math.div_rn(o_lo, den), 0.0)
    hi = tl.where(ok[:, None], tl.math.div_rn(o_hi, den), 0.0)
    tl.store(out_ptr + q_off, _to_out(lo, ty), mask=hmask[:, None])
    tl.store(out_ptr + q_off + 1, _to_out(hi, ty), mask=hmask[:, None])


@triton.jit
def _dot(a, b, acc, BF16_MMA: tl.constexpr, PREC: tl.constexpr):
    """acc + a @ b: bf16 tensor cores (f32 accumulate) when BF16_MMA, else float32 inputs at PREC."""
    if BF16_MMA:
        res = tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16), acc)
    else:
        res = tl.dot(a, b, acc, input_precision=PREC)
    return res


@triton.jit
def msa_decode_kernel(
    q_ptr, kd_ptr, ks_ptr, vd_ptr, vs_ptr, sel_ptr, pos_ptr, req_ptr, seqlen_ptr, bt_ptr, out_ptr,
    ws_ptr, ml_ptr, cnt_ptr, bt_stride, scale,
    H: tl.constexpr, KVH: tl.constexpr, HG: tl.constexpr, BLOCK_H: tl.constexpr, D: tl.constexpr,
    BS: tl.constexpr, BLOCK_N: tl.constexpr, TOPK: tl.constexpr, TOPK_P2: tl.constexpr, SPLIT: tl.constexpr,
    BF16_MMA: tl.constexpr, PREC: tl.constexpr,
):
    """Program = (row t, group g, split sp). ws: f32 [tiles, SPLIT, 2, BLOCK_H, D/2]; ml: f32 [tiles, SPLIT, 2,
    BLOCK_H]; cnt: int32 [tiles], zero on entry and on exit (tile = t * KVH + g). Unused when SPLIT == 1."""
    D2: tl.constexpr = D // 2
    PER: tl.constexpr = (TOPK + SPLIT - 1) // SPLIT
    NSUB: tl.constexpr = BS // BLOCK_N
    pid = tl.program_id(0)
    sp = pid % SPLIT
    tile = pid // SPLIT
    t = tile // KVH
    g = tile % KVH
    r = tl.load(req_ptr + t).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    seq_len = tl.load(seqlen_ptr + r).to(tl.int64)
    n_blocks = (seq_len + BS - 1) // BS

    h = tl.arange(0, BLOCK_H)
    hmask = h < HG
    j = tl.arange(0, D2)
    q_off = ((t * H + g * HG + h).to(tl.int64) * D)[:, None] + 2 * j[None, :]
    q_lo = tl.load(q_ptr + q_off, mask=hmask[:, None], other=0.0)
    q_hi = tl.load(q_ptr + q_off + 1, mask=hmask[:, None], other=0.0)
    if not BF16_MMA:
        q_lo = q_lo.to(tl.float32)
        q_hi = q_hi.to(tl.float32)

    kk = tl.arange(0, TOPK_P2)
    sel_row = tl.load(sel_ptr + tile.to(tl.int64) * TOPK + kk, mask=kk < TOPK, other=-1)
    rows = tl.arange(0, BLOCK_N)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc_lo = tl.zeros([BLOCK_H, D2], tl.float32)
    acc_hi = tl.zeros([BLOCK_H, D2], tl.float32)
    for i in range(PER * NSUB):  # (selection entry, BLOCK_N-key sub-tile of its block)
        idx = sp + (i // NSUB) * SPLIT
        b = tl.load(sel_ptr + tile.to(tl.int64) * TOPK + idx, mask=idx < TOPK, other=-1).to(tl.int64)
        dup = tl.sum(((sel_row == b) & (kk < idx)).to(tl.int32))  # counted once, like the reference
        first = b * BS + (i % NSUB) * BLOCK_N
        valid = (b >= 0) & (b < n_blocks) & (first <= pos) & (dup == 0)
        phys = tl.load(bt_ptr + r * bt_stride + tl.where(valid, b, 0)).to(tl.int64)  # entry 0 always exists
        kpos = first + rows
        last = tl.where(valid, tl.minimum(pos, seq_len - 1), -1)  # last visible key; -1: none
        vis = (kpos >= 0) & (kpos <= last)
        tok = (phys * BS + (i % NSUB) * BLOCK_N + rows) * KVH + g
        k_lo, k_hi = _dequant_rows(kd_ptr, ks_ptr, tok, vis, BLOCK_N, D2)
        s = _dot(q_lo, tl.trans(k_lo), tl.zeros([BLOCK_H, BLOCK_N], tl.float32), BF16_MMA, PREC)
        s = _dot(q_hi, tl.trans(k_hi), s, BF16_MMA, PREC) * scale
        s = tl.where(vis[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v_lo, v_hi = _dequant_rows(vd_ptr, vs_ptr, tok, vis, BLOCK_N, D2)
        acc_lo = _dot(p, v_lo, acc_lo * alpha[:, None], BF16_MMA, PREC)
        acc_hi = _dot(p, v_hi, acc_hi * alpha[:, None], BF16_MMA, PREC)
        m_i = m_new

    if SPLIT == 1:
        _store_out(out_ptr, q_off, hmask, acc_lo, acc_hi, l_i)
    else:
        hd = h[:, None] * D2 + j[None, :]
        part = (tile * SPLIT + sp).to(tl.int64)
        tl.store(ws_ptr + part * (2 * BLOCK_H * D2) + hd, acc_lo)
        tl.store(ws_ptr + part * (2 * BLOCK_H * D2) + BLOCK_H * D2 + hd, acc_hi)
        tl.store(ml_ptr + part * (2 * BLOCK_H) + h, m_i)
        tl.store(ml_ptr + part * (2 * BLOCK_H) + BLOCK_H + h, l_i)
        done = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel")
        if done == SPLIT - 1:  # the last split of this (t, g) merges, in a fixed order
            first_part = (tile * SPLIT).to(tl.int64)
            m_all = tl.full([BLOCK_H], float("-inf"), tl.float32)
            for i in range(SPLIT):
                m_all = tl.maximum(m_all, tl.load(ml_ptr + (first_part + i) * (2 * BLOCK_H) + h, cache_modifier=".cg"))
            m_ref = tl.where(m_all == float("-inf"), 0.0, m_all)  # no visible key anywhere: all weights 0
            o_lo = tl.zeros([BLOCK_H, D2], tl.float32)
            o_hi = tl.zeros([BLOCK_H, D2], tl.float32)
            l_sum = tl.zeros([BLOCK_H], tl.float32)
            for i in range(SPLIT):
                base = (first_part + i) * (2 * BLOCK_H)
                w = tl.exp(tl.load(ml_ptr + base + h, cache_modifier=".cg") - m_ref)
                l_sum += w * tl.load(ml_ptr + base + BLOCK_H + h, cache_modifier=".cg")
                wbase = (first_part + i) * (2 * BLOCK_H * D2)
                o_lo += w[:, None] * tl.load(ws_ptr + wbase + hd, cache_modifier=".cg")
                o_hi += w[:, None] * tl.load(ws_ptr + wbase + BLOCK_H * D2 + hd, cache_modifier=".cg")
            tl.store(cnt_ptr + tile, 0)
            _store_out(out_ptr, q_off, hmask, o_lo, o_hi, l_sum)


def interpreting() -> bool:
    """Whether Triton runs in its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def token_requests(query_start_loc: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """int32 [T]: the request of each flattened token (on device, no sync; compute once per step)."""
    tokens = torch.arange(num_tokens, dtype=query_start_loc.dtype, device=query_start_loc.device)
    return torch.searchsorted(query_start_loc[1:].contiguous(), tokens, right=True, out_int32=True)


def pick_split(num_tiles: int, top_k: int, device: torch.device) -> int:
    """Splits per (row, group): the smallest power of two filling ~2 programs per SM, at most top_k."""
    if interpreting() or device.type != "cuda":
        return min(2, top_k)
    target = 2 * torch.cuda.get_device_properties(device).multi_processor_count
    split = 1
    while split < top_k and num_tiles * split < target:
        split *= 2
    return min(split, top_k)


_WORKSPACE: dict[tuple[str, int, int, int, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}


def _workspace(
    device: torch.device, tiles: int, split: int, block_h: int, d: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Persistent partials (acc, m/l) and zeroed counters, reused across calls (CUDA-graph safe)."""
    key = (str(device), tiles, split, block_h, d)
    if key not in _WORKSPACE:
        parts = tiles * split
        _WORKSPACE[key] = (torch.empty(parts * block_h * d, dtype=torch.float32, device=device),
                           torch.empty(parts * 2 * block_h, dtype=torch.float32, device=device),
                           torch.zeros(tiles, dtype=torch.int32, device=device))
    return _WORKSPACE[key]


def msa_sparse_attention_decode(
    q: torch.Tensor,
    k_data: torch.Tensor,
    k_scale: torch.Tensor,
    v_data: torch.Tensor,
    v_scale: torch.Tensor,
    selected: torch.Tensor,
    positions: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    block_size: int,
    scale: float,
    split: int | None = None,
    req_of_token: torch.Tensor | None = None,
    num_warps: int | None = None,
    block_n: int | None = None,
    num_stages: int = 3,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Exact attention of q [T, H, D] (float32 / bf16) over each row's selected blocks: [T, H, D] in q's dtype.

    Caches are nvfp4 (``k_data``/``v_data`` uint8 [NB, BS, KVH, D/2], scales float8_e4m3fn [NB, BS, KVH,
    D/16]); ``selected`` is int [T, KVH, top_k] request-relative block ids (-1 ignored). ``req_of_token``
    (from :func:`token_requests`) may be passed to share it across layers; ``out`` may be preallocated.
    Checks shapes only (no sync).
    """
    if q.dim() != 3 or k_data.dim() != 4:
        raise ShapeError(f"q {tuple(q.shape)} must be [T, H, D] and k_data {tuple(k_data.shape)} [NB, BS, KVH, D/2]")
    t, h, d = q.shape
    nb, bs, kvh, d2 = k_data.shape
    top_k = selected.shape[-1]
    if bs != block_size or d2 * 2 != d or d % 16 or d & (d - 1) or bs & (bs - 1):
        raise ShapeError(f"cache {tuple(k_data.shape)} vs q {tuple(q.shape)}, block_size {block_size}: need "
                         "BS == block_size and D == 2 * D/2, both powers of two, D % 16 == 0")
    if h % kvh or tuple(selected.shape) != (t, kvh, top_k) or top_k < 1:
        raise ShapeError(f"H={h} must be a multiple of KVH={kvh}; selected {tuple(selected.shape)} must be "
                         f"[{t}, {kvh}, top_k]")
    if tuple(v_data.shape) != tuple(k_data.shape) or tuple(k_scale.shape) != (nb, bs, kvh, d // 16) \
            or tuple(v_scale.shape) != tuple(k_scale.shape):
        raise ShapeError("v_data / k_scale / v_scale do not match k_data's nvfp4 layout")
    if k_data.dtype != torch.uint8 or v_data.dtype != torch.uint8:
        raise ShapeError(f"k_data/v_data have dtypes {k_data.dtype}/{v_data.dtype}: expected packed nvfp4 uint8")
    if q.dtype not in (torch.float32, torch.bfloat16):
        raise ShapeError(f"q has dtype {q.dtype}: expected float32 or bfloat16")
    for name, x in (("q", q), ("k_data", k_data), ("k_scale", k_scale), ("v_data", v_data),
                    ("v_scale", v_scale), ("selected", selected)):
        if not x.is_contiguous():
            raise ShapeError(f"{name} must be contiguous")
    if block_table.stride(1) != 1:
        raise ShapeError("block_table rows must be contiguous")
    if out is None:
        out = torch.empty_like(q)
    elif out.shape != q.shape or out.dtype != q.dtype or not out.is_contiguous():
        raise ShapeError(f"out {tuple(out.shape)} {out.dtype} must be a contiguous tensor like q")
    if t == 0:
        return out
    hg = h // kvh
    block_h = max(16, triton.next_power_of_2(hg))
    tiles = t * kvh
    split = split or pick_split(tiles, top_k, q.device)
    split = max(1, min(split, top_k))
    if req_of_token is None:
        req_of_token = token_requests(query_start_loc, t)
    if split > 1:
        ws, ml, cnt = _workspace(q.device, tiles, split, block_h, d)
    else:
        ws = ml = out
        cnt = req_of_token
    bf16 = q.dtype == torch.bfloat16
    block_n = min(block_n or (64 if bf16 else 32), bs)
    if bs % block_n or block_n & (block_n - 1):
        raise ShapeError(f"block_n={block_n} must be a power of two dividing block_size {bs}")
    interp = interpreting()
    msa_decode_kernel[(tiles * split,)](
        q, k_data, k_scale.view(torch.uint8), v_data, v_scale.view(torch.uint8), selected, positions,
        req_of_token, seq_lens, block_table, out, ws, ml, cnt, block_table.stride(0), float(scale),
        H=h, KVH=kvh, HG=hg, BLOCK_H=block_h, D=d, BS=bs, BLOCK_N=block_n, TOPK=top_k,
        TOPK_P2=triton.next_power_of_2(top_k), SPLIT=split, BF16_MMA=bf16 and not interp, PREC="ieee" if interp else "tf32x3",
        num_warps=num_warps or (4 if bf16 or d < 128 else 8), num_stages=num_stages, enable_fp_fusion=False,
    )
    return out
