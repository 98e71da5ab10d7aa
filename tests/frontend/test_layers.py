"""Identical-layer recognition and layer stamping (tiny, a 6-layer mix, the 60-layer flash preset on meta)."""

from __future__ import annotations

import time

import pytest
import torch

from m3c.frontend.capture import Capture, capture_m3
from m3c.frontend.layers import StampError, layer_groups, layer_hashes, normalize_name, rename_layer, stamp_layers
from m3c.ir.graph import Graph
from m3c.ir.interpreter import interpret
from m3c.ir.text import graphs_equal, parse_graph
from m3c.ir.types import DType, TensorType, sym
from m3c.ir.verifier import verify
from m3c.model_defs.config import M3Config
from m3c.model_defs.generate import make_cache
from m3c.model_defs.minimax_m3 import MiniMaxM3ForCausalLM
from m3c.model_defs.presets import get_preset


def test_names_normalize_and_rename() -> None:
    assert normalize_name("layers.12.mlp.w13") == "layers.*.mlp.w13"
    assert normalize_name("kv.3.index_k") == "kv.*.index_k"
    assert normalize_name("embed_tokens") == "embed_tokens"
    assert rename_layer("layers.1.self_attn.qkv_proj", 1, 7) == "layers.7.self_attn.qkv_proj"
    assert rename_layer("kv.1.k_scale", 1, 0) == "kv.0.k_scale"
    assert rename_layer("layers.10.norm", 1, 0) == "layers.10.norm"


def test_tiny_layer_groups(tiny_capture: Capture) -> None:
    g = tiny_capture.graph
    assert layer_groups(g) == g.meta["layer_groups"] == [[0, 1], [2]]
    hashes = layer_hashes(g)
    assert hashes[0] == hashes[1] != hashes[2]


def test_stamped_graph_equals_the_full_trace_and_runs(tiny_capture: Capture, tiny_model: MiniMaxM3ForCausalLM,
                                                      tiny_cfg: M3Config, rng: torch.Generator) -> None:
    cfg, model, full = tiny_cfg, tiny_model, tiny_capture
    stamped = capture_m3(cfg, model=model, stamp=True)  # traces [sparse, sparse, dense, dense], stamps [1, 1, 3]
    assert "stamped 3 layers from layers [1, 3]" in stamped.report.stamped and not full.report.stamped
    assert graphs_equal(stamped.graph, full.graph)
    assert [v.name for v in stamped.graph.inputs] == [v.name for v in full.graph.inputs]
    assert stamped.graph.meta == full.graph.meta
    assert {n.scope for n in stamped.graph.nodes} == {n.scope for n in full.graph.nodes}
    verify(stamped.graph)
    assert graphs_equal(parse_graph(str(stamped.graph)), stamped.graph)
    cache = make_cache(cfg, 32, 3)
    for r in range(2):
        cache.add_request(r)
    meta = cache.prepare({0: 6, 1: 2})
    ids = torch.randint(0, cfg.vocab_size, (8,), generator=rng)
    args = (ids, meta.positions, meta.slot_mapping, meta.block_table, meta.query_start_loc, meta.seq_lens)
    twin = [{k: v.clone() for k, v in layer.items()} for layer in cache.layers]
    with torch.no_grad():
        want = model(*args, cache.layers)
    (got,) = interpret(stamped.graph, stamped.bind(model, *args, twin), check_types=True)
    assert torch.equal(got, want)


def test_flash_traces_on_meta_quickly_with_one_group_of_60() -> None:
    cfg = get_preset("m3.1-flash")
    t0 = time.perf_counter()
    cap = capture_m3(cfg, device="meta")
    seconds = time.perf_counter() - t0
    text = str(cap.graph)
    print(f"m3.1-flash: {seconds:.1f} s, {len(cap.graph.nodes)} IR nodes, {len(cap.graph.inputs)} inputs")
    print(cap.report)
    assert seconds < 60
    g = cap.graph
    assert g.meta["layer_groups"] == [list(range(60))]
    assert cap.report.fallbacks == [] and cap.report.stamped
    counts = g.op_counts()
    assert counts["sparse_attention"] == 60 and counts["paged_write"] == 180 and "paged_attention" not in counts
    assert len(g.nodes) > 60 * 100 and len(text.splitlines()) > len(g.nodes)
    types = {v.name: v.type for v in g.inputs}
    assert types["layers.59.mlp.w13"] == TensorType(DType.nvfp4, (256, 2 * 1536, 6144))
    assert types["kv.59.k"].dtype == DType.nvfp4
    verify(g)


def _chain_graph(kinds: list[str]) -> Graph:
    """x -> one node per layer (`mul` by its own weight, or `add` of it) -> neg: a toy decoder stack."""
    g = Graph("toy")
    t = TensorType(DType.f32, (sym("T"), 4))
    x = g.add_input("x", t)
    (h,) = g.add("mul", [x], {"scalar": 2.0}, names=["h"])
    for i, kind in enumerate(kinds):
        w = g.add_input(f"layers.{i}.w", TensorType(DType.f32, (4,)), "param")
        (h,) = g.add(kind, [h, w], scope=f"layers.{i}")
    (out,) = g.add("neg", [h], names=["out"])
    g.outputs = [out]
    return g


def test_stamping_a_toy_stack(rng: torch.Generator) -> None:
    g = _chain_graph(["mul", "mul", "add", "add"])
    assert layer_groups(g) == [[0, 1], [2, 3]]
    new, origin = stamp_layers(g, [1, 3, 1, 1, 3])
    verify(new)
    assert [n.op for n in new.nodes] == ["mul", "mul", "add", "mul", "mul", "add", "neg"]
    assert origin["layers.4.w"] == ("layers.3.w", 3, 4)
    assert [v.name for v in new.inputs] == ["x", *(f"layers.{i}.w" for i in range(5))]
    assert layer_groups(new) == [[0, 2, 3], [1, 4]]
    x = torch.randn(3, 4, generator=rng)
    ws = [torch.randn(4, generator=rng) for _ in range(5)]
    (got,) = interpret(new, {"x": x, **{f"layers.{i}.w": w for i, w in enumerate(ws)}})
    h = x * 2
    for i, w in enumerate(ws):
        h = h + w if i in (1, 4) else h * w
    assert torch.equal(got, -h)


def test_stamping_refuses_what_it_cannot_copy(tiny_capture: Capture) -> None:
    with pytest.raises(StampError, match="no decoder layers"):
        stamp_layers(Graph(), [0])
    with pytest.raises(StampError, match="names layers"):
        stamp_layers(tiny_capture.graph, [0, 7])
    with pytest.raises(StampError, match="identical twin"):
        stamp_layers(_chain_graph(["mul", "add"]), [1, 1])
