"""``moe_cuda.PERSIST``: moe_fc1 / moe_fc2 as many CTAs as are resident, each running the grid's items in turn
(``persist_items`` in cuda/moe_decode_mma.cu).

On the CPU: which launches a call makes with it on (the builds that fold are untouched), a Python twin of the item
loop driven by the kernel's own item enumeration (random routings, CTA speeds and residency: every item with work
runs once, no unused slot's item is claimed once a CTA knows the touched count, the counters end at zero), and the
offline build (no local memory in the weight loops; the NT = 2 build held to 168 registers). On the GPU: bitwise the
default's output, eagerly and from graph replays, the counters left at zero."""

from __future__ import annotations

import random
import re

import numpy as np
import pytest
import torch
from test_moe_cuda import kernel_sass
from test_moe_cuda_grid_twin import _find_block, _launches, _shared_first

from m3c.backends.kernels import moe_cuda

SMALL = (6144, 1536, 64, 8, 1536)  # m3.1-small: H, I, E, top-k, S


@pytest.mark.parametrize("t, layout", [(1, SMALL), (2, SMALL), (16, SMALL), (40, SMALL),
                                       (5, (1024, 512, 16, 2, 0))])
def test_launches(t: int, layout: tuple, monkeypatch: pytest.MonkeyPatch) -> None:
    """With PERSIST a call that does not fold launches moe_fc1 / moe_fc2 with PERSIST defined, a counter block as
    their last argument (its own 64 ints each) and at most one wave of CTAs; every argument before the counters, and
    the other launches (grids and arguments), are the plain call's. A call that folds keeps its launches."""
    plain = _launches(t, *layout)
    monkeypatch.setattr(moe_cuda, "PERSIST", True)
    got = _launches(t, *layout)
    assert set(got) == set(plain)
    if moe_cuda.call_build(t, *layout)[2]:
        assert all(got[k][0].key() == plain[k][0].key() for k in got)
        return
    waves = moe_cuda.one_wave(t, *layout[:2], layout[4])
    for kernel, wave in zip(("moe_fc1", "moe_fc2"), waves, strict=True):
        spec, grid, args = got[kernel]
        pspec, pgrid, pargs = plain[kernel]
        assert dict(spec.defines).get("PERSIST") == 1 and "PERSIST" not in dict(pspec.defines)
        assert [n for n, _ in spec.arg_types] == [*(n for n, _ in pspec.arg_types), "ctr"]
        assert grid == (min(pgrid[0], wave),) and wave > 0
        ctr = args["ctr"]
        assert ctr.dtype == torch.int32 and ctr.numel() == 64
        for name, value in pargs.items():
            assert type(args[name]) is type(value) and (isinstance(value, torch.Tensor) or args[name] == value), name
    for kernel in set(got) - {"moe_fc1", "moe_fc2"}:  # (one module: PERSIST defined for all of them)
        spec, pspec = got[kernel][0], plain[kernel][0]
        assert set(spec.defines) - set(pspec.defines) == {("PERSIST", 1)} and got[kernel][1] == plain[kernel][1]
        assert spec.arg_types == pspec.arg_types


