"""`m3c bench` and the timing helper: numbers come out positive and consistent; bad input exits 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from m3c.cli import main
from m3c.model_defs.checkpoint import build_model
from m3c.model_defs.presets import get_preset
from m3c.runtime.bench import random_prompts, timed_generation


def test_timed_generation_reports_throughput_and_tokens() -> None:
    cfg = get_preset("m3.1-tiny")
    prompts = random_prompts(cfg, 2, 20)
    r = timed_generation(build_model(cfg, seed=3), cfg, prompts, 3, "cpu")
    assert len(r["tokens"]) == 2 and all(len(t) == 4 for t in r["tokens"])
    assert r["prefill_s"] > 0 and r["prefill_tok_s"] == pytest.approx(40 / r["prefill_s"])
    assert r["decode_ms_per_step"] > 0 and r["decode_tok_s"] == pytest.approx(6e3 / (3 * r["decode_ms_per_step"]))


def test_bench_cli_on_an_artifact_and_bad_input(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    art = tmp_path / "tiny.m3c"
    assert main(["compile", "--preset", "m3.1-tiny", "-o", str(art), "--no-cache"]) == 0
    capsys.readouterr()
    assert main(["bench", str(art), "--prompt-tokens", "12", "--decode-steps", "2", "--device", "cpu", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["decode_steps"] == 2 and out["prefill_tok_s"] > 0 and "(cpu)" in out["what"]
    argv = ["bench", "--preset", "m3.1-tiny", "--prompt-tokens", "12", "--decode-steps", "2", "--device", "cpu"]
    assert main([*argv, "--dtype", "bfloat16", "--json"]) == 0  # the reference model, built in bf16
    out = json.loads(capsys.readouterr().out)
    assert out["what"] == "m3.1-tiny reference (bfloat16)" and out["decode_ms_per_step"] > 0
    assert main(["bench", str(art), "--dtype", "bfloat16"]) == 2
    assert "--dtype belongs to reference runs" in capsys.readouterr().err
    assert main(["bench", "--decode-steps", "0"]) == 2
    assert "must be >= 1" in capsys.readouterr().err
