"""``moe_cuda.L2_HINT``: the weight codes' loads with L2's prefetch-size qualifier. Offline (sm_90a) every 16-byte
weight load of the FC1 / FC2 builds carries it (SASS ``LTC128B`` / ``LTC256B``) and nothing else changes; a value
other than 0 / 128 / 256 is refused; on the GPU the output is bitwise the default build's."""

from __future__ import annotations

import re

import pytest
import torch
from test_moe_cuda import _case, kernel_opcodes

from m3c.backends.kernels import moe_cuda
from m3c.errors import ConfigError


def _weight_loads(ops: list[str]) -> list[str]:
    """The 16-byte no-L1-allocate loads (the weight codes' only ones)."""
    return [op for op in ops if re.fullmatch(r"LDG\.E\.NA(\.LTC\d+B)?\.128\.CONSTANT", op)]


@pytest.mark.parametrize("tokens, hint", [(1, 256), (16, 128)])
def test_every_weight_load_carries_the_hint(tokens: int, hint: int, monkeypatch: pytest.MonkeyPatch) -> None:
    build = moe_cuda.call_build(tokens, 6144, 1536, 64, 8, 1536)
    plain = {sp.kernel: sp for sp in moe_cuda.mma_specs(6144, 1536, 1536, "bf16", *build)}
    monkeypatch.setattr(moe_cuda, "L2_HINT", hint)
    hinted = {sp.kernel: sp for sp in moe_cuda.mma_specs(6144, 1536, 1536, "bf16", *build)}
    for kernel in ("moe_fc1", "moe_fc2"):
        assert ("L2_HINT", hint) in hinted[kernel].defines and hinted[kernel].key() != plain[kernel].key()
        before, after = kernel_opcodes(plain[kernel]), kernel_opcodes(hinted[kernel])
        loads = _weight_loads(after)
        assert len(loads) == len(_weight_loads(before)) > 0
        assert set(loads) == {f"LDG.E.NA.LTC{hint}B.128.CONSTANT"}, (kernel, set(loads))
        strip = [re.sub(r"\.LTC\d+B", "", op) for op in after]
        assert strip == before, kernel  # the same instructions otherwise, in the same order


@pytest.mark.parametrize("bad", [64, 512, -1])
def test_other_sizes_are_refused(bad: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(moe_cuda, "L2_HINT", bad)
    with pytest.raises(ConfigError, match="L2_HINT"):
        moe_cuda.mma_specs(6144, 1536, 1536, "bf16")


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 4, 40])  # the folded, plain and NT = 2 looping builds
def test_output_is_bitwise_the_default_builds(t: int, monkeypatch: pytest.MonkeyPatch) -> None:
    moe, mm, x, ids, w = _case(t, 6144, 1536, 64, 8, "mxfp8", torch.bfloat16)
    w13, w2, s13, s2 = mm.weights()
    plain = moe_cuda.moe_decode_mma(x, ids, w.float(), w13, w2, s13, s2)
    monkeypatch.setattr(moe_cuda, "L2_HINT", 256)
    out = torch.full_like(x, float("nan"))
    moe_cuda.moe_decode_mma(x, ids, w.float(), w13, w2, s13, s2, out=out)
    assert torch.equal(out, plain)
    truth = moe(x.float())
    assert float((out.float() - truth).norm() / truth.norm()) < 1.5e-2
