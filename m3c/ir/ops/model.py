"""M3 ops: (de)quantization, paged KV-cache write, the three MSA stages, dense paged attention, MoE pieces.

Quantized values are first-class: a weight or cache of dtype ``nvfp4`` / ``mxfp8`` is one IR value
(its runtime object bundles codes and scales). An fp8 cache is an ``fp8e4m3`` tensor plus an
``f32[]`` per-tensor scale operand. The references delegate to :mod:`m3c.model_defs.ops`, so the
IR and the reference model can never disagree.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from m3c.ir.ops.infer import dims_equal, require, require_dims_equal, require_int, require_rank
from m3c.ir.registry import REQUIRED, IRTypeError, defop
from m3c.ir.types import DType, TensorType
from m3c.model_defs import ops as mops
from m3c.model_defs import quant

Types = Sequence[TensorType | None]
RuntimeTensor = torch.Tensor | quant.NVFP4Tensor | quant.MXFP8Tensor


def cache_args(cache: RuntimeTensor, scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None, str]:
    """(data, scale, format name) of a runtime cache value, as the model ops take them."""
    if isinstance(cache, quant.NVFP4Tensor):
        return cache.data, cache.scale, "nvfp4"
    if cache.dtype == torch.float8_e4m3fn:
        return cache, scale, "fp8"
    return cache, None, "bf16"


# ---- quantization ------------------------------------------------------------------------------
def _dequantize_infer(types: Types, attrs: dict[str, Any]) -> list[TensorType]:
    w = require(types[0], "w")
    if not w.dtype.is_quantized:
        raise IRTypeError(f"dequantize expects an nvfp4 or mxfp8 value, got {w}")
    return [TensorType(DType.f32, w.shape)]


@defop("dequantize", ("w",), infer=_dequantize_infer)
def dequantize(w: quant.NVFP4Tensor | quant.MXFP8Tensor) -> torch.Tensor:
    """A block-quantized value (codes × block scales × tensor scale) as float32."""
    if isinstance(w, quant.NVFP4Tensor):
        return quant.nvfp4_dequantize(w)
    return quant.mxfp8_dequantize(w)


def _quantize_infer(types: Types, attrs: dict[str, Any]) -> list[TensorType]:
    x = require(types[0], "x")
    dtype = DType(attrs["dtype"])
    if dtype not in (DType.nvfp4, DType.fp8e4m3, DType.mxfp8):
        raise IRTypeError(f"quantize to {dtype.value}: expected nvfp4, mxfp8 or fp8e4m3")
    block = {DType.nvfp4: quant.NVFP4_BLOCK, DType.mxfp8: quant.MXFP8_BLOCK}.get(dtype)
    if block and (x.rank == 0 or (isinstance(x.shape[-1], int) and x.shape[-1] % block)):
        raise IRTypeError(f"quantize to {dtype.value}: the last dim of {x} must be a multiple of {block}")
    if dtype == DType.fp8e4m3 and (len(types) < 2 or types[1] is None):
        raise IRTypeError("quantize to fp8e4m3 needs its per-tensor scale operand")
    return [TensorType(dtype, x.shape)]


@defop("quantize", ("x", "scale?"), {"dtype": REQUIRED}, infer=_quantize_infer)
def quantize(x: torch.Tensor, scale: torch.Tensor | None = None, *, dtype: str) -> RuntimeTensor:
    """Quantize x: nvfp4 (no tensor scale, the KV-cache layout), mxfp8, or fp8e4m3 with a given scale."""
    if dtype == "nvfp4":
        return quant.nvfp4_quantize(x)
    if dtype == "mxfp8":
        return quant.mxfp8_quantize(x)
    return quant.fp8_quantize_per_tensor(x, scale)[0]


def _no_outputs(types: Types, attrs: dict[str, Any]) -> list[TensorType]:
    src, cache = require(types[0], "src"), require(types[2], "cache")
    slots = require_rank(require_int(types[1], "slot_mapping"), "slot_mapping", 1)
    if src.dtype != cache.dtype:
        raise IRTypeError(f"paged_write: source {src} and cache {cache} differ in dtype")
    if src.rank < 1 or cache.rank != src.rank + 1 or \
            not all(dims_equal(a, b) for a, b in zip(src.shape[1:], cache.shape[2:])):
        raise IRTypeError(f"paged_write: source {src} ([T, ...]) does not fit cache {cache} ([blocks, block_size, ...])")
    require_dims_equal(slots.shape[0], src.shape[0], f"paged_write: slot_mapping {slots} vs source {src} rows")
    return []


@defop("paged_write", ("src", "slot_mapping", "cache"), infer=_no_outputs, writes=("cache",))
def paged_write(src: RuntimeTensor, slot_mapping: torch.Tensor, cache: RuntimeTensor) -> None:
    """Store row t of src at slot slot_mapping[t] of the paged cache [blocks, block_size, ...]."""
    if isinstance(src, quant.NVFP4Tensor):
        assert isinstance(cache, quant.NVFP4Tensor)
        mops.paged_write(src.data, slot_mapping, cache.data)
        mops.paged_write(src.scale, slot_mapping, cache.scale)
    else:
        mops.paged_write(src, slot_mapping, cache)


# ---- MSA -------------------------------------------------------------------------------------
_META = ("positions", "query_start_loc", "seq_lens", "block_table")


def _check_meta(types: Types, first: int) -> TensorType:
    """Check the batch-metadata operands starting at `first`; returns the block table's type."""
    for i, name in enumerate(_META[:3]):
        require_rank(require_int(types[first + i], name), name, 1)
    return require_rank(require_int(types[first + 3], "block_table"), "block_table", 2)


