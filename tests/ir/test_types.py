"""IR types: storage sizes of quantized dtypes, printed forms, symbolic dims."""

from __future__ import annotations

from fractions import Fraction

import pytest
import sympy
import torch

from m3c.ir.types import DType, TensorType, dim_str, eval_dim, parse_dim, sym

T = sym("T")


@pytest.mark.parametrize(("text", "bindings", "nbytes"), [
    ("nvfp4[T,128]", {"T": 10}, Fraction(10 * 128 * 9, 16)),  # E2M1 + one E4M3 per 16: 4.5 bits
    ("mxfp8[T,64]", {"T": 2}, Fraction(2 * 64 * 33, 32)),  # E4M3 + one E8M0 per 32: 8.25 bits
    ("bf16[3,5]", None, Fraction(30)),
    ("f32[]", None, Fraction(4)),
    ("bool[7]", None, Fraction(7)),
])
def test_nbytes(text: str, bindings: dict[str, int] | None, nbytes: Fraction) -> None:
    assert TensorType.parse(text).nbytes(bindings) == nbytes


def test_symbolic_nbytes_and_bits() -> None:
    assert TensorType.parse("nvfp4[T,128]").nbytes() == 72 * T
    assert DType.nvfp4.bits == Fraction(9, 2) and DType.mxfp8.bits == Fraction(33, 4)
    assert DType.fp8e4m3.bits == 8 and DType.e8m0.bits == 8
    assert DType.nvfp4.is_quantized and DType.mxfp8.is_quantized and not DType.fp8e4m3.is_quantized
    assert not DType.i64.is_float and DType.e8m0.is_float


@pytest.mark.parametrize("text", ["f32[T,128]", "nvfp4[NB,8,2,32]", "mxfp8[576,128]", "fp8e4m3[4*T]", "e8m0[T,4]",
                                  "f32[]", "i64[T+1]", "bf16[floor(T/2),ceiling(T/8)]", "u8[Mod(T,8)]",
                                  "bool[2*R+2,MB]", "f16[S*T]"])
def test_parse_str_roundtrip(text: str) -> None:
    t = TensorType.parse(text)
    assert str(t) == text
    assert TensorType.parse(str(t)) == t


def test_dims() -> None:
    assert parse_dim("128") == 128 and isinstance(parse_dim("128"), int)
    assert parse_dim("-1") == -1
    assert parse_dim("4*T") == 4 * T
    assert parse_dim("2*T - T") == T
    assert dim_str(4 * (T + 1)) == "4*T+4"
    assert eval_dim(4 * T + 4, {"T": 3}) == 16
    assert eval_dim(sympy.floor(T / 2), {"T": 5}) == 2
    assert eval_dim(7, {}) == 7
    assert TensorType.parse("f32[T,4]").rank == 2 and not TensorType.parse("f32[T,4]").is_static
    assert TensorType.parse("f32[T,4]").numel() == 4 * T


def test_eval_dim_errors() -> None:
    with pytest.raises(KeyError, match=r"unbound symbols \['S'\]"):
        eval_dim(T * sym("S"), {"T": 2})
    with pytest.raises(KeyError, match="not an integer"):
        eval_dim(T / 2, {"T": 3})
    with pytest.raises(KeyError, match="unbound"):
        TensorType.parse("f32[T]").nbytes({})


@pytest.mark.parametrize("text", ["f32[T", "q7[3]", "f32[3,]", "f32[T+]", "f32[(]"])
def test_parse_errors(text: str) -> None:
    with pytest.raises(ValueError):
        TensorType.parse(text)


def test_torch_dtypes() -> None:
    for d in (DType.f32, DType.bf16, DType.fp8e4m3, DType.i64, DType.bool):
        assert DType.from_torch(d.to_torch()) == d
    assert DType.nvfp4.to_torch() == torch.uint8 and DType.mxfp8.to_torch() == torch.float8_e4m3fn
    with pytest.raises(TypeError, match="no m3c IR dtype"):
        DType.from_torch(torch.complex64)
