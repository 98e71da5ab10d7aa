"""MSA reference (m3c.model_defs.msa) against brute-force loops, SDPA and hand-built cases; fresh random inputs."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from m3c.errors import ShapeError
from m3c.model_defs.msa import (
    dense_causal_attention,
    indexer_block_scores,
    msa_attention,
    msa_reference,
    select_blocks,
)

NAN, NEG_INF = float("nan"), float("-inf")


def _randn(rng: torch.Generator, *shape: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    return torch.randn(*shape, generator=rng, dtype=dtype)


def _positions(rng: torch.Generator, tq: int, tk: int) -> torch.Tensor:
    """A chunk of queries at the end of the context, then decode-like rows at random positions."""
    chunk = torch.arange(tk - (tq + 1) // 2, tk)
    return torch.cat([chunk, torch.randint(0, tk, (tq // 2,), generator=rng)])


def _brute_attention(q, k, v, pos, scale, keys_of) -> torch.Tensor:
    """Per query, per head loop; keys_of(i, g) lists the keys query i may see in group g (before causality)."""
    tq, h, _ = q.shape
    r = h // k.shape[1]
    out = torch.zeros(tq, h, v.shape[-1], dtype=torch.float64)
    for i in range(tq):
        for hh in range(h):
            keys = [j for j in keys_of(i, hh // r) if j <= int(pos[i])]
            if keys:
                logits = torch.stack([scale * torch.dot(q[i, hh], k[j, hh // r]) for j in keys])
                weights = torch.softmax(logits, dim=0)
                out[i, hh] = sum(w * v[j, hh // r] for w, j in zip(weights, keys))
    return out


def _brute_select(scores: torch.Tensor, pos: torch.Tensor, block_size: int, top_k: int) -> torch.Tensor:
    tq, g, nb = scores.shape
    out = torch.full((tq, g, top_k), -1, dtype=torch.int64)
    for i in range(tq):
        own = int(pos[i]) // block_size
        for gg in range(g):
            cands = [(-float(scores[i, gg, b]), b) for b in range(nb) if b != own]
            cands = sorted(c for c in cands if not math.isnan(c[0]) and c[0] != math.inf)
            chosen = sorted([own] + [b for _, b in cands[: top_k - 1]])
            out[i, gg, : len(chosen)] = torch.tensor(chosen)
    return out


@pytest.mark.parametrize(("tq", "tk", "h", "kvh"), [(5, 23, 4, 1), (8, 64, 8, 2), (1, 7, 2, 2)])
def test_dense_matches_sdpa(rng: torch.Generator, tq: int, tk: int, h: int, kvh: int) -> None:
    q, k, v = _randn(rng, tq, h, 16), _randn(rng, tk, kvh, 16), _randn(rng, tk, kvh, 12)
    pos = _positions(rng, tq, tk)
    out = dense_causal_attention(q, k, v, pos, scale=0.3)
    mask = torch.arange(tk)[None, :] <= pos[:, None]
    ke, ve = (x.repeat_interleave(h // kvh, dim=1).transpose(0, 1) for x in (k, v))
    ref = F.scaled_dot_product_attention(q.transpose(0, 1), ke, ve, attn_mask=mask, scale=0.3).transpose(0, 1)
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(("tk", "block_size", "top_k"), [(30, 8, 4), (32, 8, 4), (5, 16, 1), (17, 4, 7)])
def test_msa_equals_dense_when_all_blocks_fit(rng: torch.Generator, tk: int, block_size: int, top_k: int) -> None:
    tq, h, kvh = 6, 8, 2
    q, k, v = _randn(rng, tq, h, 16), _randn(rng, tk, kvh, 16), _randn(rng, tk, kvh, 8)
    iq, ik = _randn(rng, tq, kvh, 8), _randn(rng, tk, 8)
    pos = _positions(rng, tq, tk)
    out, sel = msa_reference(q, k, v, iq, ik, pos, block_size, top_k, scale=0.25)
    # Every visible block (0..own) is selected, ascending, then -1 padding.
    for i in range(tq):
        own = int(pos[i]) // block_size
        expected = list(range(own + 1)) + [-1] * (top_k - own - 1)
        assert sel[i].tolist() == [expected] * kvh
    torch.testing.assert_close(out, dense_causal_attention(q, k, v, pos, scale=0.25), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(("tk", "block_size"), [(37, 8), (32, 8), (9, 1), (5, 16), (50, 7)])
def test_indexer_block_scores_brute_force(rng: torch.Generator, tk: int, block_size: int) -> None:
    tq, g, d = 7, 3, 16
    iq, ik = _randn(rng, tq, g, d, dtype=torch.float32), _randn(rng, tk, d, dtype=torch.float32)
    pos = _positions(rng, tq, tk)
    pos[0] = tk // 2  # a query in the middle of the context
    scores = indexer_block_scores(iq, ik, pos, block_size)
    nb = math.ceil(tk / block_size)
    assert scores.shape == (tq, g, nb) and scores.dtype == torch.float32
    ref = torch.full((tq, g, nb), NEG_INF, dtype=torch.float64)
    for i in range(tq):
        for gg in range(g):
            for j in range(int(pos[i]) + 1):
                s = torch.dot(iq[i, gg].double(), ik[j].double())
                ref[i, gg, j // block_size] = max(ref[i, gg, j // block_size], s)
    torch.testing.assert_close(scores.double(), ref, rtol=1e-5, atol=1e-5)
    assert torch.isneginf(scores[0, :, tk // 2 // block_size + 1 :]).all()  # future blocks


@pytest.mark.parametrize(("nb", "top_k"), [(9, 4), (5, 1), (4, 8), (16, 16), (12, 2)])
def test_select_blocks_brute_force(rng: torch.Generator, nb: int, top_k: int) -> None:
    tq, g, block_size = 20, 3, 4
    # Few distinct values (many ties), with -inf and NaN sprinkled in.
    scores = torch.randint(0, 4, (tq, g, nb), generator=rng).float()
    special = torch.rand(tq, g, nb, generator=rng)
    scores[special < 0.2] = NEG_INF
    scores[special > 0.9] = NAN
    pos = torch.randint(0, nb * block_size, (tq,), generator=rng)
    sel = select_blocks(scores, pos, block_size, top_k)
    assert sel.shape == (tq, g, top_k) and sel.dtype == torch.int64
    assert torch.equal(sel, _brute_select(scores, pos, block_size, top_k))
    for i in range(tq):
        for row in sel[i].tolist():
            assert int(pos[i]) // block_size in row  # own block, whatever its score
            kept = [b for b in row if b >= 0]
            assert kept == sorted(set(kept)) and row == kept + [-1] * (top_k - len(kept))


def test_select_blocks_hand_cases() -> None:
    # Ties: blocks 1, 3, 4 all score 7; the smaller indices 1 and 3 win. Own block 5 (position 41).
    scores = torch.tensor([[[1.0, 7.0, 3.0, 7.0, 7.0, 0.0]]])
    assert select_blocks(scores, torch.tensor([41]), 8, 3).tolist() == [[[1, 3, 5]]]
    assert select_blocks(scores, torch.tensor([41]), 8, 2).tolist() == [[[1, 5]]]
    assert select_blocks(scores, torch.tensor([41]), 8, 1).tolist() == [[[5]]]
    # Short context: only blocks 0 and 1 visible; -1 padding at the end, also when top_k > n_blocks.
    short = torch.tensor([[[2.0, 5.0, NEG_INF, NEG_INF]]])
    assert select_blocks(short, torch.tensor([9]), 8, 4).tolist() == [[[0, 1, -1, -1]]]
    assert select_blocks(short[..., :2], torch.tensor([9]), 8, 5).tolist() == [[[0, 1, -1, -1, -1]]]
    # NaN counts as -inf: never selected, except the own block (2), which is always kept.
    nan = torch.tensor([[[NAN, 1.0, NAN, NAN]], [[NAN, NAN, 0.0, 3.0]]])
    assert select_blocks(nan, torch.tensor([17, 17]), 8, 3).tolist() == [[[1, 2, -1]], [[2, 3, -1]]]


def test_nan_index_scores_select_only_own_block(rng: torch.Generator) -> None:
    ik = _randn(rng, 40, 8)
    ik[:, 0] = NAN
    scores = indexer_block_scores(_randn(rng, 2, 1, 8), ik, torch.tensor([39, 20]), 8)
    assert torch.isnan(scores[0]).all() and torch.isneginf(scores[1, 0, 3:]).all()
    assert select_blocks(scores, torch.tensor([39, 20]), 8, 3).tolist() == [[[4, -1, -1]], [[2, -1, -1]]]


def _random_selection(rng: torch.Generator, pos: torch.Tensor, kvh: int, nb: int, bs: int, top_k: int):
    """Random block sets (own block mostly included, future blocks and duplicates allowed), -1 anywhere."""
    sel = torch.randint(-1, nb, (pos.shape[0], kvh, top_k), generator=rng)
    sel[:, :, 0] = torch.where(torch.rand(pos.shape[0], kvh, generator=rng) < 0.8, pos[:, None] // bs, -1)
    sel[:, :, -1] = -1
    return sel[:, :, torch.randperm(top_k, generator=rng)]


@pytest.mark.parametrize(("h", "kvh", "tk", "bs", "top_k"), [(8, 2, 61, 8, 4), (4, 1, 40, 5, 3), (2, 2, 33, 16, 2)])
def test_msa_attention_brute_force(rng: torch.Generator, h: int, kvh: int, tk: int, bs: int, top_k: int) -> None:
    tq, nb = 9, math.ceil(tk / bs)
    q, k, v = _randn(rng, tq, h, 16), _randn(rng, tk, kvh, 16), _randn(rng, tk, kvh, 8)
    pos = _positions(rng, tq, tk)
    sel = _random_selection(rng, pos, kvh, nb, bs, top_k)
    sel[0, 0, 0], sel[1, 0, 0] = 0, nb - 1  # queries of one chunk selecting different blocks
    sel[2, -1] = -1  # a group with nothing selected attends to nothing: zeros
    out = msa_attention(q, k, v, sel, pos, bs, scale=0.2)

    def keys_of(i: int, g: int) -> list[int]:
        return [j for j in range(tk) if j // bs in sel[i, g].tolist()]

    torch.testing.assert_close(out, _brute_attention(q, k, v, pos, 0.2, keys_of), rtol=1e-12, atol=1e-12)
    assert (out[2, -(h // kvh) :] == 0).all()


def test_output_ignores_unselected_keys(rng: torch.Generator) -> None:
    tq, h, kvh, tk, bs, top_k = 6, 8, 2, 80, 8, 3
    q, k, v = _randn(rng, tq, h, 16), _randn(rng, tk, kvh, 16), _randn(rng, tk, kvh, 8)
    iq, ik = _randn(rng, tq, kvh, 8), _randn(rng, tk, 8)
    pos = _positions(rng, tq, tk)
    out, sel = msa_reference(q, k, v, iq, ik, pos, bs, top_k, scale=0.2)
    key_block = torch.arange(tk) // bs
    for i in range(tq):
        seen = torch.stack([torch.isin(key_block, sel[i, g]) for g in range(kvh)], dim=1)  # [Tk, KVH]
        seen &= (torch.arange(tk) <= pos[i])[:, None]
        k2, v2 = k + 10 * _randn(rng, *k.shape) * ~seen[..., None], v + 10 * _randn(rng, *v.shape) * ~seen[..., None]
        assert torch.equal(msa_attention(q, k2, v2, sel, pos, bs, scale=0.2)[i], out[i])
        j, g = int(pos[i]), int(torch.randint(0, kvh, (1,), generator=rng))  # the own key is always selected
        k3, v3 = k.clone(), v.clone()  # its key and value both: a row whose only visible key is its own
        k3[j, g] += 1.0 + _randn(rng, 16)  # (position 0) has softmax weight 1 whatever that key is
        v3[j, g] += 1.0 + _randn(rng, 8)
        changed = msa_attention(q, k3, v3, sel, pos, bs, scale=0.2)[i]
        group = slice(g * h // kvh, (g + 1) * h // kvh)
        assert not torch.allclose(changed[group], out[i, group], rtol=1e-9, atol=1e-9)
        rest = torch.ones(h, dtype=torch.bool)
        rest[group] = False
        assert torch.equal(changed[rest], out[i, rest])


def test_dtypes(rng: torch.Generator) -> None:
    q, k, v = (_randn(rng, *s, dtype=torch.bfloat16) for s in ((3, 4, 16), (20, 2, 16), (20, 2, 8)))
    iq, ik = _randn(rng, 3, 2, 8, dtype=torch.bfloat16), _randn(rng, 20, 8, dtype=torch.bfloat16)
    pos = torch.tensor([17, 18, 19], dtype=torch.int32)
    out, sel = msa_reference(q, k, v, iq, ik, pos, 4, 2, scale=0.25)
    assert out.dtype == torch.bfloat16 and out.shape == (3, 4, 8) and sel.dtype == torch.int64
    assert indexer_block_scores(iq, ik, pos, 4).dtype == torch.float32


def _bad_calls():
    z = torch.zeros
    pos, sel = torch.tensor([3, 4]), torch.zeros(2, 2, 2, dtype=torch.int64)
    q, k, v = z(2, 4, 8), z(8, 2, 8), z(8, 2, 6)
    return {
        "H not multiple of KVH": lambda: msa_attention(z(2, 3, 8), k, v, sel, pos, 4, 1.0),
        "selected G != KVH": lambda: msa_attention(q, k, v, sel[:, :1], pos, 4, 1.0),
        "D mismatch": lambda: msa_attention(q, z(8, 2, 4), v, sel, pos, 4, 1.0),
        "v Tk mismatch": lambda: msa_attention(q, k, z(7, 2, 6), sel, pos, 4, 1.0),
        "positions length": lambda: msa_attention(q, k, v, sel, pos[:1], 4, 1.0),
        "position past context": lambda: dense_causal_attention(q, k, v, torch.tensor([3, 8]), 1.0),
        "float positions": lambda: dense_causal_attention(q, k, v, pos.float(), 1.0),
        "selected block out of range": lambda: msa_attention(q, k, v, sel + 2, pos, 4, 1.0),
        "dense KVH": lambda: dense_causal_attention(z(2, 4, 8), z(8, 3, 8), z(8, 3, 6), pos, 1.0),
        "q ndim": lambda: dense_causal_attention(z(2, 32), k, v, pos, 1.0),
        "index D mismatch": lambda: indexer_block_scores(z(2, 2, 8), z(8, 4), pos, 4),
        "index_q ndim": lambda: indexer_block_scores(z(2, 8), z(8, 8), pos, 4),
        "block_size 0": lambda: indexer_block_scores(z(2, 2, 8), z(8, 8), pos, 0),
        "scores ndim": lambda: select_blocks(z(2, 2), pos, 4, 2),
        "top_k 0": lambda: select_blocks(z(2, 2, 2), pos, 4, 0),
        "own block past scores": lambda: select_blocks(z(2, 2, 1), pos, 4, 2),
        "index_k Tk != k Tk": lambda: msa_reference(q, k, v, z(2, 2, 4), z(9, 4), pos, 4, 2, 1.0),
    }


@pytest.mark.parametrize("case", list(_bad_calls()))
def test_bad_shapes_raise(case: str) -> None:
    with pytest.raises(ShapeError):
        _bad_calls()[case]()
