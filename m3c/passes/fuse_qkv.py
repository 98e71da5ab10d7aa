"""Fusion: QKV projection + per-head norms + RoPE + NVFP4 KV-cache insert → one ``qkv_norm_rope_kvinsert``.

Matches, in the canonicalized graph (RoPE already raised), one layer's chain::

    w' = dequantize(w) | cast(w)          y = linear(x, w')        q, k, v[, iq, ik] = split(y)
    q  = rope(rms_norm(view(q), cast(q_norm)), cos, sin)            (and index-q likewise)
    paged_write(quantize(rope(rms_norm(view(k), cast(k_norm)), cos, sin)) {nvfp4}, slots, k_cache)
    paged_write(quantize(view(v)) {nvfp4}, slots, v_cache)          (and index-k like k)

and replaces it with one node whose outputs are q (and index-q) and whose effects are the cache
writes. One rewrite per form of the chain: sparse/dense layer × projection weight as
``dequantize(w)`` / ``cast(dequantize(w))`` / ``cast(w)`` × norm weights cast to the activation
dtype or used as they are (a bf16 model needs no cast).
"""

from __future__ import annotations

from m3c.ir.types import DType
from m3c.passes.rewrite import Check, Match, P, Rewrite, RewritePass, V, X

PASS_NAME = "fuse_qkv_norm_rope_kvinsert"


WEIGHT_FORMS = ("dequantize", "cast_dequantize", "cast")


def _head_chain(part: P, norm: str, cos: X, sin: X, name: str, norm_cast: bool) -> P:
    """rope(rms_norm(view(part), [cast](norm_weight)), cos, sin)."""
    weight = P("cast", X(norm)) if norm_cast else X(norm)
    return P("rope", P("rms_norm", P("view", part, name=f"{name}_view"), weight, eps=V("eps")), cos, sin, name=name)


def _weight(form: str) -> P:
    if form == "dequantize":
        return P("dequantize", X("w"))
    if form == "cast_dequantize":
        return P("cast", P("dequantize", X("w")))
    return P("cast", X("w"))


def _write(value: P, cache: str, name: str) -> P:
    return P("paged_write", P("quantize", value, dtype="nvfp4"), X("slots"), X(cache), name=name)


def _rewrite(sparse: bool, weight_form: str, norm_cast: bool) -> Rewrite:
    split = P("split", P("linear", X("x", rank=2), _weight(weight_form)), name="split", dim=1)
    cos, sin = X("cos", rank=2), X("sin", rank=2)
    q = _head_chain(split[0], "q_norm", cos, sin, "q", norm_cast)
    k = _write(_head_chain(split[1], "k_norm", cos, sin, "k", norm_cast), "k_cache", "k_write")
    v = _write(P("view", split[2], name="v_view"), "v_cache", "v_write")
    roots = [k, v, q]
    if sparse:
        iq = _head_chain(split[3], "index_q_norm", cos, sin, "iq", norm_cast)
        ik = _write(_head_chain(split[4], "index_k_norm", cos, sin, "ik", norm_cast), "index_k_cache", "ik_write")
        roots = [k, v, ik, q, iq]
    parts = 5 if sparse else 3
    checks = [
        Check(f"the projection splits into {parts} parts", lambda m: len(m.node("split").outputs) == parts),
        Check("every head view is [T, heads, head_dim] of one head_dim", lambda m: _head_dim(m, sparse) > 0),
        Check("the index key is one head", lambda m: not sparse or m.node("ik_view").outputs[0].type.shape[1] == 1),
        Check("caches are nvfp4", lambda m: all(m[c].type.dtype == DType.nvfp4 for c in _caches(sparse))),
    ]
    name = f"qkv_{'sparse' if sparse else 'dense'}_{weight_form}_{'normcast' if norm_cast else 'norm'}"
    return Rewrite(name, roots, lambda m, b: _build(m, b, sparse), where=checks)


def _caches(sparse: bool) -> tuple[str, ...]:
    return ("k_cache", "v_cache", "index_k_cache") if sparse else ("k_cache", "v_cache")


def _head_dim(m: Match, sparse: bool) -> int:
    """The common head_dim of every head view, or 0 if they differ."""
    views = ["q_view", "k_view", "v_view"] + (["iq_view", "ik_view"] if sparse else [])
    dims = {m.node(v).outputs[0].type.shape[2] for v in views}
    ranks = {m.node(v).outputs[0].type.rank for v in views}
    return dims.pop() if len(dims) == 1 and ranks == {3} and isinstance(next(iter(dims | {0})), int) else 0


def _build(m: Match, b, sparse: bool) -> list:
    heads = lambda view: m.node(view).outputs[0].type.shape[1]  # noqa: E731
    attrs = {"num_q_heads": heads("q_view"), "num_kv_heads": heads("k_view"),
             "num_index_heads": heads("iq_view") if sparse else 0, "head_dim": _head_dim(m, sparse), "eps": m["eps"]}
    operands = [m["x"], m["w"], m["q_norm"], m["k_norm"], m["index_q_norm"] if sparse else None,
                m["index_k_norm"] if sparse else None, m["cos"], m["sin"], m["slots"], m["k_cache"], m["v_cache"],
                m["index_k_cache"] if sparse else None]
    outs = b.add("qkv_norm_rope_kvinsert", operands, attrs, names=["q", "iq"] if sparse else ["q"])
    return list(outs)  # one value per root output: writes have none, then q (, iq)


def fuse_qkv_pass() -> RewritePass:
    """The fusion pass (sparse layers first, then dense; every weight and norm form)."""
    return RewritePass(PASS_NAME, [_rewrite(s, form, cast) for s in (True, False) for form in WEIGHT_FORMS
                                   for cast in (True, False)])
