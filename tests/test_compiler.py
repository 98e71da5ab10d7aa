"""The compile driver: compile_preset on the tiny preset (zero fallbacks, cache hits, byte-identical
artifacts, cache formats), and m3c.compile on model objects."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import m3c
from m3c.backends import CompileOptions
from m3c.compiler import CompiledModel, compile_preset
from m3c.errors import CompileError, ConfigError, TargetError
from m3c.model_defs.checkpoint import build_model
from m3c.model_defs.generate import make_cache
from m3c.model_defs.presets import get_preset
from m3c.runtime.artifact import save_artifact
from m3c.runtime.compile_cache import CompileCache, cache_key, model_key
from m3c.runtime.executor import Executor

ONE_LAYER = get_preset("m3.1-tiny").replace(name="tiny-1layer", num_hidden_layers=1, sparse_layers=(0,))


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A compile cache of this module's own, so the first tiny compile here is a real capture (a miss)."""
    return tmp_path_factory.mktemp("m3c-cache-compiler")


@pytest.fixture(scope="module")
def tiny(cache_dir: Path):
    """(program, cfg, report) of the tiny preset, compiled through the cache."""
    return compile_preset("m3.1-tiny", cache=CompileCache(cache_dir))


def _step_args(cfg, tokens: int, seed: int):
    """A one-request prefill of `tokens` random tokens on a fresh cache: (args..., cache)."""
    cache = make_cache(cfg, tokens + 8, 1)
    cache.add_request(0)
    meta = cache.prepare({0: tokens})
    ids = torch.randint(0, cfg.vocab_size, (tokens,), generator=torch.Generator().manual_seed(seed))
    return (ids, meta.positions, meta.slot_mapping, meta.block_table, meta.query_start_loc, meta.seq_lens), cache


def test_tiny_compiles_with_zero_fallbacks(tiny) -> None:
    program, cfg, report = tiny
    assert report.fallback_ops == [] and report.capture_report.fallback_count == 0
    assert not program.graph.find("fallback")
    assert report.nodes_compiled <= report.nodes_captured
    assert report.op_counts["sparse_attention"] == len(cfg.sparse_layers)
    assert report.op_counts["paged_attention"] == cfg.num_hidden_layers - len(cfg.sparse_layers)
    assert {"capture", "passes", "lower", "save"} <= set(report.stage_seconds)
    assert [p.name for p in report.pipeline.passes] and all(p.seconds is not None for p in report.pipeline.passes)
    text = report.text()
    assert "fallback   none" in text and "cache miss" in text and "canonicalize" in text


def test_second_compile_is_a_cache_hit_and_runs_the_same(tiny, cache_dir: Path, rng: torch.Generator) -> None:
    program, cfg, _ = tiny
    cache = CompileCache(cache_dir)
    again, _, report = compile_preset("m3.1-tiny", cache=cache)
    assert report.cache == "hit" and cache.hits == 1 and report.compile_seconds < 5
    assert "capture" not in report.stage_seconds  # the pre-capture key answered
    args, kv1 = _step_args(cfg, 20, int(torch.randint(0, 1000, (1,), generator=rng)))
    _, kv2 = _step_args(cfg, 20, 0)
    assert torch.equal(Executor(program)(*args, kv1.layers), Executor(again)(*args, kv2.layers))
    opts = CompileOptions()
    assert model_key(cfg, opts, "random:seed=1") != model_key(cfg, opts, "random:seed=0")  # other weights, other entry
    assert model_key(cfg, CompileOptions(kv_cache_dtype="fp8"), "w") != model_key(cfg, opts, "w")
    assert cache_key(cfg, program.graph, opts, "a") != cache_key(cfg, program.graph, opts, "b")


def test_same_inputs_give_byte_identical_artifacts(tmp_path: Path) -> None:
    first, cfg, _ = compile_preset(ONE_LAYER, cache=False)
    second, _, _ = compile_preset(ONE_LAYER, cache=False)
    a = save_artifact(first, cfg, tmp_path / "a.m3c", {"config": cfg.name})
    b = save_artifact(second, cfg, tmp_path / "b.m3c", {"config": cfg.name})
    assert a.read_bytes() == b.read_bytes()


