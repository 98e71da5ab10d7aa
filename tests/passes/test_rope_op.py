"""The `rope` IR op the canonicalizer raises into: its reference is the model's apply_rope; bad types refused."""

from __future__ import annotations

import pytest
import torch

from m3c.ir.graph import Graph
from m3c.ir.interpreter import interpret
from m3c.ir.registry import IRTypeError, get_op
from m3c.ir.types import DType, TensorType, sym
from m3c.model_defs.layers import apply_rope

T = sym("T")


def test_reference_is_apply_rope(rng: torch.Generator) -> None:
    g = Graph()
    x = g.add_input("x", TensorType(DType.f32, (T, 3, 24)))
    cos, sin = (g.add_input(n, TensorType(DType.f32, (T, 8))) for n in ("cos", "sin"))
    g.outputs = g.add("rope", [x, cos, sin])
    ins = {"x": torch.randn(5, 3, 24, generator=rng), "cos": torch.randn(5, 8, generator=rng),
           "sin": torch.randn(5, 8, generator=rng)}
    (out,) = interpret(g, ins, check_types=True)
    assert torch.equal(out, apply_rope(ins["x"], ins["cos"], ins["sin"]))
    assert get_op("rope").reads == () and not get_op("rope").has_effects()


@pytest.mark.parametrize(("x", "cs", "msg"), [
    ((T, 4, 32), (T, 17), "does not fit"),
    ((T, 32), (T, 8), "expects x"),
    ((T, 4, 32), ("U", 8), "does not fit"),
])
def test_bad_types_are_refused(x: tuple, cs: tuple, msg: str) -> None:
    g = Graph()
    cs = tuple(sym(d) if isinstance(d, str) else d for d in cs)
    xv = g.add_input("x", TensorType(DType.f32, x))
    c, s = (g.add_input(n, TensorType(DType.f32, cs)) for n in ("cos", "sin"))
    with pytest.raises(IRTypeError, match=msg):
        g.add("rope", [xv, c, s])


def test_mixed_dtypes_are_refused() -> None:
    g = Graph()
    x = g.add_input("x", TensorType(DType.bf16, (T, 4, 32)))
    c, s = (g.add_input(n, TensorType(DType.f32, (T, 8))) for n in ("cos", "sin"))
    with pytest.raises(IRTypeError, match="dtype"):
        g.add("rope", [x, c, s])
