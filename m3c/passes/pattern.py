"""The pattern language of the rewriter: declarative op patterns over the IR dataflow, and the matcher.

::

    x = X("x", rank=3)                       # any value, captured; the same name twice = the same value
    P("slice", x, dim=V("d"), start=0)       # an op with operand patterns and attribute constraints;
                                             # V("d") captures an attribute (unified by name like X)
    P("mul", a, b, commutative=True)         # try both operand orders
    P("split", x)[1]                         # output 1 of a multi-output node
    P("cat", ..., dim=0)                     # `...` as the last operand: any remaining operands
    P("view", x, name="v", where=[Check("same shape", lambda m: ...)])   # named node, predicates
    None                                     # as an operand: an absent optional operand

The matcher is a backtracking search over operand edges. Every satisfied constraint (an op, an
attribute, a capture, a check) counts as progress; the failure reached with the most progress is a
rewrite's *near miss*, which explain reports when the rewrite matched nowhere.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from m3c.ir.graph import Node, Value
from m3c.ir.registry import get_op

_MISSING = object()


# ---- patterns --------------------------------------------------------------------------------
@dataclass(frozen=True)
class Check:
    """A named predicate over the match so far; the name is what explain reports when it fails."""

    desc: str
    fn: Callable[[Match], bool]


class X:
    """Any value (graph input or node output), optionally captured by name and constrained by type."""

    def __init__(self, name: str | None = None, *, rank: int | None = None, dtype: str | None = None,
                 where: Sequence[Check] = ()) -> None:
        self.name, self.where = name, list(where)
        label = name or "value"
        if rank is not None:
            self.where.insert(0, Check(f"{label} has rank {rank}", lambda m: m.last.type.rank == rank))
        if dtype is not None:
            self.where.insert(0, Check(f"{label} is {dtype}", lambda m: m.last.type.dtype.value == dtype))

    def __repr__(self) -> str:
        return f"X({self.name!r})" if self.name else "X()"


@dataclass(frozen=True)
class V:
    """In an attribute position: capture the attribute's value under `name` (equal values unify)."""

    name: str


class P:
    """A node of op `op` whose operands match `operands` and whose attributes match `attrs`."""

    def __init__(self, op: str, *operands: Any, name: str | None = None, where: Sequence[Check] = (),
                 commutative: bool = False, **attrs: Any) -> None:
        self.op, self.name, self.where, self.commutative, self.attrs = op, name, list(where), commutative, attrs
        self.rest = bool(operands) and operands[-1] is Ellipsis
        self.operands = list(operands[:-1] if self.rest else operands)
        if commutative and len(self.operands) != 2:
            raise ValueError(f"P({op!r}): commutative patterns take exactly two operands")

    def __getitem__(self, index: int) -> Out:
        return Out(self, index)

    def __repr__(self) -> str:
        return f"P({self.op!r}{', name=' + repr(self.name) if self.name else ''})"


@dataclass(frozen=True)
class Out:
    """Output `index` of the node matched by `pattern` (for multi-output ops)."""

    pattern: P
    index: int


# ---- matches ---------------------------------------------------------------------------------
class Match:
    """Captures of one (partial) match: X/V names, named nodes; immutable, extended along the search."""

    __slots__ = ("_by_pattern", "_captures", "last", "progress")

    def __init__(self) -> None:
        self._captures: dict[str, Any] = {}
        self._by_pattern: dict[int, Node] = {}
        self.progress = 0  # constraints satisfied so far (ranks near misses)
        self.last: Any = None  # the value an X check is looking at

    def _copy(self) -> Match:
        m = Match()
        m._captures, m._by_pattern, m.progress, m.last = dict(self._captures), dict(self._by_pattern), \
            self.progress, self.last
        return m

    def __getitem__(self, name: str) -> Any:
        """A captured value (X), attribute (V) or named node's first output."""
        got = self._captures[name]
        return got.outputs[0] if isinstance(got, Node) else got

    def __contains__(self, name: str) -> bool:
        return name in self._captures

    def node(self, name: str) -> Node:
        """The node matched by the pattern named `name`."""
        got = self._captures[name]
        assert isinstance(got, Node), f"{name!r} names a value, not a node"
        return got

    def node_of(self, pat: P) -> Node | None:
        """The node pattern `pat` matched, if it has been matched."""
        return self._by_pattern.get(id(pat))

    @property
    def nodes(self) -> list[Node]:
        """Every matched node (no duplicates)."""
        return list(dict.fromkeys(self._by_pattern.values()))


def node_label(node: Node) -> str:
    """'op %out' (or just the op) for reports."""
    return f"{node.op} %{node.outputs[0].name}" if node.outputs else node.op


def node_at(node: Node) -> str:
    """'op %out at scope' for failure messages."""
    return f"{node_label(node)}" + (f" at {node.scope}" if node.scope else "")


