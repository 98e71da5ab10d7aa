"""The text form: print -> parse -> print is a fixed point, graphs compare and hash structurally, errors name lines."""

from __future__ import annotations

import math
import struct
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from m3c.ir.graph import Graph, Value
from m3c.ir.text import IRParseError, graph_hash, graphs_equal, parse_graph, print_graph
from m3c.ir.types import TensorType
from m3c.ir.verifier import verify

from .test_ops import CASES, build

FAST = settings(max_examples=60, deadline=None)

EXAMPLE = """\
graph @layer(%input_ids: i64[T] input, %w: f32[512,128] param, %layers.0.qkv: f32[128,128] param,
             %slot_mapping: i64[T] input, %kv.0.k: nvfp4[NB,8,2,32] state) {
  meta {"effect_order":{"kv.0.k":"w"}}
  %x: f32[T,128] = embedding(%w, %input_ids)  # embed_tokens
  %qkv: f32[T,128] = linear(%x, %layers.0.qkv, _)  # layers.0.self_attn.qkv
  %a: f32[T,64], %b: f32[T,64] = split(%qkv) {dim=-1, sizes=[64,64]}  # layers.0.self_attn
  %k: f32[T,2,32] = view(%b) {shape=["T",2,32]}
  %kq: nvfp4[T,2,32] = quantize(%k) {dtype="nvfp4"}
  paged_write(%kq, %slot_mapping, %kv.0.k)  # layers.0.self_attn.kv_insert
  %y: f32[T,64] = mul(%a) {scalar=0.17677669529663687}
  return %y
}
"""


def roundtrip(g: Graph) -> Graph:
    """Print, parse, print again; assert the fixed point and structural equality."""
    text = print_graph(g)
    h = parse_graph(text)
    assert print_graph(h) == text
    assert graphs_equal(g, h) and graphs_equal(h, g)
    assert graph_hash(g) == graph_hash(h)
    assert [n.scope for n in h.nodes] == [n.scope for n in g.nodes]
    assert [v.name for v in h.values()] == [v.name for v in g.values()]
    assert h.name == g.name
    return h


def test_example_parses_verifies_and_roundtrips() -> None:
    g = parse_graph(EXAMPLE)
    verify(g)
    assert g.op_counts()["paged_write"] == 1
    assert [v.kind for v in g.inputs] == ["input", "param", "param", "input", "state"]
    assert g.nodes[1].inputs[2] is None and g.nodes[1].scope == "layers.0.self_attn.qkv"
    assert g.nodes[2].attrs == {"dim": -1, "sizes": [64, 64]}
    assert g.meta == {"effect_order": {"kv.0.k": "w"}}
    h = roundtrip(g)
    assert str(h) == print_graph(h)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_every_op_case_roundtrips(case: Any) -> None:
    g, _ = build(case)
    verify(roundtrip(g))


@pytest.mark.parametrize("value", [1e-6, 0.1, math.inf, -math.inf, math.nan, -0.0, 5e-324, 1.7976931348623157e308,
                                   1 / 3, 2.0**-149])
def test_float_attrs_roundtrip_exactly(value: float) -> None:
    g = Graph()
    x = g.add_input("x", TensorType.parse("f32[T]"))
    g.outputs = g.add("add", [x], {"scalar": value})
    got = parse_graph(print_graph(g)).nodes[0].attrs["scalar"]
    assert isinstance(got, float)
    assert struct.pack("<d", got) == struct.pack("<d", value) or (math.isnan(got) and math.isnan(value))


@pytest.mark.parametrize("type_text", ["f32[4*T,T+1]", "bf16[S*T+1,8]", "i64[floor(T/2)]", "nvfp4[NB,8,2,32]",
                                       "f32[]", "u8[Mod(T,8),ceiling(T/16)]", "mxfp8[2*R+2,64]"])
def test_symbolic_types_roundtrip(type_text: str) -> None:
    g = Graph()
    x = g.add_input("x.0", TensorType.parse(type_text))
    g.outputs = g.add("neg", [x])
    h = roundtrip(g)
    assert str(h.inputs[0].type) == type_text
    assert h.inputs[0].type == TensorType.parse(type_text)


