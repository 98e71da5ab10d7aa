"""The few model operations ATen cannot say well, declared as ``torch.ops.m3c.*`` custom ops.

Everything else in the model is ordinary ATen (linear, split, view, rms_norm, mul, …) so that
fusion is the compiler's work. These ops stay single graph nodes under torch.export / Dynamo; each
has a fake (meta) implementation for tracing without memory, and its real implementation here is
the reference semantics the IR interpreter and every kernel test use.

Paged-cache ops take the batch metadata of :class:`m3c.model_defs.kv_cache.BatchMetadata`
(positions, query_start_loc, seq_lens, block_table) and the cache tensors of one quantity
(``data`` and, for nvfp4, per-16 ``scale``; for fp8, a 0-d per-tensor ``scale``; for bf16, none).
"""

from __future__ import annotations

import torch
from torch.library import custom_op

from m3c.model_defs import msa, quant

# ---------------------------------------------------------------------------------------------
# Weight dequantization and quantization into the caches
# ---------------------------------------------------------------------------------------------


@custom_op("m3c::nvfp4_dequantize", mutates_args=())
def nvfp4_dequantize(data: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor | None) -> torch.Tensor:
    """NVFP4 (packed E2M1 + E4M3 per-16 scales × optional float32 tensor scale) -> float32."""
    return quant.nvfp4_dequantize(quant.NVFP4Tensor(data, scale, global_scale))


@nvfp4_dequantize.register_fake
def _(data: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor | None) -> torch.Tensor:
    return data.new_empty((*data.shape[:-1], data.shape[-1] * 2), dtype=torch.float32)


