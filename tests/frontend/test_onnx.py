"""ONNX export of IR graphs: custom-domain nodes, symbolic dims, quantized types, checker-clean."""

from __future__ import annotations

from pathlib import Path

import onnx
from onnx import TensorProto

from m3c.frontend.capture import Capture
from m3c.frontend.onnx_export import DOMAIN, save_onnx, to_onnx
from m3c.ir.graph import Graph
from m3c.ir.types import DType, TensorType, sym


def test_tiny_graph_exports_checker_clean(tiny_capture: Capture, tmp_path: Path) -> None:
    g = tiny_capture.graph
    model = to_onnx(g)
    onnx.checker.check_model(model, full_check=True)
    assert len(model.graph.node) == len(g.nodes)
    assert {n.domain for n in model.graph.node} == {DOMAIN}
    assert [n.op_type for n in model.graph.node] == [n.op for n in g.nodes]
    inputs = {i.name: i for i in model.graph.input}
    ids = inputs["input_ids"].type.tensor_type
    assert ids.elem_type == TensorProto.INT64 and ids.shape.dim[0].dim_param == "T"
    assert inputs["query_start_loc"].type.tensor_type.shape.dim[0].dim_param == "R+1"
    kv = inputs["kv.0.k"]
    assert kv.type.tensor_type.elem_type == TensorProto.UINT8
    assert kv.doc_string.startswith("state") and "nvfp4[NB," in kv.doc_string
    writes = [n for n in model.graph.node if n.op_type == "paged_write"]
    assert writes and all(len(n.output) == 0 for n in writes)
    path = save_onnx(g, tmp_path / "tiny.onnx")
    back = onnx.load(str(path))
    assert len(back.graph.node) == len(g.nodes)
    assert any(p.key == "m3c.meta" for p in back.metadata_props)


def test_attributes_map_to_onnx_types_or_json() -> None:
    g = Graph("attrs")
    x = g.add_input("x", TensorType(DType.f32, (sym("T"), 8)))
    (y,) = g.add("slice", [x], {"dim": 1, "start": 2, "end": None, "step": 1})
    (z,) = g.add("view", [y], {"shape": ["T", 2, 3]})
    (w,) = g.add("sum", [z], {"dims": [1, 2], "keepdim": True})
    g.outputs = [w]
    model = to_onnx(g)
    onnx.checker.check_model(model)
    attrs = {(n.op_type, a.name): a for n in model.graph.node for a in n.attribute}
    assert attrs[("slice", "dim")].type == onnx.AttributeProto.INT
    assert attrs[("slice", "end")].type == onnx.AttributeProto.STRING and attrs[("slice", "end")].s == b"null"
    assert attrs[("slice", "end")].doc_string == "json"
    assert attrs[("view", "shape")].s == b'["T", 2, 3]'
    assert list(attrs[("sum", "dims")].ints) == [1, 2] and attrs[("sum", "keepdim")].i == 1
    out = model.graph.output[0].type.tensor_type
    assert out.shape.dim[0].dim_param == "T" and out.shape.dim[1].dim_value == 1
