"""The one pattern-rewrite mechanism: a :class:`Rewrite` pairs root patterns (see
:mod:`m3c.passes.pattern`) with ``build(match, builder) -> values`` (one replacement value per output
of each root: new nodes made with the builder, or existing values for identities), and
:func:`apply_rewrites` applies a list of them to a fixpoint.

Example::

    Rewrite("view_of_view", P("view", P("view", X("x")), name="root"),
            lambda m, b: [b.one("view", [m["x"]], {"shape": m.node("root").attrs["shape"]})])

The driver walks the graph in program order and refuses a match whose fusion would create a cycle
(:func:`m3c.ir.analysis.would_create_cycle`, asked for multi-root matches; a single-root match can
never close one) or move a state access past a conflicting one (:func:`m3c.ir.analysis.moves_effect`,
asked when a matched node touches state). The replacement goes where the match's last node was
(before the first outside use of a replaced value, if that is earlier); uses are rewired and the
matched nodes left unused are removed — effect nodes included, since the pattern replaced them; a
node outside the match is never removed.

Interior values (outputs of matched nodes other than the roots) used outside the match BLOCK the
match: it is refused and the reason recorded for explain. To keep such a value, list its pattern
among the roots: the replacement then re-exports it (build returns a value for it too) and is
placed before its first outside use. ``keep_shared=True`` (canonicalization) instead leaves shared
interior nodes in place for their other users and recomputes them in the replacement; a shared
node with effects still blocks.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from m3c.errors import M3CError
from m3c.ir.analysis import accesses, moves_effect, would_create_cycle
from m3c.ir.graph import Graph, Node, Value
from m3c.ir.ops.infer import dims_equal
from m3c.ir.registry import IRTypeError, get_op, infer_types
from m3c.passes import effects
from m3c.passes.manager import Pass, PassContext, PassResult
from m3c.passes.pattern import Check, Match, Out, P, Tracker, V, X, match_node, node_at, node_label, run_checks

__all__ = ["Builder", "Check", "Match", "MatchRecord", "Out", "P", "Rewrite", "RewriteError", "RewritePass", "V",
           "X", "apply_rewrites", "node_label", "op_accepts", "same_type"]


class RewriteError(M3CError, RuntimeError):
    """A rewrite's build produced replacements that do not fit what they replace (a bug in the rewrite)."""


@dataclass
class MatchRecord:
    """What happened to one rewrite at one place: applied, refused (with the reason) or missed.

    A `missed` record (only for a rewrite that matched nowhere) is the closest partial match: where
    it was tried, how many constraints held, and the first constraint that failed.
    """

    rewrite: str
    status: Literal["applied", "refused", "missed"]
    scope: str = ""
    where: str = ""  # the root node, e.g. "cat %q_rot"
    reason: str = ""
    progress: int = 0


# ---- rewrites ----------------------------------------------------------------------------------
class Builder:
    """Makes the replacement's nodes (type-inferred, not yet placed; the driver places them)."""

    def __init__(self, graph: Graph, scope: str) -> None:
        self.graph, self.scope, self.nodes = graph, scope, []

    def add(self, op: str, inputs: Sequence[Value | None], attrs: dict[str, Any] | None = None,
            names: list[str] | None = None) -> list[Value]:
        """A new node of `op`; returns its outputs."""
        if names is None:  # name the outputs after the op ("rope", "rope3", ...)
            opdef = get_op(op)
            types = [None if v is None else v.type for v in inputs]
            names = [op] * len(infer_types(opdef, types, opdef.full_attrs(dict(attrs or {}))))
        node = self.graph.new_node(op, inputs, attrs, names, self.scope)
        self.nodes.append(node)
        return node.outputs

    def one(self, op: str, inputs: Sequence[Value | None], attrs: dict[str, Any] | None = None) -> Value:
        """A new single-output node of `op`; returns its output."""
        outs = self.add(op, inputs, attrs)
        assert len(outs) == 1, f"{op} has {len(outs)} outputs"
        return outs[0]


