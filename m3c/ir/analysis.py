"""Graph analyses over data and effect edges: networkx view, topological order, reachability, fusion legality.

Data edges run from a value's producer (a Node, or for a graph input the input's own Value, which
stands as a pseudo node) to each node using it. Effect edges run, in program order, between two
nodes touching the same state input when at least one of them writes it (reads commute with
reads). A fusion is legal when the fused group neither creates a cycle (:func:`would_create_cycle`)
nor moves a state access across a conflicting one (:func:`moves_effect`).

The fast queries assume a graph in valid program order (``verify`` passes): every edge points
forward, so a search can stop at the group's last member.
"""

from __future__ import annotations

from collections.abc import Iterable

import networkx as nx

from m3c.ir.graph import Graph, Node, Value
from m3c.ir.registry import UnknownOpError
from m3c.ir.verifier import IRVerifyError, describe, state_accesses

EFFECT = "effect"


def accesses(node: Node) -> dict[Value, str]:
    """The state operands a node touches and how: 'w', 'r' or 'wr' (unknown ops touch nothing)."""
    try:
        acc = state_accesses(node)
    except (UnknownOpError, ValueError):
        return {}
    out: dict[Value, str] = {}
    for v, mode in acc:
        out[v] = "".join(sorted(set(out.get(v, "") + mode), reverse=True))
    return out


def effect_edges(g: Graph) -> list[tuple[Node, Node, str]]:
    """(earlier, later, state name) for every pair of nodes touching one state where at least one writes."""
    touching: dict[Value, list[tuple[Node, str]]] = {}
    for node in g.nodes:
        for v, mode in accesses(node).items():
            touching.setdefault(v, []).append((node, mode))
    edges = []
    for v, seq in touching.items():
        for i, (a, ma) in enumerate(seq):
            edges += [(a, b, v.name) for b, mb in seq[i + 1:] if "w" in ma or "w" in mb]
    return edges


def _data_edges(g: Graph) -> Iterable[tuple[Node | Value, Node, Value]]:
    inputs = set(g.inputs)
    for node in g.nodes:
        for v in node.inputs:
            if v is None:
                continue
            if v in inputs:
                yield v, node, v
            elif v.producer is not None:
                yield v.producer, node, v


def to_networkx(g: Graph) -> nx.MultiDiGraph:
    """Nodes: every Node (attrs kind='node', op, index) and every graph input's Value (kind='input',
    input_kind, index). Edges: data edges (kind='data', label=value name, value) and effect edges
    (kind='effect', label='effect', state=name)."""
    G = nx.MultiDiGraph(name=g.name)
    for i, v in enumerate(g.inputs):
        G.add_node(v, kind="input", input_kind=v.kind, index=i, label=f"%{v.name}")
    for i, node in enumerate(g.nodes):
        G.add_node(node, kind="node", op=node.op, index=i, label=describe(node, i))
    for src, dst, v in _data_edges(g):
        G.add_edge(src, dst, kind="data", label=v.name, value=v)
    for a, b, state in effect_edges(g):
        G.add_edge(a, b, kind=EFFECT, label=EFFECT, state=state)
    return G


def topological_order(g: Graph) -> list[Node]:
    """The nodes in a dependency order (data + effect edges), ties broken by program order."""
    G = to_networkx(g)
    try:
        order = list(nx.lexicographical_topological_sort(G, key=lambda n: (G.nodes[n]["kind"], G.nodes[n]["index"])))
    except nx.NetworkXUnfeasible:
        cycle = nx.find_cycle(G)
        path = " -> ".join(describe(a) for a, *_ in cycle if isinstance(a, Node))
        raise IRVerifyError([f"the graph has a cycle: {path}"]) from None
    return [n for n in order if isinstance(n, Node)]


def _successors(g: Graph) -> dict[Node | Value, list[Node]]:
    succ: dict[Node | Value, list[Node]] = {}
    for src, dst, _ in _data_edges(g):
        succ.setdefault(src, []).append(dst)
    for a, b, _ in effect_edges(g):
        succ.setdefault(a, []).append(b)
    return succ


def reachable(g: Graph, src_node: Node, dst_node: Node) -> bool:
    """Whether a path of data or effect edges leads from `src_node` to `dst_node` (a node reaches itself)."""
    if src_node is dst_node:
        return True
    pos = {n: i for i, n in enumerate(g.nodes)}
    return _reaches(_successors(g), pos, [src_node], {dst_node}, pos[dst_node])


def would_create_cycle(g: Graph, group: set[Node]) -> bool:
    """Whether some path leaves `group` and re-enters it, so fusing the group into one node makes a cycle."""
    if len(group) < 2:
        return False
    pos = {n: i for i, n in enumerate(g.nodes)}
    limit = max(pos[m] for m in group)
    succ = _successors(g)
    outside = [s for m in group for s in succ.get(m, ()) if s not in group and pos[s] < limit]
    return _reaches(succ, pos, outside, group, limit)


def _reaches(succ: dict, pos: dict, starts: list, targets: set, limit: int) -> bool:
    """Whether a path from `starts` reaches a node of `targets`, walking only nodes placed before `limit`.

    In program order every edge points forward, so nothing at or after `limit` can lead back to a
    target placed before it.
    """
    stack, seen = list(starts), set(starts)
    while stack:
        for s in succ.get(stack.pop(), ()):
            if s in targets:
                return True
            if s not in seen and pos[s] < limit:
                seen.add(s)
                stack.append(s)
    return False


def moves_effect(g: Graph, group: set[Node]) -> bool:
    """Whether fusing `group` into one node at its last member's position moves a member's state access
    past another node's conflicting access to the same state (at least one of the two writes)."""
    pos = {n: i for i, n in enumerate(g.nodes)}
    last = max((pos[m] for m in group), default=0)
    for m in group:
        mine = accesses(m)
        if not mine:
            continue
        for other in g.nodes[pos[m] + 1:last]:
            if other in group:
                continue
            theirs = accesses(other)
            if any(v in theirs and ("w" in mode or "w" in theirs[v]) for v, mode in mine.items()):
                return True
    return False
