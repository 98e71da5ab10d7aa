"""Primitive tensor ops: elementwise math, casts, linear algebra, norms, shape ops, reductions.

Binary ops take a second operand or a ``scalar`` attribute. Shape attributes may hold symbolic
dims (strings such as ``"T"``); the interpreter binds them before calling the reference.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import sympy
import torch
import torch.nn.functional as F

from m3c.ir.ops.infer import (
    attr_dims,
    broadcast,
    dims_equal,
    norm_dim,
    promote,
    require,
    require_int,
    require_rank,
    same_as,
)
from m3c.ir.registry import REQUIRED, IRTypeError, defop
from m3c.ir.types import Dim, DType, TensorType

Types = Sequence[TensorType | None]


# ---- elementwise -----------------------------------------------------------------------------
def _binary_dtype(types: Types, attrs: dict[str, Any]) -> DType:
    """torch's result dtype: a 0-d float operand does not widen a ranked float one; scalars keep a float dtype."""
    a = require(types[0], "a")
    b = types[1] if len(types) > 1 else None
    if b is None:
        if attrs.get("scalar") is None:
            raise IRTypeError("binary op needs a second operand or a scalar attribute")
        return DType.f32 if not a.dtype.is_float and isinstance(attrs["scalar"], float) else a.dtype
    if a.dtype.is_float and b.dtype.is_float and (a.rank == 0) != (b.rank == 0):
        return a.dtype if b.rank == 0 else b.dtype
    return promote(a.dtype, b.dtype)


def _binary_infer(types: Types, attrs: dict[str, Any]) -> list[TensorType]:
    a, b = require(types[0], "a"), (types[1] if len(types) > 1 else None)
    shape = a.shape if b is None else broadcast(a.shape, b.shape)
    return [TensorType(_binary_dtype(types, attrs), shape)]


def _div_infer(types: Types, attrs: dict[str, Any]) -> list[TensorType]:
    """True division: integer operands give float32, as in torch."""
    (t,) = _binary_infer(types, attrs)
    return [t if t.dtype.is_float else TensorType(DType.f32, t.shape)]


def _binary(name: str, fn: Any) -> None:
    @defop(name, ("a", "b?"), {"scalar": None}, infer=_div_infer if name == "div" else _binary_infer)
    def ref(a: torch.Tensor, b: torch.Tensor | None = None, *, scalar: float | None = None) -> torch.Tensor:
        return fn(a, b if b is not None else scalar)

    ref.__doc__ = f"Elementwise {name} (tensor or scalar second operand)."


for _name, _fn in (("add", torch.add), ("sub", torch.sub), ("mul", torch.mul), ("div", torch.div)):
    _binary(_name, _fn)


def _unary(name: str, fn: Any) -> None:
    @defop(name, ("x",), infer=same_as(0))
    def ref(x: torch.Tensor) -> torch.Tensor:
        return fn(x)

    ref.__doc__ = f"Elementwise {name}."


for _name, _fn in (("neg", torch.neg), ("cos", torch.cos), ("sin", torch.sin), ("exp", torch.exp),
                   ("sigmoid", torch.sigmoid), ("silu", F.silu), ("rsqrt", torch.rsqrt)):
    _unary(_name, _fn)


@defop("pow_scalar", ("x",), {"base": REQUIRED}, infer=same_as(0))
def pow_scalar(x: torch.Tensor, *, base: float) -> torch.Tensor:
    """base ** x, elementwise (a scalar raised to a tensor)."""
    return torch.pow(base, x)


@defop("cast", ("x",), {"dtype": REQUIRED},
       infer=lambda t, a: [TensorType(DType(a["dtype"]), require(t[0], "x").shape)])
def cast(x: torch.Tensor, *, dtype: str) -> torch.Tensor:
    """Convert to another element dtype."""
    return x.to(DType(dtype).to_torch())


@defop("arange", (), {"start": 0, "end": REQUIRED, "step": 1, "dtype": "i64"},
       infer=lambda t, a: [TensorType(DType(a["dtype"]), (max(0, math.ceil((a["end"] - a["start"]) / a["step"])),))])
def arange(*, start: float, end: float, step: float, dtype: str) -> torch.Tensor:
    """start, start+step, ... < end."""
    return torch.arange(start, end, step, dtype=DType(dtype).to_torch())


# ---- linear algebra and norms ------------------------------------------------------------------
def _linear_infer(types: Types, attrs: dict[str, Any]) -> list[TensorType]:
    x, w = require(types[0], "x"), require(types[1], "w")
    if x.rank < 1 or w.rank != 2 or not dims_equal(x.shape[-1], w.shape[1]):
        raise IRTypeError(f"linear: x {x} does not match weight {w} ([out, in])")
    b = types[2] if len(types) > 2 else None
    if b is not None and (b.rank != 1 or not dims_equal(b.shape[0], w.shape[0])):
        raise IRTypeError(f"linear: bias {b} does not match weight {w} ([out])")
    return [TensorType(x.dtype, (*x.shape[:-1], w.shape[0]))]


