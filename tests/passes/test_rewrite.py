"""The pattern rewriter: matching, refusals (cycle, effect order, shared interior values), placement, explain."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
import torch
from passes_helpers import assert_equivalent

from m3c.ir import registry
from m3c.ir.graph import Graph, Value
from m3c.ir.ops.infer import same_as
from m3c.ir.registry import defop
from m3c.ir.text import graphs_equal, parse_graph, print_graph
from m3c.ir.verifier import verify
from m3c.passes import Check, P, PassContext, Rewrite, RewritePass, V, X, apply_rewrites, run_pipeline
from m3c.passes.manager import Pipeline
from m3c.passes.rewrite import Builder, Match, RewriteError


@pytest.fixture(autouse=True)
def _test_ops(monkeypatch: pytest.MonkeyPatch) -> None:
    """Test-only fused ops, registered in a copy of the registry that is put back after each test."""
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry.all_ops()))

    @defop("test_exp_sin", ("x", "y"), infer=lambda t, a: [t[0], t[1]])
    def _exp_sin(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Test-only horizontal fusion: (exp x, sin y)."""
        return x.exp(), y.sin()

    @defop("test_add_rms_norm", ("x", "r", "w"), {"eps": 1e-6}, infer=lambda t, a: [t[0], t[0]])
    def _add_rms_norm(x: torch.Tensor, r: torch.Tensor, w: torch.Tensor, *, eps: float) -> tuple[torch.Tensor, ...]:
        """Test-only fused residual add + RMSNorm: (rms_norm(x + r) * w, x + r)."""
        s = x + r
        return torch.nn.functional.rms_norm(s, (s.shape[-1],), w, eps), s

    @defop("test_scaled_attention", ("q", "k_cache", "v_cache", "positions", "query_start_loc", "seq_lens",
                                     "block_table"), {"block_size": 8, "scale": 1.0, "factor": 1.0},
           infer=same_as(0), reads=("k_cache", "v_cache"))
    def _scaled_attention(*args: Any, **kw: Any) -> torch.Tensor:  # never run
        """Test-only: attention times a factor."""
        raise NotImplementedError

    @defop("test_exp_attention", ("x", "q", "k_cache", "v_cache", "positions", "query_start_loc", "seq_lens",
                                  "block_table"), infer=lambda t, a: [t[0], t[1]], reads=("k_cache", "v_cache"))
    def _exp_attention(*args: Any) -> torch.Tensor:  # never run
        """Test-only horizontal fusion of an exp and an attention."""
        raise NotImplementedError


def _op(m: Match, b: Builder, op: str, names: Sequence[str], attrs: dict[str, Any] | None = None) -> list[Value]:
    return b.add(op, [m[n] for n in names], attrs)


EXP_SIN = Rewrite("exp_sin", [P("exp", X("x")), P("sin", X("y"))],
                  lambda m, b: _op(m, b, "test_exp_sin", ["x", "y"]))


def _records(g: Graph, *rewrites: Rewrite) -> list:
    out = apply_rewrites(g, rewrites, PassContext(explain=True))
    verify(g)
    return out


# ---- matching ------------------------------------------------------------------------------------
def test_captures_unify_by_name_and_commutative_tries_both_orders() -> None:
    g = parse_graph("""
    graph @main(%x: f32[4] input, %y: f32[4] input) {
      %a: f32[4] = mul(%x, %x)
      %b: f32[4] = mul(%x, %y)
      %c: f32[4] = add(%b, %a)
      return %c
    }""")
    square = P("mul", X("v"), X("v"), name="sq")
    rw = Rewrite("add_square", P("add", square, X("other"), commutative=True),
                 lambda m, b: [b.one("sub", [m["other"], m["sq"]])])
    (rec,) = _records(g, rw)
    assert rec.status == "applied"
    assert [n.op for n in g.nodes] == ["mul", "mul", "sub"]
    assert g.nodes[2].inputs == [g.nodes[1].outputs[0], g.nodes[0].outputs[0]]


