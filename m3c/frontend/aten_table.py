"""The torch → IR op mapping tables: one entry per ATen overload, one per ``torch.ops.m3c`` op.

A :class:`Rule` names the IR op an overload becomes and converts the FX node's arguments (already
mapped to IR values, Python constants and symbolic dims) by calling ``lo.emit``. It returns what
the FX node stands for (a value, a list of values, an existing value for no-ops, or :data:`DROP`),
or ``None`` when these particular arguments have no IR form: the capture then emits an IR
``fallback`` node, which the report lists. The capture checks every result type against torch's
own (FX ``meta["val"]``) and falls back on a mismatch, so a wrong rule can never go unnoticed.

Quantized values stay whole: a grouped weight, an nvfp4 cache or an nvfp4 ``quantize`` result is
one IR value, and the FX tensors that hold its pieces map to :class:`QuantPart` s of it. Only the
m3c rules below take pieces; any other use of one is a :class:`CaptureError`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import sympy
import torch

import m3c.model_defs.ops  # noqa: F401  (registers torch.ops.m3c.*)
from m3c.errors import M3CError
from m3c.ir.graph import Value
from m3c.ir.ops.infer import dims_attr
from m3c.ir.types import DType

aten = torch.ops.aten


class CaptureError(M3CError, RuntimeError):
    """A torch program the frontend cannot turn into IR; the message names the FX node and why."""


@dataclass(frozen=True)
class QuantPart:
    """One stored piece ("data", "scale" or "global_scale") of a quantized IR value."""

    value: Value
    part: str


class _Drop:
    def __repr__(self) -> str:
        return "DROP"


DROP: Any = _Drop()
"""A rule's result for FX nodes with no IR meaning (runtime asserts)."""


class Lowerer(Protocol):
    """What a rule may ask of the capture while converting one FX node."""

    def emit(self, op: str, inputs: Sequence[Value | None], attrs: dict[str, Any] | None = None) -> list[Value]:
        """Append a type-inferred IR node for the current FX node; returns its outputs."""
        ...

    @property
    def meta(self) -> Any:
        """The FX node's ``meta["val"]`` (a FakeTensor, a tuple of them, or a SymInt)."""
        ...


Convert = Callable[[Lowerer, tuple[Any, ...], dict[str, Any]], Any]


@dataclass(frozen=True)
class Rule:
    """One table entry: the IR op (for docs and reports) and the argument conversion."""

    op: str
    convert: Convert


# ---- helpers ---------------------------------------------------------------------------------
def _is_value(x: Any) -> bool:
    return isinstance(x, Value)


def _ir_dtype(dtype: torch.dtype | None) -> str | None:
    return None if dtype is None else DType.from_torch(dtype).value


def _one(lo: Lowerer, op: str, inputs: Sequence[Value | None], attrs: dict[str, Any] | None = None) -> Value:
    return lo.emit(op, inputs, attrs)[0]


def _is_dim_list(xs: Any) -> bool:
    return isinstance(xs, (list, tuple)) and all(isinstance(x, int) or hasattr(x, "free_symbols") for x in xs)


