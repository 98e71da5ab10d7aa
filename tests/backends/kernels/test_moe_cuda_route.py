"""The one-launch CUDA routing + token staging (``cuda/moe_route.cu``, :func:`m3c.backends.kernels.moe_cuda.route_stage`).

CPU: a Python twin of the kernel's split GEMV (lane chunks, butterfly sums, partial layout), its fixed-order merge
(one thread per output, ks order) and its routing (order keys, per-lane expert slots, redux
max / min rounds) against the reference routing, ties and NaN included; the offline sm_90a compile (SASS, no local
memory); the dispatch. GPU (H200): the kernel against ``fused_route`` and ``MoE.route``, graph replays, the staging
against ``moe_stage_x``, megamoe through the new path against the reference MoE."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from m3c.backends.cuda_aot import compile_cuda, cuobjdump, disassemble
from m3c.backends.kernels import moe_cuda
from m3c.errors import ShapeError
from m3c.model_defs.layers import route

THREADS = 256


# ------------------------------------------------------------------ the kernel's arithmetic, in Python


def order_key(v: torch.Tensor) -> torch.Tensor:
    """order_key() of moe_route.cu on float32 values: int64 keys, larger = larger value, NaN above +inf, -0 == +0."""
    b = v.to(torch.float32).view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    mag = b & 0x7FFFFFFF
    key = torch.where((b & 0x80000000) != 0, (~b) & 0xFFFFFFFF, b | 0x80000000)
    key = torch.where(mag == 0, torch.full_like(key, 0x80000000), key)
    return torch.where(mag > 0x7F800000, torch.full_like(key, 0xFFFFFFFF), key)


def _f32(v: float) -> float:
    return float(np.float32(v))


def twin_route_token(logit: torch.Tensor, bias: torch.Tensor, top_k: int, scale: float, norm: bool,
                     eslots: int) -> tuple[list[int], list[float]]:
    """route_token() of moe_route.cu for one token: lane l holds experts l + 32 i (i < ESLOTS); each round a warp max
    of the lanes' best keys, then the smallest index among the lanes holding it; the owner lane rescans."""
    e_count = logit.shape[0]
    s = torch.sigmoid(logit.to(torch.float32))
    keys = order_key(s + bias.to(torch.float32)).tolist()
    sc = s.tolist()
    lane_keys = [[keys[lane + 32 * i] if lane + 32 * i < e_count else 0 for i in range(eslots)] for lane in range(32)]

    def rescan(lane: int) -> tuple[int, int]:
        best, bidx = 0, 0xFFFFFFFF
        for i in range(eslots):
            if lane_keys[lane][i] > best:
                best, bidx = lane_keys[lane][i], lane + 32 * i
        return best, bidx

    state = [rescan(lane) for lane in range(32)]
    ids: list[int] = []
    for _ in range(top_k):
        m = max(b for b, _ in state)
        w = min(i if b == m else 0xFFFFFFFF for b, i in state)
        owner = [lane for lane in range(32) if state[lane][1] == w]
        assert len(owner) == 1 and w < e_count
        lane_keys[owner[0]][(w - owner[0]) // 32] = 0
        state[owner[0]] = rescan(owner[0])
        ids.append(w)
    sel = [np.float32(sc[i]) for i in ids]
    den = np.float32(0.0)
    if norm:
        for v in sel:
            den = np.float32(den + v)
        den = np.float32(den + np.float32(1e-20))
    with np.errstate(invalid="ignore"):
        wts = [_f32(np.float32((v / den) if norm else v) * np.float32(scale)) for v in sel]
    return ids, wts


def merge_passes(n: int, ksplit: int) -> list[list[int]]:
    """The outputs each thread of the last CTA sums (moe_route.cu's merge: MO outputs a thread a pass, warps whose
    outputs are all past n stop), checking each output is summed by exactly one thread."""
    mq = min(ksplit, 32)
    mo = max(1, 48 // mq)
    mine: list[list[int]] = [[] for _ in range(THREADS)]
    for base in range(0, n, THREADS * mo):
        for tid in range(THREADS):
            if base + (tid & ~31) >= n:
                continue
            mine[tid] += [o for i in range(mo) if (o := base + i * THREADS + tid) < n]
    assert sorted(o for m in mine for o in m) == list(range(n))
    return mine


def twin_logits(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """The kernel's logits [T, E]: per (expert, K slice) lane accumulators (fmaf over the lane's CH chunks, then
    x y z w), the warp's xor butterfly, then each output's partials summed in ks order (float32 throughout; the fma
    is emulated in float64, exact but for rare double roundings)."""
    t, h = x.shape
    e = gate.shape[0]
    ch, ksplit = moe_cuda.route_split(h, e)
    xf = x.to(torch.float32).to(torch.float64)
    g = gate.to(torch.float32).to(torch.float64)
    # k = ks 128 CH + 128 c + 4 lane + j
    xs = xf.reshape(t, ksplit, ch, 32, 4)
    gs = g.reshape(e, ksplit, ch, 32, 4)
    acc = torch.zeros(t, e, ksplit, 32, dtype=torch.float32)
    for c in range(ch):
        for j in range(4):
            prod = xs[:, None, :, c, :, j] * gs[None, :, :, c, :, j]  # exact in float64
            acc = (prod + acc.to(torch.float64)).to(torch.float32)
    lanes = torch.arange(32)
    for o in (16, 8, 4, 2, 1):
        acc = acc + acc[..., lanes ^ o]
    part = acc[..., 0].reshape(t * e, ksplit)  # every lane holds the sum; lane t stores token t's
    merge_passes(t * e, ksplit)
    out = torch.zeros(t * e, dtype=torch.float32)
    for q in range(ksplit):  # s = 0, then s += part[ks] for ks = 0, 1, ... (float32 adds)
        out = out + part[:, q]
    return out.reshape(t, e)


def twin_route_stage(x: torch.Tensor, gate: torch.Tensor, bias: torch.Tensor, top_k: int, scale: float,
                     norm: bool, logits: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids int64 [T, k], weights float32 [T, k]) as the kernel computes them (from `logits` if given)."""
    lg = twin_logits(x, gate) if logits is None else logits
    eslots = -(-gate.shape[0] // 32)
    rows = [twin_route_token(lg[i], bias, top_k, scale, norm, eslots) for i in range(lg.shape[0])]
    return (torch.tensor([r[0] for r in rows], dtype=torch.int64),
            torch.tensor([r[1] for r in rows], dtype=torch.float32))


def _reference(logits: torch.Tensor, bias: torch.Tensor, top_k: int, scale: float,
               norm: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's route() on given logits (an identity gate: each logit times 1 plus zeros, exact when finite)."""
    e = logits.shape[1]
    return route(logits, torch.eye(e), bias, top_k, norm, scale)


def _check_ids(ids: torch.Tensor, ref_ids: torch.Tensor, corrected: torch.Tensor, top_k: int,
               gap: float = 1e-5) -> torch.Tensor:
    """The same expert sets as the reference for every token whose k-th and (k+1)-th corrected scores are apart by
    > gap (other tokens may pick the other of two near-equal experts: the logits sum in another order; the order
    within a set is checked exactly elsewhere, on equal logits); returns those tokens."""
    top = corrected.sort(dim=-1, descending=True).values
    clear = (top[:, top_k - 1] - top[:, top_k]).abs() > gap if top.shape[1] > top_k else torch.ones(
        top.shape[0], dtype=torch.bool)
    clear = clear.to(ids.device)
    assert torch.equal(ids.sort(-1).values[clear], ref_ids.to(ids.device).sort(-1).values[clear])
    return clear


def _by_expert(ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The weights of each token in ascending expert order (to compare with a reference whose ties may order
    differently)."""
    return w.gather(1, ids.argsort(-1))


# ------------------------------------------------------------------ CPU: the twin against the reference


def test_order_key_sorts_as_torch_sort(rng: torch.Generator) -> None:
    specials = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), -float("nan"), 1e-45, -1e-45,
                             1.0, -1.0, 3.4e38, -3.4e38, 1.0, 0.0])
    v = torch.cat([specials, torch.randn(50, generator=rng), torch.randn(50, generator=rng).round()])
    key = order_key(v)
    assert int(key.min()) >= 0x007FFFFF  # 0 is free for "no candidate"
    order = sorted(range(v.numel()), key=lambda i: (-int(key[i]), i))
    want = torch.sort(v, descending=True, stable=True).indices.tolist()
    assert order == want


@pytest.mark.parametrize("t,e,k,norm", [(1, 64, 8, True), (3, 64, 8, False), (16, 8, 2, True), (5, 256, 8, True),
                                        (2, 40, 6, False), (4, 33, 33, True), (1, 256, 64, False)])
def test_twin_routing_matches_reference(t: int, e: int, k: int, norm: bool, rng: torch.Generator) -> None:
    logits = torch.randn(t, e, generator=rng) * 3
    bias = torch.randn(e, generator=rng) * 0.1
    ids, w = twin_route_stage(torch.empty(t, 0), torch.empty(e, 0), bias, k, 2.5, norm, logits=logits)
    rid, rw = _reference(logits, bias, k, 2.5, norm)
    assert torch.equal(ids, rid)
    torch.testing.assert_close(w, rw, rtol=2e-6, atol=0)


def test_twin_routing_ties_and_nan() -> None:
    e, k = 64, 8
    logits = torch.zeros(4, e)
    bias = torch.zeros(e)
    bias[[3, 35, 36, 60, 61, 62, 63]] = 0.3  # 7 winners in lanes 3 (slots 0, 1), 4, 28..31 (slot 1)
    logits[1, [40, 8, 9]] = 5.0  # equal scores above them: 8, 9 (slot 0) before 40 (slot 1 of lane 8)
    logits[2] = float("nan")  # every score NaN: experts 0..k-1 (torch.sort puts NaN first, stably)
    logits[3, [50, 10]] = float("nan")  # NaN scores first (smaller index first), then the others
    ids, w = twin_route_stage(torch.empty(4, 0), torch.empty(e, 0), bias, k, 2.5, True, logits=logits)
    # the reference's selection op on these scores (its F.linear would spread one NaN over the row)
    sel = torch.ops.m3c.topk(torch.sigmoid(logits) + bias, k)[1]
    assert torch.equal(ids, sel)
    assert ids[0].tolist() == [3, 35, 36, 60, 61, 62, 63, 0]
    assert ids[1].tolist() == [8, 9, 40, 3, 35, 36, 60, 61]
    assert ids[2].tolist() == list(range(k)) and torch.isnan(w[2]).all()
    assert ids[3].tolist()[:3] == [10, 50, 3] and torch.isnan(w[3]).all()  # NaN in the normalization: all NaN
    _, rw = _reference(logits[:2], bias, k, 2.5, True)
    torch.testing.assert_close(w[:2], rw, rtol=5e-7, atol=0)
    nan_tok = torch.full((1, 128), float("nan"))  # the reference's own path: a NaN token's logits are all NaN
    rid2, _ = route(nan_tok, torch.randn(e, 128), bias, k, True, 2.5)
    assert torch.equal(ids[2:3], rid2)


@pytest.mark.parametrize("t,e,ksplit", [(1, 64, 24), (16, 64, 24), (3, 256, 8), (1, 8, 48), (16, 256, 8),
                                        (7, 40, 5), (2, 1, 1), (1, 8, 128)])
def test_merge_sums_every_output_once(t: int, e: int, ksplit: int) -> None:
    mine = merge_passes(t * e, ksplit)
    busy = sum(bool(m) for m in mine)
    assert busy == min(THREADS, t * e)  # idle warps stop at once; every busy thread has an output


@pytest.mark.parametrize("h,e", [(6144, 64), (6144, 256), (7424, 64), (128, 8), (3072, 32), (6144, 1)])
def test_gemv_split_covers_k_once(h: int, e: int) -> None:
    ch, ksplit = moe_cuda.route_split(h, e)
    groups = -(-e // 8)
    assert ch * ksplit * 128 == h and (groups * ksplit <= moe_cuda._ROUTE_CTAS or ch == h // 128)
    ks = torch.arange(ksplit)[:, None, None, None]
    c = torch.arange(ch)[None, :, None, None]
    lane = torch.arange(32)[None, None, :, None]
    j = torch.arange(4)[None, None, None, :]
    k = ks * 128 * ch + 4 * lane + 128 * c + j  # the kernel's k0 + 128 c (+ the float4's element)
    assert torch.equal(k.reshape(-1).sort().values, torch.arange(h))
    if (h, e) == (6144, 64):
        assert (ch, ksplit) == (2, 24)  # 192 CTAs of 8 KB of the gate each (+ T staging CTAs)
    if (h, e) == (6144, 256):
        assert (ch, ksplit) == (6, 8)  # 256 CTAs of 24 KB


@pytest.mark.parametrize("t,e,k,dtype", [(1, 64, 8, torch.bfloat16), (3, 16, 4, torch.float32),
                                         (16, 8, 2, torch.bfloat16)])
def test_twin_route_stage_end_to_end(t: int, e: int, k: int, dtype: torch.dtype, rng: torch.Generator) -> None:
    """The twin's split GEMV + merge + routing vs the reference routing on fresh tokens (ties made on purpose)."""
    h = 512
    x = torch.randn(t, h, generator=rng).to(dtype)
    gate = torch.randn(e, h, generator=rng) * 0.05
    gate[e - 1] = gate[1]  # identical rows: bitwise equal logits in the kernel too (same order): a tie
    bias = torch.zeros(e)
    bias[[1, e - 1]] = 5.0  # both always chosen, the smaller index first
    logits = twin_logits(x, gate)
    ref_logits = F.linear(x.to(torch.float32), gate)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)
    ids, w = twin_route_stage(x, gate, bias, k, 2.5, True, logits=logits)
    rid, rw = route(x.to(torch.float32), gate, bias, k, True, 2.5)
    assert (ids[:, :2] == torch.tensor([1, e - 1])).all()
    clear = _check_ids(ids, rid, torch.sigmoid(ref_logits) + bias, k)
    torch.testing.assert_close(_by_expert(ids, w)[clear], _by_expert(rid, rw)[clear], rtol=1e-4, atol=0)


# ------------------------------------------------------------------ CPU: spec, offline compile, checks


def test_route_supported_and_spec() -> None:
    assert moe_cuda.route_supported(6144, 64, 8, "bf16", 1) is None
    assert moe_cuda.route_supported(6144, 256, 8, "fp32", 16) is None
    assert moe_cuda.route_supported(6144, 64, 8, "bf16", 17) is None  # the NT = 8 build: 17..64 tokens
    assert moe_cuda.route_supported(6144, 256, 8, "bf16", 64) is None  # 64 KB of logits: dynamic shared memory
    assert "1..64" in moe_cuda.route_supported(6144, 64, 8, "bf16", 65)
    assert [moe_cuda.route_nt(t) for t in (1, 8, 9, 16, 17, 64)] == [1, 1, 2, 2, 8, 8]
    # the offline lowering's token counts reach every build route_nt picks, each once
    builds = [moe_cuda.route_nt(t) for t in moe_cuda.ROUTE_BUILD_TOKENS]
    assert sorted(builds) == sorted({moe_cuda.route_nt(t) for t in range(1, moe_cuda.ROUTE_MAX_TOKENS + 1)})
    assert "at most 256" in moe_cuda.route_supported(6144, 512, 8, "bf16", 1)
    assert "top-64" in moe_cuda.route_supported(6144, 128, 65, "bf16", 1)
    assert "multiple of 128" in moe_cuda.route_supported(6144 + 64, 64, 8, "bf16", 1)
    spec = moe_cuda.route_stage_spec(6144, 64, "bf16", 1)
    assert spec is moe_cuda.route_stage_spec(6144, 64, "bf16", 1)  # cached
    assert dict(spec.defines) == {"NT": 1, "ACT_BF16": 1, "CH": 2, "KSPLIT": 24, "ESLOTS": 2}
    assert spec.num_warps == 8 and dict(spec.arg_types)["scale"] == "fp32" and len(spec.arg_types) == 16
    # the merged logits in dynamic shared memory, 8 NT tokens x 32 ESLOTS experts: 2 KB here, 64 KB at most
    assert spec.shared_bytes == 8 * 64 * 4
    assert moe_cuda.route_stage_spec(6144, 256, "bf16", 8).shared_bytes == 64 * 256 * 4
    assert dict(moe_cuda.route_stage_spec(6144, 256, "fp32", 2).defines) == {"NT": 2, "ACT_BF16": 0, "CH": 6,
                                                                             "KSPLIT": 8, "ESLOTS": 8}


def test_route_stage_rejects_bad_inputs() -> None:
    x = torch.empty(2, 256, dtype=torch.bfloat16, device="meta")
    g = torch.empty(8, 256, device="meta")
    b = torch.empty(8, device="meta")
    with pytest.raises(ShapeError, match="float32"):
        moe_cuda.route_stage(x, g.to(torch.bfloat16), b, 2, 1.0, True)
    with pytest.raises(ShapeError, match="bias"):
        moe_cuda.route_stage(x, g, torch.empty(7, device="meta"), 2, 1.0, True)
    with pytest.raises(ShapeError, match="tokens"):
        moe_cuda.route_stage(x.to(torch.float16), g, b, 2, 1.0, True)
    with pytest.raises(ShapeError, match=r"1\.\.64"):
        moe_cuda.route_stage(torch.empty(65, 256, device="meta"), g, b, 2, 1.0, True)
    with pytest.raises(ShapeError, match="top-64"):
        moe_cuda.route_stage(x, g, b, 9, 1.0, True)
    with pytest.raises(ShapeError, match="logits"):
        moe_cuda.route_stage(x, g, b, 2, 1.0, True, logits=torch.empty(2, 9, device="meta"))
    with pytest.raises(ShapeError, match="x16"):
        moe_cuda.moe_decode_mma(x, torch.empty(2, 2, dtype=torch.int64, device="meta"),
                                torch.empty(2, 2, device="meta"), None, None, None, None,
                                x16=torch.empty(2, 256, dtype=torch.float16, device="meta"))


def test_route_stage_launch_args_on_meta() -> None:
    """One launch with the spec's argument count, T + groups x KSPLIT CTAs, the workspace persistent."""
    seen: list = []
    x = torch.empty(3, 6144, dtype=torch.float32, device="meta")
    g = torch.empty(64, 6144, device="meta")
    b = torch.empty(64, device="meta")
    for _ in range(2):
        ids, w, x16, xmult = moe_cuda.route_stage(x, g, b, 8, 2.5, False,
                                                  runner=lambda sp, grid, args: seen.append((sp, grid, args)))
    assert ids.shape == (3, 8) and ids.dtype == torch.int64 and w.dtype == torch.float32
    assert x16.shape == (3, 6144) and x16.dtype == torch.float16 and xmult.shape == (3,)
    (sp, grid, args), (_, _, args2) = seen
    assert sp.kernel == "moe_route_stage" and dict(sp.defines)["ACT_BF16"] == 0
    assert grid == (3 + 8 * 24,) and len(args) == len(sp.arg_types)
    names = [n for n, _ in sp.arg_types]
    assert args[names.index("scale")] == 2.5 and args[names.index("norm")] == 0 and args[names.index("T")] == 3
    assert args[names.index("part")] is args2[names.index("part")]  # persistent: graph replays keep the address
    assert args[names.index("counter")] is args2[names.index("counter")]


@pytest.mark.parametrize("h,e,act,nt", [(6144, 64, "bf16", 1), (6144, 64, "bf16", 2), (6144, 64, "fp32", 2),
                                         (6144, 256, "bf16", 1), (6144, 256, "bf16", 2), (6144, 64, "bf16", 8),
                                         (6144, 256, "fp32", 8)])
def test_route_kernel_compiles_for_sm90a(h: int, e: int, act: str, nt: int) -> None:
    spec = moe_cuda.route_stage_spec(h, e, act, nt)
    ck = compile_cuda(spec, "sm_90a")
    assert ck.binary[:4] == b"\x7fELF" and ck.name == "moe_route_stage"
    sass = disassemble(ck.binary)
    assert "REDUX.MAX" in sass and "REDUX.MIN" in sass  # the warp top-k rounds
    assert "ATOMG.E.ADD" in sass and "MEMBAR" in sass  # the arrival
    assert "LDG.E.NA.128" in sass  # the gate streamed in 16-byte loads
    # no local arrays; at most one register parked on the stack around the IEEE division's subroutine calls
    assert sass.count("STL") <= 1, sass.count("STL")
    res = cuobjdump(ck.binary, "-res-usage")
    assert "LOCAL:0" in res, res


# ------------------------------------------------------------------ GPU (H200)


def _gpu_case(t: int, e: int, k: int, dtype: torch.dtype, norm: bool, h: int = 6144):
    gen = torch.Generator(device="cuda").manual_seed(int(torch.randint(0, 2**31, ())))
    x = torch.randn(t, h, generator=gen, device="cuda").to(dtype)
    gate = torch.randn(e, h, generator=gen, device="cuda") * h ** -0.5
    bias = torch.randn(e, generator=gen, device="cuda") * 0.05
    return x, gate, bias


@pytest.mark.gpu
@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("t,e", [(1, 64), (3, 64), (16, 64), (40, 64), (64, 64), (1, 256), (3, 256), (16, 256),
                                 (40, 256), (64, 256)])
def test_route_stage_matches_fused_route_and_reference(t: int, dtype: torch.dtype, norm: bool, e: int) -> None:
    from m3c.backends.kernels.moe_routing import fused_route

    k = 8
    x, gate, bias = _gpu_case(t, e, k, dtype, norm)
    gate[e - 3] = gate[2]  # a constructed tie: equal rows give bitwise equal logits (same summation order)
    bias[e - 3] = bias[2] = 10.0  # both win; 2 first
    lg = torch.empty(t, e, device="cuda")
    ids, w, x16, xmult = moe_cuda.route_stage(x, gate, bias, k, 2.5, norm, logits=lg)
    ref_logits = F.linear(x.float(), gate)
    torch.testing.assert_close(lg, ref_logits, rtol=1e-4, atol=1e-5)
    assert torch.equal(lg[:, 2], lg[:, e - 3]) and (ids[:, :2] == torch.tensor([2, e - 3], device="cuda")).all()
    fi, fw, _ = fused_route(lg, bias, top_k=k, routed_scaling_factor=2.5, norm_topk_prob=norm)
    assert torch.equal(ids, fi)  # same logits: the same selection
    torch.testing.assert_close(w, fw, rtol=1e-6, atol=0)  # normalization summed in another order: ~1 ulp
    rid, rw = route(x.float(), gate, bias, k, norm, 2.5)
    clear = _check_ids(ids, rid, torch.sigmoid(ref_logits) + bias, k)
    torch.testing.assert_close(_by_expert(ids, w)[clear], _by_expert(rid, rw)[clear], rtol=1e-4, atol=1e-6)
    # the staged tokens are bitwise what moe_stage_x writes
    stage = moe_cuda.mma_specs(6144, 1536, 1536, "bf16" if dtype == torch.bfloat16 else "fp32", 1)[0]
    x16_ref = torch.empty_like(x16)
    xmult_ref = torch.empty_like(xmult)
    from m3c.backends.triton_aot import jit_run

    jit_run(stage, (t,), [x, 6144, x16_ref, xmult_ref])
    assert torch.equal(x16.view(torch.int16), x16_ref.view(torch.int16)) and torch.equal(xmult, xmult_ref)


@pytest.mark.gpu
def test_route_stage_ties_nan_and_twin() -> None:
    """All-equal scores (zero gate and bias): experts 0..k-1; a NaN token: experts 0..k-1 with NaN weights (as the
    reference); the other tokens unaffected; the CPU twin on the kernel's logits gives the kernel's ids and weights."""
    t, e, k = 3, 64, 8
    x, gate, bias = _gpu_case(t, e, k, torch.bfloat16, True)
    x[1] = float("nan")
    lg = torch.empty(t, e, device="cuda")
    ids, w, _, _ = moe_cuda.route_stage(x, gate, bias, k, 2.5, True, logits=lg)
    assert ids[1].tolist() == list(range(k)) and torch.isnan(w[1]).all()
    rid, _ = route(x.float(), gate, bias, k, True, 2.5)
    assert torch.equal(ids[1], rid[1])
    tid, tw = twin_route_stage(x.cpu(), gate.cpu(), bias.cpu(), k, 2.5, True, logits=lg.cpu())
    assert torch.equal(ids.cpu(), tid)
    torch.testing.assert_close(w.cpu(), tw, rtol=1e-6, atol=0, equal_nan=True)  # CPU vs GPU sigmoid: an ulp
    ids0, w0, _, _ = moe_cuda.route_stage(x[[0]], torch.zeros_like(gate), torch.zeros_like(bias), k, 1.0, True)
    assert ids0[0].tolist() == list(range(k))
    torch.testing.assert_close(w0, torch.full_like(w0, 1 / k))


@pytest.mark.gpu
def test_route_stage_logits_match_twin_bitwise_mostly() -> None:
    """The kernel's summation order is the twin's: logits equal but for the twin's rare double roundings."""
    x, gate, bias = _gpu_case(2, 64, 8, torch.bfloat16, True)
    lg = torch.empty(2, 64, device="cuda")
    moe_cuda.route_stage(x, gate, bias, 8, 2.5, True, logits=lg)
    twin = twin_logits(x.cpu(), gate.cpu())
    assert (lg.cpu() == twin).float().mean() > 0.95
    torch.testing.assert_close(lg.cpu(), twin, rtol=1e-6, atol=1e-7)


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 16, 64])
def test_route_stage_graph_replays_are_identical(t: int) -> None:
    x, gate, bias = _gpu_case(t, 64, 8, torch.bfloat16, True)
    eager = moe_cuda.route_stage(x, gate, bias, 8, 2.5, True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = moe_cuda.route_stage(x, gate, bias, 8, 2.5, True)
    results = []
    for _ in range(2):
        for o in outs:
            o.zero_()
        graph.replay()
        torch.cuda.synchronize()
        results.append([o.clone() for o in outs])
    for a, b, c in zip(results[0], results[1], eager, strict=True):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)) and torch.equal(a.view(torch.uint8),
                                                                                     c.view(torch.uint8))
    counter = moe_cuda._route_workspace(x.device, 64, 24)[1]
    assert int(counter) == 0  # the kernel leaves the counter at zero


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 3, 16, 40])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("norm", [True, False])
def test_megamoe_cuda_route_matches_reference(t: int, dtype: torch.dtype, norm: bool,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    from m3c.backends.kernels import megamoe as mm_mod
    from m3c.fused.moe import MegaMoE, random_moe

    gen = torch.Generator(device="cuda").manual_seed(int(torch.randint(0, 2**31, ())))
    moe = random_moe(6144, 1536, 64, 8, "mxfp8", gen, device="cuda", norm_topk_prob=norm)
    mm = MegaMoE.from_reference(moe)
    x = torch.randn(t, 6144, generator=gen, device="cuda").to(dtype)
    w13, w2, s13, s2 = mm.weights()
    cfg = moe.cfg
    launches: list[str] = []

    def runner(sp, grid, args):
        from m3c.backends.triton_aot import jit_run

        launches.append(getattr(sp, "kernel", "triton"))
        jit_run(sp, grid, args)

    def call(route_on: bool) -> torch.Tensor:
        monkeypatch.setattr(mm_mod, "CUDA_ROUTE", route_on)
        return mm_mod.megamoe(x, mm.gate_w32, mm.bias, w13, w2, s13, s2, top_k=8,
                              routed_scaling_factor=cfg.routed_scaling_factor, norm_topk_prob=norm, runner=runner)

    out = call(True)
    folds = moe_cuda.decode_folds(t, 6144, 1536, 64, 8, 1536)  # (one token: act and combine folded into FC1 / FC2)
    assert launches == ["moe_route_stage", "moe_fc1", *(() if folds else ("moe_act",)), "moe_fc2",
                        *(() if folds else ("moe_combine",))]
    old = call(False)
    truth = moe(x.float())
    err = float((out.float() - truth).norm() / truth.norm())
    old_err = float((old.float() - truth).norm() / truth.norm())
    assert torch.isfinite(out).all() and err < 1.5e-2, (err, old_err)
