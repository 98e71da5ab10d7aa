"""Fusion: MSA indexer scores + top-k block selection + sparse attention → one ``msa_attention``.

Matches, per sparse layer, the chain the frontend emits::

    s   = indexer_block_scores(iq, index_k_cache, [index_k_scale], positions, qsl, seq_lens, block_table)
    sel = select_blocks(s, positions)
    o   = sparse_attention(q, k_cache, [k_scale], v_cache, [v_scale], sel, positions, qsl, seq_lens, block_table)

where the three ops agree on ``block_size`` and share the batch-metadata values, and replaces it with
one node. The rewriter refuses the match when the scores or the selection have other users (they
would have to be recomputed); a chain whose operands the fused op's stricter checks reject (e.g.
cache blocks that are not ``block_size`` long) is left alone too. One rewrite per form: index cache
with or without a per-tensor scale (an fp8 index cache) × K/V caches with or without scales (fp8
K/V). No casts sit between the three ops in f32 or bf16 models (scores are f32 and the selection
i64 in both), so none are matched. Dense layers (``paged_attention``) are left alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from m3c.ir.graph import Value
from m3c.ir.ops.fused_msa import MSA_OPERANDS
from m3c.passes.rewrite import Builder, Check, Match, P, Rewrite, RewritePass, V, X, op_accepts

PASS_NAME = "fuse_msa_attention"
META = ("positions", "query_start_loc", "seq_lens", "block_table")


def _rewrite(index_scale: bool, kv_scales: bool) -> Rewrite:
    """The rewrite for one form of the chain (which optional scale operands are present)."""
    meta = [X(name) for name in META]
    scores = P("indexer_block_scores", X("index_q", rank=3), X("index_k_cache"),
               X("index_k_scale") if index_scale else None, *meta, name="scores", block_size=V("block_size"))
    selected = P("select_blocks", scores, meta[0], name="selected", block_size=V("block_size"), top_k=V("top_k"))
    attention = P("sparse_attention", X("q", rank=3), X("k_cache"), X("k_scale") if kv_scales else None,
                  X("v_cache"), X("v_scale") if kv_scales else None, selected, *meta, name="attention",
                  block_size=V("block_size"), scale=V("scale"))
    name = "msa" + ("_indexscale" if index_scale else "") + ("_kvscale" if kv_scales else "")
    return Rewrite(name, attention, _build, where=[Check("msa_attention accepts the operands", _accepts_operands)],
                   doc="indexer_block_scores → select_blocks → sparse_attention as one msa_attention")


def _operands(m: Match) -> list[Value | None]:
    """The fused op's operands: the patterns capture each under its name in the op's declaration."""
    return [m[n] if n in m else None for n in (o.rstrip("?") for o in MSA_OPERANDS)]  # noqa: SIM401  (no .get)


def _attrs(m: Match) -> dict[str, Any]:
    return {"block_size": m["block_size"], "top_k": m["top_k"], "scale": m["scale"]}


def _accepts_operands(m: Match) -> bool:
    return op_accepts("msa_attention", _operands(m), _attrs(m))


def _build(m: Match, b: Builder) -> Sequence[Value]:
    return b.add("msa_attention", _operands(m), _attrs(m), names=["msa"])


def fuse_msa_pass() -> RewritePass:
    """The MSA fusion pass (every form of optional cache scales)."""
    return RewritePass(PASS_NAME, [_rewrite(i, kv) for i in (False, True) for kv in (False, True)])
