"""The ``megamoe`` op: its reference equals the model's MoE block bit for bit; type inference and its errors."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from m3c.ir.graph import Graph, Value
from m3c.ir.ops.fused_moe import megamoe
from m3c.ir.registry import IRTypeError
from m3c.ir.text import parse_graph, print_graph
from m3c.ir.types import TensorType
from m3c.ir.verifier import verify
from m3c.model_defs import quant
from m3c.model_defs.checkpoint import build_model
from m3c.model_defs.layers import MoE, QuantLinear
from m3c.model_defs.presets import get_preset

ATTRS = {"top_k": 2, "routed_scaling_factor": 2.5, "norm_topk_prob": True, "router_dtype": "f32"}
TYPES = ["f32[T,128]", "bf16[8,128]", "f32[8]", "nvfp4[8,128,128]", "nvfp4[8,128,64]", "mxfp8[128,128]",
         "mxfp8[128,64]"]


def _stored(q: QuantLinear) -> Any:
    """A QuantLinear's weight as the runtime value of its IR parameter."""
    if q.fmt == "nvfp4":
        return quant.NVFP4Tensor(q.weight, q.weight_scale, q.weight_scale_2)
    if q.fmt == "mxfp8":
        return quant.MXFP8Tensor(q.weight, q.weight_scale)
    return q.weight


def _graph(types: list[str | None], attrs: dict[str, Any] | None = None) -> tuple[Graph, list[Value]]:
    g = Graph("moe")
    operands = [None if t is None else g.add_input(f"x{i}", TensorType.parse(t), "input" if i == 0 else "param")
                for i, t in enumerate(types)]
    outs = g.add("megamoe", operands, ATTRS if attrs is None else attrs, scope="layers.0.mlp")
    g.outputs = outs
    return g, outs


@pytest.mark.parametrize("dtype,changes", [
    (torch.float32, {}),
    (torch.bfloat16, {}),
    (torch.float32, {"n_shared_experts": 0, "norm_topk_prob": False, "routed_expert_dtype": "mxfp8"}),
    (torch.bfloat16, {"routed_expert_dtype": "bf16", "proj_dtype": "bf16", "routed_scaling_factor": 1.0}),
], ids=["f32", "bf16", "f32-noshared-nonorm-mxfp8", "bf16-bf16weights-unscaled"])
def test_reference_equals_the_model_block(dtype: torch.dtype, changes: dict[str, Any], rng: torch.Generator) -> None:
    cfg = get_preset("m3.1-tiny").replace(**changes)
    model = build_model(cfg, seed=int(torch.randint(0, 2**31 - 1, (1,), generator=rng)), dtype=dtype)
    moe = model.layers[0].mlp
    assert isinstance(moe, MoE)
    x = torch.randn(int(torch.randint(1, 9, (1,), generator=rng)), cfg.hidden_size, generator=rng).to(dtype)
    shared = [None, None] if moe.shared is None else [_stored(moe.shared[0]), _stored(moe.shared[1])]
    got = megamoe(x, moe.gate.weight, moe.e_score_correction_bias, _stored(moe.w13), _stored(moe.w2), *shared,
                  top_k=cfg.num_experts_per_tok, routed_scaling_factor=cfg.routed_scaling_factor,
                  norm_topk_prob=cfg.norm_topk_prob, router_dtype="f32")
    want = moe(x)
    assert got.dtype == want.dtype == dtype
    assert torch.equal(got, want)


def test_infer_gives_x_type_and_the_graph_verifies_and_round_trips() -> None:
    g, (out,) = _graph(["bf16[T,128]", *TYPES[1:]])
    assert out.type == TensorType.parse("bf16[T,128]")
    verify(g)
    text = print_graph(g)
    assert "megamoe(" in text and print_graph(parse_graph(text)) == text
    g2, (out2,) = _graph(TYPES[:5])  # no shared expert
    assert out2.type == TensorType.parse("f32[T,128]") and len(g2.nodes[0].inputs) == 5


@pytest.mark.parametrize("index,bad,message", [
    (0, "f32[T,2,128]", "x must have rank 2"),
    (0, "nvfp4[T,128]", "x must be a float tensor"),
    (1, "bf16[8,64]", r"gate_w .* vs x .* \(hidden\)"),
    (2, "f32[7]", r"correction_bias .* \(experts\)"),
    (3, "nvfp4[4,128,128]", r"w13 .* \(experts\)"),
    (3, "nvfp4[8,96,128]", "2·I rows"),
    (4, "i32[8,128,64]", "w2 must be nvfp4, mxfp8 or float"),
    (4, "nvfp4[8,64,64]", r"w2 .* \(hidden\)"),
    (5, "mxfp8[100,128]", "2·S rows"),
    (6, None, "both or neither"),
])
def test_infer_errors_name_the_bad_operand(index: int, bad: str | None, message: str) -> None:
    types: list[str | None] = list(TYPES)
    types[index] = bad
    with pytest.raises(IRTypeError, match=f"megamoe: .*{message}"):
        _graph(types)


@pytest.mark.parametrize("key,value,message", [
    ("top_k", 9, r"top_k=9 must be an int in \[1, 8\]"),
    ("top_k", 0, "top_k=0"),
    ("router_dtype", "nvfp4", "router_dtype='nvfp4' must be a float dtype"),
    ("router_dtype", "bogus", "router_dtype='bogus'"),
    ("norm_topk_prob", 1, "norm_topk_prob=1 must be a bool"),
    ("routed_scaling_factor", "2.5", "routed_scaling_factor='2.5' must be a number"),
])
def test_infer_errors_on_bad_attrs(key: str, value: Any, message: str) -> None:
    with pytest.raises(IRTypeError, match=f"megamoe: {message}"):
        _graph(TYPES, {**ATTRS, key: value})
