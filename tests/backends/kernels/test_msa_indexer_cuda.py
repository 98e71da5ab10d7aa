"""The CUDA C++ MSA indexer scores kernel (m3c/backends/kernels/msa_indexer_cuda.py).

CPU: a lane-level Python twin of the kernel's decode (prmt byte lookups, sign gathering, f16 pairs, scale pairs),
its K permutation (A fragments from the key's natural bytes, the staged query pairs as B) and the query's
power-of-two staging must give back the dense dot product exactly; the offline sm_90a build holds the MMA / prmt
instructions without spills; the dispatch ("auto" / "cuda" / fallbacks) and the listed specs.
GPU (`-m gpu`): the kernel against the reference at m3.1-small shapes up to 1M tokens, block sizes 16..128, more
columns than one MMA tile, ±inf / NaN / tiny / huge queries, graph replays, offline cubins through the runtime.
"""

from __future__ import annotations

import pytest
import torch
from test_msa_indexer import _batch, _check, _reference, _run, _scaled_rows

from m3c.backends.cuda_aot import CudaKernelSpec, compile_cuda, disassemble
from m3c.backends.kernels import msa_indexer as mi
from m3c.backends.kernels import msa_indexer_cuda as mc
from m3c.errors import ShapeError
from m3c.model_defs import ops, quant

M32 = 0xFFFFFFFF


def _prmt(a: torch.Tensor, b: torch.Tensor | int, sel: int) -> torch.Tensor:
    """PTX prmt.b32 (default mode) on int64 tensors holding u32 values."""
    b = torch.as_tensor(b, dtype=torch.int64).expand_as(a)
    src = [(a >> (8 * i)) & 0xFF for i in range(4)] + [(b >> (8 * i)) & 0xFF for i in range(4)]
    out = torch.zeros_like(a)
    for i in range(4):
        nib = (sel >> (4 * i)) & 0xF
        byte = src[nib & 7]
        if nib & 8:
            byte = torch.where(byte & 0x80 != 0, 0xFF, 0)
        out |= byte << (8 * i)
    return out


def _prmt_t(a: torch.Tensor, b: int, sel: torch.Tensor) -> torch.Tensor:
    """prmt with a per-element selector (the LUT lookups): only the selector's low 16 bits count."""
    src = [(b >> (8 * i)) & 0xFF for i in range(4)]
    lut = torch.tensor([(int(a) >> (8 * i)) & 0xFF for i in range(4)] + src, dtype=torch.int64)
    out = torch.zeros_like(sel)
    for i in range(4):
        nib = (sel >> (4 * i)) & 0xF
        assert not (nib & 8).any()
        out |= lut[nib & 7] << (8 * i)
    return out


