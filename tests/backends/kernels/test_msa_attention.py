"""The MSA sparse-attention decode kernel against `m3c.model_defs.ops.sparse_attention` on the same paged caches.

CPU CI runs it in Triton's interpreter at tiny shapes (float32 dots, so float32 q matches the reference
to rounding); `-m gpu` runs m3.1-small shapes (16 q heads, 1 KV head, D=128, block 128, top-16).
"""

from __future__ import annotations

import os

import pytest
import torch

from m3c.backends.kernels import msa_attention_cuda
from m3c.model_defs import ops, quant

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _kernel():
    if not torch.cuda.is_available():
        assert os.environ.get("TRITON_INTERPRET") == "1", "tests/conftest.py sets the interpreter without a GPU"
    from m3c.backends.kernels import msa_attention

    return msa_attention


def _case(gen: torch.Generator, d: int, bs: int, hg: int, kvh: int, top_k: int, reqs: list[tuple[int, int]],
          q_dtype: torch.dtype = torch.float32, pad_p: float = 0.3, device: str = DEVICE, share_p: float = 0.0) -> dict:
    """Random paged NVFP4 caches, shuffled block tables and selections for requests [(context, query rows)]
    (the rows are the request's last positions, as in a prefill chunk or decode).

    Slots past each request's length and unowned blocks hold NaN poison (0xFF codes, E4M3 NaN scales).
    ``share_p``: probability that a row starts from the previous row's selection (as consecutive rows of a
    chunk mostly do) and changes one entry to any block of the request (future ones too), a duplicate or -1.
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
        prev: list[list[int]] = []
        for p in range(length - rows, length):
            positions.append(p)
            own = p // bs
            for g in range(kvh):
                if prev and float(torch.rand(1, generator=gen)) < share_p:
                    sel = list(prev[g])
                    sel[int(torch.randint(0, top_k, (1,), generator=gen))] = int(
                        torch.randint(-1, need[r], (1,), generator=gen))
                    if own not in sel:
                        sel[int(torch.randint(0, top_k, (1,), generator=gen))] = own
                else:
                    others = [b for b in torch.randperm(need[r], generator=gen).tolist() if b != own]
                    n = int(torch.randint(0, top_k, (1,), generator=gen)) if torch.rand(1, generator=gen) < pad_p \
                        else top_k - 1
                    sel = sorted([own, *others[:n]])
                    sel += [-1] * (top_k - len(sel))
                selected.append(sel)
            prev = selected[-kvh:]
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


def test_requests_without_rows_and_empty(rng: torch.Generator) -> None:
    """Requests holding no rows (between, before and after others) do not shift the kernel's row -> request
    lookup (it reads query_start_loc in-kernel, RB requests at a time: more requests than RB here); zero rows
    is a no-op."""
    d, bs, hg, kvh, top_k, reqs = CASES["d32-b16-g3x2-k2"]
    c = _case(rng, d, bs, hg, kvh, top_k, [*reqs, (20, 1)])
    k = _kernel()
    want = _run(c, 2)
    rows = torch.diff(c["query_start_loc"])
    n = rows.numel()
    pad = 70  # empty requests around every real one: 4 * 70 + n requests > RB = 64
    new_rows = torch.zeros(n * (pad + 1) + pad, dtype=torch.int32)
    new_rows[pad::pad + 1] = rows
    keep = torch.zeros(new_rows.numel(), dtype=torch.bool)
    keep[pad::pad + 1] = True
    idx = (torch.cumsum(keep.long(), 0) - 1).clamp(min=0)
    seq = torch.where(keep, c["seq_lens"][idx], 0).to(torch.int32)  # a row mapped to an empty request sees no key
    c2 = {**c, "query_start_loc": torch.cat([torch.zeros(1, dtype=torch.int32), new_rows.cumsum(0).to(torch.int32)]),
          "seq_lens": seq, "block_table": c["block_table"][idx].contiguous()}
    assert torch.equal(k.msa_sparse_attention_decode(**c2, split=2), want)
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


# ---------------------------------------------------------------------------------------------
# The prefill kernel and the runner-based launcher (msa_sparse_attention, attention_specs)
# ---------------------------------------------------------------------------------------------

PREFILL_CASES = {
    # name: (D, block, H/KVH, KVH, top_k, [(context, query rows), ...]); interpreter tiles hold 16 // pow2(H/KVH)
    # rows (4 here), so requests span several tiles, partial ones, and one request has no rows at all.
    "d64-b16-g4x1-k4": (64, 16, 4, 1, 4, [(75, 9), (40, 0), (37, 6), (16, 2)]),
    "d32-b8-g3x2-k3": (32, 8, 3, 2, 3, [(29, 5), (52, 11)]),
}


def _attn(c: dict, **kw) -> torch.Tensor:
    """msa_sparse_attention into a NaN-poisoned output."""
    out = torch.full_like(c["q"], float("nan"))
    assert _kernel().msa_sparse_attention(**c, out=out, **kw) is out
    return out


def _reference_rows(c: dict, rows: torch.Tensor) -> torch.Tensor:
    """The reference on a subset of rows (sorted), as its own batch (each row's output depends only on itself)."""
    qsl = c["query_start_loc"].cpu()
    req = torch.searchsorted(qsl[1:], rows, right=True)
    counts = torch.bincount(req, minlength=qsl.numel() - 1)
    sub_qsl = torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)]).to(torch.int32)
    idx = rows.to(c["q"].device)
    return _reference({**c, "q": c["q"][idx], "selected": c["selected"][idx], "positions": c["positions"][idx],
                       "query_start_loc": sub_qsl.to(c["q"].device)})