def test_attribute_captures_multi_output_and_rest_operands() -> None:
    g = parse_graph("""
    graph @main(%x: f32[4,8] input) {
      %a: f32[4,4], %b: f32[4,4] = split(%x) {dim=1, sizes=[4,4]}
      %c: f32[4,8] = cat(%b, %a) {dim=1}
      return %c
    }""")
    sp = P("split", X("x"), dim=V("d"))
    swap = Rewrite("swap_halves", P("cat", sp[1], sp[0], dim=V("d")),
                   lambda m, b: [b.one("cat", [m["x"]], {"dim": m["d"]})],
                   where=[Check("two equal halves", lambda m: True)])
    any_cat = Rewrite("any_cat", P("cat", ..., dim=0), lambda m, b: [])
    records = _records(g, any_cat, swap)
    assert [(r.rewrite, r.status) for r in records] == [("swap_halves", "applied"), ("any_cat", "missed")]
    assert "attribute dim=1, expected 0" in records[1].reason
    assert [n.op for n in g.nodes] == ["cat"]


def test_near_miss_reports_the_deepest_partial_match() -> None:
    g = parse_graph("""
    graph @main(%x: f32[4] input) {
      %a: f32[4] = exp(%x)  # early
      %b: f32[4] = neg(%a)  # early
      %c: f32[4] = exp(%x)  # late
      %d: f32[4] = sin(%c)  # late
      return %b, %d
    }""")
    rw = Rewrite("sin_exp_x", P("sin", P("exp", X("x", rank=2))), lambda m, b: [b.one("neg", [m["x"]])])
    (miss,) = _records(g, rw)
    assert (miss.status, miss.scope, miss.progress) == ("missed", "late", 3)
    assert miss.reason == "operand 0 of exp %c at late: check 'x has rank 2' failed"
    assert _records(g, Rewrite("none", P("matmul", X(), X()), lambda m, b: []))[0].reason == \
        "no 'matmul' node in the graph"


def test_build_must_return_fitting_values() -> None:
    g = parse_graph("graph @main(%x: f32[4] input, %y: f32[8] input) {\n %a: f32[4] = exp(%x)\n return %a\n}")
    bad = Rewrite("bad", P("exp", X("x")), lambda m, b: [g.inputs[1]])
    with pytest.raises(RewriteError, match=r"replacement %y: f32\[8\] for %a: f32\[4\]"):
        _records(g, bad)


def test_a_rewrite_that_never_settles_is_reported() -> None:
    g = parse_graph("graph @main(%x: f32[4] input) {\n %a: f32[4] = exp(%x)\n return %a\n}")
    loop = Rewrite("loop", P("exp", X("x")), lambda m, b: [b.one("exp", [m["x"]])])
    with pytest.raises(RewriteError, match="did not converge"):
        apply_rewrites(g, [loop], max_sweeps=3)


# ---- refusals and placement -------------------------------------------------------------------
def test_refuses_a_fusion_that_would_create_a_cycle() -> None:
    before = """
    graph @main(%x: f32[4] input) {
      %a: f32[4] = exp(%x)
      %b: f32[4] = neg(%a)
      %c: f32[4] = sin(%b)
      return %c
    }"""
    g = parse_graph(before)
    (rec,) = _records(g, EXP_SIN)
    assert rec.status == "refused" and "would create a cycle" in rec.reason
    assert graphs_equal(g, parse_graph(before))
    report = run_pipeline(g, Pipeline("p", [RewritePass("fuse", [EXP_SIN])]), PassContext(explain=True))
    assert "exp_sin: refused at exp %a" in report.explain_text()
    assert "would create a cycle" in report.explain_text()


def test_multi_root_fusion_is_placed_before_the_first_use(rng: torch.Generator) -> None:
    g = parse_graph("""
    graph @main(%x: f32[4] input, %y: f32[4] input) {
      %a: f32[4] = exp(%x)
      %b: f32[4] = neg(%a)
      %c: f32[4] = sin(%y)
      %d: f32[4] = add(%b, %c)
      return %d
    }""")
    before = parse_graph(print_graph(g))
    (rec,) = _records(g, EXP_SIN)
    assert rec.status == "applied"
    assert graphs_equal(g, parse_graph("""
    graph @main(%x: f32[4] input, %y: f32[4] input) {
      %e: f32[4], %s: f32[4] = test_exp_sin(%x, %y)
      %b: f32[4] = neg(%e)
      %d: f32[4] = add(%b, %s)
      return %d
    }"""))
    assert_equivalent(before, g, {"x": torch.randn(4, generator=rng), "y": torch.randn(4, generator=rng)})