def _f16_pair(p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(low half, high half) of f16x2 words as float64."""
    lo = (p & 0xFFFF).to(torch.int32).to(torch.int16).view(torch.float16).double()
    hi = ((p >> 16) & 0xFFFF).to(torch.int32).to(torch.int16).view(torch.float16).double()
    return lo, hi


def _decode8(w: torch.Tensor) -> list[torch.Tensor]:
    """The kernel's decode8: eight natural E2M1 nibbles -> four f16x2 pairs (element 2i, 2i + 1)."""
    m = w & 0x77777777
    oa = _prmt_t(0x3E3C3800, 0x46444240, m)
    ob = _prmt_t(0x3E3C3800, 0x46444240, m >> 16)
    w4 = (w << 4) & M32
    oa = oa | (_prmt(w4, w, 0x5140) & 0x80808080)
    ob = ob | (_prmt(w4, w, 0x7362) & 0x80808080)
    return [_prmt(oa, 0, 0x1404), _prmt(oa, 0, 0x3424), _prmt(ob, 0, 0x1404), _prmt(ob, 0, 0x3424)]


def _twin_tile(codes: torch.Tensor, scales: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """What the kernel computes for one 16-key tile: scores [16 keys, N columns] (float64), from the codes [16, 64]
    uint8 and scales [16, 8] E4M3 bytes in the cache's layout and the queries [N, 128] (bf16: one f16 MMA column
    each; float32: hi and lo columns, summed), through the lanes' loads (key g / g + 8, bytes 16c.., scale bytes 2c,
    2c + 1), decode8, scale pairs, the MMA's fragment sums and the query staging (f16 times 2^-e per column, the
    result times 2^e)."""
    n = q.shape[0]
    # query staging: e from the column's largest finite magnitude, q * 2^-e rounded to f16 (pairs of elements)
    qf = q.float()
    fin = qf.abs().masked_fill(~torch.isfinite(qf), 0).amax(-1)
    e = torch.where(fin > 0, torch.frexp(fin).exponent - 1 - 14, 0)  # floor(log2 max) - 14, subnormals too
    scaled = qf.double() * torch.exp2(-e.double())[:, None]  # exact (the kernel: two power-of-two factors)
    staged = scaled.half().double()  # [N, 128]
    if q.dtype == torch.float32:  # + the lo column: f16 of what the hi one left
        staged = staged + (scaled - scaled.half().double()).half().double()
    out = torch.zeros(16, n, dtype=torch.float64)
    for c in range(4):  # lanes (g, c): the MMA sums over c and the 8 steps
        words = codes[:, 16 * c: 16 * c + 16].contiguous().view(torch.int32).to(torch.int64) & M32  # [16, 4]
        s16 = scales[:, 2 * c].to(torch.int64) | (scales[:, 2 * c + 1].to(torch.int64) << 8)
        sp = [_prmt(s16, 0, i | (i << 4)) & 0xFF for i in (0, 1)]  # scale_pair: the byte, converted (E4M3)
        sval = [s.to(torch.uint8).view(torch.float8_e4m3fn).double() for s in sp]
        for j in range(4):
            pairs = _decode8(words[:, j])
            sg = sval[j >> 1]
            for e2 in range(2):
                s = 2 * j + e2  # MMA step
                a0lo, a0hi = _f16_pair(pairs[2 * e2])
                a2lo, a2hi = _f16_pair(pairs[2 * e2 + 1])
                # f16 products of the decoded codes and the scale (exact in f16: checked below)
                a = [(v * sg).half().double() for v in (a0lo, a0hi, a2lo, a2hi)]
                assert all(torch.equal(x, v * sg) for x, v in zip(a, (a0lo, a0hi, a2lo, a2hi)))
                b = [staged[:, 32 * c + 2 * (2 * s) + k] for k in (0, 1)] + \
                    [staged[:, 32 * c + 2 * (2 * s + 1) + k] for k in (0, 1)]
                for av, bv in zip(a, b):
                    out += av[:, None] * bv[None, :]
    return out * torch.exp2(e.double())[None, :]


@pytest.mark.parametrize("trial", range(3))
def test_lane_twin_equals_dense_dot(trial: int, rng: torch.Generator) -> None:
    """The twin of one tile (random codes, every sign; random, tiny and zero scales; bf16 queries of several
    magnitudes) equals dequantized keys times queries exactly (float64: every product and sum is exact); float32
    queries (hi + lo columns) to 2^-21 of the sum of |products|."""
    codes = torch.randint(0, 256, (16, 64), generator=rng, dtype=torch.uint8)
    scales = torch.randint(0, 0x7F, (16, 8), generator=rng, dtype=torch.uint8)  # no NaN byte
    scales[0, 0] = 0  # a zero group
    scales[1, 3] = 1  # the smallest subnormal E4M3 scale
    scales[2, 7] = 0x7E  # 448
    codes[5, 16 + 3], scales[5, 2] = 0x35, 56  # element 32 + 7 of key 5: 3 (scale 1), flipped below
    q = (torch.randint(-64, 65, (5, 128), generator=rng).float() / 64)
    q = (q * torch.exp2(torch.tensor([0.0, 20, -20, 3, -3]))[:, None]).to(torch.bfloat16)
    keys = quant.nvfp4_dequantize(quant.NVFP4Tensor(codes, scales.view(torch.float8_e4m3fn), None)).double()
    want = keys @ q.double().T
    got = _twin_tile(codes, scales.view(torch.uint8), q)
    assert torch.equal(got, want)
    bad = codes.clone()
    bad[5, 16 + 3] ^= 0x80  # that element's sign (lane c = 1, step 1)
    assert not torch.equal(_twin_tile(bad, scales, q), want)
    q32 = torch.randn(5, 128, generator=rng) * torch.exp2(torch.tensor([0.0, 30, -30, 3, -3]))[:, None]
    want = keys @ q32.double().T
    got = _twin_tile(codes, scales.view(torch.uint8), q32)
    bound = 2.0**-21 * (keys.abs() @ q32.double().abs().T)
    assert ((got - want).abs() <= bound).all()
    assert ((_twin_tile(codes, scales.view(torch.uint8), q32.bfloat16().float()) - want).abs() > bound).any()
    # float32 columns of tiny (subnormal) and huge magnitude keep their 22 bits: the staging exponent is not clamped
    q_ext = torch.randn(3, 128, generator=rng) * torch.tensor([2.0**-135, 2.0**-120, 2.0**120])[:, None]
    want = keys @ q_ext.double().T
    bound = 2.0**-21 * (keys.abs() @ q_ext.double().abs().T) + 2.0**-149 * 128 * 2688
    assert ((_twin_tile(codes, scales.view(torch.uint8), q_ext) - want).abs() <= bound).all()


def test_decode8_every_nibble() -> None:
    """decode8 turns every E2M1 nibble, in each of the 8 positions of a word, into its f16 value."""
    e2m1 = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], dtype=torch.float64)
    nib = torch.arange(16, dtype=torch.int64)
    for pos in range(8):
        w = (nib << (4 * pos)) | (((nib + 5) % 16) << (4 * ((pos + 3) % 8)))  # another nibble beside it
        pairs = _decode8(w)
        lo, hi = _f16_pair(pairs[pos // 2])
        got = hi if pos % 2 else lo
        assert torch.equal(got, e2m1[nib]) and torch.equal(torch.signbit(got), torch.signbit(e2m1[nib]))


@pytest.mark.parametrize("nt,bs,q_dtype", [(1, 128, "bf16"), (2, 128, "bf16"), (1, 16, "bf16"), (1, 64, "bf16"),
                                           (1, 128, "fp32"), (2, 32, "fp32")])
def test_compiles_for_sm90a(nt: int, bs: int, q_dtype: str) -> None:
    """The kernel builds for sm_90a with the MMA, prmt decode and f16 multiplies, 16-byte streaming loads, and at
    most the registers MIN_CTAS allows (no spill traffic in the loop)."""
    spec = mc.scores_spec(bs, nt, q_dtype)
    ck = compile_cuda(spec, "sm_90a")
    assert ck.binary[:4] == b"\x7fELF" and ck.name == "msa_index_scores"
    sass = disassemble(ck.binary)
    assert "HMMA.16816.F32" in sass and "PRMT" in sass and "HMUL2" in sass and ".128" in sass
    assert sass.count("STL") <= 2  # at most a spill around the setup, none in the loop
    assert "max.NaN.f32" in ck.stages["ptx"]


def test_supported_and_dispatch(monkeypatch: pytest.MonkeyPatch, rng: torch.Generator) -> None:
    """Which layouts the kernel takes, what indexer_specs lists for them, and that a decode launch goes to the CUDA
    spec (by key, grid and argument count) when the call is supported — the GPU-only check faked on the CPU by
    forcing call_supported — while prefill stays on Triton."""
    assert mc.supported(1, 128, 128, "bf16") is None and mc.supported(4, 128, 16, "bf16") is None
    assert "128" in mc.supported(1, 64, 128, "bf16") and "16" in mc.supported(1, 128, 8, "bf16")
    assert mc.supported(1, 128, 256, "bf16") is None and "multiples of 64" in mc.supported(1, 128, 96, "bf16")
    assert mc.supported(1, 128, 128, "fp32") is None and "bf16 or float32" in mc.supported(1, 128, 128, "fp16")
    specs = mi.indexer_specs(1, 128, 128, 16, "bf16", 8)
    cuda = [s for s in specs if isinstance(s, CudaKernelSpec)]
    assert [dict(s.defines)["NT"] for s in cuda] == [1]  # 1 and 8 rows x 1 head: one MMA tile
    assert [dict(s.defines)["NT"] for s in mi.indexer_specs(4, 128, 128, 16, "bf16", 4)
            if isinstance(s, CudaKernelSpec)] == [1, 2]
    assert [dict(s.defines)["NT"] for s in mi.indexer_specs(1, 128, 128, 16, "fp32", 8)
            if isinstance(s, CudaKernelSpec)] == [1, 2]  # float32: 4 query columns a tile
    assert not any(isinstance(s, CudaKernelSpec) for s in mi.indexer_specs(1, 128, 128, 16, "bf16", 8, upcast=True))
    with pytest.raises(ShapeError, match=r"deq='cuda'.*128"):
        mi.indexer_specs(1, 64, 128, 16, "bf16", 8, deq="cuda")
    bs = 16
    b = _batch([300, 70], [1, 1], bs, 128, 2, rng, exact=True, q_dtype=torch.bfloat16)
    with pytest.raises(ShapeError, match=r"deq='cuda'.*auto"):
        mi.msa_indexer(**b, block_size=bs, top_k=4, deq="cuda")
    seen = []

    def record(spec, grid, args):  # a Runner
        assert len(args) == len(spec.arg_types)
        seen.append((spec, grid, args))

    monkeypatch.setattr(mc, "call_supported", lambda q, block_size: None)
    listed = {s.key() for s in mi.indexer_specs(2, 128, bs, 4, "bf16", 8)}
    mi.msa_indexer(**b, block_size=bs, top_k=4, runner=record)
    (spec, grid, args), topk = seen[0], seen[1]
    assert isinstance(spec, CudaKernelSpec) and spec.key() in listed and topk[0].key() in listed
    chunk = args[-1]
    assert grid == (2, -(-b["block_table"].shape[1] // chunk)) and chunk % mc.WARPS == 0
    # a contiguous but misaligned index_q (a view 2 bytes into its storage) reaches the kernel as an aligned copy
    seen.clear()
    buf = torch.empty(1 + b["index_q"].numel(), dtype=torch.bfloat16)
    q_odd = buf[1:].view(b["index_q"].shape)
    q_odd.copy_(b["index_q"])
    assert q_odd.is_contiguous() and q_odd.data_ptr() % 16
    mi.msa_indexer(**{**b, "index_q": q_odd}, block_size=bs, top_k=4, runner=record)
    q_seen = seen[0][2][0]
    assert q_seen.data_ptr() % 16 == 0 and torch.equal(q_seen, q_odd)
    seen.clear()
    b = _batch([300, 70], [40, 3], bs, 128, 2, rng, exact=True, q_dtype=torch.bfloat16)
    mi.msa_indexer(**b, block_size=bs, top_k=4, max_q_rows=4, runner=record)
    assert not isinstance(seen[0][0], CudaKernelSpec) and seen[0][0].constexprs["PREFILL"]


@pytest.mark.parametrize("n_req,mb,sms", [(8, 8192, 132), (1, 8192, 132), (1, 3, 132), (32, 1024, 132), (3, 100, 8)])
def test_pick_chunk(n_req: int, mb: int, sms: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunks: a multiple of WARPS (read at call time: the benchmark's knob), at most MAX_BLOCKS_PER_WARP blocks a
    warp, about CTAS_PER_SM CTAs per SM."""
    for warps in (4, 2, 8):
        monkeypatch.setattr(mc, "WARPS", warps)
        c = mc.pick_chunk(n_req, mb, sms)
        assert c % warps == 0 and warps <= c <= mc.MAX_BLOCKS_PER_WARP * warps
        ctas = n_req * -(-mb // c)
        assert ctas <= mc.CTAS_PER_SM * sms or c == mc.MAX_BLOCKS_PER_WARP * warps


# ---- GPU (H200) ----


@pytest.mark.gpu
@pytest.mark.parametrize("q_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("exact", [True, False])
def test_m31_small_long_contexts(exact: bool, q_dtype: torch.dtype, rng: torch.Generator) -> None:
    """m3.1-small's slice (G = 1, D = 128, block 128, top-16) at 32K and 1M tokens, plain and speculative rows."""
    bs = 128
    lens, rows = ([32 * 1024 - 5, 1 << 20], [1, 4]) if exact else ([32 * 1024, (1 << 20) - 77], [4, 2])
    b = _batch(lens, rows, bs, 128, 1, rng, exact=exact, q_dtype=q_dtype, device="cuda")
    _check(b, bs, 16, exact=exact, deq="cuda")
    b = _batch([5000, 1 << 20, 77, 300000], [1, 1, 1, 1], bs, 128, 1, rng, exact=exact, q_dtype=q_dtype,
               device="cuda")
    _check(b, bs, 16, exact=exact, deq="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("bs,g,rows,max_rows,chunk", [(16, 1, [1, 3, 2], 4, None), (64, 4, [4, 1, 2], 4, 3),
                                                      (128, 4, [8, 5, 1], 8, 5), (32, 2, [1, 1, 1], 8, 4),
                                                      (256, 1, [2, 0, 3], 4, None)])
def test_block_sizes_heads_and_columns(bs: int, g: int, rows: list[int], max_rows: int, chunk: int | None,
                                       rng: torch.Generator) -> None:
    """Block sizes 16..128 (one step a block below 64 keys), several index heads (bf16: 16 columns are two MMA tiles,
    32 two passes over the keys; float32: 4 columns a tile), chunks that end mid-request, poisoned outputs."""
    lens = [3000, 129, 40000][: len(rows)]
    for exact, q_dtype in ((True, torch.bfloat16), (False, torch.bfloat16), (True, torch.float32),
                           (False, torch.float32)):
        b = _batch(lens, rows, bs, 128, g, rng, exact=exact, q_dtype=q_dtype, device="cuda", spare_cols=5)
        _check(b, bs, 8, exact=exact, deq="cuda", max_q_rows=max_rows, chunk_blocks=chunk)


@pytest.mark.gpu
@pytest.mark.parametrize("q_dtype", [torch.bfloat16, torch.float32])
def test_queries_of_any_magnitude(q_dtype: torch.dtype, rng: torch.Generator) -> None:
    """Columns staged with their own power of two: exact inputs at 2^-100..2^100 stay bit-exact; ±inf / NaN give
    the reference's ±inf / NaN scores; an all-zero column scores 0."""
    bs, lens, rows = 16, [900, 2000], [4, 2]
    b = _batch(lens, rows, bs, 128, 2, rng, exact=True, q_dtype=q_dtype, device="cuda")
    b["index_q"] = _scaled_rows(b["index_q"].cpu(), (-100, 100, -30, 0, 64, -64)).cuda()
    _check(b, bs, 4, exact=True, deq="cuda", max_q_rows=4)
    b = _batch(lens, rows, bs, 128, 2, rng, exact=False, q_dtype=q_dtype, device="cuda")
    b["index_q"][0, 1, 5] = float("inf")
    b["index_q"][1, 0, 9] = float("-inf")
    b["index_q"][2, 1, 0] = float("nan")
    b["index_q"][3, 0] = 0.0
    scores, sel = _run(b, bs, 4, deq="cuda", max_q_rows=4)
    ref = _reference(b, bs)
    assert torch.equal(scores.isnan(), ref.isnan()) and torch.equal(scores.isinf(), ref.isinf())
    assert torch.equal(scores[scores.isinf()], ref[ref.isinf()])
    assert scores[2, 1].isnan().any() and (scores[1, 0].isinf() | scores[1, 0].isnan()).all()
    fin = ref.isfinite()
    assert ((scores - ref).abs()[fin] <= 5e-5 * ref.abs()[fin].max()).all()
    assert (scores[3, 0][fin[3, 0]] == 0).all()
    assert torch.equal(sel, ops.select_blocks(scores, b["positions"], bs, 4))
    # the largest finite magnitudes count as finite (the column's scale comes from them, no f16 overflow), and
    # float32 columns of subnormal magnitude keep their precision
    b = _batch(lens, rows, bs, 128, 2, rng, exact=False, q_dtype=q_dtype, device="cuda")
    b["index_q"][0, 0, 3] = 3.0e38
    if q_dtype == torch.float32:
        b["index_q"][1, 1] *= 2.0**-135
    scores, _ = _run(b, bs, 4, deq="cuda", max_q_rows=4)
    ref = _reference({k: v.cpu() for k, v in b.items()}, bs).cuda()  # on the CPU: IEEE subnormal products
    assert torch.equal(scores.isfinite(), ref.isfinite())
    fin = ref.isfinite()
    # row (0, 0) is checked for finiteness only: its column is staged at the scale of the 3e38 element, so its other
    # 127 values (2^-128 of it) flush to zero by design, and a block whose keys all have a zero (or negative) code in
    # dim 3 pools a finite score made of exactly those values (a short last block makes that likely: session 16's
    # failure, row max 1,257 there against ~10^4 elsewhere)
    near = torch.ones_like(fin)
    near[0, 0] = False
    row_max = ref.abs().masked_fill(~fin, 0).amax(-1, keepdim=True)
    assert ((scores - ref).abs().masked_fill(~(fin & near), 0) <= 5e-5 * row_max + 2.0**-140).all()


@pytest.mark.gpu
def test_graph_replay_and_offline_cubins(rng: torch.Generator) -> None:
    """A captured decode step replays to the same scores as a fresh call (new queries copied in), and the specs
    compiled offline run through the runtime's CubinRunner with the same results."""
    from m3c.backends.triton_aot import compile_kernels
    from m3c.runtime.cuda_launcher import CubinKernel, CubinRunner

    bs = 128
    b = _batch([70000, 3000, 1 << 18], [1, 1, 1], bs, 128, 1, rng, exact=False, q_dtype=torch.bfloat16, device="cuda")
    want_s, want_sel = _run(b, bs, 16, deq="cuda")
    scores = torch.full_like(want_s, float("nan"))
    sel = torch.full_like(want_sel, -7)
    q = b["index_q"].clone()
    args = {**b, "index_q": q}
    mi.msa_indexer(**args, block_size=bs, top_k=16, scores_out=scores, selected_out=sel)  # warm-up
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        mi.msa_indexer(**args, block_size=bs, top_k=16, scores_out=scores, selected_out=sel)
    for _ in range(2):
        scores.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(scores, want_s) and torch.equal(sel, want_sel)
    q.copy_(torch.randn_like(q))
    graph.replay()
    fresh, fresh_sel = _run({**b, "index_q": q.clone()}, bs, 16, deq="cuda")
    assert torch.equal(scores, fresh) and torch.equal(sel, fresh_sel)
    specs = mi.indexer_specs(1, 128, bs, 16, "bf16", 8)
    runner = CubinRunner({k.key: CubinKernel(k.binary, k.name, k.shared_bytes, k.num_warps, k.arg_types)
                          for k in compile_kernels(specs)})
    s2, sel2 = _run(b, bs, 16, runner=runner)
    assert torch.equal(s2, want_s) and torch.equal(sel2, want_sel) and runner.launches == 2
