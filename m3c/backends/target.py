"""Compile targets: one frozen record of hardware FACTS per target, and the registry that names them.

A :class:`Target` says what a chip has (SM/CU count, shared memory, warp/wave size, the MMA shapes
and low-precision formats it offers, how an NVFP4 value becomes something its tensor cores take)
and which pass pipeline and code generator serve it. Shared code reads these facts; it never asks
``if target.name == ...`` (STYLE.md lesson 7). Each target is declared in one file under
:mod:`m3c.backends.targets`; third-party packages may add more through the ``m3c.targets`` entry
point group (the entry point names a zero-argument callable returning a Target), in the style of
Triton's backend discovery.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from m3c.errors import TargetError

KB = 1024


@dataclass(frozen=True)
class Target:
    """Facts about one compile target. Every field is data; nothing here runs code on a device."""

    name: str
    """Registry name, as typed on the command line (``--target hopper``)."""
    arch: str
    """Compiler architecture string: ``sm_90a``, ``sm_100a``, ``gfx950``, ``cpu``."""
    vendor: str
    """``nvidia``, ``amd`` or ``cpu``."""
    products: tuple[str, ...]
    """Chips this target is for, e.g. ``("H100", "H200")``."""
    compute_units: int
    """Streaming multiprocessors (NVIDIA) or compute units (AMD) on the product; 0 for the CPU."""
    smem_per_block: int
    """Largest shared memory / LDS one thread block may allocate, in bytes (0: none)."""
    smem_per_sm: int
    """Shared memory / LDS per SM or CU, in bytes (0: none)."""
    warp_size: int
    """Threads per warp (32) or wavefront (64); 1 for the CPU."""
    mma: tuple[str, ...]
    """Matrix instructions the kernels may use, by PTX/ISA name and shape."""
    fp8: bool
    """Whether the tensor cores multiply E4M3 directly."""
    fp4: bool
    """Whether the tensor cores multiply E2M1 (NVFP4/MXFP4) directly."""
    nvfp4_dequant: str
    """How an NVFP4 value reaches the MMA on this target (the dequant strategy the kernels implement)."""
    pipeline: str
    """Name of the pass pipeline (``m3c.passes.manager.pipeline_for``) that serves this target."""
    stages: tuple[str, ...]
    """Named, dumpable code-generation stages, in order (Triton style)."""
    runtime: str
    """``cpu``, ``cuda`` or ``hip``: which device runtime executes its programs."""
    capability: tuple[int, int] | None = None
    """CUDA compute capability of the device (NVIDIA only)."""
    tmem_columns: int = 0
    """Tensor-memory columns per SM (Blackwell and later; 0: no TMEM)."""
    binary_ext: str = ""
    """File extension of the kernel binaries in an artifact (``cubin``, ``hsaco``; empty: no kernels)."""
    lowering: str = ""
    """``module:function`` of the code generator ``(graph, options, weights) -> Program``; empty: none yet."""
    notes: str = ""
    """Where figures come from, or what is a working guess."""

    def runnable_here(self) -> bool:
        """Whether this machine has a device that runs this target's programs."""
        return _RUNNABLE[self.runtime](self)

    def lowering_fn(self) -> Callable[..., Any]:
        """The code generator; raises TargetError when this target has none in this m3c yet."""
        if not self.lowering:
            raise TargetError(
                f"target {self.name!r} ({self.arch}) has no code generator in this version of m3c yet; "
                f"compile with --target cpu (runs anywhere), or see `m3c targets` for what each target offers"
            )
        module, _, fn = self.lowering.partition(":")
        return getattr(importlib.import_module(module), fn)

    def facts(self) -> dict[str, Any]:
        """The facts as a JSON-ready dict (tuples become lists)."""
        return {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(self).items()}


def _cuda_runnable(t: Target) -> bool:
    import torch

    if not torch.cuda.is_available() or torch.version.hip:
        return False
    return any(torch.cuda.get_device_capability(i) == t.capability for i in range(torch.cuda.device_count()))


def _hip_runnable(t: Target) -> bool:
    import torch

    if not torch.cuda.is_available() or not torch.version.hip:
        return False
    names = [getattr(torch.cuda.get_device_properties(i), "gcnArchName", "") for i in range(torch.cuda.device_count())]
    return any(n.split(":")[0] == t.arch for n in names)


_RUNNABLE: dict[str, Callable[[Target], bool]] = {
    "cpu": lambda t: True,
    "cuda": _cuda_runnable,
    "hip": _hip_runnable,
}

_TARGETS: dict[str, Target] = {}
_LOADED = False


def register_target(target: Target) -> Target:
    """Add a target to the registry (its name must be new); returns it."""
    if target.name in _TARGETS:
        raise TargetError(f"target {target.name!r} registered twice")
    if target.runtime not in _RUNNABLE:
        raise TargetError(f"target {target.name!r}: runtime {target.runtime!r} is not one of {sorted(_RUNNABLE)}")
    _TARGETS[target.name] = target
    return target


def get_target(name: str) -> Target:
    """The target called `name`; an unknown name raises TargetError listing the known ones."""
    _ensure_loaded()
    try:
        return _TARGETS[name]
    except KeyError:
        known = ", ".join(f"{t.name} ({t.arch})" for t in _TARGETS.values())
        raise TargetError(f"unknown target {name!r}; known targets: {known}") from None


def list_targets() -> list[Target]:
    """Every registered target, in registration order (built-ins first)."""
    _ensure_loaded()
    return list(_TARGETS.values())


def _ensure_loaded() -> None:
    """Import the built-in target files and any ``m3c.targets`` entry points (once)."""
    global _LOADED
    if _LOADED:
        return
    _LOADED = True
    from importlib.metadata import entry_points

    import m3c.backends.targets  # noqa: F401  (each file registers its targets)

    for ep in entry_points(group="m3c.targets"):
        register_target(ep.load()())


def targets_table(targets: list[Target] | None = None) -> str:
    """A text table of the targets' main facts and whether each runs on this machine."""
    rows = [("target", "arch", "chips", "SMs/CUs", "smem/SM", "warp", "fp8", "fp4", "TMEM", "NVFP4 dequant",
             "pipeline", "runs here")]
    for t in targets if targets is not None else list_targets():
        rows.append((
            t.name, t.arch, "/".join(t.products), str(t.compute_units or "-"),
            f"{t.smem_per_sm // KB} KB" if t.smem_per_sm else "-", str(t.warp_size), "yes" if t.fp8 else "no",
            "yes" if t.fp4 else "no", str(t.tmem_columns or "-"), t.nvfp4_dequant, t.pipeline,
            "yes" if t.runnable_here() else "no",
        ))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


def auto_target() -> Target:
    """The first registered target with a code generator whose device this machine has, else cpu."""
    for t in list_targets():
        if t.runtime != "cpu" and t.lowering and t.runnable_here():
            return t
    return get_target("cpu")
