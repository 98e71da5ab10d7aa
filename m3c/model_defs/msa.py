"""MiniMax Sparse Attention (MSA): the plain torch reference for one request.

These functions are the ground truth every MSA kernel is tested against; they favour exactness and
clarity over speed (vectorized over queries, no per-query Python loop).

Algorithm. The KV cache is split into blocks of ``block_size`` tokens (the last may be partial).
1. Indexer: for each GQA group ``g`` (one index query per group) every key ``j`` is scored by
   ``dot(index_q[q, g], index_k[j])`` against one shared index-key head (no scale, no activation);
   the scores are max-pooled per block (:func:`indexer_block_scores`).
2. Selection: each query keeps ``top_k`` blocks per group: its own block (the block holding its
   position) always, plus the ``top_k - 1`` highest-scoring other blocks (:func:`select_blocks`).
3. Attention: exact softmax over the keys of the selected blocks of the head's group, causal
   (:func:`msa_attention`). Dense layers use :func:`dense_causal_attention`.

Conventions.
- Key ``j`` has absolute position ``j`` (``0..Tk-1``); ``q_positions[i]`` is the absolute position
  of query ``i`` (``0 <= p < Tk``) and it sees keys ``0..p``. Queries may be a chunk at the end of
  the context or decode rows, in any order.
- Query head ``h`` belongs to GQA group ``h // (H // KVH)``.
- A block with no visible key scores ``-inf`` and is never selected (except as the own block).
  NaN scores count as ``-inf``.
- Ties between equal scores go to the smaller block index (stable descending sort).
- Selected block indices are returned in ascending order, padded with ``-1`` at the end when fewer
  than ``top_k`` blocks are selectable; ``-1`` entries are ignored by :func:`msa_attention`.
- Attention computes in float32 (float64 when an input is float64) and returns ``q.dtype``; block
  scores are float32; indices are int64.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from m3c.errors import ShapeError

NEG_INF = float("-inf")


def _check_int(name: str, value: int, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ShapeError(f"{name}={value!r}: expected an int >= {minimum}")


def _check_ndim(name: str, t: torch.Tensor, ndim: int, layout: str) -> None:
    if t.dim() != ndim:
        raise ShapeError(f"{name} has shape {tuple(t.shape)}: expected {layout}")


def _check_positions(q_positions: torch.Tensor, tq: int, tk: int) -> torch.Tensor:
    """Validate q_positions ([Tq] integers in [0, Tk)) and return them as int64."""
    if q_positions.dim() != 1 or q_positions.shape[0] != tq:
        raise ShapeError(f"q_positions has shape {tuple(q_positions.shape)}: expected ({tq},), one per query")
    if q_positions.is_floating_point() or q_positions.is_complex() or q_positions.dtype == torch.bool:
        raise ShapeError(f"q_positions has dtype {q_positions.dtype}: expected an integer dtype")
    pos = q_positions.long()
    if tq and (int(pos.min()) < 0 or int(pos.max()) >= tk):
        raise ShapeError(f"q_positions must lie in [0, {tk}) (the key at a query's own position must exist)")
    return pos


def _causal_mask(pos: torch.Tensor, tk: int) -> torch.Tensor:
    """[Tq, Tk] bool: key j is visible to query i iff j <= pos[i]."""
    return torch.arange(tk, device=pos.device)[None, :] <= pos[:, None]


def _check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[int, int, int, int]:
    """Validate q [Tq, H, D], k [Tk, KVH, D], v [Tk, KVH, Dv]; return (Tq, H, Tk, KVH)."""
    _check_ndim("q", q, 3, "[Tq, H, D]")
    _check_ndim("k", k, 3, "[Tk, KVH, D]")
    _check_ndim("v", v, 3, "[Tk, KVH, Dv]")
    tq, h, d = q.shape
    tk, kvh, dk = k.shape
    if dk != d:
        raise ShapeError(f"head dim mismatch: q has D={d}, k has D={dk}")
    if tuple(v.shape[:2]) != (tk, kvh):
        raise ShapeError(f"v has shape {tuple(v.shape)}: expected ({tk}, {kvh}, Dv) to match k")
    if kvh == 0 or h % kvh:
        raise ShapeError(f"H={h} query heads is not a multiple of KVH={kvh} key/value heads")
    return tq, h, tk, kvh


def _masked_gqa_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor, scale: float
) -> torch.Tensor:
    """Softmax attention of q [Tq, H, D] over the keys where visible [Tq, KVH, Tk] is True.

    A query head with no visible key gets a zero output.
    """
    tq, h, d = q.shape
    kvh = k.shape[1]
    dt = torch.float64 if torch.float64 in (q.dtype, k.dtype, v.dtype) else torch.float32
    qg = q.to(dt).reshape(tq, kvh, h // kvh, d)  # head h -> (group h // (H // KVH), index in group)
    s = torch.einsum("tgrd,kgd->tgrk", qg, k.to(dt)).mul_(scale)  # logits [Tq, KVH, H // KVH, Tk]
    s.masked_fill_(~visible[:, :, None, :], NEG_INF)
    m = s.amax(dim=-1, keepdim=True)
    m.masked_fill_(m == NEG_INF, 0.0)  # rows with no visible key: avoid (-inf) - (-inf)
    p = s.sub_(m).exp_()  # in place (large tensor); masked keys give exactly 0
    denom = p.sum(dim=-1, keepdim=True)  # >= 1 if any key is visible (the max gives exp(0)), else 0
    out = torch.einsum("tgrk,kgv->tgrv", p, v.to(dt)) / denom.clamp_min(1.0)
    return out.reshape(tq, h, v.shape[-1]).to(q.dtype)


def indexer_block_scores(
    index_q: torch.Tensor, index_k: torch.Tensor, q_positions: torch.Tensor, block_size: int
) -> torch.Tensor:
    """Max-pooled indexer scores: [Tq, G, n_blocks] float32, n_blocks = ceil(Tk / block_size).

    ``score(q, j) = dot(index_q[q, g], index_k[j])`` for keys ``j <= q_positions[q]``; future keys
    are ``-inf`` before the per-block max, so blocks with no visible key score ``-inf``.
    """
    _check_int("block_size", block_size, 1)
    _check_ndim("index_q", index_q, 3, "[Tq, G, D]")
    _check_ndim("index_k", index_k, 2, "[Tk, D]")
    tq, g, d = index_q.shape
    tk = index_k.shape[0]
    if index_k.shape[1] != d:
        raise ShapeError(f"index dim mismatch: index_q has D={d}, index_k has D={index_k.shape[1]}")
    pos = _check_positions(q_positions, tq, tk)
    n_blocks = math.ceil(tk / block_size)
    scores = torch.einsum("qgd,kd->qgk", index_q.float(), index_k.float())
    scores = scores.masked_fill(~_causal_mask(pos, tk)[:, None, :], NEG_INF)
    scores = F.pad(scores, (0, n_blocks * block_size - tk), value=NEG_INF)  # partial last block
    return scores.reshape(tq, g, n_blocks, block_size).amax(dim=-1)


def select_blocks(block_scores: torch.Tensor, q_positions: torch.Tensor, block_size: int, top_k: int) -> torch.Tensor:
    """Per query and group, the ``top_k`` kept blocks: int64 [Tq, G, top_k], ascending, ``-1``-padded.

    The own block ``q_positions // block_size`` is always kept, whatever its score (even NaN or
    ``-inf``). The other ``top_k - 1`` slots go to the highest-scoring other blocks whose score is
    not ``-inf``; NaN scores count as ``-inf`` (never selected). Equal scores: smaller index wins.
    """
    _check_int("block_size", block_size, 1)
    _check_int("top_k", top_k, 1)
    _check_ndim("block_scores", block_scores, 3, "[Tq, G, n_blocks]")
    tq, g, n_blocks = block_scores.shape
    pos = _check_positions(q_positions, tq, n_blocks * block_size)
    own = (pos // block_size)[:, None, None].expand(tq, g, 1)

    scores = block_scores.float()
    scores = scores.masked_fill(torch.isnan(scores), NEG_INF)
    scores = scores.scatter(-1, own, NEG_INF)  # the own block is not a candidate; it is added below
    n_other = min(top_k - 1, n_blocks)
    sorted_scores, order = torch.sort(scores, dim=-1, descending=True, stable=True)  # stable: ties -> smaller
    others = order[..., :n_other].masked_fill(sorted_scores[..., :n_other] == NEG_INF, n_blocks)

    # n_blocks is a sentinel for "no block": it sorts after every real index and becomes -1.
    chosen = torch.cat([own, others], dim=-1).sort(dim=-1).values
    chosen = chosen.masked_fill(chosen == n_blocks, -1)
    return F.pad(chosen, (0, top_k - chosen.shape[-1]), value=-1)


def msa_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    selected_blocks: torch.Tensor,
    q_positions: torch.Tensor,
    block_size: int,
    scale: float,
) -> torch.Tensor:
    """Sparse attention: [Tq, H, Dv] in q.dtype.

    Query head ``h`` attends (exact softmax, ``scale * q.k`` logits) to the keys ``j <= q_positions[q]``
    lying in the blocks ``selected_blocks[q, h // (H // KVH)]`` (``-1`` ignored; duplicates are
    harmless). A head with no such key outputs zeros.
    """
    _check_int("block_size", block_size, 1)
    tq, _, tk, kvh = _check_qkv(q, k, v)
    pos = _check_positions(q_positions, tq, tk)
    _check_ndim("selected_blocks", selected_blocks, 3, "[Tq, KVH, top_k]")
    if tuple(selected_blocks.shape[:2]) != (tq, kvh):
        raise ShapeError(
            f"selected_blocks has shape {tuple(selected_blocks.shape)}: expected ({tq}, {kvh}, top_k), "
            "one row of blocks per query and GQA group"
        )
    if selected_blocks.is_floating_point() or selected_blocks.dtype == torch.bool:
        raise ShapeError(f"selected_blocks has dtype {selected_blocks.dtype}: expected an integer dtype")
    n_blocks = math.ceil(tk / block_size)
    sel = selected_blocks.long()
    if sel.numel() and (int(sel.min()) < -1 or int(sel.max()) >= n_blocks):
        raise ShapeError(f"selected_blocks entries must lie in [-1, {n_blocks})")

    # [Tq, KVH, n_blocks] bool: which blocks are selected (-1 is routed to an extra column, dropped).
    in_block = torch.zeros(tq, kvh, n_blocks + 1, dtype=torch.bool, device=q.device)
    in_block.scatter_(-1, sel.masked_fill(sel < 0, n_blocks), True)
    key_block = torch.arange(tk, device=q.device) // block_size
    visible = in_block[..., :n_blocks][..., key_block] & _causal_mask(pos, tk)[:, None, :]
    return _masked_gqa_attention(q, k, v, visible, scale)


def dense_causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_positions: torch.Tensor, scale: float
) -> torch.Tensor:
    """Plain causal GQA attention over all keys ``j <= q_positions[q]``: [Tq, H, Dv] in q.dtype."""
    tq, _, tk, kvh = _check_qkv(q, k, v)
    pos = _check_positions(q_positions, tq, tk)
    visible = _causal_mask(pos, tk)[:, None, :].expand(tq, kvh, tk)
    return _masked_gqa_attention(q, k, v, visible, scale)


def msa_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    index_q: torch.Tensor,
    index_k: torch.Tensor,
    q_positions: torch.Tensor,
    block_size: int,
    top_k: int,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Full MSA on one request: (output [Tq, H, Dv], selected blocks int64 [Tq, KVH, top_k]).

    ``index_q`` is [Tq, KVH, D_index] (one index query per GQA group), ``index_k`` [Tk, D_index].
    """
    if index_k.dim() != 2 or k.dim() != 3 or index_k.shape[0] != k.shape[0]:
        raise ShapeError(f"index_k {tuple(index_k.shape)} and k {tuple(k.shape)} must cover the same Tk keys")
    scores = indexer_block_scores(index_q, index_k, q_positions, block_size)
    selected = select_blocks(scores, q_positions, block_size, top_k)
    return msa_attention(q, k, v, selected, q_positions, block_size, scale), selected
