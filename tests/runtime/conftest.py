"""Fixtures for runtime tests: a small hand-built program (an NVFP4 linear plus a bias) and its inputs."""

from __future__ import annotations

import pytest
import torch

from m3c.backends import CompileOptions, lower
from m3c.backends.program import Program
from m3c.ir.graph import Graph
from m3c.ir.types import DType, TensorType, sym
from m3c.model_defs import quant


def toy_graph() -> Graph:
    """y = x @ dequant(w)^T + b, with x: f32[T,32], w: nvfp4[16,32] param, b: f32[16] param."""
    g = Graph("toy")
    x = g.add_input("x", TensorType(DType.f32, (sym("T"), 32)))
    w = g.add_input("layer.w", TensorType(DType.nvfp4, (16, 32)), kind="param")
    b = g.add_input("layer.b", TensorType(DType.f32, (16,)), kind="param")
    (wf,) = g.add("dequantize", [w])
    (y,) = g.add("linear", [x, wf, b], names=["y"])
    g.outputs = [y]
    return g


def toy_weights(seed: int = 0) -> dict[str, object]:
    """Weights for :func:`toy_graph` (seeded)."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(16, 32, generator=gen)
    return {"layer.w": quant.nvfp4_quantize(w, quant.nvfp4_global_scale(w)), "layer.b": torch.randn(16, generator=gen)}


def toy_program(seed: int = 0, target: str = "cpu") -> Program:
    """The cpu Program of the toy graph (target relabelled when asked, to fake other targets)."""
    prog = lower(toy_graph(), CompileOptions(), toy_weights(seed))
    if target != "cpu":
        prog = Program(target=target, graph=prog.graph, weights=prog.weights,
                       options=CompileOptions(target=target), kernels={"toy.cubin": b"\x7fELF fake"})
    return prog


@pytest.fixture
def program() -> Program:
    """The toy cpu Program."""
    return toy_program()


@pytest.fixture
def make_program():
    """The factory :func:`toy_program` (seed, target)."""
    return toy_program
