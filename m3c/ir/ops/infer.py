"""Shared type-inference helpers for op definitions (symbolic shapes welcome)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import sympy

from m3c.ir.registry import IRTypeError
from m3c.ir.types import Dim, DType, TensorType, parse_dim

_FLOAT_RANK = {DType.bf16: 1, DType.f16: 1, DType.f32: 2, DType.f64: 3}


def promote(a: DType, b: DType) -> DType:
    """Result dtype of a binary op between two tensors (torch's rules for the dtypes the IR uses)."""
    if a == b:
        return a
    fa, fb = a in _FLOAT_RANK, b in _FLOAT_RANK
    if fa and fb:
        if {a, b} == {DType.bf16, DType.f16}:
            return DType.f32
        return a if _FLOAT_RANK[a] > _FLOAT_RANK[b] else b
    if fa != fb:
        return a if fa else b
    order = [DType.bool, DType.u8, DType.i32, DType.i64]
    return max(a, b, key=order.index)


def dims_equal(a: Dim, b: Dim) -> bool:
    """Whether two (possibly symbolic) dimensions are provably equal."""
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    if a == b:
        return True
    return sympy.simplify(sympy.sympify(a) - sympy.sympify(b)) == 0


def types_equal(a: TensorType, b: TensorType) -> bool:
    """Whether two types have one dtype and provably equal dims."""
    if a == b:
        return True
    return a.dtype == b.dtype and a.rank == b.rank and all(dims_equal(x, y) for x, y in zip(a.shape, b.shape))


def broadcast(a: Sequence[Dim], b: Sequence[Dim]) -> tuple[Dim, ...]:
    """Numpy-style broadcast of two shapes."""
    out: list[Dim] = []
    for i in range(max(len(a), len(b))):
        x = a[len(a) - 1 - i] if i < len(a) else 1
        y = b[len(b) - 1 - i] if i < len(b) else 1
        if x == 1:
            out.append(y)
        elif y == 1 or dims_equal(x, y):
            out.append(x)
        else:
            raise IRTypeError(f"shapes {list(a)} and {list(b)} do not broadcast")
    return tuple(reversed(out))


def norm_dim(dim: int, rank: int) -> int:
    """A dimension index in [0, rank)."""
    if not -rank <= dim < max(rank, 1):
        raise IRTypeError(f"dim {dim} out of range for rank {rank}")
    return dim % max(rank, 1)


def same_as(i: int):
    """Infer: the output has operand i's type."""

    def infer(types: Sequence[TensorType | None], attrs: dict[str, Any]) -> list[TensorType]:
        t = types[i]
        assert t is not None
        return [t]

    return infer


def attr_dims(values: Sequence[Any]) -> tuple[Dim, ...]:
    """Dims from an attribute list (ints or symbolic strings)."""
    return tuple(v if isinstance(v, int) else parse_dim(str(v)) for v in values)


def dims_attr(dims: Sequence[Dim]) -> list[Any]:
    """An attribute list from dims (ints stay ints, symbols become strings)."""
    return [d if isinstance(d, int) else str(d).replace(" ", "") for d in dims]


def require(t: TensorType | None, what: str) -> TensorType:
    """The operand's type; raise IRTypeError if it is absent."""
    if t is None:
        raise IRTypeError(f"missing operand {what}")
    return t


def require_rank(t: TensorType | None, what: str, rank: int | tuple[int, ...]) -> TensorType:
    """The operand's type; raise IRTypeError if it is absent or its rank is not `rank` (or one of them)."""
    t = require(t, what)
    ranks = (rank,) if isinstance(rank, int) else rank
    if t.rank not in ranks:
        want = " or ".join(str(r) for r in ranks)
        raise IRTypeError(f"{what} must have rank {want}, got {t}")
    return t


def require_int(t: TensorType | None, what: str) -> TensorType:
    """The operand's type; raise IRTypeError if it is absent or not an integer dtype."""
    t = require(t, what)
    if t.dtype.is_float or t.dtype == DType.bool:
        raise IRTypeError(f"{what} must have an integer dtype, got {t}")
    return t


def require_dims_equal(a: Dim, b: Dim, what: str) -> None:
    """Raise IRTypeError unless two dims are provably equal."""
    if not dims_equal(a, b):
        raise IRTypeError(f"{what}: {a} != {b}")