BuildFn = Callable[[Match, Builder], Sequence[Value]]


@dataclass
class Rewrite:
    """A named pattern plus its replacement. `roots` are the patterns whose outputs get replaced."""

    name: str
    roots: P | Sequence[P]
    build: BuildFn
    where: Sequence[Check] = ()
    keep_shared: bool = False
    doc: str = ""
    _roots: list[P] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._roots = [self.roots] if isinstance(self.roots, P) else list(self.roots)
        if not self._roots or not all(isinstance(r, P) for r in self._roots):
            raise ValueError(f"rewrite {self.name!r}: roots must be one or more P patterns")

    @property
    def root_op(self) -> str:
        """The op of the first root (where the driver starts looking)."""
        return self._roots[0].op

    def matches_at(self, node: Node, by_op: dict[str, list[Node]], removed: set[Node],
                   t: Tracker) -> Iterator[Match]:
        """Complete matches whose first root is `node` (further roots come from `by_op`, minus `removed`)."""
        t.root = node
        for m in match_node(self._roots[0], node, Match(), t):
            yield from self._more_roots(1, m, by_op, removed, t)

    def _more_roots(self, i: int, m: Match, by_op: dict[str, list[Node]], removed: set[Node],
                    t: Tracker) -> Iterator[Match]:
        if i == len(self._roots):
            yield from run_checks(self.where, m, t, node_at(t.root) if t.root else self.name)
            return
        pat = self._roots[i]
        if m.node_of(pat) is not None:
            yield from self._more_roots(i + 1, m, by_op, removed, t)
            return
        taken = set(m.nodes)
        candidates = [n for n in by_op.get(pat.op, []) if n not in taken and n not in removed]
        if not candidates:
            t.fail(m, f"{self.name}: no {pat.op!r} node for root {i}")
        for node in candidates:
            for m2 in match_node(pat, node, m, t):
                yield from self._more_roots(i + 1, m2, by_op, removed, t)

    def root_nodes(self, m: Match) -> list[Node]:
        """The matched root nodes, in root order."""
        return [m.node_of(r) for r in self._roots]  # type: ignore[misc]


def op_accepts(op: str, operands: Sequence[Value | None], attrs: dict[str, Any]) -> bool:
    """Whether `op`'s type inference takes these operands and attributes (defaults filled in): a rewrite's
    check for a replacement op stricter than the chain it matches, so the build never raises."""
    opdef = get_op(op)
    try:
        infer_types(opdef, [None if v is None else v.type for v in operands], opdef.full_attrs(attrs))
    except IRTypeError:
        return False
    return True


def same_type(a: Value, b: Value) -> bool:
    """Whether two values have the same dtype and provably equal shapes."""
    ta, tb = a.type, b.type
    return ta.dtype == tb.dtype and ta.rank == tb.rank and all(dims_equal(x, y) for x, y in zip(ta.shape, tb.shape))


# ---- the driver --------------------------------------------------------------------------------
def apply_rewrites(graph: Graph, rewrites: Sequence[Rewrite], ctx: PassContext | None = None, *,
                   max_sweeps: int = 50) -> list[MatchRecord]:
    """Apply `rewrites` until none applies (sweeps in program order); returns what happened.

    Applied records accumulate over sweeps; refusals and near misses come from the final sweep (the
    graph as it is left). A near miss is recorded only for a rewrite that applied nowhere.
    """
    applied: list[MatchRecord] = []
    for _ in range(max_sweeps):
        sweep = _Sweep(graph, rewrites)
        n = sweep.run()
        applied += sweep.applied
        if n == 0:
            explain = ctx is None or ctx.explain
            return applied + sweep.refused + (sweep.near_misses({r.rewrite for r in applied}) if explain else [])
    raise RewriteError(f"rewrites {[r.name for r in rewrites]} did not converge in {max_sweeps} sweeps")


