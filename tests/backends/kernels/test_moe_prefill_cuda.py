"""The wgmma MoE prefill (``moe_prefill_cuda``): its build (offline, sm_90a), its argument checks, and on a GPU its
results against the float64 reference of ``test_moe_prefill`` (NaN-poisoned workspaces and outputs)."""

from __future__ import annotations

import subprocess
import tempfile
from pathlib import Path

import pytest
import torch
from test_moe_prefill import _check, _expert, _problem, _reference, _to

from m3c.backends.cuda_aot import SOURCE_DIR, compile_cuda, disassemble, find_nvcc
from m3c.backends.kernels import moe_cuda
from m3c.backends.kernels import moe_prefill as mp
from m3c.backends.kernels import moe_prefill_cuda as pc
from m3c.backends.triton_aot import jit_run
from m3c.errors import ConfigError, ShapeError, TargetError
from m3c.model_defs import quant


@pytest.mark.parametrize("bt, wgs, stages, prec, inflight, promote, lut", [
    (128, 4, 5, "bf16", 1, 0, 0), (256, 2, 5, "bf16", 1, 0, 0), (64, 2, 6, "bf16", 2, 0, 0), (128, 4, 5, "fp8", 1, 0, 0),
    (128, 4, 6, "fp8", 3, 0, 0), (128, 2, 4, "fp8", 1, 1, 0), (256, 2, 5, "fp8", 1, 0, 0), (256, 2, 4, "fp8", 2, 0, 0),
    (128, 4, 5, "fp8", 1, 0, 1)])
def test_kernels_compile_for_sm90a_with_register_a_wgmma(bt: int, wgs: int, stages: int, prec: str, inflight: int,
                                                         promote: int, lut: int,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pc, "BT", bt)
    monkeypatch.setattr(pc, "WGS", wgs)
    monkeypatch.setattr(pc, "STAGES", stages)
    monkeypatch.setattr(pc, "INFLIGHT", inflight)
    monkeypatch.setattr(pc, "PROMOTE", bool(promote))
    monkeypatch.setattr(pc, "LUT", bool(lut))
    specs = pc.specs(prec)
    assert (("LUT", 1) in specs[0].defines) == bool(lut)
    assert len(specs) == (3 if prec == "fp8" else 2)
    for spec in specs[:2]:
        ck = compile_cuda(spec, "sm_90a")
        sass = disassemble(ck.binary)
        assert f"HGMMA.64x{bt}x16.F32.BF16" in sass and "gdesc" in sass  # A from registers, B from a descriptor
        if prec == "fp8":  # the routed tiles: E4M3 x E4M3, k32
            assert f"QGMMA.64x{bt}x32.F32.E4M3.E4M3" in sass and "F2FP.SATFINITE.E4M3" in sass
        if bt == 256:  # tiles of at most 128 tokens run the N = 128 MMA on the accumulator's first half
            assert "HGMMA.64x128x16.F32.BF16" in sass
            assert prec != "fp8" or "QGMMA.64x128x32.F32.E4M3.E4M3" in sass
        assert sass.count("HGMMA") >= 8  # 4 steps a stage, NVFP4 and MXFP8 loops
        assert "LDGSTS" in sass
        assert spec.shared_bytes == stages * (bt * 128 + wgs * 4 * 1280) and spec.num_warps == 4 * wgs
    with tempfile.TemporaryDirectory() as tmp:  # ptxas keeps every wgmma asynchronous (no serialization warning)
        res = subprocess.run([find_nvcc(), "-arch=sm_90a", "-cubin", "-O3", "-std=c++17", "-Xptxas", "-v",
                              f"-DBT={bt}", f"-DWGS={wgs}", f"-DSTAGES={stages}",
                              f"-DROUTED_FP8={int(prec == 'fp8')}", f"-DINFLIGHT={inflight}", f"-DPROMOTE={promote}",
                              f"-DLUT={lut}", "-o", str(Path(tmp) / "k.cubin"),
                              str(SOURCE_DIR / pc.SOURCE)], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "serializ" not in res.stderr and " 0 bytes spill stores" in res.stderr, res.stderr[-2000:]


def test_build_settings_are_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError, match="precision='fp4'"):
        pc.specs("fp4")
    monkeypatch.setattr(pc, "PROMOTE", True)
    with pytest.raises(ConfigError, match="PROMOTE True"):
        pc.specs("fp8")  # WGS 4: the second accumulator does not fit the registers
    monkeypatch.setattr(pc, "PROMOTE", False)
    monkeypatch.setattr(pc, "BT", 256)
    monkeypatch.setattr(pc, "WGS", 2)
    monkeypatch.setattr(pc, "PROMOTE", True)
    with pytest.raises(ConfigError, match="PROMOTE True"):
        pc.specs("fp8")  # BT 256: the accumulator alone takes 128 registers
    monkeypatch.setattr(pc, "PROMOTE", False)
    monkeypatch.setattr(pc, "WGS", 4)
    monkeypatch.setattr(pc, "BT", 64)
    with pytest.raises(ConfigError, match="128 or 256 for fp8"):
        pc.specs("fp8")
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


