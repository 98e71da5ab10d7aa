"""Canonicalize: Before/Expected IR for every rule, and the partial-RoPE raising."""

from __future__ import annotations

import re

import pytest
import torch
from passes_helpers import BIG, assert_equivalent, rope_graph

from m3c.ir.graph import Graph
from m3c.ir.text import graphs_equal, parse_graph, print_graph
from m3c.ir.verifier import verify
from m3c.passes import PassContext
from m3c.passes.basic import Canonicalize


def canonicalize(g: Graph) -> list:
    records = Canonicalize().run(g, PassContext(explain=True)).records
    verify(g)
    return records


def _graph(inputs: str, body: str, ret: str) -> str:
    return f"graph @main({inputs}) {{\n{body}\n  return {ret}\n}}"


CASES = {
    "view_of_view": (
        "%x: f32[T,4,8] input",
        """%a: f32[T,32] = view(%x) {shape=["T",32]}
           %b: f32[T,2,16] = view(%a) {shape=["T",2,16]}""", "%b",
        """%b: f32[T,2,16] = view(%x) {shape=["T",2,16]}""", "%b"),
    "view_of_view_keeps_a_shared_inner_view": (
        "%x: f32[T,4,8] input",
        """%a: f32[T,32] = view(%x) {shape=["T",32]}
           %b: f32[T,2,16] = view(%a) {shape=["T",2,16]}""", "%a, %b",
        """%a: f32[T,32] = view(%x) {shape=["T",32]}
           %b: f32[T,2,16] = view(%x) {shape=["T",2,16]}""", "%a, %b"),
    "view_noop": (
        "%x: f32[T,4,8] input",
        """%a: f32[T,4,8] = view(%x) {shape=["T",4,8]}
           %b: f32[T,4,8] = exp(%a)""", "%b",
        """%b: f32[T,4,8] = exp(%x)""", "%b"),
    "view_round_trip": (
        "%x: f32[T,4,8] input",
        """%a: f32[T,32] = view(%x) {shape=["T",-1]}
           %b: f32[T,4,8] = view(%a) {shape=["T",4,8]}""", "%b", "", "%x"),
    "cast_noop": (
        "%x: f32[4] input, %y: bf16[4] input",
        """%a: f32[4] = cast(%x) {dtype="f32"}
           %b: f32[4] = cast(%y) {dtype="f32"}""", "%a, %b",
        """%b: f32[4] = cast(%y) {dtype="f32"}""", "%x, %b"),
    "split_noop": (
        "%x: f32[4,8] input",
        """%a: f32[4,8] = split(%x) {dim=1, sizes=[8]}""", "%a", "", "%x"),
    "slice_noop": (
        "%x: f32[T,8] input",
        f"""%a: f32[T,8] = slice(%x) {{dim=0, start=0, end={BIG}}}
           %b: f32[T,8] = slice(%a) {{dim=1, start=0, end=8}}
           %c: f32[T,4] = slice(%b) {{dim=1, start=0, end=4}}""", "%c",
        """%c: f32[T,4] = slice(%x) {dim=1, start=0, end=4}""", "%c"),
    "scalar_identities": (
        "%x: f32[4] input, %i: i64[4] input",
        """%a: f32[4] = mul(%x) {scalar=1}
           %b: f32[4] = add(%a) {scalar=0.0}
           %c: f32[4] = sub(%b) {scalar=0}
           %d: f32[4] = div(%c) {scalar=1}
           %e: f32[4] = mul(%d) {scalar=2}
           %f: f32[4] = mul(%i) {scalar=1.0}""", "%e, %f",
        """%e: f32[4] = mul(%x) {scalar=2}
           %f: f32[4] = mul(%i) {scalar=1.0}""", "%e, %f"),
    "negative_dims": (
        "%x: f32[T,4,8] input",
        """%a: f32[T,4,4], %b: f32[T,4,4] = split(%x) {dim=-1, sizes=[4,4]}
           %c: f32[T,4,2] = slice(%a) {dim=-1, start=0, end=2}
           %d: f32[T,4,6] = cat(%c, %b) {dim=-1}
           %e: f32[T,6] = sum(%d) {dims=[-2]}
           %f: f32[T,6,1] = unsqueeze(%e) {dim=-1}""", "%f",
        """%a: f32[T,4,4], %b: f32[T,4,4] = split(%x) {dim=2, sizes=[4,4]}
           %c: f32[T,4,2] = slice(%a) {dim=2, start=0, end=2}
           %d: f32[T,4,6] = cat(%c, %b) {dim=2}
           %e: f32[T,6] = sum(%d) {dims=[1]}
           %f: f32[T,6,1] = unsqueeze(%e) {dim=2}""", "%f"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_rule(case: str) -> None:
    inputs, before, ret, expected, ret_expected = CASES[case]
    g = parse_graph(_graph(inputs, before, ret))
    canonicalize(g)
    want = parse_graph(_graph(inputs, expected, ret_expected))
    assert graphs_equal(g, want), f"got:\n{print_graph(g)}\nexpected:\n{print_graph(want)}"


def test_rope_raising_before_expected(rng: torch.Generator) -> None:
    g = rope_graph()
    before = parse_graph(print_graph(g))
    records = canonicalize(g)
    want = parse_graph("""
    graph @rope(%x: f32[T,4,32] input, %cos: f32[T,8] input, %sin: f32[T,8] input) {
      %r: f32[T,4,32] = rope(%x, %cos, %sin)
      return %r
    }""")
    assert graphs_equal(g, want), print_graph(g)
    assert [r.scope for r in records if r.rewrite == "rope" and r.status == "applied"] == ["attn"]
    x, cos, sin = (torch.randn(5, *s, generator=rng) for s in ((4, 32), (8,), (8,)))
    assert_equivalent(before, g, {"x": x, "cos": cos, "sin": sin})


def test_rope_with_operands_swapped_and_shared_slices_still_raises() -> None:
    text = print_graph(rope_graph())
    text = text.replace("mul(%0, %5)", "mul(%5, %0)")  # x1 * c written c * x1
    g = parse_graph(text.replace("return %15", "return %15, %0"))  # x1 also used outside
    canonicalize(g)
    assert g.op_counts().get("rope") == 1 and "cat" not in g.op_counts()
    assert g.op_counts()["slice"] == 1  # the shared x1 slice stays for its other user


def test_rope_not_raised_for_a_different_function() -> None:
    g = parse_graph(print_graph(rope_graph()).replace("sub(%9, %10)", "add(%9, %10)"))  # x1*c + x2*s
    records = canonicalize(g)
    assert "rope" not in g.op_counts() and "cat" in g.op_counts()
    (miss,) = [r for r in records if r.rewrite == "rope"]
    assert miss.status == "missed" and miss.scope == "attn" and miss.where.startswith("cat")
    assert re.fullmatch(r"operand 0 of cat %\w+ at attn: expected op 'sub', got add %11", miss.reason), miss.reason


def test_canonicalize_is_idempotent() -> None:
    g = rope_graph()
    canonicalize(g)
    again = parse_graph(print_graph(g))
    assert not Canonicalize().run(again, PassContext()).changed
    assert graphs_equal(g, again)