def test_multi_root_refused_when_an_operand_comes_too_late() -> None:
    g = parse_graph("""
    graph @main(%x: f32[4] input) {
      %a: f32[4] = exp(%x)
      %b: f32[4] = neg(%a)
      %y: f32[4] = cos(%x)
      %c: f32[4] = sin(%y)
      %d: f32[4] = add(%b, %c)
      return %d
    }""")
    (rec,) = _records(g, EXP_SIN)
    assert rec.status == "refused" and "needs %y, defined after the first use" in rec.reason


ATTN_GRAPH = """
graph @main(%q: f32[T,4,64] input, %k: f32[T,2,64] input, %slots: i64[T] input, %pos: i64[T] input,
            %qsl: i32[R+1] input, %lens: i32[R] input, %table: i32[R,6] input,
            %kc: f32[12,8,2,64] state, %vc: f32[12,8,2,64] state, %xc: f32[12,8,2,64] state) {
  %o: f32[T,4,64] = paged_attention(%q, %kc, _, %vc, _, %pos, %qsl, %lens, %table) {block_size=8, scale=0.125}
  WRITE
  %r: f32[T,4,64] = mul(%o) {scalar=2.0}
  return %r
}"""
SCALE = Rewrite("scale_attention", P("mul", P("paged_attention", X("q"), X("kc"), None, X("vc"), None, X("pos"),
                                              X("qsl"), X("lens"), X("table"), name="attn"), scalar=V("f")),
                lambda m, b: _op(m, b, "test_scaled_attention", ["q", "kc", "vc", "pos", "qsl", "lens", "table"],
                                 {"scale": m.node("attn").attrs["scale"], "factor": m["f"]}))


def test_refuses_a_fusion_that_would_move_a_read_past_a_write() -> None:
    before = ATTN_GRAPH.replace("WRITE", "paged_write(%k, %slots, %kc)")
    g = parse_graph(before)
    (rec,) = _records(g, SCALE)
    assert rec.status == "refused" and "reorder an effect" in rec.reason and "paged_attention %o" in rec.reason
    assert graphs_equal(g, parse_graph(before))
    text = run_pipeline(g, Pipeline("p", [RewritePass("fuse", [SCALE])]), PassContext(explain=True)).explain_text()
    assert "scale_attention: refused at mul %r: fusing would reorder an effect" in text


@pytest.mark.parametrize(("write", "applies"), [("paged_write(%k, %slots, %vc)", False),
                                                ("paged_write(%k, %slots, %xc)", True), ("", True)])
def test_the_fusion_applies_when_no_conflicting_write_is_in_between(write: str, applies: bool) -> None:
    g = parse_graph(ATTN_GRAPH.replace("WRITE", write))
    (rec,) = _records(g, SCALE)
    assert (rec.status == "applied") == applies
    if applies:
        assert [n.op for n in g.nodes if n.op != "paged_write"] == ["test_scaled_attention"]
        assert g.nodes[-1].attrs["factor"] == 2.0


def test_refuses_moving_a_read_up_past_a_write() -> None:
    before = ATTN_GRAPH.replace("%o: f32[T,4,64] = paged_attention", """%e: f32[T,2,64] = exp(%k)
  %n: f32[T,2,64] = neg(%e)
  paged_write(%k, %slots, %kc)
  %o: f32[T,4,64] = paged_attention""").replace("WRITE", "")
    attn = P("paged_attention", X("q"), X("kc"), None, X("vc"), None, X("pos"), X("qsl"), X("lens"), X("table"))
    rw = Rewrite("exp_attention", [P("exp", X("x")), attn],
                 lambda m, b: _op(m, b, "test_exp_attention", ["x", "q", "kc", "vc", "pos", "qsl", "lens", "table"]))
    g = parse_graph(before)
    (rec,) = _records(g, rw)
    assert rec.status == "refused"
    assert rec.reason == "fusing would reorder an effect: paged_attention %o would move before paged_write", rec.reason
    g = parse_graph(before.replace("paged_write(%k, %slots, %kc)", "paged_write(%k, %slots, %xc)"))
    assert _records(g, rw)[0].status == "applied"
    assert [n.op for n in g.nodes] == ["test_exp_attention", "neg", "paged_write", "mul"]