def test_fp8_k_order_pairs_the_bf16_steps_of_a_lane() -> None:
    """fp8 position 16 t + 4 j + e holds what moe_cuda's K order has at bf16 step t, lane j, its K e (so each lane's
    E4M3 register is one bf16 step's four K of one row); the order is its own inverse."""
    o8, o16 = pc.fp8_k_order(256), pc.k_order(256)
    assert sorted(o8.tolist()) == list(range(256)) and torch.equal(o8[o8], torch.arange(256))
    for q in range(256):
        t, j, e = (q % 64) // 16, (q // 4) % 4, q % 4
        slot = 2 * j + e % 2 + 8 * (e // 2)
        assert int(o8[q]) == int(o16[q - q % 64 + 16 * t + slot])


def test_fp8_exponent_keeps_every_product_in_e4m3_range(rng: torch.Generator) -> None:
    """The largest product lands in (224, 448] after x 2^-wexp: up or down, so small ones stay clear of E4M3's
    subnormals; clamped to [-14, 14] (the f16 / float32 powers the kernel forms); 0 for all-zero scales."""
    for top in (448.0, 100.0, 74.0, 0.5, 2.0**-9):
        scale = (torch.rand(4, 32, 16, generator=rng) * top).to(torch.float8_e4m3fn)
        scale.view(-1)[0] = top  # the largest scale present
        w = quant.NVFP4Tensor(torch.zeros(4, 32, 128, dtype=torch.uint8), scale, None)
        e = pc.fp8_exponent(w)
        biggest = 6 * float(scale.float().max())
        assert -14 <= e <= 14 and biggest * 2.0**-e <= 448 and (e == -14 or biggest * 2.0 ** (1 - e) > 448), (top, e)
    zero = quant.NVFP4Tensor(torch.zeros(2, 16, 32, dtype=torch.uint8), torch.zeros(2, 16, 4).to(torch.float8_e4m3fn), None)
    assert pc.fp8_exponent(zero) == 0


def test_fp8_state_ready_also_needs_the_weights_exponents(rng: torch.Generator,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The fp8 build's first call also computes each routed weight's exponent (a host sync): tracked like the rest,
    so a CUDA-graph capture is refused until it exists; the bf16 build does not need it. WS_SHARED / WS_SHARED_FC2:
    the shared expert's E4M3 images too, and then not its register-A pack (no register-A kernel runs its tiles)."""
    monkeypatch.setattr(pc, "WS_SHARED_FC2", True)
    x, _, _, w13, w2, sh13, sh2 = _problem(4, 256, 256, 4, 2, 128, "nvfp4", "mxfp8", rng)
    x = x.bfloat16()
    for w in (w13, w2):
        moe_cuda.packed_pair(w)
    mp.nvfp4_row_scales(w13, (4, 512), "w13")
    mp.nvfp4_row_scales(w2, (4, 256), "w2")
    pc._k_order_on(x.device, 256)
    assert not pc.state_ready(x, w13, w2, sh13, sh2, "bf16")  # the bf16 build runs the shared tiles: its pack
    for w in (sh13, sh2):
        pc._packed_shared(w)
    assert pc.state_ready(x, w13, w2, sh13, sh2, "bf16") and not pc.state_ready(x, w13, w2, sh13, sh2, "fp8")
    pc.fp8_exponent(w13)
    assert not pc.state_ready(x, w13, w2, sh13, sh2, "fp8")
    pc.fp8_exponent(w2)
    assert pc.WS_SHARED and not pc.state_ready(x, w13, w2, sh13, sh2, "fp8")  # the shared expert's E4M3 images
    img = pc._ws_shared(sh13)[0]
    assert pc.WS_SHARED_FC2 and not pc.state_ready(x, w13, w2, sh13, sh2, "fp8")
    pc._ws_shared(sh2, gate_up=False)
    assert pc.state_ready(x, w13, w2, sh13, sh2, "fp8") and pc._ws_shared(sh13)[0] is img
    sh13.scale.add_(0)  # the image depends on the scales too: rebuilt
    assert not pc.state_ready(x, w13, w2, sh13, sh2, "fp8") and pc._ws_shared(sh13)[0] is not img
    # the register-A pack is stale now: fp8 does not read it, bf16 does
    assert pc.state_ready(x, w13, w2, sh13, sh2, "fp8") and not pc.state_ready(x, w13, w2, sh13, sh2, "bf16")
    monkeypatch.setattr(pc, "WS_SHARED_FC2", False)  # the shared FC2 tiles on the register-A kernel: its w2 pack
    assert pc.state_ready(x, w13, w2, sh13, sh2, "fp8")  # (current; the stale w13 pack stays unread)
    sh2.scale.add_(0)
    assert not pc.state_ready(x, w13, w2, sh13, sh2, "fp8")
    pc._packed_shared(sh2)
    assert pc.state_ready(x, w13, w2, sh13, sh2, "fp8")
    monkeypatch.setattr(pc, "WS_SHARED", False)  # and the shared FC1 tiles: the w13 pack, stale since its scale moved
    assert not pc.state_ready(x, w13, w2, sh13, sh2, "fp8")
    pc._packed_shared(sh13)
    assert pc.state_ready(x, w13, w2, sh13, sh2, "fp8")
    monkeypatch.setattr(pc, "WS_SHARED", True)
    monkeypatch.setattr(pc, "WS_SHARED_FC2", True)
    assert not pc.state_ready(x, w13, w2, sh13, sh2, "fp8")  # w2's image, stale since its scale moved
    pc._ws_shared(sh2, gate_up=False)
    assert pc.state_ready(x, w13, w2, sh13, sh2, "fp8")
    w2.scale.view(torch.uint8).add_(0)  # a new version of a scale: its exponent is stale
    assert not pc.state_ready(x, w13, w2, sh13, sh2, "fp8")


def test_the_plan_puts_each_shared_fc_where_its_pack_is_built() -> None:
    """_plan (read by the call, state_ready and ws_specs): the fp8 defaults run every tile on the warp-specialized
    kernels; past MAX_EXPERTS the routed tiles and the shared FC1 go to the register-A kernels (which then need the
    w13 pack only), the shared FC2 stays; bf16 runs no warp-specialized tile; S = 0 (no shared expert): no pack."""
    p = pc._plan(True, 256, 256, 4, 128)
    assert p == (True, pc.WS_FC2, True, True, True) and not p.register_a_sh and not p.register_a_sh2
    p = pc._plan(True, 256, 256, pc.ws.MAX_EXPERTS + 1, 128)
    assert p == (False, False, False, True, True) and p.register_a_sh and not p.register_a_sh2
    p = pc._plan(False, 256, 256, 4, 128)
    assert p == (False, False, False, False, True) and p.register_a_sh and p.register_a_sh2
    p = pc._plan(True, 256, 256, 4, 0)
    assert not (p.has_sh or p.ws_sh or p.ws_sh2 or p.register_a_sh or p.register_a_sh2)


def test_fp8_asked_where_only_triton_runs_warns(rng: torch.Generator) -> None:
    from m3c.backends.kernels import megamoe

    x, _, _, w13, _, sh13, _ = _problem(20, 256, 256, 4, 2, 128, "nvfp4", "mxfp8", rng)
    with pytest.warns(UserWarning, match="prefill_precision='fp8'"):
        assert megamoe._prefill(x.bfloat16(), w13, sh13, "fp8") is mp.moe_prefill  # a CPU tensor


def test_megamoe_lists_the_wgmma_specs_only_when_on(monkeypatch: pytest.MonkeyPatch) -> None:
    from m3c.backends.kernels import megamoe

    def fams() -> list[str]:
        return [getattr(sp, "family", "") for sp in megamoe.megamoe_specs(6144, 1536, 64, 8, 1536, "bf16", "nvfp4",
                                                                           "mxfp8")]
    assert fams().count("megamoe_prefill_wgmma") == 2  # FC1, FC2
    monkeypatch.setattr(pc, "PRECISION", "fp8")  # the default precision's build is the one compiled ahead of time
    monkeypatch.setattr(pc, "WS_FC1", False)
    assert fams().count("megamoe_prefill_wgmma") == 3  # + the row quantizer
    monkeypatch.setattr(pc, "WS_SHARED_FC2", True)
    monkeypatch.setattr(pc, "WS_FC2", False)  # (the routed FC2 tiles on the register-A kernel)
    monkeypatch.setattr(pc, "WS_FC1", True)  # + the warp-specialized FC1, its token image and (WS_SHARED_FC2) FC2
    assert fams().count("megamoe_prefill_wgmma") == 3 and fams().count("megamoe_prefill_ws") == 3
    assert [sp.kernel for sp in pc.ws_specs("fp8", 6144, 1536)] == ["moe_ws_fc1", "moe_ws_image"]  # (no shared)
    assert pc.ws_specs("fp8", 6144, 1600) == ()  # I % 128
    assert [sp.kernel for sp in pc.ws_specs("fp8", 6144, 1600, 1536)] == ["moe_ws_fc2", "moe_ws_image"]
    monkeypatch.setattr(pc, "WS_SHARED_FC2", False)
    assert pc.ws_specs("fp8", 6144, 1600, 1536) == ()
    monkeypatch.setattr(pc, "WS_FC2", True)  # + its FC2
    assert [sp.kernel for sp in pc.ws_specs("fp8", 6144, 1536)] == ["moe_ws_fc1", "moe_ws_fc2", "moe_ws_image"]
    assert [sp.kernel for sp in pc.ws_specs("fp8", 6144, 1664)] == ["moe_ws_fc1", "moe_ws_image"]  # (FC2: I % 256)
    monkeypatch.setattr(pc, "WS_FC1", False)
    assert [sp.kernel for sp in pc.ws_specs("fp8", 6144, 1536)] == ["moe_ws_fc2", "moe_ws_image"]
    assert pc.ws_specs("bf16", 6144, 1536) == ()  # (bf16 routed tiles: the register-A kernels)
    monkeypatch.setattr(pc, "PROMOTE", True)  # (float32 stage sums: the register-A kernels only)
    assert pc.ws_specs("fp8", 6144, 1536) == ()
    monkeypatch.setattr(pc, "PRECISION", "bf16")
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
@pytest.mark.parametrize("bt, wgs, stages, inflight", [(128, 4, 5, 1), (256, 2, 5, 1), (64, 4, 4, 2), (128, 2, 6, 3),
                                                      (64, 1, 3, 1)])
def test_build_variants_gpu(bt: int, wgs: int, stages: int, inflight: int, rng: torch.Generator,
                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pc, "BT", bt)
    monkeypatch.setattr(pc, "WGS", wgs)
    monkeypatch.setattr(pc, "STAGES", stages)
    monkeypatch.setattr(pc, "INFLIGHT", inflight)
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


def _div448(amax: torch.Tensor) -> torch.Tensor:
    """amax / 448 as the kernel's float32 division rounds it (torch divides by a Python scalar via its reciprocal);
    0 for rows the kernel zeroes (amax <= 2^-100)."""
    return torch.where(amax > 2.0**-100, amax / torch.full_like(amax, 448.0), torch.zeros_like(amax))


def _inv448(amax: torch.Tensor) -> torch.Tensor:
    """448 / amax as the kernel divides it (0 where amax <= 2^-100)."""
    live = amax > 2.0**-100
    return torch.where(live, torch.full_like(amax, 448.0) / torch.where(live, amax, 1.0), torch.zeros_like(amax))


def _e4m3_weights(w: quant.NVFP4Tensor, expert: int) -> torch.Tensor:
    """One expert's weights as the fp8 build has them, in float64: value x scale x 2^-wexp (wexp: the whole
    weight's) rounded to E4M3, x 2^wexp x the tensor scale. (An expert at a time: all 64 of m3.1-small's FC1 in
    float64 are ~10 GB, too much beside the other GPU test processes.)"""
    e, one = pc.fp8_exponent(w), _expert(w, expert)
    qs = quant.nvfp4_dequantize(quant.NVFP4Tensor(one.data, one.scale, None))
    q8 = (qs * 2.0**-e).to(torch.float8_e4m3fn).double() * 2.0**e
    return q8 * one.global_scale.double() if one.global_scale is not None else q8  # [N, 1] or a 0-d scale


def _e4m3_rows(v: torch.Tensor) -> torch.Tensor:
    """Rows in E4M3 with amax / 448 scales (moe_pf_quant), in float64."""
    v = v.float()
    amax = v.abs().amax(-1, keepdim=True)
    return (v * _inv448(amax)).to(torch.float8_e4m3fn).double() * _div448(amax).double()


def _bf16(v: torch.Tensor) -> torch.Tensor:
    return v.to(torch.bfloat16).double()


def _swiglu_bf16(gu: torch.Tensor, inter: int) -> torch.Tensor:
    """act from the FC1 rows [gate | up] as the kernels round it: gate, up, SiLU(gate) and the product in bf16."""
    g, u = _bf16(gu[:, :inter]), _bf16(gu[:, inter:])
    return _bf16(_bf16(g * torch.sigmoid(g)) * u)


def _e4m3_rescaled(w: quant.MXFP8Tensor) -> torch.Tensor:
    """An MXFP8 weight as WS_SHARED's E4M3 rows (float64): each row over its largest scale of a block holding a
    nonzero code, rounded to E4M3, times that scale back."""
    v = quant.mxfp8_dequantize(w).double()
    nz = (w.data.float().view(*w.scale.shape, 32) != 0).any(-1)
    top = torch.where(nz, w.scale.double() - 127, -1e9).amax(-1, keepdim=True)
    rs = torch.where(top < -1e8, 1.0, 2.0**top)
    return (v / rs).to(torch.float8_e4m3fn).double() * rs


def _fp8_model(x, ids, wts, w13, w2, sh13, sh2, shared_fc1: bool = False, shared_fc2: bool = False) -> torch.Tensor:
    """What the fp8 build computes, in float64 on the GPU: weights value x scale x 2^-wexp rounded to E4M3 (x 2^wexp
    x the tensor scale), tokens and act in E4M3 with amax / 448 row scales, act and each slot's FC2 row rounded to
    bf16 as the kernels store them, the shared expert exact (bf16 tiles), or with `shared_fc1` (WS_SHARED) its FC1
    on the E4M3 tokens and its rows re-encoded to E4M3 (:func:`_e4m3_rescaled`), with `shared_fc2` (WS_SHARED_FC2)
    its FC2 so on its act in E4M3."""
    if (shared_fc1 or shared_fc2) and sh13 is not None:
        s = sh2.shape[-1]
        xs = _e4m3_rows(x.bfloat16()) if shared_fc1 else x.bfloat16().double()
        sact = _swiglu_bf16(xs @ (_e4m3_rescaled(sh13) if shared_fc1 else quant.mxfp8_dequantize(sh13).double()).t(),
                            s)
        if shared_fc2:
            shared = _bf16(_e4m3_rows(sact) @ _e4m3_rescaled(sh2).t())
        else:
            shared = _bf16(sact @ quant.mxfp8_dequantize(sh2).double().t())
        return _fp8_model(x, ids, wts, w13, w2, None, None) + shared
    xq = _e4m3_rows(x.bfloat16())
    inter = w2.data.shape[-1] * 2
    down = torch.zeros(*ids.shape, x.shape[1], dtype=torch.float64, device=x.device)
    for e in range(w13.data.shape[0]):
        tok, slot = (ids == e).nonzero(as_tuple=True)
        act = _swiglu_bf16(xq[tok] @ _e4m3_weights(w13, e).t(), inter)
        down[tok, slot] = _bf16((_e4m3_rows(act) @ _e4m3_weights(w2, e).t()) * wts[tok, slot].double().unsqueeze(-1))
    routed = down.sum(dim=1)
    shared = _reference(x.double(), ids, torch.zeros_like(wts), w13, w2, sh13, sh2, "nvfp4", "mxfp8" if sh13 else None,
                        dtype=torch.float64) if sh13 is not None else 0.0
    return routed + shared


@pytest.mark.gpu
@pytest.mark.parametrize("t, h, inter, e, k, s, skew, empty, bt, wgs, inflight, promote", [
    (77, 512, 256, 8, 2, 128, False, 2, 128, 4, 1, False), (300, 6144, 256, 8, 2, 0, True, 3, 128, 2, 3, False),
    (1000, 6144, 1536, 64, 8, 1536, False, 3, 128, 4, 2, False),
    (500, 6144, 1024, 16, 4, 256, True, 1, 128, 2, 3, True),
    (77, 512, 256, 8, 2, 128, False, 2, 256, 2, 1, False), (700, 6144, 512, 4, 2, 256, True, 1, 256, 2, 2, False),
    (1000, 6144, 1536, 64, 8, 1536, False, 3, 256, 2, 1, False)])
def test_fp8_build_gpu(t: int, h: int, inter: int, e: int, k: int, s: int, skew: bool, empty: int, bt: int, wgs: int,
                       inflight: int, promote: bool, rng: torch.Generator, monkeypatch: pytest.MonkeyPatch) -> None:
    """The E4M3 routed tiles against a float64 model of their own rounding, and against the exact float64
    reference (the E4M3 rounding of weights, tokens and act: ~5%); deterministic. Against the model: the wgmma
    E4M3 accumulator keeps fewer than float32's bits (1.7% at K = 6144, growing with K, 0.6% at K = 256:
    benchmarks/check_fp8_accumulation.py), so without PROMOTE the bound is loose; with PROMOTE (a fresh accumulator
    a 128-K stage, added in float32; it keeps the routed FC1 on the register-A kernel, not WS_FC1's) the model holds
    to ~0.5% at every K (bf16 act rounding flips). BT 256 builds
    also run tiles of at most 128 tokens (the N = 128 MMA) and full ones (N = 256)."""
    monkeypatch.setattr(pc, "BT", bt)
    monkeypatch.setattr(pc, "WGS", wgs)
    monkeypatch.setattr(pc, "INFLIGHT", inflight)
    monkeypatch.setattr(pc, "PROMOTE", promote)
    monkeypatch.setattr(pc, "WS_FC1", False)  # (the register-A routed FC1 these builds vary; WS_FC1: its own test)
    monkeypatch.setattr(pc, "WS_FC2", False)  # (and its routed FC2)
    monkeypatch.setattr(pc, "WS_SHARED_FC2", False)  # (and the shared expert's bf16 FC2 tiles beside the routed ones)
    sfmt = "mxfp8" if s else None
    x, ids, wts, w13, w2, sh13, sh2 = _problem(t, h, inter, e, k, s, "nvfp4", sfmt, rng, skew=skew, empty=empty)
    args = [_to(v, "cuda") for v in (x.bfloat16().float(), ids, wts, w13, w2, sh13, sh2)]
    xb = args[0].bfloat16()
    out = torch.full((t, h), float("nan"), dtype=torch.bfloat16, device="cuda")
    got = pc.moe_prefill_wgmma(xb, *args[1:], out=out, precision="fp8")
    assert got is out and torch.isfinite(out).all()
    model = _fp8_model(*args)
    bound = 1e-2 if promote else 3e-2
    rel = float((out.double() - model).norm() / model.norm())
    worst = float(((out.double() - model).norm(dim=1) / model.norm(dim=1)).max())  # no token far off the rest
    assert rel < bound and worst < 2.5 * bound, (rel, worst)
    ref = _reference(*args, "nvfp4", sfmt, dtype=torch.float64)
    rel_exact = float((out.double() - ref.double()).norm() / ref.double().norm())
    assert rel_exact < 8e-2, rel_exact
    assert torch.equal(pc.moe_prefill_wgmma(xb, *args[1:], precision="fp8"), out), "not deterministic"


@pytest.mark.gpu
@pytest.mark.parametrize("fc1, fc2, persist", [(True, False, False), (False, True, False), (True, True, False),
                                                (True, True, True)])
@pytest.mark.parametrize("t, h, inter, e, k, s, skew, empty", [
    (77, 512, 256, 8, 2, 128, False, 2), (300, 6144, 256, 8, 2, 0, True, 3), (1000, 6144, 1536, 64, 8, 1536, False, 3)])
def test_fp8_with_the_warp_specialized_kernels_gpu(t: int, h: int, inter: int, e: int, k: int, s: int, skew: bool,
                                                   empty: int, fc1: bool, fc2: bool, persist: bool,
                                                   rng: torch.Generator, monkeypatch: pytest.MonkeyPatch) -> None:
    """WS_FC1 / WS_FC2 (routed tiles on moe_prefill_ws with their A rows' tile image, the shared expert's FC1 tiles
    there too (WS_SHARED) or, like its FC2 tiles, on the register-A kernels, act re-ordered by the quantizer where
    the two FCs' K orders differ): the fp8 model's bounds
    (test_fp8_build_gpu), NaN-poisoned workspaces, near the register-A build (the MMAs group K differently),
    deterministic, and graph replays with new tokens; persist: a CTA an SM looping over the work items."""
    from m3c.backends.kernels import moe_prefill_ws

    monkeypatch.setattr(moe_prefill_ws, "PERSIST", persist)
    monkeypatch.setattr(pc, "WS_FC1", fc1)
    monkeypatch.setattr(pc, "WS_FC2", fc2)
    monkeypatch.setattr(pc, "WS_SHARED_FC2", True)  # (the shared FC2 items: with the routed ones, or alone)
    x, ids, wts, w13, w2, sh13, sh2 = _problem(t, h, inter, e, k, s, "nvfp4", "mxfp8" if s else None, rng, skew=skew,
                                               empty=empty)
    args = [_to(v, "cuda") for v in (x.bfloat16().float(), ids, wts, w13, w2, sh13, sh2)]
    xb = args[0].bfloat16()
    out = torch.full((t, h), float("nan"), dtype=torch.bfloat16, device="cuda")
    assert pc.moe_prefill_wgmma(xb, *args[1:], out=out, precision="fp8") is out and torch.isfinite(out).all()
    model = _fp8_model(*args, shared_fc1=fc1 and pc.WS_SHARED, shared_fc2=True)
    rel = float((out.double() - model).norm() / model.norm())
    worst = float(((out.double() - model).norm(dim=1) / model.norm(dim=1)).max())
    assert rel < 3e-2 and worst < 7.5e-2, (rel, worst)
    assert torch.equal(pc.moe_prefill_wgmma(xb, *args[1:], precision="fp8"), out), "not deterministic"
    monkeypatch.setattr(pc, "WS_FC1", False)
    monkeypatch.setattr(pc, "WS_FC2", False)
    monkeypatch.setattr(pc, "WS_SHARED_FC2", False)
    plain = pc.moe_prefill_wgmma(xb, *args[1:], precision="fp8")
    # (WS_SHARED: the shared expert's FC1 on E4M3 tokens too, a few % of its part; 3.1% measured at S = I / 2, top-2)
    near = 5e-2 if s else 2e-2
    assert float((out.double() - plain.double()).norm() / plain.double().norm()) < near
    monkeypatch.setattr(pc, "WS_FC1", fc1)
    monkeypatch.setattr(pc, "WS_FC2", fc2)
    monkeypatch.setattr(pc, "WS_SHARED_FC2", True)
    if persist:  # which CTA runs a work item changes nothing: bitwise the plain grid's output
        monkeypatch.setattr(moe_prefill_ws, "PERSIST", False)
        assert torch.equal(pc.moe_prefill_wgmma(xb, *args[1:], precision="fp8"), out)
        monkeypatch.setattr(moe_prefill_ws, "PERSIST", True)
    xg = xb.clone()
    graph, got = torch.cuda.CUDAGraph(), torch.empty_like(out)
    with torch.cuda.graph(graph):
        pc.moe_prefill_wgmma(xg, *args[1:], out=got, precision="fp8")
    xg.copy_(torch.randn(xg.shape, generator=rng).to(xg))
    graph.replay()
    assert torch.equal(got, pc.moe_prefill_wgmma(xg, *args[1:], precision="fp8"))


@pytest.mark.gpu
@pytest.mark.parametrize("t, h, inter, e, k, s, skew, empty", [(300, 6144, 256, 8, 2, 128, True, 3),
                                                                (1000, 6144, 1536, 64, 8, 1536, False, 3)])
def test_fp8_lut_build_equals_the_default_build_gpu(t: int, h: int, inter: int, e: int, k: int, s: int, skew: bool,
                                                    empty: int, rng: torch.Generator,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """LUT (the E4M3 product tables looked up by scale byte from a shared table built once a CTA) makes the same
    tables as the loop's own e4m3_tables: the whole op's output is bitwise the default build's (NaN-poisoned)."""
    monkeypatch.setattr(pc, "WS_FC1", False)  # (LUT is the register-A kernels' knob: its routed FC1 and FC2 too)
    monkeypatch.setattr(pc, "WS_FC2", False)
    x, ids, wts, w13, w2, sh13, sh2 = _problem(t, h, inter, e, k, s, "nvfp4", "mxfp8", rng, skew=skew, empty=empty)
    args = [_to(v, "cuda") for v in (x.bfloat16(), ids, wts, w13, w2, sh13, sh2)]
    outs = []
    for lut in (False, True):
        monkeypatch.setattr(pc, "LUT", lut)
        out = torch.full((t, h), float("nan"), dtype=torch.bfloat16, device="cuda")
        outs.append(pc.moe_prefill_wgmma(*args, out=out, precision="fp8"))
    assert torch.isfinite(outs[1]).all() and torch.equal(outs[0], outs[1])


@pytest.mark.gpu
def test_fp8_row_quantizer_gpu(rng: torch.Generator) -> None:
    """moe_pf_quant: E4M3 rows with amax / 448 scales (an all-zero row, or one whose amax 448 / amax would overflow:
    zeros, scale 0), columns in fp8 K order when asked; one pass of the CTA's threads (K 640) and two (6144)."""
    spec = pc.specs("fp8")[2]
    for k in (640, 6144):
        src = (torch.randn(37, k, generator=rng) * torch.rand(37, 1, generator=rng) * 50).bfloat16().cuda()
        src[5] = 0
        src[6] *= 1e-38  # amax ~1e-37 (bf16 subnormals)
        for permute in (0, 1):
            dst = torch.full((37, k), 0x7F, dtype=torch.uint8, device="cuda")
            sc = torch.full((37,), float("nan"), device="cuda")
            jit_run(spec, (37,), [src, dst, sc, k, permute])
            v = src.float()[:, pc.fp8_k_order(k, "cuda")] if permute else src.float()
            amax = v.abs().amax(-1)
            assert torch.equal(sc, _div448(amax)) and float(sc[6]) == 0
            want = (v * _inv448(amax)[:, None]).to(torch.float8_e4m3fn).view(torch.uint8)
            assert torch.equal(dst, want)


@pytest.mark.gpu
def test_fp8_graph_replays_and_capture_needs_a_warm_up(rng: torch.Generator) -> None:
    """The fp8 build inside a CUDA graph: refused before its first eager call (the weights' exponents are computed
    there), then captured and replayed on new tokens and routing."""
    t, h, inter, e, k, s = 150, 512, 256, 8, 2, 256
    x, ids, wts, w13, w2, sh13, sh2 = _problem(t, h, inter, e, k, s, "nvfp4", "mxfp8", rng)
    args = [_to(v, "cuda") for v in (x.bfloat16(), ids, wts, w13, w2, sh13, sh2)]
    out = torch.empty(t, h, dtype=torch.bfloat16, device="cuda")
    pc.moe_prefill_wgmma(*args, out=out)  # the bf16 build's warm-up builds everything but the exponents
    torch.cuda.synchronize()
    with pytest.raises(moe_cuda.CaptureError), torch.cuda.graph(torch.cuda.CUDAGraph()):
        pc.moe_prefill_wgmma(*args, out=out, precision="fp8")
    pc.moe_prefill_wgmma(*args, out=out, precision="fp8")
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        pc.moe_prefill_wgmma(*args, out=out, precision="fp8")
    x2, ids2, wts2, *_ = _problem(t, h, inter, e, k, s, "nvfp4", "mxfp8", rng)
    for dst, src in zip(args[:3], (x2.bfloat16(), ids2, wts2)):
        dst.copy_(src)
    graph.replay()
    torch.cuda.synchronize()
    want = pc.moe_prefill_wgmma(*args, precision="fp8")
    assert torch.equal(out, want)
