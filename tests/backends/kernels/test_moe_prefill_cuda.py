"""The wgmma MoE prefill (``moe_prefill_cuda``): its build (offline, sm_90a), its argument checks, and on a GPU its
results against the float64 reference of ``test_moe_prefill`` (NaN-poisoned workspaces and outputs)."""

from __future__ import annotations

import subprocess
import tempfile
from pathlib import Path

import pytest
import torch
from test_moe_prefill import _check, _problem, _reference, _to

from m3c.backends.cuda_aot import SOURCE_DIR, compile_cuda, disassemble, find_nvcc
from m3c.backends.kernels import moe_cuda
from m3c.backends.kernels import moe_prefill as mp
from m3c.backends.kernels import moe_prefill_cuda as pc
from m3c.errors import ConfigError, ShapeError, TargetError


@pytest.mark.parametrize("bt, wgs, stages", [(128, 4, 5), (256, 2, 5), (64, 2, 6)])
def test_kernels_compile_for_sm90a_with_register_a_wgmma(bt: int, wgs: int, stages: int,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pc, "BT", bt)
    monkeypatch.setattr(pc, "WGS", wgs)
    monkeypatch.setattr(pc, "STAGES", stages)
    for spec in pc.specs():
        ck = compile_cuda(spec, "sm_90a")
        sass = disassemble(ck.binary)
        assert f"HGMMA.64x{bt}x16.F32.BF16" in sass and "gdesc" in sass  # A from registers, B from a descriptor
        assert sass.count("HGMMA") >= 8  # 4 steps a stage, NVFP4 and MXFP8 loops
        assert "LDGSTS" in sass
        assert spec.shared_bytes == stages * (bt * 128 + wgs * 4 * 1280) and spec.num_warps == 4 * wgs
    with tempfile.TemporaryDirectory() as tmp:  # ptxas keeps every wgmma asynchronous (no serialization warning)
        res = subprocess.run([find_nvcc(), "-arch=sm_90a", "-cubin", "-O3", "-std=c++17", "-Xptxas", "-v",
                              f"-DBT={bt}", f"-DWGS={wgs}", f"-DSTAGES={stages}", "-o", str(Path(tmp) / "k.cubin"),
                              str(SOURCE_DIR / pc.SOURCE)], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "serializ" not in res.stderr and " 0 bytes spill stores" in res.stderr, res.stderr[-2000:]


def test_build_settings_are_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pc, "BT", 96)
    with pytest.raises(ConfigError, match="BT 96"):
        pc.specs()
    monkeypatch.setattr(pc, "BT", 128)
    monkeypatch.setattr(pc, "STAGES", 8)
    with pytest.raises(ConfigError, match="shared memory"):
        pc.specs()


def test_rejects_what_it_cannot_take(rng: torch.Generator) -> None:
    x, ids, wts, w13, w2, sh13, sh2 = _problem(4, 256, 128, 4, 2, 128, "nvfp4", "mxfp8", rng)
    with pytest.raises(ShapeError, match="bf16"):
        pc.moe_prefill_wgmma(x, ids, wts, w13, w2, sh13, sh2)  # float32 tokens
    x, ids, wts, w13, w2, sh13, sh2 = _problem(4, 256, 96, 4, 2, 128, "nvfp4", "mxfp8", rng)
    with pytest.raises(ShapeError, match="multiples of 256"):
        pc.moe_prefill_wgmma(x.bfloat16(), ids, wts, w13, w2, sh13, sh2)
    x, ids, wts, w13, w2, sh13, sh2 = _problem(4, 256, 256, 4, 2, 128, "nvfp4", "mxfp8", rng)
    with pytest.raises(ShapeError, match="permutation"):
        pc.moe_prefill_wgmma(x.bfloat16(), ids, wts, w13, w2, sh13, sh2,
                             permutation=(torch.zeros(3, dtype=torch.int32), torch.zeros(5, dtype=torch.int32)))


def test_needs_an_sm90_device_and_a_contiguous_permutation(rng: torch.Generator) -> None:
    x, ids, wts, w13, w2, sh13, sh2 = _problem(4, 256, 256, 4, 2, 128, "nvfp4", "mxfp8", rng)
    with pytest.raises(TargetError, match="sm_90"):
        pc.moe_prefill_wgmma(x.bfloat16(), ids, wts, w13, w2, sh13, sh2)  # a CPU tensor


def test_state_ready_tracks_every_lazily_built_piece(rng: torch.Generator) -> None:
    """What a first call builds (prepacked copies, row-scale expansion, token K order) is tracked per weight version:
    a call inside CUDA-graph capture is refused until all of it exists."""
    x, _, _, w13, w2, sh13, sh2 = _problem(4, 256, 256, 4, 2, 128, "nvfp4", "mxfp8", rng)
    w13.global_scale = w13.global_scale.amax().reshape(1)  # a per-tensor scale: expanded once per row
    x = x.bfloat16()
    assert not pc.state_ready(x, w13, w2, sh13, sh2)
    moe_cuda.packed_pair(w13)
    moe_cuda.packed_pair(w2)
    pc._packed_shared(sh13)
    pc._packed_shared(sh2)
    pc._k_order_on(x.device, 256)
    assert not pc.state_ready(x, w13, w2, sh13, sh2)  # w13's per-row scales not expanded yet
    mp.nvfp4_row_scales(w13, (4, 512), "w13")
    assert pc.state_ready(x, w13, w2, sh13, sh2) and pc.state_ready(x, w13, w2, None, None)
    sh2.scale.add_(0)  # an in-place change (version bump) of a scale alone
    assert not pc.state_ready(x, w13, w2, sh13, sh2)


