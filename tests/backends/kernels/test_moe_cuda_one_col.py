"""``moe_cuda.ONE_COL``: routed NVFP4 blocks of one token column scaled in float32 a chunk (``mma_nvfp4_one``). On the
CPU: only the folded builds take it, and their one-column weight loop is shorter than the plain NVFP4 loop, without
HMUL2 and without local memory. On the GPU: the decode against the plain build (float32 rounding apart) and the
reference, with and without the shared expert, replayed from a CUDA graph."""

from __future__ import annotations

import re

import pytest
import torch
from test_moe_cuda import _case, kernel_sass

from m3c.backends.kernels import moe_cuda


def weight_loops(sass: str) -> list[tuple[int, int]]:
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


def _specs(monkeypatch: pytest.MonkeyPatch, on: bool, fold: bool) -> dict:
    monkeypatch.setattr(moe_cuda, "ONE_COL", on)
    return {sp.kernel: sp for sp in moe_cuda.mma_specs(6144, 1536, 1536, "bf16", 1, False, fold)}


def test_only_the_folded_builds_take_it(monkeypatch: pytest.MonkeyPatch) -> None:
    for fold in (False, True):
        for kernel, spec in _specs(monkeypatch, True, fold).items():
            assert (("ONE_COL", 1) in spec.defines) == fold, (kernel, fold)


@pytest.mark.parametrize("kernel", ["moe_fc1", "moe_fc2"])
def test_one_column_loop_in_sass(kernel: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Offline sm_90a: the folded build gains a third weight loop (MXFP8, NVFP4, NVFP4 one column); the one-column
    loop has no HMUL2, at most 85% of the NVFP4 loop's instructions (1,059 against 1,291 in FC1) and at most one
    local-memory access (FC2's spill, one word)."""
    plain = weight_loops(kernel_sass(_specs(monkeypatch, False, True)[kernel]))
    sass = kernel_sass(_specs(monkeypatch, True, True)[kernel])
    loops = weight_loops(sass)
    assert len(plain) == 2 and len(loops) == 3, (plain, loops)
    bodies = [[line for line in sass.splitlines()
               if (m := re.search(r"/\*([0-9a-f]{4,5})\*/", line)) and a <= int(m.group(1), 16) <= b]
              for a, b in loops]
    nvfp4s = [body for body in bodies if sum("PRMT" in line for line in body) >= 256]  # (MXFP8's loop: none)
    one = [body for body in nvfp4s if not any("HMUL2" in line for line in body)]
    assert len(nvfp4s) == 2 and len(one) == 1
    nvfp4 = max(len(body) for body in nvfp4s if body is not one[0])
    assert len(one[0]) <= 0.85 * nvfp4, (len(one[0]), nvfp4)
    assert sum(bool(re.search(r"\b(LDL|STL)", line)) for line in one[0]) <= 1


@pytest.mark.gpu
@pytest.mark.parametrize("shared", ["mxfp8", "none"])
def test_one_column_decode_gpu(shared: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """T = 1 (the folded call): within float32 rounding of the plain build, near the reference; then replayed from a
    CUDA graph with new tokens (poisoned output)."""
    moe, mm, x, _, _ = _case(1, 6144, 1536, 64, 8, shared, torch.bfloat16)
    assert moe_cuda.call_build(1, 6144, 1536, 64, 8, 1536 if shared == "mxfp8" else 0)[2]
    monkeypatch.setattr(moe_cuda, "ONE_COL", False)
    plain = mm(x).float()
    monkeypatch.setattr(moe_cuda, "ONE_COL", True)
    one = mm(x).float()
    truth = moe(x.float())
    assert float((one - truth).norm() / truth.norm()) < 1.5e-2
    assert float((one - plain).norm() / plain.norm()) < 2e-3  # (bf16 output: a rounding step apart at most)
    static = x.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = mm(static)
    new = (torch.randn(x.shape, device="cuda") * 3).to(x.dtype)
    static.copy_(new)
    out.fill_(float("nan"))
    graph.replay()
    monkeypatch.setattr(moe_cuda, "ONE_COL", False)
    want = mm(new).float()
    assert float((out.float() - want).norm() / want.norm()) < 2e-3
