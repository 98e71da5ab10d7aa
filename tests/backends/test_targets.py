"""Targets are data in a registry; options are frozen and hash stably; lowering dispatches by target."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from m3c.backends import CompileOptions, Program, get_target, list_targets, lower
from m3c.backends.program import flatten_weights, unflatten_weights
from m3c.backends.target import Target, register_target
from m3c.errors import CompileError, TargetError
from m3c.ir.graph import Graph
from m3c.ir.types import DType, TensorType
from m3c.model_defs import quant
from m3c.model_defs.presets import get_preset

EXPECTED = {  # name: (arch, vendor, SM/CU count, warp size, fp4)
    "hopper": ("sm_90a", "nvidia", 132, 32, False),
    "blackwell": ("sm_100a", "nvidia", 148, 32, True),
    "blackwell-ultra": ("sm_103a", "nvidia", 148, 32, True),
    "rubin": ("sm_107a", "nvidia", 212, 32, True),
    "cdna4": ("gfx950", "amd", 256, 64, True),
    "cpu": ("cpu", "cpu", 0, 1, False),
}


@pytest.mark.parametrize("name", list(EXPECTED))
def test_builtin_target_facts(name: str) -> None:
    t = get_target(name)
    assert (t.arch, t.vendor, t.compute_units, t.warp_size, t.fp4) == EXPECTED[name]
    assert t.nvfp4_dequant and t.pipeline and t.stages
    assert isinstance(hash(t), int)  # frozen, hashable
    with pytest.raises(dataclasses.FrozenInstanceError):
        t.name = "x"  # type: ignore[misc]
    facts = t.facts()
    assert facts["name"] == name and isinstance(facts["stages"], list)


def test_published_per_target_choices() -> None:
    assert get_target("hopper").smem_per_sm == 228 * 1024
    assert "QMUL4" in get_target("blackwell").nvfp4_dequant
    assert "mul.e4m3x4.e2m1x4.e4m3x4" in get_target("blackwell-ultra").nvfp4_dequant
    rubin = get_target("rubin")
    assert rubin.smem_per_sm == 328 * 1024 and rubin.tmem_columns == 576
    assert "fma.rn.f32x2.f16x2" in rubin.nvfp4_dequant
    assert "v_perm_b32" in get_target("cdna4").nvfp4_dequant
    assert get_target("cpu").nvfp4_dequant == "reference"


def test_runnable_here() -> None:
    assert get_target("cpu").runnable_here()
    on_hopper = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
    assert get_target("hopper").runnable_here() == on_hopper
    if not torch.cuda.is_available():
        assert [t.name for t in list_targets() if t.runnable_here()] == ["cpu"]


def test_unknown_target_lists_the_known_ones() -> None:
    with pytest.raises(TargetError, match=r"unknown target 'h100'.*hopper \(sm_90a\).*cpu"):
        get_target("h100")


def test_registering_a_name_twice_is_refused() -> None:
    with pytest.raises(TargetError, match="twice"):
        register_target(dataclasses.replace(get_target("cpu")))
    with pytest.raises(TargetError, match="runtime"):
        register_target(dataclasses.replace(get_target("cpu"), name="cpu-x", runtime="tpu"))


def test_gpu_targets_without_a_code_generator_say_so() -> None:
    g = Graph()
    with pytest.raises(TargetError, match=r"no code generator.*--target cpu"):
        lower(g, CompileOptions(target="rubin"), {})


def test_options_are_frozen_hashable_and_key_stably() -> None:
    a, b = CompileOptions(kv_cache_dtype="fp8"), CompileOptions(kv_cache_dtype="fp8")
    assert a == b and hash(a) == hash(b) and a.key() == b.key()
    assert a.key() != CompileOptions(kv_cache_dtype="nvfp4").key()
    assert CompileOptions.from_dict(a.to_dict()) == a
    with pytest.raises(CompileError, match="kv_cache_dtype='fp4'"):
        CompileOptions(kv_cache_dtype="fp4")
    with pytest.raises(CompileError, match="unknown compile options"):
        CompileOptions.from_dict({"tarjet": "cpu"})


def test_options_apply_to_config() -> None:
    cfg = get_preset("m3.1-tiny")
    out = CompileOptions(kv_cache_dtype="fp8", indexer_kv_dtype="bf16", block_size=8).apply_to(cfg)
    assert (out.quant.kv_cache_dtype, out.quant.indexer_kv_dtype) == ("fp8", "bf16")
    assert CompileOptions().apply_to(cfg) is cfg
    with pytest.raises(CompileError, match="--block-size 8"):
        CompileOptions(block_size=16).apply_to(cfg)


def _param_graph() -> Graph:
    g = Graph()
    g.add_input("a", TensorType(DType.nvfp4, (4, 32)), "param")
    g.add_input("b", TensorType(DType.mxfp8, (4, 32)), "param")
    g.add_input("c", TensorType(DType.f32, (3,)), "param")
    return g


def test_weights_flatten_and_unflatten(rng: torch.Generator) -> None:
    g = _param_graph()
    x = torch.randn(4, 32, generator=rng)
    bound = {"a": quant.nvfp4_quantize(x, quant.nvfp4_global_scale(x)), "b": quant.mxfp8_quantize(x),
             "c": torch.randn(3, generator=rng)}
    flat = flatten_weights(g, bound)
    assert sorted(flat) == ["a.data", "a.global_scale", "a.scale", "b.data", "b.scale", "c"]
    back = unflatten_weights(g, flat)
    assert isinstance(back["a"], quant.NVFP4Tensor) and isinstance(back["b"], quant.MXFP8Tensor)
    assert torch.equal(quant.nvfp4_dequantize(back["a"]), quant.nvfp4_dequantize(bound["a"]))
    assert torch.equal(back["c"], bound["c"])
    prog = Program("cpu", g, flat)
    assert prog.weights_nbytes() == sum(t.numel() * t.element_size() for t in flat.values())


def test_flatten_refuses_missing_meta_or_mistyped_weights() -> None:
    g = _param_graph()
    x = torch.randn(4, 32)
    ok = {"a": quant.nvfp4_quantize(x), "b": quant.mxfp8_quantize(x), "c": torch.zeros(3)}
    with pytest.raises(CompileError, match="%c"):
        flatten_weights(g, {k: v for k, v in ok.items() if k != "c"})
    with pytest.raises(CompileError, match="meta device"):
        flatten_weights(g, {**ok, "c": torch.zeros(3, device="meta")})
    with pytest.raises(CompileError, match="IR type nvfp4"):
        flatten_weights(g, {**ok, "a": x})


def test_target_is_a_plain_dataclass() -> None:
    assert all(isinstance(t, Target) for t in list_targets())
    assert [t.name for t in list_targets()][:2] == ["hopper", "blackwell"]
