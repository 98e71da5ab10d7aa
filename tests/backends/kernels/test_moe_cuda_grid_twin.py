"""A Python twin of the CUDA MoE decode kernels' work split (``find_block``, ``find_tokens`` and the column groups of
``moe_fc1`` / ``moe_fc2`` in ``cuda/moe_decode_mma.cu``), driven by the grids and arguments :func:`moe_decode_mma`
really launches (meta tensors: no data): every CTA of the grid decodes its item as the kernel does, and the rows and
columns it writes are counted. Each routed pair's and each shared token's output rows must be written exactly once,
nothing else at all (a pair whose id is out of range: never). The CPU's check that the host's grids and the
kernels' item decoding agree, for the plain builds and the looping ones (above 8 tokens, hot experts included)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_moe_cuda import mxfp8, nvfp4

from m3c.backends.kernels import moe_cuda
from m3c.fused.moe import hot_routing


def _launches(t: int, hidden: int, inter: int, experts: int, top_k: int, shared: int) -> dict[str, tuple]:
    """{kernel: (spec, grid, {argument name: value})} of one moe_decode_mma call on meta tensors."""
    seen: dict[str, tuple] = {}

    def record(spec, grid, args):
        seen[spec.kernel] = (spec, grid, dict(zip((n for n, _ in spec.arg_types), args, strict=False)))

    x = torch.empty(t, hidden, dtype=torch.bfloat16, device="meta")
    ids = torch.empty(t, top_k, dtype=torch.int64, device="meta")
    w = torch.empty(t, top_k, device="meta")
    s13, s2 = (mxfp8(2 * shared, hidden), mxfp8(hidden, shared)) if shared else (None, None)
    moe_cuda.moe_decode_mma(x, ids, w, nvfp4(experts, 2 * inter, hidden), nvfp4(experts, hidden, inter), s13, s2,
                            runner=record)
    return seen


def _shared_first(idx: int, shared: int, routed: int) -> int:
    """Grid position -> find_block item where the shared expert's items run first (moe_decode_items.cuh's
    shared_first: FC1's grid, moe_experts' FC2 tickets)."""
    return routed + idx if idx < shared else idx - shared


def _find_block(item: int, ids: np.ndarray, t: int, e: int, n_slots: int, rows: int, srows: int, ksr: int,
                kss: int, maxt: int, groups_max: int, cta_rows: int) -> tuple[int, int, int, int] | None:
    """(expert or -1, row0, ks, grp or -1) of a work item, or None for an unused slot (find_block); a CTA covers
    cta_rows = 32 WARPS weight rows."""
    per = rows // cta_rows
    if item >= n_slots * per * ksr:
        item -= n_slots * per * ksr
        groups = 1 if groups_max == 1 else -(-t // maxt)
        grp, item = item % groups, item // groups
        ks, row0 = item % kss, (item // kss) * cta_rows
        return (-1, row0, ks, grp) if row0 < srows else None
    ks, item = item % ksr, item // ksr
    slot, row0 = item // per, (item % per) * cta_rows
    touched = sorted({int(v) for v in ids.reshape(-1) if 0 <= v < e})
    return (touched[slot], row0, ks, -1) if slot < len(touched) else None


def _columns(expert: int, ids: np.ndarray, t: int, top_k: int) -> list[int]:
    """The output rows (pairs) of the block's compacted columns, in column order (find_tokens)."""
    if expert < 0:
        return [t * top_k + n for n in range(t)]
    out = []
    for n in range(t):
        slots = [k for k in range(top_k) if ids[n, k] == expert]
        if slots:
            out.append(n * top_k + slots[0])
    return out


