"""MSA sparse attention over the paged NVFP4 K/V caches: Triton decode and prefill kernels, runner-based launches.

Semantics are those of :func:`m3c.model_defs.ops.sparse_attention` (the reference): every query head
attends, with an exact softmax, to the keys ``j <= position`` of the blocks its GQA group selected
(request-relative ids, ``-1`` ignored, duplicates counted once); a head with no such key outputs zeros.

Launch. :func:`msa_sparse_attention` picks a kernel from static facts only (shapes, never values). By
default every batch runs the decode kernel (one program per row and group): on the H200 it beat the
prefill kernel on 4K-row chunks with independent random selections (2.6 vs 4.8 ms at 128K, 2.6 vs 5.7 ms
at 1M; benchmarks/RESULTS.md), where the prefill kernel's union of 8 rows' blocks does ~8x redundant
work. With ``max_q_rows`` given, ``T <= max_q_rows * R`` (T query rows, R requests) runs the decode
kernel and anything larger the prefill kernel for the whole batch (for chunks whose rows share
blocks, not yet measured). Every launch goes through ``runner(spec, grid, runtime_args)``
(:data:`m3c.backends.triton_aot.Runner`): Triton's JIT by default, or the runtime's offline-compiled
cubins; :func:`attention_specs` lists every :class:`KernelSpec` the launcher can produce for a layout
(constexprs are layout facts plus the decode split, bucketed to powers of two <= min(top_k, 16)).
No host synchronization anywhere (no .item(), no value-dependent shapes): CUDA-graph capturable, with
fixed grids for a given (T, R); workspaces are persistent per (device, shape).

Common device design.
- The group's ``H / KVH`` query heads (16 on M3.1's TP4 slice) are (part of) the MMA M dimension, so one
  pass over a block serves all of them. QK^T and P·V run over BLOCK_N-key sub-tiles of each block.
- NVFP4 is dequantized in registers from the packed bytes (E2M1 and E4M3 decoded by bit arithmetic,
  exact in the interpreter too); dequantized K/V never reach HBM. The low/high nibbles are kept
  apart: even and odd head-dim columns form two half-width dots (q_even·k_even + q_odd·k_odd, and
  P·v_even, P·v_odd), so no nibble interleaving shuffles are needed; the output store re-interleaves.
- Loops are branch-free so Triton's pipeliner can prefetch the next sub-tile (cp.async): masked-out
  keys (``-1`` entries, out of range, duplicates, the query's future) are masked out of the loads (no
  memory traffic; only their arithmetic is wasted).
- Dots: float32 ``ieee`` in the interpreter (its bf16 dots are wrong); on a GPU bf16 tensor-core dots
  for bf16 q (dequantized K/V have <= 6 significant bits, so they are exact in bf16; P is rounded to
  bf16), ``tf32x3`` for float32 q.
- Tiles (not tuned on the GPU yet) come from offline sm_90a compiles with Triton 3.9 (cuobjdump: no spills): decode bf16 q BLOCK_N=64, 4 warps, 3 stages (146-197 registers over the split buckets),
  float32 q BLOCK_N=32, 8 warps (174-182); prefill see :func:`prefill_config`.

Decode kernel (``msa_decode_kernel``): one program per (query row t, KV group g, split sp), split
fastest, the heads padded to BLOCK_H >= 16 rows; each finds its request from ``query_start_loc`` itself
(:func:`~m3c.backends.kernels.prefill_tiles.request_of_row`: no token -> request launches per layer).
Flash-decoding: the top-k selection is dealt strided over SPLIT programs (entry i goes to split i % SPLIT, so ``-1`` padding spreads evenly); each runs an
online softmax over its blocks and writes (m, l, unnormalized acc) into a float32 workspace; the last
split to finish (an atomic counter, reset to 0 again, so CUDA-graph replays work) merges all partials
exactly in a fixed order (rescale by exp(m_i - m)). SPLIT == 1 writes the output directly. SPLIT is
the smallest power of two giving ~2 programs per SM (<= min(top_k, 16)). Byte floor per row and KV
head: the selected blocks' K and V, 16 blocks × 128 tokens × 2 (K, V) × 72 B (64 B codes + 8 B
scales at D=128) = 294,912 B (288 KiB), i.e. 0.07 µs at 4.28 TB/s: one row is latency-bound.

Prefill kernel (``msa_prefill_kernel``): one program per (tile, KV group); a tile is ROWS consecutive
query rows of ONE request (ROWS × the group's heads = the MMA M dim, 8 × 16 = 128 on M3.1). The grid
is fixed by shapes, ``(T + R·(ROWS-1)) // ROWS`` tiles (an upper bound on sum_r ceil(rows_r / ROWS));
each program finds its (request, first row) by a prefix sum over ``query_start_loc`` in registers and
spare programs exit with nothing to do. It gathers the ROWS × top_k selection entries, drops invalid
ones (``-1``, out of range, wholly in the row's future) and duplicates (an all-pairs compare of the
<= ROWS·top_k entries, once per tile), and iterates over the UNION of the distinct blocks (the u-th
distinct entry is picked by a rank computed with a prefix sum: no loop-carried state). Per key the
mask is per (row, head): the key's block is in that row's own selection and its position <= the
row's position. Online softmax per (row, head), no split (a 4K chunk has 512 tiles per KV group).
Cost: every tile pays for the union, so rows that agree on their blocks cost one pass; rows that all
disagree cost up to ROWS passes of M = 128 rows. Measured on the H200 with independent random
selections per row, that made it ~2x slower than the decode kernel's one pass per row (hence the
default dispatch above); chunks whose rows share blocks were not measured.

Floor of a 4K-row prefill chunk at 1M context (one TP4 slice: 16 heads, 1 KV head, D=128, top-16
blocks of 128, bf16 q): FLOPs 4096 × 16 × 2048 keys × 128 × 4 = 68.7 GFLOP (~92 µs at 750 TFLOP/s
dense bf16); bytes: q + out 33.5 MB, K/V at most every block of the context once (8192 × 18 KiB =
151 MB) and usually far fewer: <= 185 MB (~43 µs at 4.28 TB/s), so the chunk is compute-bound. With a
union of U blocks per tile the kernel does U/16 × the floor's MMA work (U = 16 when a tile's rows
agree), plus the dequant on CUDA cores (~32K values per tile and block, comparable to the MMA time at
M = 128: expect ~2-3× the FLOP floor, ~0.2-0.3 ms). Dense causal attention of the same chunk over
1M keys is 4096 × 16 × 1,048,576 × 128 × 4 = 35.2 TFLOP (>= 47 ms at 750 TFLOP/s): the sparse chunk
does 1/512 of its FLOPs, so ~150-250× faster is the expectation (goal: >= 8×).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from m3c.backends.kernels import msa_attention_cuda
from m3c.backends.kernels.batch_args import paged_batch, require_aligned
from m3c.backends.kernels.fp_codes import e2m1_tiny, e4m3_big, to_stored
from m3c.backends.kernels.host import interpreting, num_sms, persistent
from m3c.backends.kernels.prefill_tiles import prefill_tile, prefill_tile_count, request_of_row
from m3c.backends.kernels.split_merge import last_to_arrive
from m3c.backends.triton_aot import KernelSpec, Runner, jit_run
from m3c.errors import ShapeError


@triton.jit
def _dequant_rows(data_ptr, scale_ptr, tok, rmask, BLOCK_N: tl.constexpr, D2: tl.constexpr):
    """Dequantized (even columns, odd columns) float32 [BLOCK_N, D/2] of cache rows `tok` (token·KVH + head),
    × 2^-7: a nibble placed into float32 bits (``e2m1_tiny``, value × 2^-126, 3 ops) times its scale as
    value × 2^119 (``e4m3_big``). Exact (<= 6 significant bits, within bf16's range); callers undo the 2^-7
    with power-of-two multiplies (:data:`DEQ_UNDO`)."""
    j = tl.arange(0, D2)
    byte = tl.load(data_ptr + tok[:, None] * D2 + j[None, :], mask=rmask[:, None], other=0).to(tl.int32)
    sc = tl.load(scale_ptr + tok[:, None] * (D2 // 8) + tl.arange(0, D2 // 8)[None, :], mask=rmask[:, None], other=0)
    s = e4m3_big(sc.to(tl.int32))  # [BLOCK_N, D/16]: one contiguous load, decoded once, broadcast to its 8 bytes
    s = tl.reshape(tl.broadcast_to(s[:, :, None], [BLOCK_N, D2 // 8, 8]), [BLOCK_N, D2])
    return e2m1_tiny(byte, 0) * s, e2m1_tiny(byte, 4) * s


DEQ_UNDO = tl.constexpr(128.0)
"""2^7: `_dequant_rows` values are × 2^-7, so scores take × 2^7 with the softmax scale and outputs × 2^7."""


@triton.jit
def _store_out(out_ptr, q_off, hmask, o_lo, o_hi, l_sum):
    """Normalize by l (rows with l == 0, i.e. no visible key, give 0) and store even/odd columns; o_lo / o_hi
    are sums of P × (V × 2^-7) (see `_dequant_rows`): × 2^7 first (exact)."""
    ok = l_sum > 0.0
    den = tl.where(ok, l_sum, 1.0)[:, None]
    ty: tl.constexpr = out_ptr.dtype.element_ty
    lo = tl.where(ok[:, None], tl.math.div_rn(o_lo * DEQ_UNDO, den), 0.0)
    hi = tl.where(ok[:, None], tl.math.div_rn(o_hi * DEQ_UNDO, den), 0.0)
    tl.store(out_ptr + q_off, to_stored(lo, ty), mask=hmask[:, None])
    tl.store(out_ptr + q_off + 1, to_stored(hi, ty), mask=hmask[:, None])


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
    q_ptr, kd_ptr, ks_ptr, vd_ptr, vs_ptr, sel_ptr, pos_ptr, qsl_ptr, seqlen_ptr, bt_ptr, out_ptr,
    ws_ptr, ml_ptr, cnt_ptr, n_req, bt_stride, scale,
    H: tl.constexpr, KVH: tl.constexpr, HG: tl.constexpr, BLOCK_H: tl.constexpr, D: tl.constexpr,
    BS: tl.constexpr, BLOCK_N: tl.constexpr, TOPK: tl.constexpr, TOPK_P2: tl.constexpr, SPLIT: tl.constexpr,
    BF16_MMA: tl.constexpr, PREC: tl.constexpr, RB: tl.constexpr,
):
    """Program = (row t, group g, split sp). ws: f32 [tiles, SPLIT, 2, BLOCK_H, D/2]; ml: f32 [tiles, SPLIT, 2,
    BLOCK_H]; cnt: int32 [tiles], zero on entry and on exit (tile = t * KVH + g). Unused when SPLIT == 1."""
    D2: tl.constexpr = D // 2
    PER: tl.constexpr = (TOPK + SPLIT - 1) // SPLIT
    NSUB: tl.constexpr = (BS + BLOCK_N - 1) // BLOCK_N  # BLOCK_N > BS (tiny blocks): one padded sub-tile
    pid = tl.program_id(0)
    sp = pid % SPLIT
    tile = pid // SPLIT
    t = tile // KVH
    g = tile % KVH
    r = request_of_row(t, qsl_ptr, n_req, RB).to(tl.int64)  # no separate token -> request launch
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
        vis = (kpos >= 0) & (kpos <= last) & (rows < BS)
        tok = (phys * BS + (i % NSUB) * BLOCK_N + rows) * KVH + g
        k_lo, k_hi = _dequant_rows(kd_ptr, ks_ptr, tok, vis, BLOCK_N, D2)
        s = _dot(q_lo, tl.trans(k_lo), tl.zeros([BLOCK_H, BLOCK_N], tl.float32), BF16_MMA, PREC)
        s = _dot(q_hi, tl.trans(k_hi), s, BF16_MMA, PREC) * (scale * DEQ_UNDO)
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
        if last_to_arrive(cnt_ptr, tile, SPLIT):  # the last split of this (t, g) merges, in a fixed order
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


@triton.jit
def _entries(sel_ptr, pos_ptr, trow, k, t_end, g, n_blocks, KVH: tl.constexpr, TOPK: tl.constexpr, BS: tl.constexpr):
    """Selection entries (row trow, slot k) of group g as int32 block ids, -1 where invalid: a padding slot,
    a row past t_end, a -1 entry, a block past the request's end or wholly in the row's future."""
    ok = (k < TOPK) & (trow < t_end)
    t64 = tl.where(ok, trow, 0).to(tl.int64)
    b = tl.load(sel_ptr + (t64 * KVH + g) * TOPK + k, mask=ok, other=-1).to(tl.int64)
    pos = tl.load(pos_ptr + t64, mask=ok, other=-1).to(tl.int64)
    return tl.where(ok & (b >= 0) & (b < n_blocks) & (b * BS <= pos), b, -1).to(tl.int32)


@triton.jit
def msa_prefill_kernel(
    q_ptr, kd_ptr, ks_ptr, vd_ptr, vs_ptr, sel_ptr, pos_ptr, qsl_ptr, seqlen_ptr, bt_ptr, out_ptr,
    n_req, bt_stride, scale,
    H: tl.constexpr, KVH: tl.constexpr, HG: tl.constexpr, HGP: tl.constexpr, ROWS: tl.constexpr, D: tl.constexpr,
    BS: tl.constexpr, BLOCK_N: tl.constexpr, TOPK: tl.constexpr, TOPK_P2: tl.constexpr, RCH: tl.constexpr,
    BF16_MMA: tl.constexpr, PREC: tl.constexpr,
):
    """Program = (tile, group g): ROWS consecutive rows of one request × the group's heads (M = ROWS·HGP),
    attending over the union of the rows' selected blocks with a per-(row, head) mask."""
    D2: tl.constexpr = D // 2
    M: tl.constexpr = ROWS * HGP
    C: tl.constexpr = ROWS * TOPK_P2
    NSUB: tl.constexpr = (BS + BLOCK_N - 1) // BLOCK_N  # BLOCK_N > BS (tiny blocks): one padded sub-tile
    pid = tl.program_id(0)
    g = tl.program_id(1)

    # Which request and rows: tiles are numbered request by request, ceil(rows_r / ROWS) each.
    r, t0, t_end = prefill_tile(pid, qsl_ptr, n_req, ROWS, RCH)
    rs = tl.maximum(r, 0).to(tl.int64)
    seq_len = tl.load(seqlen_ptr + rs).to(tl.int64)
    n_blocks = (seq_len + BS - 1) // BS

    # Query rows × heads as the M dimension.
    m = tl.arange(0, M)
    trow = t0 + m // HGP
    mh = m % HGP
    mok = (mh < HG) & (trow < t_end)
    trow64 = tl.where(mok, trow, 0).to(tl.int64)
    pos_m = tl.load(pos_ptr + trow64, mask=mok, other=-1).to(tl.int64)  # -1: sees no key
    j = tl.arange(0, D2)
    q_off = ((trow64 * H + g * HG + mh) * D)[:, None] + 2 * j[None, :]
    q_lo = tl.load(q_ptr + q_off, mask=mok[:, None], other=0.0)
    q_hi = tl.load(q_ptr + q_off + 1, mask=mok[:, None], other=0.0)
    if not BF16_MMA:
        q_lo = q_lo.to(tl.float32)
        q_hi = q_hi.to(tl.float32)
    # The union of the tile's valid entries (ROWS x TOPK_P2 candidates c = (row, k)): first occurrences,
    # ranked by a prefix sum, each with the bitmask of the rows that selected it. Row by row, so the
    # all-pairs compare stays [C, TOPK_P2].
    c = tl.arange(0, C)
    kk = tl.arange(0, TOPK_P2)
    key = _entries(sel_ptr, pos_ptr, t0 + c // TOPK_P2, c % TOPK_P2, t_end, g, n_blocks, KVH, TOPK, BS)
    n_earlier = tl.zeros([C], tl.int32)
    row_bits = tl.zeros([C], tl.int32)
    for rr in tl.static_range(ROWS):
        key_r = _entries(sel_ptr, pos_ptr, t0 + rr + kk * 0, kk, t_end, g, n_blocks, KVH, TOPK, BS)
        eq = (key[:, None] == key_r[None, :]) & (key_r >= 0)[None, :]
        n_earlier += tl.sum((eq & ((rr * TOPK_P2 + kk)[None, :] < c[:, None])).to(tl.int32), axis=1)
        row_bits += tl.where(tl.max(eq.to(tl.int32), axis=1) > 0, 1 << rr, 0)
    first = (key >= 0) & (n_earlier == 0)
    rank = tl.cumsum(first.to(tl.int32), 0) - 1
    n_u = tl.sum(first.to(tl.int32))
    last = tl.minimum(tl.max(pos_m), seq_len - 1)  # the tile's last visible key
    mrow = m // HGP

    rows = tl.arange(0, BLOCK_N)
    m_i = tl.full([M], float("-inf"), tl.float32)
    l_i = tl.zeros([M], tl.float32)
    acc_lo = tl.zeros([M, D2], tl.float32)
    acc_hi = tl.zeros([M, D2], tl.float32)
    for it in range(n_u * NSUB):  # (distinct block, BLOCK_N-key sub-tile of it)
        pick = first & (rank == it // NSUB)
        b = tl.sum(tl.where(pick, key, 0))
        bits = tl.sum(tl.where(pick, row_bits, 0))  # the rows whose selection holds block b
        sub = it % NSUB
        phys = tl.load(bt_ptr + rs * bt_stride + b).to(tl.int64)
        kpos = b.to(tl.int64) * BS + sub * BLOCK_N + rows
        kv_ok = (kpos <= last) & (rows < BS)
        tok = (phys * BS + sub * BLOCK_N + rows) * KVH + g
        k_lo, k_hi = _dequant_rows(kd_ptr, ks_ptr, tok, kv_ok, BLOCK_N, D2)
        s = _dot(q_lo, tl.trans(k_lo), tl.zeros([M, BLOCK_N], tl.float32), BF16_MMA, PREC)
        s = _dot(q_hi, tl.trans(k_hi), s, BF16_MMA, PREC) * (scale * DEQ_UNDO)
        vis = (((bits >> mrow) & 1) != 0)[:, None] & (kpos[None, :] <= pos_m[:, None]) & kv_ok[None, :]
        s = tl.where(vis, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v_lo, v_hi = _dequant_rows(vd_ptr, vs_ptr, tok, kv_ok, BLOCK_N, D2)
        acc_lo = _dot(p, v_lo, acc_lo * alpha[:, None], BF16_MMA, PREC)
        acc_hi = _dot(p, v_hi, acc_hi * alpha[:, None], BF16_MMA, PREC)
        m_i = m_new
    _store_out(out_ptr, q_off, mok, acc_lo, acc_hi, l_i)


# ---------------------------------------------------------------------------------------------
# Host side
# ---------------------------------------------------------------------------------------------

Q_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
ATTN_CUDA = True
"""Decode through the CUDA C++ kernel (:mod:`msa_attention_cuda`) where it runs (CUDA sm_89+, bf16 q, D = 128, KV
blocks of a multiple of 64 tokens, <= 16 heads a KV group), else the Triton kernel. On the H200 (RESULTS.md,
session 15, one row, top-16 of 128-token blocks) 9.4 / 9.8 / 16.0 µs at batch 1 / 8 / 32 vs Triton's 13.8 / 14.1 /
23.1, and 4,096-row prefill chunks ~630 vs ~1,320 µs. :func:`attention_specs` lists its specs when it is on, so
set it the same way for an offline compile and for the run of its artifact. :func:`msa_sparse_attention_decode`
(the Triton kernel with tiling overrides) never takes it."""

MAX_SPLIT = 16


def split_buckets(top_k: int) -> list[int]:
    """The decode split counts the launcher can pick: powers of two <= min(top_k, 16)."""
    out = [1]
    while out[-1] * 2 <= min(top_k, MAX_SPLIT):
        out.append(out[-1] * 2)
    return out


def pick_split(num_tiles: int, top_k: int, device: torch.device) -> int:
    """Splits per (row, group): the smallest bucket filling ~2 programs per SM (2 in the interpreter).

    H200, 32K, batch 1, one row (benchmarks/RESULTS.md, session 10): 166 / 91 / 49 / 28 / 19 µs at 1 / 2 / 4
    / 8 / 16 splits (64-key steps, 4 warps; 126 / 66 / 36 / 21 / 15 µs with 8 warps). A rewrite for latency
    (128-key steps, 8 warps, selection row and block table read up front, merge without loop-carried loads,
    ~16 programs per SM) measured 18.4 µs at 16 splits and made 4K-row prefill chunks 25% slower (3.3 vs
    2.6 ms), so it was not kept: the time is in the per-step NVFP4 decode and the dots' layout changes
    (~3-4 µs per 64-key step), not in the chain of loads."""
    if interpreting():
        return min(2, top_k)
    target = 2 * num_sms(device)
    buckets = split_buckets(top_k)
    for split in buckets:
        if num_tiles * split >= target:
            return split
    return buckets[-1]


def _q_name(dtype: torch.dtype) -> str:
    for name, dt in Q_DTYPES.items():
        if dt == dtype:
            return name
    raise ShapeError(f"q has dtype {dtype}: expected float32 or bfloat16")


def _common_types(q: str) -> dict[str, str]:
    return {"q_ptr": f"*{q}", "kd_ptr": "*u8", "ks_ptr": "*u8", "vd_ptr": "*u8", "vs_ptr": "*u8", "sel_ptr": "*i64",
            "pos_ptr": "*i64"}


_ALIGNED = ("q_ptr", "kd_ptr", "ks_ptr", "vd_ptr", "vs_ptr", "out_ptr")  # 16-byte aligned (checked at launch)


@functools.cache  # launches ask for the same few specs every step: build (and key) each once
def decode_spec(num_heads: int, num_kv_heads: int, d: int, block_size: int, top_k: int, q_dtype: str, split: int,
                *, gpu: bool = True, block_n: int | None = None, num_warps: int | None = None,
                num_stages: int = 3) -> KernelSpec:
    """The decode kernel's KernelSpec for a layout and split (gpu=False: the interpreter's float32 dots)."""
    hg = num_heads // num_kv_heads
    bf16 = q_dtype == "bf16"
    block_n = max(16, min(block_n or (64 if bf16 else 32), block_size))  # dots need K >= 16 (Triton 3.6)
    consts = dict(H=num_heads, KVH=num_kv_heads, HG=hg, BLOCK_H=max(16, triton.next_power_of_2(hg)), D=d,
                  BS=block_size, BLOCK_N=block_n, TOPK=top_k, TOPK_P2=triton.next_power_of_2(top_k), SPLIT=split,
                  BF16_MMA=bf16 and gpu, PREC="tf32x3" if gpu else "ieee", RB=64)
    types = _common_types(q_dtype) | {"qsl_ptr": "*i32", "seqlen_ptr": "*i32", "bt_ptr": "*i32",
                                      "out_ptr": f"*{q_dtype}", "ws_ptr": "*fp32", "ml_ptr": "*fp32",
                                      "cnt_ptr": "*i32", "n_req": "i32", "bt_stride": "i32", "scale": "fp32"}
    # bf16: 8 warps when split (latency-bound rows: 14.9 vs 18.6 µs at 16 splits, 21.0 vs 27.2 at 8, 32K on the
    # H200), 4 for unsplit launches (prefill-sized batches: measured with 4 warps only)
    warps = num_warps or ((8 if split > 1 else 4) if bf16 else 4 if d < 128 else 8)
    return KernelSpec("msa_attention_decode", msa_decode_kernel, types, consts, warps, num_stages,
                      divisible_16=(*_ALIGNED, "ws_ptr", "ml_ptr"))


def prefill_config(num_heads: int, num_kv_heads: int, q_dtype: str, gpu: bool = True) -> tuple[int, int, int, int]:
    """(rows per tile, BLOCK_N, num_warps, num_stages) of the prefill kernel.

    bf16 on a GPU: M = rows × next_pow2(heads per group) = 128 (8 rows × 16 heads), 32-key sub-tiles,
    8 warps, 2 stages (sm_90a offline compile: 252 registers, no spills; 64-key sub-tiles spill). float32
    q (tf32x3 dots, a test path): M = 16, 4 warps, 1 stage (238 registers; more rows spill). Interpreter:
    M = 16. Rows are 1..16 (a tile's row set is an int32 bitmask).
    """
    hgp = triton.next_power_of_2(num_heads // num_kv_heads)
    if gpu and q_dtype == "bf16":
        return min(16, max(1, 128 // hgp)), 32, 8, 2
    return min(16, max(1, 16 // hgp)), 32, 4, 1


@functools.cache  # launches ask for the same few specs every step: build (and key) each once
def prefill_spec(num_heads: int, num_kv_heads: int, d: int, block_size: int, top_k: int, q_dtype: str,
                 *, gpu: bool = True, rows: int | None = None, block_n: int | None = None,
                 num_warps: int | None = None, num_stages: int | None = None) -> KernelSpec:
    """The prefill kernel's KernelSpec for a layout (gpu=False: the interpreter's float32 dots); the keyword
    overrides (for tile searches on a GPU) default to :func:`prefill_config`."""
    hg = num_heads // num_kv_heads
    bf16 = q_dtype == "bf16"
    d_rows, d_bn, d_warps, d_stages = prefill_config(num_heads, num_kv_heads, q_dtype, gpu)
    rows = rows or d_rows
    if not 1 <= rows <= 16:
        raise ShapeError(f"rows={rows}: a prefill tile holds 1..16 query rows")
    consts = dict(H=num_heads, KVH=num_kv_heads, HG=hg, HGP=triton.next_power_of_2(hg), ROWS=rows, D=d,
                  BS=block_size, BLOCK_N=max(16, min(block_n or d_bn, block_size)), TOPK=top_k,
                  TOPK_P2=triton.next_power_of_2(top_k), RCH=256 if gpu else 4, BF16_MMA=bf16 and gpu,
                  PREC="tf32x3" if gpu else "ieee")
    types = _common_types(q_dtype) | {"qsl_ptr": "*i32", "seqlen_ptr": "*i32", "bt_ptr": "*i32",
                                      "out_ptr": f"*{q_dtype}", "n_req": "i32", "bt_stride": "i32", "scale": "fp32"}
    return KernelSpec("msa_attention_prefill", msa_prefill_kernel, types, consts, num_warps or d_warps,
                      num_stages or d_stages, divisible_16=_ALIGNED)


def attention_specs(num_heads: int, num_kv_heads: int, d: int, block_size: int, top_k: int,
                    q_dtype: str = "bf16") -> list[KernelSpec]:
    """Every KernelSpec :func:`msa_sparse_attention` can launch for this layout on a GPU (for AOT compiles):
    the decode kernel at each split bucket, then the prefill kernel. ``q_dtype``: "bf16" or "fp32"."""
    _check_layout(num_heads, num_kv_heads, d, block_size, top_k)
    if q_dtype not in Q_DTYPES:
        raise ShapeError(f"q_dtype={q_dtype!r}: expected one of {sorted(Q_DTYPES)}")
    cuda: list = []
    if ATTN_CUDA and msa_attention_cuda.supported(num_heads, num_kv_heads, d, block_size, top_k, q_dtype) is None:
        cuda = msa_attention_cuda.specs(num_heads, num_kv_heads, block_size, top_k)
    return [*(decode_spec(num_heads, num_kv_heads, d, block_size, top_k, q_dtype, s) for s in split_buckets(top_k)),
            *cuda, prefill_spec(num_heads, num_kv_heads, d, block_size, top_k, q_dtype)]


def _check_layout(h: int, kvh: int, d: int, bs: int, top_k: int) -> None:
    if kvh < 1 or h % kvh:
        raise ShapeError(f"H={h} query heads must be a positive multiple of KVH={kvh} KV heads")
    if d < 32 or d & (d - 1) or bs < 1 or bs & (bs - 1):
        raise ShapeError(f"head dim {d} must be a power of two >= 32 and block_size {bs} a power of two")
    if top_k < 1:
        raise ShapeError(f"top_k={top_k} must be >= 1")


def _workspace(
    device: torch.device, tiles: int, split: int, block_h: int, d: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Persistent partials (acc, m/l) and zeroed counters, reused across calls (CUDA-graph safe).

    With split == 1 (unused by the kernel) a tiny buffer of the right dtypes."""
    parts = tiles * split if split > 1 else 0
    key = (tiles, split, block_h, d) if split > 1 else ()
    return persistent(
        ("msa_attention_decode", str(device), *key),
        lambda: (torch.empty(max(parts * block_h * d, 4), dtype=torch.float32, device=device),
                 torch.empty(max(parts * 2 * block_h, 4), dtype=torch.float32, device=device),
                 torch.zeros(max(tiles if split > 1 else 0, 4), dtype=torch.int32, device=device)))


def _checked(q: torch.Tensor, k_data: torch.Tensor, k_scale: torch.Tensor, v_data: torch.Tensor,
             v_scale: torch.Tensor, selected: torch.Tensor, positions: torch.Tensor, query_start_loc: torch.Tensor,
             seq_lens: torch.Tensor, block_table: torch.Tensor, block_size: int,
             out: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
    """Validate shapes/dtypes (no sync; the batch metadata through `paged_batch`); return (selected i64,
    positions i64, qsl i32, seq_lens i32, block_table i32, out) with the index tensors in the kernels' dtypes
    (device-side casts only if needed)."""
    if q.dim() != 3 or k_data.dim() != 4:
        raise ShapeError(f"q {tuple(q.shape)} must be [T, H, D] and k_data {tuple(k_data.shape)} [NB, BS, KVH, D/2]")
    t, h, d = q.shape
    nb, bs, kvh, d2 = k_data.shape
    top_k = selected.shape[-1] if selected.dim() == 3 else 0
    if bs != block_size or d2 * 2 != d:
        raise ShapeError(f"cache {tuple(k_data.shape)} vs q {tuple(q.shape)}, block_size {block_size}: need "
                         "BS == block_size and the cache's last dim == D/2 (packed nvfp4)")
    _check_layout(h, kvh, d, bs, max(top_k, 1))
    if tuple(selected.shape) != (t, kvh, top_k) or top_k < 1:
        raise ShapeError(f"selected {tuple(selected.shape)} must be [{t}, {kvh}, top_k >= 1]")
    if tuple(v_data.shape) != tuple(k_data.shape) or tuple(k_scale.shape) != (nb, bs, kvh, d // 16) \
            or tuple(v_scale.shape) != tuple(k_scale.shape):
        raise ShapeError("v_data / k_scale / v_scale do not match k_data's nvfp4 layout "
                         f"(scales must be [{nb}, {bs}, {kvh}, {d // 16}])")
    if k_data.dtype != torch.uint8 or v_data.dtype != torch.uint8 or k_scale.element_size() != 1 \
            or v_scale.element_size() != 1:
        raise ShapeError(f"k_data/v_data have dtypes {k_data.dtype}/{v_data.dtype}, scales {k_scale.dtype}/"
                         f"{v_scale.dtype}: expected packed nvfp4 uint8 codes and float8_e4m3fn scales")
    _q_name(q.dtype)
    for name, x in (("q", q), ("k_data", k_data), ("k_scale", k_scale), ("v_data", v_data),
                    ("v_scale", v_scale), ("selected", selected), ("positions", positions),
                    ("query_start_loc", query_start_loc), ("seq_lens", seq_lens)):
        if not x.is_contiguous():
            raise ShapeError(f"{name} must be contiguous (call .contiguous() first)")
    pos, qsl, seq, table = paged_batch(positions, query_start_loc, seq_lens, block_table, t, q.device)
    if block_table.stride(1) != 1:
        raise ShapeError(f"block_table {tuple(block_table.shape)} must have contiguous rows (call .contiguous())")
    if t and seq.shape[0] == 0:
        raise ShapeError(f"{t} query rows but no request (seq_lens is empty)")
    if out is None:
        out = torch.empty_like(q)
    elif out.shape != q.shape or out.dtype != q.dtype or not out.is_contiguous():
        raise ShapeError(f"out {tuple(out.shape)} {out.dtype} must be a contiguous tensor like q")
    require_aligned(q=q, out=out, k_data=k_data, k_scale=k_scale, v_data=v_data, v_scale=v_scale)
    return selected.to(torch.int64), pos, qsl, seq, table, out


def _launch_decode(runner: Runner, spec: KernelSpec, q: torch.Tensor, k_data: torch.Tensor, k_scale: torch.Tensor,
                   v_data: torch.Tensor, v_scale: torch.Tensor, selected: torch.Tensor, positions: torch.Tensor,
                   query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor, out: torch.Tensor,
                   scale: float) -> None:
    c = spec.constexprs
    tiles = q.shape[0] * c["KVH"]
    ws, ml, cnt = _workspace(q.device, tiles, c["SPLIT"], c["BLOCK_H"], c["D"])
    args = (q, k_data, k_scale.view(torch.uint8), v_data, v_scale.view(torch.uint8), selected, positions,
            query_start_loc, seq_lens, block_table, out, ws, ml, cnt, seq_lens.shape[0], block_table.stride(0),
            float(scale))
    runner(spec, (tiles * c["SPLIT"],), args)


def _launch_prefill(runner: Runner, spec: KernelSpec, q: torch.Tensor, k_data: torch.Tensor, k_scale: torch.Tensor,
                    v_data: torch.Tensor, v_scale: torch.Tensor, selected: torch.Tensor, positions: torch.Tensor,
                    query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor,
                    out: torch.Tensor, scale: float) -> None:
    c = spec.constexprs
    t, n_req, rows = q.shape[0], seq_lens.shape[0], c["ROWS"]
    tiles = prefill_tile_count(t, n_req, rows)
    args = (q, k_data, k_scale.view(torch.uint8), v_data, v_scale.view(torch.uint8), selected, positions,
            query_start_loc, seq_lens, block_table, out, n_req, block_table.stride(0), float(scale))
    runner(spec, (tiles, c["KVH"]), args)


def msa_sparse_attention(
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
    *,
    runner: Runner = jit_run,
    out: torch.Tensor | None = None,
    max_q_rows: int | None = None,
) -> torch.Tensor:
    """Exact attention of q [T, H, D] (float32 / bf16) over each row's selected blocks: [T, H, D] in q's dtype.

    Caches are nvfp4 (``k_data``/``v_data`` uint8 [NB, BS, KVH, D/2], scales float8_e4m3fn [NB, BS, KVH,
    D/16]); ``selected`` is int [T, KVH, top_k] request-relative block ids (-1 ignored); batch metadata as
    in :class:`m3c.model_defs.kv_cache.BatchMetadata`. The decode kernel runs every batch unless
    ``max_q_rows`` is given: then ``T <= max_q_rows * R`` runs it, else the prefill kernel (0: always
    prefill). ``out`` may be preallocated. Every launch goes through ``runner``; checks shapes only (no sync).
    """
    sel, pos, qsl, seq, table, out = _checked(q, k_data, k_scale, v_data, v_scale, selected, positions,
                                              query_start_loc, seq_lens, block_table, block_size, out)
    t, h, d = q.shape
    if t == 0:
        return out
    if max_q_rows is None or t <= max_q_rows * seq.shape[0]:
        _decode(runner, q, k_data, k_scale, v_data, v_scale, sel, pos, qsl, seq, table, out, block_size, scale)
    else:
        spec = prefill_spec(h, k_data.shape[2], d, block_size, sel.shape[-1], _q_name(q.dtype), gpu=not interpreting())
        _launch_prefill(runner, spec, q, k_data, k_scale, v_data, v_scale, sel, pos, qsl, seq, table, out, scale)
    return out


def _decode(runner: Runner, q: torch.Tensor, k_data: torch.Tensor, k_scale: torch.Tensor, v_data: torch.Tensor,
            v_scale: torch.Tensor, sel: torch.Tensor, pos: torch.Tensor, qsl: torch.Tensor, seq: torch.Tensor,
            table: torch.Tensor, out: torch.Tensor, block_size: int, scale: float, split: int | None = None,
            **tiles: int | None) -> None:
    """The decode kernel on checked inputs: split (default: the bucket filling the GPU) and tile overrides."""
    t, h, d = q.shape
    kvh, top_k = k_data.shape[2], sel.shape[-1]
    if ATTN_CUDA and not any(tiles.values()) and msa_attention_cuda.call_supported(q, kvh, block_size, top_k) is None:
        msa_attention_cuda.launch(runner, q, k_data, k_scale, v_data, v_scale, sel, pos, qsl, seq, table, out,
                                  block_size, scale)
        return
    split = max(1, min(split or pick_split(t * kvh, top_k, q.device), top_k))
    spec = decode_spec(h, kvh, d, block_size, top_k, _q_name(q.dtype), split, gpu=not interpreting(), **tiles)
    _launch_decode(runner, spec, q, k_data, k_scale, v_data, v_scale, sel, pos, qsl, seq, table, out, scale)


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
    num_warps: int | None = None,
    block_n: int | None = None,
    num_stages: int = 3,
    out: torch.Tensor | None = None,
    runner: Runner = jit_run,
) -> torch.Tensor:
    """The decode kernel alone, with optional overrides (split, tiles) for tests and benchmarks; see
    :func:`msa_sparse_attention` for the arguments. Any split in [1, top_k] works (not only the buckets)."""
    sel, pos, qsl, seq, table, out = _checked(q, k_data, k_scale, v_data, v_scale, selected, positions,
                                              query_start_loc, seq_lens, block_table, block_size, out)
    if q.shape[0] == 0:
        return out
    if block_n is not None and ((block_size % block_n and block_n < block_size) or block_n & (block_n - 1)):
        raise ShapeError(f"block_n={block_n} must be a power of two dividing block_size {block_size} (or above it)")
    _decode(runner, q, k_data, k_scale, v_data, v_scale, sel, pos, qsl, seq, table, out, block_size, scale, split,
            block_n=block_n, num_warps=num_warps, num_stages=num_stages)
    return out
