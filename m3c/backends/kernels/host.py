"""Host-side facts every kernel launcher asks: whether Triton runs in its CPU interpreter, and the SM count."""

from __future__ import annotations

import functools
import os

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