def _coverage(kernel: str, launch: tuple, ids: np.ndarray, t: int, top_k: int) -> np.ndarray:
    """How often each (K split, pair, row) of the kernel's output is written."""
    spec, grid, a = launch
    d = dict(spec.defines)
    maxt, cta_rows = 8 * d["NT"], 32 * d["WARPS"]
    groups_max = -(-d.get("TMAX", maxt) // maxt)
    fc1 = kernel == "moe_fc1"
    e, n_slots, pairs = a["E"], a["n_slots"], a["P"]
    rows, srows = (a["rows"], a["srows"]) if fc1 else (a["H"], a["H"] if a["S"] else 0)
    ksr, kss = (a["KSr"], a["KSs"]) if fc1 else (1, a["KSs"])
    width = a["ROWS"] if fc1 else a["H"]
    count = np.zeros((max(ksr, kss), pairs, width), dtype=np.int64)
    groups = 1 if groups_max == 1 else -(-t // maxt)
    shared_items = srows // cta_rows * kss * groups if fc1 else 0  # FC1: the shared items first in the grid
    routed_items = n_slots * (rows // cta_rows) * ksr
    for block in range(grid[0]):
        item = _shared_first(block, shared_items, routed_items) if fc1 else block
        found = _find_block(item, ids, t, e, n_slots, rows, srows, ksr, kss, maxt, groups_max, cta_rows)
        if found is None:
            continue
        expert, row0, ks, grp = found
        cols = _columns(expert, ids, t, top_k)
        c0, c1 = (0, len(cols)) if grp < 0 else (grp * maxt, min(len(cols), grp * maxt + maxt))
        assert grp >= 0 or groups_max > 1 or len(cols) <= maxt, "a narrow build got more columns than it runs"
        for p in cols[c0:c1]:
            count[ks, p, row0:row0 + cta_rows] += 1
    return count


def _expected(ids: np.ndarray, t: int, top_k: int, e: int, ks_routed: int, ks_shared: int, routed_rows: int,
              shared_rows: int, shape: tuple) -> np.ndarray:
    want = np.zeros(shape, dtype=np.int64)
    for n in range(t):
        for k in range(top_k):
            if 0 <= ids[n, k] < e:
                want[:ks_routed, n * top_k + k, :routed_rows] = 1
        if shared_rows:
            want[:ks_shared, t * top_k + n, :shared_rows] = 1
    return want


FOLD_LAYOUT = (256, 16, 4)  # inter, experts, top_k of the fold tests (hidden 1536: BALANCE_SHARED's 3 or 6 splits)


def _folded(monkeypatch: pytest.MonkeyPatch, knob: str, warps: int, t: int, hot: int, shared: int,
            hidden: int) -> tuple[np.ndarray, dict]:
    """Fresh routing (``hot`` tokens on one expert; above 3 tokens one id out of range) and the launches of
    :data:`FOLD_LAYOUT` at this width with ``knob`` on and ``warps`` warps a CTA."""
    monkeypatch.setattr(moe_cuda, "WARPS", warps)
    monkeypatch.setattr(moe_cuda, knob, True)
    inter, e, top_k = FOLD_LAYOUT
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    ids = hot_routing(t, e, top_k, hot, gen)[0].numpy()
    if t > 3:
        ids[2, 1] = e
    return ids, _launches(t, hidden, inter, e, top_k, shared)


@pytest.mark.parametrize("t,hot,warps", [(1, 0, 4), (5, 5, 4), (8, 8, 4), (9, 0, 4), (16, 16, 4), (17, 0, 4),
                                         (24, 17, 4), (32, 9, 4), (33, 0, 4), (40, 33, 4), (64, 64, 4), (64, 0, 4),
                                         (1, 0, 1), (6, 6, 1), (16, 9, 1), (32, 17, 1), (4, 0, 2), (40, 33, 2)])
@pytest.mark.parametrize("shared", [256, 0])
def test_every_output_row_is_written_once(t: int, hot: int, warps: int, shared: int,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Every routed pair's and shared token's rows written once by FC1 and FC2, nothing else: at the shipped CTA size
    (WARPS = 4, 128 rows) and the smaller ones benchmarks try (32 and 64 rows a CTA)."""
    monkeypatch.setattr(moe_cuda, "WARPS", warps)
    hidden, inter, e, top_k = 1024, 256, 16, 4
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    ids = hot_routing(t, e, top_k, hot, gen)[0].numpy()
    if t > 3:
        ids[2, 1] = e  # an out-of-range id (NaN router logits): no CTA writes its pair
    launches = _launches(t, hidden, inter, e, top_k, shared)
    fc1, fc2 = launches["moe_fc1"], launches["moe_fc2"]
    loop_tmax = moe_cuda.NT1_MAX_TOKENS if t <= moe_cuda.NT1_MAX_TOKENS else 64
    assert dict(fc1[0].defines).get("TMAX") == (loop_tmax if t > 8 else None)
    a1, a2 = fc1[2], fc2[2]
    got1 = _coverage("moe_fc1", fc1, ids, t, top_k)
    want1 = _expected(ids, t, top_k, e, a1["KSr"], a1["KSs"], 2 * inter, 2 * shared, got1.shape)
    assert np.array_equal(got1, want1), np.argwhere(got1 != want1)[:5]
    got2 = _coverage("moe_fc2", fc2, ids, t, top_k)
    want2 = _expected(ids, t, top_k, e, 1, a2["KSs"], hidden, hidden if shared else 0, got2.shape)
    assert np.array_equal(got2, want2), np.argwhere(got2 != want2)[:5]


def test_a_cta_size_the_kernels_cannot_run_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """find_tokens compacts 32 tokens a warp: one warp cannot run the NT = 2 looping build (up to 64 tokens, above
    NT1_MAX_TOKENS), so the decode refuses those calls (megamoe then takes its other path) and the build itself; the
    launch bounds count 16 warps an SM, so only 1, 2 or 4 warps a CTA are taken."""
    from m3c.errors import ConfigError, ShapeError

    monkeypatch.setattr(moe_cuda, "WARPS", 1)
    big = moe_cuda.NT1_MAX_TOKENS + 1
    assert moe_cuda.mma_specs(1024, 256, 256, "bf16", 2)[1].defines[0] == ("WARPS", 1)
    assert "WARPS = 1" in moe_cuda.mma_supported(1024, 256, 16, 4, 256, "bf16", "nvfp4", "mxfp8", big)
    assert moe_cuda.mma_supported(1024, 256, 16, 4, 256, "bf16", "nvfp4", "mxfp8", big - 1) is None
    with pytest.raises(ShapeError, match="WARPS = 1"):
        _launches(big, 1024, 256, 16, 4, 256)
    with pytest.raises(ConfigError, match="WARPS = 1"):
        moe_cuda.mma_specs(1024, 256, 256, "bf16", 2, wide=True)
    monkeypatch.setattr(moe_cuda, "WARPS", 3)
    with pytest.raises(ConfigError, match="WARPS = 3"):
        moe_cuda.mma_specs(1024, 256, 256, "bf16", 1)


@pytest.mark.parametrize("t,hot,warps", [(1, 0, 4), (5, 5, 4), (9, 0, 4), (16, 16, 4), (33, 0, 4), (40, 33, 4),
                                         (64, 64, 4), (6, 6, 1), (32, 17, 1), (40, 33, 2)])
@pytest.mark.parametrize("shared", [256, 0])
@pytest.mark.parametrize("hidden", [1024, 1536])
def test_folded_act_counters_see_every_partial_and_act_is_written_once(t: int, hot: int, warps: int, shared: int,
                                                                       hidden: int,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """FOLD_ACT: every FC1 CTA arrives at its act chunk's counter (put_tail's index); each counter used gets exactly
    the 2 x K-split arrivals it expects (so the last one computes the chunk and the counter is left at zero), every
    index lies inside the host's counter buffer, and the last arrivals write each routed pair's [0, I) and each shared
    token's [0, S) of act exactly once, nothing else."""
    inter, e, top_k = FOLD_LAYOUT
    ids, launches = _folded(monkeypatch, "FOLD_ACT", warps, t, hot, shared, hidden)  # (the bad id: no act)
    assert "moe_act" not in launches
    spec, grid, a = launches["moe_fc1"]
    assert dict(spec.defines)["FOLD_ACT"] == 1 and dict(launches["moe_fc2"][0].defines)["FOLD_ACT"] == 1
    d = dict(spec.defines)
    maxt, cta_rows = 8 * d["NT"], 32 * d["WARPS"]
    groups_max = -(-d.get("TMAX", maxt) // maxt)
    rows, srows, ksr, kss = a["rows"], a["srows"], a["KSr"], a["KSs"]
    chm = max(rows, srows) // 2 // cta_rows
    assert a["counters"].numel() == (e + moe_cuda.MAX_TOKENS // 8) * chm
    assert a["act"].shape == (a["P"], a["ROWS"] // 2)
    groups = 1 if groups_max == 1 else -(-t // maxt)
    shared_items = srows // cta_rows * kss * groups
    routed_items = a["n_slots"] * (rows // cta_rows) * ksr
    arrivals: dict[int, list] = {}
    for block in range(grid[0]):
        item = _shared_first(block, shared_items, routed_items)
        found = _find_block(item, ids, t, e, a["n_slots"], rows, srows, ksr, kss, maxt, groups_max, cta_rows)
        if found is None:
            continue
        expert, row0, ks, grp = found
        half = (rows if expert >= 0 else srows) // 2
        k0 = row0 if row0 < half else row0 - half
        index = (expert if expert >= 0 else e + max(grp, 0)) * chm + k0 // cta_rows
        assert 0 <= index < a["counters"].numel()
        cols = _columns(expert, ids, t, top_k)
        c0, c1 = (0, len(cols)) if expert >= 0 else (max(grp, 0) * maxt, min(len(cols), max(grp, 0) * maxt + maxt))
        arrivals.setdefault(index, []).append((ks, row0 >= half, k0, cols[c0:c1], ksr if expert >= 0 else kss))
    written = np.zeros((a["P"], a["ROWS"] // 2), dtype=np.int64)
    for index, came in arrivals.items():
        splits = came[0][4]
        assert len(came) == 2 * splits, (index, len(came))  # every gate and up block of every K split, once
        assert sorted((ks, up) for ks, up, *_ in came) == [(ks, up) for ks in range(splits) for up in (False, True)]
        _, _, k0, pairs, _ = came[-1]  # the last to arrive (any of them: they agree on chunk and columns)
        assert all(c[2] == k0 and c[3] == pairs for c in came)
        for p in pairs:
            written[p, k0:k0 + cta_rows] += 1
    want = np.zeros_like(written)
    for n in range(t):
        for k in range(top_k):
            if 0 <= ids[n, k] < e:
                want[n * top_k + k, :inter] = 1
        if shared:
            want[t * top_k + n, :shared] = 1
    assert np.array_equal(written, want), np.argwhere(written != want)[:5]


@pytest.mark.parametrize("t,hot,warps", [(1, 0, 4), (5, 5, 4), (9, 0, 4), (16, 16, 4), (33, 0, 4), (40, 33, 4),
                                         (64, 64, 4), (6, 6, 1), (32, 17, 1), (40, 33, 2)])
@pytest.mark.parametrize("shared", [256, 0])
@pytest.mark.parametrize("hidden", [1024, 1536])
def test_folded_combine_counters_expect_every_fc2_cta_and_out_is_written_once(
        t: int, hot: int, warps: int, shared: int, hidden: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """FOLD_COMBINE: every FC2 CTA (an unused routed slot's too) arrives at its row block's counter, which expects
    n_slots + the shared splits x column groups (combine_tail's count); each counter gets exactly that many, so the
    last one sums its block for every token (each output element once) and leaves the counter at zero."""
    _, e, _ = FOLD_LAYOUT
    ids, launches = _folded(monkeypatch, "FOLD_COMBINE", warps, t, hot, shared, hidden)  # (the bad id: NaN)
    assert "moe_combine" not in launches
    spec, grid, a = launches["moe_fc2"]
    d = dict(spec.defines)
    assert d["FOLD_COMBINE"] == 1 and a["out"].shape == (t, hidden)
    maxt, cta_rows = 8 * d["NT"], 32 * d["WARPS"]
    groups_max = -(-d.get("TMAX", maxt) // maxt)
    groups = 1 if groups_max == 1 else -(-t // maxt)
    expect = a["n_slots"] + (a["KSs"] * groups if a["S"] else 0)  # combine_tail's count (SHARED_GROUPS(T))
    assert a["done"].numel() == hidden // cta_rows
    came = np.zeros(hidden // cta_rows, dtype=np.int64)
    per = hidden // cta_rows
    for block in range(grid[0]):
        found = _find_block(block, ids, t, e, a["n_slots"], hidden, hidden if a["S"] else 0, 1, a["KSs"], maxt,
                            groups_max, cta_rows)
        if found is None:  # an unused routed slot (the grid's shared items all exist): it arrives all the same
            assert block < a["n_slots"] * per
            row0 = (block % per) * cta_rows
        else:
            row0 = found[1]
        came[row0 // cta_rows] += 1
    assert (came == expect).all(), (came, expect)
