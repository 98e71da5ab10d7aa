"""IR types: element dtypes (quantized ones first-class) and tensor types with symbolic dimensions.

A dimension is an ``int`` or a :class:`sympy.Expr` over named symbols (``T`` new tokens, ``R``
requests, ...), so one graph serves every batch and sequence length. Quantized dtypes count their
scales: NVFP4 costs 4.5 bits a value (E2M1 + one E4M3 per 16), MXFP8 8.25 bits (E4M3 + one E8M0
per 32), so a pass can ask how many bytes a value occupies.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from enum import Enum
from fractions import Fraction

import sympy
import torch


class DType(Enum):
    """Element types of IR values. The value is the printed name."""

    f64 = "f64"
    f32 = "f32"
    f16 = "f16"
    bf16 = "bf16"
    fp8e4m3 = "fp8e4m3"
    e8m0 = "e8m0"
    nvfp4 = "nvfp4"
    mxfp8 = "mxfp8"
    u8 = "u8"
    i32 = "i32"
    i64 = "i64"
    bool = "bool"

    @property
    def bits(self) -> Fraction:
        """Storage bits per logical element, block scales included."""
        return _BITS[self]

    @property
    def is_quantized(self) -> bool:
        """Whether values of this dtype carry block scales (a packed format)."""
        return self in (DType.nvfp4, DType.mxfp8)

    @property
    def is_float(self) -> bool:
        """Whether this is a floating-point dtype (quantized ones included)."""
        return self not in (DType.u8, DType.i32, DType.i64, DType.bool)

    def to_torch(self) -> torch.dtype:
        """The torch dtype that stores one element (packed formats: their data tensor's dtype)."""
        return _TO_TORCH[self]

    @staticmethod
    def from_torch(dtype: torch.dtype) -> DType:
        """The IR dtype of a torch dtype."""
        try:
            return _FROM_TORCH[dtype]
        except KeyError:
            raise TypeError(f"torch dtype {dtype} has no m3c IR dtype") from None


_BITS = {
    DType.f64: Fraction(64), DType.f32: Fraction(32), DType.f16: Fraction(16), DType.bf16: Fraction(16),
    DType.fp8e4m3: Fraction(8), DType.e8m0: Fraction(8), DType.nvfp4: Fraction(9, 2),
    DType.mxfp8: Fraction(33, 4), DType.u8: Fraction(8), DType.i32: Fraction(32), DType.i64: Fraction(64),
    DType.bool: Fraction(8),
}
_TO_TORCH = {
    DType.f64: torch.float64, DType.f32: torch.float32, DType.f16: torch.float16, DType.bf16: torch.bfloat16,
    DType.fp8e4m3: torch.float8_e4m3fn, DType.e8m0: torch.uint8, DType.nvfp4: torch.uint8,
    DType.mxfp8: torch.float8_e4m3fn, DType.u8: torch.uint8, DType.i32: torch.int32, DType.i64: torch.int64,
    DType.bool: torch.bool,
}
_FROM_TORCH = {
    torch.float64: DType.f64, torch.float32: DType.f32, torch.float16: DType.f16, torch.bfloat16: DType.bf16,
    torch.float8_e4m3fn: DType.fp8e4m3, torch.uint8: DType.u8, torch.int32: DType.i32, torch.int64: DType.i64,
    torch.bool: DType.bool,
}

Dim = int | sympy.Expr


def sym(name: str) -> sympy.Symbol:
    """A named symbolic dimension (positive integer)."""
    return sympy.Symbol(name, integer=True, positive=True)


@functools.lru_cache(maxsize=4096)
def parse_dim(text: str) -> Dim:
    """A dimension from its printed form ('128', 'T', '4*T'); cached (dims are immutable)."""
    text = text.strip()
    if text.lstrip("-").isdigit():
        return int(text)
    try:
        expr = sympy.sympify(text, locals={**_DIM_FUNCTIONS, **{n: sym(n) for n in _symbol_names(text)}})
    except (sympy.SympifyError, SyntaxError, TypeError) as e:
        raise ValueError(f"bad dimension {text!r}: {e}") from None
    if not isinstance(expr, sympy.Expr):
        raise ValueError(f"bad dimension {text!r}")
    return int(expr) if expr.is_Integer else expr


_DIM_FUNCTIONS = {"floor": sympy.floor, "ceiling": sympy.ceiling, "Max": sympy.Max, "Min": sympy.Min,
                  "Mod": sympy.Mod}


def _symbol_names(text: str) -> set[str]:
    import re

    return {m for m in re.findall(r"[A-Za-z_][A-Za-z_0-9]*", text)} - set(_DIM_FUNCTIONS)


def dim_str(d: Dim) -> str:
    """Printed form of a dimension (no spaces)."""
    return str(d).replace(" ", "")


def eval_dim(d: Dim, bindings: dict[str, int]) -> int:
    """A dimension's value once its symbols are bound."""
    if isinstance(d, int):
        return d
    value = sympy.sympify(d).subs({sym(k): v for k, v in bindings.items()})
    if value.free_symbols:
        raise KeyError(f"dimension {d} has unbound symbols {sorted(map(str, value.free_symbols))}")
    if not value.is_Integer:
        raise KeyError(f"dimension {d} is {value}, not an integer, at {bindings}")
    return int(value)


@dataclass(frozen=True)
class TensorType:
    """Element dtype and (possibly symbolic) shape of an IR value."""

    dtype: DType
    shape: tuple[Dim, ...]

    def __str__(self) -> str:
        return f"{self.dtype.value}[{','.join(dim_str(d) for d in self.shape)}]"

    @property
    def rank(self) -> int:
        """Number of dimensions."""
        return len(self.shape)

    @property
    def is_static(self) -> bool:
        """Whether every dimension is a known integer."""
        return all(isinstance(d, int) for d in self.shape)

    def numel(self) -> Dim:
        """Element count (symbolic if the shape is)."""
        n: Dim = 1
        for d in self.shape:
            n = n * d
        return n

    def nbytes(self, bindings: dict[str, int] | None = None) -> Fraction | sympy.Expr:
        """Bytes the value occupies, block scales included; symbolic unless `bindings` fixes every symbol."""
        n = self.numel()
        if bindings is not None:
            n = eval_dim(n, bindings) if not isinstance(n, int) else n
        if isinstance(n, int):
            return Fraction(n) * self.dtype.bits / 8
        return n * sympy.Rational(self.dtype.bits.numerator, self.dtype.bits.denominator) / 8

    @staticmethod
    def parse(text: str) -> TensorType:
        """Parse the printed form 'f32[T,128]'."""
        name, _, rest = text.strip().partition("[")
        if not rest.endswith("]"):
            raise ValueError(f"bad tensor type {text!r}")
        body = rest[:-1]
        dims = tuple(parse_dim(x) for x in _split_dims(body)) if body else ()
        return TensorType(DType(name), dims)


def _split_dims(body: str) -> list[str]:
    """Split 'T,4*(T+1),8' at top-level commas."""
    out, depth, cur = [], 0, ""
    for ch in body:
        if ch == "," and depth == 0:
            out.append(cur)
            cur = ""
            continue
        depth += ch == "("
        depth -= ch == ")"
        cur += ch
    out.append(cur)
    return out