ADD_NORM = """
graph @main(%x: f32[4,8] input, %r: f32[4,8] input, %w: f32[8] param) {
  %s: f32[4,8] = add(%x, %r)
  %n: f32[4,8] = rms_norm(%s, %w) {eps=1e-06}
  %e: f32[4,8] = exp(%n)
  %o: f32[4,8] = add(%s, %e)
  return %o
}"""


def test_interior_value_used_outside_blocks_the_fusion() -> None:
    fused = Rewrite("add_rms_norm", P("rms_norm", P("add", X("x"), X("r")), X("w"), eps=V("eps")),
                    lambda m, b: _op(m, b, "test_add_rms_norm", ["x", "r", "w"], {"eps": m["eps"]})[:1])
    g = parse_graph(ADD_NORM)
    (rec,) = _records(g, fused)
    assert rec.status == "refused"
    assert rec.reason == "interior value %s (add) is also used by add %o"


def test_interior_value_listed_as_a_root_is_re_exported(rng: torch.Generator) -> None:
    add = P("add", X("x"), X("r"))
    fused = Rewrite("add_rms_norm", [P("rms_norm", add, X("w"), eps=V("eps")), add],
                    lambda m, b: _op(m, b, "test_add_rms_norm", ["x", "r", "w"], {"eps": m["eps"]}))
    g = parse_graph(ADD_NORM)
    before = parse_graph(ADD_NORM)
    assert _records(g, fused)[0].status == "applied"
    assert graphs_equal(g, parse_graph("""
    graph @main(%x: f32[4,8] input, %r: f32[4,8] input, %w: f32[8] param) {
      %n: f32[4,8], %s: f32[4,8] = test_add_rms_norm(%x, %r, %w) {eps=1e-06}
      %e: f32[4,8] = exp(%n)
      %o: f32[4,8] = add(%s, %e)
      return %o
    }"""))
    ins = {"x": torch.randn(4, 8, generator=rng), "r": torch.randn(4, 8, generator=rng),
           "w": torch.randn(8, generator=rng)}
    assert_equivalent(before, g, ins)


def test_matched_effect_nodes_go_only_when_replaced() -> None:
    g = parse_graph("""
    graph @main(%x: f32[4,8] input, %slots: i64[4] input, %cache: f32[2,4,8] state) {
      %a: f32[4,8] = exp(%x)
      paged_write(%a, %slots, %cache)
      %b: f32[4,8] = neg(%a)
      return %b
    }""")
    neg_exp = Rewrite("neg_exp", P("neg", P("exp", X("x"))), lambda m, b: [b.one("sin", [m["x"]])])
    (rec,) = _records(g, neg_exp)  # exp's value also feeds the write: refused, the write stays
    assert rec.status == "refused" and "also used by paged_write" in rec.reason
    assert [n.op for n in g.nodes] == ["exp", "paged_write", "neg"]
    shared = Rewrite("neg_exp", P("neg", P("exp", X("x"))), lambda m, b: [b.one("sin", [m["x"]])],
                     keep_shared=True)
    assert _records(g, shared)[0].status == "applied"
    assert [n.op for n in g.nodes] == ["exp", "paged_write", "sin"]


def test_identity_rewrite_of_a_graph_output() -> None:
    g = parse_graph("graph @main(%x: f32[4] input) {\n %a: f32[4] = mul(%x) {scalar=1}\n return %a\n}")
    _records(g, Rewrite("unit", P("mul", X("x"), scalar=1), lambda m, b: [m["x"]]))
    assert g.nodes == [] and g.outputs == [g.inputs[0]]


def test_pattern_types_are_checked() -> None:
    with pytest.raises(ValueError, match="commutative"):
        P("add", X(), X(), X(), commutative=True)
    with pytest.raises(ValueError, match="roots"):
        Rewrite("r", [], lambda m, b: [])
