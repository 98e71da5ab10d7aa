"""HF-layout checkpoints: sharded writes, bit-exact loads, named errors for every corruption, meta builds."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from m3c.errors import CheckpointError
from m3c.model_defs import quant
from m3c.model_defs.checkpoint import (
    INDEX_NAME,
    build_model,
    load_checkpoint,
    load_model,
    make_random_checkpoint,
    random_hf_weights,
    save_checkpoint,
    validate_tensors,
)
from m3c.model_defs.config import M3Config
from m3c.model_defs.kv_cache import PagedKVCache, allocate_layer_cache
from m3c.model_defs.presets import m31_flash, m31_tiny
from m3c.model_defs.weights import checkpoint_nbytes, weight_specs

SHARD_BYTES = 200_000  # the tiny checkpoint is ~1 MB: several shards


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8) if t.dim() else t.reshape(1).view(torch.uint8)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-exact equality of dtype, shape and bytes."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bits(a), _bits(b))


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> tuple[Path, int, dict[str, torch.Tensor]]:
    """(directory, seed, in-memory tensors) of a random sharded tiny checkpoint; the seed is fresh each run."""
    seed = int(torch.randint(0, 2**31 - 1, (1,)))
    print(f"checkpoint seed: {seed}")
    path = make_random_checkpoint("m3.1-tiny", tmp_path_factory.mktemp("ckpt") / "tiny", seed=seed,
                                  max_shard_bytes=SHARD_BYTES)
    return path, seed, random_hf_weights(m31_tiny(), seed)


@pytest.fixture(autouse=True)
def _print_seed(ckpt) -> None:
    print(f"checkpoint seed: {ckpt[1]}")


@pytest.fixture
def copy(ckpt, tmp_path) -> Path:
    """A private copy of the checkpoint directory to corrupt."""
    dst = tmp_path / "copy"
    shutil.copytree(ckpt[0], dst)
    return dst


def _pick(rng: torch.Generator, names: list[str]) -> str:
    return names[int(torch.randint(0, len(names), (1,), generator=rng))]


def test_layout_on_disk(ckpt) -> None:
    path, _, tensors = ckpt
    assert M3Config.load(path / "config.json") == m31_tiny()
    index = json.loads((path / INDEX_NAME).read_text())
    weight_map = index["weight_map"]
    assert set(weight_map) == set(tensors)
    files = sorted(set(weight_map.values()))
    n = len(files)
    assert n >= 3, "max_shard_bytes should force several shards"
    assert files == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    assert sorted(p.name for p in path.glob("*.safetensors")) == files
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors.values())
    for fname in files:
        with safe_open(str(path / fname), framework="pt") as f:
            keys = set(f.keys())
            assert keys == {k for k, v in weight_map.items() if v == fname}
            size = sum(tensors[k].numel() * tensors[k].element_size() for k in keys)
            assert size <= SHARD_BYTES or len(keys) == 1


def test_load_round_trip_bit_exact(ckpt) -> None:
    path, _, tensors = ckpt
    cfg, loaded = load_checkpoint(path)
    assert cfg == m31_tiny()
    assert set(loaded) == set(tensors)
    bad = [k for k in tensors if not _same(loaded[k], tensors[k])]
    assert not bad, bad[:5]
    expected = {k for s in weight_specs(cfg) for k in s.stored()}
    optional = {k for s in weight_specs(cfg) for k in s.optional()}
    assert expected <= set(loaded) <= expected | optional


def test_nvfp4_experts_stored_modelopt_style(ckpt) -> None:
    path, _, tensors = ckpt
    cfg = m31_tiny()
    h, inter = cfg.hidden_size, cfg.moe_intermediate_size
    weight_map = json.loads((path / INDEX_NAME).read_text())["weight_map"]

    def header(name: str) -> tuple[str, list[int]]:
        with safe_open(str(path / weight_map[name]), framework="pt") as f:
            s = f.get_slice(name)
            return s.get_dtype(), s.get_shape()

    for layer in range(cfg.num_hidden_layers):
        e = layer % cfg.n_routed_experts
        for proj, (out, inp) in (("gate_proj", (inter, h)), ("up_proj", (inter, h)), ("down_proj", (h, inter))):
            p = f"model.layers.{layer}.mlp.experts.{e}.{proj}"
            assert header(f"{p}.weight") == ("U8", [out, inp // 2])
            assert header(f"{p}.weight_scale") == ("F8_E4M3", [out, inp // 16])
            assert header(f"{p}.weight_scale_2") == ("F32", [])
            assert header(f"{p}.input_scale") == ("F32", [])
            t = quant.NVFP4Tensor(tensors[f"{p}.weight"], tensors[f"{p}.weight_scale"], tensors[f"{p}.weight_scale_2"])
            w = quant.nvfp4_dequantize(t)
            assert torch.isfinite(w).all() and w.abs().amax() > 0
            codes = quant.unpack_nibbles(t.data)
            assert len(codes.unique()) > 8  # both nibbles carry real codes of both signs
            # the per-tensor scale puts the largest block scale near the top of the E4M3 range
            assert 224 <= float(t.scale.float().amax()) <= 448
        s = f"model.layers.{layer}.mlp.shared_experts.gate_proj"
        assert header(f"{s}.weight") == ("F8_E4M3", [inter * cfg.n_shared_experts, h])
        assert header(f"{s}.weight_scale") == ("U8", [inter * cfg.n_shared_experts, h // 32])
        assert header(f"model.layers.{layer}.mlp.gate.e_score_correction_bias") == ("F32", [cfg.n_routed_experts])
    assert header("model.embed_tokens.weight") == ("BF16", [cfg.vocab_size, h])


# ---------------------------------------------------------------------------------------------
# Validation errors name the tensor (or file)
# ---------------------------------------------------------------------------------------------


def _misshape(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(1) if t.dim() == 0 else t[..., :-1].contiguous() if t.shape[-1] > 1 else t.reshape(-1, 1)


def _wrong_dtype(t: torch.Tensor) -> torch.Tensor:
    other = {torch.uint8: torch.int8, torch.float8_e4m3fn: torch.uint8, torch.bfloat16: torch.float16,
             torch.float32: torch.float64}
    return t.view(other[t.dtype]) if other[t.dtype].itemsize == t.element_size() else t.to(other[t.dtype])


@pytest.mark.parametrize("fault", ["missing", "extra", "misshapen", "dtype"])
def test_validate_names_the_tensor(ckpt, rng: torch.Generator, tmp_path, fault: str) -> None:
    _, _, tensors = ckpt
    cfg = m31_tiny()
    bad = dict(tensors)
    name = _pick(rng, sorted(k for k in tensors if not k.endswith("input_scale")))
    if fault == "missing":
        del bad[name]
        what = "missing"
    elif fault == "extra":
        name = f"model.layers.{cfg.num_hidden_layers}.mlp.gate.weight"
        bad[name] = torch.zeros(3)
        what = "not part"
    elif fault == "misshapen":
        bad[name] = _misshape(bad[name])
        what = "shape"
    else:
        bad[name] = _wrong_dtype(bad[name])
        what = "dtype"
    print(f"fault {fault} on {name}")
    match = f"{re.escape(repr(name))}.*{what}"
    with pytest.raises(CheckpointError, match=match):
        validate_tensors(cfg, bad)
    with pytest.raises(CheckpointError, match=match):  # the header-only form
        validate_tensors(cfg, {k: (tuple(v.shape), v.dtype) for k, v in bad.items()})
    with pytest.raises(CheckpointError, match=match):
        build_model(cfg, bad)
    save_checkpoint(cfg, bad, tmp_path / "bad", max_shard_bytes=SHARD_BYTES)
    with pytest.raises(CheckpointError, match=match):
        load_checkpoint(tmp_path / "bad")


def test_missing_shard(copy: Path, rng: torch.Generator) -> None:
    shard = _pick(rng, sorted(p.name for p in copy.glob("model-*.safetensors")))
    (copy / shard).unlink()
    with pytest.raises(CheckpointError, match=f"{re.escape(shard)}.*missing"):
        load_checkpoint(copy)


def test_truncated_shard(copy: Path, rng: torch.Generator) -> None:
    shard = copy / _pick(rng, sorted(p.name for p in copy.glob("model-*.safetensors")))
    data = shard.read_bytes()
    cut = int(torch.randint(1, len(data) - 8, (1,), generator=rng))
    print(f"truncating {shard.name} from {len(data)} to {len(data) - cut} bytes")
    shard.write_bytes(data[: len(data) - cut])
    with pytest.raises(CheckpointError, match=re.escape(shard.name)):
        load_checkpoint(copy)


def test_index_points_at_wrong_shard(copy: Path, rng: torch.Generator) -> None:
    index = json.loads((copy / INDEX_NAME).read_text())
    wm = index["weight_map"]
    name = _pick(rng, sorted(wm))
    other = sorted(set(wm.values()) - {wm[name]})[0]
    wm[name] = other
    (copy / INDEX_NAME).write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=f"{re.escape(repr(name))}.*{re.escape(other)}"):
        load_checkpoint(copy)


def test_bad_index_and_no_weights(copy: Path) -> None:
    (copy / INDEX_NAME).write_text("{not json")
    with pytest.raises(CheckpointError, match="index"):
        load_checkpoint(copy)
    (copy / INDEX_NAME).write_text(json.dumps({"metadata": {}}))
    with pytest.raises(CheckpointError, match="index"):
        load_checkpoint(copy)
    (copy / INDEX_NAME).unlink()
    with pytest.raises(CheckpointError, match=re.escape("model.safetensors")):
        load_checkpoint(copy)


def test_single_file_layout(ckpt, tmp_path) -> None:
    _, _, tensors = ckpt
    d = tmp_path / "single"
    d.mkdir()
    m31_tiny().save(d)
    save_file(tensors, str(d / "model.safetensors"))
    cfg, loaded = load_checkpoint(d)
    assert cfg == m31_tiny() and set(loaded) == set(tensors)
    assert all(_same(loaded[k], tensors[k]) for k in tensors)
    one = dict(loaded)
    name = sorted(one)[0]
    del one[name]
    save_file(one, str(d / "model.safetensors"))
    with pytest.raises(CheckpointError, match=re.escape(repr(name))):
        load_checkpoint(d)


def test_corrupt_single_file(ckpt, tmp_path) -> None:
    d = tmp_path / "single"
    d.mkdir()
    m31_tiny().save(d)
    save_file(ckpt[2], str(d / "model.safetensors"))
    data = (d / "model.safetensors").read_bytes()
    for corrupt in (data[:-100], data[:5], b"not a safetensors file at all"):
        (d / "model.safetensors").write_bytes(corrupt)
        with pytest.raises(CheckpointError, match=re.escape("model.safetensors")):
            load_checkpoint(d)


# ---------------------------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------------------------


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_meta_build_of_full_preset() -> None:
    cfg = m31_flash()
    before = _rss_bytes()
    model = build_model(cfg, device="meta")
    grown = _rss_bytes() - before
    buffers = dict(model.named_buffers())
    assert all(b.is_meta for b in buffers.values())
    total = sum(b.numel() * b.element_size() for b in buffers.values())
    assert grown < 256 << 20, f"a meta build of a {total / 1e9:.0f} GB model grew RSS by {grown / 1e6:.0f} MB"
    # per-expert-row tensor scales ([E, N, 1]) instead of per-weight scalars: a fraction of a percent apart
    assert abs(total - checkpoint_nbytes(cfg)) / checkpoint_nbytes(cfg) < 0.005
    assert len(model.layers) == 60
    f8, u8, bf, f32 = torch.float8_e4m3fn, torch.uint8, torch.bfloat16, torch.float32
    want = {
        "embed_tokens": ((200064, 6144), bf),
        "lm_head": ((200064, 6144), bf),
        "norm": ((6144,), bf),
        "layers.0.input_layernorm": ((6144,), bf),
        "layers.0.self_attn.qkv_proj.weight": ((64 * 128 + 2 * 4 * 128 + 4 * 128 + 128, 6144), f8),
        "layers.0.self_attn.qkv_proj.weight_scale": ((9856, 6144 // 32), u8),
        "layers.59.self_attn.o_proj.weight": ((6144, 8192), f8),
        "layers.0.self_attn.q_norm": ((128,), bf),
        "layers.0.self_attn.index_k_norm": ((128,), bf),
        "layers.0.mlp.gate.weight": ((256, 6144), bf),
        "layers.0.mlp.e_score_correction_bias": ((256,), f32),
        "layers.0.mlp.w13.weight": ((256, 2 * 1536, 6144 // 2), u8),
        "layers.0.mlp.w13.weight_scale": ((256, 2 * 1536, 6144 // 16), f8),
        "layers.0.mlp.w13.weight_scale_2": ((256, 2 * 1536, 1), f32),
        "layers.0.mlp.w2.weight": ((256, 6144, 1536 // 2), u8),
        "layers.0.mlp.w2.weight_scale": ((256, 6144, 1536 // 16), f8),
        "layers.0.mlp.shared.0.weight": ((2 * 1536, 6144), f8),
        "layers.0.mlp.shared.1.weight": ((6144, 1536), f8),
        "layers.0.mlp.shared.1.weight_scale": ((6144, 1536 // 32), u8),
    }
    for name, (shape, dtype) in want.items():
        assert (tuple(buffers[name].shape), buffers[name].dtype) == (shape, dtype), name
    # the cache of one full layer on meta is free as well, with the published 576 B/token of K/V
    layer = allocate_layer_cache(cfg, 0, 1000, device="meta")
    kv = sum(t.numel() * t.element_size() for n, t in layer.items() if n[0] in "kv")
    assert all(t.is_meta for t in layer.values()) and kv == 576 * 1000 * cfg.msa_block_size


def _forward(model, ids: torch.Tensor) -> torch.Tensor:
    cache = PagedKVCache(model.cfg, num_blocks=8, max_blocks_per_seq=8)
    cache.add_request(0)
    with torch.no_grad():
        return model.step(ids, cache.prepare({0: len(ids)}), cache)


def test_loaded_model_equals_in_memory_model(ckpt, rng: torch.Generator) -> None:
    path, seed, tensors = ckpt
    loaded = load_model(path)
    fresh = build_model(m31_tiny(), seed=seed)  # random_hf_weights(cfg, seed) under the hood
    explicit = build_model(m31_tiny(), tensors)
    a, b, c = (dict(m.named_buffers()) for m in (loaded, fresh, explicit))
    assert set(a) == set(b) == set(c)
    assert all(_same(a[k], b[k]) and _same(a[k], c[k]) for k in a)
    ids = torch.randint(0, m31_tiny().vocab_size, (int(torch.randint(20, 40, (1,), generator=rng)),), generator=rng)
    la, lb = _forward(loaded, ids), _forward(explicit, ids)
    assert torch.isfinite(la).all()
    assert torch.equal(la, lb)
    other = build_model(m31_tiny(), seed=seed + 1)
    assert not torch.allclose(_forward(other, ids), la)  # the weights matter
    l64 = load_model(path, dtype=torch.float64)
    assert l64.dtype == torch.float64
    assert torch.equal(_forward(l64, ids), _forward(build_model(m31_tiny(), tensors, dtype=torch.float64), ids))


@pytest.mark.parametrize(
    "changes",
    [
        {"tie_word_embeddings": True},
        {"routed_expert_dtype": "bf16", "proj_dtype": "bf16"},
        {"routed_expert_dtype": "mxfp8", "n_shared_experts": 2},
        {"n_shared_experts": 0, "sparse_layers": ()},
    ],
    ids=["tied", "bf16", "mxfp8-experts", "no-shared-dense"],
)
def test_other_formats_round_trip(tmp_path, rng: torch.Generator, changes: dict) -> None:
    """Other weight formats and layouts: the files hold what weights.py says, and load into the same model."""
    cfg = m31_tiny().replace(**changes)
    seed = int(torch.randint(0, 2**31 - 1, (1,), generator=rng))
    make_random_checkpoint(cfg, tmp_path, seed=seed, max_shard_bytes=SHARD_BYTES)
    loaded_cfg, tensors = load_checkpoint(tmp_path)
    assert loaded_cfg == cfg
    expected = {k: v for s in weight_specs(cfg) for k, v in s.stored().items()}
    assert set(expected) <= set(tensors)
    for name, (shape, dtype) in expected.items():
        assert (tuple(tensors[name].shape), tensors[name].dtype) == (shape, dtype), name
    assert ("lm_head.weight" in tensors) != cfg.tie_word_embeddings
    ids = torch.randint(0, cfg.vocab_size, (int(torch.randint(9, 30, (1,), generator=rng)),), generator=rng)
    a = _forward(load_model(tmp_path), ids)
    b = _forward(build_model(cfg, seed=seed), ids)
    assert torch.isfinite(a).all() and torch.equal(a, b)
