"""The MSA sparse-attention decode kernel against `m3c.model_defs.ops.sparse_attention` on the same paged caches.

CPU CI runs it in Triton's interpreter at tiny shapes (float32 dots, so float32 q matches the reference
to rounding); `-m gpu` runs m3.1-small shapes (16 q heads, 1 KV head, D=128, block 128, top-16).
"""

from __future__ import annotations

import os

import pytest
import torch

from m3c.model_defs import ops, quant

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _kernel():
    if not torch.cuda.is_available():
        assert os.environ.get("TRITON_INTERPRET") == "1", "tests/conftest.py sets the interpreter without a GPU"
    from m3c.backends.kernels import msa_attention

    return msa_attention


def _case(gen: torch.Generator, d: int, bs: int, hg: int, kvh: int, top_k: int, reqs: list[tuple[int, int]],
          q_dtype: torch.dtype = torch.float32, pad_p: float = 0.3, device: str = DEVICE) -> dict:
    """Random paged NVFP4 caches, shuffled block tables and selections for requests [(context, query rows)].

    Slots past each request's length and unowned blocks hold NaN poison (0xFF codes, E4M3 NaN scales).
    """
    need = [-(-length // bs) for length, _ in reqs]
    nb = sum(need) + 2
    perm = torch.randperm(nb, generator=gen)
    table = torch.zeros(len(reqs), max(need) + 1, dtype=torch.int32)
    caches = {}
    # Per-token magnitudes: 0.01 gives subnormal E4M3 scales; K stays mild so the softmax is not one-hot.
    for name, mags in (("k", [0.01, 0.3, 1.0]), ("v", [0.01, 1.0, 30.0])):  # quantized on `device` (1M-token pool)
        mag = torch.tensor(mags)[torch.randint(0, 3, (nb, bs, kvh, 1), generator=gen)]
        t = quant.nvfp4_quantize((torch.randn(nb, bs, kvh, d, generator=gen) * mag).to(device))
        caches[name] = (t.data.clone(), t.scale.view(torch.uint8).clone())
    owned = torch.zeros(nb, bs, dtype=torch.bool)
    starts, positions, selected, used = [0], [], [], 0
    for r, (length, rows) in enumerate(reqs):
        blocks = perm[used: used + need[r]]
        used += need[r]
        table[r, : need[r]] = blocks.to(torch.int32)
        owned.view(-1)[(blocks[:, None] * bs + torch.arange(bs)).reshape(-1)[:length]] = True
        for p in range(length - rows, length):
            positions.append(p)
            for _ in range(kvh):
                own = p // bs
                others = [b for b in torch.randperm(need[r], generator=gen).tolist() if b != own]
                n = int(torch.randint(0, top_k, (1,), generator=gen)) if torch.rand(1, generator=gen) < pad_p else top_k - 1
                sel = sorted([own, *others[:n]])
                selected.append(sel + [-1] * (top_k - len(sel)))
        starts.append(starts[-1] + rows)
    for data, scale in caches.values():
        data[~owned.to(device)] = 0xFF
        scale[~owned.to(device)] = 0xFF
    t = starts[-1]
    return {
        "q": torch.randn(t, hg * kvh, d, generator=gen).to(q_dtype).to(device),
        "k_data": caches["k"][0], "k_scale": caches["k"][1].view(torch.float8_e4m3fn),
        "v_data": caches["v"][0], "v_scale": caches["v"][1].view(torch.float8_e4m3fn),
        "selected": torch.tensor(selected, dtype=torch.int64).view(t, kvh, top_k).to(device),
        "positions": torch.tensor(positions, dtype=torch.int64).to(device),
        "query_start_loc": torch.tensor(starts, dtype=torch.int32).to(device),
        "seq_lens": torch.tensor([length for length, _ in reqs], dtype=torch.int32).to(device),
        "block_table": table.to(device),
        "block_size": bs,
        "scale": d**-0.5,
    }


def _reference(c: dict) -> torch.Tensor:
    return ops.sparse_attention(c["q"], c["k_data"], c["k_scale"], c["v_data"], c["v_scale"], "nvfp4", c["selected"],
                                c["positions"], c["query_start_loc"], c["seq_lens"], c["block_table"],
                                c["block_size"], c["scale"])


def _run(c: dict, split: int | None = None, **kw) -> torch.Tensor:
    """Launch into a NaN-poisoned output (so unwritten elements show)."""
    out = torch.full_like(c["q"], float("nan"))
    res = _kernel().msa_sparse_attention_decode(**c, split=split, out=out, **kw)
    assert res is out
    return out


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30))


CASES = {
    # name: (D, block, H/KVH, KVH, top_k, [(context, query rows), ...])
    "d64-b16-g4x1-k4": (64, 16, 4, 1, 4, [(75, 1), (40, 3), (16, 2)]),
    "d32-b8-g2x2-k3": (32, 8, 2, 2, 3, [(29, 4), (52, 1)]),
    "d32-b16-g3x2-k2": (32, 16, 3, 2, 2, [(37, 2)]),
}


@pytest.mark.parametrize("split", [1, 2, 3])
@pytest.mark.parametrize("name", list(CASES))
def test_matches_reference_float32(name: str, split: int, rng: torch.Generator) -> None:
    """float32 q: every element written, within float32 rounding of the reference (dots are exact-f32 here)."""
    d, bs, hg, kvh, top_k, reqs = CASES[name]
    c = _case(rng, d, bs, hg, kvh, top_k, reqs)
    out, ref = _run(c, split), _reference(c)
    assert bool(torch.isfinite(out).all()), "unwritten (NaN-poisoned) or non-finite output"
    tol = 5e-6 if DEVICE == "cpu" else 1e-4  # CPU: f32 rounding only (seen <= 7e-7); GPU: tf32x3 dots
    assert _rel(out, ref) <= tol, _rel(out, ref)


