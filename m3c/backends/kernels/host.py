"""Host-side facts and helpers every kernel launcher uses: whether Triton runs in its CPU interpreter, the SM
count, and tensors derived from a weight once (not at every step)."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable

import torch


def interpreting() -> bool:
    """Whether Triton runs in its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


@functools.cache
def num_sms(device: torch.device, cpu_default: int = 132) -> int:
    """Streaming multiprocessors of a CUDA device; `cpu_default` elsewhere (132 mimics an H200's grids in
    the interpreter; launchers whose interpreter grids must stay small pass less)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return cpu_default


def derived(source: torch.Tensor, tag: str, make: Callable[[], torch.Tensor]) -> torch.Tensor:
    """``make()``, kept on `source` under `tag` (so it lives as long as `source`) and rebuilt only when
    `source` changes in place (its version counter): a per-step launcher converts a weight once, not at
    every step."""
    cache = getattr(source, "_m3c_derived", None)
    if cache is None:
        cache = {}
        source._m3c_derived = cache  # type: ignore[attr-defined]
    hit = cache.get(tag)
    if hit is None or hit[0] != source._version:
        hit = (source._version, make())
        cache[tag] = hit
    return hit[1]
