"""Timing helpers every benchmark script shares (imported as ``from _timing import ...``: scripts run from
this directory's parent as ``python benchmarks/<script>.py``, which puts this directory on sys.path)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import triton.testing


def bench(fn: Callable[[], Any], warmup: int = 20, rep: int = 100) -> float:
    """Median ms over device-event timings (host launch gaps included)."""
    return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))


def bench_graph(fn: Callable[[], Any], rep: int = 100) -> float:
    """Median ms of fn replayed from a CUDA graph (kernel time without host launch work); NaN, printed, if
    capture fails (a launcher that is not graph-safe shows up here)."""
    try:
        return float(triton.testing.do_bench_cudagraph(fn, rep=rep, return_mode="median"))
    except Exception as e:  # recorded in the tables as NaN
        print(f"graph capture failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
        return float("nan")
