"""Any IR graph as an ONNX model, for looking at it in ONNX tools (Netron, onnx.checker).

Every IR node becomes one node of the custom domain ``m3c`` (op_type = IR op name, doc_string =
scope). Attributes map to ONNX ints / floats / strings and their lists; anything else (None,
mixed or nested lists, dicts, symbolic shapes) becomes a JSON string attribute whose doc_string
is ``"json"``. Value infos carry every value's type: symbolic dims as ``dim_param`` (``T``,
``R+1``); quantized dtypes (nvfp4, mxfp8) and e8m0 as UINT8 with the IR type in the doc_string.
Graph inputs say their kind (input / param / state) in their doc_string; ``graph.meta`` is kept
as JSON in the model's metadata_props. Nodes that only write state (``paged_write``) have no outputs.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import onnx
from onnx import TensorProto, helper

from m3c.ir.graph import Graph, Value
from m3c.ir.types import DType, TensorType, dim_str

DOMAIN = "m3c"
OPSET = 21

_ELEM = {
    DType.f64: TensorProto.DOUBLE, DType.f32: TensorProto.FLOAT, DType.f16: TensorProto.FLOAT16,
    DType.bf16: TensorProto.BFLOAT16, DType.fp8e4m3: TensorProto.FLOAT8E4M3FN, DType.e8m0: TensorProto.UINT8,
    DType.nvfp4: TensorProto.UINT8, DType.mxfp8: TensorProto.UINT8, DType.u8: TensorProto.UINT8,
    DType.i32: TensorProto.INT32, DType.i64: TensorProto.INT64, DType.bool: TensorProto.BOOL,
}
_STORED_AS_BYTES = (DType.nvfp4, DType.mxfp8, DType.e8m0)


def _value_info(name: str, t: TensorType, doc: str = "") -> onnx.ValueInfoProto:
    dims = [d if isinstance(d, int) else dim_str(d) for d in t.shape]
    if t.dtype in _STORED_AS_BYTES:
        doc = f"{doc} m3c type {t}".strip()
    return helper.make_tensor_value_info(name, _ELEM[t.dtype], dims, doc_string=doc)


def _attribute(key: str, value: Any) -> onnx.AttributeProto:
    """An ONNX attribute for an IR attribute (JSON string, doc_string 'json', when no ONNX type fits)."""
    plain = (
        isinstance(value, (bool, int, float, str))
        or (isinstance(value, (list, tuple)) and value and all(type(x) is int for x in value))
        or (isinstance(value, (list, tuple)) and value and all(type(x) is float for x in value))
        or (isinstance(value, (list, tuple)) and value and all(type(x) is str for x in value))
    )
    if plain:
        return helper.make_attribute(key, value)
    return helper.make_attribute(key, json.dumps(value, sort_keys=True, default=str), doc_string="json")


def to_onnx(graph: Graph) -> onnx.ModelProto:
    """The graph as an ONNX model of custom-domain ``m3c`` nodes that passes ``onnx.checker``."""

    def name(v: Value | None) -> str:
        return "" if v is None else v.name

    nodes = []
    for i, node in enumerate(graph.nodes):
        attrs = [_attribute(k, v) for k, v in sorted(node.attrs.items())]
        proto = helper.make_node(node.op, [name(v) for v in node.inputs], [v.name for v in node.outputs],
                                 name=f"n{i}_{node.op}", domain=DOMAIN, doc_string=node.scope)
        proto.attribute.extend(attrs)
        nodes.append(proto)
    inputs = [_value_info(v.name, v.type, v.kind) for v in graph.inputs]
    outputs = [_value_info(v.name, v.type) for v in graph.outputs]
    outset = set(graph.outputs)
    infos = [_value_info(v.name, v.type) for n in graph.nodes for v in n.outputs if v not in outset]
    g = helper.make_graph(nodes, graph.name, inputs, outputs, value_info=infos)
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid(DOMAIN, 1)],
                              producer_name="m3c")
    if graph.meta:
        helper.set_model_props(model, {"m3c.meta": json.dumps(graph.meta, sort_keys=True, default=str)})
    return model


def save_onnx(graph: Graph, path: str | Path) -> Path:
    """Write :func:`to_onnx` of the graph to `path` (checked first); returns the path."""
    model = to_onnx(graph)
    onnx.checker.check_model(model)
    path = Path(path)
    onnx.save(model, str(path))
    return path
