"""Capture of the reference model: inputs, op counts, zero fallbacks, interpreter equivalence, errors."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.export import Dim

from m3c.frontend.aten_table import CaptureError
from m3c.frontend.capture import Capture, capture, capture_m3
from m3c.ir.interpreter import interpret
from m3c.ir.types import DType, TensorType, sym
from m3c.ir.verifier import verify
from m3c.model_defs import quant
from m3c.model_defs.checkpoint import build_model
from m3c.model_defs.config import M3Config
from m3c.model_defs.generate import make_cache
from m3c.model_defs.layers import QuantLinear
from m3c.model_defs.minimax_m3 import MiniMaxM3ForCausalLM
from m3c.model_defs.presets import get_preset

T, R, MB, NB = sym("T"), sym("R"), sym("MB"), sym("NB")


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def run_steps(cap: Capture, model: MiniMaxM3ForCausalLM, cfg: M3Config, steps: list[dict[int, int]],
              num_blocks_per_seq: int, gen: torch.Generator) -> None:
    """Run each step eagerly and in the interpreter on twin caches; logits and cache bytes must be equal."""
    reqs = sorted(steps[0])
    cache = make_cache(cfg, num_blocks_per_seq * cfg.msa_block_size, len(reqs) + 1)
    for r in reqs:
        cache.add_request(r)
    twin = copy.deepcopy(cache.layers)
    for step in steps:
        meta = cache.prepare(step)
        ids = torch.randint(0, cfg.vocab_size, meta.positions.shape, generator=gen)
        args = (ids, meta.positions, meta.slot_mapping, meta.block_table, meta.query_start_loc, meta.seq_lens)
        with torch.no_grad():
            want = model(*args, cache.layers)
        (got,) = interpret(cap.graph, cap.bind(model, *args, twin), check_types=True)
        assert got.shape == want.shape
        assert torch.equal(got, want), (got - want).abs().max()
        for i, (a, b) in enumerate(zip(cache.layers, twin)):
            for name in a:
                assert torch.equal(_bytes(a[name]), _bytes(b[name])), f"layer {i} cache {name} differs"


# ---- the tiny preset ---------------------------------------------------------------------------------
def test_tiny_capture_has_no_fallbacks_and_the_expected_ops(tiny_capture: Capture, tiny_cfg: M3Config) -> None:
    g, cfg = tiny_capture.graph, tiny_cfg
    assert tiny_capture.report.fallbacks == [] and "fallback" not in g.op_counts()
    verify(g)
    counts = g.op_counts()
    n, sparse = cfg.num_hidden_layers, len(cfg.sparse_layers)
    cached = 2 * n + sparse  # k, v per layer, index_k per sparse layer
    assert counts["paged_write"] == cached
    assert counts["quantize"] == cached  # every cache is nvfp4: one quantize per write
    assert counts["sparse_attention"] == counts["indexer_block_scores"] == counts["select_blocks"] == sparse
    assert counts["paged_attention"] == n - sparse
    assert counts["grouped_gemm"] == 2 * n and counts["topk"] == n
    assert counts["dequantize"] == 4 * n  # qkv, o, shared gate/up, shared down (mxfp8)
    assert counts["embedding"] == 1 and counts["rms_norm"] == n * 2 + 1 + sum(4 if cfg.is_sparse(i) else 2
                                                                              for i in range(n))
    assert not {"getitem", "auto_functionalized_v2", "sym_size", "_assert_tensor_metadata"} & set(counts)
    for i in range(n):
        scopes = {node.scope for node in g.find("paged_write") if node.inputs[2].name.startswith(f"kv.{i}.")}
        assert scopes == {f"layers.{i}.self_attn"}
    assert g.meta["layer_groups"] == [[0, 1], [2]]
    assert set(g.meta["effect_order"].values()) == {"wr"}


def test_tiny_capture_inputs(tiny_capture: Capture, tiny_cfg: M3Config) -> None:
    types = {v.name: (v.type, v.kind) for v in tiny_capture.graph.inputs}
    assert types["input_ids"] == (TensorType(DType.i64, (T,)), "input")
    assert types["block_table"] == (TensorType(DType.i32, (R, MB)), "input")
    assert types["query_start_loc"] == (TensorType(DType.i32, (R + 1,)), "input")
    cfg, bs = tiny_cfg, tiny_cfg.msa_block_size
    assert types["kv.0.k"] == (TensorType(DType.nvfp4, (NB, bs, cfg.num_key_value_heads, cfg.head_dim)), "state")
    assert types["kv.1.index_k"] == (TensorType(DType.nvfp4, (NB, bs, 1, cfg.index_head_dim)), "state")
    assert "kv.2.index_k" not in types
    qkv = sum(cfg.qkv_split_sizes(0))
    assert types["layers.0.self_attn.qkv_proj"] == (TensorType(DType.mxfp8, (qkv, cfg.hidden_size)), "param")
    e, inter = cfg.n_routed_experts, cfg.moe_intermediate_size
    assert types["layers.2.mlp.w13"] == (TensorType(DType.nvfp4, (e, 2 * inter, cfg.hidden_size)), "param")
    assert types["layers.0.input_layernorm"] == (TensorType(DType.bf16, (cfg.hidden_size,)), "param")
    assert not any(name.endswith(("weight_scale", "weight_scale_2", "_data", "_scale")) for name in types)


@pytest.mark.parametrize("steps", [
    [{0: 5, 1: 3}, {0: 1, 1: 1}],        # prefill two requests, then decode both (R=2)
    [{0: 1}, {0: 9}, {0: 1}],             # one request: decode-sized, a chunk crossing blocks, decode (R=1)
    [{0: 2, 1: 11, 2: 1}, {0: 3, 1: 1, 2: 2}],  # three requests of mixed sizes (R=3)
])
def test_tiny_interpreter_matches_eager(tiny_capture: Capture, tiny_model: MiniMaxM3ForCausalLM, tiny_cfg: M3Config,
                                        steps: list[dict[int, int]], rng: torch.Generator) -> None:
    run_steps(tiny_capture, tiny_model, tiny_cfg, steps, num_blocks_per_seq=4, gen=rng)


@pytest.mark.parametrize("quant_fields", [
    {"kv_cache_dtype": "fp8", "indexer_kv_dtype": "bf16", "routed_expert_dtype": "mxfp8", "proj_dtype": "bf16"},
    {"kv_cache_dtype": "bf16", "indexer_kv_dtype": "fp8", "routed_expert_dtype": "bf16", "proj_dtype": "mxfp8"},
])
def test_other_formats_capture_and_match(quant_fields: dict[str, str], rng: torch.Generator) -> None:
    cfg = get_preset("m3.1-tiny").replace(**quant_fields)
    model = build_model(cfg, seed=int(torch.randint(0, 2**31 - 1, (1,), generator=rng)))
    cap = capture_m3(cfg, model=model)
    assert cap.report.fallbacks == []
    verify(cap.graph)
    types = {v.name: v.type for v in cap.graph.inputs if v.kind == "state"}
    for name, fmt in (("k", cfg.quant.kv_cache_dtype), ("index_k", cfg.quant.indexer_kv_dtype)):
        want = {"fp8": DType.fp8e4m3, "bf16": DType.bf16}[fmt]
        assert types[f"kv.0.{name}"].dtype == want
        assert (f"kv.0.{name}_scale" in types) == (fmt == "fp8")
    n_fp8 = sum(1 for i in range(cfg.num_hidden_layers) for q in ("k", "v", "index_k")
                if f"kv.{i}.{q}_scale" in types)
    assert cap.graph.op_counts().get("quantize", 0) == n_fp8
    run_steps(cap, model, cfg, [{0: 6, 1: 2}, {0: 1, 1: 1}], num_blocks_per_seq=3, gen=rng)


def test_small_preset_captures_on_meta_without_fallbacks() -> None:
    """(m3.1-tiny: above; m3.1-flash: tests/frontend/test_layers.py.)"""
    cap = capture_m3(get_preset("m3.1-small"), device="meta")
    assert cap.report.fallbacks == [] and "fallback" not in cap.graph.op_counts()
    assert "fallbacks: none" in str(cap.report) and not cap.report.stamped
    assert cap.graph.meta["layer_groups"] == [[0, 1]]
    verify(cap.graph)


# ---- any module ------------------------------------------------------------------------------------
def _nvfp4_linear(out_f: int, in_f: int) -> QuantLinear:
    lin = QuantLinear(in_f, out_f, "nvfp4")
    w = torch.randn(out_f, in_f)
    gs = quant.nvfp4_global_scale(w)
    q = quant.nvfp4_quantize(w, gs)
    lin.weight.copy_(q.data)
    lin.weight_scale.copy_(q.scale)
    lin.weight_scale_2.copy_(gs.reshape(()))
    return lin


class _Toy(nn.Module):
    """An nvfp4 linear, a parameter, ops the table lacks (cumsum, flip) and an int true division (typed f32)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = _nvfp4_linear(32, 64)
        self.w = nn.Parameter(torch.randn(32))

    def forward(self, x: torch.Tensor, idx: torch.Tensor) -> tuple[torch.Tensor, ...]:
        y = torch.cumsum(self.lin(x) * self.w, dim=1)
        return y.reshape(-1, 16) + 1.0, idx / 2, torch.flip(y, [0]).to(torch.float64)


