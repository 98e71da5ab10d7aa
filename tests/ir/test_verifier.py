"""The verifier: a valid graph passes; each invariant, broken on purpose, fails with a message naming the node."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from m3c.ir.graph import Graph, Node, Value
from m3c.ir.text import parse_graph, print_graph
from m3c.ir.types import DType, TensorType, sym
from m3c.ir.verifier import IRVerifyError, effect_signature, record_effect_order, verify

from .graphs import attention_graph

Corrupt = Callable[[Graph, dict[str, Node]], None]


def _swap(g: Graph, a: Node, b: Node) -> None:
    i, j = g.nodes.index(a), g.nodes.index(b)
    g.nodes[i], g.nodes[j] = b, a


def _retype(n: dict[str, Node]) -> None:
    v = n["split"].outputs[1]
    v.type = TensorType(DType.f32, (sym("T"), 33))  # someone edits a type by hand


def _param_cache(g: Graph, n: dict[str, Node]) -> None:
    g.inputs[-2].kind = "param"  # kv.0.k is now a weight, yet paged_write writes it


def _result_as_cache(g: Graph, n: dict[str, Node]) -> None:
    n["attn"].inputs[3] = n["vq"].outputs[0]  # attention reads a node result as its V cache


def _dangling(g: Graph, n: dict[str, Node]) -> None:
    g.outputs.append(Value("ghost", TensorType.parse("f32[T]")))


def _missing_attr(g: Graph, n: dict[str, Node]) -> None:
    del n["split"].attrs["dim"]


def _cycle(g: Graph, n: dict[str, Node]) -> None:
    n["qkv"].inputs[0] = n["out"].outputs[0]


CORRUPTIONS: list[tuple[str, Corrupt, str]] = [
    ("use-before-def", lambda g, n: _swap(g, n["q3"], n["split"]), "operand #0 %q is used before its definition"),
    ("cycle", lambda g, n: _cycle(g, n), "%out is used before its definition"),
    ("undefined-value", lambda g, n: n["q3"].inputs.__setitem__(0, Value("nowhere", TensorType.parse("f32[T,32]"))),
     "%nowhere is used but never defined"),
    ("unknown-op", lambda g, n: setattr(n["out"], "op", "frobnicate"), "unknown op 'frobnicate'"),
    ("unknown-attr", lambda g, n: n["split"].attrs.update(bogus=1), "unknown attribute 'bogus'"),
    ("missing-attr", _missing_attr, "missing attribute 'dim'"),
    ("arity", lambda g, n: n["q3"].inputs.append(g.inputs[0]), "expects 1..1 operands, got 2"),
    ("absent-required", lambda g, n: n["attn"].inputs.__setitem__(0, None), "operand 0 (q) is required but absent"),
    ("type-mismatch", lambda g, n: _retype(n), "operand types do not fit"),
    ("recorded-type", lambda g, n: setattr(n["out"].outputs[0], "type", TensorType.parse("f32[T,31]")),
     "%out is recorded as f32[T,31] but its operands give f32[T,32]"),
    ("output-count", lambda g, n: n["split"].outputs.pop(), "has 2 outputs, the op declares 3"),
    ("write-non-state", _param_cache, "writes %kv.0.k as state, but it is a graph param"),
    ("read-non-state", _result_as_cache, "reads %vq as state, but it is a node result"),
    ("dangling-output", _dangling, "graph output #1 %ghost is not defined"),
    ("defined-twice", lambda g, n: g.nodes.append(n["out"]), "value %out is defined twice"),
    ("back-link", lambda g, n: setattr(n["split"].outputs[1], "index", 2), "output #1 %k links back"),
    ("name-clash", lambda g, n: setattr(n["out"].outputs[0], "name", "x"), "value name %x is already used"),
    ("input-kind", lambda g, n: setattr(g.inputs[0], "kind", "weird"), "kind 'weird' is not one of"),
]


def test_valid_graph_passes() -> None:
    g, _ = attention_graph()
    verify(g)
    verify(parse_graph(print_graph(g)))
    record_effect_order(g)
    verify(g)


@pytest.mark.parametrize(("corrupt", "fragment"), [c[1:] for c in CORRUPTIONS], ids=[c[0] for c in CORRUPTIONS])
def test_each_check_fails(corrupt: Corrupt, fragment: str) -> None:
    g, nodes = attention_graph()
    corrupt(g, nodes)
    with pytest.raises(IRVerifyError) as info:
        verify(g)
    assert fragment in str(info.value), str(info.value)


def test_messages_name_op_outputs_and_scope() -> None:
    g, n = attention_graph()
    _retype(n)
    with pytest.raises(IRVerifyError) as info:
        verify(g)
    assert "node #1 %q, %k, %v = split (scope layers.0.self_attn): output %k is recorded as f32[T,33] but its " \
        "operands give f32[T,32]" in str(info.value)
    assert "node #3 %k3 = view (scope layers.0.self_attn): operand types do not fit" in str(info.value)


def test_all_problems_are_listed() -> None:
    g, n = attention_graph()
    n["out"].op = "frobnicate"
    _param_cache(g, n)
    _dangling(g, n)
    with pytest.raises(IRVerifyError) as info:
        verify(g)
    problems = info.value.problems
    assert len(problems) == 4  # the param cache is both written (paged_write) and read (paged_attention)
    assert [p.split(":")[0] for p in problems] == [
        "node #7 paged_write (scope layers.0.self_attn.k_insert)", "node #9 %o = paged_attention (scope layers.0.self_attn)",
        "node #10 %out = frobnicate (scope layers.0.self_attn)", "graph output #1 %ghost is not defined by any input or node (dangling)"]


def test_effect_order_is_checked_when_recorded() -> None:
    g, n = attention_graph()
    record_effect_order(g)
    assert g.meta["effect_order"] == {"kv.0.k": "wr", "kv.0.v": "wr"}
    g.nodes.remove(n["write_k"])
    g.nodes.insert(g.nodes.index(n["attn"]) + 1, n["write_k"])  # the write now follows its reader
    del g.meta["effect_order"]
    verify(g)  # SSA still holds: without a recorded order nothing says the write must come first
    g.meta["effect_order"] = {"kv.0.k": "wr", "kv.0.v": "wr"}
    with pytest.raises(IRVerifyError, match=r"state %kv.0.k: accesses in program order are 'rw'") as info:
        verify(g)
    assert "k_insert" in str(info.value)


def test_effect_signature_collapses_reads() -> None:
    g, n = attention_graph()
    again = lambda node: g.nodes.append(Node(node.op, list(node.inputs), dict(node.attrs), [], "again"))  # noqa: E731
    again(n["attn"])  # a second read right after the first: the same phase
    again(n["write_k"])
    again(n["attn"])
    assert effect_signature(g) == {"kv.0.k": "wrwr", "kv.0.v": "wr"}
