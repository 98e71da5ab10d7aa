"""``moe_cuda.BALANCE_FC1``: FC1 as one wave, the shared expert's items as the plain grid's and the routed units
balanced around them (``cuda/moe_decode_balanced.cuh``). On the CPU: the host's twin of the kernel's schedule (every
routed unit once, each row block's partials dense and within h's bound, the CTAs' bytes level), the launches a call makes (meta tensors), and the offline build (no 64-bit division
subroutine, no local memory in the weight loops). On the GPU: the decode against the reference and the plain grid,
hot and invalid routing, graph replays."""

from __future__ import annotations

import re

import pytest
import torch
from test_moe_cuda import _case, kernel_sass
from test_moe_cuda_grid_twin import _launches

from m3c.backends.kernels import moe_cuda

SMALL = (6144, 1536, 64, 8, 1536)  # m3.1-small: H, I, E, top-k, S


def _check_schedule(t: int, layout: tuple[int, int, int, int, int], touched: int) -> list[int]:
    """Assert the twin's routed schedule covers every unit once with dense, consecutive partials per row block, and
    that the CTAs' bytes are balanced; return the routed units each CTA streams."""
    hidden, inter, _, _, shared = layout
    grid, gs, a, _, go, per = moe_cuda._balanced_plan(t, *layout, touched)
    segs = moe_cuda.balanced_segments(t, *layout, touched)
    assert len(segs) == grid > gs
    seen: dict[int, list[tuple[int, int, int, int, int]]] = {}  # row block -> (partial, count, first, units, cta)
    for c, cta in enumerate(segs):
        for block, part, count, first, units in cta:
            seen.setdefault(block, []).append((part, count, first, units, c))
    assert sorted(seen) == list(range(touched * (2 * inter // 128)))
    for block, parts in seen.items():
        parts.sort()
        assert [p for p, *_ in parts] == list(range(len(parts))), block  # dense partials 0..count-1
        assert {n for _, n, *_ in parts} == {len(parts)}, block  # every segment knows the block's count
        ctas = [c for *_, c in parts]
        assert ctas == list(range(ctas[0], ctas[0] + len(parts))), block  # consecutive CTAs
        pos = 0
        for _, _, first, units, _ in parts:  # the K ranges tile the block in partial order
            assert first == pos and units > 0
            pos += units
        assert pos == per, block
    units = [sum(s[4] for s in cta) for cta in segs]
    assert sum(units) == touched * (2 * inter // 128) * per
    assert units[:gs] == [a] * gs  # each shared CTA: its item and A routed units
    others = units[gs:gs + go]
    assert min(others) >= 1 and max(others) - min(others) <= 1 and not any(units[gs + go:])
    if shared and a:  # a shared CTA's bytes within a unit of the others' (its item in routed units: e)
        e = (hidden // (gs // (2 * shared // 128))) * 33 / 4608
        assert a + e <= max(others) + 1 and a + e + 1 >= min(others)
    return units


@pytest.mark.parametrize("t, layout, touched", [
    (1, SMALL, 8), (4, SMALL, 19), (4, SMALL, 32), (2, SMALL, 1), (1, (6144, 1536, 64, 8, 0), 8),
    (3, (1024, 256, 16, 4, 256), 9), (1, (1024, 512, 16, 4, 1024), 4), (4, (512, 256, 8, 2, 0), 1)])
def test_schedule_streams_every_routed_unit_once(t: int, layout: tuple[int, int, int, int, int],
                                                 touched: int) -> None:
    """The twin of fc1_balanced's schedule: each routed unit once, each row block's partials dense (0..count - 1,
    one consecutive CTA each, K ranges in order), the shared CTAs' bytes (item + A units) level with the others'."""
    _check_schedule(t, layout, touched)


def test_schedule_random_layouts_within_the_partial_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fresh random layouts, token counts and touched counts: the schedule checks hold, and no row block gets more
    partials than h holds (balanced_partials, for the grid a call launches)."""
    monkeypatch.setattr(moe_cuda, "BALANCE_FC1", True)
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    for _ in range(30):
        hidden = 256 * int(torch.randint(1, 25, (), generator=gen))
        layout = (hidden, 128 * int(torch.randint(1, 17, (), generator=gen)), 64, 8,
                  128 * int(torch.randint(0, 9, (), generator=gen)))
        t = int(torch.randint(1, 5, (), generator=gen))
        grid, gs = moe_cuda._balanced_plan(t, *layout, 1)[:2]
        if grid <= gs:
            continue
        touched = int(torch.randint(1, min(64, t * 8) + 1, (), generator=gen))
        _check_schedule(t, layout, touched)
        most = max(s[2] for cta in moe_cuda.balanced_segments(t, *layout, touched) for s in cta)
        assert most <= moe_cuda.balanced_partials(t, *layout), layout


def test_balanced_launches(monkeypatch: pytest.MonkeyPatch) -> None:
    """m3.1-small, meta tensors: with the knob on, T = 1..4 launch FC1 balanced over one wave (the BALANCE build,
    nseg), h with room for its partials, and moe_act with nseg / ids / E (T = 1: act launched, the combine still
    folded); T = 5 (its segments would not fit FC1's shared memory) and the knob off launch the plain grid."""
    for on, t, balanced in ((True, 1, True), (True, 4, True), (True, 5, False), (False, 1, False)):
        monkeypatch.setattr(moe_cuda, "BALANCE_FC1", on)
        launches = _launches(t, *SMALL)
        spec, grid, args = launches["moe_fc1"]
        assert ("BALANCE" in dict(spec.defines)) == balanced == ("nseg" in args), (on, t)
        assert moe_cuda.call_build(t, *SMALL)[3] == balanced
        if not balanced:
            continue
        assert grid == (moe_cuda.one_wave(t, *SMALL[:2], SMALL[4])[0],) == (528,)
        assert args["h"].shape[0] == moe_cuda.balanced_partials(t, *SMALL) >= args["KSs"]
        assert args["nseg"].numel() == 64 * 3072 // 128 + 3072 // 128
        act = launches["moe_act"][2]
        assert act["nseg"] is args["nseg"] and act["ids"] is args["ids"] and act["E"] == 64
        assert ("moe_combine" in launches) == (t > 1)


def _weight_loops(sass: str) -> list[tuple[int, int]]:
    """The innermost loops (backward branches) of a kernel's SASS that hold tensor-core MMAs: its weight streams."""
    rows = []
    for line in sass.splitlines():
        m = re.search(r"/\*([0-9a-f]{4,5})\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)([^;]*)", line)
        if m:
            rows.append((int(m.group(1), 16), m.group(2), m.group(3)))
    loops = []
    for addr, op, arg in rows:
        target = re.search(r"0x([0-9a-f]+)", arg)
        if op.startswith("BRA") and target and int(target.group(1), 16) < addr:
            loops.append((int(target.group(1), 16), addr))
    mma = [a for a, op, _ in rows if op.startswith("HMMA")]
    holding = [(a, b) for a, b in loops if any(a <= x <= b for x in mma)]
    return [(a, b) for a, b in holding if not any((c, d) != (a, b) and a <= c and d <= b for c, d in holding)]


def test_balanced_build_in_sass() -> None:
    """Offline sm_90a, m3.1-small: the balanced FC1 (plain and with the combine folded) calls no subroutine (its
    schedule is 32-bit: a 64-bit division would be one), and its weight loops (MXFP8 and NVFP4) hold no local
    memory access, as the plain FC1's."""
    for fold in (False, True):
        spec = moe_cuda.mma_specs(6144, 1536, 1536, "bf16", 1, False, fold, True)[1]
        assert ("BALANCE", 1) in spec.defines and spec.kernel == "moe_fc1"
        sass = kernel_sass(spec)
        assert "CALL" not in sass
        loops = _weight_loops(sass)
        assert len(loops) == 2, loops
        for a, b in loops:
            body = [line for line in sass.splitlines()
                    if (m := re.search(r"/\*([0-9a-f]{4,5})\*/", line)) and a <= int(m.group(1), 16) <= b]
            assert not any(re.search(r"\b(LDL|STL)", line) for line in body), (fold, hex(a), hex(b))


@pytest.mark.gpu
@pytest.mark.parametrize("t, hot, invalid, shared", [(1, 0, False, "mxfp8"), (2, 2, False, "mxfp8"),
                                                     (3, 0, True, "mxfp8"), (4, 4, False, "mxfp8"),
                                                     (4, 0, False, "mxfp8"), (3, 0, True, "none")])
def test_balanced_decode_gpu(t: int, hot: int, invalid: bool, shared: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """m3.1-small (or without its shared expert), fresh tokens and routing (`hot` tokens on expert 0; `invalid`: one
    id out of range, its token NaN): the balanced FC1's output is near the reference and the plain grid's (the K sums
    split otherwise), equal call after call (deterministic), and replayed from a CUDA graph with new tokens."""
    from m3c.fused.moe import hot_routing

    layout = (*SMALL[:4], SMALL[4] if shared != "none" else 0)
    moe, mm, x, _, _ = _case(t, *SMALL[:4], shared, torch.bfloat16)
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    ids, w = hot_routing(t, 64, 8, hot, gen, "cuda")
    if invalid:
        ids[t - 1, 3] = 64
    w13, w2, s13, s2 = mm.weights()

    def run(tokens: torch.Tensor, on: bool) -> torch.Tensor:
        monkeypatch.setattr(moe_cuda, "BALANCE_FC1", on)
        assert moe_cuda.call_build(t, *layout)[3] == on
        out = torch.full_like(tokens, float("nan"))
        return moe_cuda.moe_decode_mma(tokens, ids, w, w13, w2, s13, s2, out=out)

    valid = slice(0, t - 1) if invalid else slice(0, t)  # (the reference takes the valid tokens' routing only)
    moe.route = lambda _x: (ids[valid], w[valid])
    plain, got = run(x, False), run(x, True)
    truth = moe(x[valid].float())
    err = float((got[valid].float() - truth).norm() / truth.norm())
    assert err < 1.5e-2, err
    diff = float((got[valid].float() - plain[valid].float()).norm() / plain[valid].float().norm())
    assert diff < 2e-3, diff
    assert torch.isfinite(got[valid]).all() and (not invalid or torch.isnan(got[t - 1]).all())
    same = lambda a, b: torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0))  # noqa: E731  (the invalid token's NaN)
    assert same(run(x, True), got)
    static = x.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run(static, True)
    for scale in (1.0, 40.0):
        new = (torch.randn(x.shape, device="cuda") * scale).to(x.dtype)
        static.copy_(new)
        out.fill_(float("nan"))
        graph.replay()
        assert same(out, run(new, True)), scale


def test_balanced_build_takes_the_probe(monkeypatch: pytest.MonkeyPatch) -> None:
    """With TIMELINE the balanced FC1 is a probe build too (``bench_moe_cta_timeline.py``): it takes `tl` after
    `nseg`, a [grid, 8] int64 tensor, and its SASS reads the global timer; the plain balanced build does not."""
    monkeypatch.setattr(moe_cuda, "BALANCE_FC1", True)
    for on in (False, True):
        monkeypatch.setattr(moe_cuda, "TIMELINE", on)
        spec, grid, args = _launches(1, *SMALL)["moe_fc1"]
        assert ("BALANCE", 1) in spec.defines and ("TIMELINE" in dict(spec.defines)) == on
        names = [n for n, _ in spec.arg_types]
        assert names[-2:] == ["nseg", "tl"] if on else names[-1] == "nseg"
        if on:
            assert tuple(args["tl"].shape) == (grid[0], 8)
        assert ("SR_GLOBALTIMERLO" in kernel_sass(spec)) == on
