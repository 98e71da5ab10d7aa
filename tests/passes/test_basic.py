"""DCE and CSE: Before/Expected IR compared structurally, effects respected."""

from __future__ import annotations

from m3c.ir.graph import Graph
from m3c.ir.text import graphs_equal, parse_graph, print_graph
from m3c.ir.verifier import record_effect_order, verify
from m3c.passes import PassContext
from m3c.passes.basic import CommonSubexpressionElimination, DeadCodeElimination

ATTN_INPUTS = """%q: f32[T,4,64] input, %k: f32[T,2,64] input, %slots: i64[T] input, %sel: i64[T,2,2] input,
    %pos: i64[T] input, %qsl: i32[R+1] input, %lens: i32[R] input, %table: i32[R,6] input,
    %kc: f32[12,8,2,64] state, %vc: f32[12,8,2,64] state, %xc: f32[12,8,2,64] state"""
SPARSE = "sparse_attention(%q, %kc, _, %vc, _, %sel, %pos, %qsl, %lens, %table) {block_size=8, scale=0.125}"


def _run(p: DeadCodeElimination | CommonSubexpressionElimination, before: str) -> tuple[Graph, bool]:
    g = parse_graph(before)
    changed = p.run(g, PassContext()).changed
    verify(g)
    return g, changed


def _assert_equal(got: Graph, expected: str) -> None:
    want = parse_graph(expected)
    assert graphs_equal(got, want), f"got:\n{print_graph(got)}\nexpected:\n{print_graph(want)}"


def test_dce_removes_dead_chains_keeps_writes() -> None:
    g, changed = _run(DeadCodeElimination(), """
    graph @main(%x: f32[4,8] input, %slots: i64[4] input, %cache: f32[2,4,8] state) {
      %a: f32[4,8] = exp(%x)
      %b: f32[4,8] = neg(%a)
      %c: f32[4,8] = sin(%x)
      paged_write(%c, %slots, %cache)
      %d: f32[4,8] = cos(%x)
      return %d
    }""")
    assert changed
    _assert_equal(g, """
    graph @main(%x: f32[4,8] input, %slots: i64[4] input, %cache: f32[2,4,8] state) {
      %c: f32[4,8] = sin(%x)
      paged_write(%c, %slots, %cache)
      %d: f32[4,8] = cos(%x)
      return %d
    }""")


def test_dce_unchanged_when_nothing_is_dead() -> None:
    g, changed = _run(DeadCodeElimination(), """
    graph @main(%x: f32[4] input) {
      %a: f32[4] = exp(%x)
      return %a
    }""")
    assert not changed and len(g.nodes) == 1


def test_dce_drops_a_dead_read_and_keeps_the_recorded_effect_order_valid() -> None:
    g = parse_graph(f"""
    graph @main({ATTN_INPUTS}) {{
      paged_write(%k, %slots, %kc)
      %dead: f32[T,4,64] = {SPARSE}
      paged_write(%k, %slots, %kc)
      return %q
    }}""")
    record_effect_order(g)
    assert g.meta["effect_order"]["kc"] == "wrw"
    assert DeadCodeElimination().run(g, PassContext()).changed
    verify(g)
    assert [n.op for n in g.nodes] == ["paged_write", "paged_write"]
    assert g.meta["effect_order"]["kc"] == "ww"


def test_cse_merges_chains_and_respects_attrs() -> None:
    g, changed = _run(CommonSubexpressionElimination(), """
    graph @main(%x: f32[4,8] input, %y: f32[4,8] input) {
      %a: f32[4,8] = mul(%x, %y)
      %b: f32[4,8] = mul(%x, %y)
      %c: f32[4,8] = exp(%a)
      %d: f32[4,8] = exp(%b)
      %e: f32[4,8] = mul(%x) {scalar=2}
      %f: f32[4,8] = mul(%x) {scalar=2.0}
      %g: f32[4,4] = slice(%x) {dim=1, start=0, end=4}
      %h: f32[4,4] = slice(%x) {dim=1, start=4, end=8}
      %s: f32[4,8] = add(%c, %d)
      return %s, %e, %f, %g, %h
    }""")
    assert changed
    _assert_equal(g, """
    graph @main(%x: f32[4,8] input, %y: f32[4,8] input) {
      %a: f32[4,8] = mul(%x, %y)
      %c: f32[4,8] = exp(%a)
      %e: f32[4,8] = mul(%x) {scalar=2}
      %f: f32[4,8] = mul(%x) {scalar=2.0}
      %g: f32[4,4] = slice(%x) {dim=1, start=0, end=4}
      %h: f32[4,4] = slice(%x) {dim=1, start=4, end=8}
      %s: f32[4,8] = add(%c, %c)
      return %s, %e, %f, %g, %h
    }""")


def test_cse_never_merges_reads_separated_by_a_write_to_the_same_cache() -> None:
    before = f"""
    graph @main({ATTN_INPUTS}) {{
      %a: f32[T,4,64] = {SPARSE}
      paged_write(%k, %slots, %kc)
      %b: f32[T,4,64] = {SPARSE}
      %c: f32[T,4,64] = add(%a, %b)
      return %c
    }}"""
    g, changed = _run(CommonSubexpressionElimination(), before)
    assert not changed
    _assert_equal(g, before)


def test_cse_merges_reads_when_the_write_is_to_another_cache() -> None:
    g, changed = _run(CommonSubexpressionElimination(), f"""
    graph @main({ATTN_INPUTS}) {{
      %a: f32[T,4,64] = {SPARSE}
      paged_write(%k, %slots, %xc)
      %b: f32[T,4,64] = {SPARSE}
      %c: f32[T,4,64] = add(%a, %b)
      return %c
    }}""")
    assert changed
    _assert_equal(g, f"""
    graph @main({ATTN_INPUTS}) {{
      %a: f32[T,4,64] = {SPARSE}
      paged_write(%k, %slots, %xc)
      %c: f32[T,4,64] = add(%a, %a)
      return %c
    }}""")


def test_cse_keeps_identical_writes() -> None:
    before = """
    graph @main(%x: f32[4,8] input, %slots: i64[4] input, %cache: f32[2,4,8] state) {
      paged_write(%x, %slots, %cache)
      paged_write(%x, %slots, %cache)
      return %x
    }"""
    g, changed = _run(CommonSubexpressionElimination(), before)
    assert not changed
    _assert_equal(g, before)
