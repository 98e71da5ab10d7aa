"""Graph, Node and Value: the IR in SSA form.

A :class:`Graph` has typed inputs (``input`` activations, ``param`` weights, ``state`` buffers
such as KV caches that ops write in place), a list of nodes in program order, and outputs. Each
:class:`Value` is defined once, by a graph input or one node's output. Effects (writes to state)
are declared by the op registry; program order orders them, and passes must keep that order.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from m3c.ir.types import TensorType

INPUT_KINDS = ("input", "param", "state")


class Value:
    """An SSA value: a graph input or one output of one node."""

    __slots__ = ("index", "kind", "name", "producer", "type")

    def __init__(self, name: str, type: TensorType, kind: str = "result", producer: Node | None = None,
                 index: int = 0) -> None:
        self.name, self.type, self.kind, self.producer, self.index = name, type, kind, producer, index

    def __repr__(self) -> str:
        return f"%{self.name}: {self.type}"


@dataclass(eq=False)
class Node:
    """One operation: op name, operands (None for an absent optional operand), attributes, outputs."""

    op: str
    inputs: list[Value | None]
    attrs: dict[str, Any] = field(default_factory=dict)
    outputs: list[Value] = field(default_factory=list)
    scope: str = ""  # where it came from (module path), for reports; not part of equality

    def __repr__(self) -> str:
        outs = ", ".join(f"%{v.name}" for v in self.outputs)
        ins = ", ".join("_" if v is None else f"%{v.name}" for v in self.inputs)
        return f"{outs + ' = ' if outs else ''}{self.op}({ins})"


class Graph:
    """A function: inputs, nodes in program order, outputs."""

    def __init__(self, name: str = "main") -> None:
        self.name = name
        self.inputs: list[Value] = []
        self.nodes: list[Node] = []
        self.outputs: list[Value] = []
        self.meta: dict[str, Any] = {}
        self._names: set[str] = set()
        self._counter = itertools.count()

    # ---- building ------------------------------------------------------------------------
    def fresh_name(self, hint: str = "") -> str:
        """A value name not yet used in this graph."""
        base = "".join(c if c.isalnum() or c in "_." else "_" for c in hint) if hint else ""
        if base and base not in self._names and not base[0].isdigit():
            self._names.add(base)
            return base
        while True:
            name = f"{base}{next(self._counter)}" if base else str(next(self._counter))
            if name not in self._names:
                self._names.add(name)
                return name

    def add_input(self, name: str, type: TensorType, kind: str = "input") -> Value:
        """Append a graph input of kind 'input', 'param' or 'state'."""
        if kind not in INPUT_KINDS:
            raise ValueError(f"input kind {kind!r} not in {INPUT_KINDS}")
        if name in self._names:
            raise ValueError(f"value name {name!r} already used")
        self._names.add(name)
        v = Value(name, type, kind)
        self.inputs.append(v)
        return v

    def make_node(self, op: str, inputs: Iterable[Value | None], attrs: dict[str, Any] | None,
                  out_types: list[TensorType], names: list[str] | None = None, scope: str = "") -> Node:
        """A node with fresh output values (not yet placed in the node list)."""
        node = Node(op, list(inputs), dict(attrs or {}), [], scope)
        for i, t in enumerate(out_types):
            name = self.fresh_name(names[min(i, len(names) - 1)] if names else "")  # extra outputs: numbered
            node.outputs.append(Value(name, t, "result", node, i))
        return node

    def new_node(self, op: str, inputs: Iterable[Value | None], attrs: dict[str, Any] | None = None,
                 names: list[str] | None = None, scope: str = "") -> Node:
        """A node whose output types the op registry infers (not yet placed in the node list)."""
        from m3c.ir.registry import get_op, infer_types

        opdef = get_op(op)
        inputs = list(inputs)
        opdef.check_operands(inputs)
        full = opdef.full_attrs(dict(attrs or {}))
        out_types = infer_types(opdef, [None if v is None else v.type for v in inputs], full)
        stored = {k: v for k, v in full.items() if k in (attrs or {}) or v != opdef.attrs[k]}
        return self.make_node(op, inputs, stored, out_types, names, scope)

    def add(self, op: str, inputs: Iterable[Value | None], attrs: dict[str, Any] | None = None,
            names: list[str] | None = None, scope: str = "") -> list[Value]:
        """Append a type-inferred node; returns its outputs (a new list: the node keeps its own)."""
        return list(self.append(self.new_node(op, inputs, attrs, names, scope)).outputs)

    def append(self, node: Node) -> Node:
        """Place a node at the end of the program."""
        self.nodes.append(node)
        return node

    def insert_before(self, anchor: Node, node: Node) -> Node:
        """Place a node just before `anchor`."""
        self.nodes.insert(self.nodes.index(anchor), node)
        return node

    def remove(self, node: Node) -> None:
        """Drop a node (its outputs must be unused)."""
        self.nodes.remove(node)

    def replace_uses(self, old: Value, new: Value, after: Node | None = None) -> int:
        """Point every use of `old` (optionally only in nodes after `after`) at `new`; returns the count."""
        count, live = 0, after is None
        for node in self.nodes:
            if not live:
                live = node is after
                continue
            for i, v in enumerate(node.inputs):
                if v is old:
                    node.inputs[i] = new
                    count += 1
        self.outputs = [new if v is old else v for v in self.outputs]
        return count

    # ---- queries ---------------------------------------------------------------------------
    def users(self) -> dict[Value, list[Node]]:
        """Every value's using nodes, in program order."""
        out: dict[Value, list[Node]] = {}
        for node in self.nodes:
            for v in node.inputs:
                if v is not None:
                    out.setdefault(v, []).append(node)
        return out

    def values(self) -> Iterator[Value]:
        """All values: inputs then node outputs in program order."""
        yield from self.inputs
        for node in self.nodes:
            yield from node.outputs

    def find(self, op: str) -> list[Node]:
        """Nodes of one op, in program order."""
        return [n for n in self.nodes if n.op == op]

    def op_counts(self) -> dict[str, int]:
        """How many nodes of each op the graph holds."""
        out: dict[str, int] = {}
        for n in self.nodes:
            out[n.op] = out.get(n.op, 0) + 1
        return dict(sorted(out.items()))

    def __str__(self) -> str:
        from m3c.ir.text import print_graph

        return print_graph(self)

    def to_networkx(self):  # -> networkx.MultiDiGraph
        """Dataflow + effect-order view: nodes are Node objects, edges carry the value or 'effect'."""
        from m3c.ir.analysis import to_networkx

        return to_networkx(self)
