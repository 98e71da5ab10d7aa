"""MegaMoE decode kernel (one persistent launch) against the reference MoE block, tiny in the interpreter,
m3.1-small on the GPU; launched specs are listed and AOT-compile for sm_90a."""

from __future__ import annotations

import pytest
import torch
from moe_weights import meta_weights

from m3c.backends.kernels import moe_decode as md
from m3c.backends.kernels.megamoe import megamoe, megamoe_specs, megamoe_supported
from m3c.backends.kernels.moe_routing import expert_segments, moe_route
from m3c.errors import ShapeError
from m3c.fused.moe import MegaMoE, random_moe


def cuda_generator(rng: torch.Generator) -> torch.Generator:
    """A CUDA generator seeded from the test's rng (weights of m3.1-small size are drawn on the GPU)."""
    return torch.Generator("cuda").manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=rng)))



def _weights(moe):
    return MegaMoE.from_reference(moe).weights()


def _run(moe, x, **kw):
    cfg = moe.cfg
    w13, w2, s13, s2 = _weights(moe)
    return megamoe(x, moe.gate.weight, moe.e_score_correction_bias, w13, w2, s13, s2,
                   top_k=cfg.num_experts_per_tok, routed_scaling_factor=cfg.routed_scaling_factor,
                   norm_topk_prob=cfg.norm_topk_prob, **{"decode_kernel": True} | kw)


def check_close(out: torch.Tensor, moe, x: torch.Tensor) -> None:
    """float32: within 5e-5 of the reference (max error / RMS); bf16: against the reference evaluated in
    float32 on the same bf16 tokens, 2% relative Frobenius and 15% max / RMS (the bf16 reference itself
    sits ~0.7% / ~5% away)."""
    assert out.dtype == x.dtype and out.shape == x.shape and bool(torch.isfinite(out).all())
    ref = moe(x.float()).double()
    d = out.double() - ref
    rms = ref.pow(2).mean().sqrt()
    if x.dtype == torch.float32:
        assert float(d.abs().max() / rms) < 5e-5
    else:
        assert float(d.norm() / ref.norm()) < 2e-2
        assert float(d.abs().max() / rms) < 0.15


CASES = [("mxfp8", torch.float32, 1), ("mxfp8", torch.bfloat16, 3), ("mxfp8", torch.bfloat16, 20),
         ("bf16", torch.float32, 16), ("bf16", torch.bfloat16, 64), ("none", torch.float32, 64),
         ("none", torch.bfloat16, 1)]  # token buckets 16, 32 and 64


@pytest.mark.parametrize("shared,dtype,t", CASES)
def test_decode_matches_reference(shared: str, dtype: torch.dtype, t: int, rng: torch.Generator) -> None:
    """8 experts, top-2, hidden 128, inter 64: routing + one launch vs MoE.forward; output poisoned first."""
    moe = random_moe(128, 64, 8, 2, shared, rng)
    x = torch.randn(t, 128, generator=rng).to(dtype)
    out = torch.full((t, 128), float("nan"), dtype=dtype)
    assert _run(moe, x, out=out) is out
    check_close(out, moe, x)


def test_crowded_and_untouched_experts_reused_workspace(rng: torch.Generator) -> None:
    """All 16 tokens on two experts (six untouched), 3 persistent programs, one workspace for two calls:
    the counters reset themselves, the results are identical (deterministic combine) and correct."""
    moe = random_moe(128, 64, 8, 2, "mxfp8", rng)
    with torch.no_grad():
        moe.e_score_correction_bias[[2, 6]] += 100.0
    x = torch.randn(16, 128, generator=rng)
    ids, w = moe_route(x, moe.gate.weight, moe.e_score_correction_bias, top_k=2, routed_scaling_factor=2.5,
                       norm_topk_prob=True)
    seg = expert_segments(ids, 8)
    assert int(seg.num_active) == 2
    w13, w2, s13, s2 = _weights(moe)
    ws = md.DecodeWorkspace.create(16, 128, 64, 64, 8, 2, torch.float32, "cpu")
    outs = []
    for _ in range(2):
        ws.part.fill_(float("nan"))
        ws.act.fill_(float("nan"))
        outs.append(md.moe_decode(x, seg, w.float(), w13, w2, s13, s2, workspace=ws, programs=3))
        assert int(ws.counters.abs().sum()) == 0
    assert torch.equal(outs[0], outs[1])
    check_close(outs[0], moe, x)


