"""The tiny preset compiled for Hopper (fused QKV kernel as a cubin, other ops through torch on the GPU),
saved, reloaded and run: greedy tokens equal the reference model's for 32 decode steps."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from m3c.backends.hopper import lower_hopper
from m3c.compiler import compile_preset
from m3c.ir.types import DType
from m3c.runtime.artifact import load_artifact, save_artifact
from m3c.runtime.executor import Executor, run_artifact
from m3c.runtime.reference import run_reference


def test_hopper_lowering_compiles_cubins_offline() -> None:
    """No GPU needed: the fused nodes get cubins (wgmma-free f32 here) and a launch plan; the rest is listed."""
    program, cfg, _ = compile_preset("m3.1-tiny", target="hopper", cache=False)
    entries = [e for e in program.launch_plan if e.get("kernels")]
    assert len(entries) == cfg.num_hidden_layers
    assert all(f"{k}.cubin" in program.kernels for e in entries for k in e["kernels"].values())
    assert all(program.kernels[n][:4] == b"\x7fELF" for n in program.kernels if n.endswith(".cubin"))
    assert all(b".target sm_90a" in program.kernels[n] for n in program.kernels if n.endswith(".ptx"))
    assert all(e["weight"] in program.weights for e in entries)
    listed = next(e for e in program.launch_plan if "reference_ops" in e)["reference_ops"]
    assert "qkv_norm_rope_kvinsert" not in listed and "sparse_attention" not in listed  # fused into msa_attention
    assert lower_hopper.__module__ == "m3c.backends.hopper"


def test_hopper_program_refuses_to_run_without_its_gpu(tmp_path) -> None:
    if torch.cuda.is_available():
        pytest.skip("this checks the CPU-only refusal")
    program, cfg, _ = compile_preset("m3.1-tiny", target="hopper", cache=False)
    from m3c.errors import ArtifactError, TargetError

    with pytest.raises(TargetError, match="cannot run it"):
        Executor(program, "cpu")
    path = save_artifact(program, cfg, tmp_path / "tiny_hopper.m3c")
    with pytest.raises(ArtifactError):
        load_artifact(path)


@pytest.mark.gpu
def test_tiny_hopper_artifact_matches_reference_tokens(tmp_path) -> None:
    program, cfg, _ = compile_preset("m3.1-tiny", target="hopper", cache=False)
    path = save_artifact(program, cfg, tmp_path / "tiny_hopper.m3c")
    got = run_artifact(str(path), prompt_tokens=40, decode_steps=32, batch=2, device="cuda")
    ref = run_reference("m3.1-tiny", prompt_tokens=40, decode_steps=32, batch=2, device="cuda")
    assert got.result.tokens == ref.result.tokens


def test_compile_dumps_kernel_stages(tmp_path, capsys) -> None:
    """`m3c compile --target hopper --dump-kernels DIR` writes the PTX (sm_90a) and the cubin (ELF) of each kernel."""
    from m3c.cli import main

    out = tmp_path / "kernels"
    assert main(["compile", "--preset", "m3.1-tiny", "--target", "hopper", "-o", str(tmp_path / "t.m3c"),
                 "--no-cache", "--dump-kernels", str(out)]) == 0
    ptx, cubins = sorted(out.glob("*.ptx")), sorted(out.glob("*.cubin"))
    assert ptx and len(ptx) == len(cubins)
    texts = [p.read_text() for p in ptx]
    assert all(".target sm_90a" in t for t in texts)
    for family in ("qkv_norm_rope_kvinsert", "indexer_scores_kernel", "msa_decode_kernel", "moe_fc1_kernel"):
        assert sum(f".entry {family}" in t for t in texts) >= 1, f"no {family} kernel dumped"
    assert all(c.read_bytes()[:4] == b"\x7fELF" for c in cubins)
    assert "kernels" in capsys.readouterr().out


def _cuda_moe_cfg():
    """The tiny preset widened so the CUDA C++ kernels take it: the MegaMoE decode (H, I multiples of 256) and the
    MSA indexer's decode scores (index head dim 128, KV blocks of 16 tokens)."""
    from m3c.model_defs.presets import m31_tiny

    return m31_tiny().replace(hidden_size=256, moe_intermediate_size=256, index_head_dim=128, msa_block_size=16)


