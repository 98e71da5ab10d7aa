"""Checks every paged-attention launcher runs on its batch arguments, before any launch (no host sync)."""

from __future__ import annotations

import torch

from m3c.errors import ShapeError


def paged_batch(positions: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                block_table: torch.Tensor, rows: int,
                device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A paged batch's metadata for `rows` query rows, checked (shapes, integer dtypes, `device`) and in the
    kernels' dtypes: positions int64 [T], query_start_loc int32 [R + 1], seq_lens int32 [R], block_table int32
    [R, max_blocks] (as :class:`m3c.model_defs.kv_cache.BatchMetadata` builds them: then no copies)."""
    if seq_lens.dim() != 1:
        raise ShapeError(f"seq_lens has shape {tuple(seq_lens.shape)}: expected [R] (one length per request)")
    r = seq_lens.shape[0]
    if block_table.dim() != 2 or block_table.shape[0] != r or tuple(query_start_loc.shape) != (r + 1,):
        raise ShapeError(f"block_table {tuple(block_table.shape)} / query_start_loc {tuple(query_start_loc.shape)} "
                         f"do not match {r} requests: expected [R, max_blocks] and [R + 1]")
    if tuple(positions.shape) != (rows,):
        raise ShapeError(f"positions has shape {tuple(positions.shape)}: expected ({rows},)")
    named = (("positions", positions), ("query_start_loc", query_start_loc), ("seq_lens", seq_lens),
             ("block_table", block_table))
    for name, x in named:
        if x.dtype.is_floating_point or x.dtype.is_complex or x.dtype == torch.bool:
            raise ShapeError(f"{name} has dtype {x.dtype}: expected an integer tensor (as BatchMetadata builds it)")
        if x.device != device:
            raise ShapeError(f"{name} is on {x.device}, the queries on {device}: move the batch metadata there")
    return (positions.to(torch.int64), query_start_loc.to(torch.int32), seq_lens.to(torch.int32),
            block_table.to(torch.int32))


def require_aligned(**tensors: torch.Tensor) -> None:
    """Raise ShapeError for a tensor not starting at a 16-byte aligned address (the compiled kernels assume it)."""
    for name, x in tensors.items():
        if x.data_ptr() % 16:
            raise ShapeError(f"{name} must start at a 16-byte aligned address (the compiled kernels assume it): "
                             "pass a fresh tensor or a .clone()")
