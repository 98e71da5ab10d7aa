"""The CUDA C++ MSA sparse-attention decode kernel (m3c/backends/kernels/msa_attention_cuda.py; ATTN_CUDA, on by default).

CPU: lane-level twins of the kernel's fragment algebra — V's interleaved (key A, key B) pairs for every lane, and one
64-key step (S = Q K^T from the lanes' K quarters, P from the S fragments, O = P V from the lanes' 8-byte V slices)
against the dense computation —, the offline sm_90a build, and the dispatch with ATTN_CUDA on and off. GPU (`-m gpu`): the
kernel against the reference at m3.1-small shapes, other head groups and block sizes, splits, graph replays.
"""

from __future__ import annotations

import pytest
import torch
from test_msa_attention import _case, _reference, _rel
from test_msa_indexer_cuda import M32, _decode8, _f16_pair, _prmt

from m3c.backends.cuda_aot import CudaKernelSpec, compile_cuda, disassemble
from m3c.backends.kernels import msa_attention as ma
from m3c.backends.kernels import msa_attention_cuda as mac
from m3c.model_defs import quant


def _interleave(a: torch.Tensor, b: torch.Tensor, sel: int) -> torch.Tensor:
    """The kernel's interleave (two keys' words -> nibbles A0 B0 A1 B1 A2 B2 A3 B3 of bytes `sel` picks)."""
    x = _prmt(a, b, sel)
    lo4, hi4 = x & 0x0F0F0F0F, (x >> 4) & 0x0F0F0F0F
    return (_prmt(lo4, hi4, 0x6240) | (_prmt(lo4, hi4, 0x7351) << 4)) & M32


