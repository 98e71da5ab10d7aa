"""``moe_cuda.QUEUE``: FC1's and FC2's items in one persistent launch (``moe_experts``, cuda/moe_decode_queue.cuh).

On the CPU: which launches a call makes with it on (and that calls which do not fold are untouched), a Python twin of
the ticket / readiness protocol driven by the kernel's own item enumeration (random CTA speeds and residency: it
always finishes, every FC2 item starts after all act chunks of its expert, the counters end at zero), and the
offline build (atomics, acquire loads, the spin's sleep; its spills). On the GPU: bitwise the two-launch fold, eagerly
and from graph replays."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from test_moe_cuda_grid_twin import _find_block, _launches, _shared_first

from m3c.backends.kernels import moe_cuda

SMALL = (6144, 1536, 64, 8, 1536)  # m3.1-small: H, I, E, top-k, S


@pytest.mark.parametrize("t, layout", [(1, SMALL), (4, (1024, 1024, 16, 4, 1024)), (3, (1024, 512, 16, 2, 0))])
def test_one_launch_where_the_call_folds(t: int, layout: tuple, monkeypatch: pytest.MonkeyPatch) -> None:
    """With QUEUE a folded call launches stage_x and moe_experts (FC1's arguments, then FC2's, the counters, n1 and
    n2 = the two grids; as many CTAs as fit at once, at most n1 + n2); a call that does not fold keeps its launches."""
    folds = moe_cuda.call_build(t, *layout)[2]
    plain = _launches(t, *layout)
    monkeypatch.setattr(moe_cuda, "QUEUE", True)
    got = _launches(t, *layout)
    if not folds:
        assert set(got) == set(plain) and all(got[k][0].key() == plain[k][0].key() for k in got)
        return
    assert set(got) == {"moe_stage_x", "moe_experts"}, set(got)
    spec, grid, args = got["moe_experts"]
    _, g1, a1 = plain["moe_fc1"]
    _, g2, a2 = plain["moe_fc2"]
    assert dict(spec.defines)["QUEUE"] == 1 and not spec.pdl
    assert (args["n1"], args["n2"]) == (g1[0], g2[0])
    assert 0 < grid[0] <= g1[0] + g2[0] and grid[0] <= moe_cuda.SMS * 4
    assert spec.shared_bytes == max(plain["moe_fc1"][0].shared_bytes, plain["moe_fc2"][0].shared_bytes)
    for name in ("x", "ids", "rows", "srows", "KSr", "KSs", "P", "ROWS", "counters"):
        assert _same(args[name], a1[name]), name
    for mine, theirs in (("rcode2", "rcode"), ("rscale2", "rscale"), ("rrow2", "rrow"), ("scode2", "scode"),
                         ("wts", "wts"), ("I", "I"), ("S", "S"), ("KS2s", "KSs"), ("done", "done")):
        assert _same(args[mine], a2[theirs]), mine
    e = args["E"]  # the kernel's layout: tickets, two FC1 pools, ready at 96, consumed at the next line after E + 1
    assert args["queue"].dtype == torch.int32 and args["queue"].numel() == moe_cuda.queue_ints(e)
    assert moe_cuda.queue_ints(e) >= 96 + -(-(e + 1) // 32) * 32 + e + 1


def _same(a, b) -> bool:
    """The same argument of two calls on meta tensors: equal shape and dtype, or equal values."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and a.dtype == b.dtype
    return a == b