class Tracker:
    """The best partial match of one rewrite (most constraints satisfied before the first failure)."""

    def __init__(self) -> None:
        self.best: tuple[int, str, Node | None] | None = None
        self.root: Node | None = None

    def fail(self, m: Match, reason: str) -> None:
        """Note a failed constraint; kept if this attempt got further than any before."""
        if self.best is None or m.progress > self.best[0]:
            self.best = (m.progress, reason, self.root)


def _full_attrs(node: Node) -> dict[str, Any]:
    return {**get_op(node.op).attrs, **node.attrs}


def _match_value(pat: Any, value: Value | None, m: Match, t: Tracker, ctx: str) -> Iterator[Match]:
    """Matches of operand pattern `pat` against `value` (`ctx` says where, for failure messages)."""
    if pat is None:
        if value is None:
            yield m
        else:
            t.fail(m, f"{ctx}: expected no operand, got %{value.name}")
        return
    if value is None:
        t.fail(m, f"{ctx}: operand is absent")
        return
    if isinstance(pat, X):
        if pat.name is not None and pat.name in m._captures:
            if m._captures[pat.name] is not value:
                t.fail(m, f"{ctx}: {pat.name!r} is %{m._captures[pat.name].name} here but %{value.name} there")
                return
            yield m
            return
        m = m._copy()
        m.progress += 1
        if pat.name is not None:
            m._captures[pat.name] = value
        m.last = value
        yield from run_checks(pat.where, m, t, ctx)
        return
    index = 0
    if isinstance(pat, Out):
        pat, index = pat.pattern, pat.index
    if value.producer is None:
        t.fail(m, f"{ctx}: expected a {pat.op!r} result, got graph input %{value.name}")
        return
    node = value.producer
    if node.op != pat.op and id(pat) not in m._by_pattern:
        t.fail(m, f"{ctx}: expected op {pat.op!r}, got {node_label(node)}")
        return
    if value.index != index:
        t.fail(m, f"{ctx}: expected output {index} of {pat.op!r}, got output {value.index}")
        return
    yield from match_node(pat, node, m, t)


def match_node(pat: P, node: Node, m: Match, t: Tracker) -> Iterator[Match]:
    """Matches of node pattern `pat` rooted at `node`."""
    bound = m._by_pattern.get(id(pat))
    if bound is not None:
        if bound is node:
            yield m
        else:
            t.fail(m, f"{node_at(node)}: the pattern needs the same node as {node_label(bound)}")
        return
    if node.op != pat.op:
        t.fail(m, f"{node_at(node)}: expected op {pat.op!r}")
        return
    m = m._copy()
    m.progress += 1
    attrs = _full_attrs(node)
    for key, want in pat.attrs.items():
        have = attrs.get(key, _MISSING)
        if isinstance(want, V):
            if want.name in m._captures and m._captures[want.name] != have:
                t.fail(m, f"{node_at(node)}: attribute {key}={have!r} but {want.name}={m._captures[want.name]!r}")
                return
            m._captures[want.name] = have
        elif have is _MISSING or have != want:
            t.fail(m, f"{node_at(node)}: attribute {key}={have!r}, expected {want!r}")
            return
        m.progress += 1
    m._by_pattern[id(pat)] = node
    if pat.name is not None:
        m._captures[pat.name] = node
    inputs, pats = list(node.inputs), list(pat.operands)
    opdef = get_op(node.op)
    if pat.rest:
        if len(inputs) < len(pats):
            t.fail(m, f"{node_at(node)}: has {len(inputs)} operands, the pattern at least {len(pats)}")
            return
        inputs = inputs[:len(pats)]
    elif not opdef.variadic:  # absent trailing optional operands match None
        inputs += [None] * (len(opdef.operands) - len(inputs))
        pats += [None] * (len(opdef.operands) - len(pats))
    if len(inputs) != len(pats):
        t.fail(m, f"{node_at(node)}: has {len(inputs)} operands, the pattern {len(pats)}")
        return
    orders = [pats, [pats[1], pats[0], *pats[2:]]] if pat.commutative else [pats]
    for order in orders:
        for m2 in _match_seq(order, inputs, m, t, node):
            yield from run_checks(pat.where, m2, t, node_at(node))


def _match_seq(pats: Sequence[Any], values: Sequence[Value | None], m: Match, t: Tracker,
               node: Node) -> Iterator[Match]:
    if not pats:
        yield m
        return
    for m2 in _match_value(pats[0], values[0], m, t, f"operand {len(values) - len(pats)} of {node_at(node)}"):
        yield from _match_seq(pats[1:], values[1:], m2, t, node)


def run_checks(checks: Sequence[Check], m: Match, t: Tracker, ctx: str) -> Iterator[Match]:
    """`m` (with progress counted) if every check holds; else note the first failing one."""
    for check in checks:
        if not check.fn(m):
            t.fail(m, f"{ctx}: check '{check.desc}' failed")
            return
        m = m._copy()
        m.progress += 1
    yield m
