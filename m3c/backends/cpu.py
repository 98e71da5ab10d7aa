"""Lowering for the CPU target: the fused graph itself is the program (the IR interpreter runs it)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from m3c.backends.options import CompileOptions
from m3c.backends.program import Program, flatten_weights
from m3c.errors import CompileError
from m3c.ir.graph import Graph
from m3c.ir.registry import UnknownOpError, get_op


def lower_cpu(graph: Graph, options: CompileOptions, weights: Mapping[str, Any]) -> Program:
    """A CPU Program: the graph (every op must have a reference implementation) and its flat weights."""
    for node in graph.nodes:
        try:
            get_op(node.op)
        except UnknownOpError as e:
            raise CompileError(f"cannot lower node {node!r} for cpu: {e}") from None
    return Program(target="cpu", graph=graph, weights=flatten_weights(graph, weights), options=options)
