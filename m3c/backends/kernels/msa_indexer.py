"""MSA indexer for decode: NVFP4 index-key scores max-pooled per KV block, then exact top-k block selection.

Semantics: exactly ``msa.select_blocks(msa.indexer_block_scores(...))`` per request over the paged cache,
i.e. ``m3c.model_defs.ops.select_blocks(ops.indexer_block_scores(...))``.

Kernel 1 ``indexer_scores_kernel``, grid (request, chunk of ``chunk_blocks`` blocks). A request's block
range is split into chunks so one long context (8,192 blocks = 1M tokens at block 128) spreads over all
SMs. A program loads the index-q rows of its request (up to ROWS query rows × G heads as one M tile, as
even / odd columns so packed keys need no interleave), then walks its blocks through the block table,
NBT blocks (>= 64 keys) a step: it loads packed E2M1 bytes + E4M3 scale bytes and dequantizes them in
registers, exactly (also in the CPU interpreter) and cheaply: a nibble's bits are placed into a float32
(3 integer ops; E2M1 e = 0 lands on subnormals, so every code reads as value × 2^-126) and multiplied
by its scale, decoded arithmetically as scale × 2^119; the keys so carry 2^-7, undone on the scores (a
power of two: rounding is unchanged). Two tensor-core dots follow (low nibbles × even q columns, high ×
odd; an NVFP4 value has <= 6 significant bits, exact in bf16, so bf16 q uses bf16 dots; float32 q uses
exact-product IEEE FMA dots, a slower test / reference path). Then it masks future keys per row,
max-pools per block (NaN if a visible score is NaN, as torch.amax) and stores [T, G, max_blocks]
float32. Blocks past the request's last visible block get -inf without touching keys. More than ROWS
rows per request loop over row tiles (keys re-read per tile; decode has one tile).

Kernel 2 ``topk_blocks_kernel``, one program per (query row, group): streams the row's scores over
blocks 0..own (later blocks hold only future keys, hence -inf; CAUSAL=False scans all) in chunks of
CH, packing each score and its index into one int64 key (order-preserving float bits << 32 |
(2^31 - 1 - index)) so one max-reduction yields the best score with ties to the smaller index. A
running set of top_k - 1 keys is kept in registers; per chunk, while the chunk's best key beats the
set's minimum it replaces it (at most top_k - 1 times a chunk: no sort). CH is up to 8,192 (16 warps,
no spills on sm_90), so a 1M-token row is one chunk: <= 15 block-wide max-reductions for top-16. The
own block is excluded from candidates and added at the end; NaN / -inf scores never qualify; -0.0
ties +0.0. The <= top_k indices are ranked pairwise and scattered in ascending order, -1 padded.

Byte floor per decode step (per sparse layer): the index keys of every request's whole context, read
once: D/2 code bytes + D/16 scale bytes per token = 72 B/token at D = 128 (72 MiB for a 1M-token
request). Index-q, block tables, block scores (4 B per block and row) and the indices are small beside.

Contract: every token row belongs to a request (query_start_loc[-1] == T), positions lie in
[0, seq_len), blocks hold block_size tokens. No host synchronization (CUDA-graph safe).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import triton
import triton.language as tl

from m3c.backends.kernels.qkv_fused_launch import interpreting
from m3c.errors import ShapeError


@triton.jit
def _e2m1_tiny(b, SHIFT: tl.constexpr):
    """The E2M1 nibble at bit SHIFT (0 or 4) of bytes b (int32) as float32 × 2^-126, exactly, in 3 ops.

    The code's bits (s, e1 e0, m) become the float's sign, lowest two exponent bits and top mantissa
    bit, so e = 0 (0 and 0.5) lands on subnormals and every code gets the same factor 2^-126.
    """
    bits = ((b << (22 - SHIFT)) & 0x01C00000) | ((b << (28 - SHIFT)) & -2147483648)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _e4m3_big(byte):
    """E4M3 bytes (int32, 0..255) -> float32 × 2^119, exactly (NaN for 0x7F / 0xFF; 448 × 2^119 < 2^128)."""
    e = (byte >> 3) & 15
    m = byte & 7
    normal = (((e + 239) << 23) | (m << 20)).to(tl.float32, bitcast=True)
    mag = tl.where(e == 0, m.to(tl.float32) * 1.2980742146337069e33, normal)  # subnormal: m × 2^-9 × 2^119
    nan = tl.full(byte.shape, 0x7FC00000, tl.int32).to(tl.float32, bitcast=True)
    mag = tl.where((byte & 0x7F) == 0x7F, nan, mag)
    return tl.where(byte >= 128, -mag, mag)


@triton.jit
def _dequant_half(b, scale, SHIFT: tl.constexpr, KEYS: tl.constexpr, D: tl.constexpr):
    """Key values × 2^-7 (exact) of the nibbles at SHIFT of bytes b [KEYS, D/2]; scale [KEYS, D/16] × 2^119."""
    v = tl.reshape(_e2m1_tiny(b, SHIFT), [KEYS, D // 16, 8])
    return tl.reshape(v * scale[:, :, None], [KEYS, D // 2])


@triton.jit
def indexer_scores_kernel(
    q_ptr, kd_ptr, ks_ptr, pos_ptr, qsl_ptr, seq_ptr, bt_ptr, out_ptr,
    stride_qt, stride_qg, stride_bt, MB, chunk_blocks,
    G: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, NBT: tl.constexpr, ROWS: tl.constexpr,
    M: tl.constexpr, FILL: tl.constexpr, UPCAST: tl.constexpr,
):
    """Block-max index scores of one (request, block chunk): out[t, g, b] float32 for the request's rows t."""
    KEYS: tl.constexpr = NBT * BS
    HD: tl.constexpr = D // 2
    r = tl.program_id(0)
    c_lo = tl.program_id(1) * chunk_blocks
    c_hi = tl.minimum(c_lo + chunk_blocks, MB)
    q_lo = tl.load(qsl_ptr + r).to(tl.int32)
    q_hi = tl.load(qsl_ptr + r + 1).to(tl.int32)
    n_blk = tl.cdiv(tl.load(seq_ptr + r).to(tl.int32), BS)
    m = tl.arange(0, M)
    mt = m // G
    mg = m % G
    hc = tl.arange(0, HD)
    sc_cols = tl.arange(0, D // 16)
    j = tl.arange(0, KEYS)
    jb = j // BS
    nb = tl.arange(0, NBT)
    nf = tl.arange(0, FILL)
    for t0 in range(q_lo, q_hi, ROWS):
        row_ok = (mt < ROWS) & (t0 + mt < q_hi)
        tok = tl.where(row_ok, t0 + mt, t0).to(tl.int64)
        qpos = tl.where(row_ok, tl.load(pos_ptr + tok).to(tl.int32), -1)
        q_off = tok * stride_qt + mg * stride_qg
        q_even = tl.load(q_ptr + q_off[:, None] + 2 * hc[None, :], mask=row_ok[:, None], other=0.0)
        q_odd = tl.load(q_ptr + q_off[:, None] + 2 * hc[None, :] + 1, mask=row_ok[:, None], other=0.0)
        if UPCAST:  # Triton's CPU interpreter mis-multiplies bf16 dots; f32 gives the same exact products
            q_even = q_even.to(tl.float32)
            q_odd = q_odd.to(tl.float32)
        out_row = out_ptr + (tok * G + mg) * MB
        max_pos = tl.max(qpos)
        n_vis = tl.where(max_pos >= 0, tl.minimum(max_pos // BS + 1, n_blk), 0)
        vis_hi = tl.minimum(c_hi, n_vis)
        for b0 in range(c_lo, vis_hi, NBT):
            blk = b0 + jb  # request-relative block of each key row
            ok = blk < vis_hi
            if NBT == 1:  # one whole block: scalar base address, unmasked loads
                phys = tl.load(bt_ptr + r * stride_bt + b0).to(tl.int64)
                codes = tl.load(kd_ptr + phys * (BS * HD) + (j[:, None] * HD + hc[None, :]))
                sbyte = tl.load(ks_ptr + phys * (BS * D // 16) + (j[:, None] * (D // 16) + sc_cols[None, :]))
            else:
                phys = tl.load(bt_ptr + r * stride_bt + blk, mask=ok, other=0).to(tl.int64)
                slot = phys * BS + j % BS
                codes = tl.load(kd_ptr + slot[:, None] * HD + hc[None, :], mask=ok[:, None], other=0)
                sbyte = tl.load(ks_ptr + slot[:, None] * (D // 16) + sc_cols[None, :], mask=ok[:, None], other=0)
            codes = codes.to(tl.int32)
            scale = _e4m3_big(sbyte.to(tl.int32))
            k_lo = _dequant_half(codes, scale, 0, KEYS, D)
            k_hi = _dequant_half(codes, scale, 4, KEYS, D)
            if q_even.dtype == tl.float32:
                acc = tl.dot(q_even, tl.trans(k_lo), input_precision="ieee")
                acc = tl.dot(q_odd, tl.trans(k_hi), acc, input_precision="ieee")
            else:  # e2m1 × e4m3 has <= 6 significant bits: exact in bf16 / fp16
                acc = tl.dot(q_even, tl.trans(k_lo.to(q_even.dtype)))
                acc = tl.dot(q_odd, tl.trans(k_hi.to(q_odd.dtype)), acc)
            acc = acc * 128.0  # undo the keys' 2^-7 (a power of two: the sums round as unscaled ones)
            key_pos = blk * BS + j % BS
            vis = (key_pos[None, :] <= qpos[:, None]) & ok[None, :]
            s = tl.where(vis, acc, float("-inf"))
            is_nan = s != s
            best = tl.max(tl.reshape(tl.where(is_nan, float("-inf"), s), [M, NBT, BS]), axis=2)
            any_nan = tl.max(tl.reshape(is_nan.to(tl.int32), [M, NBT, BS]), axis=2)
            best = tl.where(any_nan > 0, float("nan"), best)
            cols = b0 + nb
            tl.store(out_row[:, None] + cols[None, :], best, mask=row_ok[:, None] & (cols < vis_hi)[None, :])
        ninf = tl.full([M, FILL], float("-inf"), tl.float32)
        for f0 in range(tl.maximum(c_lo, vis_hi), c_hi, FILL):  # no visible key: -inf, keys untouched
            cols = f0 + nf
            tl.store(out_row[:, None] + cols[None, :], ninf, mask=row_ok[:, None] & (cols < c_hi)[None, :])


@triton.jit
def topk_blocks_kernel(scores_ptr, pos_ptr, out_ptr, MB, G: tl.constexpr, BS: tl.constexpr, K: tl.constexpr,
                       KO: tl.constexpr, CH: tl.constexpr, CAUSAL: tl.constexpr):
    """out[t, g, :K]: own block + top K-1 other blocks of scores[t, g, :] (ties -> smaller), ascending, -1 padded.

    CAUSAL: scan only blocks 0..own (kernel 1's scores are -inf past the own block); else all MB blocks.
    """
    NONE: tl.constexpr = -9223372036854775807  # below every packed key (a finite or +inf score)
    TOP: tl.constexpr = 9223372036854775807
    BIG: tl.constexpr = 2147483647  # "no block": sorts after every real index
    pid = tl.program_id(0)  # t * G + g
    own = tl.load(pos_ptr + pid // G).to(tl.int64) // BS
    n_scan = tl.minimum(own + 1, MB) if CAUSAL else MB
    row = scores_ptr + pid.to(tl.int64) * MB
    slot = tl.arange(0, KO)
    is_set = slot < K - 1  # slots of the running top set; slot K - 1 is the own block's
    top = tl.full([KO], NONE, tl.int64)
    for c0 in range(0, n_scan, CH):
        idx = c0 + tl.arange(0, CH)
        ok = (idx < n_scan) & (idx != own)
        s = tl.load(row + idx, mask=ok, other=float("-inf"))
        s = tl.where(s == 0.0, 0.0, s)  # -0.0 ties +0.0
        ok = ok & (s > float("-inf"))  # NaN and -inf never qualify
        bits = s.to(tl.int32, bitcast=True)
        ordered = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(tl.int64)
        keys = tl.where(ok, (ordered << 32) | (BIG - idx).to(tl.int64), NONE)
        thr = tl.min(tl.where(is_set, top, TOP))
        best = tl.max(keys)
        while best > thr:  # the chunk's best beats the set's minimum: replace it
            victim = tl.min(tl.where(is_set & (top == thr), slot, KO))
            top = tl.where(slot == victim, best, top)
            keys = tl.where(keys == best, NONE, keys)
            thr = tl.min(tl.where(is_set, top, TOP))
            best = tl.max(keys)
    chosen = is_set & (top != NONE)
    cand = tl.where(chosen, BIG - (top & 0x7FFFFFFF), tl.where(slot == K - 1, own, BIG))
    before = (cand[None, :] < cand[:, None]) | ((cand[None, :] == cand[:, None]) & (slot[None, :] < slot[:, None]))
    rank = tl.sum(before.to(tl.int32), axis=1)
    tl.store(out_ptr + pid.to(tl.int64) * K + rank, tl.where(cand == BIG, -1, cand), mask=rank < K)


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 132  # H200


def pick_chunk_blocks(n_req: int, max_blocks: int, nbt: int, num_sms: int) -> int:
    """Blocks per kernel-1 program: ~4 waves of programs over the batch, 2..64 blocks each (a multiple of nbt)."""
    want = triton.cdiv(n_req * max_blocks, 4 * num_sms)
    chunk = min(max(want, 2, nbt), 64, max(max_blocks, 1))
    return triton.cdiv(chunk, nbt) * nbt


def _configs(g: int, d: int, block_size: int, top_k: int, max_blocks: int, max_q_rows: int,
             ) -> tuple[dict[str, Any], int, dict[str, Any], int]:
    """(constexprs, num_warps) of kernel 1, then of kernel 2, for one layout."""
    nbt = max(1, 64 // block_size)
    k1 = dict(G=g, D=d, BS=block_size, NBT=nbt, ROWS=max_q_rows, M=max(16, triton.next_power_of_2(max_q_rows * g)),
              FILL=32, UPCAST=interpreting())
    ch = min(8192, max(16, triton.next_power_of_2(max_blocks)))  # 1M tokens at block 128: one chunk
    k2 = dict(G=g, BS=block_size, K=top_k, KO=max(2, triton.next_power_of_2(top_k)), CH=ch, CAUSAL=True)
    return k1, (8 if nbt * block_size * d >= 8192 else 4), k2, max(4, min(16, ch // 512))


def indexer_specs(g: int, d: int, block_size: int, top_k: int, max_blocks: int, max_q_rows: int = 8,
                  q: str = "bf16") -> list[Any]:
    """AOT KernelSpecs of both kernels as msa_indexer_decode launches them (q: "bf16" or "fp32")."""
    from m3c.backends.triton_aot import KernelSpec

    k1, w1, k2, w2 = _configs(g, d, block_size, top_k, max_blocks, max_q_rows)
    t1 = {"q_ptr": f"*{q}", "kd_ptr": "*u8", "ks_ptr": "*u8", "pos_ptr": "*i64", "qsl_ptr": "*i32", "seq_ptr": "*i32",
          "bt_ptr": "*i32", "out_ptr": "*fp32", "stride_qt": "i32", "stride_qg": "i32", "stride_bt": "i32",
          "MB": "i32", "chunk_blocks": "i32"}
    t2 = {"scores_ptr": "*fp32", "pos_ptr": "*i64", "out_ptr": "*i64", "MB": "i32"}
    return [KernelSpec("msa_indexer_scores", indexer_scores_kernel, t1, k1 | {"UPCAST": False}, w1, 3,
                       divisible_16=("q_ptr", "kd_ptr", "ks_ptr", "out_ptr")),
            KernelSpec("msa_topk_blocks", topk_blocks_kernel, t2, k2, w2, 1, divisible_16=("scores_ptr", "out_ptr"))]


def _check(index_q: torch.Tensor, k_data: torch.Tensor, k_scale: torch.Tensor, positions: torch.Tensor,
           query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor, block_size: int,
           top_k: int, max_q_rows: int) -> None:
    if index_q.dim() != 3:
        raise ShapeError(f"index_q has shape {tuple(index_q.shape)}: expected [T, G, D]")
    t, _, d = index_q.shape
    if d < 32 or d & (d - 1):
        raise ShapeError(f"index head dim {d} must be a power of two >= 32")
    if block_size < 1 or block_size & (block_size - 1):
        raise ShapeError(f"block_size={block_size} must be a power of two")
    if k_data.dim() != 4 or tuple(k_data.shape[1:]) != (block_size, 1, d // 2) or k_data.dtype != torch.uint8:
        raise ShapeError(f"k_data {tuple(k_data.shape)} {k_data.dtype}: expected uint8 [NB, {block_size}, 1, {d // 2}]")
    if tuple(k_scale.shape) != (k_data.shape[0], block_size, 1, d // 16) or k_scale.element_size() != 1:
        raise ShapeError(f"k_scale {tuple(k_scale.shape)}: expected float8_e4m3fn [NB, {block_size}, 1, {d // 16}]")
    r = seq_lens.shape[0]
    if block_table.dim() != 2 or block_table.shape[0] != r or tuple(query_start_loc.shape) != (r + 1,):
        raise ShapeError(f"block_table {tuple(block_table.shape)} / query_start_loc {tuple(query_start_loc.shape)} "
                         f"do not match {r} requests")
    if tuple(positions.shape) != (t,):
        raise ShapeError(f"positions has shape {tuple(positions.shape)}: expected ({t},)")
    if top_k < 1 or max_q_rows < 1:
        raise ShapeError(f"top_k={top_k} and max_q_rows={max_q_rows} must be >= 1")


def msa_indexer_decode(
    index_q: torch.Tensor,
    k_data: torch.Tensor,
    k_scale: torch.Tensor,
    positions: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    block_size: int,
    top_k: int,
    max_q_rows: int = 8,
    *,
    scores_out: torch.Tensor | None = None,
    selected_out: torch.Tensor | None = None,
    chunk_blocks: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Block scores float32 [T, G, max_blocks] and selected blocks int64 [T, G, top_k] (two launches).

    ``index_q`` [T, G, D] float32 / bf16; ``k_data`` uint8 [NB, block_size, 1, D/2] and ``k_scale``
    float8_e4m3fn [NB, block_size, 1, D/16] (the paged NVFP4 index-key cache); batch metadata as in
    :class:`m3c.model_defs.kv_cache.BatchMetadata`. ``max_q_rows`` sizes the query tile (more rows
    per request still work, at one key pass per tile). ``scores_out`` / ``selected_out`` are optional
    preallocated outputs (static buffers for CUDA graphs). Shapes come from tensor sizes only.
    """
    _check(index_q, k_data, k_scale, positions, query_start_loc, seq_lens, block_table, block_size, top_k,
           max_q_rows)
    t, g, d = index_q.shape
    n_req, mb = block_table.shape
    dev = index_q.device
    scores = scores_out if scores_out is not None else torch.empty((t, g, mb), dtype=torch.float32, device=dev)
    selected = selected_out if selected_out is not None else torch.empty((t, g, top_k), dtype=torch.int64, device=dev)
    if tuple(scores.shape) != (t, g, mb) or tuple(selected.shape) != (t, g, top_k):
        raise ShapeError(f"outputs {tuple(scores.shape)}, {tuple(selected.shape)}: expected ({t}, {g}, {mb}), "
                         f"({t}, {g}, {top_k})")
    if t == 0 or n_req == 0 or mb == 0:
        return scores, selected
    if index_q.stride(-1) != 1:
        index_q = index_q.contiguous()
    if block_table.stride(-1) != 1:
        block_table = block_table.contiguous()
    k1, w1, k2, w2 = _configs(g, d, block_size, top_k, mb, max_q_rows)
    chunk = chunk_blocks or pick_chunk_blocks(n_req, mb, k1["NBT"], _num_sms(dev))
    indexer_scores_kernel[(n_req, triton.cdiv(mb, chunk))](
        index_q, k_data, k_scale.view(torch.uint8), positions, query_start_loc, seq_lens, block_table, scores,
        index_q.stride(0), index_q.stride(1), block_table.stride(0), mb, chunk, **k1, num_warps=w1, num_stages=3)
    topk_blocks_kernel[(t * g,)](scores, positions, selected, mb, **k2, num_warps=w2)
    return scores, selected