def _v_pairs(va: torch.Tensor, vb: torch.Tensor, sa: torch.Tensor, sb: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """v_pairs: 8 code bytes of keys A and B (as two u32 words each, [..., 2]) and their E4M3 scale bytes -> the 16
    (A, B) value pairs (float64 lo / hi halves, [..., 16]), scales applied."""
    words = [_interleave(va[..., 0], vb[..., 0], 0x5140), _interleave(va[..., 0], vb[..., 0], 0x7362),
             _interleave(va[..., 1], vb[..., 1], 0x5140), _interleave(va[..., 1], vb[..., 1], 0x7362)]
    fa = sa.to(torch.uint8).view(torch.float8_e4m3fn).double()
    fb = sb.to(torch.uint8).view(torch.float8_e4m3fn).double()
    lo, hi = [], []
    for w in words:
        for p in _decode8(w):
            pl, ph = _f16_pair(p)
            lo.append(pl * fa)
            hi.append(ph * fb)
    return torch.stack(lo, -1), torch.stack(hi, -1)


def _dequant(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return quant.nvfp4_dequantize(quant.NVFP4Tensor(codes, scales.view(torch.float8_e4m3fn), None)).double()


def _words(codes: torch.Tensor) -> torch.Tensor:
    return codes.contiguous().view(torch.int32).to(torch.int64) & M32


def test_v_pairs_every_lane(rng: torch.Generator) -> None:
    """Lane group g's pairs out[jd] are (key A, key B) at dim 16 g + jd, times each key's scale (group g), exactly."""
    codes = torch.randint(0, 256, (2, 64), generator=rng, dtype=torch.uint8)
    scales = torch.randint(0, 0x7F, (2, 8), generator=rng, dtype=torch.uint8)
    dense = _dequant(codes, scales)  # [2 keys, 128 dims]
    for g in range(8):
        lo, hi = _v_pairs(_words(codes[0, 8 * g: 8 * g + 8]), _words(codes[1, 8 * g: 8 * g + 8]),
                          scales[0, g].long(), scales[1, g].long())
        assert torch.equal(lo, dense[0, 16 * g: 16 * g + 16]) and torch.equal(hi, dense[1, 16 * g: 16 * g + 16])


def _twin_step(q: torch.Tensor, kc: torch.Tensor, ksc: torch.Tensor, vc: torch.Tensor, vsc: torch.Tensor,
               last: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One 64-key step of one warp, through the kernel's lane formulas: (O [16, 128], l [16]) with m = the row max
    (a single step). q [16, 128] bf16; K / V codes [64, 64] and scales [64, 8] bytes; keys past `last` masked."""
    qf = q.float()
    e = torch.where(qf.abs().amax(-1) > 0, torch.frexp(qf.abs().amax(-1)).exponent - 1 - 14, 0)
    qs = (qf.double() * torch.exp2(-e.double())[:, None]).half().double()  # staged [16, 128]
    s = torch.zeros(16, 64, dtype=torch.float64)
    for j in range(8):
        for n in range(8):  # B column n = lane group g = n: key 8 j + n
            key = 8 * j + n
            for c in range(4):
                kw = _words(kc[key, 16 * c: 16 * c + 16])
                s16 = ksc[key, 2 * c].long() | (ksc[key, 2 * c + 1].long() << 8)
                sc = [(_prmt(s16, 0, i | (i << 4)) & 0xFF).to(torch.uint8).view(torch.float8_e4m3fn).double()
                      for i in (0, 1)]
                for w in range(4):
                    p = _decode8(kw[w])
                    for e2 in range(2):
                        st = 2 * w + e2
                        for half, pair in ((0, p[2 * e2]), (1, p[2 * e2 + 1])):  # b0: dims 32c+4s+{0,1}; b1: +{2,3}
                            blo, bhi = _f16_pair(pair)
                            d0 = 32 * c + 4 * st + 2 * half
                            s[:, key] += qs[:, d0] * blo * sc[w >> 1] + qs[:, d0 + 1] * bhi * sc[w >> 1]
    s = s * torch.exp2(e.double())[:, None]
    s[:, last + 1:] = float("-inf")
    m = s.amax(-1, keepdim=True)
    p = torch.exp(s - m)
    l_sum = p.sum(-1)
    ph = p.half().double()  # P in f16
    o = torch.zeros(16, 128, dtype=torch.float64)
    for kk in range(4):
        for c in range(4):
            keys = [16 * kk + 2 * c, 16 * kk + 2 * c + 1, 16 * kk + 2 * c + 8, 16 * kk + 2 * c + 9]
            for n in range(8):  # lane group g = n: dims 16 n + jd
                vis = [k <= last for k in keys]
                w = [_words(vc[k, 8 * n: 8 * n + 8]) if v else torch.zeros(2, dtype=torch.int64)
                     for k, v in zip(keys, vis)]
                sb = [vsc[k, n].long() if v else torch.tensor(0) for k, v in zip(keys, vis)]
                b0 = _v_pairs(w[0], w[1], sb[0], sb[1])
                b1 = _v_pairs(w[2], w[3], sb[2], sb[3])
                for jd in range(16):
                    o[:, 16 * n + jd] += (ph[:, keys[0]] * b0[0][jd] + ph[:, keys[1]] * b0[1][jd]
                                          + ph[:, keys[2]] * b1[0][jd] + ph[:, keys[3]] * b1[1][jd])
    return o, l_sum


@pytest.mark.parametrize("last", [63, 40])
def test_step_twin_equals_dense_attention(last: int, rng: torch.Generator) -> None:
    """The twin of one step equals dense attention over the dequantized keys (P rounded to f16 as the kernel does);
    NaN-poisoned V rows past `last` do not leak."""
    q = torch.randn(16, 128, generator=rng).to(torch.bfloat16)
    kc = torch.randint(0, 256, (64, 64), generator=rng, dtype=torch.uint8)
    vc = torch.randint(0, 256, (64, 64), generator=rng, dtype=torch.uint8)
    ksc = torch.randint(40, 64, (64, 8), generator=rng, dtype=torch.uint8)
    vsc = torch.randint(40, 64, (64, 8), generator=rng, dtype=torch.uint8)
    vsc[last + 1:] = 0xFF  # NaN scales past the last visible key
    k, v = _dequant(kc, ksc), _dequant(vc, vsc)
    s = q.double() @ k.T
    s[:, last + 1:] = float("-inf")
    p = torch.exp(s - s.amax(-1, keepdim=True))
    want_o = p.half().double() @ torch.nan_to_num(v.masked_fill(torch.arange(64)[:, None] > last, 0.0))
    o, l_sum = _twin_step(q, kc, ksc, vc, vsc, last)
    assert torch.isfinite(o).all()
    assert torch.allclose(l_sum, p.sum(-1), rtol=1e-12)
    assert torch.allclose(o, want_o, rtol=1e-9, atol=1e-9 * want_o.abs().max().item())


@pytest.mark.parametrize("h,kvh,bs,top_k,split,warps", [(16, 1, 128, 16, 8, 4), (16, 1, 128, 16, 1, 4),
                                                         (8, 2, 64, 8, 4, 1)])
def test_compiles_for_sm90a(h: int, kvh: int, bs: int, top_k: int, split: int, warps: int) -> None:
    """Builds for sm_90a with the MMA and the prmt decodes, no register spills; 2..8 splits merge in a cluster
    (its barrier in the SASS), one split needs none."""
    ck = compile_cuda(mac.decode_spec(h, kvh, bs, top_k, split, warps), "sm_90a")
    sass = disassemble(ck.binary)
    assert "HMMA.16816.F32" in sass and "PRMT" in sass and "HMUL2" in sass and "STL" not in sass
    assert ("UCGABAR_WAIT" in sass) == (1 < split <= 8)


def test_supported_and_dispatch(monkeypatch: pytest.MonkeyPatch, rng: torch.Generator) -> None:
    """Layouts the kernel takes; with ATTN_CUDA on and the call's device check forced (as on a GPU) decode goes to
    the listed CUDA spec with the kernel's grid; where the device check fails (here) or the flag is off it stays
    on Triton."""
    assert mac.supported(16, 1, 128, 128, 16, "bf16") is None
    assert "128" in mac.supported(16, 1, 64, 128, 16, "bf16") and "64" in mac.supported(16, 1, 128, 16, 16, "bf16")
    assert "1..16" in mac.supported(32, 1, 128, 128, 16, "bf16") and "bf16" in mac.supported(16, 1, 128, 128, 16,
                                                                                              "fp32")
    c = _case(rng, 128, 64, 8, 2, 4, [(700, 1), (300, 2)], q_dtype=torch.bfloat16, device="cpu")
    seen: list = []

    def record(spec, grid, args):  # a Runner
        assert len(args) == len(spec.arg_types)
        seen.append((spec, grid))

    ma.msa_sparse_attention(**c, runner=record)
    assert not isinstance(seen[0][0], CudaKernelSpec)
    monkeypatch.setattr(ma, "ATTN_CUDA", False)
    monkeypatch.setattr(mac, "call_supported", lambda q, kvh, bs, top_k: None)
    seen.clear()
    ma.msa_sparse_attention(**c, runner=record)
    assert not isinstance(seen[0][0], CudaKernelSpec)
    assert not any(isinstance(s, CudaKernelSpec) for s in ma.attention_specs(16, 2, 128, 64, 4, "bf16"))
    monkeypatch.setattr(ma, "ATTN_CUDA", True)
    monkeypatch.setattr(mac, "call_supported", lambda q, kvh, bs, top_k: None)
    seen.clear()
    ma.msa_sparse_attention(**c, runner=record)
    (spec, grid), = seen
    listed = {s.key() for s in ma.attention_specs(16, 2, 128, 64, 4, "bf16")}
    assert isinstance(spec, CudaKernelSpec) and spec.key() in listed
    assert grid[0] == 3 * 2 * dict(spec.defines)["SPLIT"]


def test_splits_keep_every_warp_busy() -> None:
    """Listed splits give every warp of every CTA at least one 64-key step; the pick keeps one CTA an SM."""
    assert mac.splits(16, 128) == [1, 2, 4, 8] and mac.splits(16, 128, warps=2) == [1, 2, 4, 8, 16]
    assert mac.splits(1, 64) == [1] and mac.splits(5, 64) == [1]
    assert mac.splits(32, 256, warps=1)[-1] == 64  # not 128: the global merge stages SPLIT x 32 floats in 2,112
    for top_k, bs in [(16, 128), (8, 64), (32, 256), (3, 128)]:
        for split in mac.splits(top_k, bs):
            assert split * mac.WARPS <= max(top_k * bs // 64, mac.WARPS)
    cpu = torch.device("cpu")  # 132 SMs there
    assert mac.pick_split(1, 16, 128, cpu) == 8 and mac.pick_split(16, 16, 128, cpu) == 8
    assert mac.pick_split(17, 16, 128, cpu) == 4 and mac.pick_split(32, 16, 128, cpu) == 4
    assert mac.pick_split(66, 16, 128, cpu) == 2 and mac.pick_split(264, 16, 128, cpu) == 1


def test_workspace_only_for_splits() -> None:
    """Unsplit launches (large batches) share one tiny workspace; split ones get [tiles, split, 16, 128] partials."""
    ws, ml, cnt = mac._workspace(torch.device("cpu"), 4096, 1)
    assert ws.numel() == ml.numel() == cnt.numel() == 4 and mac._workspace(torch.device("cpu"), 777, 1)[0] is ws
    ws, ml, cnt = mac._workspace(torch.device("cpu"), 3, 4)
    assert ws.numel() == 3 * 4 * 16 * 128 and ml.numel() == 3 * 4 * 32 and cnt.numel() == 4 and not cnt.any()


# ---- GPU (H200) ----


@pytest.mark.gpu
@pytest.mark.parametrize("hg,kvh,bs,top_k,reqs", [
    (16, 1, 128, 16, [(70000, 1), (3000, 1), (200, 1)]),  # m3.1-small's slice
    (16, 1, 128, 16, [(40000, 4), (130, 2)]),              # speculative rows
    (8, 2, 64, 8, [(5000, 3), (64, 1), (1, 1)]),           # two KV groups, 64-token blocks, a one-key request
])
def test_matches_reference(hg: int, kvh: int, bs: int, top_k: int, reqs: list, rng: torch.Generator,
                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ma, "ATTN_CUDA", True)
    c = _case(rng, 128, bs, hg, kvh, top_k, reqs, q_dtype=torch.bfloat16, device="cuda")
    ref = _reference(c)
    # (splits <= 8 merge in a thread-block cluster, 16 through global memory and the last CTA to arrive)
    for split, warps in ((None, 4), (1, 4), (2, 4), (1, 1), (4, 2), (16, 2)):
        out = torch.full_like(c["q"], float("nan"))
        ma.msa_sparse_attention(**c, out=out) if split is None else mac.launch(
            ma.jit_run, c["q"], c["k_data"], c["k_scale"], c["v_data"], c["v_scale"], c["selected"], c["positions"],
            c["query_start_loc"], c["seq_lens"], c["block_table"], out, c["block_size"], c["scale"], split, warps)
        assert torch.isfinite(out).all(), (split, warps)
        assert _rel(out, ref) <= 1e-2, (split, warps, _rel(out, ref))  # bf16 output, f16 P


@pytest.mark.gpu
def test_graph_replay(rng: torch.Generator, monkeypatch: pytest.MonkeyPatch) -> None:
    """Captured decode replays equal fresh calls (the split counters are back at zero after every launch)."""
    monkeypatch.setattr(ma, "ATTN_CUDA", True)
    c = _case(rng, 128, 128, 16, 1, 16, [(50000, 1), (9000, 1)], q_dtype=torch.bfloat16, device="cuda")
    want = ma.msa_sparse_attention(**c)
    out = torch.empty_like(want)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ma.msa_sparse_attention(**c, out=out)
    for _ in range(3):
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, want)
