"""``moe_cuda.PTXAS_OPT``: the decode builds with ptxas at another optimization level. In the SASS (offline sm_90a)
-O1 leaves each step's next weight loads at the top of the step, before its MMAs, where -O3 moves them among the
MMAs; on the GPU the output is bitwise the default build's (the same products in the same order)."""

from __future__ import annotations

import re

import pytest
import torch
from test_moe_cuda import _case, kernel_sass

from m3c.backends.kernels import moe_cuda


def _loop_load_positions(sass: str) -> list[list[int]]:
    """For each NVFP4 weight loop of the SASS (a backward branch's body with HMUL2s and HMMAs), each global load's
    count of the body's HMMAs before it."""
    ins = [(int(m[1], 16), line.split("*/", 1)[1].strip())
           for line in sass.splitlines() if (m := re.search(r"/\*([0-9a-f]{4,5})\*/", line))]
    loops = []
    for at, text in ins:
        target = re.search(r"BRA\s+.*?0x([0-9a-f]+)", text)
        if target and int(target[1], 16) < at:
            body = [b for a, b in ins if int(target[1], 16) <= a <= at]
            if sum("HMUL2" in b for b in body) >= 128 and sum("HMMA" in b for b in body) == 64:
                positions, seen = [], 0
                for b in body:
                    seen += "HMMA" in b
                    if re.search(r"\bLDG\.E\.NA", b):
                        positions.append(seen)
                loops.append(positions)
    return loops


@pytest.mark.parametrize("tokens", [1, 2, 9, 33])  # the folded, plain, NT = 1 looping and NT = 2 looping builds
def test_o1_issues_each_steps_weight_loads_before_its_mmas(tokens: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """At -O1 every weight load of an NVFP4 loop (two super-chunks a trip, 32 MMAs each) comes before the first MMA
    of its half (0 or 32 MMAs before it) and nothing spills; at -O3 some come later (the placement -O1 is for)."""
    build = moe_cuda.call_build(tokens, 6144, 1536, 64, 8, 1536)
    placements = {}
    for level in (3, 1):
        monkeypatch.setattr(moe_cuda, "PTXAS_OPT", level)
        specs = {sp.kernel: sp for sp in moe_cuda.mma_specs(6144, 1536, 1536, "bf16", *build)}
        assert all(sp.ptxas_opt == level for sp in specs.values())
        placements[level] = []
        for kernel in ("moe_fc1", "moe_fc2"):
            sass = kernel_sass(specs[kernel])
            loops = _loop_load_positions(sass)
            assert loops, kernel
            placements[level] += [p for loop in loops for p in loop]
            if level == 1:
                assert "STL" not in sass, kernel
    assert placements[1] and set(placements[1]) <= {0, 32}, placements[1]
    assert any(p not in (0, 32) for p in placements[3]), placements[3]


def test_the_level_is_in_the_key() -> None:
    """A build at another ptxas level is its own compiled binary (its key differs); -O3 keeps the keys of before."""
    plain = moe_cuda.mma_specs(6144, 1536, 1536, "bf16")
    other = moe_cuda._mma_specs(6144, 1536, 1536, "bf16", 1, moe_cuda.WARPS, 0, ptxas_opt=1)
    assert {sp.key() for sp in plain}.isdisjoint(sp.key() for sp in other)
    assert all(sp.ptxas_opt == 3 for sp in plain) and all(sp.ptxas_opt == 1 for sp in other)


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 4, 40])  # the folded, plain and NT = 2 looping builds
def test_output_is_bitwise_the_default_builds(t: int, monkeypatch: pytest.MonkeyPatch) -> None:
    moe, mm, x, ids, w = _case(t, 6144, 1536, 64, 8, "mxfp8", torch.bfloat16)
    w13, w2, s13, s2 = mm.weights()
    plain = moe_cuda.moe_decode_mma(x, ids, w.float(), w13, w2, s13, s2)
    monkeypatch.setattr(moe_cuda, "PTXAS_OPT", 1)
    out = torch.full_like(x, float("nan"))
    moe_cuda.moe_decode_mma(x, ids, w.float(), w13, w2, s13, s2, out=out)
    assert torch.equal(out, plain)
    truth = moe(x.float())
    assert float((out.float() - truth).norm() / truth.norm()) < 1.5e-2