def test_cache_formats_fp8_and_bf16_match_the_reference() -> None:
    """--kv-cache-dtype fp8 with a bf16 indexer cache: executor logits and cache bytes equal the reference's."""
    opts = CompileOptions(kv_cache_dtype="fp8", indexer_kv_dtype="bf16")
    program, cfg, report = compile_preset(ONE_LAYER, options=opts, cache=False)
    assert (cfg.quant.kv_cache_dtype, cfg.quant.indexer_kv_dtype) == ("fp8", "bf16") and not report.fallback_ops
    states = {v.name: str(v.type.dtype.value) for v in program.graph.inputs if v.kind == "state"}
    assert states["kv.0.k"] == "fp8e4m3" and states["kv.0.index_k"] == "bf16"
    model = build_model(cfg, seed=0)
    args, ref_cache = _step_args(cfg, 19, 5)
    _, our_cache = _step_args(cfg, 19, 5)
    with torch.no_grad():
        want = model(*args, ref_cache.layers)
    got = Executor(program)(*args, our_cache.layers)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    for name, t in ref_cache.layers[0].items():
        assert torch.equal(t.reshape(-1).view(torch.uint8), our_cache.layers[0][name].reshape(-1).view(torch.uint8)), name


def test_m3c_compile_of_a_model_object() -> None:
    model = build_model(ONE_LAYER, seed=3)
    compiled = m3c.compile(model)
    assert isinstance(compiled, CompiledModel) and not compiled.report.fallback_ops
    args, c1 = _step_args(ONE_LAYER, 11, 2)
    _, c2 = _step_args(ONE_LAYER, 11, 2)
    with torch.no_grad():
        want = model(*args, c1.layers)
    torch.testing.assert_close(compiled(*args, c2.layers), want, rtol=1e-4, atol=1e-4)


class _Toy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.silu(self.proj(x)) * 2.0


def test_m3c_compile_of_any_module(rng: torch.Generator) -> None:
    toy = _Toy()
    compiled = m3c.compile(toy, (torch.randn(3, 16),))
    x = torch.randn(3, 16, generator=rng)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), toy(x))
    assert compiled.graph.find("linear")


def test_package_front_doors() -> None:
    assert m3c.__version__ and m3c.compile is m3c.compiler.compile and m3c.Executor is Executor
    with pytest.raises(AttributeError):
        m3c.no_such_thing  # noqa: B018


def test_bad_requests_are_refused_early() -> None:
    with pytest.raises(TargetError, match="unknown target 'h200'"):
        compile_preset("m3.1-tiny", target="h200", cache=False)
    with pytest.raises(TargetError, match="no code generator"):
        compile_preset("m3.1-tiny", target="rubin", cache=False)
    with pytest.raises(CompileError, match="--block-size 8"):
        compile_preset("m3.1-tiny", options=CompileOptions(block_size=128), cache=False)
    with pytest.raises(CompileError, match=r"no such pass; its passes are \['canonicalize'"):
        compile_preset(ONE_LAYER, dump_ir_after=["fuse_everything"], cache=False)
    with pytest.raises(CompileError, match="no pass"):
        compile_preset(ONE_LAYER, options=CompileOptions(disable_passes=("fuse_everything",)), cache=False)
    with pytest.raises(CompileError, match="example_inputs"):
        m3c.compile(_Toy())
    with pytest.raises(CompileError, match="known options"):
        m3c.compile(_Toy(), (torch.randn(1, 16),), flavour="spicy")
    with pytest.raises(CompileError, match="moe_prefill_precision='fp4': expected one of bf16, fp8"):
        CompileOptions(moe_prefill_precision="fp4")
    with pytest.raises(ConfigError, match="model dtype 'float64': use one of float32, bfloat16"):
        compile_preset("m3.1-tiny", dtype="float64", cache=False)
    with pytest.raises(ConfigError, match=r"model dtype torch\.float16"):
        compile_preset("m3.1-tiny", dtype=torch.float16, cache=False)
