"""The ATen table: each entry maps to its IR op, types agree with torch, and the interpreter agrees with eager."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.export import Dim

from m3c.frontend.aten_table import ATEN_TABLE, M3C_TABLE, lookup, target_name
from m3c.frontend.capture import capture
from m3c.ir.interpreter import interpret
from m3c.ir.registry import all_ops
from m3c.ir.verifier import verify

aten = torch.ops.aten

REQUIRED = [aten.embedding.default, aten._to_copy.default, aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor,
            aten.div.Tensor, aten.neg.default, aten.cos.default, aten.sin.default, aten.sigmoid.default,
            aten.silu.default, aten.pow.Scalar, aten.arange.start_step, aten.rms_norm.default, aten.linear.default,
            aten.slice.Tensor, aten.split.Tensor, aten.split_with_sizes.default, aten.cat.default, aten.view.default,
            aten.reshape.default, aten._unsafe_view.default, aten.unsqueeze.default, aten.gather.default,
            aten.sum.dim_IntList, aten._assert_tensor_metadata.default]


def test_table_covers_the_required_overloads_with_registered_ops() -> None:
    assert all(op in ATEN_TABLE for op in REQUIRED)
    ops = all_ops()
    for table in (ATEN_TABLE, M3C_TABLE):
        for target, rule in table.items():
            assert rule.op == "" or rule.op in ops, f"{target_name(target)} maps to unknown IR op {rule.op}"
    assert lookup(aten.cumsum.default) is None
    assert target_name(aten.split.Tensor) == "aten.split.Tensor"


class _Fn(nn.Module):
    def __init__(self, fn: Callable[..., torch.Tensor], **buffers: torch.Tensor) -> None:
        super().__init__()
        self.fn = fn
        for k, v in buffers.items():
            self.register_buffer(k, v)

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        return self.fn(self, *args)


def _x(*shape: int) -> torch.Tensor:
    return torch.randn(*shape)


# (case id, function of (module, *inputs), inputs, IR ops expected, buffers)
CASES: list[tuple[str, Callable[..., torch.Tensor], tuple[torch.Tensor, ...], set[str], dict[str, torch.Tensor]]] = [
    ("embedding", lambda m, ids: F.embedding(ids, m.w), (torch.tensor([1, 3, 0, 2]),), {"embedding"},
     {"w": _x(5, 8).to(torch.bfloat16)}),
    ("to_copy", lambda m, x: x.to(torch.float64), (_x(4, 8),), {"cast"}, {}),
    ("add_sub_tensor", lambda m, x: (x + m.b) - x * 0.5, (_x(4, 8),), {"add", "sub", "mul"}, {"b": _x(8)}),
    ("mul_div_scalar", lambda m, x: (x * 3) / 2.5 + 1, (_x(4, 8),), {"mul", "div", "add"}, {}),
    ("div_tensor", lambda m, x: x / (m.b + 2), (_x(4, 8),), {"div", "add"}, {"b": _x(8).abs()}),
    ("unary", lambda m, x: torch.sigmoid(-x) + F.silu(torch.cos(x)) * torch.sin(x) + torch.exp(x) + torch.rsqrt(x * x + 1),
     (_x(4, 8),), {"sigmoid", "neg", "silu", "cos", "sin", "exp", "rsqrt"}, {}),
    ("pow_scalar", lambda m, x: 2.0 ** x, (_x(4, 8),), {"pow_scalar"}, {}),
    ("arange", lambda m, x: x + torch.arange(0, 16, 2, dtype=torch.float32), (_x(4, 8),), {"arange"}, {}),
    ("rms_norm", lambda m, x: F.rms_norm(x, (8,), m.w, 1e-5), (_x(4, 8),), {"rms_norm"}, {"w": _x(8)}),
    ("linear", lambda m, x: F.linear(x, m.w) + F.linear(x, m.w, m.b), (_x(4, 8),), {"linear"},
     {"w": _x(6, 8), "b": _x(6)}),
    ("matmul", lambda m, x: x @ m.w, (_x(4, 8),), {"matmul"}, {"w": _x(8, 3)}),
    ("slice", lambda m, x: x[:, 2:6] * x[:, ::2][:, :4], (_x(4, 8),), {"slice", "mul"}, {}),
    ("split", lambda m, x: torch.cat([p * (i + 1) for i, p in enumerate(torch.split(x, 3, dim=-1))], -1),
     (_x(4, 8),), {"split", "cat"}, {}),
    ("split_sizes", lambda m, x: torch.split(x, [2, 6], dim=1)[1] + 1, (_x(4, 8),), {"split"}, {}),
    ("view", lambda m, x: x.view(x.shape[0], 2, 4).reshape(-1, 8) + x.reshape(x.shape[0] * 8).view(x.shape[0], 8),
     (_x(4, 8),), {"view"}, {}),
    ("unsqueeze", lambda m, x: x.unsqueeze(1) * x.unsqueeze(-1), (_x(4, 8),), {"unsqueeze"}, {}),
    ("gather_sum", lambda m, x, i: torch.gather(x, 1, i).sum(dim=-1, keepdim=True) + x.sum(dim=(0,)),
     (_x(4, 8), torch.tensor([[0, 7], [1, 1], [3, 2], [5, 6]])), {"gather", "sum"}, {}),
]


@pytest.mark.parametrize(("fn", "inputs", "ops", "buffers"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_aten_rule_captures_and_runs(fn: Callable[..., torch.Tensor], inputs: tuple[torch.Tensor, ...], ops: set[str],
                                     buffers: dict[str, torch.Tensor]) -> None:
    model = _Fn(fn, **buffers)
    dims = tuple({0: Dim(f"T{i}")} for i in range(len(inputs)))
    cap = capture(model, inputs, dynamic_shapes=(dims,))
    counts = cap.graph.op_counts()
    assert cap.report.fallbacks == [], str(cap.report)
    assert ops <= set(counts), counts
    verify(cap.graph)
    # a different leading size through the same (symbolic) graph
    fresh = tuple(torch.cat([x, x[:1]]) if x.is_floating_point() else torch.cat([x, x[-1:]]) for x in inputs)
    (got,) = interpret(cap.graph, cap.bind(model, *fresh), check_types=True)
    torch.testing.assert_close(got, model(*fresh), rtol=0, atol=0)


def test_fallback_arguments_keep_dtypes_and_drop_devices() -> None:
    model = _Fn(lambda m, x: torch.cumsum(x, 0, dtype=torch.float64) + torch.zeros(3, device=x.device))
    cap = capture(model, (_x(4, 3),))
    node = cap.graph.find("fallback")[0]
    assert node.attrs["args"]["kwargs"]["dtype"] == {"$dtype": "f64"}
    targets = {f.target for f in cap.report.fallbacks}
    assert "aten.cumsum.default" in targets
    x = _x(4, 3)
    (got,) = interpret(cap.graph, cap.bind(model, x), check_types=True)
    assert torch.equal(got, model(x))