def test_odd_names_scopes_and_meta_roundtrip() -> None:
    g = Graph("my graph")
    x = g.add_input("has space", TensorType.parse("f32[T]"))
    y = g.add_input("0.weird-name", TensorType.parse("f32[T]"), "param")
    (z,) = g.add("add", [x, y], scope='quote " and # hash\nnewline')
    (w,) = g.add("neg", [z], scope="  padded  ")
    (u,) = g.add("neg", [w], scope='"starts quoted')
    g.outputs = [u, x]
    g.meta = {"nested": {"list": [1, 2.5, None, True, "s"]}, "inf": math.inf}
    h = roundtrip(g)
    assert h.meta["nested"] == g.meta["nested"] and h.meta["inf"] == math.inf


def test_graphs_equal_ignores_names_but_not_structure() -> None:
    def make(names: tuple[str, str], dim: int = -1, swap: bool = False, kind: str = "input") -> Graph:
        g = Graph()
        a = g.add_input(names[0], TensorType.parse("f32[T,8]"), kind)
        b = g.add_input(names[1], TensorType.parse("f32[T,8]"))
        (c,) = g.add("sub", [b, a] if swap else [a, b])
        g.outputs = g.add("split", [c], {"dim": dim, "sizes": [4, 4]})
        return g

    base = make(("a", "b"))
    assert graphs_equal(base, make(("p", "q")))
    assert graph_hash(base) == graph_hash(make(("p", "q")))
    for other in (make(("a", "b"), dim=1), make(("a", "b"), swap=True), make(("a", "b"), kind="param")):
        assert not graphs_equal(base, other)
        assert graph_hash(base) != graph_hash(other)
    fewer = make(("a", "b"))
    fewer.outputs = fewer.outputs[:1]
    assert not graphs_equal(base, fewer)


def test_graph_hash_matches_identical_layers() -> None:
    def layer(i: int) -> Graph:
        g = Graph(f"layer{i}")
        x = g.add_input("x", TensorType.parse("f32[T,16]"))
        w = g.add_input(f"layers.{i}.w", TensorType.parse("f32[16,16]"), "param")
        (y,) = g.add("linear", [x, w], names=[f"layers.{i}.out"], scope=f"layers.{i}")
        g.outputs = g.add("rms_norm", [y], {"eps": 1e-6}, scope=f"layers.{i}.norm")
        return g

    assert graph_hash(layer(0)) == graph_hash(layer(1))
    assert len(graph_hash(layer(0))) == 64


PARSE_ERRORS = [
    ("graph @g() {\n  return %y\n}\n", 2, "%y is used but not defined"),
    ("graph @g(%x: f32[T] input) {\n  %y: f32[T] = neg(%x)\n", 3, "missing 'return'"),
    ("graph @g(%x: f32[T] wrong) {\n  return %x\n}", 1, "input kind 'wrong'"),
    ("graph @g(%x: q9[T] input) {\n  return %x\n}", 1, "bad tensor type"),
    ("graph @g(%x: f32[T input) {\n  return %x\n}", 1, "unclosed tensor type"),
    ("graph @g(%x: f32[T] input) {\n  %y: f32[T] = neg(%x) {a=[1,}\n  return %y\n}", 2, "bad JSON for attribute a"),
    ("graph @g(%x: f32[T] input) {\n\n  %x: f32[T] = neg(%x)\n  return %x\n}", 3, "%x is defined twice"),
    ("graph @g(%x: f32[T] input) {\n  %y: f32[T] neg(%x)\n  return %y\n}", 2, "expected '='"),
    ("graph @g(%x: f32[T] input) {\n  return %x\n}\nextra", 4, "unexpected text after the graph"),
    ("graph @g(%x: f32[T] input) {\n  %y: f32[T] = neg(%x) {a=1, a=2}\n  return %y\n}", 2, "given twice"),
    ("graf @g() {}", 1, "expected 'graph'"),
    ("graph @g(%x: f32[T] input) {\n  meta [1]\n  return %x\n}", 2, "graph meta must be a JSON object"),
]


@pytest.mark.parametrize(("text", "line", "fragment"), PARSE_ERRORS)
def test_parse_errors_name_the_line(text: str, line: int, fragment: str) -> None:
    with pytest.raises(IRParseError, match=f"^line {line}: ") as info:
        parse_graph(text)
    assert fragment in str(info.value)


# ---- random graphs ---------------------------------------------------------------------------------
INPUT_TYPES = ["f32[T,8]", "f32[4*T,8]", "bf16[T+1,8]", "f32[8]", "f16[2,T,8]", "f32[T,32]", "f32[S,T,16]"]
FLOATS = st.floats(allow_nan=True, allow_infinity=True) | st.sampled_from([1e-6, 0.1, -0.0, math.inf, math.nan])
JSON = st.recursive(st.none() | st.booleans() | st.integers() | FLOATS | st.text(max_size=6),
                    lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=4), c, max_size=3),
                    max_leaves=8)
