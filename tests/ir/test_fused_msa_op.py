"""The fused ``msa_attention`` op: its declaration, a reference bit-identical to the three ops it replaces
(nvfp4 and fp8 caches, a prefill then a decode step), the text round trip and clear type errors."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from m3c.ir.graph import Graph, Value
from m3c.ir.interpreter import interpret
from m3c.ir.registry import IRTypeError, get_op
from m3c.ir.text import graphs_equal, parse_graph, print_graph
from m3c.ir.types import TensorType
from m3c.ir.verifier import verify
from m3c.model_defs import quant
from m3c.model_defs.kv_cache import PagedKVCache
from m3c.model_defs.presets import m31_tiny

BS, TOP_K, SCALE = 8, 2, 0.17677669529663687
META = {"positions": "i64[T]", "query_start_loc": "i32[R+1]", "seq_lens": "i32[R]", "block_table": "i32[R,MB]"}
CACHE = {"nvfp4": "nvfp4[NB,8,{h},32]", "fp8": "fp8e4m3[NB,8,{h},32]"}


def _types(kv: str = "nvfp4", index: str = "nvfp4") -> dict[str, str | None]:
    """Operand types by name, in the op's order (None: an absent scale)."""
    return {"q": "f32[T,4,32]", "index_q": "f32[T,2,32]", "index_k_cache": CACHE[index].format(h=1),
            "index_k_scale": "f32[]" if index == "fp8" else None, "k_cache": CACHE[kv].format(h=2),
            "k_scale": "f32[]" if kv == "fp8" else None, "v_cache": CACHE[kv].format(h=2),
            "v_scale": "f32[]" if kv == "fp8" else None, **META}


def _inputs(g: Graph, types: dict[str, str | None]) -> dict[str, Value | None]:
    kinds = {"index_k_cache": "state", "k_cache": "state", "v_cache": "state"}
    return {n: None if t is None else g.add_input(n, TensorType.parse(t), kinds.get(n, "input"))
            for n, t in types.items()}


def fused_graph(types: dict[str, str | None], **attrs: Any) -> Graph:
    """One msa_attention node over graph inputs named like its operands."""
    g = Graph("fused")
    ins = _inputs(g, types)
    g.outputs = g.add("msa_attention", list(ins.values()),
                      {"block_size": BS, "top_k": TOP_K, "scale": SCALE, **attrs}, scope="attn")
    return g


def unfused_graph(types: dict[str, str | None]) -> Graph:
    """The three ops msa_attention replaces, over the same inputs."""
    g = Graph("unfused")
    i = _inputs(g, types)
    meta = [i[n] for n in META]
    (s,) = g.add("indexer_block_scores", [i["index_q"], i["index_k_cache"], i["index_k_scale"], *meta],
                 {"block_size": BS})
    (sel,) = g.add("select_blocks", [s, i["positions"]], {"block_size": BS, "top_k": TOP_K})
    g.outputs = g.add("sparse_attention", [i["q"], i["k_cache"], i["k_scale"], i["v_cache"], i["v_scale"], sel,
                                           *meta], {"block_size": BS, "scale": SCALE})
    return g


def _cache_value(layer: dict[str, torch.Tensor], name: str, fmt: str, rng: torch.Generator) -> dict[str, Any]:
    """Random valid contents for one cached quantity; its runtime value(s) by operand name."""
    data = layer[f"{name}_data"]
    if fmt == "nvfp4":
        q = quant.nvfp4_quantize(torch.randn((*data.shape[:-1], data.shape[-1] * 2), generator=rng))
        data.copy_(q.data)
        layer[f"{name}_scale"].copy_(q.scale)
        return {f"{name}_cache": quant.NVFP4Tensor(data, layer[f"{name}_scale"], None)}
    data.copy_(torch.randn(data.shape, generator=rng).to(data.dtype))
    layer[f"{name}_scale"].copy_(torch.rand((), generator=rng) + 0.5)
    return {f"{name}_cache": data, f"{name}_scale": layer[f"{name}_scale"]}


