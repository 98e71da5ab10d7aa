"""Host-side facts and helpers every kernel launcher uses: whether Triton runs in its CPU interpreter, the SM
count, tensors derived from a weight once (not at every step), and persistent launch workspaces."""

from __future__ import annotations

import functools
import os
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

import torch


def interpreting() -> bool:
    """Whether Triton runs in its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def cuda_kernel_device(t: torch.Tensor) -> str | None:
    """None if the CUDA C++ kernels can run on ``t``'s device (CUDA, sm_89+ for ``cvt.f16x2.e4m3x2``, not the
    Triton interpreter), else the reason."""
    if not t.is_cuda or interpreting():
        return "not on a CUDA device (or the Triton interpreter is on)"
    if torch.cuda.get_device_capability(t.device) < (8, 9):
        return "the GPU is older than sm_89 (no cvt.f16x2.e4m3x2)"
    return None


@functools.cache
def num_sms(device: torch.device, cpu_default: int = 132) -> int:
    """Streaming multiprocessors of a CUDA device; `cpu_default` elsewhere (132 mimics an H200's grids in
    the interpreter; launchers whose interpreter grids must stay small pass less)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return cpu_default


_T = TypeVar("_T")


def _stamp(source: torch.Tensor, also: tuple[torch.Tensor, ...]) -> tuple:
    """What a :func:`derived` entry was made from: `source`'s version, and each of `also` by identity and version."""
    return (source._version, *((weakref.ref(t), t._version) for t in also))


def _current(stamp: tuple, source: torch.Tensor, also: tuple[torch.Tensor, ...]) -> bool:
    return (len(stamp) == 1 + len(also) and stamp[0] == source._version
            and all(ref() is t and v == t._version for (ref, v), t in zip(stamp[1:], also, strict=True)))


def derived(source: torch.Tensor, tag: str, make: Callable[[], _T], also: tuple[torch.Tensor, ...] = ()) -> _T:
    """``make()``, kept on `source` under `tag` (so it lives as long as `source`) and rebuilt only when
    `source` changes in place (its version counter), or when one of `also` (other tensors it is made from) is
    another tensor or changed in place: a per-step launcher converts a weight once, not at every step."""
    cache = getattr(source, "_m3c_derived", None)
    if cache is None:
        cache = {}
        source._m3c_derived = cache  # type: ignore[attr-defined]
    hit = cache.get(tag)
    if hit is None or not _current(hit[0], source, also):
        cache.pop(tag, None)  # (the stale value goes before its successor is made)
        hit = (_stamp(source, also), make())
        cache[tag] = hit
    return hit[1]


def derived_ready(source: torch.Tensor, tag: str, also: tuple[torch.Tensor, ...] = ()) -> bool:
    """Whether :func:`derived` holds a current `tag` for `source` (and `also`): a call would not rebuild it, what a
    launch inside CUDA-graph capture, which must not build anything, checks first."""
    hit = getattr(source, "_m3c_derived", {}).get(tag)
    return hit is not None and _current(hit[0], source, also)


_PERSISTENT: dict[tuple, Any] = {}


def persistent(key: tuple, make: Callable[[], _T]) -> _T:
    """``make()`` once per `key` (name the launcher, the device and every size in it), then the same object:
    workspaces that keep their addresses across calls, so launches captured in a CUDA graph stay valid, and
    whose counters the kernels leave at zero. Launches sharing a key must run on one stream."""
    if key not in _PERSISTENT:
        _PERSISTENT[key] = make()
    return _PERSISTENT[key]


def persistent_ready(key: tuple) -> bool:
    """Whether :func:`persistent` already made the object of `key`."""
    return key in _PERSISTENT