@defop("linear", ("x", "w", "b?"), infer=_linear_infer)
def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """x @ w^T (+ b), w is [out, in]."""
    return F.linear(x, w, b)


def _matmul_infer(types: Types, attrs: dict[str, Any]) -> list[TensorType]:
    a, b = require(types[0], "a"), require(types[1], "b")
    if a.rank < 2 or b.rank < 2 or not dims_equal(a.shape[-1], b.shape[-2]):
        raise IRTypeError(f"matmul: {a} @ {b} do not chain")
    batch = broadcast(a.shape[:-2], b.shape[:-2])
    return [TensorType(promote(a.dtype, b.dtype), (*batch, a.shape[-2], b.shape[-1]))]


@defop("matmul", ("a", "b"), infer=_matmul_infer)
def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Batched matrix product."""
    return torch.matmul(a, b)


def _rms_norm_infer(types: Types, attrs: dict[str, Any]) -> list[TensorType]:
    x = require(types[0], "x")
    w = types[1] if len(types) > 1 else None
    if x.rank < 1:
        raise IRTypeError(f"rms_norm: x must have rank >= 1, got {x}")
    if w is not None and (w.rank != 1 or not dims_equal(w.shape[0], x.shape[-1])):
        raise IRTypeError(f"rms_norm: weight {w} does not match the last dim of {x}")
    return [x]


@defop("rms_norm", ("x", "w?"), {"eps": REQUIRED}, infer=_rms_norm_infer)
def rms_norm(x: torch.Tensor, w: torch.Tensor | None = None, *, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim, times w if given."""
    return F.rms_norm(x, (x.shape[-1],), w, eps)


def _embedding_infer(types: Types, attrs: dict[str, Any]) -> list[TensorType]:
    w, ids = require_rank(types[0], "embedding weight", 2), require_int(types[1], "embedding ids")
    return [TensorType(w.dtype, (*ids.shape, w.shape[1]))]


