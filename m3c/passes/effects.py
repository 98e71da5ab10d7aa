"""Which state values a node reads and writes (the op registry's declared effects)."""

from __future__ import annotations

from m3c.ir.graph import Node, Value
from m3c.ir.registry import get_op
from m3c.ir.verifier import state_accesses


def writes(node: Node) -> list[Value]:
    """The state values `node` updates in place."""
    return [v for v, mode in state_accesses(node) if mode == "w"]


def reads(node: Node) -> list[Value]:
    """The state values `node` reads (declared `reads` operands)."""
    return [v for v, mode in state_accesses(node) if mode == "r"]


def has_effects(node: Node) -> bool:
    """Whether the node writes state (so it may never be removed or merged)."""
    return get_op(node.op).has_effects()


def touches_state(node: Node) -> bool:
    """Whether the node reads or writes state (so its position relative to writes matters)."""
    op = get_op(node.op)
    return bool(op.writes or op.reads)
