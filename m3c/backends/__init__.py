"""Backends: compile targets (facts + registry), compile options, the Program, and lowering to a Program.

``lower(graph, options, weights)`` hands the fused graph to the target's code generator (named by
the target's ``lowering`` fact); targets without one yet raise TargetError saying so.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from m3c.backends.options import CompileOptions
from m3c.backends.program import Program, flatten_weights, unflatten_weights
from m3c.backends.target import Target, get_target, list_targets, register_target
from m3c.ir.graph import Graph

__all__ = [
    "CompileOptions", "Program", "Target", "flatten_weights", "get_target", "list_targets", "lower",
    "register_target", "unflatten_weights",
]


def lower(graph: Graph, options: CompileOptions, weights: Mapping[str, Any]) -> Program:
    """The Program for `options.target` from a fused graph and its param values (name -> tensor/quantized)."""
    return get_target(options.target).lowering_fn()(graph, options, weights)
