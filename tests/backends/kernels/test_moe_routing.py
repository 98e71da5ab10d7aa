"""Device routing for MegaMoE: ids / weights bitwise as MoE.route (ties to the smaller expert), expert segments."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from m3c.backends.kernels.moe_routing import expert_permutation, expert_segments, fused_route, moe_route
from m3c.errors import ShapeError
from m3c.fused.moe import random_moe


def cuda_generator(rng: torch.Generator) -> torch.Generator:
    """A CUDA generator seeded from the test's rng (weights of m3.1-small size are drawn on the GPU)."""
    return torch.Generator("cuda").manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=rng)))



def _route(moe, x):
    cfg = moe.cfg
    return moe_route(x, moe.gate.weight, moe.e_score_correction_bias, top_k=cfg.num_experts_per_tok,
                     routed_scaling_factor=cfg.routed_scaling_factor, norm_topk_prob=cfg.norm_topk_prob)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("norm", [True, False])
def test_route_matches_reference_bitwise(dtype: torch.dtype, norm: bool, rng: torch.Generator) -> None:
    """Same ids and bitwise-equal weights as MoE.route for float32 / bf16 / float64 tokens."""
    moe = random_moe(128, 64, 8, 3, "none", rng, norm_topk_prob=norm)
    for t in (1, 5, 64):
        x = torch.randn(t, 128, generator=rng).to(dtype)
        ids, w = _route(moe, x)
        rids, rw = moe.route(x)
        assert torch.equal(ids, rids) and ids.dtype == torch.int64
        assert torch.equal(w, rw) and w.dtype == rw.dtype


def test_route_ties_go_to_the_smaller_expert(rng: torch.Generator) -> None:
    """Equal corrected scores pick the smaller expert index first, as the reference's stable top-k."""
    moe = random_moe(128, 64, 8, 2, "none", rng)
    with torch.no_grad():
        moe.gate.weight[5] = moe.gate.weight[1]
        moe.gate.weight[6] = moe.gate.weight[1]
        moe.e_score_correction_bias.fill_(0.0)
        moe.e_score_correction_bias[[1, 5, 6]] = 50.0  # these three always win; two of them are chosen
    x = torch.randn(9, 128, generator=rng)
    ids, w = _route(moe, x)
    assert torch.equal(ids, torch.tensor([[1, 5]] * 9))
    assert torch.equal(ids, moe.route(x)[0]) and torch.equal(w, moe.route(x)[1])
    with torch.no_grad():
        moe.gate.weight.zero_()
        moe.e_score_correction_bias.zero_()
    ids, _ = _route(moe, x)  # all scores equal: experts 0, 1
    assert torch.equal(ids, torch.tensor([[0, 1]] * 9))


