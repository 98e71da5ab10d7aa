"""M3Config and presets: validation, HF config.json round trips, and every bad field named in its ConfigError."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest
import torch

from m3c.errors import ConfigError
from m3c.model_defs.config import M3Config, QuantScheme
from m3c.model_defs.presets import PRESETS, get_preset, m31_flash, m31_small, m31_tiny

REQUIRED = [
    f.name for f in dataclasses.fields(M3Config)
    if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
]


@pytest.mark.parametrize("name", list(PRESETS))
def test_presets_validate(name: str) -> None:
    cfg = get_preset(name)
    cfg.validate()
    assert cfg.name == name
    assert cfg == PRESETS[name]()
    assert cfg.num_attention_heads % cfg.num_key_value_heads == 0
    assert cfg.index_n_heads == cfg.num_key_value_heads
    assert all(0 <= i < cfg.num_hidden_layers for i in cfg.sparse_layers)


def test_flash_preset_published_numbers() -> None:
    cfg = m31_flash()
    assert (cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim) == (60, 4, 128)
    assert (cfg.index_n_heads, cfg.index_head_dim) == (4, 128)
    assert (cfg.msa_block_size, cfg.msa_topk_blocks) == (128, 16)
    assert cfg.hidden_size == 6144
    assert cfg.quant == QuantScheme("nvfp4", "nvfp4", "nvfp4", "mxfp8")
    small = m31_small()
    assert small.num_key_value_heads == 1 and small.gqa_group_size == cfg.gqa_group_size == 16
    assert small.head_dim == cfg.head_dim and small.hidden_size == cfg.hidden_size


def test_tiny_preset_reaches_both_attention_paths() -> None:
    cfg = m31_tiny()
    assert any(cfg.is_sparse(i) for i in range(cfg.num_hidden_layers))
    assert not all(cfg.is_sparse(i) for i in range(cfg.num_hidden_layers))
    assert cfg.msa_topk_blocks < 4  # a context of >= 4 blocks really drops blocks


def test_derived_sizes() -> None:
    cfg = m31_flash().replace(num_hidden_layers=3, sparse_layers=(0, 2))
    assert cfg.q_size == 64 * 128 and cfg.kv_size == 4 * 128 and cfg.index_q_size == 4 * 128
    assert cfg.gqa_group_size == 16
    assert cfg.qkv_split_sizes(0) == (8192, 512, 512, 512, 128)  # sparse: + index-q, index-k
    assert cfg.qkv_split_sizes(1) == (8192, 512, 512)  # dense
    assert cfg.is_sparse(2) and not cfg.is_sparse(1)


@pytest.mark.parametrize("name", list(PRESETS))
def test_dict_round_trip(name: str) -> None:
    cfg = get_preset(name)
    d = cfg.to_dict()
    assert d["model_type"] == "minimax_m3" and d["architectures"] == ["MiniMaxM3ForCausalLM"]
    assert d["quantization"] == dataclasses.asdict(cfg.quant)
    assert isinstance(d["sparse_layers"], list)
    back = M3Config.from_dict(json.loads(json.dumps(d)))  # through real JSON
    assert back == cfg
    assert back.sparse_layers == cfg.sparse_layers and isinstance(back.sparse_layers, tuple)


@pytest.mark.parametrize("name", list(PRESETS))
def test_save_load_round_trip(tmp_path, name: str) -> None:
    cfg = get_preset(name)
    cfg.save(tmp_path / "config.json")
    assert M3Config.load(tmp_path / "config.json") == cfg
    d = tmp_path / "dir"
    d.mkdir()
    cfg.save(d)  # a directory gets config.json inside it
    assert (d / "config.json").exists()
    assert M3Config.load(d) == cfg


def test_random_configs_round_trip(tmp_path, rng: torch.Generator) -> None:
    """Random valid configs (fresh each run) survive save/load unchanged."""
    def r(lo: int, hi: int) -> int:
        return int(torch.randint(lo, hi + 1, (1,), generator=rng))

    def pick(xs: tuple[str, ...]) -> str:
        return xs[r(0, len(xs) - 1)]

    for i in range(20):
        kvh = r(1, 4)
        layers = r(1, 6)
        head_dim = 32 * r(1, 4)
        experts = r(1, 16)
        sparse = tuple(j for j in range(layers) if r(0, 1))
        cfg = M3Config(
            num_hidden_layers=layers, hidden_size=32 * r(1, 8), vocab_size=r(1, 1000),
            num_attention_heads=kvh * r(1, 4), num_key_value_heads=kvh, head_dim=head_dim,
            index_n_heads=kvh, index_head_dim=32 * r(1, 4), msa_block_size=r(1, 256), msa_topk_blocks=r(1, 32),
            sparse_layers=sparse, rope_theta=float(r(1, 10**7)) / 3, rotary_dim=2 * r(1, 16),
            rms_norm_eps=1e-6 * r(1, 100), n_routed_experts=experts, num_experts_per_tok=r(1, experts),
            moe_intermediate_size=32 * r(1, 8), n_shared_experts=r(0, 2), routed_scaling_factor=r(1, 5) / 2,
            norm_topk_prob=bool(r(0, 1)), tie_word_embeddings=bool(r(0, 1)),
            quant=QuantScheme(pick(("nvfp4", "fp8", "bf16")), pick(("nvfp4", "fp8", "bf16")),
                              pick(("nvfp4", "mxfp8", "bf16")), pick(("mxfp8", "bf16"))),
            name=f"rand{i}",
        )
        cfg.save(tmp_path / "c.json")
        assert M3Config.load(tmp_path / "c.json") == cfg, cfg


def test_hf_extra_keys_and_int_floats_accepted() -> None:
    d = m31_tiny().to_dict()
    d.update(torch_dtype="bfloat16", transformers_version="4.57.0", rope_theta=10000)
    cfg = M3Config.from_dict(d)
    assert cfg == m31_tiny()
    assert isinstance(cfg.rope_theta, float)
    d.pop("quantization")
    assert M3Config.from_dict(d).quant == QuantScheme()  # defaults when absent


def _mutated(**changes: Any) -> dict[str, Any]:
    d = m31_tiny().to_dict()
    d.update(changes)
    return d


_TINY = m31_tiny()
BAD_FIELDS = [
    # (changes to the tiny preset's config.json, a word the message must contain)
    ({"foo_bar": 1}, "foo_bar"),
    ({"hidden_size": "128"}, "hidden_size"),
    ({"hidden_size": 128.0}, "hidden_size"),
    ({"hidden_size": True}, "hidden_size"),
    ({"rope_theta": "big"}, "rope_theta"),
    ({"rms_norm_eps": [1e-6]}, "rms_norm_eps"),
    ({"tie_word_embeddings": 1}, "tie_word_embeddings"),
    ({"sparse_layers": "0,1"}, "sparse_layers"),
    ({"sparse_layers": [0.5]}, "sparse_layers"),
    ({"name": 7}, "name"),
    ({"vocab_size": 0}, "vocab_size"),
    ({"num_hidden_layers": -3}, "num_hidden_layers"),
    ({"n_shared_experts": -1}, "n_shared_experts"),
    ({"num_attention_heads": _TINY.num_key_value_heads * 2 + 1}, "num_attention_heads"),
    ({"index_n_heads": _TINY.num_key_value_heads + 1}, "index_n_heads"),
    ({"rotary_dim": 15}, "rotary_dim"),
    ({"rotary_dim": _TINY.head_dim + 2}, "rotary_dim"),
    ({"rotary_dim": _TINY.index_head_dim + 2, "head_dim": _TINY.index_head_dim + 32}, "rotary_dim"),
    ({"head_dim": _TINY.head_dim + 16}, "head_dim"),
    ({"index_head_dim": _TINY.index_head_dim + 8}, "index_head_dim"),
    ({"hidden_size": _TINY.hidden_size + 4}, "hidden_size"),
    ({"moe_intermediate_size": _TINY.moe_intermediate_size + 2}, "moe_intermediate_size"),
    ({"sparse_layers": [0, _TINY.num_hidden_layers]}, "sparse_layers"),
    ({"sparse_layers": [-1]}, "sparse_layers"),
    ({"sparse_layers": [1, 1]}, "sparse_layers"),
    ({"num_experts_per_tok": _TINY.n_routed_experts + 1}, "num_experts_per_tok"),
    ({"scoring_func": "softmax"}, "scoring_func"),
    ({"rope_theta": 0.0}, "rope_theta"),
    ({"rms_norm_eps": 0.0}, "rms_norm_eps"),
    ({"rms_norm_eps": 1.5}, "rms_norm_eps"),
    ({"quantization": {"kv_cache_dtype": "int4"}}, "kv_cache_dtype"),
    ({"quantization": {"indexer_kv_dtype": "mxfp8"}}, "indexer_kv_dtype"),
    ({"quantization": {"routed_expert_dtype": "fp8"}}, "routed_expert_dtype"),
    ({"quantization": {"proj_dtype": "nvfp4"}}, "proj_dtype"),
    ({"quantization": {"kv_cache_dtype": 5}}, "kv_cache_dtype"),
    ({"quantization": {"kv_dtype": "nvfp4"}}, "kv_dtype"),
    ({"quantization": ["nvfp4"]}, "quantization"),
    ({"model_type": "llama"}, "model_type"),
]


@pytest.mark.parametrize("changes,field", BAD_FIELDS, ids=[f"{f}-{i}" for i, (_, f) in enumerate(BAD_FIELDS)])
def test_bad_field_raises_naming_it(changes: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        M3Config.from_dict(_mutated(**changes))


@pytest.mark.parametrize("field", REQUIRED)
def test_missing_required_field(field: str) -> None:
    d = m31_tiny().to_dict()
    del d[field]
    with pytest.raises(ConfigError, match=rf"{field}\b.*missing"):
        M3Config.from_dict(d)


@pytest.mark.parametrize(
    "changes,field",
    [
        ({"num_attention_heads": 6, "num_key_value_heads": 4, "index_n_heads": 4}, "num_attention_heads"),
        ({"index_n_heads": _TINY.num_key_value_heads + 1}, "index_n_heads"),
        ({"rotary_dim": 7}, "rotary_dim"),
        ({"head_dim": _TINY.head_dim + 16}, "head_dim"),
        ({"sparse_layers": (_TINY.num_hidden_layers,)}, "sparse_layers"),
        ({"num_experts_per_tok": _TINY.n_routed_experts + 2}, "num_experts_per_tok"),
        ({"kv_cache_dtype": "fp4"}, "kv_cache_dtype"),
    ],
)
def test_construction_and_replace_validate(changes: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        m31_tiny().replace(**changes)
    d = dataclasses.asdict(m31_tiny())
    d["quant"] = QuantScheme(**d["quant"])
    qchanges = {k: changes.pop(k) for k in list(changes) if k in d["quant"].__dataclass_fields__}
    d.update(changes)
    if qchanges:
        d["quant"] = dataclasses.replace(d["quant"], **qchanges)
    with pytest.raises(ConfigError, match=field):
        M3Config(**d)


def test_bad_json_file(tmp_path) -> None:
    p = tmp_path / "config.json"
    p.write_text('{"num_hidden_layers": 3,')
    with pytest.raises(ConfigError, match=r"config\.json.*JSON"):
        M3Config.load(p)
    p.write_text("[1, 2]")
    with pytest.raises(ConfigError, match="JSON object"):
        M3Config.load(p)
    with pytest.raises(ConfigError, match=r"nope\.json"):
        M3Config.load(tmp_path / "nope.json")
    p.write_text(json.dumps(_mutated(num_experts_per_tok=99)))
    with pytest.raises(ConfigError, match="num_experts_per_tok"):
        M3Config.load(tmp_path)


def test_replace_flat_quant_fields() -> None:
    cfg = m31_tiny()
    fp8 = cfg.replace(kv_cache_dtype="fp8")
    assert fp8.quant == QuantScheme("fp8", "nvfp4", "nvfp4", "mxfp8")
    assert cfg.quant.kv_cache_dtype == "nvfp4"  # the original is untouched
    both = cfg.replace(num_hidden_layers=2, sparse_layers=(1,), indexer_kv_dtype="bf16", proj_dtype="bf16")
    assert both.num_hidden_layers == 2 and both.sparse_layers == (1,)
    assert both.quant == QuantScheme("nvfp4", "bf16", "nvfp4", "bf16")
    assert dataclasses.replace(both, num_hidden_layers=3, sparse_layers=(0, 1), quant=cfg.quant) == cfg
    assert cfg.replace(quant=QuantScheme("bf16", "bf16", "bf16", "bf16")).quant.kv_cache_dtype == "bf16"
    assert M3Config.from_dict(fp8.to_dict()) == fp8


def test_replace_explicit_quant_plus_flat_field() -> None:
    """An explicit quant= and flat quantization fields combine (the flat ones win)."""
    cfg = m31_tiny().replace(quant=QuantScheme(proj_dtype="bf16"), kv_cache_dtype="fp8")
    assert cfg.quant == QuantScheme(kv_cache_dtype="fp8", proj_dtype="bf16")


def test_replace_unknown_field() -> None:
    with pytest.raises(ConfigError, match="hiden_size"):
        m31_tiny().replace(hiden_size=64)


def test_from_dict_python_quant_key() -> None:
    d = m31_tiny().to_dict()
    d["quant"] = d.pop("quantization")
    with pytest.raises(ConfigError, match="quant"):
        M3Config.from_dict(d)


@pytest.mark.parametrize(
    "field,value",
    [("n_shared_experts", 1.5), ("n_shared_experts", True), ("tie_word_embeddings", "no"),
     ("norm_topk_prob", 1), ("rope_theta", "big"), ("routed_scaling_factor", None), ("quant", "nvfp4")],
)
def test_construction_type_checks(field: str, value: Any) -> None:
    """Direct construction (not only from_dict) refuses mistyped fields, naming them."""
    with pytest.raises(ConfigError, match=field):
        m31_tiny().replace(**{field: value})


def test_get_preset_unknown_lists_known() -> None:
    with pytest.raises(ConfigError) as e:
        get_preset("m3.1-huge")
    msg = str(e.value)
    assert "m3.1-huge" in msg
    for name in PRESETS:
        assert name in msg


def test_config_is_frozen() -> None:
    cfg = m31_tiny()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.hidden_size = 64  # type: ignore[misc]
    assert hash(cfg) == hash(m31_tiny())


@pytest.mark.parametrize("how", ["json-bool", "construct-float"])
def test_sparse_layers_must_be_integers(how: str) -> None:
    with pytest.raises(ConfigError, match="sparse_layers"):
        if how == "json-bool":
            M3Config.from_dict(_mutated(sparse_layers=[True]))
        else:
            m31_tiny().replace(sparse_layers=(0.7,))
