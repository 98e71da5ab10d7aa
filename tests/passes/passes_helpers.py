"""Hand-built graphs for the pass tests (the ops the frontend emits for the reference model) and a runner."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from m3c.ir.graph import Graph, Value
from m3c.ir.interpreter import interpret
from m3c.ir.types import DType, TensorType, sym
from m3c.model_defs.kv_cache import PagedKVCache
from m3c.model_defs.presets import m31_tiny

T, R = sym("T"), sym("R")
BIG = 2**63 - 1  # torch.export's "to the end" slice bound
CFG = m31_tiny()
NUM_BLOCKS, MAX_BLOCKS = 12, 6


def f32(*shape: Any) -> TensorType:
    return TensorType(DType.f32, tuple(shape))


def emit_apply_rope(g: Graph, x: Value, cos: Value, sin: Value, scope: str) -> Value:
    """The ops of m3c.model_defs.layers.apply_rope as a frontend writes them (negative dims, whole slices)."""
    half = cos.type.shape[1]

    def a(op: str, ins: list[Value], attrs: dict[str, Any] | None = None) -> Value:
        return g.add(op, ins, attrs, scope=scope)[0]

    x1 = a("slice", [x], {"dim": -1, "start": 0, "end": half})
    x2 = a("slice", [x], {"dim": -1, "start": half, "end": 2 * half})
    rest = a("slice", [x], {"dim": -1, "start": 2 * half, "end": BIG})
    c = a("slice", [a("unsqueeze", [a("slice", [cos], {"dim": 0, "start": 0, "end": BIG})], {"dim": 1})],
          {"dim": 2, "start": 0, "end": BIG})
    s = a("slice", [a("unsqueeze", [a("slice", [sin], {"dim": 0, "start": 0, "end": BIG})], {"dim": 1})],
          {"dim": 2, "start": 0, "end": BIG})
    first = a("sub", [a("mul", [x1, c]), a("mul", [x2, s])])
    second = a("add", [a("mul", [x2, c]), a("mul", [x1, s])])
    return a("cat", [first, second, rest], {"dim": -1})


def rope_graph() -> Graph:
    """One apply_rope on x [T, 4, 32] with cos, sin [T, 8]."""
    g = Graph("rope")
    x = g.add_input("x", f32(T, 4, 32))
    cos, sin = g.add_input("cos", f32(T, 8)), g.add_input("sin", f32(T, 8))
    g.outputs = [emit_apply_rope(g, x, cos, sin, "attn")]
    return g


def attention_graph(layers: tuple[bool, ...] = (True, False)) -> Graph:
    """Decoder attention blocks of the tiny preset (sparse or dense per layer), f32 caches as state.

    Includes what the passes should clean up: a no-op cast of each norm weight, a view of a view,
    a ×1, a recomputed input norm (CSE) and a dead node (DCE).
    """
    cfg = CFG
    g = Graph("attn")
    h = g.add_input("h", f32(T, cfg.hidden_size))
    cos, sin = g.add_input("cos", f32(T, cfg.rotary_dim // 2)), g.add_input("sin", f32(T, cfg.rotary_dim // 2))
    positions = g.add_input("positions", TensorType(DType.i64, (T,)))
    slots = g.add_input("slot_mapping", TensorType(DType.i64, (T,)))
    table = g.add_input("block_table", TensorType(DType.i32, (R, MAX_BLOCKS)))
    qsl = g.add_input("query_start_loc", TensorType(DType.i32, (R + 1,)))
    seq_lens = g.add_input("seq_lens", TensorType(DType.i32, (R,)))
    meta = [positions, qsl, seq_lens, table]
    heads = {"q": cfg.num_attention_heads, "k": cfg.num_key_value_heads, "v": cfg.num_key_value_heads,
             "iq": cfg.index_n_heads, "ik": 1}
    for i, sparse in enumerate(layers):
        sc = f"layers.{i}.self_attn"

        def a(op: str, ins: list[Any], attrs: dict[str, Any] | None = None, sc: str = sc) -> Value:
            return g.add(op, ins, attrs, scope=sc)[0]

        names = ["q", "k", "v", *(["iq", "ik"] if sparse else [])]
        dims = {n: cfg.index_head_dim if n in ("iq", "ik") else cfg.head_dim for n in names}
        sizes = [heads[n] * dims[n] for n in names]
        w_in = g.add_input(f"l{i}.input_norm", f32(cfg.hidden_size), "param")
        w_qkv = g.add_input(f"l{i}.qkv", f32(sum(sizes), cfg.hidden_size), "param")
        w_o = g.add_input(f"l{i}.o", f32(cfg.hidden_size, cfg.q_size), "param")
        caches = {n: g.add_input(f"l{i}.{n}_cache", f32(NUM_BLOCKS, cfg.msa_block_size, heads[n], dims[n]), "state")
                  for n in (["k", "v", "ik"] if sparse else ["k", "v"])}
        xn = g.add("rms_norm", [h, w_in], {"eps": cfg.rms_norm_eps}, scope=f"layers.{i}")[0]
        parts = g.add("split", [a("linear", [xn, w_qkv])], {"sizes": sizes, "dim": -1}, scope=sc)
        x = {n: a("view", [p], {"shape": ["T", heads[n], dims[n]]}) for n, p in zip(names, parts)}
        x["q"] = a("view", [a("view", [x["q"]], {"shape": ["T", cfg.q_size]})], {"shape": ["T", heads["q"], cfg.head_dim]})
        x["v"] = a("mul", [x["v"]], {"scalar": 1})
        for n in ("q", "k", *(["iq", "ik"] if sparse else [])):
            w = g.add_input(f"l{i}.{n}_norm", f32(dims[n]), "param")
            normed = a("rms_norm", [x[n], a("cast", [w], {"dtype": "f32"})], {"eps": cfg.rms_norm_eps})
            x[n] = emit_apply_rope(g, normed, cos, sin, sc)
        for n, cache in caches.items():
            g.add("paged_write", [x[n], slots, cache], scope=sc)
        bs, scale = cfg.msa_block_size, 1 / math.sqrt(cfg.head_dim)
        if sparse:
            scores = a("indexer_block_scores", [x["iq"], caches["ik"], None, *meta], {"block_size": bs})
            sel = a("select_blocks", [scores, positions], {"block_size": bs, "top_k": cfg.msa_topk_blocks})
            out = a("sparse_attention", [x["q"], caches["k"], None, caches["v"], None, sel, *meta],
                    {"block_size": bs, "scale": scale})
        else:
            out = a("paged_attention", [x["q"], caches["k"], None, caches["v"], None, *meta],
                    {"block_size": bs, "scale": scale})
        a("exp", [out])  # dead
        o = a("linear", [a("view", [out], {"shape": ["T", cfg.q_size]}), w_o])
        again = g.add("rms_norm", [h, w_in], {"eps": cfg.rms_norm_eps}, scope=f"layers.{i}")[0]  # CSE twin of xn
        h = g.add("add", [a("add", [h, o]), a("mul", [again, xn])], scope=f"layers.{i}")[0]
    g.outputs = [h]
    return g


def random_inputs(g: Graph, rng: torch.Generator) -> dict[str, torch.Tensor]:
    """Fresh inputs for `attention_graph`/`rope_graph`: a two-request step with cached context."""
    cache = PagedKVCache(CFG, NUM_BLOCKS, MAX_BLOCKS)
    cache.add_request(0)
    cache.add_request(1)
    cache.prepare({0: 13})
    meta = cache.prepare({0: 3, 1: 5})
    t = meta.positions.shape[0]
    out: dict[str, torch.Tensor] = {
        "positions": meta.positions, "slot_mapping": meta.slot_mapping, "block_table": meta.block_table,
        "query_start_loc": meta.query_start_loc, "seq_lens": meta.seq_lens,
    }
    for v in g.inputs:
        if v.name in out:
            continue
        shape = [t if not isinstance(d, int) else d for d in v.type.shape]
        out[v.name] = torch.randn(*shape, generator=rng) * (0.2 if v.kind == "param" else 1.0)
    return out


def run_both(before: Graph, after: Graph, inputs: dict[str, torch.Tensor]) -> tuple[list[Any], list[Any],
                                                                                    dict[str, Any], dict[str, Any]]:
    """Interpret both graphs on clones of the inputs; returns (outs_before, outs_after, state_before, state_after)."""
    results = []
    for g in (before, after):
        ins = {k: v.clone() for k, v in inputs.items()}
        outs = interpret(g, ins, check_types=True)
        state = {v.name: ins[v.name] for v in g.inputs if v.kind == "state"}
        results.append((outs, state))
    return results[0][0], results[1][0], results[0][1], results[1][1]


def assert_equivalent(before: Graph, after: Graph, inputs: dict[str, torch.Tensor],
                      close: Callable[..., None] = torch.testing.assert_close) -> None:
    """Outputs and final state (KV caches) of both graphs agree."""
    ob, oa, sb, sa = run_both(before, after, inputs)
    assert len(ob) == len(oa)
    for x, y in zip(ob, oa):
        close(y, x)
    assert sb.keys() == sa.keys()
    for k in sb:
        close(sa[k], sb[k], equal_nan=True)