def test_megamoe_lists_the_wgmma_specs_only_when_on(monkeypatch: pytest.MonkeyPatch) -> None:
    from m3c.backends.kernels import megamoe

    def fams() -> list[str]:
        return [getattr(sp, "family", "") for sp in megamoe.megamoe_specs(6144, 1536, 64, 8, 1536, "bf16", "nvfp4",
                                                                           "mxfp8")]
    assert fams().count("megamoe_prefill_wgmma") == 2
    monkeypatch.setattr(megamoe, "PREFILL_WGMMA", False)
    assert "megamoe_prefill_wgmma" not in fams()


def _gpu_case(t: int, h: int, inter: int, e: int, k: int, s: int, rng: torch.Generator, skew: bool = False,
              empty: int = 0):
    sfmt = "mxfp8" if s else None
    x, ids, wts, w13, w2, sh13, sh2 = _problem(t, h, inter, e, k, s, "nvfp4", sfmt, rng, skew=skew, empty=empty)
    args = [_to(v, "cuda") for v in (x.bfloat16().float(), ids, wts, w13, w2, sh13, sh2)]
    out = torch.full((t, h), float("nan"), dtype=torch.bfloat16, device="cuda")
    got = pc.moe_prefill_wgmma(args[0].bfloat16(), *args[1:], out=out)
    assert got is out
    ref = _reference(*args, "nvfp4", sfmt, dtype=torch.float64)
    _check(out, ref, torch.bfloat16)
    return args, out


@pytest.fixture(autouse=True)
def _poison(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(mp, "POISON_WORKSPACES", True)


@pytest.mark.gpu
@pytest.mark.parametrize("t, skew, empty", [(1, False, 0), (77, False, 2), (300, True, 3), (1000, False, 0)])
@pytest.mark.parametrize("shared", [128, 0], ids=["mxfp8-shared", "no-shared"])
def test_small_layouts_gpu(t: int, skew: bool, empty: int, shared: int, rng: torch.Generator) -> None:
    """Partial and empty token tiles, unused experts, with and without the shared expert's tiles."""
    _gpu_case(t, 512, 256, 8, 2, shared, rng, skew=skew, empty=empty)


@pytest.mark.gpu
@pytest.mark.parametrize("bt, wgs, stages", [(128, 4, 5), (256, 2, 5), (64, 4, 4), (128, 2, 6), (64, 1, 3)])
def test_build_variants_gpu(bt: int, wgs: int, stages: int, rng: torch.Generator,
                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pc, "BT", bt)
    monkeypatch.setattr(pc, "WGS", wgs)
    monkeypatch.setattr(pc, "STAGES", stages)
    _gpu_case(333, 512, 256, 8, 3, 256, rng)


@pytest.mark.gpu
@pytest.mark.parametrize("t", [600, 4096])
def test_m31_small_gpu(t: int, rng: torch.Generator) -> None:
    """m3.1-small shapes against the float64 reference and the Triton grouped GEMM; deterministic."""
    args, out = _gpu_case(t, 6144, 1536, 64, 8, 1536, rng, skew=t == 600, empty=3 if t == 600 else 0)
    xb = args[0].bfloat16()
    tri = mp.moe_prefill(xb, *args[1:])
    rel = float((tri.float() - out.float()).norm() / out.float().norm())
    assert rel < 1e-2, rel
    again = pc.moe_prefill_wgmma(xb, *args[1:])
    assert torch.equal(again, out), "not deterministic"


@pytest.mark.gpu
def test_invalid_ids_contribute_nothing_and_graph_replays_gpu(rng: torch.Generator) -> None:
    t, h, inter, e, k, s = 150, 512, 256, 8, 2, 256
    x, ids, wts, w13, w2, sh13, sh2 = _problem(t, h, inter, e, k, s, "nvfp4", "mxfp8", rng)
    args = [_to(v, "cuda") for v in (x.bfloat16(), ids, wts, w13, w2, sh13, sh2)]
    out = torch.empty(t, h, dtype=torch.bfloat16, device="cuda")
    pc.moe_prefill_wgmma(*args, out=out)  # warm-up: compile and prepack outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        pc.moe_prefill_wgmma(*args, out=out)
    x2, ids2, wts2, *_ = _problem(t, h, inter, e, k, s, "nvfp4", "mxfp8", rng)
    ids2[::3, 1] = -1  # ids outside [0, E): those slots contribute nothing
    ids2[1::5, 0] = e + 3
    args[0].copy_(x2.bfloat16())
    args[1].copy_(ids2)
    args[2].copy_(wts2)
    graph.replay()
    torch.cuda.synchronize()
    keep = (ids2.cuda() >= 0) & (ids2.cuda() < e)
    ref = _reference(args[0].float(), ids2.cuda().clamp(0, e - 1), wts2.cuda() * keep, *args[3:], "nvfp4", "mxfp8",
                     dtype=torch.float64)
    _check(out, ref, torch.bfloat16)