@pytest.mark.parametrize("t,k,e", [(1, 2, 8), (3, 2, 8), (16, 4, 8), (5, 8, 64), (64, 8, 64)])
def test_expert_segments(t: int, k: int, e: int, rng: torch.Generator) -> None:
    """Pairs sorted by expert (stable), touched experts ascending with their start / count, untouched count 0."""
    ids = torch.stack([torch.randperm(e, generator=rng)[:k] for _ in range(t)])
    if t > 2:
        ids[: t // 2, 0] = 1  # crowd one expert
    seg = expert_segments(ids, e)
    flat = ids.reshape(-1).tolist()
    touched = sorted(set(flat))
    a = min(e, t * k)
    assert seg.max_active == a and int(seg.num_active) == len(touched)
    assert sorted(seg.sorted_pairs.tolist()) == list(range(t * k))
    for i in range(a):
        cnt, start = int(seg.slot_count[i]), int(seg.slot_start[i])
        if i < len(touched):
            ex = touched[i]
            assert int(seg.slot_expert[i]) == ex
            want = [p for p, x in enumerate(flat) if x == ex]
            assert cnt == len(want) and seg.sorted_pairs[start:start + cnt].tolist() == want
        else:
            assert cnt == 0 and int(seg.slot_expert[i]) not in touched
    want_offs = [sum(x < ex for x in flat) for ex in range(e + 1)]
    assert seg.offsets.tolist() == want_offs  # every expert's first sorted pair (untouched ones too), then T·k
    order, offs = expert_permutation(ids, e)  # what moe_prefill uses when no permutation is passed
    assert torch.equal(order, seg.sorted_pairs) and torch.equal(offs, seg.offsets)
    for name in ("sorted_pairs", "slot_expert", "slot_start", "slot_count", "num_active", "offsets"):
        assert getattr(seg, name).dtype == torch.int32, name


def _check_fused(moe, x) -> None:
    """fused_route vs moe_route + expert_segments: same ids and segments, weights within 2 ulp-ish."""
    cfg = moe.cfg
    e = cfg.n_routed_experts
    ids, w = _route(moe, x)
    seg = expert_segments(ids, e)
    logits = F.linear(x.float(), moe.gate.weight.float())
    fi, fw, fs = fused_route(logits, moe.e_score_correction_bias, top_k=cfg.num_experts_per_tok,
                             routed_scaling_factor=cfg.routed_scaling_factor, norm_topk_prob=cfg.norm_topk_prob)
    na = int(seg.num_active)
    assert torch.equal(fi, ids)
    torch.testing.assert_close(fw, w, rtol=5e-7, atol=0)
    assert torch.equal(fs.sorted_pairs, seg.sorted_pairs) and int(fs.num_active) == na
    assert torch.equal(fs.offsets, seg.offsets)
    assert torch.equal(fs.slot_count, seg.slot_count)
    assert torch.equal(fs.slot_expert[:na], seg.slot_expert[:na]) and torch.equal(fs.slot_start[:na], seg.slot_start[:na])


@pytest.mark.parametrize("t,e,k,norm", [(1, 8, 2, True), (3, 8, 2, False), (16, 8, 4, True), (40, 64, 8, True),
                                        (64, 256, 8, False)])
def test_fused_route_matches_torch_routing(t: int, e: int, k: int, norm: bool, rng: torch.Generator) -> None:
    """The one-launch decode routing gives the torch routing's ids, weights (to rounding) and segments."""
    moe = random_moe(128, 64, e, k, "none", rng, norm_topk_prob=norm)
    x = torch.randn(t, 128, generator=rng).to(torch.bfloat16)
    _check_fused(moe, x)


def test_fused_route_ties(rng: torch.Generator) -> None:
    """Exact ties in the fused routing go to the smaller expert, with every pair segmented."""
    moe = random_moe(128, 64, 8, 2, "none", rng)
    with torch.no_grad():
        moe.gate.weight.zero_()
        moe.e_score_correction_bias.zero_()
        moe.e_score_correction_bias[[3, 4, 7]] = 1.0
    x = torch.randn(6, 128, generator=rng)
    _check_fused(moe, x)
    logits = F.linear(x, moe.gate.weight.float())
    ids, _, seg = fused_route(logits, moe.e_score_correction_bias, top_k=2, routed_scaling_factor=1.0,
                              norm_topk_prob=True)
    assert torch.equal(ids, torch.tensor([[3, 4]] * 6)) and int(seg.num_active) == 2


def test_bad_inputs_raise(rng: torch.Generator) -> None:
    """Wrong shapes name what is wrong."""
    moe = random_moe(128, 64, 8, 2, "none", rng)
    with pytest.raises(ShapeError, match="gate weight"):
        moe_route(torch.randn(2, 64), moe.gate.weight, moe.e_score_correction_bias, top_k=2,
                  routed_scaling_factor=1.0, norm_topk_prob=True)
    with pytest.raises(ShapeError, match="top_k"):
        moe_route(torch.randn(2, 128), moe.gate.weight, moe.e_score_correction_bias, top_k=9,
                  routed_scaling_factor=1.0, norm_topk_prob=True)
    with pytest.raises(ShapeError, match="topk_ids"):
        expert_segments(torch.zeros(4, dtype=torch.int64), 8)
    with pytest.raises(ShapeError, match=r"1\.\.64 tokens"):
        fused_route(torch.zeros(65, 8), torch.zeros(8), top_k=2, routed_scaling_factor=1.0, norm_topk_prob=True)


@pytest.mark.gpu
def test_routing_m31_small_graph_capture(rng: torch.Generator) -> None:
    """m3.1-small router (64 experts, top-8): bitwise MoE.route on the GPU, and routing + segments replay
    from a CUDA graph (no host sync) with the same results."""
    moe = random_moe(6144, 1536, 64, 8, "mxfp8", cuda_generator(rng), device="cuda")
    for t in (1, 4, 16, 64, 512):
        x = torch.randn(t, 6144, generator=rng).to("cuda", torch.bfloat16)
        ids, w = _route(moe, x)
        rids, rw = moe.route(x)
        assert torch.equal(ids, rids) and torch.equal(w, rw)
        seg = expert_segments(ids, 64)
        if t <= 64:
            _check_fused(moe, x)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            gi, gw = _route(moe, x)
            gseg = expert_segments(gi, 64)
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(gi, ids) and torch.equal(gw, w)
        for name in ("sorted_pairs", "slot_expert", "slot_start", "slot_count", "num_active", "offsets"):
            assert torch.equal(getattr(gseg, name), getattr(seg, name)), name


@pytest.mark.gpu
@pytest.mark.parametrize("experts,top_k", [(8, 2), (16, 1), (64, 8)])
def test_fused_routing_small_expert_counts_gpu(experts: int, top_k: int, rng: torch.Generator) -> None:
    """The one-program routing kernel at few experts / pairs (tiny preset: 8 experts top-2) on the GPU."""
    moe = random_moe(128, 64, experts, top_k, "mxfp8", cuda_generator(rng), device="cuda")
    for t in (1, 3, 16, 17, 64):
        _check_fused(moe, torch.randn(t, 128, generator=rng).to("cuda"))


def test_gate_weight_converts_once_per_version(rng: torch.Generator) -> None:
    """The router weight is converted once per (tensor, version): repeated steps reuse it, an in-place
    update of the weight is seen."""
    from m3c.backends.kernels.moe_routing import gate_weight

    g = torch.randn(8, 16, generator=rng).bfloat16()
    first = gate_weight(g, torch.float32)
    assert gate_weight(g, torch.float32) is first and torch.equal(first, g.float())
    g.mul_(2)
    again = gate_weight(g, torch.float32)
    assert again is not first and torch.equal(again, g.float())
    assert gate_weight(g, torch.float64).dtype == torch.float64
