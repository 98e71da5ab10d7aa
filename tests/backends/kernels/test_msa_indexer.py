"""The MSA indexer kernels (NVFP4 block scores + exact top-k) against the reference ops.

CPU CI runs them in Triton's interpreter at tiny shapes (decode, speculative rows, prefill tiles, every
decode dequant path); `-m gpu` runs m3.1-small shapes (32K and 1M tokens, a 4K-row prefill chunk at
128K and 1M, the offline-compiled cubins through the runtime's CubinRunner). "Exact" inputs (q in
multiples of 1/8 within [-2, 2], power-of-two scales) make every partial sum exact in float32, so
scores must equal the reference bit for bit whatever the summation order, and the selection must equal
`select_blocks` on the reference scores. General inputs compare scores to float32 rounding and the
selection to `select_blocks` on the kernel's own scores. The "fp8" path quantizes q: it is compared
with the reference on the same power-of-two-scaled E4M3 q (exact inputs are already on that grid).
The "fma" path scales each q row by a power of two of its own: rows of very different magnitudes (and
NaN / ±inf / zero rows) must still match the reference, each row to its own magnitude.
"""

from __future__ import annotations

import os

import pytest
import torch
import triton
from ptx_subset import run_ptx

from m3c.backends.triton_aot import KernelSpec
from m3c.errors import ShapeError
from m3c.model_defs import ops

POW2_SCALES = (40, 48, 56, 64)  # E4M3 bytes of 0.25, 0.5, 1, 2


def _kernels():
    if not torch.cuda.is_available():
        assert os.environ.get("TRITON_INTERPRET") == "1", "tests/conftest.py sets the interpreter without a GPU"
    from m3c.backends.kernels import msa_indexer

    return msa_indexer


def _device():
    """The indexer's Triton device code (the PTX constants; the top-k kernel launched alone)."""
    _kernels()  # the interpreter check
    from m3c.backends.kernels import msa_indexer_kernels

    return msa_indexer_kernels


