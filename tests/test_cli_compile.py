"""`m3c compile | inspect | targets | run ARTIFACT` through main([...]), including the done criterion:
greedy tokens of a saved-and-reloaded tiny CPU artifact equal the reference model's for 32 decode steps."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest

from m3c.backends.program import Program
from m3c.cli import main
from m3c.model_defs.checkpoint import make_random_checkpoint
from m3c.model_defs.presets import get_preset
from m3c.runtime.artifact import load_artifact, save_artifact

ONE_LAYER = get_preset("m3.1-tiny").replace(name="tiny-1layer", num_hidden_layers=1, sparse_layers=(0,))


@pytest.fixture(autouse=True)
def _session_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every test compiles into one session-wide cache (shared with test_compiler.py), never ~/.cache."""
    monkeypatch.setenv("M3C_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "m3c-cache"))


@pytest.fixture(scope="module")
def tiny_artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`m3c compile --preset m3.1-tiny --target cpu -o tiny.m3c`."""
    out = tmp_path_factory.mktemp("cli") / "tiny.m3c"
    mp = pytest.MonkeyPatch()
    mp.setenv("M3C_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "m3c-cache"))
    try:
        assert main(["compile", "--preset", "m3.1-tiny", "--target", "cpu", "-o", str(out)]) == 0
    finally:
        mp.undo()
    return out


def _tokens(text: str) -> list[list[int]]:
    return [ast.literal_eval(m) for m in re.findall(r"^tokens\[\d+\] (\[.*\])$", text, re.M)]


def test_compile_writes_a_verified_artifact(tiny_artifact: Path, capsys: pytest.CaptureFixture[str]) -> None:
    loaded = load_artifact(tiny_artifact)
    assert loaded.target == "cpu" and loaded.cfg is not None and loaded.cfg.name == "m3.1-tiny"
    assert loaded.manifest["created_from"] == {"preset": "m3.1-tiny", "weights": "random, seed 0"}
    assert not loaded.program.graph.find("fallback")


def test_inspect(tiny_artifact: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", str(tiny_artifact)]) == 0
    out = capsys.readouterr().out
    for want in ("target     cpu (cpu", "runnable here: yes", "model      m3.1-tiny: 3 layers (2 sparse)",
                 "sparse_attention 2", "paged_attention 1", "weights.safetensors", "sha256", "OK"):
        assert want in out, want
    assert main(["inspect", str(tiny_artifact), "--json"]) == 0
    manifest = json.loads(capsys.readouterr().out)
    assert manifest["verified"] is True and manifest["format_version"] == 1
    assert manifest["graph"]["op_counts"]["select_blocks"] == 2


def test_targets(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["targets"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^hopper\s+sm_90a\s+H100/H200\s+132\s+228 KB", out, re.M)
    assert re.search(r"^cdna4\s+gfx950\s+MI350X/MI355X\s+256\s+160 KB\s+64", out, re.M)
    assert re.search(r"^cpu\s.*\byes$", out, re.M)
    assert main(["targets", "--json"]) == 0
    facts = {t["name"]: t for t in json.loads(capsys.readouterr().out)}
    assert facts["rubin"]["tmem_columns"] == 576 and facts["cpu"]["runnable_here"] is True


def test_done_criterion_run_artifact_equals_reference(tiny_artifact: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """32 greedy decode steps after a 20-token prompt (> top-k 2 × block 8: the sparse path selects)."""
    steps = ["--prompt-tokens", "20", "--decode-steps", "32", "--device", "cpu"]
    assert main(["run", str(tiny_artifact), *steps]) == 0
    compiled = capsys.readouterr().out
    assert f"path: artifact {tiny_artifact} (cpu target)" in compiled
    assert main(["run", "--preset", "m3.1-tiny", *steps]) == 0
    reference = _tokens(capsys.readouterr().out)
    got = _tokens(compiled)
    assert len(got[0]) == 33 and got == reference


def test_checkpoint_compile_with_debug_flags(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Real weights from a checkpoint, fp8 KV cache, explain and IR dumps; its run equals the reference's."""
    ckpt = make_random_checkpoint(ONE_LAYER, tmp_path / "ckpt", seed=7)
    out, dumps = tmp_path / "ckpt-fp8", tmp_path / "dumps"
    assert main(["compile", "--checkpoint", str(ckpt), "--kv-cache-dtype", "fp8", "--block-size", "8",
                 "--verify-each", "--explain", "--dump-ir-after", "all", "--dump-dir", str(dumps), "--no-cache",
                 "-o", str(out)]) == 0
    text = capsys.readouterr().out
    assert "cache off" in text and f"wrote      {out}" in text and "IR dumps" in text
    assert sorted(p.name for p in dumps.iterdir())[0] == "cpu.00_input.m3ir"
    loaded = load_artifact(out)
    assert loaded.cfg.quant.kv_cache_dtype == "fp8" and loaded.manifest["created_from"] == {"checkpoint": "ckpt"}
    steps = ["--prompt-tokens", "18", "--decode-steps", "4", "--device", "cpu", "--batch", "2"]
    assert main(["run", str(out), *steps]) == 0
    got = _tokens(capsys.readouterr().out)
    assert main(["run", "--checkpoint", str(ckpt), "--kv-cache-dtype", "fp8", *steps]) == 0
    assert got == _tokens(capsys.readouterr().out) and len(got) == 2


def test_compile_from_config_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ONE_LAYER.save(tmp_path)
    assert main(["compile", "--config", str(tmp_path / "config.json"), "--seed", "3", "-o", str(tmp_path / "c")]) == 0
    assert "wrote" in capsys.readouterr().out
    assert load_artifact(tmp_path / "c").manifest["created_from"] == {"config": "tiny-1layer",
                                                                      "weights": "random, seed 3"}


def test_compile_records_the_moe_prefill_precision(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--moe-prefill-precision lands in the artifact's options (and so in its compile-cache key)."""
    ONE_LAYER.save(tmp_path)
    argv = ["compile", "--config", str(tmp_path / "config.json"), "--no-cache", "-o"]
    assert main([*argv, str(tmp_path / "f"), "--moe-prefill-precision", "fp8"]) == 0
    assert main([*argv, str(tmp_path / "b")]) == 0
    fp8, default = load_artifact(tmp_path / "f").program.options, load_artifact(tmp_path / "b").program.options
    assert fp8.moe_prefill_precision == "fp8" and default.moe_prefill_precision is None
    assert fp8.key() != default.key()
    capsys.readouterr()
    assert main([*argv, str(tmp_path / "x"), "--moe-prefill-precision", "fp4"]) == 2  # not one of the choices
    assert "invalid choice: 'fp4'" in capsys.readouterr().err and not (tmp_path / "x").exists()


def test_bfloat16_compile_runs_the_bfloat16_reference_tokens(tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    """--dtype bfloat16 builds the model in bf16 (what the GPU kernels take): the artifact's activations are bf16,
    its cache key and provenance say so, and its greedy tokens equal the bf16 reference run's (`m3c run --dtype`)."""
    from m3c.ir.types import DType

    ckpt = make_random_checkpoint(ONE_LAYER, tmp_path / "ckpt", seed=11)
    argv = ["compile", "--checkpoint", str(ckpt), "--no-cache", "-o"]
    assert main([*argv, str(tmp_path / "b16"), "--dtype", "bfloat16"]) == 0
    assert main([*argv, str(tmp_path / "f32")]) == 0
    b16, f32 = load_artifact(tmp_path / "b16"), load_artifact(tmp_path / "f32")
    assert b16.manifest["created_from"] == {"checkpoint": "ckpt", "dtype": "bfloat16"}
    assert f32.manifest["created_from"] == {"checkpoint": "ckpt"}  # float32: as before the option
    hidden = lambda a: next(n for n in a.program.graph.nodes if n.op == "rms_norm").outputs[0].type.dtype  # noqa
    assert hidden(b16) == DType.bf16 and hidden(f32) == DType.f32
    steps = ["--prompt-tokens", "18", "--decode-steps", "6", "--device", "cpu"]
    capsys.readouterr()
    assert main(["run", str(tmp_path / "b16"), *steps]) == 0
    got = _tokens(capsys.readouterr().out)
    assert main(["run", "--checkpoint", str(ckpt), "--dtype", "bfloat16", *steps]) == 0
    assert got == _tokens(capsys.readouterr().out) and len(got[0]) == 7
    assert main([*argv, str(tmp_path / "x"), "--dtype", "float16"]) == 2  # not one of the choices
    assert "invalid choice: 'float16'" in capsys.readouterr().err and not (tmp_path / "x").exists()
    _fails(["run", str(tmp_path / "b16"), "--dtype", "bfloat16"], capsys, "--dtype belong to reference runs")


# ---- error exits -----------------------------------------------------------------------------
def _fails(argv: list[str], capsys: pytest.CaptureFixture[str], *words: str) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("m3c: error: "), err
    for w in words:
        assert w in err, err
    return err


def test_bad_target_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _fails(["compile", "--preset", "m3.1-tiny", "--target", "h100", "-o", str(tmp_path / "x.m3c")], capsys,
           "unknown target 'h100'", "hopper (sm_90a)")
    _fails(["compile", "--preset", "m3.1-tiny", "--target", "blackwell", "-o", str(tmp_path / "x.m3c")], capsys,
           "no code generator", "--target cpu")
    assert not (tmp_path / "x.m3c").exists()


def test_corrupt_artifact_exits_2(tiny_artifact: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.m3c"
    bad.write_bytes(tiny_artifact.read_bytes()[: -500])
    _fails(["inspect", str(bad)], capsys, "corrupt or truncated", "compile it again")
    _fails(["run", str(bad)], capsys, "corrupt or truncated")
    _fails(["run", str(tmp_path / "missing.m3c")], capsys, "no such artifact")


def test_foreign_target_artifact_exits_2(tiny_artifact: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    loaded = load_artifact(tiny_artifact)
    p = loaded.program
    hopper = save_artifact(Program("hopper", p.graph, p.weights, p.options), loaded.cfg, tmp_path / "h.m3c")
    _fails(["run", str(hopper)], capsys, "compiled for target hopper", "--target cpu")
    assert main(["inspect", str(hopper)]) == 0  # inspecting works anywhere
    assert "runnable here: no" in capsys.readouterr().out


def test_run_artifact_rejects_reference_flags(tiny_artifact: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _fails(["run", str(tiny_artifact), "--preset", "m3.1-tiny"], capsys, "the artifact fixes its model")


def test_help_texts_teach(capsys: pytest.CaptureFixture[str]) -> None:
    for cmd, words in (("compile", ["examples:", "byte-identical", "M3C_CACHE_DIR", "--kv-cache-dtype"]),
                       ("inspect", ["sha256", "examples:"]), ("targets", ["runnable", "examples:"]),
                       ("run", ["ARTIFACT", "same tokens", "examples:"])):
        assert main([cmd, "--help"]) == 0
        out = " ".join(capsys.readouterr().out.split())
        for w in words:
            assert w in out, (cmd, w)


def test_fresh_process_loads_and_runs_the_artifact(tiny_artifact: Path) -> None:
    """`python -m m3c run ARTIFACT` in a new interpreter: nothing may rely on modules a compile imported."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "m3c", "run", str(tiny_artifact), "--prompt-tokens", "4",
                           "--decode-steps", "1", "--device", "cpu"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert len(_tokens(proc.stdout)[0]) == 2


@pytest.mark.gpu
def test_run_artifact_on_cuda_equals_reference(tiny_artifact: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A cpu-target artifact runs on CUDA tensors through the same executor (the interpreter on the GPU)."""
    steps = ["--prompt-tokens", "24", "--decode-steps", "8", "--device", "cuda"]
    assert main(["run", str(tiny_artifact), *steps]) == 0
    got = _tokens(capsys.readouterr().out)
    assert main(["run", "--preset", "m3.1-tiny", *steps]) == 0
    assert got == _tokens(capsys.readouterr().out)