def test_unknown_ops_become_listed_fallbacks_that_run(rng: torch.Generator) -> None:
    model = _Toy()
    cap = capture(model, (torch.randn(5, 64), torch.arange(6)), dynamic_shapes=({0: Dim("T")}, {0: Dim("N")}))
    uses = {f.target: f for f in cap.report.fallbacks}
    assert set(uses) == {"aten.cumsum.default", "aten.flip.default"}
    assert all(f.count == 1 for f in uses.values())
    assert cap.graph.op_counts()["fallback"] == 2 and cap.report.fallback_count == 2
    (div,) = cap.graph.find("div")  # int / int is true division: the IR types it f32 like torch
    assert div.outputs[0].type.dtype == DType.f32
    assert "fallback aten.cumsum.default x1" in str(cap.report)
    verify(cap.graph)
    lin = {v.name: v for v in cap.graph.inputs}["lin"]
    assert lin.type == TensorType(DType.nvfp4, (32, 64)) and lin.kind == "param"
    assert cap.graph.find("dequantize")[0].inputs == [lin]
    x, idx = torch.randn(9, 64, generator=rng), torch.arange(4)
    bound = cap.bind(model, x, idx)
    assert isinstance(bound["lin"], quant.NVFP4Tensor) and bound["lin"].global_scale is model.lin.weight_scale_2
    got = interpret(cap.graph, bound, check_types=True)
    for a, b in zip(got, model(x, idx)):
        assert torch.equal(a, b)


class _PeekScale(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = _nvfp4_linear(16, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.lin.weight_scale_2


class _AddInPlace(nn.Module):
    def forward(self, x: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
        state.add_(1.0)
        return x * 2


class _WriteView(nn.Module):
    def forward(self, x: torch.Tensor, slots: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
        torch.ops.m3c.paged_write(x, slots, cache[1:])
        return x + 1


@pytest.mark.parametrize(("module", "args", "match"), [
    (_PeekScale, (torch.randn(3, 32),), "keeps quantized weights whole"),
    (_AddInPlace, (torch.randn(3), torch.zeros(3)), "in place"),
    (_WriteView, (torch.randn(4, 2, 8), torch.arange(4), torch.zeros(6, 4, 2, 8)), "view of a cache"),
])
def test_unsupported_programs_raise_capture_errors(module: type[nn.Module], args: tuple[torch.Tensor, ...],
                                                   match: str) -> None:
    with pytest.raises(CaptureError, match=match):
        capture(module(), args)
