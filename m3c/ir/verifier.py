"""The IR verifier: run after every pass in tests and debug mode; says which node is wrong and how.

Checks: inputs well-formed; every op registered; operand count and absent operands; attributes
declared and required ones present; SSA (each value defined once, uses after their definition,
so no cycles); output back-links; recorded output types equal re-inferred ones (dims compared
symbolically); state effects only on ``state`` graph inputs; graph outputs defined; and, when
``graph.meta["effect_order"]`` is present, that each state's read/write order is the recorded one.

Effect order: ``meta["effect_order"]`` maps a state input's name to its access signature, one
letter per node touching it in program order (``w`` for a write, ``r`` for a read; a node doing
both counts as ``wr``: fused kernels insert and then attend). Runs of reads collapse to one ``r``
(reads commute), so the signature is what a legal schedule keeps: which reads see which writes.
:func:`record_effect_order` stores the current order; frontends call it once after tracing.
"""

from __future__ import annotations

from typing import Any

from m3c.errors import M3CError
from m3c.ir.graph import INPUT_KINDS, Graph, Node, Value
from m3c.ir.ops.infer import types_equal
from m3c.ir.registry import IRTypeError, OpDef, UnknownOpError, get_op, infer_types


class IRVerifyError(M3CError, ValueError):
    """A graph breaks an IR invariant; ``problems`` lists every one found, each naming its node."""

    def __init__(self, problems: list[str] | str) -> None:
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        super().__init__(self.problems)

    def __str__(self) -> str:
        n = len(self.problems)
        return "\n  ".join([f"IR verification failed ({n} problem{'s' if n != 1 else ''}):", *self.problems])


def describe(node: Node, index: int | None = None) -> str:
    """How error messages name a node: position, outputs, op and scope."""
    outs = ", ".join(f"%{v.name}" for v in node.outputs)
    where = f"node #{index} " if index is not None else "node "
    scope = f" (scope {node.scope})" if node.scope else ""
    return f"{where}{outs + ' = ' if outs else ''}{node.op}{scope}"


def state_accesses(node: Node, opdef: OpDef | None = None) -> list[tuple[Value, str]]:
    """(operand, 'w' or 'r') for each state operand the node's op declares as written or read."""
    op = opdef or get_op(node.op)
    out: list[tuple[Value, str]] = []
    for names, mode in ((op.writes, "w"), (op.reads, "r")):
        for name in names:
            i = op.operand_index(name)
            if i < len(node.inputs) and node.inputs[i] is not None:
                out.append((node.inputs[i], mode))  # type: ignore[arg-type]
    return out


def effect_signature(g: Graph) -> dict[str, str]:
    """Per state input touched by some node: its access signature (see the module docstring)."""
    sig: dict[str, str] = {}
    for node in g.nodes:
        try:
            acc = state_accesses(node)
        except (UnknownOpError, ValueError):
            continue
        modes: dict[str, str] = {}
        for v, mode in acc:
            modes[v.name] = "".join(sorted(set(modes.get(v.name, "") + mode), reverse=True))  # "wr" order
        for name, m in modes.items():
            sig[name] = sig.get(name, "") + m
    return {k: _collapse(v) for k, v in sig.items()}


def _collapse(sig: str) -> str:
    out = ""
    for ch in sig:
        if not (ch == "r" and out.endswith("r")):
            out += ch
    return out


def record_effect_order(g: Graph) -> None:
    """Store the graph's current state access order in ``g.meta['effect_order']``."""
    g.meta["effect_order"] = effect_signature(g)


