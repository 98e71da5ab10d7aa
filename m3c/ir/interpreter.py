"""The IR interpreter: runs any graph through its ops' reference implementations, on CPU or CUDA tensors.

Inputs are bound by name. Symbolic dims of the input types are bound from the actual shapes (and
checked for consistency), then used for shape attributes such as a view's target shape.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import sympy
import torch

from m3c.errors import ShapeError
from m3c.ir.graph import Graph, Node, Value
from m3c.ir.registry import get_op
from m3c.ir.types import Dim, DType, TensorType, eval_dim, parse_dim
from m3c.model_defs import quant


def runtime_shape(value: Any) -> tuple[int, ...]:
    """Logical shape of a runtime value (quantized values report their unpacked shape)."""
    return tuple(value.shape)


def bind_symbols(graph: Graph, inputs: Mapping[str, Any]) -> dict[str, int]:
    """Symbol bindings implied by the inputs' shapes; raises ShapeError on a missing or misshapen input."""
    bindings: dict[str, int] = {}
    pending: list[tuple[Value, int, Dim, int]] = []
    for v in graph.inputs:
        if v.name not in inputs:
            raise ShapeError(f"graph input %{v.name} ({v.type}, {v.kind}) was not given")
        shape = runtime_shape(inputs[v.name])
        if len(shape) != v.type.rank:
            raise ShapeError(f"input %{v.name}: expected {v.type}, got a tensor of shape {list(shape)}")
        for i, (d, actual) in enumerate(zip(v.type.shape, shape)):
            if isinstance(d, int):
                if d != actual:
                    raise ShapeError(f"input %{v.name}: dim {i} must be {d} ({v.type}), got {actual}")
            elif isinstance(d, sympy.Symbol):
                prev = bindings.setdefault(d.name, actual)
                if prev != actual:
                    raise ShapeError(f"input %{v.name}: dim {i} is {d}={actual}, but {d}={prev} elsewhere")
            else:
                pending.append((v, i, d, actual))
    _solve_pending(pending, bindings)
    for v, i, d, actual in pending:
        try:
            want = eval_dim(d, bindings)
        except KeyError:
            continue
        if want != actual:
            raise ShapeError(f"input %{v.name}: dim {i} must be {d}={want}, got {actual}")
    return bindings


def _solve_pending(pending: list[tuple[Value, int, Dim, int]], bindings: dict[str, int]) -> None:
    """Bind symbols that appear only inside expressions (an input of shape [4*T]) by solving for them."""
    progress = True
    while progress:
        progress = False
        for v, i, d, actual in pending:
            free = [s for s in sympy.sympify(d).free_symbols if s.name not in bindings]
            if len(free) != 1:
                continue
            known = sympy.sympify(d).subs({s: bindings[s.name] for s in d.free_symbols if s.name in bindings})
            try:
                roots = [r for r in sympy.solve(sympy.Eq(known, actual), free[0]) if r.is_Integer and r > 0]
            except NotImplementedError:
                continue
            if len(roots) != 1:
                raise ShapeError(f"input %{v.name}: dim {i} is {d}, which no positive integer "
                                 f"{free[0]} makes {actual}")
            bindings[free[0].name] = int(roots[0])
            progress = True


def _bind_attr(value: Any, bindings: dict[str, int]) -> Any:
    if isinstance(value, list):
        return [_bind_attr(v, bindings) for v in value]
    if isinstance(value, str):
        return eval_dim(parse_dim(value), bindings)
    return value


OpImpl = Callable[[Node, list[Any], dict[str, Any]], Any]


def interpret(graph: Graph, inputs: Mapping[str, Any], check_types: bool = False,
              impls: Mapping[str, OpImpl] | None = None) -> list[Any]:
    """Run `graph` on named inputs; returns its outputs. State inputs are updated in place.

    With `check_types`, every produced tensor's shape and dtype is checked against its IR type.
    `impls` lets a runtime claim ops: ``impls[op](node, args, attrs)`` runs instead of the reference
    (a GPU backend's kernels); every other op runs its reference implementation.
    """
    impls = impls or {}
    bindings = bind_symbols(graph, inputs)
    env: dict[Value, Any] = {v: inputs[v.name] for v in graph.inputs}
    for node in graph.nodes:
        op = get_op(node.op)
        attrs = op.full_attrs(node.attrs)  # nodes store only non-default attributes
        for name in op.dim_attrs:
            attrs[name] = _bind_attr(attrs[name], bindings)
        args = [None if v is None else env[v] for v in node.inputs]
        impl = impls.get(node.op)
        out = impl(node, args, attrs) if impl is not None else op.reference(*args, **attrs)
        if not node.outputs:
            continue
        outs = list(out) if isinstance(out, (tuple, list)) else [out]
        if len(outs) != len(node.outputs):
            raise ShapeError(f"{node.op} produced {len(outs)} values, the IR declares {len(node.outputs)}")
        for v, o in zip(node.outputs, outs):
            if check_types:
                _check(v, o, bindings)
            env[v] = o
    return [env[v] for v in graph.outputs]


def _check(v: Value, value: Any, bindings: dict[str, int]) -> None:
    t: TensorType = v.type
    shape = runtime_shape(value)
    want = tuple(eval_dim(d, bindings) if not isinstance(d, int) else d for d in t.shape)
    if shape != want:
        raise ShapeError(f"%{v.name}: IR type {t} (= {list(want)}) but the reference produced {list(shape)}")
    if t.dtype.is_quantized:
        want_cls = quant.NVFP4Tensor if t.dtype == DType.nvfp4 else quant.MXFP8Tensor
        if not isinstance(value, want_cls):
            raise ShapeError(f"%{v.name}: IR type {t} but the reference produced a {type(value).__name__}")
    elif not isinstance(value, torch.Tensor) or value.dtype != t.dtype.to_torch():
        got = value.dtype if isinstance(value, torch.Tensor) else type(value).__name__
        raise ShapeError(f"%{v.name}: IR type {t} but the reference produced {got}")