@custom_op("m3c::mxfp8_dequantize", mutates_args=())
def mxfp8_dequantize(data: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """MXFP8 (E4M3 + E8M0 per-32 scales) -> float32."""
    return quant.mxfp8_dequantize(quant.MXFP8Tensor(data, scale))


@mxfp8_dequantize.register_fake
def _(data: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return data.new_empty(data.shape, dtype=torch.float32)


@custom_op("m3c::nvfp4_quantize", mutates_args=())
def nvfp4_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """NVFP4 with no tensor scale (the KV-cache layout): (packed codes uint8, E4M3 per-16 scales)."""
    t = quant.nvfp4_quantize(x)
    return t.data, t.scale


@nvfp4_quantize.register_fake
def _(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    lead, k = x.shape[:-1], x.shape[-1]
    return x.new_empty((*lead, k // 2), dtype=torch.uint8), x.new_empty((*lead, k // 16), dtype=torch.float8_e4m3fn)


@custom_op("m3c::fp8_quantize", mutates_args=())
def fp8_quantize(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """E4M3 with a given per-tensor scale (saturating)."""
    return quant.fp8_quantize_per_tensor(x, scale)[0]


@fp8_quantize.register_fake
def _(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape, dtype=torch.float8_e4m3fn)


@custom_op("m3c::paged_write", mutates_args=("cache",))
def paged_write(src: torch.Tensor, slot_mapping: torch.Tensor, cache: torch.Tensor) -> None:
    """Store row t of `src` ([T, ...]) at slot `slot_mapping[t]` of `cache` ([blocks, block_size, ...])."""
    flat = cache.view(cache.shape[0] * cache.shape[1], *cache.shape[2:])
    if src.dtype.itemsize == 1:  # index_copy_ has no float8 kernels; copy the bytes
        flat.view(torch.uint8).index_copy_(0, slot_mapping.long(), src.view(torch.uint8))
    else:
        flat.index_copy_(0, slot_mapping.long(), src.to(cache.dtype))


@paged_write.register_fake
def _(src: torch.Tensor, slot_mapping: torch.Tensor, cache: torch.Tensor) -> None:
    return None


# ---------------------------------------------------------------------------------------------
# Reading the paged caches
# ---------------------------------------------------------------------------------------------


def gather_dequant(
    data: torch.Tensor, scale: torch.Tensor | None, fmt: str, blocks: torch.Tensor, length: int
) -> torch.Tensor:
    """The first `length` cached tokens held in `blocks`, dequantized: float32 [length, heads, dim]."""
    rows = data[blocks.long()].flatten(0, 1)[:length]
    if fmt == "nvfp4":
        assert scale is not None
        s = scale[blocks.long()].flatten(0, 1)[:length]
        return quant.nvfp4_dequantize(quant.NVFP4Tensor(rows, s, None))
    if fmt == "fp8":
        assert scale is not None
        return quant.fp8_dequantize(rows, scale)
    return rows.float()


def _requests(query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor, block_size: int):
    """Per request: (token slice, context length, its block ids)."""
    starts = query_start_loc.tolist()
    for r, length in enumerate(seq_lens.tolist()):
        n_blocks = -(-length // block_size)
        yield slice(starts[r], starts[r + 1]), length, block_table[r, :n_blocks]


def _request_kv(k_data: torch.Tensor, k_scale: torch.Tensor | None, v_data: torch.Tensor,
                v_scale: torch.Tensor | None, fmt: str, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                block_table: torch.Tensor, block_size: int):
    """Per request: (its token rows, its dequantized K and V [length, heads, dim])."""
    for rows, length, blocks in _requests(query_start_loc, seq_lens, block_table, block_size):
        yield (rows, gather_dequant(k_data, k_scale, fmt, blocks, length),
               gather_dequant(v_data, v_scale, fmt, blocks, length))


@custom_op("m3c::indexer_block_scores", mutates_args=())
def indexer_block_scores(
    index_q: torch.Tensor,
    k_data: torch.Tensor,
    k_scale: torch.Tensor | None,
    fmt: str,
    positions: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    block_size: int,
) -> torch.Tensor:
    """Block-max-pooled index scores [T, G, max_blocks] (−inf past each request's visible blocks)."""
    t, g, _ = index_q.shape
    out = torch.full((t, g, block_table.shape[1]), float("-inf"), dtype=torch.float32, device=index_q.device)
    for rows, length, blocks in _requests(query_start_loc, seq_lens, block_table, block_size):
        keys = gather_dequant(k_data, k_scale, fmt, blocks, length)[:, 0]
        s = msa.indexer_block_scores(index_q[rows].float(), keys, positions[rows], block_size)
        out[rows, :, : s.shape[-1]] = s
    return out


@indexer_block_scores.register_fake
def _(index_q, k_data, k_scale, fmt, positions, query_start_loc, seq_lens, block_table, block_size):
    return index_q.new_empty((index_q.shape[0], index_q.shape[1], block_table.shape[1]), dtype=torch.float32)


@custom_op("m3c::select_blocks", mutates_args=())
def select_blocks(scores: torch.Tensor, positions: torch.Tensor, block_size: int, top_k: int) -> torch.Tensor:
    """Top-k blocks per query and group, own block forced, ascending, −1 padded: int64 [T, G, top_k]."""
    return msa.select_blocks(scores, positions, block_size, top_k)


@select_blocks.register_fake
def _(scores, positions, block_size, top_k):
    return scores.new_empty((scores.shape[0], scores.shape[1], top_k), dtype=torch.int64)


@custom_op("m3c::sparse_attention", mutates_args=())
def sparse_attention(
    q: torch.Tensor,
    k_data: torch.Tensor,
    k_scale: torch.Tensor | None,
    v_data: torch.Tensor,
    v_scale: torch.Tensor | None,
    fmt: str,
    selected: torch.Tensor,
    positions: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    block_size: int,
    scale: float,
) -> torch.Tensor:
    """Exact attention over each query's selected blocks (request-relative block ids): [T, H, D]."""
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    for rows, k, v in _request_kv(k_data, k_scale, v_data, v_scale, fmt, query_start_loc, seq_lens, block_table,
                                  block_size):
        out[rows] = msa.msa_attention(q[rows], k, v, selected[rows], positions[rows], block_size, scale)
    return out


@sparse_attention.register_fake
def _(q, k_data, k_scale, v_data, v_scale, fmt, selected, positions, query_start_loc, seq_lens, block_table,
      block_size, scale):
    return torch.empty_like(q)


@custom_op("m3c::paged_attention", mutates_args=())
def paged_attention(
    q: torch.Tensor,
    k_data: torch.Tensor,
    k_scale: torch.Tensor | None,
    v_data: torch.Tensor,
    v_scale: torch.Tensor | None,
    fmt: str,
    positions: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    block_size: int,
    scale: float,
) -> torch.Tensor:
    """Dense causal GQA attention over each request's whole cached context: [T, H, D]."""
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    for rows, k, v in _request_kv(k_data, k_scale, v_data, v_scale, fmt, query_start_loc, seq_lens, block_table,
                                  block_size):
        out[rows] = msa.dense_causal_attention(q[rows], k, v, positions[rows], scale)
    return out


@paged_attention.register_fake
def _(q, k_data, k_scale, v_data, v_scale, fmt, positions, query_start_loc, seq_lens, block_table, block_size,
      scale):
    return torch.empty_like(q)


# ---------------------------------------------------------------------------------------------
# MoE
# ---------------------------------------------------------------------------------------------


@custom_op("m3c::topk", mutates_args=())
def topk(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Largest k along the last dim, ties toward the smaller index (stable), in descending order."""
    values, indices = torch.sort(x, dim=-1, descending=True, stable=True)
    return values[..., :k].contiguous(), indices[..., :k].contiguous()


@topk.register_fake
def _(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (*x.shape[:-1], k)
    return x.new_empty(shape), x.new_empty(shape, dtype=torch.int64)


def dequantize_weight(
    fmt: str, data: torch.Tensor, scale: torch.Tensor | None, global_scale: torch.Tensor | None
) -> torch.Tensor:
    """A stored weight (any format) as float32."""
    if fmt == "nvfp4":
        assert scale is not None
        return quant.nvfp4_dequantize(quant.NVFP4Tensor(data, scale, global_scale))
    if fmt == "mxfp8":
        assert scale is not None
        return quant.mxfp8_dequantize(quant.MXFP8Tensor(data, scale))
    return data.float()


@custom_op("m3c::grouped_gemm", mutates_args=())
def grouped_gemm(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    w_data: torch.Tensor,
    w_scale: torch.Tensor | None,
    w_global_scale: torch.Tensor | None,
    fmt: str,
) -> torch.Tensor:
    """Per (token, slot): x[t] (or x[t, j]) @ W[topk_ids[t, j]]^T with stacked expert weights [E, N, K].

    `x` is [T, K] (shared by the token's k slots) or [T, k, K]; out is [T, k, N] in x's dtype.
    Experts no token chose are never dequantized.
    """
    t, k = topk_ids.shape
    n = w_data.shape[1]
    out = x.new_zeros((t, k, n))
    xs = x.unsqueeze(1).expand(t, k, x.shape[-1]) if x.dim() == 2 else x
    for e in torch.unique(topk_ids).tolist():
        tok, slot = (topk_ids == e).nonzero(as_tuple=True)
        w = dequantize_weight(
            fmt,
            w_data[e],
            None if w_scale is None else w_scale[e],
            None if w_global_scale is None else w_global_scale[e],
        ).to(x.dtype)
        out[tok, slot] = xs[tok, slot] @ w.t()
    return out


@grouped_gemm.register_fake
def _(x, topk_ids, w_data, w_scale, w_global_scale, fmt):
    return x.new_empty((topk_ids.shape[0], topk_ids.shape[1], w_data.shape[1]))
