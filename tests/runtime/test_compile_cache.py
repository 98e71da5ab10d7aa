"""The compile cache: keyed by content, hit/miss counted, damaged entries dropped, aliases skip capture."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from m3c.backends import CompileOptions
from m3c.model_defs import quant
from m3c.model_defs.presets import get_preset
from m3c.runtime.compile_cache import (
    CompileCache,
    cache_key,
    checkpoint_key,
    code_fingerprint,
    default_cache_dir,
    model_key,
    source_fingerprint,
    tensors_key,
)


def test_default_dir_follows_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("M3C_CACHE_DIR", str(tmp_path))
    assert default_cache_dir() == tmp_path and CompileCache().root == tmp_path
    monkeypatch.delenv("M3C_CACHE_DIR")
    assert default_cache_dir() == Path.home() / ".cache" / "m3c"


def test_put_get_hit_miss_and_damage(tmp_path: Path, program) -> None:
    cache = CompileCache(tmp_path)
    key = cache_key(None, program.graph, program.options, "w")
    assert cache.get(key) is None and (cache.hits, cache.misses) == (0, 1)
    path = cache.put(key, program, None)
    assert path == cache.path_for(key) and cache.entries() == [path]
    loaded = cache.get(key)
    assert loaded is not None and cache.hits == 1
    assert torch.equal(loaded.program.weights["layer.b"], program.weights["layer.b"])
    path.write_bytes(path.read_bytes()[:-7])  # damaged: a miss, and the entry is dropped
    assert cache.get(key) is None and not path.exists() and cache.misses == 2


def test_aliases(tmp_path: Path, program) -> None:
    cache = CompileCache(tmp_path)
    cfg = get_preset("m3.1-tiny")
    pre = model_key(cfg, CompileOptions(), "random:seed=0")
    assert cache.get_alias(pre) is None
    key = cache_key(cfg, program.graph, CompileOptions(), "random:seed=0")
    cache.put(key, program, None)
    cache.put_alias(pre, key)
    assert cache.get_alias(pre) is not None and cache.hits == 1
    cache.path_for(key).unlink()
    assert cache.get_alias(pre) is None  # a dangling alias is just a miss


def test_keys_follow_every_input(program, make_program) -> None:
    cfg, opts = get_preset("m3.1-tiny"), CompileOptions()
    base = cache_key(cfg, program.graph, opts, "w")
    assert base == cache_key(cfg, make_program().graph, opts, "w")  # deterministic
    assert base != cache_key(cfg.replace(kv_cache_dtype="fp8"), program.graph, opts, "w")
    assert base != cache_key(cfg, program.graph, CompileOptions(verify_each=True), "w")
    assert base != cache_key(cfg, program.graph, opts, "w2")
    assert len(code_fingerprint()) == 64


def test_source_fingerprint_covers_python_and_cuda_sources(tmp_path: Path) -> None:
    """A kernel's .cu / .cuh text is part of its key, so editing one must change every cache key (a cached artifact
    would otherwise name kernels the new source no longer builds); other files do not count."""
    (tmp_path / "kernels").mkdir()
    files = {"a.py": "x = 1\n", "kernels/k.cu": "// kernel\n", "kernels/h.cuh": "// header\n", "notes.txt": "n\n"}
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    first = source_fingerprint(tmp_path)
    for name, changed in ((n, n != "notes.txt") for n in files):
        (tmp_path / name).write_text(files[name] + "// edit\n")
        assert (source_fingerprint(tmp_path) != first) == changed, name
        (tmp_path / name).write_text(files[name])
    assert source_fingerprint(tmp_path) == first


def test_weight_and_checkpoint_keys(tmp_path: Path) -> None:
    x = torch.randn(4, 32)
    a = {"w": quant.nvfp4_quantize(x), "b": torch.ones(3)}
    assert tensors_key(a) == tensors_key(dict(reversed(a.items())))
    assert tensors_key(a) != tensors_key({**a, "b": torch.zeros(3)})
    (tmp_path / "config.json").write_text("{}")
    k1 = checkpoint_key(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"x")
    assert checkpoint_key(tmp_path) != k1
