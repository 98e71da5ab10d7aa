"""``moe_cuda.TIMELINE``, the benchmark probe behind ``benchmarks/bench_moe_cta_timeline.py``: FC1 and FC2 take one
more argument (a [grid, 8] int64 tensor per kernel, kept in ``moe_cuda.last_timeline``) only when it is on, their
SASS reads the global timer only then, and on the GPU the stamps are ordered, every CTA writes its entry and exit,
the experts it names are the routed ones, and the output stays bitwise the plain build's."""

from __future__ import annotations

import pytest
import torch
from test_moe_cuda_grid_twin import _launches

from m3c.backends.kernels import moe_cuda

SMALL = (6144, 1536, 64, 8, 1536)  # m3.1-small: H, I, E, top-k, S


@pytest.mark.parametrize("t", [1, 4, 16, 40])
@pytest.mark.parametrize("on", [False, True])
def test_the_probe_argument_only_when_on(t: int, on: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """With TIMELINE the FC1 / FC2 specs define it and take `tl` last, each a [grid, 8] int64 tensor; without it
    neither has the define or the argument (the plain builds' keys and arguments are untouched)."""
    monkeypatch.setattr(moe_cuda, "TIMELINE", on)
    moe_cuda.last_timeline.clear()
    launches = _launches(t, *SMALL)
    for i, kernel in enumerate(("moe_fc1", "moe_fc2")):
        spec, grid, args = launches[kernel]
        assert ("TIMELINE" in dict(spec.defines)) == on
        assert (spec.arg_types[-1][0] == "tl") == on and ("tl" in args) == on
        if on:
            assert args["tl"] is moe_cuda.last_timeline[i]
            assert tuple(args["tl"].shape) == (grid[0], 8) and args["tl"].dtype == torch.int64
    assert len(moe_cuda.last_timeline) == (2 if on else 0)


def test_only_the_probe_reads_the_timer() -> None:
    """Offline sm_90a: the folded T = 1 build's FC1 and FC2 read SR_GLOBALTIMERLO with TIMELINE, never without."""
    from m3c.backends.cuda_aot import compile_cuda

    for on in (False, True):
        specs = moe_cuda._mma_specs(6144, 1536, 1536, "bf16", 1, 4, 0, fold_act=True, fold_combine=True,
                                    timeline=on)
        sass = compile_cuda(specs[1], keep_sass=True).stages["sass"]
        for kernel in ("moe_fc1", "moe_fc2"):
            body = sass.split(f"Function : {kernel}")[1].split("Function : ")[0]
            assert ("SR_GLOBALTIMERLO" in body) == on, (kernel, on)


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 4, 16])
def test_stamps_are_ordered_and_the_output_unchanged_gpu(t: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """m3.1-small on the GPU, random routing: the probe build's output equals the plain build's bitwise; every CTA
    stamps entry <= exit; the CTAs with work stamp entry <= staging <= GEMV end <= exit and name a routed expert or
    the shared one (-1), with K range H / KS (FC1) or I (FC2's routed); those left without work name an unused slot."""
    from m3c.fused.moe import MegaMoE, random_moe

    h, inter, e, k, _ = SMALL
    gen = torch.Generator(device="cuda").manual_seed(int(torch.randint(0, 1 << 30, (1,))))
    moe = random_moe(h, inter, e, k, "mxfp8", gen, device="cuda")
    mm = MegaMoE.from_reference(moe)
    x = torch.randn(t, h, generator=gen, device="cuda").to(torch.bfloat16)
    plain = mm(x).clone()
    monkeypatch.setattr(moe_cuda, "TIMELINE", True)
    moe_cuda.last_timeline.clear()
    probe = mm(x)
    torch.cuda.synchronize()
    assert torch.equal(plain, probe)
    ids = torch.unique(moe.route(x.float())[0]).tolist()
    assert len(moe_cuda.last_timeline) == 2
    for kernel, tl in zip(("moe_fc1", "moe_fc2"), moe_cuda.last_timeline, strict=True):
        r = tl.cpu()
        entry, staged, gemv_end, exit_ = r[:, 0], r[:, 1], r[:, 2], r[:, 3]
        assert bool((entry > 0).all() and (exit_ >= entry).all()), kernel
        work = staged > 0
        assert bool(work.any())
        assert bool((staged[work] >= entry[work]).all() and (gemv_end[work] >= staged[work]).all()
                    and (exit_[work] >= gemv_end[work]).all()), kernel
        experts = set(r[work, 5].tolist())
        assert experts <= set(ids) | {-1} and -1 in experts, (kernel, experts, ids)
        assert set(r[~work, 5].tolist()) <= {-2, -1}, kernel
        assert bool((r[:, 4] < torch.cuda.get_device_properties(0).multi_processor_count).all())
        if kernel == "moe_fc2":
            assert set(r[work & (r[:, 5] >= 0), 7].tolist()) == {inter}


def test_one_launch_stamps_fc1s_items_then_fc2s(monkeypatch: pytest.MonkeyPatch) -> None:
    """With QUEUE (moe_experts) the probe passes one [n1 + n2, 8] tensor; last_timeline views its FC1 and FC2 rows."""
    monkeypatch.setattr(moe_cuda, "TIMELINE", True)
    monkeypatch.setattr(moe_cuda, "QUEUE", True)
    spec, _, args = _launches(1, *SMALL)["moe_experts"]
    n1, n2 = args["n1"], args["n2"]
    assert spec.arg_types[-1][0] == "tl" and tuple(args["tl"].shape) == (n1 + n2, 8)
    fc1, fc2 = moe_cuda.last_timeline
    assert tuple(fc1.shape) == (n1, 8) and tuple(fc2.shape) == (n2, 8)
    assert fc1._base is args["tl"] and fc2._base is args["tl"]  # views of the one tensor the kernel writes
    assert fc1.storage_offset() == 0 and fc2.storage_offset() == n1 * 8