def _check_cache(q: TensorType, cache: TensorType | None, what: str) -> None:
    """A paged cache [blocks, block_size, heads, dim] whose dim matches the query's."""
    cache = require_rank(cache, what, 4)
    require_dims_equal(cache.shape[-1], q.shape[-1], f"{what} {cache} head dim vs query {q}")


def _indexer_infer(types: Types, attrs: dict[str, Any]) -> list[TensorType]:
    q = require_rank(types[0], "index_q", 3)
    _check_cache(q, types[1], "k_cache")
    table = _check_meta(types, 3)
    return [TensorType(DType.f32, (*q.shape[:2], table.shape[1]))]


def _select_infer(types: Types, attrs: dict[str, Any]) -> list[TensorType]:
    scores = require_rank(types[0], "scores", 3)
    require_rank(require_int(types[1], "positions"), "positions", 1)
    if not isinstance(attrs["top_k"], int) or attrs["top_k"] < 1:
        raise IRTypeError(f"select_blocks: top_k must be a positive int, got {attrs['top_k']!r}")
    return [TensorType(DType.i64, (*scores.shape[:2], attrs["top_k"]))]


def _attention_infer(sparse: bool):
    def infer(types: Types, attrs: dict[str, Any]) -> list[TensorType]:
        q = require_rank(types[0], "q", 3)
        _check_cache(q, types[1], "k_cache")
        _check_cache(q, types[3], "v_cache")
        if sparse:
            require_rank(require_int(types[5], "selected"), "selected", 3)
        _check_meta(types, 6 if sparse else 5)
        return [q]

    return infer


@defop("indexer_block_scores", ("index_q", "k_cache", "k_scale?", *_META), {"block_size": REQUIRED},
       infer=_indexer_infer, reads=("k_cache",), host_sync=True)
def indexer_block_scores(index_q: torch.Tensor, k_cache: RuntimeTensor, k_scale: torch.Tensor | None,
                         positions: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                         block_table: torch.Tensor, *, block_size: int) -> torch.Tensor:
    """Index scores of every visible cached key, max-pooled per block: f32 [T, G, max_blocks]."""
    data, scale, fmt = cache_args(k_cache, k_scale)
    return mops.indexer_block_scores(index_q, data, scale, fmt, positions, query_start_loc, seq_lens,
                                     block_table, block_size)


@defop("select_blocks", ("scores", "positions"), {"block_size": REQUIRED, "top_k": REQUIRED}, infer=_select_infer)
def select_blocks(scores: torch.Tensor, positions: torch.Tensor, *, block_size: int, top_k: int) -> torch.Tensor:
    """Top-k blocks per query and group (own block forced, ties to the smaller index), ascending, −1 padded."""
    return mops.select_blocks(scores, positions, block_size, top_k)


