"""The MegaMoE fusion: one ``megamoe`` per layer, the originals gone, bit-identical interpreter results,
every graph form (dtype, renorm, scale, shared expert and weight formats), and refusals that leave the graph as is."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from moe_graphs import MoEForm, T, emit_moe, moe_graph, random_inputs

from m3c.frontend.capture import Capture, capture_m3, m3_example_inputs
from m3c.ir.graph import Graph, Node
from m3c.ir.interpreter import interpret
from m3c.ir.registry import get_op
from m3c.ir.text import parse_graph, print_graph
from m3c.ir.types import DType, TensorType
from m3c.ir.verifier import verify
from m3c.model_defs.checkpoint import build_model
from m3c.model_defs.config import M3Config
from m3c.model_defs.presets import get_preset
from m3c.passes import PassContext, pipeline_for, run_pipeline
from m3c.passes.fuse_moe import PASS_NAME, fuse_moe_pass
from m3c.passes.fuse_qkv import PASS_NAME as QKV_PASS
from m3c.passes.manager import Pipeline, PipelineReport
from m3c.passes.pipelines import simplify

GONE = {"topk", "grouped_gemm", "sigmoid"}  # ops only the MoE chain has; every mlp-scope node must be megamoe


def _copy(g: Graph) -> Graph:
    return parse_graph(print_graph(g))


def _fuse(g: Graph) -> PipelineReport:
    return run_pipeline(g, Pipeline("moe", [fuse_moe_pass()]), PassContext(verify_each=True, explain=True))


def _applied(report: PipelineReport, prefix: str) -> list[str]:
    return sorted(r.scope for r in report.records() if r.status == "applied" and r.rewrite.startswith(prefix))


def _mlp_nodes(g: Graph, layer: int) -> list[Node]:
    return [n for n in g.nodes if n.scope.startswith(f"layers.{layer}.mlp")]


def _assert_fused(g: Graph, layers: int) -> None:
    """One megamoe per layer and nothing else in any MoE scope; no MoE-only op left anywhere."""
    counts = g.op_counts()
    assert counts["megamoe"] == layers and not GONE & set(counts)
    assert {n.op for n in g.nodes if ".mlp" in n.scope} == {"megamoe"}


def _seed(rng: torch.Generator) -> int:
    return int(torch.randint(0, 2**31 - 1, (1,), generator=rng))


# ---- the real capture ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny() -> Iterator[tuple[M3Config, Any, Capture, Graph]]:
    """The tiny preset as a bf16 model (the router widens to f32) with fresh random weights, captured once;
    the graph simplified, not fused."""
    cfg = get_preset("m3.1-tiny")
    seed = torch.seed() % 2**31
    print(f"model seed: {seed}")
    model = build_model(cfg, seed=seed, dtype=torch.bfloat16)
    cap = capture_m3(cfg, model=model)
    g = _copy(cap.graph)
    run_pipeline(g, Pipeline("simplify", simplify()), PassContext())
    yield cfg, model, cap, g


def _model_inputs(cap: Capture, model: Any, cfg: M3Config, rng: torch.Generator) -> tuple[dict, dict]:
    """Two copies of the interpreter inputs for fresh token ids and random valid cache contents."""
    args = list(m3_example_inputs(cfg))
    args[0] = torch.randint(0, cfg.vocab_size, args[0].shape, generator=rng)
    for layer in args[-1]:
        for t in layer.values():
            if t.dtype == torch.uint8:
                t.copy_(torch.randint(0, 256, t.shape, generator=rng, dtype=torch.uint8))
            else:
                t.copy_((torch.rand(t.shape, generator=rng) + 0.5).to(t.dtype))
    return cap.bind(model, *copy.deepcopy(args)), cap.bind(model, *copy.deepcopy(args))


def test_one_megamoe_per_layer_originals_gone_results_identical(tiny, rng: torch.Generator) -> None:
    cfg, model, cap, simplified = tiny
    g = _copy(simplified)
    report = _fuse(g)
    layers = [f"layers.{i}.mlp" for i in range(cfg.num_hidden_layers)]
    assert _applied(report, "moe_routed_widened_norm_scaled") == layers
    assert _applied(report, "moe_shared_cast_dequantize") == layers
    _assert_fused(g, cfg.num_hidden_layers)
    for i in range(cfg.num_hidden_layers):
        (node,) = _mlp_nodes(g, i)
        assert [v.name for v in node.inputs[1:]] == [f"layers.{i}.mlp.{p}" for p in (
            "gate.weight", "e_score_correction_bias", "w13", "w2", "shared.0", "shared.1")]
        assert node.attrs == {"top_k": cfg.num_experts_per_tok, "routed_scaling_factor": cfg.routed_scaling_factor,
                              "norm_topk_prob": True, "router_dtype": "f32"}
        assert node.outputs[0].type.dtype.value == "bf16"
    verify(g)
    text = print_graph(g)
    assert "= megamoe(" in text and print_graph(parse_graph(text)) == text
    a, b = _model_inputs(cap, model, cfg, rng)
    (ref,), (out,) = interpret(simplified, a, check_types=True), interpret(g, b, check_types=True)
    assert out.dtype == ref.dtype and torch.equal(out, ref)  # the same composition, op for op


def _signature(nodes: list[Node], scope: str) -> list[tuple]:
    """Each node as (op, all attrs, operands), operands named by position in `nodes` or by parameter suffix."""
    index = {n: i for i, n in enumerate(nodes)}

    def ref(v: Any) -> Any:
        if v is None:
            return None
        if v.producer in index:
            return index[v.producer], v.index
        return v.name.removeprefix(f"{scope}.") if v.name.startswith(scope) else "x"

    return [(n.op, sorted(get_op(n.op).full_attrs(n.attrs).items()), [ref(v) for v in n.inputs]) for n in nodes]


def _assert_emitter_matches(real: Graph, form: MoEForm) -> None:
    """`moe_graphs.emit_moe` (what the fast form tests run on) equals layer 0 of a real capture, node for node."""
    nodes = _mlp_nodes(real, 0)
    g = Graph("one")
    emit_moe(g, g.add_input("h", TensorType(DType(form.dtype), (T, form.hidden))), form, "layers.0.mlp")
    assert _signature(g.nodes, "layers.0.mlp") == _signature(nodes, "layers.0.mlp")


def test_the_hand_built_graphs_are_what_the_frontend_emits(tiny) -> None:
    cfg, _, _, simplified = tiny
    _assert_emitter_matches(simplified, MoEForm.of(cfg, "bf16"))


def test_an_interior_value_with_another_user_blocks_that_layer_only(tiny) -> None:
    cfg, _, _, simplified = tiny
    g = _copy(simplified)
    logits = next(n for n in _mlp_nodes(g, 0) if n.op == "sigmoid").inputs[0]
    g.outputs = [*g.outputs, logits]  # the router logits of layer 0 are also returned
    before = print_graph(g)
    report = _fuse(g)
    refused = [r for r in report.records() if r.status == "refused"]
    assert [r.scope for r in refused] == ["layers.0.mlp"] and "also used by the graph outputs" in refused[0].reason
    assert [n.op for n in _mlp_nodes(g, 0)] == [n.op for n in _mlp_nodes(parse_graph(before), 0)]
    assert g.op_counts()["megamoe"] == cfg.num_hidden_layers - 1 and g.op_counts()["topk"] == 1


def test_the_hopper_pipeline_runs_the_pass_after_the_qkv_fusion() -> None:
    names = [p.name for p in pipeline_for("hopper").passes]
    assert names.count(PASS_NAME) == 1 and names.index(PASS_NAME) > names.index(QKV_PASS)


def test_the_small_preset_fuses_every_layer_in_the_hopper_pipeline() -> None:
    """An f32 model (the router runs in x's dtype): its trace is the emitter's f32 form; every layer fuses."""
    cfg = get_preset("m3.1-small")
    cap = capture_m3(cfg, device="meta")
    simplified = _copy(cap.graph)
    run_pipeline(simplified, Pipeline("simplify", simplify()), PassContext())
    _assert_emitter_matches(simplified, MoEForm.of(cfg, "f32"))
    report = run_pipeline(cap.graph, pipeline_for("hopper"), PassContext(explain=True))
    assert cfg.num_hidden_layers == 2
    _assert_fused(cap.graph, 2)
    text = report.explain_text()
    assert "moe_routed_plain_norm_scaled: applied 2×" in text and "moe_shared_dequantize: applied 2×" in text


@pytest.mark.slow
def test_the_full_preset_fuses_all_60_layers() -> None:
    cap = capture_m3(get_preset("m3.1-flash"), device="meta")
    run_pipeline(cap.graph, pipeline_for("hopper"), PassContext())
    _assert_fused(cap.graph, 60)


# ---- hand-built graphs: every form, fast -----------------------------------------------------------
FORMS = [
    (MoEForm(), "moe_routed_plain_norm_scaled", "moe_shared_dequantize"),
    (MoEForm(dtype="bf16"), "moe_routed_widened_norm_scaled", "moe_shared_cast_dequantize"),
    (MoEForm(shared="bf16"), "moe_routed_plain_norm_scaled", "moe_shared_cast"),
    (MoEForm(dtype="bf16", experts="bf16", shared="bf16", scale=1.0), "moe_routed_widened_norm_unscaled",
     "moe_shared_plain"),
    (MoEForm(experts="mxfp8", shared=None, norm=False), "moe_routed_plain_nonorm_scaled", None),
    (MoEForm(dtype="bf16", experts="bf16", shared=None, norm=False, scale=1.0), "moe_routed_widened_nonorm_unscaled",
     None),
    (MoEForm(dtype="f64", top_k=3), "moe_routed_plain_norm_scaled", "moe_shared_cast_dequantize"),
]


@pytest.mark.parametrize("form,routed,shared", FORMS, ids=lambda v: v if isinstance(v, str) else None)
def test_every_form_fuses_to_identical_results(form: MoEForm, routed: str, shared: str | None,
                                               rng: torch.Generator) -> None:
    g = moe_graph([form, form])
    before = _copy(g)
    report = _fuse(g)
    assert _applied(report, routed) == ["layers.0.mlp", "layers.1.mlp"]
    assert _applied(report, "moe_shared") == ([] if shared is None else ["layers.0.mlp", "layers.1.mlp"])
    if shared is not None:
        assert _applied(report, shared) == ["layers.0.mlp", "layers.1.mlp"]
    assert {n.op for n in g.nodes} == {"megamoe", "add"}
    for node in (n for n in g.nodes if n.op == "megamoe"):
        assert len(node.inputs) == (5 if form.shared is None else 7)
        assert node.attrs["router_dtype"] == form.router and node.attrs["top_k"] == form.top_k
        assert node.attrs["norm_topk_prob"] is form.norm and node.attrs["routed_scaling_factor"] == form.scale
    inputs = random_inputs(g, rng)
    (ref,), (out,) = interpret(before, inputs, check_types=True), interpret(g, inputs, check_types=True)
    assert out.dtype == ref.dtype and torch.equal(out, ref)


def _node_of(g: Graph, layer: int, op: str, nth: int = 0) -> Node:
    return [n for n in _mlp_nodes(g, layer) if n.op == op][nth]


@pytest.mark.parametrize("op,nth,output", [("sigmoid", 0, 0), ("topk", 0, 1), ("grouped_gemm", 0, 0),
                                           ("mul", 0, 0), ("silu", 0, 0), ("cast", 0, 0)])
def test_an_escaping_routed_intermediate_leaves_the_graph_unchanged(op: str, nth: int, output: int) -> None:
    g = moe_graph([MoEForm(dtype="bf16")])
    g.outputs = [*g.outputs, _node_of(g, 0, op, nth).outputs[output]]
    before = print_graph(g)
    report = _fuse(g)
    assert print_graph(g) == before
    assert any(r.status == "refused" and "also used by" in r.reason for r in report.records())


def test_an_escaping_shared_intermediate_keeps_the_shared_expert_outside(rng: torch.Generator) -> None:
    g = moe_graph([MoEForm()])
    shared_up = next(n for n in g.nodes if n.op == "linear" and n.scope == "layers.0.mlp.shared.0")
    g.outputs = [*g.outputs, shared_up.outputs[0]]
    before = _copy(g)
    report = _fuse(g)
    assert _applied(report, "moe_routed") == ["layers.0.mlp"] and _applied(report, "moe_shared") == []
    (moe,) = [n for n in g.nodes if n.op == "megamoe"]
    assert len(moe.inputs) == 5 and g.op_counts()["linear"] == 2  # the shared expert stays as it was
    inputs = random_inputs(g, rng)
    for x, y in zip(interpret(before, inputs, check_types=True), interpret(g, inputs, check_types=True)):
        assert torch.equal(x, y)


def test_a_router_weight_cast_to_another_dtype_is_not_fused() -> None:
    """The router linear must run in one dtype: a gate cast to f64 under an f32 router is left alone."""
    g = moe_graph([MoEForm()])
    cast = next(n for n in g.nodes if n.op == "cast" and n.inputs[0].name.endswith("gate.weight"))
    text = print_graph(g).replace(f'{cast.outputs[0].name}: f32[8,128] = cast(%layers.0.mlp.gate.weight) '
                                  '{dtype="f32"}', f'{cast.outputs[0].name}: f64[8,128] = cast('
                                  '%layers.0.mlp.gate.weight) {dtype="f64"}')
    g = parse_graph(text)
    assert g.op_counts()["cast"] == 1 and "f64[8,128]" in text
    report = _fuse(g)
    assert "megamoe" not in g.op_counts()
    assert "router weight is cast to the router dtype" in report.explain_text()