def verify(g: Graph) -> None:
    """Raise IRVerifyError listing every broken invariant of `g`; return None for a valid graph."""
    problems: list[str] = []
    defined: set[Value] = set()
    names: dict[str, str] = {}

    def define(v: Value, owner: str) -> None:
        if v in defined:
            problems.append(f"{owner}: value %{v.name} is defined twice")
        elif v.name in names:
            problems.append(f"{owner}: value name %{v.name} is already used by {names[v.name]}")
        defined.add(v)
        names.setdefault(v.name, owner)

    for i, v in enumerate(g.inputs):
        owner = f"graph input #{i} %{v.name}"
        if v.kind not in INPUT_KINDS:
            problems.append(f"{owner}: kind {v.kind!r} is not one of {INPUT_KINDS}")
        if v.producer is not None:
            problems.append(f"{owner}: a graph input must have no producer")
        define(v, owner)

    later = {v for n in g.nodes for v in n.outputs}
    inputs = set(g.inputs)
    for idx, node in enumerate(g.nodes):
        problems += _check_node(inputs, node, idx, defined, later)
        for v in node.outputs:
            define(v, describe(node, idx))

    for i, v in enumerate(g.outputs):
        if v not in defined:
            problems.append(f"graph output #{i} %{v.name} is not defined by any input or node (dangling)")

    problems += _check_effect_order(g)
    if problems:
        raise IRVerifyError(problems)


def _check_node(inputs: set[Value], node: Node, idx: int, defined: set[Value], later: set[Value]) -> list[str]:
    """Problems of one node, each prefixed by the node's description."""
    who = describe(node, idx)
    out: list[str] = []
    for k, v in enumerate(node.outputs):
        if v.producer is not node or v.index != k:
            prod = "no node" if v.producer is None else describe(v.producer)
            out.append(f"{who}: output #{k} %{v.name} links back to {prod}, index {v.index}")
    for k, v in enumerate(node.inputs):
        if v is not None and v not in defined:
            when = "before its definition" if v in later else "but never defined in this graph"
            out.append(f"{who}: operand #{k} %{v.name} is used {when}")
    try:
        op = get_op(node.op)
    except UnknownOpError:
        return [*out, f"{who}: unknown op {node.op!r} (not in the op registry)"]
    try:
        op.check_operands(node.inputs)
        attrs = op.full_attrs(node.attrs)
    except IRTypeError as e:
        return [*out, f"{who}: {e}"]
    out += _check_types(node, op, attrs, who)
    try:
        accesses = state_accesses(node, op)
    except ValueError as e:
        return [*out, f"{who}: the op declares an effect on an operand it does not have ({e})"]
    for v, mode in accesses:
        if v not in inputs or v.kind != "state":
            what = "writes" if mode == "w" else "reads"
            kind = f"a graph {v.kind}" if v in inputs else "a node result"
            out.append(f"{who}: {what} %{v.name} as state, but it is {kind}, not a 'state' graph input")
    return out


def _check_types(node: Node, op: OpDef, attrs: dict[str, Any], who: str) -> list[str]:
    try:
        want = infer_types(op, [None if v is None else v.type for v in node.inputs], attrs)
    except IRTypeError as e:
        return [f"{who}: operand types do not fit: {e}"]
    if len(want) != len(node.outputs):
        return [f"{who}: has {len(node.outputs)} outputs, the op declares {len(want)}"]
    return [f"{who}: output %{v.name} is recorded as {v.type} but its operands give {t}"
            for v, t in zip(node.outputs, want) if not types_equal(v.type, t)]


def _check_effect_order(g: Graph) -> list[str]:
    recorded = g.meta.get("effect_order")
    if recorded is None:
        return []
    if not isinstance(recorded, dict):
        return [f"graph meta effect_order must map state names to access signatures, got {recorded!r}"]
    actual = effect_signature(g)
    out = []
    for name in sorted(set(recorded) | set(actual)):
        want, got = _collapse(str(recorded.get(name, ""))), actual.get(name, "")
        if want != got:
            touching = [describe(n, i) for i, n in enumerate(g.nodes)
                        if any(u is not None and u.name == name for u in n.inputs)]
            out.append(f"state %{name}: accesses in program order are {got or 'none'!r} but the recorded effect "
                       f"order is {want or 'none'!r}; nodes touching it: {'; '.join(touching) or 'none'}")
    return out
