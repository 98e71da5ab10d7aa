"""``moe_cuda.one_wave`` against what ptxas built: the CTAs an SM holds of each decode build's FC1 / FC2, from the
offline sm_90a cubin's registers and shared memory, must be what the wave (which decides the folds and the balanced
splits) counts; and a layout whose FC1 fits fewer CTAs an SM does not fold at a grid the 4-CTA count would take."""

from __future__ import annotations

import re

import pytest

from m3c.backends.cuda_aot import compile_cuda, cuobjdump
from m3c.backends.kernels import moe_cuda

REGS_PER_SM, WARPS_PER_SM = 65536, 64


def _usage(spec) -> tuple[int, int]:
    """(registers a thread, static + dynamic shared bytes) of the spec's kernel in its sm_90a cubin."""
    lines = cuobjdump(compile_cuda(spec).binary, "-res-usage").splitlines()
    at = next(i for i, line in enumerate(lines) if re.search(rf"Function {spec.kernel}\b", line))
    usage = lines[at + 1]
    return int(re.search(r"REG:(\d+)", usage)[1]), int(re.search(r"SHARED:(\d+)", usage)[1]) + spec.shared_bytes


def _resident(spec) -> int:
    """CTAs of this kernel an SM of sm_90 holds (registers allocated 256 a warp; 1 KB of shared memory a CTA)."""
    regs, smem = _usage(spec)
    warps = spec.num_warps
    by_regs = REGS_PER_SM // (-(-regs * 32 // 256) * 256 * warps)
    return min(by_regs, WARPS_PER_SM // warps, moe_cuda.SM_SHARED_BYTES // (smem + 1024))


@pytest.mark.parametrize("tokens,hidden,inter,shared", [(1, 6144, 1536, 1536), (16, 6144, 1536, 1536),
                                                        (40, 6144, 1536, 1536), (1, 7168, 2048, 1024),
                                                        (40, 7168, 2048, 1024)])
@pytest.mark.parametrize("natural", [False, True])
@pytest.mark.parametrize("fold", [False, True])
def test_one_wave_is_what_the_builds_hold(tokens: int, hidden: int, inter: int, shared: int, natural: bool,
                                          fold: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """one_wave's (FC1, FC2) CTAs = SMS x the CTAs an SM holds of each kernel as built (registers, shared memory),
    folded or not, prepacked or NATURAL (whose NT = 2 FC2 takes 211 registers: 2 CTAs an SM)."""
    monkeypatch.setattr(moe_cuda, "NATURAL", natural)
    nt, wide = moe_cuda.decode_build(tokens)
    specs = {sp.kernel: sp for sp in moe_cuda.mma_specs(hidden, inter, shared, "bf16", nt, wide, fold)}
    got = tuple(moe_cuda.SMS * _resident(specs[k]) for k in ("moe_fc1", "moe_fc2"))
    assert moe_cuda.one_wave(tokens, hidden, inter, shared) == got


def test_a_wide_fc1_that_holds_three_ctas_an_sm_does_not_fold() -> None:
    """H = 7168, I = 2048, top-6 at T = 1: FC1's staged tokens take 57 KB, 3 CTAs an SM; its 448-CTA grid (and
    FC2's) would fit a wave of 4 CTAs an SM, but FC1's real wave is 396: 1.13 waves, where a fold's release atomics
    cost every wave (session 31), so the call does not fold."""
    args = (1, 7168, 2048, 64, 6, 1024)
    grids = moe_cuda.decode_grids(*args)
    assert max(grids) <= 4 * moe_cuda.SMS and moe_cuda.one_wave(1, 7168, 2048, 1024) == (396, 528)
    assert not moe_cuda.decode_folds(*args) and not moe_cuda.call_build(*args)[2]