def test_hopper_lowering_compiles_the_cuda_moe_kernels_offline() -> None:
    """No GPU needed: a MoE the CUDA kernels take gets their cubins (nvcc, sm_90a) and PTX next to the Triton ones,
    and the launch plan lists them for its megamoe nodes."""
    from m3c.backends.hopper import compiled_kernels

    program, _, _ = compile_preset(_cuda_moe_cfg(), target="hopper", cache=False)
    moe = [e for e in program.launch_plan if e.get("op") == "megamoe"]
    assert moe
    cuda = [k for k in moe[0]["specs"] if k.startswith("megamoe_mma")]
    assert len(cuda) == 9  # the decode builds for 1..8, 9..32 and 33..64 tokens, every one folded: this MoE's grids
    # fit one wave, so each is stage_x, FC1 (SiLU·mul folded in) and FC2 (the combine folded in)
    assert all("launch_args" not in e for e in moe)  # the default prefill precision: nothing passed on
    msa = [e for e in program.launch_plan if e.get("op") == "msa_attention"]
    assert msa and any(k.startswith("msa_indexer_mma") for k in msa[0]["specs"])
    cuda += [k for k in msa[0]["specs"] if k.startswith("msa_indexer_mma")]
    kernels = compiled_kernels(program)
    for key in cuda:
        assert program.kernels[f"{key}.cubin"][:4] == b"\x7fELF"
        assert b".target sm_90a" in program.kernels[f"{key}.ptx"]
        assert kernels[key].name.startswith(("moe_", "msa_index")) and kernels[key].arg_types[-1] in ("*u8", "i32")
    names = sorted(kernels[key].name for key in cuda if key.startswith("megamoe_mma"))
    assert names == ["moe_fc1"] * 3 + ["moe_fc2"] * 3 + ["moe_stage_x"] * 3