def _batch(lens: list[int], rows: list[int], bs: int, d: int, g: int, gen: torch.Generator, *, exact: bool,
           q_dtype: torch.dtype = torch.float32, spare_cols: int = 2, device: str = "cpu") -> dict:
    """A paged NVFP4 index-key cache (shuffled blocks, 0xFF poison outside the contexts) and decode rows."""
    nbr = [-(-n // bs) for n in lens]
    nb = sum(nbr) + 3
    perm = torch.randperm(nb, generator=gen)
    table = torch.zeros(len(lens), max(nbr) + spare_cols, dtype=torch.int32)
    data = torch.randint(0, 256, (nb, bs, 1, d // 2), dtype=torch.uint8, generator=gen)
    if exact:
        scale = torch.tensor(POW2_SCALES, dtype=torch.uint8)[torch.randint(0, 4, (nb, bs, 1, d // 16), generator=gen)]
    else:
        scale = torch.randint(0, 0x7F, (nb, bs, 1, d // 16), dtype=torch.uint8, generator=gen)  # no NaN byte
    live = torch.zeros(nb, bs, dtype=torch.bool)
    starts, pos, used = [0], [], 0
    for r, (n, k) in enumerate(zip(lens, rows)):
        table[r, : nbr[r]] = perm[used : used + nbr[r]].to(torch.int32)
        used += nbr[r]
        tok = torch.arange(n)
        live[table[r, tok // bs].long(), tok % bs] = True
        pos.append(torch.arange(n - k, n)[torch.randperm(k, generator=gen)])
        starts.append(starts[-1] + k)
    data[~live] = 0xFF
    scale[~live] = 0xFF
    t = starts[-1]
    if exact:
        iq = torch.randint(-16, 17, (t, g, d), generator=gen).float() / 8
    else:
        iq = torch.randn(t, g, d, generator=gen)
    return {"index_q": iq.to(q_dtype).to(device), "k_data": data.to(device),
            "k_scale": scale.view(torch.float8_e4m3fn).to(device), "positions": torch.cat(pos).to(device),
            "query_start_loc": torch.tensor(starts, dtype=torch.int32, device=device),
            "seq_lens": torch.tensor(lens, dtype=torch.int32, device=device), "block_table": table.to(device)}


def _fp8_q(q: torch.Tensor) -> torch.Tensor:
    """q as the "fp8" path sees it: per (row, head) times 2^(7 - floor(log2 amax)), rounded to E4M3, scaled back."""
    qf = q.float()
    amax = qf.abs().amax(dim=-1, keepdim=True)
    e = torch.frexp(amax).exponent - 1  # floor(log2 amax) for amax > 0
    e = torch.where(amax > 0, e, torch.full_like(e, -119)).clamp(-119, 127)
    scale = torch.ldexp(torch.ones_like(qf[..., :1]), 7 - e)
    return (qf * scale).to(torch.float8_e4m3fn).float() / scale


def _reference(b: dict, bs: int, deq: str = "f32scale") -> torch.Tensor:
    q = _fp8_q(b["index_q"]) if deq == "fp8" else b["index_q"]
    return ops.indexer_block_scores(q, b["k_data"], b["k_scale"], "nvfp4", b["positions"],
                                    b["query_start_loc"], b["seq_lens"], b["block_table"], bs)


def _run(b: dict, bs: int, top_k: int, **kw) -> tuple[torch.Tensor, torch.Tensor]:
    """msa_indexer into poisoned output buffers (NaN scores, -7 indices): unwritten elements show."""
    t, g, _ = b["index_q"].shape
    dev = b["index_q"].device
    scores = torch.full((t, g, b["block_table"].shape[1]), float("nan"), device=dev)
    sel = torch.full((t, g, top_k), -7, dtype=torch.int64, device=dev)
    out = _kernels().msa_indexer(**b, block_size=bs, top_k=top_k, scores_out=scores, selected_out=sel, **kw)
    assert out[0] is scores and out[1] is sel
    return scores, sel


def _check(b: dict, bs: int, top_k: int, *, exact: bool, **kw) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the kernels and compare with the reference; returns (scores, selected)."""
    scores, sel = _run(b, bs, top_k, **kw)
    ref = _reference(b, bs, kw.get("deq", "f32scale"))
    assert scores.dtype == torch.float32 and sel.dtype == torch.int64
    assert not (sel == -7).any()
    if exact:
        assert torch.equal(scores, ref)
    else:
        assert torch.equal(torch.isnan(scores), torch.isnan(ref))
        assert torch.equal(scores == float("-inf"), ref == float("-inf"))
        fin = torch.isfinite(ref)
        err = (scores[fin] - ref[fin]).abs().max().item() if fin.any() else 0.0
        assert err <= 5e-5 * max(ref[fin].abs().max().item(), 1.0), err  # GPU MMA sums round differently
    assert torch.equal(sel, ops.select_blocks(scores, b["positions"], bs, top_k))
    if exact:
        assert torch.equal(sel, ops.select_blocks(ref, b["positions"], bs, top_k))
    return scores, sel


CASES = [
    # (D, block_size, G, context lengths, rows per request, top_k, q dtype, max_q_rows, chunk_blocks)
    (64, 8, 2, [37, 100, 9], [1, 3, 2], 4, torch.float32, 8, None),
    (64, 16, 1, [200, 48], [4, 1], 2, torch.bfloat16, 8, 3),
    (32, 8, 2, [24, 321], [2, 4], 4, torch.float32, 2, 5),
    (64, 8, 1, [160, 57, 320], [1, 2, 3], 16, torch.float32, 8, None),
    (32, 16, 2, [640], [3], 16, torch.bfloat16, 4, 7),
    (32, 64, 1, [300, 65], [2, 1], 2, torch.bfloat16, 8, None),  # one whole block a step (the GPU shape)
]


@pytest.mark.parametrize("exact", [True, False])
@pytest.mark.parametrize("case", CASES, ids=[f"d{c[0]}-bs{c[1]}-g{c[2]}-k{c[5]}-{i}" for i, c in enumerate(CASES)])
def test_matches_reference(case: tuple, exact: bool, rng: torch.Generator) -> None:
    d, bs, g, lens, rows, top_k, q_dtype, max_rows, chunk = case
    b = _batch(lens, rows, bs, d, g, rng, exact=exact, q_dtype=q_dtype)
    _check(b, bs, top_k, exact=exact, max_q_rows=max_rows, chunk_blocks=chunk)


def test_every_output_written(rng: torch.Generator) -> None:
    """Poisoned output buffers: every score (including the -inf padding columns) and index is written."""
    bs, top_k = 8, 4
    b = _batch([70, 13, 33], [2, 1, 3], bs, 64, 2, rng, exact=False, spare_cols=9)
    scores, _ = _check(b, bs, top_k, exact=False, chunk_blocks=4)
    assert not torch.isnan(scores).any()
    assert (scores[..., 10:] == float("-inf")).all()


DEQ_CASES = [
    # (D, block_size, G, context lengths, rows per request, top_k, q dtype, max_q_rows)
    (64, 8, 2, [37, 100, 9], [1, 3, 2], 4, torch.bfloat16, 4),
    (64, 16, 1, [200, 48, 30], [5, 1, 0], 3, torch.float32, 2),  # 5 rows: 3 decode tiles; an idle request
    (32, 64, 1, [300, 65], [2, 1], 2, torch.bfloat16, 2),  # one whole block a step (the GPU shape)
    (32, 128, 1, [300, 130], [1, 2], 2, torch.float32, 2),  # "fma": a block in two steps of 64 keys
]


@pytest.mark.parametrize("exact", [True, False])
@pytest.mark.parametrize("deq,prefetch", [("groupdot", False), ("fp8", False), ("fma", False), ("int8", False),
                                          ("fma", True), ("int8", True)])
@pytest.mark.parametrize("case", DEQ_CASES, ids=[f"d{c[0]}-bs{c[1]}-g{c[2]}" for c in DEQ_CASES])
def test_decode_dequant_paths(case: tuple, deq: str, prefetch: bool, exact: bool, rng: torch.Generator,
                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Every decode dequant path: exact paths bit-exact on exact inputs; "fp8" equals the reference on
    its E4M3-quantized q (exactly when q is on the E4M3 grid, as the exact inputs are). ``prefetch``: the
    CUDA-core paths with FMA_STAGES = 0 (the next step's keys prefetched into registers, steps of whole
    blocks), including the prefetch past each chunk's last block (masked, never stored)."""
    mi = _kernels()
    d, bs, g, lens, rows, top_k, q_dtype, max_rows = case
    if prefetch:
        monkeypatch.setattr(mi, "FMA_STAGES", 0)
        monkeypatch.setattr(mi, "FMA_KEYS", max(64, bs))
        spec = mi._scores_spec(g, d, bs, "fp32", 1, False, deq, True)
        assert spec.constexprs["FS"] == 0 and spec.constexprs["FK"] >= bs
    b = _batch(lens, rows, bs, d, g, rng, exact=exact, q_dtype=q_dtype)
    assert not mi.is_prefill(b["index_q"].shape[0], len(lens), max_rows)
    _check(b, bs, top_k, exact=exact, max_q_rows=max_rows, deq=deq, chunk_blocks=3)
    if exact and deq == "fp8":  # exact inputs lose nothing to the quantization
        assert torch.equal(_fp8_q(b["index_q"]), b["index_q"].float())


def _scaled_rows(q: torch.Tensor, exps: tuple[float, ...]) -> torch.Tensor:
    """q with its (token, head) rows scaled by 2^exps[0], 2^exps[1], ... in turn."""
    t, g, _ = q.shape
    e = torch.tensor(exps)[torch.arange(t * g) % len(exps)]
    return (q.float() * torch.exp2(e).view(t, g, 1)).to(q.dtype)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter's numpy: inf × 0 in the ±inf rows
@pytest.mark.parametrize("deq", ["fma", "int8"])
@pytest.mark.parametrize("q_dtype", [torch.bfloat16, torch.float32])
def test_rows_of_any_magnitude(deq: str, q_dtype: torch.dtype, rng: torch.Generator) -> None:
    """"fma" and "int8" scale each (row, head) by their own power of two: exact inputs at 2^-100..2^100 stay bit-exact (no
    overflow, no lost bits); subnormal rows (2^-140, bf16: 2^-130) agree to a few subnormal ulps (the reference
    rounds each product there); general ones match to float32 rounding row by row;
    NaN / ±inf elements give the reference's NaN / ±inf scores and an all-zero row scores 0."""
    bs, top_k = 16, 3
    lens, rows = [90, 200], [4, 2]
    b = _batch(lens, rows, bs, 64, 2, rng, exact=True, q_dtype=q_dtype)
    b["index_q"] = _scaled_rows(b["index_q"], (-100, 100, -30, 0, 64, -64))  # ~1e-30, ~1e30, ...
    _check(b, bs, top_k, exact=True, deq=deq, max_q_rows=4)
    # general inputs at normal magnitudes only (with subnormal q the reference itself rounds its products)
    b = _batch(lens, rows, bs, 64, 2, rng, exact=False, q_dtype=q_dtype)
    b["index_q"] = _scaled_rows(b["index_q"], (-100, 100, 0, 64, -64, -30))
    b["index_q"][0, 1, 5] = float("inf")
    b["index_q"][1, 0, 9] = float("-inf")
    b["index_q"][2, 1, 0] = float("nan")
    b["index_q"][3, 0] = 0.0
    scores, sel = _run(b, bs, top_k, deq=deq, max_q_rows=4)
    ref = _reference(b, bs)
    assert torch.equal(scores.isnan(), ref.isnan()) and torch.equal(scores.isinf(), ref.isinf())
    assert torch.equal(scores[scores.isinf()], ref[ref.isinf()])
    assert (scores[1, 0].isinf() | scores[1, 0].isnan()).all() and scores[2, 1].isnan().any()
    fin = ref.isfinite()  # finite scores: to float32 rounding of their own row's largest
    row_max = ref.abs().masked_fill(~fin, 0).amax(-1, keepdim=True)
    assert ((scores - ref).abs().masked_fill(~fin, 0) <= 5e-5 * row_max).all()
    assert (scores[3, 0][fin[3, 0]] == 0).all()
    assert torch.equal(sel, ops.select_blocks(scores, b["positions"], bs, top_k))
    # subnormal rows (in q's dtype, values still exact): scores whose true values lie near or below 2^-126 are
    # rounded once by the kernel (exact sum, then one scaling) but product by product by the float32
    # reference, so they agree to a few subnormal ulps, not bit for bit. bf16 ones only on a GPU: Triton's CPU
    # interpreter converts bf16 subnormals to float32 wrongly (1.0 · 2^-130 -> 0, -1.5 · 2^-130 -> -2^-127)
    if q_dtype == torch.bfloat16 and not torch.cuda.is_available():
        return
    b = _batch(lens, rows, bs, 64, 2, rng, exact=True, q_dtype=q_dtype)
    b["index_q"] = _scaled_rows(b["index_q"], (-130,) if q_dtype == torch.bfloat16 else (-140,))
    q = b["index_q"].float()
    assert (q.abs().amax(-1) > 0).all() and q.abs().amax() < 2.0**-126  # really subnormal, not flushed to 0
    scores, sel = _run(b, bs, top_k, deq=deq, max_q_rows=4)
    ref = _reference(b, bs)
    fin = ref.isfinite()
    assert torch.equal(fin, scores.isfinite()) and torch.equal(scores[~fin], ref[~fin])
    assert ((scores - ref).abs()[fin] <= 64 * 2.0**-149).all()  # D = 64 products, each rounded by the reference
    assert (scores[fin] != 0).any()


def test_fp8_nibble_shuffle_is_exact() -> None:
    """The "fp8" path's bit shuffle (its inline PTX does this on four packed bytes): every E2M1 nibble,
    low or high, becomes the E4M3 byte of exactly its value × 2^-6."""
    byte = torch.arange(256, dtype=torch.int32)
    lo = ((byte << 4) & 0x80) | ((byte << 2) & 0x1C)  # _ASM_LO per byte
    hi = (byte & 0x80) | ((byte >> 2) & 0x1C)  # _ASM_HI per byte
    e2m1 = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])
    for got, nib in ((lo, byte & 15), (hi, byte >> 4)):
        val = got.to(torch.uint8).view(torch.float8_e4m3fn).float()
        assert torch.equal(val, e2m1[nib] / 64)
    asm = _device()._ASM_LO.value + _device()._ASM_HI.value
    assert "0x1C1C1C1C" in asm and "0x80808080" in asm


def test_bf16_nibble_placement_is_exact() -> None:
    """The "groupdot" path's inline PTX per nibble: sign -> bit 15, (e1 e0 m) -> bits 8..6 is a bf16 of value
    × 2^-126 (e = 0 subnormal), which times 2^126 (0x7E80) is the E2M1 value exactly."""
    byte = torch.arange(256, dtype=torch.int32)
    e2m1 = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], dtype=torch.float64)
    lo = ((byte & 0x07) << 6) | ((byte & 0x08) << 12)  # masks / shifts of _ASM_BF16_LO
    hi = ((byte & 0x70) << 2) | ((byte & 0x80) << 8)  # ... and of _ASM_BF16_HI
    two126 = torch.tensor([0x7E80], dtype=torch.int16).view(torch.bfloat16).double()
    assert two126.item() == 2.0**126
    for bits, nib in ((lo, byte & 15), (hi, byte >> 4)):
        val = bits.to(torch.int16).view(torch.bfloat16).double() * two126
        assert torch.equal(val, e2m1[nib])
    dev = _device()
    assert "0x00070007; shl.b32 a, a, 6" in dev._ASM_BF16_LO.value and "0x00800080; shl.b32 b, b, 8" in dev._ASM_BF16_HI.value


def _run_ptx(asm: str, args: list[int]) -> int:
    """The "int8" path's one output register ($0, signed) for inputs $1.. (see ptx_subset.run_ptx)."""
    out = run_ptx(asm, args, 1)[0]
    return out - (1 << 32) if out >> 31 else out


def test_int8_dp4a_ptx_program(rng: torch.Generator) -> None:
    """The "int8" path's PTX (read by a PTX-subset interpreter): two code words against three int8 parts of q give
    ((h·128 + m)·128 + l) with h, m, l = sum over the 16 elements of 2·E2M1 value × part, every nibble value in
    every position (the GPU tests run the same text on the hardware)."""
    from m3c.backends.kernels import msa_indexer_int8

    asm = msa_indexer_int8._ASM_DP4A.value
    two_v = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12]
    words = torch.randint(0, 1 << 32, (40, 2), generator=rng, dtype=torch.int64).tolist()
    words += [[int("".join(f"{(n + k) % 16:x}" for k in range(8)), 16)] * 2 for n in range(16)]  # all nibbles
    for w in words:
        parts = torch.randint(-64, 65, (3, 16), generator=rng).tolist()
        qw = [sum((parts[p][4 * i + j] & 255) << (8 * j) for j in range(4)) for p in range(3) for i in range(4)]
        vals = [two_v[(w[e // 8] >> (4 * (e % 8))) & 15] for e in range(16)]
        h, m, lo = (sum(v * q for v, q in zip(vals, parts[p])) for p in range(3))
        assert _run_ptx(asm, [w[0], w[1], *qw, *msa_indexer_int8.LUTS]) == (h * 128 + m) * 128 + lo


PREFILL_CASES = [
    # (D, block_size, G, context lengths, rows per request, top_k, q dtype, prefill_m, chunk_blocks)
    (64, 8, 2, [90, 30, 61, 17], [21, 0, 9, 17], 4, torch.float32, 16, 3),  # 8-row tiles, an idle request
    (32, 16, 1, [300, 41], [40, 7], 5, torch.bfloat16, 16, None),  # 16-row tiles
    (32, 8, 1, [150, 40], [30, 12], 4, torch.bfloat16, 128, 4),  # the default tile (128 rows × G)
    # 16-row tiles of 200 rows: steps that one row of a tile sees whole and another does not (the mask skip
    # must go by the tile's earliest row)
    (32, 16, 1, [300, 41], [200, 7], 4, torch.bfloat16, 16, None),
]


@pytest.mark.parametrize("exact", [True, False])
@pytest.mark.parametrize("case", PREFILL_CASES, ids=[f"d{c[0]}-g{c[2]}-m{c[7]}" for c in PREFILL_CASES])
def test_prefill_tiles(case: tuple, exact: bool, rng: torch.Generator) -> None:
    """Prefill chunks (rows = the last positions of each request, several tiles a request, requests of
    different lengths, one with no rows): every row causal on its own position, against the reference."""
    d, bs, g, lens, rows, top_k, q_dtype, prefill_m, chunk = case
    b = _batch(lens, rows, bs, d, g, rng, exact=exact, q_dtype=q_dtype)
    assert _kernels().is_prefill(b["index_q"].shape[0], len(lens), 2)
    _check(b, bs, top_k, exact=exact, max_q_rows=2, prefill_m=prefill_m, chunk_blocks=chunk)


def test_launcher_specs_are_listed() -> None:
    """Every spec the launcher produces, at several (T, R, max_blocks), phases and dequant paths, is in
    indexer_specs (by key), so an AOT compile of that list serves every launch."""
    mi = _kernels()
    g, d, bs, top_k = 2, 64, 16, 4
    seen: set[str] = set()

    def record(spec: KernelSpec, grid: tuple[int, ...], args: tuple) -> None:  # a Runner
        assert len(args) == len(spec.arg_types)
        seen.add(spec.key())

    for deq in mi.DEQ_MODES:
        listed = {s.key() for s in mi.indexer_specs(g, d, bs, top_k, "bf16", 4, deq=deq, upcast=mi.interpreting())}
        for t, r, mb in ((1, 1, 3), (4, 1, 1000), (7, 3, 1025), (13, 3, 9000), (300, 2, 8192), (5, 1, 17)):
            b = {"index_q": torch.zeros(t, g, d, dtype=torch.bfloat16),
                 "k_data": torch.zeros(4, bs, 1, d // 2, dtype=torch.uint8),
                 "k_scale": torch.zeros(4, bs, 1, d // 16, dtype=torch.float8_e4m3fn),
                 "positions": torch.zeros(t, dtype=torch.int64),
                 "query_start_loc": torch.tensor([0] * r + [t], dtype=torch.int32),
                 "seq_lens": torch.ones(r, dtype=torch.int32), "block_table": torch.zeros(r, mb, dtype=torch.int32)}
            seen.clear()
            mi.msa_indexer(**b, block_size=bs, top_k=top_k, max_q_rows=4, deq=deq, runner=record)
            assert len(seen) == 2 and seen <= listed, (t, r, mb, deq)


def test_first_block_row_pads_with_minus_one(rng: torch.Generator) -> None:
    """A decode row in the request's first block has only its own block: [0, -1, -1, ...]."""
    bs = 16
    b = _batch([5, 90], [1, 2], bs, 64, 2, rng, exact=True)
    _, sel = _check(b, bs, 4, exact=True)
    assert sel[0].tolist() == [[0, -1, -1, -1]] * 2


def test_ties_go_to_the_smaller_block(rng: torch.Generator) -> None:
    """Blocks 2 and 5 hold identical (dominant) keys: with room for one, block 2 wins; with two, both."""
    bs, d = 8, 64
    b = _batch([80], [1], bs, d, 1, rng, exact=True)
    kd, ks = b["k_data"], b["k_scale"].view(torch.uint8)
    blocks = b["block_table"][0].long()
    ks[blocks[:10]] = 40  # every key small (scale 0.25) ...
    ks[blocks[2]] = 64  # ... but blocks 2 and 5 (scale 2, same codes)
    kd[blocks[5]] = kd[blocks[2]]
    ks[blocks[5]] = 64
    b["index_q"][0, 0] = ops.nvfp4_dequantize(kd[blocks[2], 3, 0], ks[blocks[2], 3, 0].view(torch.float8_e4m3fn),
                                              None).sign()
    _, sel = _check(b, bs, 2, exact=True)
    assert sel[0, 0].tolist() == [2, 9]
    _, sel = _check(b, bs, 3, exact=True)
    assert sel[0, 0].tolist() == [2, 5, 9]
    kd[blocks[:10]] = kd[blocks[0]].clone()  # all blocks equal: the smallest indices win
    ks[blocks[:10]] = 56
    _, sel = _check(b, bs, 4, exact=True)
    assert sel[0, 0].tolist() == [0, 1, 2, 9]


def test_topk_tuning_knobs(rng: torch.Generator, monkeypatch: pytest.MonkeyPatch) -> None:
    """The top-k knobs (slice width, slices per row, warps) give another plan and spec, still exact: one warp over
    16-block slices, up to 16 slices a row merged by the last to finish, against the reference."""
    mi = _kernels()
    monkeypatch.setattr(mi, "TOPK_CH", (16, 8192))
    monkeypatch.setattr(mi, "TOPK_SLICES", 16)
    monkeypatch.setattr(mi, "TOPK_WARPS", 1)
    assert mi.topk_plan(3, 200, 132) == (16, 13)
    spec = mi._topk_spec(1, 8, 4, 16)
    assert spec.num_warps == 1 and spec.constexprs["NSMAX"] == 16 and not spec.constexprs["RANK_MERGE"]
    monkeypatch.setattr(mi, "TOPK_RANK_MERGE", 64)
    assert mi._topk_spec(1, 8, 4, 16).constexprs["RANK_MERGE"]  # 16 slices x 4 <= 64
    assert not mi._topk_spec(1, 8, 16, 16).constexprs["RANK_MERGE"]  # 16 x 16 > 64
    b = _batch([1500, 900, 60], [1, 1, 1], 8, 64, 1, rng, exact=True)
    _check(b, 8, 4, exact=True)  # the rank merge (64 candidates) through the launcher


@pytest.mark.parametrize("deq", ["f32scale", "groupdot", "fp8", "fma"])
def test_nan_scale_gives_nan_score_never_selected(deq: str, rng: torch.Generator) -> None:
    """A visible key with a NaN scale makes its block score NaN (as torch.amax); selection treats it as -inf."""
    bs = 8
    b = _batch([64], [1], bs, 32, 1, rng, exact=True)
    b["k_scale"].view(torch.uint8)[b["block_table"][0, 3], 5, 0, 1] = 0x7F
    scores, sel = _kernels().msa_indexer(**b, block_size=bs, top_k=8, deq=deq)
    ref = _reference(b, bs, deq)
    assert torch.isnan(scores[0, 0, 3]) and torch.equal(scores.nan_to_num(), ref.nan_to_num())
    assert torch.equal(sel, ops.select_blocks(ref, b["positions"], bs, 8))
    assert 3 not in sel[0, 0].tolist()


def _select(scores: torch.Tensor, positions: torch.Tensor, bs: int, top_k: int, ch: int, causal: bool,
            slices: int = 1, rank_merge: bool = False) -> torch.Tensor:
    """Kernel 2 alone over given scores, with chunk width `ch`, each row split into `slices` programs (merged by
    pairwise ranks with `rank_merge`, else by repeated max-reductions)."""
    mi = _kernels()
    t, g, mb = scores.shape
    ko = max(2, 1 << (top_k - 1).bit_length())
    out = torch.full((t, g, top_k), -7, dtype=torch.int64)
    cand = torch.full((t * g * mi.TOPK_SLICES * ko,), 12345, dtype=torch.int64)  # poisoned
    cnt = torch.zeros(t * g, dtype=torch.int32)
    _device().topk_blocks_kernel[(t * g, slices)](scores, positions, out, cand, cnt, mb, G=g, BS=bs, K=top_k, KO=ko,
                                                  CH=ch, CAUSAL=causal, NSMAX=mi.TOPK_SLICES, RANK_MERGE=rank_merge)
    assert not cnt.any()  # the counters are left at zero (CUDA-graph replays)
    return out


def test_launcher_splits_long_decode_rows(rng: torch.Generator) -> None:
    """A decode batch of few rows over a table wider than one top-k chunk (1,024 blocks): the launcher splits each
    row's top-k over programs (topk_plan) and the merged selection equals the reference's."""
    mi = _kernels()
    bs = 4
    b = _batch([4300, 2000], [1, 2], bs, 32, 1, rng, exact=True)  # 1,075 and 500 blocks
    assert mi.topk_plan(3, b["block_table"].shape[1], 132)[1] == 2
    _check(b, bs, 16, exact=True, deq="fma")


@pytest.mark.parametrize("top_k", [1, 2, 16])
def test_topk_special_values_and_many_chunks(top_k: int, rng: torch.Generator) -> None:
    """Kernel 2 over crafted scores: NaN, ±inf, ±0, heavy ties, many chunks; exactly select_blocks.

    CAUSAL=False takes any scores; CAUSAL=True (the launcher's) needs -inf past the own block.
    """
    t, g, mb, bs = 6, 2, 300, 4
    pool = torch.tensor([float("nan"), float("inf"), float("-inf"), 0.0, -0.0, 1.0, -1.0, 2.5, 3.0e38, -3.0e38])
    scores = pool[torch.randint(0, len(pool), (t, g, mb), generator=rng)]
    scores[1] = torch.randn(g, mb, generator=rng)
    scores[2] = float("-inf")
    scores[3] = torch.randint(-2, 3, (g, mb), generator=rng).float()
    positions = torch.tensor([mb * bs - 1, mb * bs - 2, 700, 0, 517, 33])
    want = ops.select_blocks(scores, positions, bs, top_k)
    for ch in (16, 64, 512):  # 512 >= mb: the whole row in the first chunk
        assert torch.equal(_select(scores, positions, bs, top_k, ch, causal=False), want)
    for ch, slices in ((16, 3), (64, 8), (512, 2)):  # rows split over programs, merged by the last one
        for rank_merge in (False, True):
            got = _select(scores, positions, bs, top_k, ch, causal=False, slices=slices, rank_merge=rank_merge)
            assert torch.equal(got, want), (ch, slices, rank_merge)
    future = torch.arange(mb)[None, :] > (positions // bs)[:, None]
    scores = scores.masked_fill(future[:, None, :], float("-inf"))
    want = ops.select_blocks(scores, positions, bs, top_k)
    for ch in (16, 512):
        assert torch.equal(_select(scores, positions, bs, top_k, ch, causal=True), want)
    assert torch.equal(_select(scores, positions, bs, top_k, 16, causal=True, slices=5), want)


def test_other_integer_metadata_dtypes_give_the_same_selection(rng: torch.Generator) -> None:
    """int32 positions / int64 lengths and tables (any integer metadata the IR allows) are converted, not refused."""
    b = _batch([37, 20], [2, 1], 8, 64, 1, rng, exact=True)
    mi = _kernels()
    _, want = mi.msa_indexer(**b, block_size=8, top_k=2)
    other = b | {"positions": b["positions"].int(), "query_start_loc": b["query_start_loc"].long(),
                 "seq_lens": b["seq_lens"].long(), "block_table": b["block_table"].long()}
    assert torch.equal(mi.msa_indexer(**other, block_size=8, top_k=2)[1], want)


def test_rejects_bad_shapes(rng: torch.Generator) -> None:
    b = _batch([20], [1], 8, 64, 1, rng, exact=True)
    mi = _kernels()
    with pytest.raises(ShapeError, match="k_data"):
        mi.msa_indexer(**b, block_size=16, top_k=2)
    with pytest.raises(ShapeError, match="positions"):
        mi.msa_indexer(**(b | {"positions": b["positions"][:0]}), block_size=8, top_k=2)
    with pytest.raises(ShapeError, match="top_k"):
        mi.msa_indexer(**b, block_size=8, top_k=0)
    with pytest.raises(ShapeError, match="dtype"):
        mi.msa_indexer(**(b | {"query_start_loc": b["query_start_loc"].float()}), block_size=8, top_k=2)
    with pytest.raises(ShapeError, match="seq_lens"):
        mi.msa_indexer(**(b | {"seq_lens": b["seq_lens"][0]}), block_size=8, top_k=2)
    with pytest.raises(ShapeError, match="index head dim"):
        mi.indexer_specs(1, 48, 8, 2)
    with pytest.raises(ShapeError, match="dtype"):
        mi.msa_indexer(**(b | {"index_q": b["index_q"].half()}), block_size=8, top_k=2)
    with pytest.raises(ShapeError, match="deq"):
        mi.msa_indexer(**b, block_size=8, top_k=2, deq="fp4")
    with pytest.raises(ShapeError, match="aligned"):
        mi.msa_indexer(**b, block_size=8, top_k=2, scores_out=torch.empty(6)[1:].view(1, 1, 5))


def _resources(binary: bytes) -> str:
    """cuobjdump's resource usage line of a cubin (its first function's)."""
    from m3c.backends.cuda_aot import cuobjdump

    return next(line for line in cuobjdump(binary, "-res-usage").splitlines() if "REG:" in line)


def test_fma_pipelined_block_loop(monkeypatch: pytest.MonkeyPatch, rng: torch.Generator) -> None:
    """FMA_STAGES > 1 (Triton software-pipelines the "fma" block loop): the same exact scores and selections,
    and the sm_90a code moves the keys with cp.async (the tuning option bench_msa_indexer_variants.py sweeps)."""
    from m3c.backends.triton_aot import compile_kernels

    mi = _kernels()
    monkeypatch.setattr(mi, "FMA_STAGES", 3)  # a module knob, read at every spec lookup (no cache to clear)
    bs, top_k = 16, 3
    b = _batch([90, 200], [1, 2], bs, 64, 2, rng, exact=True)
    _check(b, bs, top_k, exact=True, deq="fma", max_q_rows=2)
    spec = next(s for s in mi.indexer_specs(1, 128, 128, 16, "bf16", 1, deq="fma") if s.constexprs.get("DEQ") == 3)
    assert spec.constexprs["FS"] == 3
    (k,) = compile_kernels([spec])
    assert "cp.async" in k.stages["ptx"]


def test_compiles_for_hopper() -> None:
    """Every spec of indexer_specs builds offline for sm_90a at m3.1 shapes (G=1 with each dequant path,
    and G=4's prefill tile), without register spills; the MMA paths hold wgmma, "fp8" its packed shuffle and FP8
    MMA, "fma" float32 FMAs and no MMA."""
    from m3c.backends.triton_aot import compile_kernels

    mi = _kernels()
    specs = {}
    for deq in mi.DEQ_MODES:
        specs |= {s.key(): s for s in mi.indexer_specs(1, 128, 128, 16, "bf16", 8, deq=deq)}
    specs |= {s.key(): s for s in mi.indexer_specs(4, 128, 128, 16, "bf16", 2)
              if isinstance(s, KernelSpec) and s.constexprs.get("PREFILL")}  # G=4 prefill: 32 rows × 4
    built = compile_kernels(list(specs.values()))
    # per path decode tiles of 1 and 8 rows ("fma": 2), the shared prefill spec, 2 top-k widths, G=4 prefill
    assert len(built) == 2 * len(mi.DEQ_MODES) + 4 and all(k.binary for k in built)
    for spec, k in zip(specs.values(), built):
        res = _resources(k.binary)
        assert " LOCAL:0 " in res, (spec.constexprs, res)  # no spills
        ptx = k.stages["ptx"]
        if spec.family == "msa_indexer_scores" and (spec.constexprs["PREFILL"] or spec.constexprs["DEQ"] in (1, 2)):
            assert "wgmma.mma_async" in ptx, spec.constexprs
        if spec.family == "msa_indexer_scores" and spec.constexprs["DEQ"] == 3:
            assert "fma.rn.f32" in ptx and "mma" not in ptx
        if spec.family == "msa_indexer_scores" and spec.constexprs["DEQ"] == 2:
            assert "0x1C1C1C1C" in ptx and "e4m3" in ptx
        if spec.family == "msa_indexer_scores" and spec.constexprs["DEQ"] == 1:
            assert "mul.rn.bf16x2" in ptx


# ---- GPU (H200): m3.1-small shapes (G=1, D=128, block 128, top-16) ----


def _check_fp8(b: dict, bs: int, top_k: int, **kw) -> None:
    """The "fp8" path on a GPU: FP8 MMA accumulates with fewer bits, so scores are close to (not equal to)
    the reference on the quantized q; prints how often the selection equals the unquantized reference's."""
    scores, sel = _run(b, bs, top_k, deq="fp8", **kw)
    ref = _reference(b, bs, "fp8")
    fin = torch.isfinite(ref)
    assert torch.equal(fin, torch.isfinite(scores))
    assert (scores[fin] - ref[fin]).abs().max().item() <= 1e-3 * ref[fin].abs().max().item()
    assert torch.equal(sel, ops.select_blocks(scores, b["positions"], bs, top_k))
    full = ops.select_blocks(_reference(b, bs), b["positions"], bs, top_k)
    print(f"fp8: selection entries equal to the unquantized reference's: {(sel == full).float().mean().item():.4f}")


@pytest.mark.gpu
@pytest.mark.parametrize("deq", ["f32scale", "groupdot", "fp8", "fma", "int8"])
@pytest.mark.parametrize("q_dtype", [torch.bfloat16, torch.float32])
def test_m31_small_long_contexts(deq: str, q_dtype: torch.dtype, rng: torch.Generator) -> None:
    """Decode at 32K and 1M tokens with 1-4 speculative rows, each dequant path."""
    bs = 128
    for exact in (True, False):
        lens, rows = ([32 * 1024 - 5, 1 << 20], [1, 4]) if exact else ([32 * 1024, (1 << 20) - 77], [4, 2])
        b = _batch(lens, rows, bs, 128, 1, rng, exact=exact, q_dtype=q_dtype, device="cuda")
        if deq == "fp8":
            _check_fp8(b, bs, 16)
        else:
            _check(b, bs, 16, exact=exact, deq=deq)


@pytest.mark.gpu
@pytest.mark.parametrize("ctx", [128 * 1024, 1 << 20])
def test_m31_small_prefill_chunk(ctx: int, rng: torch.Generator) -> None:
    """A 4K-row prefill chunk at the end of a 128K / 1M-token context, batched with a short request."""
    bs = 128
    b = _batch([ctx, 3000], [4096, 700], bs, 128, 1, rng, exact=True, q_dtype=torch.bfloat16, device="cuda")
    _check(b, bs, 16, exact=True)
    b = _batch([ctx - 33, 5000], [4096, 3], bs, 128, 1, rng, exact=False, q_dtype=torch.bfloat16, device="cuda")
    _check(b, bs, 16, exact=False)


@pytest.mark.gpu
@pytest.mark.parametrize("deq", ["f32scale", "groupdot", "fp8", "fma", "int8"])
def test_offline_cubins_through_the_runtime(deq: str, rng: torch.Generator) -> None:
    """indexer_specs compiled offline (this Triton, sm_90a) and launched by the runtime's CubinRunner, in
    both phases, against the reference."""
    from m3c.backends.triton_aot import compile_kernels
    from m3c.runtime.cuda_launcher import CubinKernel, CubinRunner

    mi = _kernels()
    bs = 128
    specs = mi.indexer_specs(1, 128, bs, 16, "bf16", 8, deq=deq)
    runner = CubinRunner({k.key: CubinKernel(k.binary, k.name, k.shared_bytes, k.num_warps, k.arg_types)
                          for k in compile_kernels(specs)})
    for lens, rows in (([70000, 300], [1, 3]), ([20000, 900], [600, 2])):  # decode, then prefill
        b = _batch(lens, rows, bs, 128, 1, rng, exact=True, q_dtype=torch.bfloat16, device="cuda")
        if deq == "fp8" and rows[0] == 1:
            _check_fp8(b, bs, 16, runner=runner)
        else:
            _check(b, bs, 16, exact=True, deq=deq, runner=runner)
    assert runner.launches == 4


@pytest.mark.parametrize("n_prog,max_blocks,nbt,sms", [(1, 8192, 1, 132), (8, 8192, 1, 132), (8, 1024, 1, 132),
                                                        (32, 8192, 2, 132), (1, 3, 1, 132), (3, 100, 4, 8)])
def test_pick_chunk_blocks(n_prog: int, max_blocks: int, nbt: int, sms: int) -> None:
    """Decode chunks: a multiple of the step's blocks, 2..CHUNK_MAX blocks (rounded up to nbt), and at least
    CHUNK_WAVES programs per SM whenever the bound allows it."""
    mi = _kernels()
    c = mi.pick_chunk_blocks(n_prog, max_blocks, nbt, sms)
    assert c % nbt == 0 and 2 <= c <= max(mi.CHUNK_MAX, nbt) + nbt
    programs = n_prog * triton.cdiv(max_blocks, c)
    if c - nbt >= 2 and c < min(mi.CHUNK_MAX, max_blocks):  # neither bound active: programs per SM met
        assert programs >= mi.CHUNK_WAVES * sms * 0.5, (c, programs)
    if max_blocks * n_prog >= mi.CHUNK_MAX * mi.CHUNK_WAVES * sms:  # long contexts: the largest chunk
        assert c >= mi.CHUNK_MAX