def test_split_and_subtile_invariance(rng: torch.Generator) -> None:
    """Flash-decoding merge is exact: any split count, and 8-key sub-tiles of 16-key blocks, agree with
    split=1 to float32 rounding (and with the reference)."""
    d, bs, hg, kvh, _, reqs = CASES["d64-b16-g4x1-k4"]
    c = _case(rng, d, bs, hg, kvh, 6, [*reqs, (96, 1)], pad_p=0.0)
    base = _run(c, 1)
    assert _rel(base, _reference(c)) <= (5e-6 if DEVICE == "cpu" else 1e-4)
    for split, block_n in ((2, 16), (4, 16), (6, 16), (1, 8), (3, 8)):
        assert _rel(_run(c, split, block_n=block_n), base) <= 2e-6, (split, block_n)


def test_bf16_q(rng: torch.Generator) -> None:
    """bf16 q: the interpreter runs the same f32 math on the same (bf16) values, so the output is the f32-q
    kernel's result rounded to nearest bf16 (<= half an ulp, 2^-8 relative). Against the bf16 reference: the two
    f32 results differ by float32 rounding (bounded as in the f32 test, relative to the max), and each side's
    final rounding can then land on neighbouring bf16 values: one ulp (<= 2^-7 relative)."""
    d, bs, hg, kvh, top_k, reqs = CASES["d32-b8-g2x2-k3"]
    c = _case(rng, d, bs, hg, kvh, top_k, reqs, q_dtype=torch.bfloat16)
    out = _run(c, 2)
    assert out.dtype == torch.bfloat16 and bool(torch.isfinite(out).all())
    ref = _reference(c)
    f32 = _run({**c, "q": c["q"].float()}, 2)
    if DEVICE == "cpu":
        assert bool(((out.float() - f32).abs() <= 2**-8 * f32.abs() + 1e-30).all())
        bound = 2**-7 * ref.float().abs() + 5e-6 * ref.float().abs().max()
        assert bool(((out.float() - ref.float()).abs() <= bound).all())
    else:  # P·V runs on bf16 tensor cores: P rounded to bf16 (2^-9 relative per weight)
        assert _rel(out, ref) <= 2e-2


def test_single_visible_key(rng: torch.Generator) -> None:
    """A query at the first slot of its block selecting only that block: output = that key's V for every head."""
    d, bs, hg, kvh, top_k = 64, 16, 4, 2, 3
    c = _case(rng, d, bs, hg, kvh, top_k, [(49, 1), (33, 1)])  # positions 48, 32: first slots of blocks 3, 2
    c["selected"][0] = torch.tensor([3, -1, -1])
    c["selected"][1] = torch.tensor([-1, 2, -1])  # -1 anywhere is ignored
    out = _run(c, 2)
    for i, (r, p) in enumerate(((0, 48), (1, 32))):
        blk = c["block_table"][r, p // bs]
        v = quant.nvfp4_dequantize(quant.NVFP4Tensor(c["v_data"][blk, p % bs], c["v_scale"][blk, p % bs], None))
        assert torch.equal(out[i].view(kvh, hg, d), v[:, None, :].expand(kvh, hg, d).to(out.dtype))


def test_skipped_entries(rng: torch.Generator) -> None:
    """No visible block -> zeros; future blocks, duplicates and unsorted entries behave as in the reference."""
    d, bs, hg, kvh, top_k = 32, 8, 2, 1, 4
    c = _case(rng, d, bs, hg, kvh, top_k, [(30, 3)])  # positions 27, 28, 29 (block 3, middle)
    c["selected"][0, 0] = torch.tensor([-1, -1, -1, -1])
    c["selected"][1, 0] = torch.tensor([1, 3, 1, 0])  # duplicate 1, unsorted
    c["selected"][2, 0] = torch.tensor([2, 3, -1, 2])
    out = _run(c, 3)
    assert bool((out[0] == 0).all())
    assert _rel(out, _reference(c)) <= (5e-6 if DEVICE == "cpu" else 1e-4)


def test_shared_token_map_and_empty(rng: torch.Generator) -> None:
    """A precomputed token->request map gives the same result; zero rows is a no-op."""
    d, bs, hg, kvh, top_k, reqs = CASES["d32-b16-g3x2-k2"]
    c = _case(rng, d, bs, hg, kvh, top_k, [*reqs, (20, 1)])
    k = _kernel()
    req = k.token_requests(c["query_start_loc"], c["q"].shape[0])
    assert req.tolist() == [0, 0, 1]
    out = k.msa_sparse_attention_decode(**c, split=2, req_of_token=req)
    assert torch.equal(out, _run(c, 2))
    empty = {**c, "q": c["q"][:0], "selected": c["selected"][:0], "positions": c["positions"][:0]}
    assert k.msa_sparse_attention_decode(**empty).shape == (0, hg * kvh, d)


@pytest.mark.gpu
@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("context", [32 * 1024, 1024 * 1024])
def test_m31_small_shapes_gpu(context: int, q_dtype: torch.dtype, rng: torch.Generator) -> None:
    """m3.1-small TP4 slice: 16 q heads, 1 KV head, D=128, block 128, top-16; decode rows of 2 requests."""
    c = _case(rng, 128, 128, 16, 1, 16, [(context, 2), (context // 2 + 77, 1)], q_dtype=q_dtype, device="cuda")
    ref = _reference(c)
    for split in (None, 1, 4):
        out = _run(c, split)
        assert bool(torch.isfinite(out).all())
        assert _rel(out, ref) <= (1e-4 if q_dtype == torch.float32 else 2e-2), (split, _rel(out, ref))
