"""Canonicalization rewrites: identities, folded views, non-negative dims, and RoPE raising.

Every rule is a :class:`Rewrite`; :func:`canonical_rewrites` lists them in the order they are tried
at each node. All use ``keep_shared`` (canonicalizing never depends on who else uses a value).
"""

from __future__ import annotations

from typing import Any

from m3c.ir.graph import Value
from m3c.ir.types import Dim
from m3c.passes.rewrite import Builder, Check, Match, P, Rewrite, V, X, same_type

_BIG = 2**62  # slice ends at or past this mean "to the end" (torch.export writes sys.maxsize)


def _identity(name: str, pattern: P, *checks: Check) -> Rewrite:
    """`pattern`'s root (named "root") → its captured operand "x" when `checks` hold."""
    same = Check("the result has the operand's type", lambda m: same_type(m["root"], m["x"]))
    return Rewrite(name, pattern, lambda m, b: [m["x"]], where=[*checks, same], keep_shared=True)


def _covers(end: Any, size: Dim) -> bool:
    return end is None or end >= _BIG or (isinstance(size, int) and end >= size)


def _slice_whole(m: Match) -> bool:
    node = m.node("root")
    x: Value = m["x"]
    dim = node.attrs.get("dim", 0) % max(x.type.rank, 1)
    return node.attrs.get("start", 0) == 0 and _covers(node.attrs.get("end"), x.type.shape[dim])


def identity_rewrites() -> list[Rewrite]:
    """No-op views, casts, one-piece splits, whole slices, ×1 / +0 / −0 / ÷1."""
    x = X("x")
    rules = [
        _identity("view_noop", P("view", x, name="root")),
        _identity("cast_noop", P("cast", x, name="root")),
        _identity("split_noop", P("split", x, name="root"),
                  Check("one piece", lambda m: len(m.node("root").attrs["sizes"]) == 1)),
        _identity("slice_noop", P("slice", x, name="root", step=1),
                  Check("the slice covers the whole dim", _slice_whole)),
    ]
    for op, unit in (("mul", 1), ("div", 1), ("add", 0), ("sub", 0)):
        rules.append(_identity(f"{op}_noop", P(op, x, name="root", scalar=unit)))
    return rules


def _view_of_view(m: Match, b: Builder) -> list[Value]:
    return [b.one("view", [m["x"]], {"shape": m.node("root").attrs["shape"]})]


# ---- negative dims -----------------------------------------------------------------------------
def _rank(m: Match) -> int:
    """The rank that the root's dim attribute counts in (unsqueeze: one more than its operand)."""
    node = m.node("root")
    rank = node.inputs[0].type.rank  # type: ignore[union-attr]
    return rank + 1 if node.op == "unsqueeze" else rank


def _dims(node_attrs: dict[str, Any]) -> list[int]:
    return list(node_attrs["dims"]) if "dims" in node_attrs else [node_attrs.get("dim", 0)]


def _has_negative(m: Match) -> bool:
    return any(d < 0 for d in _dims(m.node("root").attrs))


def _normalized(m: Match, b: Builder) -> list[Value]:
    node, rank = m.node("root"), _rank(m)
    attrs = dict(node.attrs)
    if "dims" in attrs:
        attrs["dims"] = [d % rank for d in attrs["dims"]]
    else:
        attrs["dim"] = attrs["dim"] % rank
    return b.add(node.op, node.inputs, attrs)


def dim_rewrites() -> list[Rewrite]:
    """Negative dims in split/slice/cat/sum/unsqueeze attributes → non-negative ones."""
    negative = Check("a dim attribute is negative", _has_negative)
    return [Rewrite(f"{op}_dims", P(op, ..., name="root"), _normalized, where=[negative], keep_shared=True)
            for op in ("split", "slice", "cat", "sum", "unsqueeze")]


# ---- RoPE --------------------------------------------------------------------------------------
def rope_rewrite() -> Rewrite:
    """The reference model's `apply_rope` (m3c.model_defs.layers) → `rope(x, cos, sin)`.

    ``cat(x1*c − x2*s, x2*c + x1*s, rest)`` with x1, x2, rest the slices [0,h), [h,2h), [2h,end) of
    x's last dim and c, s = cos, sin unsqueezed at dim 1 (dims already non-negative).
    """
    x, cos, sin = X("x", rank=3), X("cos", rank=2), X("sin", rank=2)
    x1 = P("slice", x, dim=2, start=0, end=V("h"), step=1)
    x2 = P("slice", x, dim=2, start=V("h"), end=V("h2"), step=1)
    rest = P("slice", x, name="rest", dim=2, start=V("h2"), step=1)
    c, s = P("unsqueeze", cos, dim=1), P("unsqueeze", sin, dim=1)
    first = P("sub", P("mul", x1, c, commutative=True), P("mul", x2, s, commutative=True))
    second = P("add", P("mul", x2, c, commutative=True), P("mul", x1, s, commutative=True), commutative=True)
    root = P("cat", first, second, rest, name="root", dim=2)
    checks = [
        Check("half is cos's last dim", lambda m: m["cos"].type.shape[1] == m["h"]),
        Check("the second slice ends at 2·half", lambda m: m["h2"] == 2 * m["h"]),
        Check("the rest slice reaches the end", lambda m: _covers(m.node("rest").attrs.get("end"),
                                                                   m["x"].type.shape[2])),
        Check("cos and sin have x's dtype and one shape", lambda m: m["cos"].type == m["sin"].type
              and m["cos"].type.dtype == m["x"].type.dtype),
        Check("the result has x's type", lambda m: same_type(m["root"], m["x"])),
    ]
    return Rewrite("rope", root, lambda m, b: [b.one("rope", [m["x"], m["cos"], m["sin"]])], where=checks,
                   keep_shared=True, doc=rope_rewrite.__doc__ or "")


def canonical_rewrites() -> list[Rewrite]:
    """Every canonicalization rule, in the order they are tried."""
    return [
        *dim_rewrites(),
        Rewrite("view_of_view", P("view", P("view", X("x")), name="root"), _view_of_view, keep_shared=True),
        *identity_rewrites(),
        rope_rewrite(),
    ]
