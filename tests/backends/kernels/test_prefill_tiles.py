"""The prefill tile map both MSA kernels use: every request's tiles in order, then spare programs."""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from m3c.backends.kernels.prefill_tiles import prefill_tile, prefill_tile_count


@triton.jit
def _tiles_kernel(qsl_ptr, out_ptr, NR, ROWS: tl.constexpr, RB: tl.constexpr):
    """(request, first row, end row) of each prefill tile, as the kernels compute them."""
    pid = tl.program_id(0)
    r, t, t_end = prefill_tile(pid, qsl_ptr, NR, ROWS, RB)
    tl.store(out_ptr + 3 * pid, r)
    tl.store(out_ptr + 3 * pid + 1, tl.where(r >= 0, t, -1))
    tl.store(out_ptr + 3 * pid + 2, tl.where(r >= 0, t_end, -1))


def test_prefill_tile_map_over_many_requests(rng: torch.Generator) -> None:
    """Request blocks of RB=4 over 11 requests (one without rows): every (request, first row, end row) of
    ceil(rows / ROWS) tiles each, in order, then spare programs (-1); the grid covers every split."""
    if not torch.cuda.is_available():
        assert os.environ.get("TRITON_INTERPRET") == "1"
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    rows = torch.randint(0, 9, (11,), generator=rng)
    rows[3] = 0
    qsl = torch.cat([torch.zeros(1, dtype=torch.int64), rows.cumsum(0)]).to(torch.int32)
    t, n_req, tile = int(rows.sum()), 11, 3
    n_prog = prefill_tile_count(t, n_req, tile)
    assert n_prog >= sum(-(-int(n) // tile) for n in rows)
    out = torch.full((n_prog, 3), -9, dtype=torch.int32, device=dev)
    _tiles_kernel[(n_prog,)](qsl.to(dev), out, n_req, ROWS=tile, RB=4)
    want = [(r, int(qsl[r]) + i * tile, int(qsl[r + 1])) for r in range(n_req) for i in range(-(-int(rows[r]) // tile))]
    want += [(-1, -1, -1)] * (n_prog - len(want))
    assert [tuple(x) for x in out.tolist()] == want
