"""``moe_cuda.PREFETCH_FC2`` on the CPU: a Python twin of FC1's ``prefetch_fc2`` / ``prefetch_block``
(``cuda/moe_decode_mma.cu``, ``cuda/moe_weight_stream.cuh``), driven by the grids and arguments
:func:`moe_decode_mma` really launches (meta tensors), against a twin of the lines FC2's own CTAs load: the 128-byte
code lines FC1 asks L2 for must be exactly those of the first n super-chunks of every FC2 item that runs, and every
scale line asked for must be one FC2 reads. Plus the offline build: the prefetches are in FC1's SASS and cost no
registers or spills."""

from __future__ import annotations

import pytest
import torch
from test_moe_cuda_grid_twin import _find_block, _launches, _shared_first

from m3c.backends.kernels import moe_cuda
from m3c.fused.moe import hot_routing

LINE = 128


def _stream_lines(expert: int, row0: int, ks: int, ks_count: int, rows_total: int, k: int, nsc: int | None,
                  cta_rows: int, natural: bool) -> tuple[set, set]:
    """(code lines, scale lines) the FC2 CTA of this block loads in its first ``nsc`` super-chunks (None: all),
    as run_tiles / the streams address them."""
    codes, scales = set(), set()
    kc = k // ks_count
    for row in range(row0, row0 + cta_rows, 32):  # a warp's two tiles
        if expert >= 0 and natural:
            rb, rsb = k // 2, k // 16
            for sc in range(kc // 256 if nsc is None else min(nsc, kc // 256)):
                for lane in range(32):
                    g, j = lane >> 2, lane & 3
                    for rr in (0, 8, 16, 24):
                        r = expert * rows_total + row + g + rr
                        for q in range(2):
                            codes.add((r * rb + ks * kc // 2 + 16 * j + sc * 128 + 64 * q) // LINE)
                            scales.add((r * rsb + ks * kc // 16 + 2 * j + sc * 16 + 8 * q) // LINE)
        elif expert >= 0:
            tile = expert * (rows_total // 16) + row // 16
            for sc in range(kc // 256 if nsc is None else min(nsc, kc // 256)):
                for lane in range(32):
                    for t in range(2):
                        for c in range(4):
                            codes.add(((tile + t) * k * 8 + ks * kc * 8 + lane * 16 + sc * 2048 + c * 512) // LINE)
                        scales.add(((tile + t) * k + ks * kc + lane * 8 + sc * 256) // LINE)
        else:
            tile, srow = row // 16, k // 32
            for sc in range(kc // 128 if nsc is None else min(nsc, kc // 128)):
                for lane in range(32):
                    g = lane >> 2
                    for t in range(2):
                        for q in range(0, 8, 2):
                            codes.add(((tile + t) * k * 16 + ks * kc * 16 + lane * 16 + sc * 2048 + q * 256) // LINE)
                        for r8 in (0, 8):
                            scales.add(((row + 16 * t + g + r8) * srow + ks * kc // 32 + sc * 4) // LINE)
    return codes, scales


def _prefetched(expert: int, row0: int, ks: int, ks1: int, inter: int, shared: int, hidden: int, ks2s: int,
                n: int, cta_rows: int, natural: bool) -> tuple[set, set]:
    """(code lines, scale lines) one FC1 CTA asks L2 for (the kernel's prefetch_fc2 and prefetch_block)."""
    ks2, k = (1, inter) if expert >= 0 else (ks2s, shared)
    n1, j1, n2 = 2 * k // cta_rows * ks1, row0 // cta_rows * ks1 + ks, hidden // cta_rows * ks2
    codes, scales = set(), set()
    for j2 in range(j1 * n2 // n1, (j1 + 1) * n2 // n1):
        r0, s2, kc = j2 // ks2 * cta_rows, j2 % ks2, k // ks2
        for row in range(r0, r0 + cta_rows, 32):
            for lane in range(32):
                if expert >= 0 and natural:
                    r = expert * hidden + row + lane
                    for sc in range(min(n, kc // 256)):
                        codes.add((r * (k // 2) + s2 * kc // 2 + sc * 128) // LINE)
                        scales.add((r * (k // 16) + s2 * kc // 16 + sc * 16) // LINE)
                elif expert >= 0:
                    tile = expert * (hidden // 16) + row // 16
                    for sc in range(min(n, kc // 256)):
                        codes.add(((tile + (lane >> 4)) * k * 8 + s2 * kc * 8 + sc * 2048 + (lane & 15) * 128) // LINE)
                        if lane < 4:
                            scales.add(((tile + (lane >> 1)) * k + s2 * kc + sc * 256 + (lane & 1) * 128) // LINE)
                else:
                    nsc = min(n, kc // 128)
                    for sc in range(nsc):
                        codes.add(((row // 16 + (lane >> 4)) * k * 16 + s2 * kc * 16 + sc * 2048 + (lane & 15) * 128)
                                  // LINE)
                    if nsc:
                        scales.add(((row + lane) * (k // 32) + s2 * kc // 32) // LINE)
    return codes, scales


@pytest.mark.parametrize("t,hot,inter,shared,natural,n", [
    (1, 0, 1024, 1024, False, 2), (1, 0, 1024, 0, False, 1), (3, 3, 1024, 1024, False, 3), (8, 0, 512, 512, False, 2),
    (8, 8, 512, 1024, False, 2), (2, 0, 1024, 1024, True, 2), (5, 5, 1024, 0, True, 9)])
def test_fc1_prefetches_the_first_superchunks_of_every_fc2_item(t: int, hot: int, inter: int, shared: int,
                                                                natural: bool, n: int,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Fresh routing (``hot`` tokens on one expert; above 3 tokens one id out of range), a layout whose calls fold:
    FC1's prefetched code lines are exactly the lines of FC2's first n super-chunks (all of them where n exceeds the
    item's) over the FC2 CTAs that run, every scale line asked for is one FC2 reads, and nothing falls outside FC2's
    weight buffers."""
    monkeypatch.setattr(moe_cuda, "PREFETCH_FC2", n)
    monkeypatch.setattr(moe_cuda, "NATURAL", natural)
    hidden, e, top_k = 1024, 16, 4
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    ids = hot_routing(t, e, top_k, hot, gen)[0].numpy()
    if t > 3:
        ids[2, 1] = e
    assert moe_cuda.call_build(t, hidden, inter, e, top_k, shared)[2], "the layout must fold for this test"
    launches = _launches(t, hidden, inter, e, top_k, shared)
    (s1, grid1, a1), (_, grid2, a2) = launches["moe_fc1"], launches["moe_fc2"]
    assert dict(s1.defines)["PREFETCH_FC2"] == n  # (one build of the source: FC2 carries the define, unused)
    assert a1["rcode2"] is a2["rcode"] and a1["rscale2"] is a2["rscale"] and a1["KS2s"] == a2["KSs"]
    assert a1["scode2"] is a2["scode"] and a1["sscale2"] is a2["sscale"]
    cta, maxt = 32 * moe_cuda.WARPS, 8 * dict(s1.defines)["NT"]
    rows, srows, ksr, kss = a1["rows"], a1["srows"], a1["KSr"], a1["KSs"]
    shared_items = srows // cta * kss
    routed_items = a1["n_slots"] * (rows // cta) * ksr
    got = {"r": (set(), set()), "s": (set(), set())}
    for block in range(grid1[0]):
        item = _shared_first(block, shared_items, routed_items)
        found = _find_block(item, ids, t, e, a1["n_slots"], rows, srows, ksr, kss, maxt, 1, cta)
        if found is not None:
            expert, row0, ks, _ = found
            c, s = _prefetched(expert, row0, ks, ksr if expert >= 0 else kss, inter, shared, hidden, a2["KSs"], n,
                               cta, natural)
            got["r" if expert >= 0 else "s"][0].update(c)
            got["r" if expert >= 0 else "s"][1].update(s)
    want = {"r": (set(), set()), "s": (set(), set())}
    read_scales = {"r": set(), "s": set()}
    for block in range(grid2[0]):
        found = _find_block(block, ids, t, e, a2["n_slots"], hidden, hidden if shared else 0, 1, a2["KSs"], maxt, 1,
                            cta)
        if found is not None:
            expert, row0, ks, _ = found
            k, ks_count = (inter, 1) if expert >= 0 else (shared, a2["KSs"])
            c, s = _stream_lines(expert, row0, ks, ks_count, hidden, k, n, cta, natural)
            want["r" if expert >= 0 else "s"][0].update(c)
            want["r" if expert >= 0 else "s"][1].update(s)
            read_scales["r" if expert >= 0 else "s"].update(
                _stream_lines(expert, row0, ks, ks_count, hidden, k, None, cta, natural)[1])
    for kind, code, scale in (("r", "rcode2", "rscale2"), ("s", "scode2", "sscale2")):
        assert got[kind][0] == want[kind][0], (kind, len(got[kind][0] ^ want[kind][0]))
        assert got[kind][1] <= read_scales[kind] and (got[kind][1] or not want[kind][1])
        if got[kind][0]:
            assert max(got[kind][0]) * LINE < a1[code].numel() and max(got[kind][1]) * LINE < a1[scale].numel()
    assert got["r"][0] and (got["s"][0] or not shared)


def test_no_prefetch_where_a_call_does_not_fold(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where FC1's grid is more than a wave (m3.1-small at 4 tokens) or the build loops over column groups, FC1 is
    the plain build: no define, no extra arguments."""
    monkeypatch.setattr(moe_cuda, "PREFETCH_FC2", 2)
    for t, layout in ((4, (6144, 1536, 64, 8, 1536)), (12, (1024, 1024, 16, 4, 1024))):
        assert not moe_cuda.call_build(t, *layout)[2] or moe_cuda.call_build(t, *layout)[1]
        spec, _, args = _launches(t, *layout[:4], layout[4])["moe_fc1"]
        assert "PREFETCH_FC2" not in dict(spec.defines) and "rcode2" not in args


def test_prefetch_build_in_sass() -> None:
    """Offline sm_90a: the folded T = 1 FC1 of m3.1-small with PREFETCH_FC2 = 2 issues more L2 prefetches
    (CCTL.E.PF2) than without, and no more local-memory stores."""
    from m3c.backends.cuda_aot import compile_cuda

    counts = []
    for n in (0, 2):
        spec = next(s for s in moe_cuda._mma_specs(6144, 1536, 1536, "bf16", 1, 4, 0, fold_act=True,
                                                     fold_combine=True, prefetch=n) if s.kernel == "moe_fc1")
        sass = compile_cuda(spec, keep_sass=True).stages["sass"]
        body = sass.split("Function : moe_fc1")[1].split("Function : ")[0]
        counts.append((body.count("CCTL.E.PF2"), body.count("STL"), dict(spec.defines).get("PREFETCH_FC2", 0)))
    (pf0, stl0, _), (pf2, stl2, d2) = counts
    assert d2 == 2 and pf2 > pf0 and stl2 <= stl0, counts


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 5, 8])
@pytest.mark.parametrize("natural", [False, True])
def test_prefetch_is_bitwise_the_plain_fold_gpu(t: int, natural: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """m3.1-small with the folds forced at every T (so the prefetching FC1 runs at several waves too): PREFETCH_FC2
    = 2 changes nothing in MegaMoE's output, eagerly and replayed from a CUDA graph."""
    from test_moe_cuda import _bitwise_the_default

    monkeypatch.setattr(moe_cuda, "NATURAL", natural)
    monkeypatch.setattr(moe_cuda, "SMS", 1 << 30)

    def knob(on: bool) -> None:
        monkeypatch.setattr(moe_cuda, "PREFETCH_FC2", 2 if on else 0)
        fc1 = next(s for s in moe_cuda.mma_specs(6144, 1536, 1536, "bf16", *moe_cuda.call_build(t, 6144, 1536, 64, 8,
                                                                                             1536))
                   if s.kernel == "moe_fc1")
        assert dict(fc1.defines).get("PREFETCH_FC2", 0) == (2 if on else 0)
    _bitwise_the_default(t, knob)
