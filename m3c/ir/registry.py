"""The op registry: each IR op declares its operands, attributes, type inference, effects and reference.

An op is one :class:`OpDef`. Its ``reference`` is plain torch and is what the interpreter runs (on
CPU or CUDA tensors); quantized operands arrive as :class:`m3c.model_defs.quant.NVFP4Tensor` /
``MXFP8Tensor``. Effects are declared by operand name: ``writes`` operands are state the op updates
in place (a KV-cache write), ``reads`` operands are state it reads; program order orders them.
Fused ops also name the ops they replace (``replaces``) so reports and checks can say so.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from m3c.errors import M3CError
from m3c.ir.types import TensorType

InferFn = Callable[[Sequence[TensorType | None], dict[str, Any]], list[TensorType]]
RefFn = Callable[..., Any]


class UnknownOpError(M3CError, KeyError):
    """An IR op name that no registered OpDef declares."""


class IRTypeError(M3CError, TypeError):
    """An op's operands or attributes do not fit its declaration."""


@dataclass(frozen=True)
class OpDef:
    """Declaration of one IR op.

    ``operands`` are names; a trailing ``?`` marks an optional operand, a leading ``*`` a variadic
    tail. ``attrs`` maps attribute name to a default (``REQUIRED`` when it has none).
    """

    name: str
    operands: tuple[str, ...]
    attrs: dict[str, Any]
    infer: InferFn
    reference: RefFn
    writes: tuple[str, ...] = ()
    reads: tuple[str, ...] = ()
    replaces: tuple[str, ...] = ()
    doc: str = ""
    dim_attrs: tuple[str, ...] = ()  # attributes holding (possibly symbolic) dims, bound at run time
    host_sync: bool = False  # the reference synchronizes with the host (.tolist(), unique): no CUDA-graph capture

    @property
    def variadic(self) -> bool:
        """Whether the last operand takes any number of values."""
        return bool(self.operands) and self.operands[-1].startswith("*")

    def operand_index(self, name: str) -> int:
        """Position of a named operand."""
        names = [o.strip("*?") for o in self.operands]
        return names.index(name)

    def has_effects(self) -> bool:
        """Whether the op writes state (and so can never be removed or reordered past a reader)."""
        return bool(self.writes)

    def check_arity(self, n: int) -> None:
        """Raise IRTypeError if `n` operands cannot match the declaration."""
        # Optional operands before a required one are passed as None, so only a trailing run may be left out.
        required = max((i + 1 for i, o in enumerate(self.operands) if not o.endswith("?") and not o.startswith("*")),
                       default=0)
        if self.variadic:
            if n < required:
                raise IRTypeError(f"{self.name}: expects at least {required} operands, got {n}")
        elif not required <= n <= len(self.operands):
            raise IRTypeError(f"{self.name}: expects {required}..{len(self.operands)} operands, got {n}")

    def check_operands(self, inputs: Sequence[object | None]) -> None:
        """Raise IRTypeError on a wrong operand count or an absent (None) operand that is not optional."""
        self.check_arity(len(inputs))
        decl = list(self.operands[:-1]) + [self.operands[-1]] * max(0, len(inputs) - len(self.operands) + 1) \
            if self.variadic else list(self.operands)
        for i, (v, d) in enumerate(zip(inputs, decl)):
            if v is None and not d.endswith("?"):
                raise IRTypeError(f"{self.name}: operand {i} ({d.strip('*')}) is required but absent")

    def full_attrs(self, attrs: dict[str, Any]) -> dict[str, Any]:
        """Attributes with defaults filled in; unknown or missing ones raise IRTypeError."""
        for key in attrs:
            if key not in self.attrs:
                raise IRTypeError(f"{self.name}: unknown attribute {key!r} (declared: {sorted(self.attrs)})")
        out = dict(self.attrs)
        out.update(attrs)
        missing = [k for k, v in out.items() if v is REQUIRED]
        if missing:
            raise IRTypeError(f"{self.name}: missing attribute {missing[0]!r}")
        return out


def infer_types(op: OpDef, types: Sequence[TensorType | None], attrs: dict[str, Any]) -> list[TensorType]:
    """Run `op`'s type inference; any failure becomes an IRTypeError that names the op."""
    try:
        return op.infer(types, attrs)
    except IRTypeError as e:
        msg = str(e)
        named = msg.split(" ", 1)[0].rstrip(":") == op.name  # the message already starts with the op's name
        raise IRTypeError(msg if named else f"{op.name}: {msg}") from None
    except (IndexError, KeyError, ValueError, TypeError, AttributeError, ZeroDivisionError) as e:
        shown = ", ".join("_" if t is None else str(t) for t in types)
        raise IRTypeError(f"{op.name}: cannot infer output types of ({shown}) with {attrs}: "
                          f"{type(e).__name__}: {e}") from e


class _Required:
    def __repr__(self) -> str:
        return "REQUIRED"


REQUIRED: Any = _Required()

_REGISTRY: dict[str, OpDef] = {}


def register(op: OpDef) -> OpDef:
    """Add an op to the registry (its name must be new)."""
    if op.name in _REGISTRY:
        raise ValueError(f"op {op.name!r} registered twice")
    _REGISTRY[op.name] = op
    return op


def get_op(name: str) -> OpDef:
    """The OpDef called `name`."""
    _ensure_loaded()
    try:
        return _REGISTRY[name]
    except KeyError:
        raise UnknownOpError(f"unknown IR op {name!r}") from None


def all_ops() -> dict[str, OpDef]:
    """Every registered op by name."""
    _ensure_loaded()
    return dict(_REGISTRY)


def defop(name: str, operands: Sequence[str], attrs: dict[str, Any] | None = None, *, infer: InferFn,
          writes: Sequence[str] = (), reads: Sequence[str] = (), replaces: Sequence[str] = (),
          dim_attrs: Sequence[str] = (), host_sync: bool = False) -> Callable[[RefFn], RefFn]:
    """Decorator: register the decorated function as the reference of a new op."""

    def wrap(fn: RefFn) -> RefFn:
        register(OpDef(name, tuple(operands), dict(attrs or {}), infer, fn, tuple(writes), tuple(reads),
                       tuple(replaces), (fn.__doc__ or "").strip().split("\n")[0], tuple(dim_attrs), host_sync))
        return fn

    return wrap


def _ensure_loaded() -> None:
    """Import the modules that define ops (once)."""
    import m3c.ir.ops  # noqa: F401
