"""The "last program merges" protocol of split launches (split-K QKV GEMM, MSA attention decode, MSA top-k).

Each of the n programs of one unit of work writes its partial result to a workspace, then arrives at the
unit's int32 counter; the program that arrives last reads every partial back (``cache_modifier=".cg"``:
through L2) and merges them in a fixed order, then stores 0 to the counter, so the counters are zero on
entry and on exit (CUDA-graph replays need nothing reset). Workspaces: :func:`m3c.backends.kernels.host.persistent`.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def last_to_arrive(cnt_ptr, unit, n):
    """Arrive at counter `unit` after this program's partial stores; True for the last of its n programs.

    The barrier makes every thread's stores precede the (one-thread) acq_rel atomic that releases them: Triton
    3.6 does not order a block's plain stores before a scalar atomic by itself.
    """
    tl.debug_barrier()
    return tl.atomic_add(cnt_ptr + unit, 1, sem="acq_rel") == n - 1
