"""The QKV + norm + RoPE + KV-insert fusion: match count, originals gone, interpreter and KV-cache equivalence."""

from __future__ import annotations

import copy

import pytest
import torch

from m3c.frontend.capture import capture_m3, m3_example_inputs
from m3c.ir.interpreter import interpret
from m3c.ir.text import parse_graph, print_graph
from m3c.model_defs.checkpoint import build_model
from m3c.model_defs.presets import get_preset
from m3c.passes import PassContext, pipeline_for, run_pipeline
from m3c.passes.fuse_qkv import PASS_NAME


def _fill(caches: list[dict[str, torch.Tensor]], gen: torch.Generator) -> None:
    """Random valid bytes in every cache slot, so reads of earlier context see real values."""
    for layer in caches:
        for t in layer.values():
            if t.dtype == torch.uint8:
                t.copy_(torch.randint(0, 256, t.shape, generator=gen, dtype=torch.uint8))
            else:
                t.copy_((torch.rand(t.shape, generator=gen) + 0.5).to(t.dtype))


def _attention_ops(graph) -> set[str]:
    return {n.op for n in graph.nodes if n.scope.endswith("self_attn")}


def _run_before_and_after(before, cap, model, cfg, rng: torch.Generator):
    """Interpret the unfused and fused graphs on the same fresh inputs and filled caches.

    Returns (logits before, logits after, caches before, caches after).
    """
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=rng)))
    args = list(m3_example_inputs(cfg))
    args[0] = torch.randint(0, cfg.vocab_size, args[0].shape, generator=gen)
    _fill(args[-1], gen)
    a_before, a_after = copy.deepcopy(args), copy.deepcopy(args)
    (ref,) = interpret(before, cap.bind(model, *a_before), check_types=True)
    (out,) = interpret(cap.graph, cap.bind(model, *a_after), check_types=True)
    return ref, out, a_before[-1], a_after[-1]


def _assert_same_bytes(caches_a, caches_b) -> None:
    for i, (la, lb) in enumerate(zip(caches_a, caches_b)):
        for name in la:  # byte-equal caches: same K/V/index-K codes and scales, same untouched slots
            assert torch.equal(la[name].view(torch.uint8), lb[name].view(torch.uint8)), f"layer {i} {name}"


def test_fusion_matches_once_per_layer_and_keeps_results(rng: torch.Generator) -> None:
    cfg = get_preset("m3.1-tiny")
    model = build_model(cfg, seed=int(torch.randint(0, 2**31 - 1, (1,), generator=rng)))
    cap = capture_m3(cfg, model=model)
    before = parse_graph(print_graph(cap.graph))
    report = run_pipeline(cap.graph, pipeline_for("hopper"), PassContext(verify_each=True, explain=True))
    applied = [r for r in report.records() if r.status == "applied" and r.rewrite.startswith("qkv_")]
    assert sorted(r.scope for r in applied) == [f"layers.{i}.self_attn" for i in range(cfg.num_hidden_layers)]
    counts = cap.graph.op_counts()
    assert counts["qkv_norm_rope_kvinsert"] == cfg.num_hidden_layers
    # the chain's ops are gone from every attention block: no separate writes, quantizes, ropes, splits
    assert not {"paged_write", "quantize", "rope", "split"} & _attention_ops(cap.graph)
    assert "paged_write" not in counts and "rope" not in counts and "quantize" not in counts
    ref, out, caches_before, caches_after = _run_before_and_after(before, cap, model, cfg, rng)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    _assert_same_bytes(caches_before, caches_after)


def test_fusion_explains_a_miss_when_the_cache_is_not_nvfp4() -> None:
    cfg = get_preset("m3.1-tiny").replace(kv_cache_dtype="bf16")
    cap = capture_m3(cfg, device="meta")
    report = run_pipeline(cap.graph, pipeline_for("hopper"), PassContext(explain=True))
    assert "qkv_norm_rope_kvinsert" not in cap.graph.op_counts()
    text = report.explain_text()
    assert PASS_NAME in text and "no match" in text


@pytest.mark.slow
def test_fusion_on_the_full_preset_matches_every_layer() -> None:
    cfg = get_preset("m3.1-flash")
    cap = capture_m3(cfg, device="meta")
    run_pipeline(cap.graph, pipeline_for("hopper"), PassContext())
    assert cap.graph.op_counts()["qkv_norm_rope_kvinsert"] == 60


@pytest.mark.parametrize("dtype,proj", [(torch.bfloat16, "mxfp8"), (torch.float32, "bf16")])
def test_fusion_matches_bf16_models_and_bf16_weights(dtype: torch.dtype, proj: str, rng: torch.Generator) -> None:
    """A bf16 model (no norm-weight casts, a cast after dequantize) and bf16 projection weights fuse too."""
    cfg = get_preset("m3.1-tiny").replace(proj_dtype=proj)
    model = build_model(cfg, seed=int(torch.randint(0, 2**31 - 1, (1,), generator=rng)), dtype=dtype)
    cap = capture_m3(cfg, model=model)
    before = parse_graph(print_graph(cap.graph))
    run_pipeline(cap.graph, pipeline_for("hopper"), PassContext(verify_each=True))
    assert cap.graph.op_counts()["qkv_norm_rope_kvinsert"] == cfg.num_hidden_layers
    ref, out, caches_before, caches_after = _run_before_and_after(before, cap, model, cfg, rng)
    assert torch.equal(out, ref)  # the fused op's reference is the same composition, op for op
    _assert_same_bytes(caches_before, caches_after)