class _Sweep:
    """One program-order pass of every rewrite over the graph."""

    def __init__(self, graph: Graph, rewrites: Sequence[Rewrite]) -> None:
        self.graph, self.rewrites = graph, rewrites
        self.trackers = {rw.name: Tracker() for rw in rewrites}
        self.applied: list[MatchRecord] = []
        self.refused: list[MatchRecord] = []
        self.removed: set[Node] = set()
        self.users: dict[Value, list[Node]] = {}

    def run(self) -> int:
        by_op: dict[str, list[Node]] = {}
        for node in self.graph.nodes:
            by_op.setdefault(node.op, []).append(node)
        self.users = self.graph.users()
        by_root: dict[str, list[Rewrite]] = {}
        for rw in self.rewrites:
            by_root.setdefault(rw.root_op, []).append(rw)
        for node in list(self.graph.nodes):
            if node in self.removed:
                continue
            for rw in by_root.get(node.op, ()):
                if self._try(rw, node, by_op):
                    break
        return len(self.applied)

    def _try(self, rw: Rewrite, node: Node, by_op: dict[str, list[Node]]) -> bool:
        t = self.trackers[rw.name]
        first_refusal: str | None = None
        for m in rw.matches_at(node, by_op, self.removed, t):
            reason = self._refusal(rw, m) or self._apply(rw, m, node)
            if reason is None:
                return True
            first_refusal = first_refusal or reason
        if first_refusal is not None:
            self.refused.append(MatchRecord(rw.name, "refused", node.scope, node_label(node), first_refusal))
        return False

    def _escapes(self, n: Node, group: set[Node]) -> list[str]:
        if any(v in self.graph.outputs for v in n.outputs):
            return ["the graph outputs"]
        return [node_label(u) for v in n.outputs for u in self.users.get(v, []) if u not in group]

    def _refusal(self, rw: Rewrite, m: Match) -> str | None:
        """Why this match may not be applied, or None."""
        nodes = m.nodes
        group = set(nodes)
        roots = set(rw.root_nodes(m))
        if len(roots) > 1 and would_create_cycle(self.graph, group):
            return f"fusing {', '.join(node_label(n) for n in nodes)} would create a cycle"
        if any(effects.touches_state(n) for n in nodes) and moves_effect(self.graph, group):
            touching = [node_label(n) for n in nodes if effects.touches_state(n)]
            return f"fusing would reorder an effect: {', '.join(touching)} would move past a state access"
        for n in nodes:
            users = [] if n in roots else self._escapes(n, group)
            if not users:
                continue
            if not rw.keep_shared:
                return f"interior value %{n.outputs[0].name} ({n.op}) is also used by {', '.join(users)}"
            if effects.has_effects(n):
                return f"shared interior node {node_label(n)} has effects"
        return None

    def _anchor(self, roots: list[Node], matched: set[Node], olds: list[Value], builder: Builder,
                new_values: list[Value]) -> Node | str:
        """Where the replacement goes: before the last matched node, or before the first outside use of a
        replaced value if that comes earlier (multi-root matches); a string says why it cannot go anywhere."""
        if len(roots) == 1:  # all matched nodes precede the root, all uses of its outputs follow it
            return roots[0]
        nodes = self.graph.nodes
        pos = {n: i for i, n in enumerate(nodes)}
        at = max(pos[n] for n in matched)
        for old in olds:
            at = min([at] + [pos[u] for u in self.users.get(old, []) if u not in matched])
        made = {v for n in builder.nodes for v in n.outputs}
        for v in [v for n in builder.nodes for v in n.inputs] + new_values:
            if v is not None and v not in made and v.producer is not None and pos[v.producer] >= at:
                return f"the replacement needs %{v.name}, defined after the first use of a replaced value"
        for n in matched:  # members after the anchor move up (moves_effect checked the moves down)
            mine = accesses(n)
            for other in nodes[at:pos[n]] if mine else ():
                theirs = accesses(other)
                if other not in matched and any(v in theirs and "w" in mode + theirs[v] for v, mode in mine.items()):
                    return (f"fusing would reorder an effect: {node_label(n)} would move before "
                            f"{node_label(other)}")
        return nodes[at]

    def _apply(self, rw: Rewrite, m: Match, root: Node) -> str | None:
        """Build, place and wire one match; returns None, or why the replacement cannot be placed."""
        graph = self.graph
        roots = rw.root_nodes(m)
        builder = Builder(graph, roots[0].scope)
        new_values = list(rw.build(m, builder))
        olds = [v for r in roots for v in r.outputs]
        if len(new_values) != len(olds):
            raise RewriteError(f"rewrite {rw.name!r}: build returned {len(new_values)} values for {len(olds)}")
        for old, new in zip(olds, new_values):
            if not same_type(old, new):
                raise RewriteError(f"rewrite {rw.name!r}: replacement %{new.name}: {new.type} "
                                   f"for %{old.name}: {old.type}")
        matched = set(m.nodes)
        anchor = self._anchor(roots, matched, olds, builder, new_values)
        if isinstance(anchor, str):
            return anchor
        for n in builder.nodes:
            graph.insert_before(anchor, n)
            for v in n.inputs:
                if v is not None:
                    self.users.setdefault(v, []).append(n)
        for old, new in zip(olds, new_values):
            keep = []
            for u in self.users.pop(old, []):
                if u in matched:
                    keep.append(u)
                    continue
                u.inputs = [new if v is old else v for v in u.inputs]
                self.users.setdefault(new, []).append(u)
            if keep:
                self.users[old] = keep
            graph.outputs = [new if v is old else v for v in graph.outputs]
        self._remove_dead(matched)
        self.applied.append(MatchRecord(rw.name, "applied", root.scope, node_label(root)))
        return None

    def _remove_dead(self, nodes: set[Node]) -> None:
        """Drop matched nodes whose outputs are no longer used (repeatedly, so dead chains fall)."""
        outputs = set(self.graph.outputs)
        pending, changed = set(nodes), True
        while changed:
            changed = False
            for n in list(pending):
                if any(self.users.get(v) or v in outputs for v in n.outputs):
                    continue
                pending.discard(n)
                changed = True
                for v in n.inputs:
                    if v is not None and v in self.users:
                        self.users[v] = [u for u in self.users[v] if u is not n]
                self.graph.remove(n)
                self.removed.add(n)

    def near_misses(self, applied: set[str]) -> list[MatchRecord]:
        """The closest partial match of each rewrite that matched nowhere and was not refused."""
        out = []
        refused = {r.rewrite for r in self.refused}
        for rw in self.rewrites:
            if rw.name in applied or rw.name in refused:
                continue
            best = self.trackers[rw.name].best
            if best is None:
                out.append(MatchRecord(rw.name, "missed", reason=f"no {rw.root_op!r} node in the graph"))
            else:
                progress, reason, root = best
                out.append(MatchRecord(rw.name, "missed", root.scope if root else "",
                                       node_label(root) if root else "", reason, progress))
        return out


class RewritePass(Pass):
    """A pass that is a named list of rewrites applied to a fixpoint (how fusion passes are written)."""

    def __init__(self, name: str, rewrites: Sequence[Rewrite]) -> None:
        self.name, self.rewrites = name, list(rewrites)
        names = [rw.name for rw in self.rewrites]
        if len(set(names)) != len(names):
            raise ValueError(f"pass {name!r}: rewrite names must be unique, got {names}")

    def run(self, graph: Graph, ctx: PassContext) -> PassResult:
        """Apply the rewrites; records come out in rewrite order."""
        records = apply_rewrites(graph, self.rewrites, ctx)
        order = {rw.name: i for i, rw in enumerate(self.rewrites)}
        records.sort(key=lambda r: order[r.rewrite])
        applied = sum(r.status == "applied" for r in records)
        return PassResult(applied > 0, records, {"applied": applied})