def test_every_code_and_scale_byte(rng: torch.Generator) -> None:
    """Random E2M1 code bytes and E4M3 scale bytes over the whole finite range (zero, subnormal, negative
    scales), float32 tokens: the in-register dequantization matches the reference's decoder."""
    moe = random_moe(128, 64, 8, 2, "mxfp8", rng)
    finite = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F], dtype=torch.uint8)
    with torch.no_grad():
        for lin in (moe.w13, moe.w2):
            lin.weight.copy_(torch.randint(0, 256, lin.weight.shape, generator=rng, dtype=torch.uint8))
            pick = torch.randint(0, finite.numel(), lin.weight_scale.shape, generator=rng)
            lin.weight_scale.copy_(finite[pick].view(torch.float8_e4m3fn))
    x = torch.randn(4, 128, generator=rng)
    check_close(_run(moe, x), moe, x)


def test_launched_specs_are_listed_and_compile(monkeypatch: pytest.MonkeyPatch) -> None:
    """At m3.1-small shapes (meta tensors: no data, no host sync possible) megamoe launches, for every
    T <= 64, one routing and one decode spec that megamoe_specs lists (argument counts match; one grid
    per T); the decode spec and a routing spec AOT-compile for sm_90a without spills."""
    from m3c.backends.kernels import moe_routing
    from m3c.backends.triton_aot import compile_kernels

    monkeypatch.setattr(md, "interpreting", lambda: False)
    monkeypatch.setattr(moe_routing, "interpreting", lambda: False)
    h, inter, e, k, s = 6144, 1536, 64, 8, 1536
    specs = megamoe_specs(h, inter, e, k, s, "bf16", "nvfp4", "mxfp8") + md.decode_specs(
        h, inter, e, k, s, "bf16", "mxfp8")
    listed = {sp.key() for sp in specs}
    w13, w2, s13, s2 = meta_weights(e, h, inter, s)
    gate = torch.empty(e, h, device="meta")
    bias = torch.empty(e, device="meta")
    used = set()
    for t in (1, 4, 16, 17, 33, 64):
        seen: list = []
        record = seen.append
        x = torch.empty(t, h, dtype=torch.bfloat16, device="meta")
        megamoe(x, gate, bias, w13, w2, s13, s2, top_k=k, routed_scaling_factor=2.5, norm_topk_prob=True,
                decode_kernel=True, runner=lambda sp, grid, args, record=record: record((sp, grid, args)))
        assert [sp.family for sp, _, _ in seen] == ["moe_route", "megamoe_decode"], t
        for sp, _, args in seen:
            assert sp.key() in listed and len(args) == len(sp.arg_types), (t, sp.family)
            used.add(sp.key())
    assert len(used) == 6  # three token buckets of each
    built = compile_kernels([next(sp for sp in specs if sp.family == f) for f in ("megamoe_decode", "moe_route")])
    for b in built:
        ptx = b.stages["ptx"]
        assert b.binary and "ld.local" not in ptx and "st.local" not in ptx, b.name