@defop("embedding", ("weight", "ids"), infer=_embedding_infer)
def embedding(weight: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows of weight selected by ids."""
    return F.embedding(ids, weight)


# ---- shape ops -----------------------------------------------------------------------------
def _slice_infer(types: Types, attrs: dict[str, Any]) -> list[TensorType]:
    x = require(types[0], "x")
    d = norm_dim(attrs["dim"], x.rank)
    size, start, end, step = x.shape[d], attrs["start"], attrs["end"], attrs["step"]
    if isinstance(size, int):
        length = len(range(*slice(start, end, step).indices(size)))
    elif start == 0 and (end is None or end >= 2**62) and step == 1:
        length = size
    else:
        raise IRTypeError(f"slice of symbolic dim {size} needs static bounds")
    shape = list(x.shape)
    shape[d] = length
    return [TensorType(x.dtype, tuple(shape))]


@defop("slice", ("x",), {"dim": REQUIRED, "start": 0, "end": None, "step": 1}, infer=_slice_infer)
def slice_(x: torch.Tensor, *, dim: int, start: int, end: int | None, step: int) -> torch.Tensor:
    """x[..., start:end:step, ...] along dim."""
    idx = [slice(None)] * x.dim()
    idx[dim] = slice(start, end, step)
    return x[tuple(idx)]


def _split_infer(types: Types, attrs: dict[str, Any]) -> list[TensorType]:
    x = require(types[0], "x")
    d = norm_dim(attrs["dim"], x.rank)
    sizes = attrs["sizes"]
    if isinstance(x.shape[d], int) and sum(sizes) != x.shape[d]:
        raise IRTypeError(f"split sizes {sizes} do not add up to dim {d} of {x}")
    outs = []
    for s in sizes:
        shape = list(x.shape)
        shape[d] = s
        outs.append(TensorType(x.dtype, tuple(shape)))
    return outs


@defop("split", ("x",), {"sizes": REQUIRED, "dim": REQUIRED}, infer=_split_infer)
def split(x: torch.Tensor, *, sizes: list[int], dim: int) -> tuple[torch.Tensor, ...]:
    """Consecutive pieces of the given sizes along dim."""
    return tuple(torch.split(x, sizes, dim))


def _cat_infer(types: Types, attrs: dict[str, Any]) -> list[TensorType]:
    xs = [require(t, "x") for t in types]
    if not xs:
        raise IRTypeError("cat needs at least one operand")
    d = norm_dim(attrs["dim"], xs[0].rank)
    total: Dim = 0
    dtype = xs[0].dtype
    for t in xs:
        if t.rank != xs[0].rank or any(not dims_equal(a, b) for i, (a, b) in enumerate(zip(t.shape, xs[0].shape))
                                       if i != d):
            raise IRTypeError(f"cat along dim {d}: {t} does not match {xs[0]}")
        total = total + t.shape[d]
        dtype = promote(dtype, t.dtype)
    shape = list(xs[0].shape)
    shape[d] = total
    return [TensorType(dtype, tuple(shape))]


@defop("cat", ("*xs",), {"dim": REQUIRED}, infer=_cat_infer)
def cat(*xs: torch.Tensor, dim: int) -> torch.Tensor:
    """Concatenate along dim."""
    return torch.cat(xs, dim)


def _view_infer(types: Types, attrs: dict[str, Any]) -> list[TensorType]:
    x = require(types[0], "x")
    shape = list(attr_dims(attrs["shape"]))
    if -1 in shape:
        known = sympy.Integer(1)
        for s in shape:
            if s != -1:
                known = known * s
        q = sympy.simplify(sympy.sympify(x.numel()) / known)
        if q.is_integer is False:
            raise IRTypeError(f"view of {x} as {list(attrs['shape'])}: {x.numel()} elements do not divide by {known}")
        shape[shape.index(-1)] = int(q) if q.is_Integer else q
    if not dims_equal(TensorType(x.dtype, tuple(shape)).numel(), x.numel()):
        raise IRTypeError(f"view of {x} as {shape} changes the element count")
    return [TensorType(x.dtype, tuple(shape))]


@defop("view", ("x",), {"shape": REQUIRED}, infer=_view_infer, dim_attrs=("shape",))
def view(x: torch.Tensor, *, shape: list[int]) -> torch.Tensor:
    """Same elements, new shape."""
    return x.reshape(shape)


def _unsqueeze_infer(types: Types, attrs: dict[str, Any]) -> list[TensorType]:
    x = require(types[0], "x")
    d = norm_dim(attrs["dim"], x.rank + 1)
    shape = list(x.shape)
    shape.insert(d, 1)
    return [TensorType(x.dtype, tuple(shape))]


@defop("unsqueeze", ("x",), {"dim": REQUIRED}, infer=_unsqueeze_infer)
def unsqueeze(x: torch.Tensor, *, dim: int) -> torch.Tensor:
    """Insert a size-1 dim."""
    return x.unsqueeze(dim)


def _gather_infer(types: Types, attrs: dict[str, Any]) -> list[TensorType]:
    x, index = require(types[0], "x"), require_int(types[1], "gather index")
    norm_dim(attrs["dim"], x.rank)
    if index.rank != x.rank:
        raise IRTypeError(f"gather: index {index} must have the rank of {x}")
    return [TensorType(x.dtype, index.shape)]


@defop("gather", ("x", "index"), {"dim": REQUIRED}, infer=_gather_infer)
def gather(x: torch.Tensor, index: torch.Tensor, *, dim: int) -> torch.Tensor:
    """x values at index along dim."""
    return torch.gather(x, dim, index)


def _sum_infer(types: Types, attrs: dict[str, Any]) -> list[TensorType]:
    x = require(types[0], "x")
    dims = {norm_dim(d, x.rank) for d in attrs["dims"]}
    shape = [1 if i in dims else s for i, s in enumerate(x.shape)] if attrs["keepdim"] else \
        [s for i, s in enumerate(x.shape) if i not in dims]
    return [TensorType(x.dtype, tuple(shape))]


@defop("sum", ("x",), {"dims": REQUIRED, "keepdim": False}, infer=_sum_infer)
def sum_(x: torch.Tensor, *, dims: list[int], keepdim: bool) -> torch.Tensor:
    """Sum over dims."""
    return torch.sum(x, dims, keepdim=keepdim)


# ---- fallback --------------------------------------------------------------------------------
@defop("fallback", ("*xs",), {"target": REQUIRED, "args": REQUIRED, "out_types": REQUIRED},
       infer=lambda t, a: [TensorType.parse(s) for s in a["out_types"]])
def fallback(*xs: torch.Tensor, target: str, args: Any, out_types: list[str]) -> Any:
    """An ATen op m3c has no IR op for, run by torch (listed in the compile report).

    ``args`` is a JSON template of the call: ``{"$": i}`` stands for operand i.
    """
    op = _resolve_aten(target)
    fill = _fill_template(args, xs)
    out = op(*fill["args"], **fill["kwargs"])
    return tuple(out) if isinstance(out, (list, tuple)) else out


def _resolve_aten(target: str) -> Any:
    """torch.ops.<ns>.<name>.<overload> from 'ns.name.overload'."""
    ns, name, overload = target.split(".")
    return getattr(getattr(getattr(torch.ops, ns), name), overload)


def _fill_template(template: Any, xs: Sequence[Any]) -> Any:
    if isinstance(template, dict):
        if set(template) == {"$"}:
            return xs[template["$"]]
        if set(template) == {"$dtype"}:
            return DType(template["$dtype"]).to_torch()
        return {k: _fill_template(v, xs) for k, v in template.items()}
    if isinstance(template, list):
        return [_fill_template(v, xs) for v in template]
    return template