@defop("sparse_attention", ("q", "k_cache", "k_scale?", "v_cache", "v_scale?", "selected", *_META),
       {"block_size": REQUIRED, "scale": REQUIRED}, infer=_attention_infer(True),
       reads=("k_cache", "v_cache"), host_sync=True)
def sparse_attention(q: torch.Tensor, k_cache: RuntimeTensor, k_scale: torch.Tensor | None, v_cache: RuntimeTensor,
                     v_scale: torch.Tensor | None, selected: torch.Tensor, positions: torch.Tensor,
                     query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor, *,
                     block_size: int, scale: float) -> torch.Tensor:
    """Exact causal attention over each query's selected blocks of the paged cache."""
    kd, ks, fmt = cache_args(k_cache, k_scale)
    vd, vs, _ = cache_args(v_cache, v_scale)
    return mops.sparse_attention(q, kd, ks, vd, vs, fmt, selected, positions, query_start_loc, seq_lens,
                                 block_table, block_size, scale)


@defop("paged_attention", ("q", "k_cache", "k_scale?", "v_cache", "v_scale?", *_META),
       {"block_size": REQUIRED, "scale": REQUIRED}, infer=_attention_infer(False),
       reads=("k_cache", "v_cache"), host_sync=True)
def paged_attention(q: torch.Tensor, k_cache: RuntimeTensor, k_scale: torch.Tensor | None, v_cache: RuntimeTensor,
                    v_scale: torch.Tensor | None, positions: torch.Tensor, query_start_loc: torch.Tensor,
                    seq_lens: torch.Tensor, block_table: torch.Tensor, *, block_size: int,
                    scale: float) -> torch.Tensor:
    """Dense causal attention over each request's whole cached context."""
    kd, ks, fmt = cache_args(k_cache, k_scale)
    vd, vs, _ = cache_args(v_cache, v_scale)
    return mops.paged_attention(q, kd, ks, vd, vs, fmt, positions, query_start_loc, seq_lens, block_table,
                                block_size, scale)


# ---- MoE -------------------------------------------------------------------------------------
def _topk_infer(types: Types, attrs: dict[str, Any]) -> list[TensorType]:
    x = require(types[0], "x")
    k = attrs["k"]
    if x.rank < 1 or not isinstance(k, int) or k < 1 or (isinstance(x.shape[-1], int) and k > x.shape[-1]):
        raise IRTypeError(f"topk: k={k!r} does not fit the last dim of {x}")
    shape = (*x.shape[:-1], k)
    return [TensorType(x.dtype, shape), TensorType(DType.i64, shape)]


@defop("topk", ("x",), {"k": REQUIRED}, infer=_topk_infer)
def topk(x: torch.Tensor, *, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Largest k along the last dim, descending, ties toward the smaller index."""
    return mops.topk(x, k)


def _grouped_gemm_infer(types: Types, attrs: dict[str, Any]) -> list[TensorType]:
    x, ids, w = require_rank(types[0], "x", (2, 3)), require_rank(types[1], "topk_ids", 2), require(types[2], "w")
    require_int(ids, "topk_ids")
    if w.rank != 3:
        raise IRTypeError(f"grouped_gemm: expert weights must be [E, N, K], got {w}")
    require_dims_equal(x.shape[-1], w.shape[2], f"grouped_gemm: x {x} vs expert weights {w} (K)")
    require_dims_equal(x.shape[0], ids.shape[0], f"grouped_gemm: x {x} vs topk_ids {ids} (tokens)")
    return [TensorType(x.dtype, (*ids.shape, w.shape[1]))]


@defop("grouped_gemm", ("x", "topk_ids", "w"), infer=_grouped_gemm_infer, host_sync=True)
def grouped_gemm(x: torch.Tensor, topk_ids: torch.Tensor, w: RuntimeTensor) -> torch.Tensor:
    """Per (token, slot): x[t] (or x[t, j]) @ W[topk_ids[t, j]]^T; out [T, k, N]."""
    if isinstance(w, quant.NVFP4Tensor):
        return mops.grouped_gemm(x, topk_ids, w.data, w.scale, w.global_scale, "nvfp4")
    if isinstance(w, quant.MXFP8Tensor):
        return mops.grouped_gemm(x, topk_ids, w.data, w.scale, None, "mxfp8")
    return mops.grouped_gemm(x, topk_ids, w, None, None, "bf16")