def test_default_path_launches_only_listed_specs(monkeypatch: pytest.MonkeyPatch) -> None:
    """The default dispatch (one routing launch for T <= 64, then the grouped GEMMs) launches only specs that
    megamoe_specs lists, which is all the offline lowering compiles (meta tensors: no data, no sync)."""
    from m3c.backends.kernels import moe_prefill, moe_routing

    for mod in (md, moe_routing, moe_prefill):
        monkeypatch.setattr(mod, "interpreting", lambda: False)
    h, inter, e, k, s = 6144, 1536, 64, 8, 1536
    listed = {sp.key() for sp in megamoe_specs(h, inter, e, k, s, "bf16", "nvfp4", "mxfp8")}
    w13, w2, s13, s2 = meta_weights(e, h, inter, s)
    for t in (1, 16, 64, 65, 512):
        seen: list = []
        x = torch.empty(t, h, dtype=torch.bfloat16, device="meta")
        megamoe(x, torch.empty(e, h, device="meta"), torch.empty(e, device="meta"), w13, w2, s13, s2, top_k=k,
                routed_scaling_factor=2.5, norm_topk_prob=True,
                runner=lambda sp, grid, args, seen=seen: seen.append(sp))
        families = [sp.family for sp in seen]
        assert "megamoe_decode" not in families and "moe_prefill_fc1" in families, (t, families)
        assert ("moe_route" in families) == (t <= 64), (t, families)
        assert all(sp.key() in listed for sp in seen), t


def test_unsupported_layouts_and_bad_inputs(rng: torch.Generator) -> None:
    """megamoe_supported names the reason; the launcher rejects too many tokens and mismatched weights."""
    assert "NVFP4" in megamoe_supported(128, 64, 8, 2, 64, "bf16", "mxfp8", "mxfp8")
    assert "fp16" in megamoe_supported(128, 64, 8, 2, 64, "fp16", "nvfp4", "mxfp8")
    assert "multiples of 32" in megamoe_supported(100, 64, 8, 2, 64, "bf16", "nvfp4", "none")
    assert megamoe_supported(128, 64, 8, 2, 64, "fp32", "nvfp4", "bf16") is None
    moe = random_moe(128, 64, 8, 2, "mxfp8", rng)
    w13, w2, s13, s2 = _weights(moe)
    x = torch.randn(65, 128)
    ids, w = moe.route(x)
    with pytest.raises(ShapeError, match=r"1\.\.64 tokens"):
        md.moe_decode(x, expert_segments(ids, 8), w.float(), w13, w2, s13, s2)
    x = x[:4]
    ids, w = moe.route(x)
    with pytest.raises(ShapeError, match="w2"):
        md.moe_decode(x, expert_segments(ids, 8), w.float(), w13, w13, s13, s2)
    with pytest.raises(ShapeError, match="segments"):
        md.moe_decode(x, expert_segments(ids[:2], 8), w.float(), w13, w2, s13, s2)
    with pytest.raises(ShapeError, match="one device"):
        megamoe(x.to("meta"), moe.gate.weight, moe.e_score_correction_bias, w13, w2, s13, s2, top_k=2,
                routed_scaling_factor=2.5, norm_topk_prob=True)


@pytest.mark.gpu
@pytest.mark.parametrize("shared", ["mxfp8", "bf16"])
def test_decode_m31_small_gpu(shared: str, rng: torch.Generator) -> None:
    """m3.1-small (64 experts of 6144×1536, top-8, one shared expert): T = 1, 4, 16, 64 in bf16 and float32,
    then a CUDA-graph capture replayed twice (self-resetting counters) gives the eager result bitwise."""
    moe = random_moe(6144, 1536, 64, 8, shared, cuda_generator(rng), device="cuda")
    for dtype in (torch.bfloat16, torch.float32):
        for t in (1, 4, 16, 64):
            x = torch.randn(t, 6144, generator=rng).to("cuda", dtype)
            out = torch.full((t, 6144), float("nan"), dtype=dtype, device="cuda")
            _run(moe, x, out=out)
            check_close(out, moe, x)
    x = torch.randn(16, 6144, generator=rng).to("cuda", torch.bfloat16)
    eager = _run(moe, x)
    ws = md.DecodeWorkspace.create(16, 6144, 1536, 1536, 64, 8, torch.bfloat16, "cuda")
    _run(moe, x, workspace=ws)  # warm up (JIT compile) outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = _run(moe, x, workspace=ws)
    for _ in range(2):
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager)
    assert int(ws.counters.abs().sum()) == 0
