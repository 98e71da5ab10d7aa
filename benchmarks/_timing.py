"""What every benchmark script shares: timing, and writing its results (imported as ``from _timing import
...``: scripts run as ``python benchmarks/<script>.py``, which puts this directory on sys.path)."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import triton
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


def soak_clock(run: Callable[[], Any], seconds: float) -> tuple[float, float]:
    """Median SM clock (MHz) and board power (W) that nvidia-smi samples every 50 ms while `run` replays back to back
    for `seconds` (NaN, NaN if nvidia-smi cannot be started)."""
    try:
        smi = subprocess.Popen(["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits",
                                "-lms", "50"], stdout=subprocess.PIPE, text=True)
    except OSError:
        return float("nan"), float("nan")
    end = time.time() + seconds
    while time.time() < end:
        for _ in range(50):
            run()
        torch.cuda.synchronize()
    smi.terminate()
    out, _ = smi.communicate()
    # (the first two samples dropped: they may predate the replays)
    samples = [[float(v) for v in line.split(",")] for line in out.splitlines()[2:] if line.count(",") == 1]
    if not samples:
        return float("nan"), float("nan")
    return statistics.median(c for c, _ in samples), statistics.median(w for _, w in samples)


def kernel_times(fn: Callable[[], Any], calls: int = 20) -> dict[str, float]:
    """Mean device µs per call of each GPU kernel fn launches (torch.profiler; fn warmed up first): where a
    call's time goes, apart from the gaps between launches."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    times = {e.key: e.device_time_total / calls for e in prof.key_averages() if e.device_time_total > 0}
    return dict(sorted(times.items(), key=lambda kv: -kv[1]))


def record_point(rows: list[dict], key: dict, fn: Callable[[], dict | list[dict]]) -> None:
    """Append fn()'s row (or rows) to `rows`; if it raises, append ``key | {"error": ...}`` (printed) instead, so
    one failing point is recorded in the table and the rest still run; then free the cached GPU memory."""
    try:
        got = fn()
        rows.extend(got if isinstance(got, list) else [got])
    except Exception as e:  # record and go on: the table shows it
        rows.append(key | {"error": f"{type(e).__name__}: {str(e)[:300]}"})
        print(rows[-1], flush=True)
    torch.cuda.empty_cache()


def write_results(name: str, rows: list[dict], **extra: Any) -> Path:
    """Write ``{bench, device, torch, triton, **extra, rows}`` to $OUT/<name>.json (or benchmarks/results)."""
    out = Path(os.environ.get("OUT", "benchmarks/results"))
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.json"
    path.write_text(json.dumps({"bench": name, "device": torch.cuda.get_device_name(), "torch": torch.__version__,
                                "triton": triton.__version__, **extra, "rows": rows}, indent=2))
    return path


def token_sweep(name: str, tokens: str, run: Callable[[int], dict | list[dict]], **extra: Any) -> list[dict]:
    """run(t) for each T of the comma-separated `tokens` (a failing T recorded, not fatal: :func:`record_point`),
    then the rows written to <name>.json (:func:`write_results`); returns the rows."""
    rows: list[dict] = []
    for t in (int(v) for v in tokens.split(",")):
        record_point(rows, {"T": t}, lambda t=t: run(t))
    write_results(name, rows, **extra)
    return rows
