"""`m3c plan` through cli.main: the table, --json, and errors reported as `m3c: error:` with exit code 2."""

from __future__ import annotations

import json

import pytest

from m3c.cli import main

BASE = ["plan", "--preset", "m3.1-flash", "--gpu", "b300", "--context", "256k"]


def test_plan_table(capsys):
    assert main([*BASE, "--tp", "4", "--kv-cache-dtype", "nvfp4"]) == 0
    out = capsys.readouterr().out
    for text in ("34,560", "61,440", "12,960", "4,320", "TP4", "max concurrent sequences", "weights per GPU",
                 "checkpoint", "KV cache per sequence", "vs FP8"):
        assert text in out, text


def test_plan_json(capsys):
    assert main([*BASE, "--dp", "4", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["layout"] == {"tp": 1, "dp": 4, "ep": 4, "num_gpus": 4, "name": "DEP4"}
    assert data["kv_bytes_per_token"] == 34_560 and data["fp8_kv"]["kv_bytes_per_token"] == 61_440
    assert data["context_tokens"] == 262_144 and data["gpu"]["name"] == "b300"
    assert data["max_sequences"] == 4 * data["sequences_per_replica"] > 0
    assert data["sequences_ratio"] == pytest.approx(data["max_sequences"] / data["fp8_kv"]["max_sequences"])
    assert data["cache_bytes_ratio"] == pytest.approx(0.5625)
    assert abs(data["checkpoint_bytes"] - 250.1e9) / 250.1e9 < 0.05


def test_plan_dtype_and_utilization_flags(capsys):
    assert main([*BASE, "--tp", "4", "--kv-cache-dtype", "fp8", "--indexer-kv-dtype", "bf16",
                 "--gpu-memory-utilization", "0.95", "--activation-reserve-gb", "0", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert (data["kv_cache_dtype"], data["indexer_kv_dtype"]) == ("fp8", "bf16")
    assert data["kv_bytes_per_token"] == 61_440 and data["index_bytes_per_token"] == 60 * 256
    assert data["cache_bytes_per_token_per_gpu"] == 61_440 // 4 + 60 * 256
    assert data["gpu_memory_utilization"] == 0.95 and data["activation_reserve_bytes"] == 0


def test_plan_from_config_file(tmp_path, capsys):
    from m3c.model_defs.presets import m31_tiny

    m31_tiny().save(tmp_path)
    assert main(["plan", "--config", str(tmp_path), "--gpu", "h200", "--tp", "2", "--context", "1k", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["model"] == "m3.1-tiny"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["plan", "--gpu", "a100", "--context", "256k"], "known GPUs: h200, b200, b300, gb300, rubin, mi355x"),
        (["plan", "--gpu", "b300", "--context", "256q"], "context '256q'"),
        (["plan", "--gpu", "b300", "--context", "256k", "--tp", "3"], "tp=3 does not divide num_key_value_heads=4"),
        (["plan", "--gpu", "b300", "--context", "256k", "--preset", "m9"], "known presets: m3.1-flash"),
        (["plan", "--gpu", "b300", "--context", "256k", "--kv-cache-dtype", "int4"], "kv_cache_dtype='int4'"),
    ],
)
def test_plan_errors(capsys, args, message):
    assert main(args) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("m3c: error: ") and message in captured.err


def test_usage_errors_and_help(capsys):
    assert main(["plan", "--gpu", "b300", "--context", "256k", "--tp", "four"]) == 2
    assert "--tp" in capsys.readouterr().err
    assert main(["plan", "--help"]) == 0
    out = capsys.readouterr().out
    assert "--kv-cache-dtype" in out and "256k" in out and "mi355x" in out
    assert main([]) == 2
