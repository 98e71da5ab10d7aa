"""``msa_attention``: one sparse layer's whole MSA — indexer block scores, top-k block selection and
sparse attention over the selected blocks of the paged caches — as one op (built by the MSA fusion pass).

Its reference is the composition of the three ops it replaces, so interpreter results are bit-identical
to the unfused graph's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from m3c.ir.ops.infer import dims_equal, require_dims_equal, require_rank
from m3c.ir.ops.model import (
    RuntimeTensor,
    _check_cache,
    _check_meta,
    indexer_block_scores,
    select_blocks,
    sparse_attention,
)
from m3c.ir.registry import REQUIRED, IRTypeError, defop
from m3c.ir.types import DType, TensorType

Types = Sequence[TensorType | None]

MSA_OPERANDS = ("q", "index_q", "index_k_cache", "index_k_scale?", "k_cache", "k_scale?", "v_cache", "v_scale?",
                "positions", "query_start_loc", "seq_lens", "block_table")
MSA_ATTRS = {"block_size": REQUIRED, "top_k": REQUIRED, "scale": REQUIRED}


def _positive_int(attrs: dict[str, Any], name: str) -> int:
    value = attrs[name]
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise IRTypeError(f"msa_attention: {name} must be a positive int, got {value!r}")
    return value


def _msa_infer(types: Types, attrs: dict[str, Any]) -> list[TensorType]:
    """Check the operands of the three stages together; the output is typed like q ([T, H, D])."""
    block_size = _positive_int(attrs, "block_size")
    _positive_int(attrs, "top_k")
    if not isinstance(attrs["scale"], (int, float)) or isinstance(attrs["scale"], bool):
        raise IRTypeError(f"msa_attention: scale must be a number, got {attrs['scale']!r}")
    q = require_rank(types[0], "q", 3)
    iq = require_rank(types[1], "index_q", 3)
    require_dims_equal(iq.shape[0], q.shape[0], f"msa_attention: index_q {iq} vs q {q} token count")
    for i, name, query in ((2, "index_k_cache", iq), (4, "k_cache", q), (6, "v_cache", q)):
        _check_cache(query, types[i], name)
        cache = types[i]
        assert cache is not None
        if isinstance(cache.shape[1], int) and cache.shape[1] != block_size:
            raise IRTypeError(f"msa_attention: {name} {cache} has blocks of {cache.shape[1]}, block_size={block_size}")
        if cache.dtype == DType.fp8e4m3 and types[i + 1] is None:
            raise IRTypeError(f"msa_attention: the fp8e4m3 {name} needs its scale operand")
    ik, k, v = types[2], types[4], types[6]
    assert ik is not None and k is not None and v is not None
    require_dims_equal(ik.shape[2], 1, f"msa_attention: index_k_cache {ik} must hold one head")
    require_dims_equal(iq.shape[1], k.shape[2],
                       f"msa_attention: index_q {iq} needs one index head per KV head of k_cache {k}")
    h, kvh = q.shape[1], k.shape[2]
    if isinstance(h, int) and isinstance(kvh, int) and h % kvh:
        raise IRTypeError(f"msa_attention: q {q} has {h} heads, not a multiple of the {kvh} KV heads of {k}")
    if not dims_equal(k.shape[2], v.shape[2]):
        raise IRTypeError(f"msa_attention: k_cache {k} and v_cache {v} differ in heads")
    _check_meta(types, 8)
    return [q]


@defop("msa_attention", MSA_OPERANDS, MSA_ATTRS, infer=_msa_infer, reads=("index_k_cache", "k_cache", "v_cache"),
       replaces=("indexer_block_scores", "select_blocks", "sparse_attention"), host_sync=True)
def msa_attention(q: torch.Tensor, index_q: torch.Tensor, index_k_cache: RuntimeTensor,
                  index_k_scale: torch.Tensor | None, k_cache: RuntimeTensor, k_scale: torch.Tensor | None,
                  v_cache: RuntimeTensor, v_scale: torch.Tensor | None, positions: torch.Tensor,
                  query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor, *,
                  block_size: int, top_k: int, scale: float) -> torch.Tensor:
    """Indexer block scores → top-k block selection → sparse attention over the selected blocks: [T, H, D]."""
    meta = (positions, query_start_loc, seq_lens, block_table)
    scores = indexer_block_scores(index_q, index_k_cache, index_k_scale, *meta, block_size=block_size)
    selected = select_blocks(scores, positions, block_size=block_size, top_k=top_k)
    return sparse_attention(q, k_cache, k_scale, v_cache, v_scale, selected, *meta, block_size=block_size,
                            scale=scale)
