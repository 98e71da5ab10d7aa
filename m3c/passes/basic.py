"""Basic passes: dead-code elimination, common-subexpression elimination, canonicalization."""

from __future__ import annotations

from typing import Any

from m3c.ir.graph import Graph, Node, Value
from m3c.ir.verifier import record_effect_order
from m3c.passes import effects
from m3c.passes.canonical import canonical_rewrites
from m3c.passes.manager import Pass, PassContext, PassResult
from m3c.passes.rewrite import RewritePass


class DeadCodeElimination(Pass):
    """Remove nodes whose outputs are unused and that have no effects (writes to state always stay).

    A node without outputs exists only for an effect, so it stays even if its op declares none.
    Removing a dead state read changes the graph's access signature, so a recorded
    ``meta["effect_order"]`` is re-recorded then (DCE never moves or drops a write).
    """

    name = "dce"

    def run(self, graph: Graph, ctx: PassContext) -> PassResult:
        """Drop dead nodes (latest first, so whole dead chains go in one run)."""
        live: set[Value] = set(graph.outputs)
        keep: list[Node] = []
        for node in reversed(graph.nodes):
            if effects.has_effects(node) or not node.outputs or any(v in live for v in node.outputs):
                keep.append(node)
                live.update(v for v in node.inputs if v is not None)
        removed = len(graph.nodes) - len(keep)
        dropped_read = removed and any(effects.touches_state(n) for n in set(graph.nodes) - set(keep))
        graph.nodes = keep[::-1]
        if dropped_read and "effect_order" in graph.meta:
            record_effect_order(graph)
        return PassResult(removed > 0, stats={"removed": removed})


def _freeze(value: Any) -> Any:
    """A hashable, type-tagged form of an attribute value (1, 1.0 and True stay distinct)."""
    if isinstance(value, dict):
        return ("dict", tuple(sorted((k, _freeze(v)) for k, v in value.items())))
    if isinstance(value, (list, tuple)):
        return ("seq", tuple(_freeze(v) for v in value))
    return (type(value).__name__, value)


class CommonSubexpressionElimination(Pass):
    """Merge nodes with the same op, operands and attributes into the first one.

    Never merges nodes with effects, nor two reads of a state value with a write to it between them
    (each read is keyed by the state's write count so far). `fallback` nodes (arbitrary ATen calls,
    possibly random) are never merged.
    """

    name = "cse"
    never: frozenset[str] = frozenset({"fallback"})

    def run(self, graph: Graph, ctx: PassContext) -> PassResult:
        """One program-order walk with a value substitution map."""
        subst: dict[Value, Value] = {}
        seen: dict[Any, Node] = {}
        version: dict[Value, int] = {}  # state value -> writes so far
        keep: list[Node] = []
        for node in graph.nodes:
            node.inputs = [None if v is None else subst.get(v, v) for v in node.inputs]
            if effects.has_effects(node):
                for s in effects.writes(node):
                    version[s] = version.get(s, 0) + 1
                keep.append(node)
                continue
            if node.op in self.never or not node.outputs:
                keep.append(node)
                continue
            key = (node.op, tuple(map(id, node.inputs)), _freeze(node.attrs),
                   tuple((id(s), version.get(s, 0)) for s in effects.reads(node)))
            first = seen.get(key)
            if first is None:
                seen[key] = node
                keep.append(node)
                continue
            for old, new in zip(node.outputs, first.outputs):
                subst[old] = new
        graph.outputs = [subst.get(v, v) for v in graph.outputs]
        merged = len(graph.nodes) - len(keep)
        graph.nodes = keep
        return PassResult(merged > 0, stats={"merged": merged})


class Canonicalize(RewritePass):
    """One shape of the graph for later patterns: identities removed, views folded, dims
    non-negative, and the reference model's partial-RoPE idiom raised to one `rope` op."""

    def __init__(self) -> None:
        super().__init__("canonicalize", canonical_rewrites())
