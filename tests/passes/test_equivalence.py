"""Interpreter equivalence: the cpu pipeline keeps outputs and KV-cache contents; RoPE raised where expected."""

from __future__ import annotations

import copy

import pytest
import torch
from passes_helpers import CFG, assert_equivalent, attention_graph, random_inputs

from m3c.frontend.capture import capture_m3, m3_example_inputs
from m3c.ir.interpreter import interpret
from m3c.ir.text import parse_graph, print_graph
from m3c.ir.verifier import record_effect_order
from m3c.model_defs.checkpoint import build_model
from m3c.passes import PassContext, pipeline_for, run_pipeline


def _rope_per_layer(report_records: list) -> dict[str, int]:
    out: dict[str, int] = {}
    for r in report_records:
        if r.status == "applied":
            layer = ".".join(r.scope.split(".")[:2])
            out[layer] = out.get(layer, 0) + 1
    return out


@pytest.mark.parametrize("layers", [(True, False), (False, True, True)])
def test_cpu_pipeline_keeps_the_hand_built_attention_graph(rng: torch.Generator, layers: tuple[bool, ...]) -> None:
    g = attention_graph(layers)
    record_effect_order(g)
    before = parse_graph(print_graph(g))
    report = run_pipeline(g, pipeline_for("cpu"), PassContext(verify_each=True, explain=True))
    assert _rope_per_layer(report.records("rope")) == {f"layers.{i}": 4 if s else 2 for i, s in enumerate(layers)}
    counts = g.op_counts()
    assert counts["rope"] == sum(4 if s else 2 for s in layers)
    assert not {"cat", "slice", "sub", "unsqueeze", "cast", "exp"} & set(counts)
    assert_equivalent(before, g, random_inputs(g, rng))


def _run_model_graph(graph, cap, model, args) -> tuple[torch.Tensor, list]:  # type: ignore[no-untyped-def]
    args = copy.deepcopy(args)
    (logits,) = interpret(graph, cap.bind(model, *args), check_types=True)
    return logits, args[-1]


def _fill_caches(caches: list[dict[str, torch.Tensor]], rng: torch.Generator) -> None:
    """Random valid contents for every cache slot (the example's cached context is otherwise NaN poison)."""
    for layer in caches:
        for t in layer.values():
            if t.dtype == torch.uint8:  # packed E2M1 pairs: every byte is valid
                t.copy_(torch.randint(0, 256, t.shape, generator=rng, dtype=torch.uint8))
            else:
                t.copy_((torch.rand(t.shape, generator=rng) + 0.5).to(t.dtype))


def test_cpu_pipeline_keeps_the_captured_tiny_model(rng: torch.Generator) -> None:
    cfg = CFG
    model = build_model(cfg, seed=int(torch.randint(0, 2**31 - 1, (1,), generator=rng)))
    cap = capture_m3(cfg, model=model)
    before = parse_graph(print_graph(cap.graph))
    report = run_pipeline(cap.graph, pipeline_for("cpu"), PassContext(verify_each=True, explain=True))
    want = {f"layers.{i}": 4 if cfg.is_sparse(i) else 2 for i in range(cfg.num_hidden_layers)}
    assert _rope_per_layer(report.records("rope")) == want, report.explain_text()
    assert "cat" not in cap.graph.op_counts()

    args = m3_example_inputs(cfg)
    args = (torch.randint(0, cfg.vocab_size, args[0].shape, generator=rng), *args[1:])
    _fill_caches(args[-1], rng)
    ref_logits, ref_caches = _run_model_graph(before, cap, model, args)
    logits, caches = _run_model_graph(cap.graph, cap, model, args)
    with torch.no_grad():
        eager = model(*copy.deepcopy(args))
    torch.testing.assert_close(logits, ref_logits)
    torch.testing.assert_close(logits, eager)
    for i, (layer_ref, layer) in enumerate(zip(ref_caches, caches)):
        assert layer_ref.keys() == layer.keys()
        for name, t in layer_ref.items():  # bytes, so NaN-poisoned (unwritten) slots compare too
            assert torch.equal(t.contiguous().view(torch.uint8), layer[name].contiguous().view(torch.uint8)), \
                f"layer {i} cache {name}"
