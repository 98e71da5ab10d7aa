"""MSA host dispatcher: the indexer (scores + exact top-k block select) then the sparse attention, on paged
NVFP4 caches — the one composition the runtime (:mod:`m3c.runtime.cuda_ops`) and the fused module
(:class:`m3c.fused.SparseAttention`) both launch. No host synchronization: CUDA-graph capturable."""

from __future__ import annotations

import torch

from m3c.backends.kernels.msa_attention import msa_sparse_attention
from m3c.backends.kernels.msa_indexer import msa_indexer
from m3c.backends.triton_aot import Runner, jit_run
from m3c.model_defs.quant import NVFP4Tensor


def msa(q: torch.Tensor, index_q: torch.Tensor, index_k_cache: NVFP4Tensor, k_cache: NVFP4Tensor,
        v_cache: NVFP4Tensor, positions: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
        block_table: torch.Tensor, block_size: int, top_k: int, scale: float, *,
        runner: Runner = jit_run) -> torch.Tensor:
    """Attention output [T, H, D] in q's dtype: each row attends exactly over the top_k blocks its GQA group's
    index query selects (caches as :class:`NVFP4Tensor`: data [NB, BS, heads, D/2], scale [NB, BS, heads, D/16])."""
    _, selected = msa_indexer(index_q, index_k_cache.data, index_k_cache.scale, positions, query_start_loc,
                              seq_lens, block_table, block_size, top_k, runner=runner)
    return msa_sparse_attention(q.contiguous(), k_cache.data, k_cache.scale, v_cache.data, v_cache.scale, selected,
                                positions, query_start_loc, seq_lens, block_table, block_size, scale, runner=runner)