@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("name", list(PREFILL_CASES))
def test_prefill_matches_reference(name: str, q_dtype: torch.dtype, rng: torch.Generator) -> None:
    """Prefill kernel (max_q_rows=0 forces it): chunks of several requests of different lengths, consecutive rows
    sharing most of their selection but differing, with duplicates, -1 and future entries. float32 q: float32
    rounding of the reference; bf16 q: the float32-q result rounded to bf16 (see test_bf16_q)."""
    d, bs, hg, kvh, top_k, reqs = PREFILL_CASES[name]
    c = _case(rng, d, bs, hg, kvh, top_k, reqs, q_dtype=q_dtype, share_p=0.7)
    out, ref = _attn(c, max_q_rows=0), _reference(c)
    assert out.dtype == q_dtype and bool(torch.isfinite(out).all()), "unwritten (NaN-poisoned) or non-finite output"
    if q_dtype == torch.float32 or DEVICE != "cpu":
        assert _rel(out, ref) <= (5e-6 if DEVICE == "cpu" else 1e-4 if q_dtype == torch.float32 else 2e-2)
    else:
        f32 = _attn({**c, "q": c["q"].float()}, max_q_rows=0)
        assert bool(((out.float() - f32).abs() <= 2**-8 * f32.abs() + 1e-30).all())
        bound = 2**-7 * ref.float().abs() + 5e-6 * ref.float().abs().max()
        assert bool(((out.float() - ref.float()).abs() <= bound).all())


def test_prefill_tile_entries(rng: torch.Generator) -> None:
    """One tile whose rows select future-only, -1-only, duplicate, unsorted and differing blocks; and the decode
    and prefill paths agree (to float32 rounding) on the same rows."""
    d, bs, hg, kvh, top_k = 32, 8, 2, 1, 4  # interpreter tile: 8 rows; positions 38..44, own blocks 4, 5
    c = _case(rng, d, bs, hg, kvh, top_k, [(45, 7)])
    c["selected"][:, 0] = torch.tensor([[5, -1, -1, -1], [-1, -1, -1, -1], [5, 5, 2, -1], [5, 0, 3, 1],
                                        [2, 5, -1, 2], [5, 0, 3, 1], [4, 5, 1, 0]])
    out = _attn(c, max_q_rows=0)
    assert bool((out[:2] == 0).all()), "rows with no visible key output zeros"
    assert _rel(out, _reference(c)) <= (5e-6 if DEVICE == "cpu" else 1e-4)
    assert _rel(_attn(c), out) <= (2e-6 if DEVICE == "cpu" else 1e-4)  # default max_q_rows: the decode kernel


