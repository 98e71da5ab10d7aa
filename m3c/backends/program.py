"""The Program: what a backend produces and the runtime executes (and what an artifact stores).

A Program holds the fused IR graph, the weights its ``param`` inputs are bound to, kernel binaries
(none for the CPU target) and a launch plan (a placeholder list until the GPU launchers land).
Weights are kept FLAT, as plain tensors, so they store as one safetensors file: a quantized weight
``w`` becomes ``w.data``, ``w.scale`` and, for NVFP4 with a tensor scale, ``w.global_scale``.
The graph's input types say which params are quantized, so :func:`unflatten_weights` can rebuild
the :class:`~m3c.model_defs.quant.NVFP4Tensor` / ``MXFP8Tensor`` runtime objects.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from m3c.backends.options import CompileOptions
from m3c.errors import CompileError
from m3c.ir.graph import Graph
from m3c.ir.types import DType
from m3c.model_defs import quant


@dataclass(frozen=True)
class Program:
    """A compiled model for one target."""

    target: str
    graph: Graph
    weights: dict[str, torch.Tensor]
    """Flat name -> tensor (see the module docstring for how quantized params are split)."""
    options: CompileOptions = field(default_factory=CompileOptions)
    kernels: dict[str, bytes] = field(default_factory=dict)
    """Kernel binaries by name (``<name>.cubin`` / ``.hsaco`` in an artifact); empty for cpu."""
    launch_plan: list[dict[str, Any]] = field(default_factory=list)
    """Kernel launches in order (placeholder until the GPU runtime lands)."""

    def weights_nbytes(self) -> int:
        """Bytes of all weight tensors."""
        return sum(t.numel() * t.element_size() for t in self.weights.values())

    def params(self, device: torch.device | str | None = None) -> dict[str, Any]:
        """The graph's param inputs bound to runtime values (quantized ones rebuilt), on `device`."""
        return unflatten_weights(self.graph, self.weights, device)


def param_inputs(graph: Graph) -> list[Any]:
    """The graph's `param` inputs, in order."""
    return [v for v in graph.inputs if v.kind == "param"]


def flatten_weights(graph: Graph, bound: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """Flat tensors for every param input of `graph`, taken from `bound` (name -> tensor or quantized value).

    Raises CompileError naming a param that is missing, on the meta device, or of the wrong kind.
    """
    out: dict[str, torch.Tensor] = {}
    for v in param_inputs(graph):
        if v.name not in bound:
            raise CompileError(f"param %{v.name} ({v.type}) has no weight bound to it; cannot lower without it")
        value = bound[v.name]
        if isinstance(value, quant.NVFP4Tensor):
            parts = {"data": value.data, "scale": value.scale, "global_scale": value.global_scale}
        elif isinstance(value, quant.MXFP8Tensor):
            parts = {"data": value.data, "scale": value.scale}
        elif isinstance(value, torch.Tensor):
            parts = {"": value}
        else:
            raise CompileError(f"param %{v.name}: expected a tensor or a quantized tensor, got {type(value).__name__}")
        if v.type.dtype.is_quantized != ("" not in parts):
            raise CompileError(f"param %{v.name}: IR type {v.type} but the bound value is a {type(value).__name__}")
        for suffix, t in parts.items():
            if t is None:
                continue
            if t.device.type == "meta":
                raise CompileError(f"param %{v.name} is on the meta device; build the model with real weights "
                                   "(a checkpoint or random ones) before lowering")
            out[f"{v.name}.{suffix}" if suffix else v.name] = t.detach()
    return out


def unflatten_weights(graph: Graph, flat: Mapping[str, torch.Tensor],
                      device: torch.device | str | None = None) -> dict[str, Any]:
    """Runtime values of the graph's params from flat tensors (the inverse of :func:`flatten_weights`)."""

    def get(name: str, required: bool = True) -> torch.Tensor | None:
        t = flat.get(name)
        if t is None:
            if required:
                raise CompileError(f"weight tensor {name!r} is missing for the graph's param inputs")
            return None
        return t.to(device) if device is not None else t

    out: dict[str, Any] = {}
    for v in param_inputs(graph):
        if v.type.dtype == DType.nvfp4:
            out[v.name] = quant.NVFP4Tensor(get(f"{v.name}.data"), get(f"{v.name}.scale"),
                                            get(f"{v.name}.global_scale", required=False))
        elif v.type.dtype == DType.mxfp8:
            out[v.name] = quant.MXFP8Tensor(get(f"{v.name}.data"), get(f"{v.name}.scale"))
        else:
            out[v.name] = get(v.name)
    return out
