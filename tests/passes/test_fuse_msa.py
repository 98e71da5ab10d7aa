"""The MSA fusion (indexer scores + block selection + sparse attention → msa_attention): match counts,
originals gone, dense layers untouched, bit-identical interpreter results over prefill then decode,
refusals that leave the graph alone, verifier and text round trip."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from passes_helpers import attention_graph, random_inputs, run_both

from m3c.frontend.capture import Capture, capture_m3
from m3c.ir.graph import Graph
from m3c.ir.interpreter import interpret
from m3c.ir.text import graphs_equal, parse_graph, print_graph
from m3c.ir.verifier import verify
from m3c.model_defs.checkpoint import build_model
from m3c.model_defs.kv_cache import PagedKVCache
from m3c.model_defs.presets import get_preset
from m3c.passes import PassContext, PipelineReport, pipeline_for, run_pipeline
from m3c.passes.fuse_msa import PASS_NAME, fuse_msa_pass
from m3c.passes.fuse_qkv import fuse_qkv_pass
from m3c.passes.manager import Pipeline
from m3c.passes.pipelines import simplify

MSA_CHAIN = {"indexer_block_scores", "select_blocks", "sparse_attention"}


def _seed(rng: torch.Generator) -> int:
    return int(torch.randint(0, 2**31 - 1, (1,), generator=rng))


def _fuse(graph: Graph) -> PipelineReport:
    """Only the MSA pass, verified before and after, with explain records."""
    return run_pipeline(graph, Pipeline("msa", [fuse_msa_pass()]), PassContext(verify_each=True, explain=True))


def _fill(cache: PagedKVCache, gen: torch.Generator) -> None:
    """Random valid bytes in every cache slot (so unwritten context is not all zeros)."""
    for layer in cache.layers:
        for t in layer.values():
            if t.dtype == torch.uint8:
                t.copy_(torch.randint(0, 256, t.shape, generator=gen, dtype=torch.uint8))
            else:
                t.copy_((torch.rand(t.shape, generator=gen) + 0.5).to(t.dtype))


def _prefill_then_decode(before: Graph, after: Graph, cap: Capture, model: Any, cfg: Any,
                         rng: torch.Generator) -> None:
    """Interpret both graphs over a prefill and a decode step, each on its own copy of one cache:
    logits and every cache byte must be identical after each step."""
    cache = PagedKVCache(cfg, num_blocks=12, max_blocks_per_seq=6)
    _fill(cache, rng)
    for r in (0, 1):
        cache.add_request(r)
    caches = [cache.layers, copy.deepcopy(cache.layers)]
    prompt = {0: int(torch.randint(17, 30, (1,), generator=rng)), 1: int(torch.randint(9, 30, (1,), generator=rng))}
    for step in (prompt, {0: 1, 1: 1}):  # more blocks than top_k, so the selection really drops some
        meta = cache.prepare(step)
        ids = torch.randint(0, cfg.vocab_size, meta.positions.shape, generator=rng)
        args = (ids, meta.positions, meta.slot_mapping, meta.block_table, meta.query_start_loc, meta.seq_lens)
        (ref,) = interpret(before, cap.bind(model, *args, caches[0]), check_types=True)
        (out,) = interpret(after, cap.bind(model, *args, caches[1]), check_types=True)
        assert torch.equal(out, ref), f"logits differ after {step}"
        for i, (la, lb) in enumerate(zip(*caches)):
            for name in la:
                a, b = la[name].reshape(-1), lb[name].reshape(-1)  # fp8 scales are 0-d
                assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), f"layer {i} {name}"


def _fused_capture(cfg: Any, rng: torch.Generator, dtype: torch.dtype) -> tuple[Capture, Any, Graph, PipelineReport]:
    """Capture a real model, run the hopper fusions before MSA, snapshot, then fuse MSA."""
    model = build_model(cfg, seed=_seed(rng), dtype=dtype)
    cap = capture_m3(cfg, model=model)
    run_pipeline(cap.graph, Pipeline("pre", [*simplify(), fuse_qkv_pass()]), PassContext())
    before = parse_graph(print_graph(cap.graph))
    return cap, model, before, _fuse(cap.graph)


def test_fusion_replaces_every_sparse_layer_and_keeps_results(rng: torch.Generator) -> None:
    cfg = get_preset("m3.1-tiny")
    cap, model, before, report = _fused_capture(cfg, rng, torch.float32)
    applied = [r for r in report.records() if r.status == "applied"]
    assert sorted(r.scope for r in applied) == [f"layers.{i}.self_attn" for i in cfg.sparse_layers]
    assert {r.rewrite for r in applied} == {"msa"}
    counts = cap.graph.op_counts()
    assert counts["msa_attention"] == len(cfg.sparse_layers) == 2
    assert not MSA_CHAIN & set(counts)
    dense = [n for n in cap.graph.nodes if n.op == "paged_attention"]
    assert [n.scope for n in dense] == [f"layers.{i}.self_attn" for i in range(cfg.num_hidden_layers)
                                        if i not in cfg.sparse_layers]
    old = next(n for n in before.nodes if n.op == "sparse_attention")
    new = next(n for n in cap.graph.nodes if n.op == "msa_attention")
    assert new.attrs == {"block_size": cfg.msa_block_size, "top_k": cfg.msa_topk_blocks, "scale": old.attrs["scale"]}
    _prefill_then_decode(before, cap.graph, cap, model, cfg, rng)


def test_fusion_with_fp8_caches_in_a_bf16_model(rng: torch.Generator) -> None:
    """A bf16 model with fp8 K/V and index caches: the scale operands are carried over, results identical."""
    cfg = get_preset("m3.1-tiny").replace(kv_cache_dtype="fp8", indexer_kv_dtype="fp8")
    cap, model, before, report = _fused_capture(cfg, rng, torch.bfloat16)
    assert report.applied("msa_indexscale_kvscale") == len(cfg.sparse_layers)
    fused = [n for n in cap.graph.nodes if n.op == "msa_attention"]
    assert len(fused) == 2 and all(v is not None for n in fused for v in n.inputs)
    assert all(n.outputs[0].type.dtype.value == "bf16" for n in fused)
    _prefill_then_decode(before, cap.graph, cap, model, cfg, rng)


def test_hopper_pipeline_fuses_msa_after_qkv_on_the_small_preset() -> None:
    cfg = get_preset("m3.1-small")
    cap = capture_m3(cfg, device="meta")
    names = [p.name for p in pipeline_for("hopper").passes]
    assert names.index("fuse_qkv_norm_rope_kvinsert") < names.index(PASS_NAME) < names.index("cse", 3)
    report = run_pipeline(cap.graph, pipeline_for("hopper"), PassContext(verify_each=True))
    counts = cap.graph.op_counts()
    assert len(cfg.sparse_layers) == 2 == counts["msa_attention"] == report.applied("msa")
    assert not MSA_CHAIN & set(counts)
    assert counts.get("paged_attention", 0) == cfg.num_hidden_layers - 2


@pytest.mark.slow
def test_fusion_on_the_full_preset_matches_every_sparse_layer() -> None:
    cfg = get_preset("m3.1-flash")
    cap = capture_m3(cfg, device="meta")
    report = run_pipeline(cap.graph, Pipeline("msa", [fuse_msa_pass()]), PassContext())
    counts = cap.graph.op_counts()
    assert len(cfg.sparse_layers) == 60 == counts["msa_attention"] == report.applied("msa")
    assert not MSA_CHAIN & set(counts)
    verify(cap.graph)


# ---- hand-built graphs: fast checks of the match conditions ----------------------------------
def test_hand_built_graph_fuses_the_sparse_layer_only(rng: torch.Generator) -> None:
    g = attention_graph((True, False))
    before = parse_graph(print_graph(g))
    report = _fuse(g)
    assert report.applied("msa") == 1
    counts = g.op_counts()
    assert counts["msa_attention"] == 1 and counts["paged_attention"] == 1 and not MSA_CHAIN & set(counts)
    verify(g)
    text = print_graph(g)
    assert "msa_attention(" in text
    again = parse_graph(text)
    assert graphs_equal(again, g) and print_graph(again) == text
    ob, oa, sb, sa = run_both(before, again, random_inputs(g, rng))
    assert all(torch.equal(x, y) for x, y in zip(ob, oa))
    assert all(torch.equal(sb[k], sa[k]) for k in sb)


def _msa_nodes(g: Graph) -> dict[str, Any]:
    return {n.op: n for n in g.nodes if n.op in MSA_CHAIN}


@pytest.mark.parametrize("extra_user", ["indexer_block_scores", "select_blocks"])
def test_a_second_user_of_an_intermediate_blocks_the_match(extra_user: str) -> None:
    g = attention_graph((True,))
    inter = _msa_nodes(g)[extra_user].outputs[0]
    g.outputs = [*g.outputs, g.add("neg" if inter.type.dtype.is_float else "mul", [inter],
                                   None if inter.type.dtype.is_float else {"scalar": 2})[0]]
    text = print_graph(g)
    report = _fuse(g)
    assert print_graph(g) == text
    (refused,) = [r for r in report.records() if r.status == "refused"]
    assert refused.rewrite == "msa" and f"%{inter.name}" in refused.reason and "also used by" in refused.reason


@pytest.mark.parametrize("op", ["select_blocks", "sparse_attention"])
def test_mismatched_block_size_leaves_the_graph_alone(op: str) -> None:
    g = attention_graph((True,))
    _msa_nodes(g)[op].attrs["block_size"] = 16
    text = print_graph(g)
    report = _fuse(g)
    assert print_graph(g) == text and "msa_attention" not in g.op_counts()
    assert "block_size" in report.explain_text()


def test_a_chain_the_fused_op_rejects_is_declined_not_failed() -> None:
    """All three ops agree on block_size 16, but the caches hold blocks of 8: no fusion, no error."""
    g = attention_graph((True,))
    for node in _msa_nodes(g).values():
        node.attrs["block_size"] = 16
    text = print_graph(g)
    report = _fuse(g)
    assert print_graph(g) == text
    assert "msa_attention accepts the operands" in report.explain_text()


@pytest.mark.parametrize("meta", ["positions", "query_start_loc", "seq_lens", "block_table"])
def test_different_batch_metadata_leaves_the_graph_alone(meta: str) -> None:
    g = attention_graph((True,))
    orig = next(v for v in g.inputs if v.name == meta)
    other = g.add_input(f"{meta}_2", orig.type)
    node = _msa_nodes(g)["sparse_attention"]
    node.inputs = [other if v is orig else v for v in node.inputs]
    text = print_graph(g)
    _fuse(g)
    assert print_graph(g) == text and "msa_attention" not in g.op_counts()
