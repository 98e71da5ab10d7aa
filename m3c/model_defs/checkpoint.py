"""Checkpoints in the Hugging Face layout: config.json + sharded safetensors + index, ModelOpt NVFP4 naming.

`load_checkpoint` validates every tensor against :func:`m3c.model_defs.weights.weight_specs` (missing,
extra, misshapen or wrongly typed tensors raise CheckpointError naming the tensor);
`make_random_checkpoint` writes a small random one for tests. No pickle anywhere: safetensors only.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from m3c.errors import CheckpointError, ConfigError
from m3c.model_defs import quant
from m3c.model_defs.config import MODEL_DTYPES, M3Config
from m3c.model_defs.minimax_m3 import MiniMaxM3ForCausalLM
from m3c.model_defs.presets import get_preset
from m3c.model_defs.weights import WeightSpec, weight_specs

INDEX_NAME = "model.safetensors.index.json"


def _random_logical(spec: WeightSpec, gen: torch.Generator) -> torch.Tensor:
    """A float32 tensor with the spread a trained weight of this kind would have (on the generator's device)."""
    short = spec.name.rsplit(".", 1)[-1]
    randn = torch.randn(spec.shape, generator=gen, device=gen.device)
    if short.endswith("norm") or short.endswith("layernorm"):
        return 1.0 + 0.1 * randn
    if short == "e_score_correction_bias":
        return 0.1 * randn
    if short == "embed_tokens":
        return randn
    return randn / spec.shape[-1] ** 0.5


def stored_tensors(spec: WeightSpec, w: torch.Tensor) -> dict[str, torch.Tensor]:
    """Quantize the logical float weight `w` into the tensors its format stores (see weights.py)."""
    if spec.fmt == "f32":
        return {spec.name: w.float()}
    if spec.fmt == "bf16":
        return {f"{spec.name}.weight": w.to(torch.bfloat16)}
    if spec.fmt == "mxfp8":
        t = quant.mxfp8_quantize(w)
        return {f"{spec.name}.weight": t.data, f"{spec.name}.weight_scale": t.scale}
    gs = quant.nvfp4_global_scale(w)
    t = quant.nvfp4_quantize(w, gs)
    return {
        f"{spec.name}.weight": t.data,
        f"{spec.name}.weight_scale": t.scale,
        f"{spec.name}.weight_scale_2": gs.reshape(()).float(),
        f"{spec.name}.input_scale": torch.ones((), dtype=torch.float32),
    }


def random_hf_weights(cfg: M3Config, seed: int, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """Every checkpoint tensor of `cfg`, random (seeded) and quantized to the configured formats.

    Drawn and quantized on `device` (a GPU makes the big presets take seconds); the values depend on
    the device's random generator, so the same seed on CPU and CUDA gives different weights.
    """
    gen = torch.Generator(device=device).manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for spec in weight_specs(cfg):
        out.update(stored_tensors(spec, _random_logical(spec, gen)))
    return out


def validate_tensors(cfg: M3Config, tensors: dict[str, torch.Tensor] | dict[str, tuple[tuple[int, ...], torch.dtype]]
                     ) -> None:
    """Raise CheckpointError naming the first missing, extra, misshapen or mistyped tensor.

    Values may be tensors or (shape, dtype) pairs (as read from a file's header).
    """
    expected: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    optional: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    for spec in weight_specs(cfg):
        expected.update(spec.stored())
        optional.update(spec.optional())
    for name, (shape, dtype) in expected.items():
        if name not in tensors:
            raise CheckpointError(f"checkpoint tensor {name!r} is missing (expected {dtype} {list(shape)})")
    for name, value in tensors.items():
        want = expected.get(name) or optional.get(name)
        if want is None:
            raise CheckpointError(f"checkpoint tensor {name!r} is not part of a {cfg.name} model of this config")
        shape, dtype = (tuple(value.shape), value.dtype) if isinstance(value, torch.Tensor) else value
        if tuple(shape) != tuple(want[0]):
            raise CheckpointError(f"checkpoint tensor {name!r} has shape {list(shape)}, expected {list(want[0])}")
        if dtype != want[1]:
            raise CheckpointError(f"checkpoint tensor {name!r} has dtype {dtype}, expected {want[1]}")


def save_checkpoint(cfg: M3Config, tensors: dict[str, torch.Tensor], path: str | Path,
                    max_shard_bytes: int = 1 << 30) -> Path:
    """Write config.json, shards `model-0000i-of-0000n.safetensors` and the index; returns the directory."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg.save(path / "config.json")
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(path / fname), metadata={"format": "pt"})
        weight_map.update({name: fname for name in shard})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / INDEX_NAME).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return path


def make_random_checkpoint(preset: str | M3Config, path: str | Path, seed: int = 0,
                           max_shard_bytes: int = 1 << 30) -> Path:
    """Write a random checkpoint of a preset (or config) to `path`, for tests and demos."""
    cfg = get_preset(preset) if isinstance(preset, str) else preset
    return save_checkpoint(cfg, random_hf_weights(cfg, seed), path, max_shard_bytes)


def _shard_files(path: Path) -> dict[str, str]:
    """tensor name -> shard file, from the index or from the single-file layout."""
    index = path / INDEX_NAME
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index}: not a valid safetensors index ({e})") from e
        return dict(weight_map)
    single = path / "model.safetensors"
    if not single.exists():
        raise CheckpointError(f"{path}: no {INDEX_NAME} and no model.safetensors; is this a checkpoint directory?")
    try:
        with safe_open(str(single), framework="pt") as f:
            return {name: "model.safetensors" for name in f.keys()}  # noqa: SIM118 (safe_open is not a dict)
    except Exception as e:  # safetensors raises its own error types for corrupt files
        raise CheckpointError(f"{single}: cannot read safetensors file ({e})") from e


def iter_checkpoint(path: str | Path, device: str | torch.device = "cpu") -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) of every tensor in a checkpoint directory, shard by shard."""
    path = Path(path)
    by_file: dict[str, list[str]] = {}
    for name, fname in _shard_files(path).items():
        by_file.setdefault(fname, []).append(name)
    for fname, names in sorted(by_file.items()):
        fpath = path / fname
        if not fpath.exists():
            raise CheckpointError(f"{fpath}: shard named in the index is missing")
        try:
            with safe_open(str(fpath), framework="pt", device=str(device)) as f:
                present = set(f.keys())
                for name in names:
                    if name not in present:
                        raise CheckpointError(f"checkpoint tensor {name!r} is listed in the index but not in {fname}")
                    yield name, f.get_tensor(name)
        except CheckpointError:
            raise
        except Exception as e:  # safetensors raises its own error types for corrupt files
            raise CheckpointError(f"{fpath}: cannot read safetensors file ({e})") from e


def load_checkpoint(path: str | Path, device: str | torch.device = "cpu") -> tuple[M3Config, dict[str, torch.Tensor]]:
    """Read and validate a checkpoint directory: (config, HF-named tensors)."""
    path = Path(path)
    cfg = M3Config.load(path / "config.json")
    tensors = dict(iter_checkpoint(path, device))
    validate_tensors(cfg, tensors)
    return cfg, tensors


def model_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """A model dtype (:data:`~m3c.model_defs.config.MODEL_DTYPES`, by name or as a torch dtype) as a torch dtype;
    anything else is a ConfigError."""
    name = dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")
    if name not in MODEL_DTYPES:
        raise ConfigError(f"model dtype {dtype!r}: use one of {', '.join(MODEL_DTYPES)}")
    return getattr(torch, name)


def build_model(cfg: M3Config, tensors: dict[str, torch.Tensor] | None = None, *, seed: int = 0,
                device: str | torch.device = "cpu",
                dtype: torch.dtype | str = torch.float32) -> MiniMaxM3ForCausalLM:
    """A reference model with the given checkpoint tensors (or random ones from `seed`), its activations and dense
    weights in `dtype` (a torch dtype, or a name of MODEL_DTYPES).

    On ``device="meta"`` no memory is allocated and no weights are loaded.
    """
    model = MiniMaxM3ForCausalLM(cfg, device=device, dtype=model_dtype(dtype) if isinstance(dtype, str) else dtype)
    if str(device) != "meta":
        if tensors is None:
            tensors = random_hf_weights(cfg, seed)
        else:
            validate_tensors(cfg, tensors)
        model.load_hf_weights({k: v.to(device) for k, v in tensors.items()})
    return model.eval()


def load_model(path: str | Path, device: str | torch.device = "cpu",
               dtype: torch.dtype = torch.float32) -> MiniMaxM3ForCausalLM:
    """A reference model from a checkpoint directory."""
    cfg, tensors = load_checkpoint(path, device)
    return build_model(cfg, tensors, device=device, dtype=dtype)
