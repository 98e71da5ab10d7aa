"""A control-flow twin of the CUDA indexer kernel (``msa_index_scores`` in cuda/msa_indexer_mma.cu): which
(row, head, block) cells each CTA, warp and lane writes, which keys each cell pools over (the per-column causal mask)
and which block-table entries it reads, for random batches, block sizes, heads, column tiles, query dtypes, warps
and chunkings. Every cell must be written exactly once, pool exactly the keys the reference sees (``j <= position``,
``j < seq_len``) or be -inf without reading keys, and no table entry past a request's blocks may be read. The twin
follows the kernel's index arithmetic line by line (keep them in step); the decode and MMA layouts have their own
twin in test_msa_indexer_cuda.py."""

from __future__ import annotations

import random

import pytest

from m3c.backends.kernels import msa_indexer_cuda as mc


def _flow(qsl: list[int], seq: list[int], pos: list[int], mb: int, g_heads: int, chunk: int, warps: int, bs: int,
          nt: int, q_f32: bool, nb_w_bug: bool = False) -> tuple[dict, set]:
    """{(t, g, b): frozenset of pooled key positions, or None for a -inf fill} and the (request, block) table reads."""
    cpt, epl = (4, 1) if q_f32 else (8, 2)
    step_tiles = 4 if bs >= 64 else bs // 16
    step_keys = 16 * step_tiles
    spb = bs // step_keys
    writes: dict = {}
    bt_reads: set = set()

    def put(key: tuple, val: frozenset | None) -> None:
        assert key not in writes, f"cell {key} written twice"
        writes[key] = val

    for r in range(len(seq)):
        for by in range(-(-mb // chunk)):
            t_lo, ncols = qsl[r], (qsl[r + 1] - qsl[r]) * g_heads
            c_lo, c_hi = by * chunk, min(by * chunk + chunk, mb)
            n_blk = (seq[r] + bs - 1) // bs
            for col0 in range(0, ncols, cpt * nt):
                def mma_col(k: int, lane_g: int, col0: int = col0, t_lo: int = t_lo, ncols: int = ncols) -> int:
                    """The position of MMA column (tile k, lane group lane_g) (-1: a spare column)."""
                    n = col0 + cpt * k + (lane_g >> 1 if q_f32 else lane_g)
                    return pos[t_lo + n // g_heads] if n < ncols else -1

                maxpos = max(mma_col(k, lg) for k in range(nt) for lg in range(8))
                vis_hi = min(c_hi, min(maxpos // bs + 1, n_blk) if maxpos >= 0 else 0)
                lo = max(c_lo, vis_hi)
                for i in range((c_hi - lo) * cpt * nt):  # the -inf fill
                    b, n = lo + i // (cpt * nt), col0 + i % (cpt * nt)
                    if n < ncols:
                        put((t_lo + n // g_heads, n % g_heads, b), None)
                for warp in range(warps):
                    nb_w = (vis_hi - c_lo - warp + warps - 1) // warps if vis_hi > c_lo + warp else 0
                    if nb_w_bug:
                        nb_w = (vis_hi - c_lo - warp) // warps if vis_hi > c_lo + warp else 0
                    assert nb_w <= mc.MAX_BLOCKS_PER_WARP, "more blocks than the lane's table registers hold"
                    pooled: dict = {}
                    for i in range(nb_w * spb):
                        b = c_lo + warp + warps * (i // spb)
                        bt_reads.add((r, b))
                        for lane in range(32):
                            lg, c = lane >> 2, lane & 3
                            kp0 = b * bs + (i % spb) * step_keys + lg
                            for k in range(nt):
                                for e in range(epl):
                                    cpos = mma_col(k, 2 * c + e)  # the lane's C column, via shfl from lane 4(2c+e)
                                    n = col0 + cpt * k + epl * c + e
                                    for tile in range(step_tiles):
                                        for half in range(2):
                                            kp = kp0 + 16 * tile + 8 * half
                                            if kp <= cpos:
                                                pooled.setdefault((n, b), set()).add(kp)
                        if i % spb == spb - 1:  # lanes 0..3 write the block's maxima
                            for c in range(4):
                                for k in range(nt):
                                    for e in range(epl):
                                        n = col0 + cpt * k + epl * c + e
                                        if n < ncols:
                                            put((t_lo + n // g_heads, n % g_heads, b), frozenset(pooled.get((n, b), ())))
    return writes, bt_reads


def _check(qsl: list[int], seq: list[int], pos: list[int], mb: int, g_heads: int, bs: int, **kw) -> None:
    writes, bt_reads = _flow(qsl, seq, pos, mb, g_heads, bs=bs, **kw)
    for r in range(len(seq)):
        nb = -(-seq[r] // bs)
        assert all(b < nb for rr, b in bt_reads if rr == r), "a table entry past the request's blocks was read"
        for t in range(qsl[r], qsl[r + 1]):
            for g in range(g_heads):
                for b in range(mb):
                    assert (t, g, b) in writes, f"cell {(t, g, b)} never written"
                    want = frozenset(j for j in range(b * bs, min(b * bs + bs, seq[r])) if j <= pos[t])
                    assert (writes[(t, g, b)] or frozenset()) == want, f"cell {(t, g, b)} pools the wrong keys"
    assert len(writes) == len(pos) * g_heads * mb  # nothing written for rows that do not exist


def _random_case(rng: random.Random) -> dict:
    bs = rng.choice([16, 32, 64, 128, 256])
    warps = rng.choice([4, 4, 2])
    rows = [rng.choice([0, 1, 1, 2, 3, 5, 9]) for _ in range(rng.randint(1, 3))]
    seq = [rng.randint(1, 6 * bs) for _ in rows]
    mb = max(-(-s // bs) for s in seq) + rng.randint(0, 3)
    qsl = [0]
    for k in rows:
        qsl.append(qsl[-1] + k)
    pos = [rng.choice([s - 1, rng.randint(0, s - 1)]) for s, k in zip(seq, rows) for _ in range(k)]
    chunk = rng.choice([1, 2, 3, 5, 8, mc.pick_chunk(len(rows), mb, 4, warps)])
    return dict(qsl=qsl, seq=seq, pos=pos, mb=mb, g_heads=rng.choice([1, 2, 3]), chunk=chunk, warps=warps, bs=bs,
                nt=rng.choice([1, 2]), q_f32=rng.random() < 0.5)


@pytest.mark.parametrize("seed", range(4))
def test_every_cell_once_with_the_reference_keys(seed: int) -> None:
    rng = random.Random(seed * 7919 + random.randrange(1 << 30))
    for _ in range(12):
        _check(**_random_case(rng))


def test_the_twin_catches_a_lost_block() -> None:
    """Rounding a warp's block count down (a plausible slip) leaves cells unwritten: the check must fail."""
    case = dict(qsl=[0, 1], seq=[5 * 64 + 3], pos=[5 * 64 + 2], mb=7, g_heads=1, chunk=6, warps=4, bs=64, nt=1,
                q_f32=False)
    _check(**case)
    with pytest.raises(AssertionError):
        _check(**case, nb_w_bug=True)
