"""`from m3c.fused import MegaMoE`: the fused MoE block against the reference MoE it was built from."""

from __future__ import annotations

import pytest
import torch

from m3c.errors import ConfigError, ShapeError
from m3c.fused import MegaMoE
from m3c.fused import moe as fused_moe
from m3c.fused.moe import hot_routing, random_moe
from m3c.model_defs.config import QuantScheme
from m3c.model_defs.layers import MoE
from m3c.model_defs.presets import m31_tiny


def cuda_generator(rng: torch.Generator) -> torch.Generator:
    """A CUDA generator seeded from the test's rng (weights of m3.1-small size are drawn on the GPU)."""
    return torch.Generator("cuda").manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=rng)))



def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref.double()).norm() / ref.double().norm())


def test_from_reference_matches_and_reuses_workspace(rng: torch.Generator) -> None:
    """Decode through the door module: float32 within 1e-5, bf16 within 2% (vs the float32 reference);
    a second call reuses the cached workspace and gives the same bits."""
    moe = random_moe(128, 64, 8, 2, "mxfp8", rng)
    x = torch.randn(5, 128, generator=rng)
    for decode_kernel in (False, True):  # default: the grouped-GEMM kernels; or the one-launch decode kernel
        mm = MegaMoE.from_reference(moe, decode_kernel=decode_kernel)
        out = mm(x)
        assert _rel(out, moe(x)) < 1e-5
        assert torch.equal(mm(x), out) and len(mm._workspaces) == int(decode_kernel)
        xb = x.bfloat16()
        outb = mm(xb)
        assert outb.dtype == torch.bfloat16 and _rel(outb, moe(xb.float())) < 2e-2


def test_prefill_path_through_dispatcher(rng: torch.Generator) -> None:
    """T > 64 goes to the prefill kernels (no decode workspace) and still matches the reference."""
    moe = random_moe(128, 64, 8, 2, "none", rng)
    mm = MegaMoE.from_reference(moe)
    x = torch.randn(70, 128, generator=rng)
    assert _rel(mm(x), moe(x)) < 1e-5 and not mm._workspaces


def test_plain_cpu_runs_the_reference(monkeypatch: pytest.MonkeyPatch, rng: torch.Generator) -> None:
    """Without a GPU or the interpreter the module runs the reference composition."""
    monkeypatch.setattr(fused_moe, "interpreting", lambda: False)
    moe = random_moe(128, 64, 8, 2, "bf16", rng)
    x = torch.randn(3, 128, generator=rng)
    assert _rel(MegaMoE.from_reference(moe)(x), moe(x)) < 1e-6


def test_rejects_what_it_cannot_run(rng: torch.Generator) -> None:
    """MXFP8 routed experts and wrong token widths raise ShapeError naming the problem."""
    cfg = m31_tiny().replace(quant=QuantScheme("nvfp4", "nvfp4", "mxfp8", "mxfp8"))
    with pytest.raises(ShapeError, match="NVFP4"):
        MegaMoE.from_reference(MoE(cfg))
    mm = MegaMoE.from_reference(random_moe(128, 64, 8, 2, "none", rng))
    with pytest.raises(ShapeError, match=r"\[T, 128\]"):
        mm(torch.randn(2, 64))
    with pytest.raises(ConfigError, match="prefill_precision='fp4'"):
        MegaMoE.from_reference(random_moe(128, 64, 8, 2, "none", rng), prefill_precision="fp4")


@pytest.mark.parametrize("t,e,k,hot", [(40, 64, 8, 33), (5, 16, 4, 0), (64, 64, 8, 64)])
def test_hot_routing(t: int, e: int, k: int, hot: int, rng: torch.Generator) -> None:
    ids, w = hot_routing(t, e, k, hot, rng)
    assert ids.shape == w.shape == (t, k) and ids.dtype == torch.int64 and w.dtype == torch.float32
    assert int((ids == 0).sum()) == hot and bool((ids[:hot, 0] == 0).all())  # expert 0: the first `hot`, slot 0
    assert all(len(set(row)) == k for row in ids.tolist()) and int(ids.min()) >= 0 and int(ids.max()) < e
    assert bool((w > 0).all()) and torch.allclose(w.sum(dim=1), torch.ones(t))
    with pytest.raises(ShapeError, match="hot = 6 of T = 5"):
        hot_routing(5, e, k, 6, rng)


@pytest.mark.gpu
def test_m31_small_gpu(rng: torch.Generator) -> None:
    """m3.1-small block (64 experts of 6144×1536, top-8, MXFP8 shared) in bf16: decode and prefill sizes."""
    moe = random_moe(6144, 1536, 64, 8, "mxfp8", cuda_generator(rng), device="cuda")
    mm = MegaMoE.from_reference(moe)
    for t in (1, 16, 64, 65, 512):
        x = torch.randn(t, 6144, generator=rng).to("cuda", torch.bfloat16)
        assert _rel(mm(x), moe(x.float())) < 2e-2, t


@pytest.mark.gpu
def test_m31_small_fp8_prefill_gpu(rng: torch.Generator) -> None:
    """prefill_precision="fp8": the wgmma prefill's E4M3 routed tiles (a few percent from the float32 reference, not
    the bf16 path's bits); decode sizes are unchanged (bf16 kernels)."""
    moe = random_moe(6144, 1536, 64, 8, "mxfp8", cuda_generator(rng), device="cuda")
    bf, f8 = MegaMoE.from_reference(moe), MegaMoE.from_reference(moe, prefill_precision="fp8")
    x = torch.randn(16, 6144, generator=rng).to("cuda", torch.bfloat16)
    assert torch.equal(f8(x), bf(x))
    x = torch.randn(600, 6144, generator=rng).to("cuda", torch.bfloat16)
    out, ref = f8(x), moe(x.float())
    assert _rel(out, ref) < 8e-2 and not torch.equal(out, bf(x))
