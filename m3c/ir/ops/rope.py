"""Rotary position embedding as one op: what the canonicalizer raises the model's slice/mul/cat idiom into."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from m3c.ir.ops.infer import dims_equal, require
from m3c.ir.registry import IRTypeError, defop
from m3c.ir.types import TensorType
from m3c.model_defs.layers import apply_rope


def _rope_infer(types: Sequence[TensorType | None], attrs: dict[str, Any]) -> list[TensorType]:
    x, cos, sin = require(types[0], "x"), require(types[1], "cos"), require(types[2], "sin")
    if x.rank != 3 or cos.rank != 2 or cos != sin:
        raise IRTypeError(f"rope: expects x [T, heads, dim] and cos, sin [T, half] of one type; got {x}, {cos}, {sin}")
    half = cos.shape[1]
    if not dims_equal(x.shape[0], cos.shape[0]) or (isinstance(half, int) and isinstance(x.shape[2], int)
                                                    and 2 * half > x.shape[2]):
        raise IRTypeError(f"rope: cos {cos} does not fit x {x} (needs [T, half] with 2·half ≤ dim)")
    if cos.dtype != x.dtype:
        raise IRTypeError(f"rope: cos/sin dtype {cos.dtype.value} differs from x dtype {x.dtype.value}")
    return [x]


@defop("rope", ("x", "cos", "sin"), infer=_rope_infer)
def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Neox-style partial RoPE on x [T, heads, dim] with cos, sin [T, half]: the first 2·half dims rotate."""
    return apply_rope(x, cos, sin)
