"""The MSA decode indexer kernels (NVFP4 block scores + exact top-k) against the reference ops.

CPU CI runs them in Triton's interpreter at tiny shapes; `-m gpu` runs m3.1-small shapes (32K and 1M
tokens). "Exact" inputs (q in multiples of 1/8, power-of-two scales) make every partial sum exact in
float32, so scores must equal the reference bit for bit whatever the summation order, and the
selection must equal `select_blocks` on the reference scores. General inputs compare scores to float32
rounding and the selection to `select_blocks` on the kernel's own scores.
"""

from __future__ import annotations

import os

import pytest
import torch

from m3c.errors import ShapeError
from m3c.model_defs import ops

POW2_SCALES = (40, 48, 56, 64)  # E4M3 bytes of 0.25, 0.5, 1, 2


def _kernels():
    if not torch.cuda.is_available():
        assert os.environ.get("TRITON_INTERPRET") == "1", "tests/conftest.py sets the interpreter without a GPU"
    from m3c.backends.kernels import msa_indexer

    return msa_indexer


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


def _reference(b: dict, bs: int) -> torch.Tensor:
    return ops.indexer_block_scores(b["index_q"], b["k_data"], b["k_scale"], "nvfp4", b["positions"],
                                    b["query_start_loc"], b["seq_lens"], b["block_table"], bs)


def _check(b: dict, bs: int, top_k: int, *, exact: bool, **kw) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the kernels and compare with the reference; returns (scores, selected)."""
    scores, sel = _kernels().msa_indexer_decode(**b, block_size=bs, top_k=top_k, **kw)
    ref = _reference(b, bs)
    assert scores.dtype == torch.float32 and sel.dtype == torch.int64
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
    t, g, _ = b["index_q"].shape
    mb = b["block_table"].shape[1]
    scores = torch.full((t, g, mb), float("nan"))
    sel = torch.full((t, g, top_k), -7, dtype=torch.int64)
    out = _check(b, bs, top_k, exact=False, scores_out=scores, selected_out=sel, chunk_blocks=4)
    assert out[0] is scores and out[1] is sel
    assert not torch.isnan(scores).any() and not (sel == -7).any()
    assert (scores[..., 10:] == float("-inf")).all()


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


def test_nan_scale_gives_nan_score_never_selected(rng: torch.Generator) -> None:
    """A visible key with a NaN scale makes its block score NaN (as torch.amax); selection treats it as -inf."""
    bs = 8
    b = _batch([64], [1], bs, 32, 1, rng, exact=True)
    b["k_scale"].view(torch.uint8)[b["block_table"][0, 3], 5, 0, 1] = 0x7F
    scores, sel = _kernels().msa_indexer_decode(**b, block_size=bs, top_k=8)
    ref = _reference(b, bs)
    assert torch.isnan(scores[0, 0, 3]) and torch.equal(scores.nan_to_num(), ref.nan_to_num())
    assert torch.equal(sel, ops.select_blocks(ref, b["positions"], bs, 8))
    assert 3 not in sel[0, 0].tolist()


def _select(scores: torch.Tensor, positions: torch.Tensor, bs: int, top_k: int, ch: int, causal: bool) -> torch.Tensor:
    """Kernel 2 alone over given scores, with chunk width `ch`."""
    mi = _kernels()
    t, g, mb = scores.shape
    out = torch.full((t, g, top_k), -7, dtype=torch.int64)
    mi.topk_blocks_kernel[(t * g,)](scores, positions, out, mb, G=g, BS=bs, K=top_k,
                                    KO=max(2, 1 << (top_k - 1).bit_length()), CH=ch, CAUSAL=causal)
    return out


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
    for ch in (16, 64):
        assert torch.equal(_select(scores, positions, bs, top_k, ch, causal=False), want)
    future = torch.arange(mb)[None, :] > (positions // bs)[:, None]
    scores = scores.masked_fill(future[:, None, :], float("-inf"))
    want = ops.select_blocks(scores, positions, bs, top_k)
    assert torch.equal(_select(scores, positions, bs, top_k, 16, causal=True), want)


def test_rejects_bad_shapes(rng: torch.Generator) -> None:
    b = _batch([20], [1], 8, 64, 1, rng, exact=True)
    mi = _kernels()
    with pytest.raises(ShapeError):
        mi.msa_indexer_decode(**b, block_size=16, top_k=2)
    with pytest.raises(ShapeError):
        mi.msa_indexer_decode(**(b | {"positions": b["positions"][:0]}), block_size=8, top_k=2)
    with pytest.raises(ShapeError):
        mi.msa_indexer_decode(**b, block_size=8, top_k=0)


def test_compiles_for_hopper() -> None:
    """Both kernels build offline for sm_90 at m3.1 shapes (no GPU needed): G=4 and G=1, 1M-token rows."""
    from m3c.backends.triton_aot import compile_kernels

    mi = _kernels()
    specs = mi.indexer_specs(4, 128, 128, 16, 8192) + mi.indexer_specs(1, 128, 128, 16, 8192, q="fp32")
    built = compile_kernels(specs)
    assert [k.name for k in built] == ["indexer_scores_kernel", "topk_blocks_kernel"] * 2
    assert all(k.binary for k in built)


@pytest.mark.gpu
@pytest.mark.parametrize("q_dtype", [torch.bfloat16, torch.float32])
def test_m31_small_long_contexts(q_dtype: torch.dtype, rng: torch.Generator) -> None:
    """m3.1-small shapes (G=1, D=128, block 128, top-16) at 32K and 1M tokens, with 1-4 speculative rows."""
    bs = 128
    b = _batch([32 * 1024 - 5, 1 << 20], [1, 4], bs, 128, 1, rng, exact=True, q_dtype=q_dtype, device="cuda")
    _check(b, bs, 16, exact=True)
    b = _batch([32 * 1024, (1 << 20) - 77], [4, 2], bs, 128, 1, rng, exact=False, q_dtype=q_dtype, device="cuda")
    _check(b, bs, 16, exact=False)