def _items(t: int, ids: np.ndarray, hidden: int, inter: int, e: int, top_k: int, shared: int, ks: tuple) -> tuple:
    """The kernel's tickets as (kind, readiness index, chunk) lists: FC1's items in moe_fc1's order (the shared
    expert's first) with the act chunk each adds to, FC2's with the shared expert's first; None for unused slots."""
    ks1, ks1s, ks2s = ks
    n_slots, cta = min(e, t * top_k), 128
    fc1, fc2 = [], []
    shared1 = 2 * shared // cta * ks1s
    routed1 = n_slots * (2 * inter // cta) * ks1
    for idx in range(shared1 + routed1):
        item = _shared_first(idx, shared1, routed1)
        found = _find_block(item, ids, t, e, n_slots, 2 * inter, 2 * shared, ks1, ks1s, 8, 1, cta)
        if found is None:
            fc1.append(None)
            continue
        expert, row0, _, _ = found
        k = inter if expert >= 0 else shared
        fc1.append((expert if expert >= 0 else e, (row0 % k) // cta))
    shared2 = hidden // cta * ks2s if shared else 0
    routed2 = n_slots * hidden // cta
    for j in range(shared2 + routed2):
        item = _shared_first(j, shared2, routed2)
        found = _find_block(item, ids, t, e, n_slots, hidden, hidden if shared else 0, 1, ks2s, 8, 1, cta)
        fc2.append(None if found is None else (found[0] if found[0] >= 0 else e))
    return fc1, fc2


def _simulate(fc1: list, fc2: list, s1: int, e: int, chunks: dict, consumers: dict, grid: int, resident: int,
              rng: random.Random, splits: dict) -> None:
    """Run moe_experts' protocol: `grid` CTAs, at most `resident` at a time, started in a random order as slots free,
    each item taking a random time. A CTA's first claim is from the FC1 pool of its block's kind (block b < s1: the
    shared expert's), then from either pool while it has not seen both empty, then FC2's ticket counter; an FC1 item
    arrives at its chunk (the last of 2 x splits arrivals computes it and adds to ready); an FC2 item spins until
    ready reaches its chunk count, then consumes (the last consumer zeroes both); the CTA taking the last end ticket
    zeroes the three counters; the pool loads sometimes read stale counts. Asserts it finishes, each item runs once, FC2 after its whole act, where every block
    was resident from the start each took an FC1 item of its block's kind first, and the counters end at zero."""
    n1, n2 = len(fc1), len(fc2)
    r1 = n1 - s1
    q = {"main": 0, "s": 0, "r": 0}
    ready, consumed, arrivals = [0] * (e + 1), [0] * (e + 1), {}
    done_chunks: dict[int, set] = {}
    waiting = rng.sample(range(grid), grid)  # blocks not yet started, in the order the hardware starts them
    cta = {b: {"first": True, "left": True} for b in range(grid)}
    running: list[list] = []  # [finish time or None (spinning), item, block]
    ran: list[int] = []
    first_kind: dict[int, bool] = {}
    started_after: dict[int, bool] = {}

    def claim(pool: str, size: int, base: int) -> int:
        q[pool] += 1
        return base + q[pool] - 1 if q[pool] - 1 < size else -1

    def draw(b: int) -> int:
        c, t = cta[b], -1
        if c["first"]:
            c["first"] = False
            t = claim("s", s1, 0) if b < s1 else claim("r", r1, s1) if b < n1 else -1
            first_kind[b] = t < 0 or (t < s1) == (b < s1)
        if t < 0 and c["left"]:
            # (relaxed loads may read an older count, never a newer one: sometimes the launch's first, 0, so claims fail)
            cs, cr = (q["s"], q["r"]) if rng.random() < 0.7 else (0, 0)
            if cr < r1:
                t = claim("r", r1, s1)
            if t < 0 and cs < s1:
                t = claim("s", s1, 0)
            c["left"] = t >= 0
        if t < 0:
            t = n1 + q["main"]
            q["main"] += 1
        return t

    ends, clock = 0, 0

    def end(tk: int) -> bool:  # an end ticket: the CTA leaves; the last one zeroes the counters
        nonlocal ends, q
        if tk < n1 + n2:
            return False
        ends += 1
        if tk == n1 + n2 + grid - 1:
            q = {"main": 0, "s": 0, "r": 0}
        return True

    for _ in range(100 * (n1 + n2) + 1000):
        while len(running) < resident and waiting:
            b = waiting.pop()
            tk = draw(b)
            if not end(tk):
                running.append([None, tk, b])
        if not running and not waiting:
            break
        for r in running:
            if r[0] is not None:
                continue
            tk = r[1]
            if tk < n1 or fc2[tk - n1] is None:
                r[0] = clock + rng.randint(1, 20)
            else:
                w = fc2[tk - n1]
                if ready[w] >= chunks[w]:  # past the spin: its act is complete
                    started_after[tk] = done_chunks.get(w, set()) == set(range(chunks[w]))
                    consumed[w] += 1
                    if consumed[w] == consumers[w]:
                        ready[w] = consumed[w] = 0
                    r[0] = clock + rng.randint(1, 20)
        for r in [r for r in running if r[0] is not None and r[0] <= clock]:
            tk, b = r[1], r[2]
            ran.append(tk)
            if tk < n1 and fc1[tk] is not None:
                w, c = fc1[tk]
                arrivals[(w, c)] = arrivals.get((w, c), 0) + 1
                if arrivals[(w, c)] == 2 * splits[w]:  # the last of the gate and up blocks of every split
                    done_chunks.setdefault(w, set()).add(c)
                    ready[w] += 1
            nxt = draw(b)
            if end(nxt):
                running.remove(r)
            else:
                r[0], r[1] = None, nxt
        clock += 1
    assert not running and not waiting and ends == grid, "the queue did not finish (deadlock)"
    assert sorted(ran) == list(range(n1 + n2)), "an item ran twice or never"
    assert all(started_after.values()) and len(started_after) == sum(1 for w in fc2 if w is not None)
    assert ready == [0] * (e + 1) and consumed == [0] * (e + 1) and q == {"main": 0, "s": 0, "r": 0}
    if resident >= grid:
        assert all(first_kind.values())


@pytest.mark.parametrize("t, layout", [(1, SMALL), (1, (1024, 512, 16, 4, 1024)), (3, (1024, 512, 16, 2, 512)),
                                       (2, (512, 512, 8, 2, 0))])
@pytest.mark.parametrize("resident", [1, 3, 528])
def test_twin_of_the_ticket_protocol(t: int, layout: tuple, resident: int) -> None:
    """Random routings, CTA speeds, start orders and residency (down to one CTA at a time, and grids larger and
    smaller than the items): the kernel's claims, item order, chunk counts and consumer counts (moe_decode_queue.cuh,
    wait_ready) finish without deadlock, run every item once and leave zeros."""
    hidden, inter, e, top_k, shared = layout
    rng = random.Random(int(torch.randint(0, 1 << 30, (1,))))
    ids = np.array([rng.sample(range(e), top_k) for _ in range(t)], dtype=np.int64)
    ks = moe_cuda.call_splits(t, *layout)
    fc1, fc2 = _items(t, ids, hidden, inter, e, top_k, shared, ks)
    chunks = {w: inter // 128 for w in range(e)} | {e: shared // 128}
    consumers = {w: hidden // 128 for w in range(e)} | {e: hidden // 128 * ks[2]}
    splits = {w: ks[0] for w in range(e)} | {e: ks[1]}
    s1 = 2 * shared // 128 * ks[1]
    for grid in (min(len(fc1) + len(fc2), 528), len(fc1) // 2 + 1, len(fc1) + 5):
        _simulate(fc1, fc2, s1, e, chunks, consumers, grid, min(resident, grid), rng, splits)


def test_queue_build_in_sass() -> None:
    """Offline sm_90a: moe_experts draws tickets and signals readiness with global atomics, spins with a relaxed
    load and a sleep (no L1 invalidation a turn), then fences, fits 128 registers, and spills at most 144 bytes a
    thread (the two item kinds inlined into one body; session 34: 136, all in the staging loops, none in the weight
    loops)."""
    import re

    from m3c.backends.cuda_aot import compile_cuda, cuobjdump

    specs = moe_cuda._mma_specs(*SMALL[:2], SMALL[4], "bf16", 1, 4, 0, fold_act=True, fold_combine=True, queue=True)
    assert [s.kernel for s in specs] == ["moe_stage_x", "moe_experts"]
    kernel = compile_cuda(specs[1], keep_sass=True)
    body = kernel.stages["sass"].split("Function : moe_experts")[1].split("Function : ")[0]
    assert "NANOSLEEP" in body and "ATOMG" in body and "RED" in body and ".STRONG.GPU" in body
    # the spin (from its sleep to its branch back) loads without invalidating L1: no CCTL.IVALL round the loop
    spin = re.search(r"NANOSLEEP.*?BRA", body, re.S)
    assert spin and "LDG.E.STRONG.GPU" in spin.group(0) and "CCTL" not in spin.group(0), spin
    usage = re.search(r"Function moe_experts:\s*REG:(\d+) STACK:(\d+)", cuobjdump(kernel.binary, "-res-usage"))
    assert usage and int(usage.group(1)) <= 128 and int(usage.group(2)) <= 144, usage


@pytest.mark.gpu
@pytest.mark.parametrize("t, forced", [(1, False), (1, True), (3, True), (8, True)])
def test_queue_is_bitwise_the_two_launch_fold_gpu(t: int, forced: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """m3.1-small: QUEUE changes nothing in MegaMoE's output, eagerly and replayed from a CUDA graph, and leaves its
    counters at zero (a leftover ticket would skip items and hang the next call). Unforced (T = 1 folds by itself):
    the grid of the CTAs resident at once, which loop over tickets; forced (the folds at every T, every grid one
    wave): a CTA per item, more than are resident."""
    from test_moe_cuda import _bitwise_the_default, _case

    from m3c.backends.kernels.host import persistent

    if forced:
        monkeypatch.setattr(moe_cuda, "SMS", 1 << 30)

    def knob(on: bool) -> None:
        monkeypatch.setattr(moe_cuda, "QUEUE", on)
        kernels = [s.kernel for s in moe_cuda.mma_specs(*SMALL[:2], SMALL[4], "bf16",
                                                        *moe_cuda.call_build(t, *SMALL))]
        assert ("moe_experts" in kernels) == on
    _bitwise_the_default(t, knob)
    monkeypatch.setattr(moe_cuda, "QUEUE", True)
    _, mm, x, _, _ = _case(t, *SMALL[:4], "mxfp8", torch.bfloat16)
    first = mm(x)
    for _ in range(3):  # repeated calls: each finds the counters at zero, or hangs / skips items
        assert torch.equal(mm(x), first)
    torch.cuda.synchronize()
    queue = persistent(("moe_experts queue", str(x.device), SMALL[2]), lambda: None)
    assert queue is not None and int(queue.abs().sum()) == 0