def _steps(kv: str, index: str, rng: torch.Generator):
    """Interpreter inputs for a prefill and then a decode step of two requests over one random cache."""
    cfg = m31_tiny().replace(num_hidden_layers=1, sparse_layers=(0,), head_dim=32, index_head_dim=32,
                             rotary_dim=16, kv_cache_dtype=kv, indexer_kv_dtype=index)
    cache = PagedKVCache(cfg, num_blocks=int(torch.randint(10, 14, (1,), generator=rng)), max_blocks_per_seq=5)
    layer = cache.layers[0]
    values: dict[str, Any] = {}
    for name, fmt in (("k", kv), ("v", kv), ("index_k", index)):
        values |= _cache_value(layer, name, fmt, rng)
    for r in (0, 1):
        cache.add_request(r)
    draw = lambda lo, hi: int(torch.randint(lo, hi, (1,), generator=rng))  # noqa: E731
    for step in ({0: draw(17, 40), 1: draw(1, 40)}, {0: 1, 1: 1}):
        meta = cache.prepare(step)
        t = int(meta.positions.shape[0])
        yield {**values, **{n: getattr(meta, n) for n in META}, "q": torch.randn(t, 4, 32, generator=rng),
               "index_q": torch.randn(t, 2, 32, generator=rng)}


def test_declaration() -> None:
    op = get_op("msa_attention")
    assert op.operands == ("q", "index_q", "index_k_cache", "index_k_scale?", "k_cache", "k_scale?", "v_cache",
                           "v_scale?", "positions", "query_start_loc", "seq_lens", "block_table")
    assert set(op.attrs) == {"block_size", "top_k", "scale"}
    assert op.reads == ("index_k_cache", "k_cache", "v_cache") and not op.writes
    assert set(op.replaces) == {"indexer_block_scores", "select_blocks", "sparse_attention"}


@pytest.mark.parametrize("kv,index", [("nvfp4", "nvfp4"), ("fp8", "fp8"), ("fp8", "nvfp4")])
def test_reference_is_bit_identical_to_the_three_ops(kv: str, index: str, rng: torch.Generator) -> None:
    types = _types(kv, index)
    fused, unfused = fused_graph(types), unfused_graph(types)
    verify(fused)
    assert fused.outputs[0].type == TensorType.parse("f32[T,4,32]")
    for inputs in _steps(kv, index, rng):
        (want,) = interpret(unfused, dict(inputs), check_types=True)
        (got,) = interpret(fused, dict(inputs), check_types=True)
        assert torch.equal(got, want) and got.abs().sum() > 0


def test_text_round_trip_keeps_absent_scales() -> None:
    for types in (_types(), _types("fp8", "fp8")):
        g = fused_graph(types)
        text = print_graph(g)
        assert "msa_attention(" in text and ("_," in text) == (types["k_scale"] is None)
        again = parse_graph(text)
        verify(again)
        assert graphs_equal(again, g) and print_graph(again) == text


BAD = [
    ({"index_q": "f32[T,64]"}, {}, "index_q must have rank 3"),
    ({"q": "f32[T+1,4,32]"}, {}, "token count"),
    ({"k_cache": "nvfp4[NB,8,2,16]"}, {}, "k_cache .* head dim"),
    ({"index_k_cache": "nvfp4[NB,8,2,32]"}, {}, "index_k_cache .* one head"),
    ({"index_q": "f32[T,1,32]"}, {}, "one index head per KV head"),
    ({"q": "f32[T,3,32]"}, {}, "not a multiple"),
    ({"v_cache": "nvfp4[NB,8,1,32]"}, {}, "differ in heads"),
    ({"k_cache": "fp8e4m3[NB,8,2,32]"}, {}, "fp8e4m3 k_cache needs its scale"),
    ({"index_k_cache": "nvfp4[NB,16,1,32]"}, {}, "blocks of 16, block_size=8"),
    ({"positions": "f32[T]"}, {}, "positions must have an integer dtype"),
    ({"block_table": "i32[R]"}, {}, "block_table must have rank 2"),
    ({}, {"top_k": 0}, "top_k must be a positive int"),
    ({}, {"block_size": "8"}, "block_size must be a positive int"),
    ({}, {"scale": None}, "scale must be a number"),
]


@pytest.mark.parametrize("types,attrs,message", BAD, ids=[b[2] for b in BAD])
def test_bad_operands_are_refused_clearly(types: dict[str, str], attrs: dict[str, Any], message: str) -> None:
    with pytest.raises(IRTypeError, match=f"^msa_attention: .*{message}"):
        fused_graph({**_types(), **types}, **attrs)
