"""Hand-built MoE graphs for the MegaMoE fusion tests: the ops the frontend emits for
:class:`m3c.model_defs.layers.MoE` after canonicalization, in trace order, with every form option.

`tests/passes/test_fuse_moe.py` checks this emitter against a real capture, so the fast variant
tests here stay tied to what the frontend really produces.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from m3c.ir.graph import Graph, Value
from m3c.ir.types import DType, TensorType, sym
from m3c.model_defs import quant
from m3c.model_defs.config import M3Config

T = sym("T")


@dataclass(frozen=True)
class MoEForm:
    """One MoE block's shape and form (tiny-preset sizes by default)."""

    dtype: str = "f32"  # the activation dtype (the model's dtype)
    experts: str = "nvfp4"  # routed expert format: nvfp4 | mxfp8 | bf16
    shared: str | None = "mxfp8"  # shared expert format: mxfp8 | bf16 | None (no shared expert)
    norm: bool = True
    scale: float = 2.5
    hidden: int = 128
    num_experts: int = 8
    inter: int = 64
    top_k: int = 2
    shared_inter: int = 64

    @classmethod
    def of(cls, cfg: M3Config, dtype: str) -> MoEForm:
        """The form a model of `cfg` in activation dtype `dtype` traces to."""
        return cls(dtype, cfg.quant.routed_expert_dtype, cfg.quant.proj_dtype if cfg.n_shared_experts else None,
                   cfg.norm_topk_prob, cfg.routed_scaling_factor, cfg.hidden_size, cfg.n_routed_experts,
                   cfg.moe_intermediate_size, cfg.num_experts_per_tok,
                   cfg.moe_intermediate_size * max(cfg.n_shared_experts, 1))

    @property
    def router(self) -> str:
        """The routing dtype: at least float32 (MoE.route)."""
        return "f64" if self.dtype == "f64" else "f32"


def _t(dtype: str, *shape: Any) -> TensorType:
    return TensorType(DType(dtype), tuple(shape))


def emit_moe(g: Graph, x: Value, form: MoEForm, scope: str) -> Value:
    """Append one MoE block on x [T, H] with its parameters named `{scope}.…`; returns its output."""
    f, h, e, i = form, form.hidden, form.num_experts, form.inter

    def a(op: str, ins: list[Value | None], attrs: dict[str, Any] | None = None, sc: str = scope) -> list[Value]:
        return g.add(op, ins, attrs, scope=sc)

    def one(op: str, ins: list[Value | None], attrs: dict[str, Any] | None = None, sc: str = scope) -> Value:
        return a(op, ins, attrs, sc)[0]

    bias = g.add_input(f"{scope}.e_score_correction_bias", _t("f32" if f.dtype != "f64" else "f64", e), "param")
    gate = g.add_input(f"{scope}.gate.weight", _t("bf16", e, h), "param")
    w13 = g.add_input(f"{scope}.w13", _t(f.experts, e, 2 * i, h), "param")
    w2 = g.add_input(f"{scope}.w2", _t(f.experts, e, h, i), "param")
    widened = f.dtype != f.router
    xr = one("cast", [x], {"dtype": f.router}) if widened else x
    scores = one("sigmoid", [one("linear", [xr, one("cast", [gate], {"dtype": f.router})])])
    ids = a("topk", [one("add", [scores, bias])], {"k": f.top_k})[1]
    w = one("gather", [scores, ids], {"dim": 1})
    if f.norm:
        w = one("div", [w, one("add", [one("sum", [w], {"dims": [1], "keepdim": True})], {"scalar": 1e-20})])
    if f.scale != 1:
        w = one("mul", [w], {"scalar": f.scale})
    gate_up = a("split", [one("grouped_gemm", [x, ids, w13])], {"dim": 2, "sizes": [i, i]})
    down = one("grouped_gemm", [one("mul", [one("silu", [gate_up[0]]), gate_up[1]]), ids, w2])
    if widened:
        w = one("cast", [w], {"dtype": f.dtype})
    out = one("sum", [one("mul", [down, one("unsqueeze", [w], {"dim": 2})])], {"dims": [1]})
    if f.shared is None:
        return out
    si = f.shared_inter
    ws = [g.add_input(f"{scope}.shared.{j}", _t(f.shared, *shape), "param") for j, shape in enumerate([(2 * si, h),
                                                                                                       (h, si)])]

    def weight(j: int) -> Value:
        sc = f"{scope}.shared.{j}"
        w = one("dequantize", [ws[j]], sc=sc) if f.shared in ("nvfp4", "mxfp8") else ws[j]
        return one("cast", [w], {"dtype": f.dtype}, sc=sc) if w.type.dtype.value != f.dtype else w

    parts = a("split", [one("linear", [x, weight(0)], sc=f"{scope}.shared.0")], {"dim": 1, "sizes": [si, si]})
    act = one("mul", [one("silu", [parts[0]]), parts[1]])
    return one("add", [out, one("linear", [act, weight(1)], sc=f"{scope}.shared.1")])


def moe_graph(forms: list[MoEForm]) -> Graph:
    """One MoE block per form, chained residually (h ← h + moe(h)) like decoder layers."""
    g = Graph("moe")
    h = g.add_input("h", _t(forms[0].dtype, T, forms[0].hidden))
    for n, form in enumerate(forms):
        h = g.add("add", [h, emit_moe(g, h, form, f"layers.{n}.mlp")], scope=f"layers.{n}")[0]
    g.outputs = [h]
    return g


def random_value(v: Value, tokens: int, rng: torch.Generator) -> Any:
    """A fresh runtime value for an input of `moe_graph` (expert stacks get a per-expert global scale)."""
    shape = tuple(tokens if not isinstance(d, int) else d for d in v.type.shape)
    dtype = v.type.dtype
    x = torch.randn(shape, generator=rng) * (0.3 if v.kind == "param" else 1.0)
    if dtype == DType.nvfp4:
        gs = torch.rand(shape[0], 1, 1, generator=rng) + 0.5 if len(shape) == 3 else None
        return quant.nvfp4_quantize(x, gs)
    if dtype == DType.mxfp8:
        return quant.mxfp8_quantize(x)
    return x.to(dtype.to_torch())


def random_inputs(g: Graph, rng: torch.Generator) -> dict[str, Any]:
    """Fresh values for every input of a `moe_graph` graph (a random token count)."""
    tokens = int(torch.randint(1, 12, (1,), generator=rng))
    return {v.name: random_value(v, tokens, rng) for v in g.inputs}