# ---- ATen rules --------------------------------------------------------------------------------
def _binary(op: str) -> Rule:
    def convert(lo: Lowerer, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        a, b = args[0], args[1]
        alpha = args[2] if len(args) > 2 else kwargs.get("alpha", 1)
        if alpha != 1 or not _is_value(a):
            return None
        if _is_value(b):
            return _one(lo, op, [a, b])
        if isinstance(b, (bool, int, float)):
            return _one(lo, op, [a], {"scalar": b})
        return None

    return Rule(op, convert)


def _unary(op: str) -> Rule:
    return Rule(op, lambda lo, args, kwargs: _one(lo, op, [args[0]]) if _is_value(args[0]) else None)


def _cast(lo: Lowerer, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    x, dtype = args[0], kwargs.get("dtype")
    if not _is_value(x) or kwargs.get("memory_format") not in (None, torch.preserve_format):
        return None
    if dtype is None or DType.from_torch(dtype) == x.type.dtype:
        return x  # a device or layout copy: the same value in the IR
    return _one(lo, "cast", [x], {"dtype": _ir_dtype(dtype)})


def _alias(lo: Lowerer, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    return args[0] if _is_value(args[0]) else None


def _pow_scalar(lo: Lowerer, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    base, x = args
    if not _is_value(x) or not isinstance(base, (int, float)):
        return None
    return _one(lo, "pow_scalar", [x], {"base": float(base)})


def _arange(lo: Lowerer, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    bounds = list(args) + [None] * (3 - len(args))
    if len(args) == 1:
        bounds = [0, args[0], 1]
    start, end, step = (0 if bounds[0] is None else bounds[0]), bounds[1], (1 if bounds[2] is None else bounds[2])
    if not all(isinstance(b, (int, float)) for b in (start, end, step)):
        return None  # symbolic bounds have no IR form
    dtype = _ir_dtype(kwargs.get("dtype")) or _ir_dtype(lo.meta.dtype)
    return _one(lo, "arange", [], {"start": start, "end": end, "step": step, "dtype": dtype})


def _rms_norm(lo: Lowerer, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    x, shape = args[0], args[1]
    w = args[2] if len(args) > 2 else kwargs.get("weight")
    eps = args[3] if len(args) > 3 else kwargs.get("eps")
    if not _is_value(x) or len(shape) != 1 or (w is not None and not _is_value(w)):
        return None
    if eps is None:
        eps = torch.finfo(x.type.dtype.to_torch()).eps
    return _one(lo, "rms_norm", [x] if w is None else [x, w], {"eps": float(eps)})


def _linear(lo: Lowerer, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    x, w = args[0], args[1]
    b = args[2] if len(args) > 2 else kwargs.get("bias")
    if not (_is_value(x) and _is_value(w)) or (b is not None and not _is_value(b)):
        return None
    return _one(lo, "linear", [x, w] if b is None else [x, w, b])


def _matmul(lo: Lowerer, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    return _one(lo, "matmul", [args[0], args[1]]) if _is_value(args[0]) and _is_value(args[1]) else None


def _embedding(lo: Lowerer, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    # padding_idx / scale_grad_by_freq / sparse only change gradients
    return _one(lo, "embedding", [args[0], args[1]]) if _is_value(args[0]) and _is_value(args[1]) else None


_BIG = 2**62


def _slice(lo: Lowerer, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    x = args[0]
    dim, start, end, step = (list(args[1:]) + [0, None, None, 1][len(args) - 1:])[:4]
    start = 0 if start is None else start
    end = None if end is None or (isinstance(end, int) and end >= _BIG) else end
    if not _is_value(x) or not all(isinstance(v, int) for v in (dim, start, step)) or \
            not (end is None or isinstance(end, int)):
        return None
    size = x.type.shape[dim]
    if step == 1 and start == 0 and (end is None or (isinstance(size, int) and end >= size)):
        return x  # the whole dim
    return _one(lo, "slice", [x], {"dim": dim, "start": start, "end": end, "step": step})


def _split(lo: Lowerer, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    x, size = args[0], args[1]
    dim = args[2] if len(args) > 2 else kwargs.get("dim", 0)
    if not _is_value(x):
        return None
    total = x.type.shape[dim]
    if isinstance(size, int):
        if not isinstance(total, int):
            return None
        sizes = [size] * (total // size) + ([total % size] if total % size else [])
    elif isinstance(size, (list, tuple)) and all(isinstance(s, int) for s in size):
        sizes = list(size)
    else:
        return None
    return lo.emit("split", [x], {"sizes": sizes, "dim": dim})


def _cat(lo: Lowerer, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    xs, dim = args[0], args[1] if len(args) > 1 else kwargs.get("dim", 0)
    if not all(_is_value(x) for x in xs):
        return None
    return _one(lo, "cat", list(xs), {"dim": dim})


def _view(lo: Lowerer, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    x, shape = args[0], args[1]
    if not _is_value(x) or not _is_dim_list(shape):
        return None
    if tuple(shape) == tuple(x.type.shape):
        return x
    return _one(lo, "view", [x], {"shape": dims_attr(shape)})


def _unsqueeze(lo: Lowerer, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    return _one(lo, "unsqueeze", [args[0]], {"dim": args[1]}) if _is_value(args[0]) else None


def _gather(lo: Lowerer, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    x, dim, index = args[0], args[1], args[2]
    if not (_is_value(x) and _is_value(index)) or kwargs.get("sparse_grad", False):
        return None
    return _one(lo, "gather", [x, index], {"dim": dim})


def _sum(lo: Lowerer, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    x = args[0]
    dims = args[1] if len(args) > 1 else kwargs.get("dim")
    keepdim = args[2] if len(args) > 2 else kwargs.get("keepdim", False)
    if not _is_value(x) or kwargs.get("dtype") is not None:
        return None
    dims = list(range(x.type.rank)) if not dims else list(dims)
    return _one(lo, "sum", [x], {"dims": dims, "keepdim": bool(keepdim)})


_DROPPED = (aten._assert_tensor_metadata.default, aten._assert_scalar.default,
            aten.sym_constrain_range_for_size.default, aten.sym_constrain_range.default,
            aten._assert_async.msg)

ATEN_TABLE: dict[Any, Rule] = {
    aten.embedding.default: Rule("embedding", _embedding),
    aten._to_copy.default: Rule("cast", _cast),
    aten.clone.default: Rule("", _alias),
    aten.alias.default: Rule("", _alias),
    aten.detach.default: Rule("", _alias),
    aten.lift_fresh_copy.default: Rule("", _alias),
    aten.pow.Scalar: Rule("pow_scalar", _pow_scalar),
    aten.arange.start_step: Rule("arange", _arange),
    aten.arange.start: Rule("arange", _arange),
    aten.arange.default: Rule("arange", _arange),
    aten.rms_norm.default: Rule("rms_norm", _rms_norm),
    aten.linear.default: Rule("linear", _linear),
    aten.mm.default: Rule("matmul", _matmul),
    aten.bmm.default: Rule("matmul", _matmul),
    aten.matmul.default: Rule("matmul", _matmul),
    aten.slice.Tensor: Rule("slice", _slice),
    aten.split.Tensor: Rule("split", _split),
    aten.split_with_sizes.default: Rule("split", _split),
    aten.cat.default: Rule("cat", _cat),
    aten.view.default: Rule("view", _view),
    aten.reshape.default: Rule("view", _view),
    aten._unsafe_view.default: Rule("view", _view),
    aten.unsqueeze.default: Rule("unsqueeze", _unsqueeze),
    aten.gather.default: Rule("gather", _gather),
    aten.sum.dim_IntList: Rule("sum", _sum),
    **{op: Rule("", lambda lo, args, kwargs: DROP) for op in _DROPPED},
}
for _name in ("add", "sub", "mul", "div"):
    ATEN_TABLE[getattr(aten, _name).Tensor] = _binary(_name)
    ATEN_TABLE[getattr(aten, _name).Scalar] = _binary(_name)
for _name in ("neg", "cos", "sin", "exp", "sigmoid", "silu", "rsqrt"):
    ATEN_TABLE[getattr(aten, _name).default] = _unary(_name)


# ---- m3c custom-op rules ------------------------------------------------------------------------
def whole(parts: Sequence[Any], names: Sequence[str], who: str) -> Value:
    """The quantized value whose pieces `parts` are (in the order `names`); CaptureError otherwise."""
    first = parts[0]
    if not isinstance(first, QuantPart):
        raise CaptureError(f"{who}: expected the pieces of one quantized value, got {first!r}")
    for p, name in zip(parts, names):
        if p is None and name == "global_scale":
            continue
        if not isinstance(p, QuantPart) or p.value is not first.value or p.part != name:
            raise CaptureError(f"{who}: operands {list(parts)!r} are not the {list(names)} of one quantized value")
    return first.value


def cache_operands(data: Any, scale: Any, fmt: str, who: str) -> tuple[Value, Value | None]:
    """(cache value, per-tensor scale operand) of a paged cache given as the model's (data, scale) pair."""
    if fmt == "nvfp4":
        return whole([data, scale], ["data", "scale"], who), None
    if not _is_value(data) or (fmt == "fp8" and not _is_value(scale)):
        raise CaptureError(f"{who}: a {fmt} cache must be a state input, got {data!r} / {scale!r}")
    return data, scale if fmt == "fp8" else None


def _dequantize(names: Sequence[str]) -> Rule:
    def convert(lo: Lowerer, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        return _one(lo, "dequantize", [whole(list(args[: len(names)]), names, "dequantize")])

    return Rule("dequantize", convert)


def _nvfp4_quantize(lo: Lowerer, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    q = _one(lo, "quantize", [args[0]], {"dtype": "nvfp4"})
    return [QuantPart(q, "data"), QuantPart(q, "scale")]


def _fp8_quantize(lo: Lowerer, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    return _one(lo, "quantize", [args[0], args[1]], {"dtype": "fp8e4m3"})


def _grouped_gemm(lo: Lowerer, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    x, ids, data, scale, gscale, fmt = args
    if fmt == "bf16":
        w = data
    elif fmt == "nvfp4":
        w = whole([data, scale, gscale], ["data", "scale", "global_scale"], "grouped_gemm")
    else:
        w = whole([data, scale], ["data", "scale"], "grouped_gemm")
    return _one(lo, "grouped_gemm", [x, ids, w])


def _indexer(lo: Lowerer, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    q, kd, ks, fmt, pos, qsl, lens, table, bs = args
    k, kscale = cache_operands(kd, ks, fmt, "indexer_block_scores")
    return _one(lo, "indexer_block_scores", [q, k, kscale, pos, qsl, lens, table], {"block_size": bs})


def _sparse_attention(lo: Lowerer, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    q, kd, ks, vd, vs, fmt, sel, pos, qsl, lens, table, bs, scale = args
    k, kscale = cache_operands(kd, ks, fmt, "sparse_attention")
    v, vscale = cache_operands(vd, vs, fmt, "sparse_attention")
    return _one(lo, "sparse_attention", [q, k, kscale, v, vscale, sel, pos, qsl, lens, table],
                {"block_size": bs, "scale": float(scale)})


def _paged_attention(lo: Lowerer, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    q, kd, ks, vd, vs, fmt, pos, qsl, lens, table, bs, scale = args
    k, kscale = cache_operands(kd, ks, fmt, "paged_attention")
    v, vscale = cache_operands(vd, vs, fmt, "paged_attention")
    return _one(lo, "paged_attention", [q, k, kscale, v, vscale, pos, qsl, lens, table],
                {"block_size": bs, "scale": float(scale)})


def _m3c_ops() -> dict[Any, Rule]:
    m3c = torch.ops.m3c
    return {
        m3c.nvfp4_dequantize.default: _dequantize(["data", "scale", "global_scale"]),
        m3c.mxfp8_dequantize.default: _dequantize(["data", "scale"]),
        m3c.nvfp4_quantize.default: Rule("quantize", _nvfp4_quantize),
        m3c.fp8_quantize.default: Rule("quantize", _fp8_quantize),
        m3c.grouped_gemm.default: Rule("grouped_gemm", _grouped_gemm),
        m3c.topk.default: Rule("topk", lambda lo, args, kwargs: lo.emit("topk", [args[0]], {"k": args[1]})),
        m3c.indexer_block_scores.default: Rule("indexer_block_scores", _indexer),
        m3c.select_blocks.default: Rule(
            "select_blocks",
            lambda lo, args, kwargs: _one(lo, "select_blocks", [args[0], args[1]],
                                          {"block_size": args[2], "top_k": args[3]})),
        m3c.sparse_attention.default: Rule("sparse_attention", _sparse_attention),
        m3c.paged_attention.default: Rule("paged_attention", _paged_attention),
    }


M3C_TABLE: dict[Any, Rule] = _m3c_ops()
"""m3c custom ops (paged_write is an effect: the capture pairs its data/scale writes itself)."""

QUANT_WEIGHT_OPS: dict[Any, tuple[str, tuple[int, ...]]] = {
    torch.ops.m3c.nvfp4_dequantize.default: ("nvfp4", (0, 1, 2)),
    torch.ops.m3c.mxfp8_dequantize.default: ("mxfp8", (0, 1)),
}
"""Ops whose argument positions (data, scale[, global scale]) are the stored pieces of one weight."""


def quant_weight_args(target: Any, args: tuple[Any, ...]) -> tuple[str, tuple[Any, ...]] | None:
    """(format, (data, scale[, global scale]) FX args) if this call consumes a stored quantized weight."""
    if target in QUANT_WEIGHT_OPS:
        fmt, idx = QUANT_WEIGHT_OPS[target]
        return fmt, tuple(args[i] for i in idx)
    if target is torch.ops.m3c.grouped_gemm.default and args[5] in ("nvfp4", "mxfp8"):
        return args[5], tuple(args[2:5] if args[5] == "nvfp4" else args[2:4])
    return None


def lookup(target: Any) -> Rule | None:
    """The rule for an FX call target, or None (the capture then emits a fallback)."""
    return M3C_TABLE.get(target) or ATEN_TABLE.get(target)


def fallback_template(args: tuple[Any, ...], kwargs: dict[str, Any], who: str) -> tuple[list[Value], dict[str, Any]]:
    """(operands, JSON call template) of an IR ``fallback``: tensors become ``{"$": i}``, dtypes
    ``{"$dtype": name}``; device / layout / memory-format keywords are dropped (the run picks them)."""
    operands: list[Value] = []

    def enc(x: Any) -> Any:
        if isinstance(x, Value):
            if x not in operands:
                operands.append(x)
            return {"$": operands.index(x)}
        if isinstance(x, QuantPart):
            raise CaptureError(f"{who} uses the {x.part} of the quantized value %{x.value.name} directly; "
                               "m3c keeps quantized values whole, so add a table rule for this op")
        if isinstance(x, torch.dtype):
            return {"$dtype": DType.from_torch(x).value}
        if isinstance(x, (list, tuple)):
            return [enc(y) for y in x]
        if x is None or isinstance(x, (bool, int, float, str)):
            return x
        if hasattr(x, "free_symbols"):
            raise CaptureError(f"{who} takes the symbolic size {x}; a fallback can only take static values")
        raise CaptureError(f"{who}: argument {x!r} has no JSON form for a fallback node")

    skip = (torch.device, torch.layout, torch.memory_format)
    template = {"args": [enc(a) for a in args], "kwargs": {k: enc(v) for k, v in kwargs.items()
                                                           if not isinstance(v, skip)}}
    return operands, template


def plain_dim(expr: Any) -> Any:
    """A torch symbolic size expression with torch's sympy functions (FloorDiv, PythonMod, ...) replaced
    by ones the IR's dim parser knows."""
    from torch.utils._sympy import functions as F

    repl = {F.FloorDiv: lambda a, b: sympy.floor(a / b), F.CleanDiv: lambda a, b: a / b,
            F.PythonMod: sympy.Mod, F.Mod: sympy.Mod}
    for cls, fn in repl.items():
        expr = expr.replace(cls, fn)
    return expr


def target_name(target: Any) -> str:
    """'ns.name.overload' of an op overload (what a fallback node records)."""
    if isinstance(target, torch._ops.OpOverload):
        return f"{target.namespace}.{target._schema.name.split('::')[-1]}.{target._overloadname}"
    return getattr(target, "__name__", str(target))


