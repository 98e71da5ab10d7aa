"""`SparseAttention`: MiniMax Sparse Attention (indexer → top-k block select → sparse attention) as an
nn.Module for users' scripts, over their own paged NVFP4 caches and block tables.

Decode (a few rows per request) and chunked prefill (many rows per request, against a cache that may
already hold up to 1M tokens) go through the same call; the host launchers pick the kernels by shape.
On a GPU it runs m3c's Triton kernels (no host synchronization: CUDA-graph capturable); on the CPU it
runs the reference ops of :mod:`m3c.model_defs.ops` (``impl="kernels"`` forces the kernels, which on
a CPU machine run in Triton's interpreter when TRITON_INTERPRET=1).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from m3c.errors import ShapeError
from m3c.model_defs import ops, quant
from m3c.model_defs.config import M3Config


class SparseAttention(nn.Module):
    """out [T, H, D] = exact attention of q over the top-k blocks its GQA group's index query selects."""

    def __init__(self, block_size: int, top_k: int, scale: float, impl: str = "auto") -> None:
        super().__init__()
        if impl not in ("auto", "kernels", "reference"):
            raise ShapeError(f"impl={impl!r}: expected 'auto', 'kernels' or 'reference'")
        if block_size < 1 or top_k < 1:
            raise ShapeError(f"block_size={block_size} and top_k={top_k} must be >= 1")
        self.block_size, self.top_k, self.scale, self.impl = block_size, top_k, float(scale), impl

    @classmethod
    def from_config(cls, cfg: M3Config, impl: str = "auto") -> SparseAttention:
        """The MSA of a model config (its block size, top-k and 1/sqrt(head_dim) scale)."""
        return cls(cfg.msa_block_size, cfg.msa_topk_blocks, 1.0 / math.sqrt(cfg.head_dim), impl)

    def _kernels(self, t: torch.Tensor) -> bool:
        return self.impl == "kernels" or (self.impl == "auto" and t.device.type == "cuda")

    def select(self, index_q: torch.Tensor, index_k_cache: quant.NVFP4Tensor, positions: torch.Tensor,
               query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
        """The selected blocks int64 [T, G, top_k] (request-relative, ascending, -1 padded)."""
        _check_nvfp4("index_k_cache", index_k_cache)
        if self._kernels(index_q):
            from m3c.backends.kernels.msa_indexer import msa_indexer

            return msa_indexer(index_q, index_k_cache.data, index_k_cache.scale, positions, query_start_loc,
                               seq_lens, block_table, self.block_size, self.top_k)[1]
        scores = ops.indexer_block_scores(index_q, index_k_cache.data, index_k_cache.scale, "nvfp4", positions,
                                          query_start_loc, seq_lens, block_table, self.block_size)
        return ops.select_blocks(scores, positions, self.block_size, self.top_k)

    def forward(self, q: torch.Tensor, index_q: torch.Tensor, index_k_cache: quant.NVFP4Tensor,
                k_cache: quant.NVFP4Tensor, v_cache: quant.NVFP4Tensor, positions: torch.Tensor,
                query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
        """Attention output [T, H, D] in q's dtype (float32 or bf16)."""
        _check_nvfp4("k_cache", k_cache)
        _check_nvfp4("v_cache", v_cache)
        if self._kernels(q):
            from m3c.backends.kernels.msa import msa

            _check_nvfp4("index_k_cache", index_k_cache)  # (the reference path checks it in `select`)
            return msa(q, index_q, index_k_cache, k_cache, v_cache, positions, query_start_loc, seq_lens,
                       block_table, self.block_size, self.top_k, self.scale)
        selected = self.select(index_q, index_k_cache, positions, query_start_loc, seq_lens, block_table)
        return ops.sparse_attention(q, k_cache.data, k_cache.scale, v_cache.data, v_cache.scale, "nvfp4", selected,
                                    positions, query_start_loc, seq_lens, block_table, self.block_size, self.scale)


def _check_nvfp4(name: str, cache: object) -> None:
    if not isinstance(cache, quant.NVFP4Tensor) or cache.data.dim() != 4:
        raise ShapeError(f"{name} must be a paged NVFP4 cache (m3c.model_defs.quant.NVFP4Tensor with data "
                         f"[blocks, block_size, heads, dim/2]), got {type(cache).__name__}; build it with "
                         "m3c.model_defs.kv_cache.PagedKVCache and wrap its *_data / *_scale tensors")