NAMES = st.from_regex(r"[a-z][a-z0-9_.]{0,6}", fullmatch=True) | st.text(max_size=5)
SCOPES = st.just("") | st.from_regex(r"layers\.[0-9]\.[a-z_]{1,6}", fullmatch=True) | st.text(max_size=8)


def _unique(g: Graph, name: str) -> str:
    """`name`, suffixed until no value of `g` uses it (any text: odd names print quoted)."""
    base, i = name, 0
    while name in {v.name for v in g.values()}:
        name, i = f"{base}~{i}", i + 1
    return name


def _float_values(pool: list[Value]) -> list[Value]:
    return [v for v in pool if v.type.dtype.is_float and not v.type.dtype.is_quantized and v.type.rank]


def _step(draw: Any, g: Graph, pool: list[Value]) -> None:
    """Append one random, well-typed node built from values in `pool`."""
    floats = _float_values(pool)
    x = draw(st.sampled_from(floats))
    last = x.type.shape[-1]
    kind = draw(st.sampled_from(["unary", "binary", "scalar", "split", "cat", "slice", "view", "sum", "cast",
                                 "linear", "norm", "fallback", "topk", "quant"]))
    scope, names = draw(SCOPES), [draw(NAMES)]
    add = lambda op, ins, attrs=None: pool.extend(g.add(op, ins, attrs, names=names, scope=scope))  # noqa: E731
    if kind == "unary":
        add(draw(st.sampled_from(["neg", "exp", "silu", "sigmoid", "rsqrt", "cos"])), [x])
    elif kind == "binary":
        same = [v for v in floats if v.type.shape == x.type.shape or v.type.shape == (last,)]
        add(draw(st.sampled_from(["add", "sub", "mul", "div"])), [x, draw(st.sampled_from(same))])
    elif kind == "scalar":
        add(draw(st.sampled_from(["add", "mul"])), [x], {"scalar": draw(FLOATS)})
    elif kind == "split" and isinstance(last, int) and last % 2 == 0:
        add("split", [x], {"dim": -1, "sizes": [last // 2, last // 2]})
    elif kind == "cat":
        add("cat", [x, x], {"dim": -1})
    elif kind == "slice" and isinstance(last, int):
        add("slice", [x], {"dim": -1, "start": draw(st.integers(0, 2)), "end": draw(st.integers(3, 9))})
    elif kind == "view":
        add("view", [x], {"shape": [-1]})
    elif kind == "sum":
        add("sum", [x], {"dims": [-1], "keepdim": draw(st.booleans())})
    elif kind == "cast":
        add("cast", [x], {"dtype": draw(st.sampled_from(["f32", "bf16", "f16"]))})
    elif kind == "linear":
        w = g.add_input(_unique(g, draw(NAMES)), TensorType.parse(f"f32[{draw(st.integers(1, 9))},{last}]"), "param")
        add("linear", [x, w])
    elif kind == "norm":
        add("rms_norm", [x], {"eps": draw(FLOATS)})
    elif kind == "fallback":
        add("fallback", [x], {"target": "aten.relu.default", "args": draw(JSON), "out_types": [str(x.type)]})
    elif kind == "topk" and isinstance(last, int):
        add("topk", [x], {"k": draw(st.integers(1, last))})
    elif kind == "quant" and isinstance(last, int) and last % 16 == 0:
        (q,) = g.add("quantize", [x], {"dtype": "nvfp4"}, names=names, scope=scope)
        add("dequantize", [q])


@st.composite
def random_graphs(draw: Any) -> Graph:
    """A random chain of well-typed ops over a few symbolic inputs."""
    g = Graph(draw(NAMES))
    pool = [g.add_input(_unique(g, draw(NAMES)), TensorType.parse(t), draw(st.sampled_from(["input", "param"])))
            for t in draw(st.lists(st.sampled_from(INPUT_TYPES), min_size=1, max_size=3))]
    for _ in range(draw(st.integers(0, 10))):
        _step(draw, g, pool)
    g.outputs = draw(st.lists(st.sampled_from(pool), max_size=3))
    if draw(st.booleans()):
        g.meta = draw(st.dictionaries(st.text(max_size=4), JSON, max_size=3))
    return g


@FAST
@given(random_graphs())
def test_random_graphs_roundtrip(g: Graph) -> None:
    verify(g)
    verify(roundtrip(g))