def _kernel_items(kernel: str, t: int, ids: np.ndarray, layout: tuple) -> tuple[list, int, int]:
    """(the kernel's items in PERSIST's order, each find_block's answer or None for an unused slot; its shared items;
    its items a slot): moe_fc1's grid order, moe_fc2's remapped to the same (shared first)."""
    hidden, inter, e, top_k, shared = layout
    ks1, ks1s, ks2s = moe_cuda.call_splits(t, *layout)
    nt, wide, _ = moe_cuda.call_build(t, *layout)
    maxt, tmax = 8 * nt, moe_cuda._tmax(nt, wide)
    groups = -(-tmax // maxt)
    n_slots, cta = min(e, t * top_k), moe_cuda._rows_per_cta()
    sgroups = 1 if groups == 1 else -(-t // maxt)
    if kernel == "moe_fc1":
        rows, srows, ksr, kss = 2 * inter, 2 * shared, ks1, ks1s
    else:
        rows, srows, ksr, kss = hidden, hidden if shared else 0, 1, ks2s
    n_shared = srows // cta * kss * sgroups
    routed = n_slots * rows // cta * ksr
    items = [_find_block(_shared_first(i, n_shared, routed), ids, t, e, n_slots, rows, srows, ksr, kss, maxt, groups,
                         cta) for i in range(n_shared + routed)]
    return items, n_shared, rows // cta * ksr


def _simulate(items: list, n_shared: int, per_slot: int, touched: int, grid: int, resident: int,
              rng: random.Random) -> list[int]:
    """persist_items' loop on `grid` CTAs (at most `resident` at once, started in random order), each item taking a
    random time: a CTA runs its blockIdx.x, claims the next ticket at the start of each item, and stops at a ticket
    past the items that exist (all of them until one of its routed items has built the flags). Returns how often
    each item ran; asserts the counters end at zero."""
    n = len(items)
    runs = [0] * n
    ctr = {"claim": 0, "exit": 0}
    waiting = list(range(grid))
    rng.shuffle(waiting)
    running: dict[int, dict] = {}
    while waiting or running:
        while waiting and len(running) < resident:
            b = waiting.pop()
            running[b] = {"idx": b, "touched": -1, "left": None, "claim": None}
        b = rng.choice(list(running))
        cta = running[b]
        if cta["left"] is None:  # the item starts: the claim, then its work (random length)
            cta["claim"] = grid + ctr["claim"]
            ctr["claim"] += 1
            cta["left"] = rng.randint(1, 3)
            continue
        cta["left"] -= 1
        if cta["left"]:
            continue
        idx = cta["idx"]
        runs[idx] += 1
        if idx >= n_shared:  # a routed item: find_block built the flags
            cta["touched"] = touched
        nxt, seen = cta["claim"], cta["touched"]
        limit = n if seen < 0 else min(n, n_shared + seen * per_slot)
        if nxt >= limit:
            del running[b]
            ctr["exit"] += 1
            if ctr["exit"] == grid:
                ctr["claim"] = ctr["exit"] = 0
            continue
        cta.update(idx=nxt, left=None)
    assert ctr == {"claim": 0, "exit": 0}
    return runs


@pytest.mark.parametrize("t, layout", [(2, SMALL), (16, SMALL), (40, SMALL), (3, (1024, 512, 16, 2, 512)),
                                       (5, (1024, 512, 16, 2, 0))])
@pytest.mark.parametrize("kernel", ["moe_fc1", "moe_fc2"])
def test_twin_of_the_item_loop(t: int, layout: tuple, kernel: str) -> None:
    """Random routings (some ids out of range), CTA speeds, start orders and residency, grids of one wave and smaller:
    every item with work runs exactly once; an unused slot's item runs only as a CTA's first item or before the CTA
    has built its flags (each then finds nothing), never more than once."""
    rng = random.Random(int(torch.randint(0, 1 << 30, (1,))))
    _, _, e, top_k, _ = layout
    ids = np.array([rng.sample(range(e), top_k) for _ in range(t)], dtype=np.int64)
    ids[rng.randrange(t), rng.randrange(top_k)] = rng.choice([-1, e])  # an id the kernel skips
    items, n_shared, per_slot = _kernel_items(kernel, t, ids, layout)
    touched = len({int(v) for v in ids.reshape(-1) if 0 <= v < e})
    n = len(items)
    for grid in (min(n, 528), n // 3 + 1, 1):
        runs = _simulate(items, n_shared, per_slot, touched, grid, min(grid, rng.choice([1, 7, 528])), rng)
        for i, (item, ran) in enumerate(zip(items, runs, strict=True)):
            if item is not None:
                assert ran == 1, (grid, i, item)
            else:
                assert ran <= 1 and i >= n_shared + touched * per_slot, (grid, i)


@pytest.mark.parametrize("t", [2, 16, 40])
def test_build_in_sass(t: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Offline sm_90a: the item loop claims with a global atomic; the weight loops (a backward branch's body with
    32 or 64 HMMAs and no loop inside it) store nothing to local memory, the routed experts' NVFP4 loops touch none,
    the shared expert's MXFP8 loops reload at most 4 spilled words a trip (T = 16: 3, two of them pointers; each trip
    streams 4.5 KB a warp); the NT = 2 build held to 168 registers (3 CTAs an SM, as one_wave counts), the NT = 1
    builds to 128."""
    from m3c.backends.cuda_aot import compile_cuda, cuobjdump

    monkeypatch.setattr(moe_cuda, "PERSIST", True)
    build = moe_cuda.call_build(t, *SMALL)
    specs = {sp.kernel: sp for sp in moe_cuda.mma_specs(*SMALL[:2], SMALL[4], "bf16", *build)}
    for kernel in ("moe_fc1", "moe_fc2"):
        sass = kernel_sass(specs[kernel])
        assert "ATOMG" in sass, kernel
        ins = [(int(m[1], 16), line.split("*/", 1)[1].strip())
               for line in sass.splitlines() if (m := re.search(r"/\*([0-9a-f]{4,5})\*/", line))]
        weight_loops = 0
        for at, text in ins:
            target = re.search(r"BRA\s+.*?0x([0-9a-f]+)", text)
            if target and int(target[1], 16) < at:
                body = [(a, b) for a, b in ins if int(target[1], 16) <= a <= at]
                inner = any(re.search(r"BRA\s+.*?0x([0-9a-f]+)", b) and int(target[1], 16) <= int(
                    re.search(r"BRA\s+.*?0x([0-9a-f]+)", b)[1], 16) < a for a, b in body[:-1])
                if sum("HMMA" in b for _, b in body) in (32, 64) and not inner:
                    weight_loops += 1
                    local = [b for _, b in body if re.search(r"\b(LDL|STL)\b", b)]
                    nvfp4 = any("HMUL2" in b for _, b in body)  # (the MXFP8 loop scales its f32 results instead)
                    assert len(local) <= (0 if nvfp4 else 4) and not any("STL" in b for b in local), (kernel, local)
        assert weight_loops >= 2, kernel
        usage = re.search(rf"Function {kernel}:\s*REG:(\d+)", cuobjdump(compile_cuda(specs[kernel]).binary,
                                                                      "-res-usage"))
        assert usage and int(usage.group(1)) <= (128 if build[0] == 1 else 168), (kernel, usage)


@pytest.mark.gpu
@pytest.mark.parametrize("t", [2, 4, 16, 40, 64])
def test_bitwise_the_default_gpu(t: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """m3.1-small: PERSIST changes nothing in MegaMoE's output, eagerly and replayed from a CUDA graph, and leaves its
    counters at zero (a leftover ticket would skip items in the next call)."""
    from test_moe_cuda import _bitwise_the_default, _case

    from m3c.backends.kernels.host import persistent

    def knob(on: bool) -> None:
        monkeypatch.setattr(moe_cuda, "PERSIST", on)
    _bitwise_the_default(t, knob)
    monkeypatch.setattr(moe_cuda, "PERSIST", True)
    _, mm, x, _, _ = _case(t, *SMALL[:4], "mxfp8", torch.bfloat16)
    first = mm(x)
    for _ in range(3):  # repeated calls: each finds the counters at zero, or skips items
        assert torch.equal(mm(x), first)
    torch.cuda.synchronize()
    ctr = persistent(("moe_fc1 / moe_fc2 tickets", str(x.device)), lambda: None)
    assert ctr is not None and int(ctr.abs().sum()) == 0