def test_moe_prefill_precision_option_reaches_the_artifact_and_the_launcher(tmp_path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """moe_prefill_precision="fp8" on a bf16 model: the lowering compiles the wgmma prefill's E4M3 build (and its
    row quantizer) for the megamoe nodes, their launch plan entries pass prefill_precision on, and both survive the
    artifact; where the wgmma prefill cannot run (off, a float32 model, a layout it does not take) the compile says so
    and passes nothing on."""
    from types import SimpleNamespace

    from m3c.backends.options import CompileOptions
    from m3c.compiler import Progress, _compile_job, _m3_job
    from m3c.model_defs.checkpoint import build_model
    from m3c.runtime.cuda_ops import FamilyLauncher

    cfg = _cuda_moe_cfg()
    opts = CompileOptions(target="hopper", moe_prefill_precision="fp8")
    job = _m3_job(build_model(cfg, dtype=torch.bfloat16), cfg, "", {"model": cfg.name})  # (m3c.compile would run it)
    program, _, _ = _compile_job(job, opts, cache=None, dump_ir_after=None, dump_dir=None, explain=False,
                                 timing=False, progress=Progress(False), seconds={})
    moe = [e for e in program.launch_plan if e.get("op") == "megamoe"]
    assert moe and all(e["launch_args"] == {"prefill_precision": "fp8"} for e in moe)
    meta = next(e["kernel_meta"] for e in program.launch_plan if "kernel_meta" in e)
    names = {meta[k]["name"] for k in moe[0]["specs"] if k.startswith("megamoe_prefill_wgmma")}
    assert names == {"moe_pf_fc1", "moe_pf_fc2", "moe_pf_quant"}  # the fp8 build: the quantizer is in it
    path = save_artifact(program, cfg, tmp_path / "fp8_prefill.m3c")
    loaded = load_artifact(path, check_device=False)
    assert loaded.program.options.moe_prefill_precision == "fp8"
    entry = next(e for e in loaded.program.launch_plan if e.get("op") == "megamoe")
    assert entry["launch_args"] == {"prefill_precision": "fp8"}
    seen: list[dict] = []
    launcher = FamilyLauncher(loaded.program, "megamoe", lambda args, attrs, runner: seen.append(attrs), None)
    launcher(SimpleNamespace(outputs=[SimpleNamespace(name=entry["output"])]), [], {"top_k": 2})
    assert seen == [{"top_k": 2, "prefill_precision": "fp8"}]
    from m3c.backends.hopper_families import moe_plan
    from m3c.backends.kernels import megamoe

    node = next(n for n in program.graph.nodes if n.op == "megamoe")
    monkeypatch.setattr(megamoe, "PREFILL_WGMMA", False)  # a node the wgmma prefill cannot take: said, not passed on
    with pytest.warns(UserWarning, match="cannot run the fp8 wgmma kernels: the wgmma prefill is off"):
        why, specs, launch_args = moe_plan(node, opts)
    assert why is None and specs and launch_args == {}
    monkeypatch.setattr(megamoe, "PREFILL_WGMMA", True)  # a float32 model's node: the way to bf16 is named
    x = node.inputs[0]
    monkeypatch.setattr(x, "type", dataclasses.replace(x.type, dtype=DType.f32))
    with pytest.warns(UserWarning, match=r"activations are fp32: .*`m3c compile --dtype bfloat16`"):
        why, specs, launch_args = moe_plan(node, opts)
    assert why is None and specs and launch_args == {}


@pytest.mark.gpu
def test_moe_prefill_precision_fp8_runs_the_e4m3_prefill_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """A bf16 model compiled with moe_prefill_precision="fp8": its prefill (80 tokens: the wgmma grouped GEMMs)
    calls the wgmma kernels in fp8, the default compile in bf16, and both generate."""
    import m3c
    from m3c.backends.kernels import moe_prefill_cuda
    from m3c.model_defs.checkpoint import build_model
    from m3c.runtime.bench import random_prompts, timed_generation

    seen: list[str | None] = []
    real = moe_prefill_cuda.moe_prefill_wgmma

    def spy(*args, precision=None, **kw):
        seen.append(precision)
        return real(*args, precision=precision, **kw)
    monkeypatch.setattr(moe_prefill_cuda, "moe_prefill_wgmma", spy)
    cfg = _cuda_moe_cfg()
    prompts = random_prompts(cfg, 2, 40)
    tokens = {}
    for prec in (None, "fp8"):
        seen.clear()
        compiled = m3c.compile(build_model(cfg, dtype=torch.bfloat16), target="hopper", moe_prefill_precision=prec)
        tokens[prec] = timed_generation(compiled, cfg, prompts, 4, "cuda", warmup_steps=0)["tokens"]
        assert seen and set(seen) == {prec}, seen
    for got in tokens.values():
        assert all(0 <= t < cfg.vocab_size for row in got for t in row)


@pytest.mark.gpu
def test_cuda_moe_artifact_matches_reference_tokens(tmp_path) -> None:
    """The widened tiny preset through the artifact (CUDA C++ MoE decode and MSA indexer kernels from the artifact's
    cubins for the decode steps): greedy tokens equal the reference model's for 32 steps."""
    cfg = _cuda_moe_cfg()
    program, cfg, _ = compile_preset(cfg, target="hopper", cache=False)
    path = save_artifact(program, cfg, tmp_path / "tiny_cuda_moe.m3c")
    got = run_artifact(str(path), prompt_tokens=40, decode_steps=32, batch=2, device="cuda")
    ref = run_reference(cfg, prompt_tokens=40, decode_steps=32, batch=2, device="cuda")
    assert got.result.tokens == ref.result.tokens


@pytest.mark.gpu
def test_bfloat16_preset_compile_runs_the_wgmma_prefill_gpu(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """compile_preset(dtype="bfloat16") (`m3c compile --dtype bfloat16`) for hopper: its artifact's prefill calls the
    wgmma grouped GEMMs (a float32 compile cannot: they take bf16 activations) and generates valid tokens."""
    from m3c.backends.kernels import moe_prefill_cuda

    calls: list[int] = []
    real = moe_prefill_cuda.moe_prefill_wgmma

    def spy(*args, **kw):
        calls.append(1)
        return real(*args, **kw)
    monkeypatch.setattr(moe_prefill_cuda, "moe_prefill_wgmma", spy)
    cfg = _cuda_moe_cfg()
    program, cfg, _ = compile_preset(cfg, target="hopper", cache=False, dtype="bfloat16")
    path = save_artifact(program, cfg, tmp_path / "tiny_bf16.m3c", {"dtype": "bfloat16"})
    got = run_artifact(str(path), prompt_tokens=40, decode_steps=4, batch=2, device="cuda")
    assert calls, "the bf16 artifact's prefill did not run the wgmma kernels"
    assert all(0 <= t < cfg.vocab_size for row in got.result.tokens for t in row)