def test_launcher_picks_kernel_by_shape(rng: torch.Generator) -> None:
    """T <= max_q_rows * R runs the decode kernel, otherwise the prefill kernel; both match the reference."""
    from m3c.backends.triton_aot import jit_run

    d, bs, hg, kvh, top_k, _ = CASES["d32-b8-g2x2-k3"]
    c = _case(rng, d, bs, hg, kvh, top_k, [(29, 3), (52, 2)], share_p=0.5)
    used: list[str] = []

    def runner(spec, grid, args) -> None:
        used.append(spec.family)
        jit_run(spec, grid, args)

    ref = _reference(c)
    for max_q_rows, family in ((3, "msa_attention_decode"), (2, "msa_attention_prefill")):
        out = _attn(c, runner=runner, max_q_rows=max_q_rows)
        assert used[-1] == family and _rel(out, ref) <= (5e-6 if DEVICE == "cpu" else 1e-4)


def _layout_batch(t: int, r: int, q_dtype: torch.dtype) -> dict:
    """Tiny m3.1-small-layout inputs (16 heads, 1 KV head, D=128, block 128, top-16) for launch planning only."""
    nb, bs, d = 2, 128, 128
    rows = torch.full((r,), t // r, dtype=torch.int32)
    rows[: t % r] += 1
    return {"q": torch.zeros(t, 16, d, dtype=q_dtype), "k_data": torch.zeros(nb, bs, 1, d // 2, dtype=torch.uint8),
            "k_scale": torch.zeros(nb, bs, 1, d // 16, dtype=torch.float8_e4m3fn),
            "v_data": torch.zeros(nb, bs, 1, d // 2, dtype=torch.uint8),
            "v_scale": torch.zeros(nb, bs, 1, d // 16, dtype=torch.float8_e4m3fn),
            "selected": torch.zeros(t, 1, 16, dtype=torch.int64), "positions": torch.zeros(t, dtype=torch.int64),
            "query_start_loc": torch.cat([torch.zeros(1, dtype=torch.int32), rows.cumsum(0).to(torch.int32)]),
            "seq_lens": torch.ones(r, dtype=torch.int32), "block_table": torch.zeros(r, 1, dtype=torch.int32),
            "block_size": bs, "scale": d**-0.5}


@pytest.mark.parametrize("q_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
def test_launch_specs_are_in_attention_specs(q_dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """With GPU settings, every spec the launcher produces at many (T, R) is one of attention_specs (by key), and
    its grid covers the work (decode: T·KVH·SPLIT programs; prefill: >= sum_r ceil(rows_r / ROWS) tiles)."""
    k = _kernel()
    monkeypatch.setattr(k, "interpreting", lambda: False)
    keys = {s.key() for s in k.attention_specs(16, 1, 128, 128, 16, "bf16" if q_dtype == torch.bfloat16 else "fp32")}
    seen: dict[str, set[int]] = {"msa_attention_decode": set(), "msa_attention_prefill": set()}
    calls: list = []
    for t, r in ((1, 1), (2, 1), (4, 1), (8, 1), (9, 1), (8, 8), (32, 8), (64, 8), (100, 16), (33, 32), (256, 32), (257, 32),
                 (4096, 1), (1000, 3), (16384, 1), (300, 200)):
        b = _layout_batch(t, r, q_dtype)
        k.msa_sparse_attention(**b, runner=lambda spec, grid, args: calls.append((spec, grid, args)), max_q_rows=8)
        (spec, grid, args), = calls[-1:]
        assert spec.key() in keys, (t, r, spec.family, spec.constexprs)
        assert len(args) == len(spec.arg_types)
        c = spec.constexprs
        if spec.family == "msa_attention_decode":
            assert t <= 8 * r and grid == (t * c["SPLIT"],)
            seen[spec.family].add(c["SPLIT"])
        else:
            qsl = b["query_start_loc"]
            assert t > 8 * r and grid[0] >= int(((qsl[1:] - qsl[:-1] + c["ROWS"] - 1) // c["ROWS"]).sum())
            seen[spec.family].add(c["ROWS"])
    assert seen["msa_attention_decode"] == {1, 2, 4, 8, 16} and seen["msa_attention_prefill"]
    for t, r in ((4096, 1), (300, 200)):  # the default (measured faster on the H200): the decode kernel for all
        k.msa_sparse_attention(**_layout_batch(t, r, q_dtype), runner=lambda spec, grid, args: calls.append(spec))
        assert calls[-1].family == "msa_attention_decode" and calls[-1].key() in keys


def test_aot_compiles_without_spills() -> None:
    """Every bf16 spec (decode at each split bucket, the CUDA decode's + prefill) and the float32 prefill spec
    build offline for sm_90a at m3.1-small shapes, without register spills (cuobjdump resource usage: STACK 0)."""
    import re

    from m3c.backends.cuda_aot import cuobjdump
    from m3c.backends.triton_aot import compile_kernels

    k = _kernel()
    specs = [*k.attention_specs(16, 1, 128, 128, 16, "bf16"), k.prefill_spec(16, 1, 128, 128, 16, "fp32")]
    built = compile_kernels(specs)
    cuda = len(msa_attention_cuda.splits(16, 128)) if k.ATTN_CUDA else 0  # the CUDA C++ decode's splits
    assert [b.name for b in built] == ["msa_decode_kernel"] * 5 + ["msa_attn_decode"] * cuda + ["msa_prefill_kernel"] * 2
    assert [b.key for b in built] == [s.key() for s in specs] and all(b.binary for b in built)
    for b in built:
        usage = cuobjdump(b.binary, "-res-usage")
        stack = re.search(r"STACK:(\d+)", usage)
        assert stack is not None and int(stack.group(1)) == 0, (b.key, usage)


def test_rejects_bad_inputs(rng: torch.Generator) -> None:
    """Wrong selection / batch-metadata shapes, a misaligned cache and a bad q_dtype raise ShapeError."""
    from m3c.errors import ShapeError

    d, bs, hg, kvh, top_k, reqs = CASES["d32-b16-g3x2-k2"]
    c = _case(rng, d, bs, hg, kvh, top_k, reqs)
    k = _kernel()
    with pytest.raises(ShapeError, match="selected"):
        k.msa_sparse_attention(**{**c, "selected": c["selected"][:, :1]})
    with pytest.raises(ShapeError, match="query_start_loc"):
        k.msa_sparse_attention(**{**c, "query_start_loc": c["query_start_loc"][:-1]})
    with pytest.raises(ShapeError, match="aligned"):
        shifted = torch.empty(c["k_data"].numel() + 1, dtype=torch.uint8, device=c["k_data"].device)[1:]
        k.msa_sparse_attention(**{**c, "k_data": shifted.view(c["k_data"].shape)})
    with pytest.raises(ShapeError, match="q_dtype"):
        k.attention_specs(16, 1, 128, 128, 16, "fp16")


@pytest.mark.gpu
@pytest.mark.parametrize("q_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
def test_prefill_m31_small_gpu(q_dtype: torch.dtype, rng: torch.Generator) -> None:
    """m3.1-small TP4 slice (16 q heads, 1 KV head, D=128, block 128, top-16): a 4K-row chunk at 128K context,
    a 300-row chunk of a second request and a decode row, through the prefill kernel; 96 sampled rows (and every
    row of one tile) against the reference."""
    c = _case(rng, 128, 128, 16, 1, 16, [(128 * 1024, 4096), (32 * 1024 + 77, 300), (5000, 1)], q_dtype=q_dtype,
              device="cuda", share_p=0.8)
    out = _attn(c, max_q_rows=0)
    assert bool(torch.isfinite(out).all())
    rows = torch.cat([torch.arange(8), torch.randperm(c["q"].shape[0] - 8, generator=rng)[:96] + 8]).sort().values
    ref = _reference_rows(c, rows)
    assert _rel(out[rows.cuda()], ref) <= (1e-4 if q_dtype == torch.float32 else 2e-2)
