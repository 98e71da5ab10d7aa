"""Prefill tiles over a flattened batch of requests, shared by the MSA indexer and attention kernels, and the
request of a decode row (:func:`request_of_row`).

A chunk's query rows are cut into tiles of ROWS consecutive rows of one request, numbered request by
request (ceil(rows_r / ROWS) tiles each). The grid is fixed for a given (T, R) — :func:`prefill_tile_count`
programs, enough whatever the split of T over the requests — and each program finds its tile with
:func:`prefill_tile`: a prefix sum over ``query_start_loc`` in registers, no host synchronization.
"""

from __future__ import annotations

import triton
import triton.language as tl


def prefill_tile_count(num_tokens: int, num_requests: int, rows: int) -> int:
    """Programs covering sum_r ceil(rows_r / rows) tiles for any split of `num_tokens` over the requests."""
    return (num_tokens + num_requests * (rows - 1)) // rows


@triton.jit
def prefill_tile(pid, qsl_ptr, n_req, ROWS: tl.constexpr, RB: tl.constexpr):
    """(request, first row, end row of the request) of tile ``pid``; (-1, 0, 0) for a spare program.

    Reads ``query_start_loc`` RB requests at a time.
    """
    r_hit = pid * 0 - 1
    t_hit = pid * 0
    t_end = pid * 0
    base = pid * 0
    for r0 in range(0, n_req, RB):
        rr = r0 + tl.arange(0, RB)
        ok = rr < n_req
        lo = tl.load(qsl_ptr + rr, mask=ok, other=0)
        hi = tl.load(qsl_ptr + rr + 1, mask=ok, other=0)
        nt = tl.where(ok, (hi - lo + ROWS - 1) // ROWS, 0)
        incl = base + tl.cumsum(nt, 0)
        excl = incl - nt
        hit = (excl <= pid) & (pid < incl)
        r_hit = tl.maximum(r_hit, tl.max(tl.where(hit, rr, -1)))
        t_hit = tl.maximum(t_hit, tl.max(tl.where(hit, lo + (pid - excl) * ROWS, 0)))
        t_end = tl.maximum(t_end, tl.max(tl.where(hit, hi, 0)))
        base += tl.sum(nt)
    return r_hit, t_hit, t_end


@triton.jit
def request_of_row(t, qsl_ptr, n_req, RB: tl.constexpr):
    """The request holding flattened row t (rows of request r: [qsl[r], qsl[r + 1])): how many requests end at or
    before t, reading ``query_start_loc`` RB requests at a time (as ``searchsorted(qsl[1:], t, right=True)``)."""
    r = t * 0
    for r0 in range(0, n_req, RB):
        rr = r0 + tl.arange(0, RB)
        end = tl.load(qsl_ptr + rr + 1, mask=rr < n_req, other=2147483647)
        r += tl.sum((end <= t).to(tl.int32))
    return r
