"""Analyses: the networkx view, effect edges, topological order, reachability and fusion legality."""

from __future__ import annotations

import pytest

from m3c.ir.analysis import effect_edges, moves_effect, reachable, to_networkx, topological_order, would_create_cycle
from m3c.ir.graph import Node
from m3c.ir.verifier import IRVerifyError, verify

from .graphs import attention_graph, diamond


def test_networkx_view_has_inputs_data_and_effect_edges() -> None:
    g, n = attention_graph()
    G = to_networkx(g)
    assert G.number_of_nodes() == len(g.inputs) + len(g.nodes)
    assert G.nodes[g.inputs[0]]["kind"] == "input" and G.nodes[n["attn"]]["op"] == "paged_attention"
    data = {(a, b, d["label"]) for a, b, d in G.edges(data=True) if d["kind"] == "data"}
    assert (n["qkv"], n["split"], "qkv") in data
    assert (g.inputs[0], n["qkv"], "x") in data
    assert (g.inputs[-2], n["write_k"], "kv.0.k") in data  # the state input feeds its writer as data too
    effects = [(a, b, d["state"]) for a, b, d in G.edges(data=True) if d["label"] == "effect"]
    assert effects == [(n["write_k"], n["attn"], "kv.0.k"), (n["write_v"], n["attn"], "kv.0.v")]
    assert g.to_networkx().number_of_edges() == G.number_of_edges()


def test_effect_edges_pair_conflicting_accesses_in_program_order() -> None:
    g, n = attention_graph()
    reader = Node("paged_attention", list(n["attn"].inputs), dict(n["attn"].attrs))
    g.nodes.append(reader)
    edges = effect_edges(g)
    assert (n["write_k"], reader, "kv.0.k") in edges
    assert (n["attn"], reader, "kv.0.k") not in edges  # reads commute
    assert all(g.nodes.index(a) < g.nodes.index(b) for a, b, _ in edges)


def test_reachable_over_data_and_effect_edges() -> None:
    g, n = attention_graph()
    assert reachable(g, n["qkv"], n["out"])
    assert reachable(g, n["write_k"], n["attn"])  # only through the effect edge: paged_write has no outputs
    assert not reachable(g, n["attn"], n["write_k"])
    assert not reachable(g, n["kq"], n["vq"])
    assert reachable(g, n["kq"], n["kq"])


def test_topological_order() -> None:
    g, n = attention_graph()
    assert topological_order(g) == g.nodes
    original = list(g.nodes)
    g.nodes.append(g.nodes.pop(0))  # the projection now comes last, after its users
    with pytest.raises(IRVerifyError, match="before its definition"):
        verify(g)
    g.nodes = topological_order(g)
    assert g.nodes == original
    verify(g)
    g.nodes.reverse()  # reversing also reverses the effects: program order is what orders them
    order = topological_order(g)
    assert order.index(n["attn"]) < order.index(n["write_k"])
    assert order.index(n["kq"]) < order.index(n["write_k"]) and order[0] is n["qkv"]
    n["qkv"].inputs[0] = n["out"].outputs[0]  # out depends on qkv and now qkv on out
    with pytest.raises(IRVerifyError, match="cycle"):
        topological_order(g)


@pytest.mark.parametrize(("members", "cycle"), [("ac", True), ("abc", False), ("ab", False), ("bc", False),
                                                 ("a", False)])
def test_would_create_cycle_on_a_diamond(members: str, cycle: bool) -> None:
    g, a, b, c = diamond()
    nodes = {"a": a, "b": b, "c": c}
    assert would_create_cycle(g, {nodes[m] for m in members}) is cycle


def test_would_create_cycle_through_an_effect_edge() -> None:
    g, n = attention_graph()
    # kq -> paged_write(k) -(effect)-> attention: fusing kq with the attention would need the write inside
    assert would_create_cycle(g, {n["kq"], n["attn"]})
    assert not would_create_cycle(g, {n["kq"], n["write_k"], n["attn"]})
    assert not would_create_cycle(g, {n["kq"], n["write_k"]})


def test_moves_effect() -> None:
    g, n = attention_graph()
    assert moves_effect(g, {n["write_k"], n["out"]})  # the write would land after its reader
    assert not moves_effect(g, {n["kq"], n["write_k"]})  # adjacent, nothing crossed
    assert not moves_effect(g, {n["write_k"], n["write_v"]})  # different states
    assert not moves_effect(g, {n["attn"], n["out"]})
    assert not moves_effect(g, {n["write_k"], n["write_v"], n["attn"]})  # the conflicting pair moves together
    second = Node("paged_attention", list(n["attn"].inputs), dict(n["attn"].attrs))
    g.nodes.insert(g.nodes.index(n["out"]), second)
    assert not moves_effect(g, {n["attn"], n["out"]})  # a read crossing a read is harmless
    g.nodes.insert(g.nodes.index(second), Node("paged_write", list(n["write_k"].inputs)))
    assert moves_effect(g, {n["attn"], n["out"]})  # ... a read crossing a write is not
