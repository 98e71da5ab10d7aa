"""torch.ops.m3c.*: paged writes, paged MSA reads, topk ties, grouped GEMM and the fake (meta) implementations.

Every paged-cache test uses a shuffled (non-contiguous) block table over a pool whose unused blocks and
unused tail slots are NaN poison, so a read outside a request's context shows up as a NaN output.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

import m3c.model_defs.ops  # noqa: F401  (registers torch.ops.m3c.*)
from m3c.model_defs import msa, quant

ops = torch.ops.m3c


def _poison(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A cache tensor full of poison: 0xFF bytes (E4M3 NaN) for one-byte dtypes, NaN otherwise."""
    if dtype.itemsize == 1:
        return torch.full(shape, 0xFF, dtype=torch.uint8).view(dtype)
    return torch.full(shape, float("nan"), dtype=dtype)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of each element (for bit-exact comparisons of any dtype)."""
    return t.contiguous().view(torch.uint8).reshape(*t.shape, t.element_size())


# ---------------------------------------------------------------------------------------------
# paged_write
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "cache_dtype,src_dtype",
    [
        (torch.uint8, torch.uint8),
        (torch.float8_e4m3fn, torch.float8_e4m3fn),
        (torch.bfloat16, torch.bfloat16),
        (torch.bfloat16, torch.float32),
        (torch.float32, torch.float32),
    ],
)
def test_paged_write_writes_only_its_slots(rng: torch.Generator, cache_dtype: torch.dtype,
                                           src_dtype: torch.dtype) -> None:
    nb, bs, h, d = 6, 8, 2, 16
    cache = _poison((nb, bs, h, d), cache_dtype)
    t = int(torch.randint(1, nb * bs, (1,), generator=rng))
    slots = torch.randperm(nb * bs, generator=rng)[:t]
    if src_dtype == torch.uint8:
        src = torch.randint(0, 255, (t, h, d), generator=rng, dtype=torch.uint8)  # 0..254: never the poison byte
    else:
        src = (4 * torch.randn(t, h, d, generator=rng)).to(src_dtype)
    ops.paged_write(src, slots, cache)
    flat = cache.view(nb * bs, h, d)
    assert torch.equal(_bytes(flat[slots]), _bytes(src.to(cache_dtype)))
    untouched = torch.ones(nb * bs, dtype=torch.bool)
    untouched[slots] = False
    assert torch.equal(_bytes(flat[untouched]), _bytes(_poison((int(untouched.sum()), h, d), cache_dtype)))
    # int32 slot mappings (as a kernel may pass them) write the same places
    cache2 = _poison((nb, bs, h, d), cache_dtype)
    ops.paged_write(src, slots.to(torch.int32), cache2)
    assert torch.equal(_bytes(cache2), _bytes(cache))


# ---------------------------------------------------------------------------------------------
# topk
# ---------------------------------------------------------------------------------------------


def test_topk_hand_ties() -> None:
    x = torch.tensor([[1.0, 3.0, 3.0, 2.0, 3.0], [0.0, 0.0, 0.0, 0.0, 0.0], [-math.inf, 1.0, -math.inf, 1.0, 5.0]])
    v, i = ops.topk(x, 4)
    assert i.tolist() == [[1, 2, 4, 3], [0, 1, 2, 3], [4, 1, 3, 0]]
    assert v.tolist() == [[3.0, 3.0, 3.0, 2.0], [0.0] * 4, [5.0, 1.0, 1.0, -math.inf]]
    v, i = ops.topk(x, 1)
    assert i.tolist() == [[1], [0], [4]] and i.dtype == torch.int64


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_topk_brute_force_many_ties(rng: torch.Generator, dtype: torch.dtype) -> None:
    t, e = 64, 16
    x = torch.randint(0, 4, (t, e), generator=rng).to(dtype) / 4  # 4 distinct values over 16 experts
    for k in (1, 3, 8, e):
        v, i = ops.topk(x, k)
        assert v.dtype == dtype and tuple(i.shape) == (t, k)
        for row in range(t):
            want = sorted(range(e), key=lambda j, row=row: (-float(x[row, j]), j))[:k]
            assert i[row].tolist() == want
            assert torch.equal(v[row], x[row, want])


# ---------------------------------------------------------------------------------------------
# grouped_gemm
# ---------------------------------------------------------------------------------------------


def _expert_stack(fmt: str, e: int, n: int, k: int, rng: torch.Generator):
    """(data, scale, global scale, dequantized float64 [E, N, K]) of a random expert stack."""
    w = torch.randn(e, n, k, generator=rng) / math.sqrt(k)
    if fmt == "bf16":
        data = w.to(torch.bfloat16)
        return data, None, None, data.double()
    if fmt == "mxfp8":
        t = quant.mxfp8_quantize(w)
        return t.data, t.scale, None, quant.mxfp8_dequantize(t).double()
    gs = w.abs().amax(dim=-1, keepdim=True).amax(dim=-2, keepdim=True) / (6 * 448)  # one per expert, [E, 1, 1]
    gs = gs.expand(e, n, 1).contiguous()  # the model's layout: [E, N, 1]
    t = quant.nvfp4_quantize(w, gs)
    return t.data, t.scale, gs, quant.nvfp4_dequantize(t).double()


def _poison_expert(fmt: str, data: torch.Tensor, scale: torch.Tensor | None, e: int) -> None:
    """Make expert e NaN when dequantized (so using it by mistake shows)."""
    if fmt == "bf16":
        data[e] = float("nan")
    else:
        assert scale is not None
        scale.view(torch.uint8)[e] = 0xFF  # E4M3 NaN / E8M0 NaN


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp8", "bf16"])
@pytest.mark.parametrize("x_rank", [2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_grouped_gemm_matches_loop(rng: torch.Generator, fmt: str, x_rank: int, dtype: torch.dtype) -> None:
    e, n, kdim, t, top = 6, 32, 64, 11, 3
    data, scale, gs, w = _expert_stack(fmt, e, n, kdim, rng)
    ids = torch.randint(0, e - 1, (t, top), generator=rng)  # expert e-1 is never chosen...
    _poison_expert(fmt, data, scale, e - 1)  # ...and is poison
    x = torch.randn((t, kdim) if x_rank == 2 else (t, top, kdim), generator=rng, dtype=dtype)
    out = ops.grouped_gemm(x, ids, data, scale, gs, fmt)
    assert out.dtype == dtype and tuple(out.shape) == (t, top, n)
    ref = torch.empty(t, top, n, dtype=torch.float64)
    for i in range(t):
        for j in range(top):
            xi = x[i] if x_rank == 2 else x[i, j]
            ref[i, j] = w[int(ids[i, j])] @ xi.double()
    tol = dict(rtol=1e-12, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.double(), ref, **tol)


# ---------------------------------------------------------------------------------------------
# Paged MSA reads
# ---------------------------------------------------------------------------------------------


@dataclass
class PagedBatch:
    """A batch of requests over a shuffled paged pool, with their contiguous dequantized K/V/index-K."""

    fmt: str
    block_size: int
    lengths: list[int]
    q_counts: list[int]
    k_data: torch.Tensor
    k_scale: torch.Tensor | None
    v_data: torch.Tensor
    v_scale: torch.Tensor | None
    ik_data: torch.Tensor
    ik_scale: torch.Tensor | None
    keys: list[torch.Tensor]  # per request, dequantized [len, G, D]
    values: list[torch.Tensor]
    index_keys: list[torch.Tensor]  # per request [len, Di]
    q: torch.Tensor  # [T, H, D] float64
    iq: torch.Tensor  # [T, G, Di]
    positions: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor


def _quantize_into(fmt: str, x: torch.Tensor, slots: torch.Tensor, data: torch.Tensor,
                   scale: torch.Tensor | None) -> torch.Tensor:
    """Quantize x [L, heads, dim] into the paged tensors at `slots`; return its dequantized value (float32)."""
    if fmt == "nvfp4":
        d, s = ops.nvfp4_quantize(x)
        assert scale is not None
        ops.paged_write(d, slots, data)
        ops.paged_write(s, slots, scale)
        return quant.nvfp4_dequantize(quant.NVFP4Tensor(d, s, None))
    if fmt == "fp8":
        assert scale is not None
        d = ops.fp8_quantize(x, scale)
        ops.paged_write(d, slots, data)
        return quant.fp8_dequantize(d, scale)
    ops.paged_write(x.to(torch.bfloat16), slots, data)
    return x.to(torch.bfloat16).float()


def _cache_tensors(fmt: str, nb: int, bs: int, heads: int, dim: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    if fmt == "nvfp4":
        return _poison((nb, bs, heads, dim // 2), torch.uint8), _poison((nb, bs, heads, dim // 16), torch.float8_e4m3fn)
    if fmt == "fp8":
        return _poison((nb, bs, heads, dim), torch.float8_e4m3fn), torch.tensor(0.75)  # a non-trivial tensor scale
    return _poison((nb, bs, heads, dim), torch.bfloat16), None


def _paged_batch(rng: torch.Generator, fmt: str, bs: int = 8, g: int = 2, h: int = 4, d: int = 32,
                 di: int = 32) -> PagedBatch:
    n_req = int(torch.randint(2, 4, (1,), generator=rng))
    lengths = [int(torch.randint(1, 6 * bs, (1,), generator=rng)) for _ in range(n_req)]
    lengths[0] = int(torch.randint(4 * bs + 1, 7 * bs, (1,), generator=rng))  # one long request: > top-k blocks
    n_blocks = [-(-n // bs) for n in lengths]
    width = max(n_blocks) + 1
    nb = sum(n_blocks) + 3  # spare blocks stay poison
    order = torch.randperm(nb, generator=rng).tolist()
    k_data, k_scale = _cache_tensors(fmt, nb, bs, g, d)
    v_data, v_scale = _cache_tensors(fmt, nb, bs, g, d)
    ik_data, ik_scale = _cache_tensors(fmt, nb, bs, 1, di)
    table = torch.zeros(n_req, width, dtype=torch.int32)
    keys, values, index_keys = [], [], []
    q_counts, positions = [], []
    for r, length in enumerate(lengths):
        blocks = torch.tensor([order.pop() for _ in range(n_blocks[r])])
        table[r, : n_blocks[r]] = blocks.to(torch.int32)
        pos = torch.arange(length)
        slots = blocks[pos // bs] * bs + pos % bs
        keys.append(_quantize_into(fmt, torch.randn(length, g, d, generator=rng), slots, k_data, k_scale))
        values.append(_quantize_into(fmt, torch.randn(length, g, d, generator=rng), slots, v_data, v_scale))
        index_keys.append(_quantize_into(fmt, torch.randn(length, 1, di, generator=rng), slots, ik_data, ik_scale)[:, 0])
        nq = int(torch.randint(1, min(length, 9) + 1, (1,), generator=rng))  # a chunk / decode rows at the end
        q_counts.append(nq)
        positions.append(torch.arange(length - nq, length))
    t = sum(q_counts)
    starts = [0]
    for c in q_counts:
        starts.append(starts[-1] + c)
    return PagedBatch(
        fmt, bs, lengths, q_counts, k_data, k_scale, v_data, v_scale, ik_data, ik_scale, keys, values, index_keys,
        q=torch.randn(t, h, d, generator=rng, dtype=torch.float64),
        iq=torch.randn(t, g, di, generator=rng),
        positions=torch.cat(positions),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(lengths, dtype=torch.int32),
        block_table=table,
    )


def _rows(b: PagedBatch, r: int) -> slice:
    return slice(int(b.query_start_loc[r]), int(b.query_start_loc[r + 1]))


@pytest.mark.parametrize("fmt", ["nvfp4", "fp8", "bf16"])
def test_paged_msa_ops_equal_contiguous_reference(rng: torch.Generator, fmt: str) -> None:
    b = _paged_batch(rng, fmt)
    bs, top_k, scale = b.block_size, 2, 1 / math.sqrt(b.q.shape[-1])
    meta = (b.positions, b.query_start_loc, b.seq_lens, b.block_table)
    scores = ops.indexer_block_scores(b.iq, b.ik_data, b.ik_scale, fmt, *meta, bs)
    assert scores.dtype == torch.float32 and tuple(scores.shape) == (*b.iq.shape[:2], b.block_table.shape[1])
    selected = ops.select_blocks(scores, b.positions, bs, top_k)
    sparse = ops.sparse_attention(b.q, b.k_data, b.k_scale, b.v_data, b.v_scale, fmt, selected, *meta, bs, scale)
    dense = ops.paged_attention(b.q, b.k_data, b.k_scale, b.v_data, b.v_scale, fmt, *meta, bs, scale)
    assert sparse.dtype == dense.dtype == torch.float64
    assert torch.isfinite(sparse).all() and torch.isfinite(dense).all(), "read a poisoned (unwritten) slot"
    dropped = 0
    for r, length in enumerate(b.lengths):
        rows, pos = _rows(b, r), b.positions[_rows(b, r)]
        n_blocks = -(-length // bs)
        want = msa.indexer_block_scores(b.iq[rows], b.index_keys[r], pos, bs)
        assert torch.equal(scores[rows, :, :n_blocks], want)
        assert bool((scores[rows, :, n_blocks:] == -math.inf).all())
        sel = msa.select_blocks(want, pos, bs, top_k)
        assert torch.equal(selected[rows], sel)
        k, v = b.keys[r], b.values[r]
        torch.testing.assert_close(sparse[rows], msa.msa_attention(b.q[rows], k, v, sel, pos, bs, scale),
                                   rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(dense[rows], msa.dense_causal_attention(b.q[rows], k, v, pos, scale),
                                   rtol=1e-12, atol=1e-12)
        dropped += int(((pos // bs + 1) > top_k).sum())  # queries that see more blocks than they keep
    assert dropped > 0  # the long request really exercises block dropping
    r0 = _rows(b, 0)
    assert not torch.allclose(sparse[r0], dense[r0])  # ...and dropping changes its output


def test_paged_ops_ignore_block_table_padding(rng: torch.Generator) -> None:
    """Entries of the block table past a request's blocks are never read (pad them with a poisoned block)."""
    b = _paged_batch(rng, "nvfp4")
    bs, scale = b.block_size, 0.2
    meta = (b.positions, b.query_start_loc, b.seq_lens, b.block_table)
    want = ops.paged_attention(b.q, b.k_data, b.k_scale, b.v_data, b.v_scale, "nvfp4", *meta, bs, scale)
    used = set(b.block_table.flatten().tolist())
    spare = next(i for i in range(b.k_data.shape[0]) if i not in used)  # still all poison
    table = b.block_table.clone()
    for r, length in enumerate(b.lengths):
        table[r, -(-length // bs):] = spare
    got = ops.paged_attention(b.q, b.k_data, b.k_scale, b.v_data, b.v_scale, "nvfp4", b.positions,
                              b.query_start_loc, b.seq_lens, table, bs, scale)
    assert torch.equal(got, want)
    scores = ops.indexer_block_scores(b.iq, b.ik_data, b.ik_scale, "nvfp4", b.positions, b.query_start_loc,
                                      b.seq_lens, table, bs)
    assert not torch.isnan(scores).any()


# ---------------------------------------------------------------------------------------------
# Fake (meta) implementations
# ---------------------------------------------------------------------------------------------


def _op_cases(rng: torch.Generator) -> list[tuple[str, tuple]]:
    b = _paged_batch(rng, "nvfp4")
    bs = b.block_size
    meta = (b.positions, b.query_start_loc, b.seq_lens, b.block_table)
    scores = ops.indexer_block_scores(b.iq, b.ik_data, b.ik_scale, "nvfp4", *meta, bs)
    selected = ops.select_blocks(scores, b.positions, bs, 2)
    x = torch.randn(5, 2, 32, generator=rng)
    d, s = ops.nvfp4_quantize(x)
    mx = quant.mxfp8_quantize(torch.randn(4, 64, generator=rng))
    wd, ws, wg, _ = _expert_stack("nvfp4", 4, 32, 64, rng)
    md, msc, _, _ = _expert_stack("mxfp8", 4, 32, 64, rng)
    ids = torch.randint(0, 4, (5, 2), generator=rng)
    f8 = _poison((4, 8, 2, 32), torch.float8_e4m3fn)
    return [
        ("nvfp4_quantize", (x,)),
        ("nvfp4_dequantize", (d, s, torch.tensor(0.5))),
        ("nvfp4_dequantize", (d, s, None)),
        ("mxfp8_dequantize", (mx.data, mx.scale)),
        ("fp8_quantize", (x, torch.tensor(0.5))),
        ("paged_write", (x.to(torch.float8_e4m3fn), torch.tensor([0, 9, 17, 30, 31]), f8)),
        ("indexer_block_scores", (b.iq, b.ik_data, b.ik_scale, "nvfp4", *meta, bs)),
        ("select_blocks", (scores, b.positions, bs, 2)),
        ("sparse_attention", (b.q, b.k_data, b.k_scale, b.v_data, b.v_scale, "nvfp4", selected, *meta, bs, 0.2)),
        ("paged_attention", (b.q.float(), b.k_data, b.k_scale, b.v_data, b.v_scale, "nvfp4", *meta, bs, 0.2)),
        ("topk", (torch.randn(5, 8, generator=rng), 3)),
        ("grouped_gemm", (torch.randn(5, 64, generator=rng), ids, wd, ws, wg, "nvfp4")),
        ("grouped_gemm", (torch.randn(5, 2, 64, generator=rng, dtype=torch.float64), ids, md, msc, None, "mxfp8")),
    ]


def _to_meta(a):
    return a.to("meta") if isinstance(a, torch.Tensor) else a


def _flat(out) -> list[torch.Tensor]:
    if out is None:
        return []
    return list(out) if isinstance(out, (tuple, list)) else [out]


def test_fake_impls_match_real(rng: torch.Generator) -> None:
    """Each op run on meta tensors (its fake) gives the real output's shapes and dtypes, and mutates nothing."""
    for name, args in _op_cases(rng):
        real = _flat(getattr(ops, name)(*args))
        fake = _flat(getattr(ops, name)(*(_to_meta(a) for a in args)))
        assert len(real) == len(fake), name
        for r, f in zip(real, fake):
            assert f.is_meta, name
            assert (tuple(f.shape), f.dtype) == (tuple(r.shape), r.dtype), name


def test_fake_impls_opcheck(rng: torch.Generator) -> None:
    """torch.library.opcheck's FakeTensor test (shapes, dtypes, strides, aliasing) on every op."""
    for name, args in _op_cases(rng):
        torch.library.opcheck(getattr(ops, name), args, test_utils=("test_faketensor",))
