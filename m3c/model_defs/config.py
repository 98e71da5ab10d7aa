"""The MiniMax-M3 model configuration: one frozen dataclass, read from and written to HF config.json.

Every dimension the model, the compiler and the planner use comes from here; nothing else in m3c
hard-codes a model size. Presets live in :mod:`m3c.model_defs.presets`.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from m3c.errors import ConfigError

KV_CACHE_DTYPES = ("nvfp4", "fp8", "bf16")
MODEL_DTYPES = ("float32", "bfloat16")  # activations and dense weights of a model built from a config (m3c compile)
EXPERT_DTYPES = ("nvfp4", "mxfp8", "bf16")
PROJ_DTYPES = ("mxfp8", "bf16")
SCORING_FUNCS = ("sigmoid",)


@dataclass(frozen=True)
class QuantScheme:
    """Number formats of the caches and the weights."""

    kv_cache_dtype: str = "nvfp4"
    indexer_kv_dtype: str = "nvfp4"
    routed_expert_dtype: str = "nvfp4"
    proj_dtype: str = "mxfp8"

    def validate(self) -> None:
        """Raise ConfigError naming the first field whose value is not a known format."""
        for name, allowed in (
            ("kv_cache_dtype", KV_CACHE_DTYPES),
            ("indexer_kv_dtype", KV_CACHE_DTYPES),
            ("routed_expert_dtype", EXPERT_DTYPES),
            ("proj_dtype", PROJ_DTYPES),
        ):
            value = getattr(self, name)
            if value not in allowed:
                raise ConfigError(f"quantization.{name}={value!r}: expected one of {allowed}")


@dataclass(frozen=True)
class M3Config:
    """Dimensions and formats of one MiniMax-M3 model (field names follow HF conventions)."""

    num_hidden_layers: int
    hidden_size: int
    vocab_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    index_n_heads: int
    index_head_dim: int
    msa_block_size: int
    msa_topk_blocks: int
    sparse_layers: tuple[int, ...]
    rope_theta: float
    rotary_dim: int
    rms_norm_eps: float
    n_routed_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    n_shared_experts: int
    scoring_func: str = "sigmoid"
    routed_scaling_factor: float = 1.0
    norm_topk_prob: bool = True
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 1 << 20
    quant: QuantScheme = field(default_factory=QuantScheme)
    name: str = "custom"

    def __post_init__(self) -> None:
        layers = self.sparse_layers
        if not isinstance(layers, (list, tuple)) or any(not isinstance(i, int) or isinstance(i, bool) for i in layers):
            raise ConfigError(f"sparse_layers={layers!r}: expected a list of integer layer indices")
        object.__setattr__(self, "sparse_layers", tuple(layers))
        self.validate()

    # ---- derived sizes -------------------------------------------------------------------
    @property
    def q_size(self) -> int:
        """Width of the query projection output."""
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        """Width of the key (or value) projection output."""
        return self.num_key_value_heads * self.head_dim

    @property
    def index_q_size(self) -> int:
        """Width of the index-query projection output (one index head per GQA group)."""
        return self.index_n_heads * self.index_head_dim

    @property
    def gqa_group_size(self) -> int:
        """Query heads per KV head."""
        return self.num_attention_heads // self.num_key_value_heads

    def is_sparse(self, layer: int) -> bool:
        """Whether decoder layer `layer` uses MSA (indexer + top-k blocks) rather than dense attention."""
        return layer in self.sparse_layers

    def qkv_split_sizes(self, layer: int) -> tuple[int, ...]:
        """Output widths of the concatenated projection: q, k, v and, on sparse layers, index-q, index-k."""
        sizes = (self.q_size, self.kv_size, self.kv_size)
        if self.is_sparse(layer):
            sizes += (self.index_q_size, self.index_head_dim)
        return sizes

    # ---- checks --------------------------------------------------------------------------
    def validate(self) -> None:
        """Raise ConfigError naming the first field that is missing a sensible value or inconsistent."""
        positive = (
            "num_hidden_layers", "hidden_size", "vocab_size", "num_attention_heads",
            "num_key_value_heads", "head_dim", "index_n_heads", "index_head_dim",
            "msa_block_size", "msa_topk_blocks", "rotary_dim", "n_routed_experts",
            "num_experts_per_tok", "moe_intermediate_size", "max_position_embeddings",
        )
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"{name}={value!r}: expected a positive integer")
        if not isinstance(self.n_shared_experts, int) or isinstance(self.n_shared_experts, bool) \
                or self.n_shared_experts < 0:
            raise ConfigError(f"n_shared_experts={self.n_shared_experts!r}: expected an integer >= 0")
        for name in ("norm_topk_prob", "tie_word_embeddings"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name}={getattr(self, name)!r}: expected true or false")
        for name in ("rope_theta", "rms_norm_eps", "routed_scaling_factor"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ConfigError(f"{name}={value!r}: expected a number")
        if not isinstance(self.quant, QuantScheme):
            raise ConfigError(f"quant={self.quant!r}: expected a QuantScheme")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if self.index_n_heads != self.num_key_value_heads:
            raise ConfigError(
                f"index_n_heads={self.index_n_heads}: MSA uses one index head per GQA group, "
                f"so it must equal num_key_value_heads={self.num_key_value_heads}"
            )
        if self.rotary_dim > self.head_dim or self.rotary_dim % 2:
            raise ConfigError(f"rotary_dim={self.rotary_dim}: must be even and <= head_dim={self.head_dim}")
        if self.rotary_dim > self.index_head_dim:
            raise ConfigError(f"rotary_dim={self.rotary_dim} exceeds index_head_dim={self.index_head_dim}")
        # NVFP4 packs 16-value blocks, MXFP8 32-value blocks along the last dim.
        for name in ("head_dim", "index_head_dim"):
            if getattr(self, name) % 32:
                raise ConfigError(f"{name}={getattr(self, name)}: must be a multiple of 32 (quantization blocks)")
        for name in ("hidden_size", "moe_intermediate_size"):
            if getattr(self, name) % 32:
                raise ConfigError(f"{name}={getattr(self, name)}: must be a multiple of 32 (quantization blocks)")
        if self.num_experts_per_tok > self.n_routed_experts:
            raise ConfigError(
                f"num_experts_per_tok={self.num_experts_per_tok} exceeds n_routed_experts={self.n_routed_experts}"
            )
        if self.scoring_func not in SCORING_FUNCS:
            raise ConfigError(f"scoring_func={self.scoring_func!r}: expected one of {SCORING_FUNCS}")
        if not self.rope_theta > 0:
            raise ConfigError(f"rope_theta={self.rope_theta}: must be > 0")
        if not 0 < self.rms_norm_eps < 1:
            raise ConfigError(f"rms_norm_eps={self.rms_norm_eps}: must be in (0, 1)")
        bad = [i for i in self.sparse_layers if not 0 <= i < self.num_hidden_layers]
        if bad or len(set(self.sparse_layers)) != len(self.sparse_layers):
            raise ConfigError(
                f"sparse_layers={list(self.sparse_layers)}: indices must be unique and in [0, {self.num_hidden_layers})"
            )
        self.quant.validate()

    def replace(self, **changes: Any) -> M3Config:
        """A copy with some fields changed (quantization fields may be given flat, e.g. kv_cache_dtype)."""
        qfields = {f.name for f in dataclasses.fields(QuantScheme)}
        known = {f.name for f in dataclasses.fields(self)}
        for key in changes:
            if key not in known and key not in qfields:
                raise ConfigError(f"{key}: unknown config field")
        qchanges = {k: changes.pop(k) for k in list(changes) if k in qfields}
        if qchanges:
            changes["quant"] = dataclasses.replace(changes.get("quant", self.quant), **qchanges)
        return dataclasses.replace(self, **changes)

    # ---- HF config.json ------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """The HF-style config.json contents."""
        out: dict[str, Any] = {"model_type": "minimax_m3", "architectures": ["MiniMaxM3ForCausalLM"]}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "quant":
                out["quantization"] = dataclasses.asdict(value)
            elif isinstance(value, tuple):
                out[f.name] = list(value)
            else:
                out[f.name] = value
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> M3Config:
        """Build from an HF-style dict; unknown keys and wrong types raise ConfigError naming the key."""
        data = dict(data)
        model_type = data.pop("model_type", "minimax_m3")
        if model_type != "minimax_m3":
            raise ConfigError(f"model_type={model_type!r}: m3c reads 'minimax_m3' configs")
        data.pop("architectures", None)
        data.pop("torch_dtype", None)
        data.pop("transformers_version", None)
        known = {f.name: f for f in dataclasses.fields(cls) if f.name != "quant"}
        quant = data.pop("quantization", {}) or {}
        if not isinstance(quant, dict):
            raise ConfigError(f"quantization: expected an object, got {type(quant).__name__}")
        qknown = {f.name for f in dataclasses.fields(QuantScheme)}
        for key in quant:
            if key not in qknown:
                raise ConfigError(f"quantization.{key}: unknown field (known: {sorted(qknown)})")
        kwargs: dict[str, Any] = {}
        for key, value in data.items():
            if key not in known:
                raise ConfigError(f"{key}: unknown config field")
            kwargs[key] = _coerce(key, known[key].type, value)
        missing = [
            name for name, f in known.items()
            if name not in kwargs and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        ]
        if missing:
            raise ConfigError(f"{missing[0]}: required config field is missing")
        return cls(quant=QuantScheme(**quant), **kwargs)

    def save(self, path: str | Path) -> None:
        """Write config.json (a directory gets config.json inside it)."""
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        path.write_text(json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> M3Config:
        """Read config.json (or a directory holding one)."""
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError as e:
            raise ConfigError(f"{path}: no such config file") from e
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}: not valid JSON ({e})") from e
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: expected a JSON object")
        return cls.from_dict(data)


def _coerce(key: str, annotation: Any, value: Any) -> Any:
    """Check (and lightly convert) one config value against its field annotation."""
    text = str(annotation)
    if text.startswith("tuple"):
        if not isinstance(value, (list, tuple)) or not all(isinstance(v, int) and not isinstance(v, bool)
                                                           for v in value):
            raise ConfigError(f"{key}={value!r}: expected a list of integers")
        return tuple(value)
    if text == "bool":
        if not isinstance(value, bool):
            raise ConfigError(f"{key}={value!r}: expected true or false")
        return value
    if text == "int":
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}={value!r}: expected an integer")
        return value
    if text == "float":
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}={value!r}: expected a number")
        return float(value)
    if text == "str":
        if not isinstance(value, str):
            raise ConfigError(f"{key}={value!r}: expected a string")
        return value
    return value
