"""Small hand-built graphs shared by the verifier and analysis tests."""

from __future__ import annotations

from m3c.ir.graph import Graph, Node
from m3c.ir.types import TensorType


def attention_graph() -> tuple[Graph, dict[str, Node]]:
    """One dense attention layer over a paged NVFP4 cache: qkv projection, cache writes, attention.

    Returns the graph and its nodes by role: qkv, split, q3, k3, v3, kq, vq, write_k, write_v, attn, out.
    """
    g = Graph("attn")
    t = TensorType.parse
    x = g.add_input("x", t("f32[T,128]"))
    w = g.add_input("layers.0.qkv", t("f32[96,128]"), "param")
    slots = g.add_input("slot_mapping", t("i64[T]"))
    meta = [g.add_input("positions", t("i64[T]")), g.add_input("query_start_loc", t("i32[R+1]")),
            g.add_input("seq_lens", t("i32[R]")), g.add_input("block_table", t("i32[R,MB]"))]
    kc = g.add_input("kv.0.k", t("nvfp4[NB,8,1,32]"), "state")
    vc = g.add_input("kv.0.v", t("nvfp4[NB,8,1,32]"), "state")
    scope = "layers.0.self_attn"
    (qkv,) = g.add("linear", [x, w], names=["qkv"], scope=f"{scope}.qkv_proj")
    q, k, v = g.add("split", [qkv], {"dim": -1, "sizes": [32, 32, 32]}, names=["q", "k", "v"], scope=scope)
    (q3,) = g.add("view", [q], {"shape": ["T", 1, 32]}, names=["q3"], scope=scope)
    (k3,) = g.add("view", [k], {"shape": ["T", 1, 32]}, names=["k3"], scope=scope)
    (v3,) = g.add("view", [v], {"shape": ["T", 1, 32]}, names=["v3"], scope=scope)
    (kq,) = g.add("quantize", [k3], {"dtype": "nvfp4"}, names=["kq"], scope=scope)
    (vq,) = g.add("quantize", [v3], {"dtype": "nvfp4"}, names=["vq"], scope=scope)
    g.add("paged_write", [kq, slots, kc], scope=f"{scope}.k_insert")
    g.add("paged_write", [vq, slots, vc], scope=f"{scope}.v_insert")
    (o,) = g.add("paged_attention", [q3, kc, None, vc, None, *meta], {"block_size": 8, "scale": 32**-0.5},
                 names=["o"], scope=scope)
    g.outputs = g.add("view", [o], {"shape": ["T", 32]}, names=["out"], scope=scope)
    roles = ["qkv", "split", "q3", "k3", "v3", "kq", "vq", "write_k", "write_v", "attn", "out"]
    return g, dict(zip(roles, g.nodes))


def diamond() -> tuple[Graph, Node, Node, Node]:
    """a = neg(x); b = exp(a); c = add(a, b): paths a -> b -> c and a -> c."""
    g = Graph("diamond")
    x = g.add_input("x", TensorType.parse("f32[T]"))
    (a,) = g.add("neg", [x], names=["a"])
    (b,) = g.add("exp", [a], names=["b"])
    (c,) = g.add("add", [a, b], names=["c"])
    g.outputs = [c]
    return g, a.producer, b.producer, c.producer  # type: ignore[return-value]
