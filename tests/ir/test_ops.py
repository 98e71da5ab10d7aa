"""Every registered op from one table of cases: type inference, the reference under the interpreter, bad inputs.

A case lists its operands (type strings with symbolic dims, a generator for the runtime value) and
attributes. Symbols are bound to fresh random sizes each run (model-op cases take them from a small
paged KV cache); the interpreter checks every produced value against its inferred type.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

import m3c.ir.ops
from m3c.ir.graph import Graph, Value
from m3c.ir.interpreter import interpret
from m3c.ir.registry import IRTypeError, all_ops, get_op
from m3c.ir.types import DType, TensorType, eval_dim
from m3c.ir.verifier import verify
from m3c.model_defs import ops as mops
from m3c.model_defs import quant
from m3c.model_defs.config import QuantScheme
from m3c.model_defs.kv_cache import PagedKVCache
from m3c.model_defs.presets import m31_tiny

Gen = Callable[[tuple[int, ...], DType, torch.Generator, dict[str, Any]], Any]


def _randn(shape: tuple[int, ...], rng: torch.Generator) -> torch.Tensor:
    return torch.randn(shape, generator=rng)


def default_gen(shape: tuple[int, ...], dtype: DType, rng: torch.Generator, ctx: dict[str, Any]) -> Any:
    """A fresh random runtime value of a type."""
    if dtype == DType.nvfp4:
        return quant.nvfp4_quantize(_randn(shape, rng))
    if dtype == DType.mxfp8:
        return quant.mxfp8_quantize(_randn(shape, rng))
    if dtype.is_float:
        return _randn(shape, rng).to(dtype.to_torch())
    if dtype == DType.bool:
        return torch.randint(0, 2, shape, generator=rng).bool()
    return torch.randint(0, 4, shape, generator=rng).to(dtype.to_torch())


def ints(hi: int) -> Gen:
    """Random integers in [0, hi)."""
    return lambda s, d, rng, ctx: torch.randint(0, hi, s, generator=rng).to(d.to_torch())


def ctx_value(name: str) -> Gen:
    """The context's value called `name` (paged caches and batch metadata)."""
    return lambda s, d, rng, ctx: ctx[name]


def nvfp4_experts(shape: tuple[int, ...], dtype: DType, rng: torch.Generator, ctx: dict[str, Any]) -> Any:
    """Stacked NVFP4 expert weights [E, N, K] with one global scale per expert."""
    return quant.nvfp4_quantize(_randn(shape, rng), torch.rand(shape[0], 1, 1, generator=rng) + 0.5)


def paged_ctx(kv: str) -> Callable[[torch.Generator], dict[str, Any]]:
    """A small paged KV cache (blocks of 8, 2 KV heads of 32, 1 index head) after a prefill and a second step."""

    def build(rng: torch.Generator) -> dict[str, Any]:
        cfg = m31_tiny().replace(num_attention_heads=4, num_key_value_heads=2, head_dim=32, index_n_heads=2,
                                 index_head_dim=32, rotary_dim=16, msa_block_size=8, sparse_layers=(0,),
                                 quant=QuantScheme(kv, "nvfp4", "nvfp4", "mxfp8"))
        nb = int(torch.randint(6, 9, (1,), generator=rng))
        cache = PagedKVCache(cfg, num_blocks=nb, max_blocks_per_seq=4)
        draw = lambda lo, hi: int(torch.randint(lo, hi, (1,), generator=rng))  # noqa: E731
        for r in (0, 1):
            cache.add_request(r)
        cache.prepare({0: draw(1, 20), 1: draw(1, 20)})
        meta = cache.prepare({0: draw(1, 4), 1: draw(1, 4)})
        layer = cache.layers[0]
        out: dict[str, Any] = {name: getattr(meta, name) for name in meta.__dataclass_fields__}
        for name in ("k", "v", "index_k"):
            data = layer[f"{name}_data"]
            if kv == "nvfp4" or name == "index_k":
                q = quant.nvfp4_quantize(_randn((*data.shape[:-1], data.shape[-1] * 2), rng))
                data.copy_(q.data)
                layer[f"{name}_scale"].copy_(q.scale)
                out[name] = quant.NVFP4Tensor(data, layer[f"{name}_scale"], None)
            else:
                data.copy_(_randn(tuple(data.shape), rng).to(data.dtype))
                out[name] = data
                out[f"{name}_scale"] = torch.rand((), generator=rng) + 0.5
        t = int(meta.positions.shape[0])
        index_q = _randn((t, 2, 32), rng)
        out["scores"] = mops.indexer_block_scores(index_q, layer["index_k_data"], layer["index_k_scale"], "nvfp4",
                                                  meta.positions, meta.query_start_loc, meta.seq_lens,
                                                  meta.block_table, 8)
        out["selected"] = mops.select_blocks(out["scores"], meta.positions, 8, 2)
        out["bindings"] = {"T": t, "NB": nb, "R": 2, "MB": 4}
        return out

    return build


@dataclass(frozen=True)
class In:
    """One operand: its IR type (None: absent optional operand), value generator and input kind."""

    type: str | None
    gen: Gen = default_gen
    kind: str = "input"


@dataclass(frozen=True)
class Case:
    """One op application. `bad` lists (operand index, type) replacements that type inference must refuse."""

    op: str
    inputs: tuple[In, ...]
    attrs: dict[str, Any] = field(default_factory=dict)
    ctx: Callable[[torch.Generator], dict[str, Any]] | None = None
    bad: tuple[tuple[int, str], ...] = ()
    name: str = ""

    @property
    def id(self) -> str:
        return self.name or self.op


F = In("f32[T,8]")
META = (In("i64[T]", ctx_value("positions")), In("i32[R+1]", ctx_value("query_start_loc")),
        In("i32[R]", ctx_value("seq_lens")), In("i32[R,MB]", ctx_value("block_table")))
KC, VC = In("nvfp4[NB,8,2,32]", ctx_value("k"), "state"), In("nvfp4[NB,8,2,32]", ctx_value("v"), "state")
EXPERTS = In("nvfp4[4,16,32]", nvfp4_experts, "param")

CASES: list[Case] = [
    Case("add", (F, In("f32[8]")), bad=((1, "f32[7]"),)),
    Case("add", (F,), {"scalar": 2.0}, name="add-scalar"),
    Case("sub", (In("f32[4*T]"), In("f32[4*T]")), bad=((1, "f32[3*T]"),)),
    Case("mul", (In("i64[T,4]"),), {"scalar": 0.5}, name="mul-int-by-float"),
    Case("div", (F, In("f32[T,1]"))),
    *(Case(op, (In("f32[T,3]"),)) for op in ("neg", "cos", "sin", "exp", "sigmoid", "silu", "rsqrt")),
    Case("pow_scalar", (In("f32[T]"),), {"base": 2.0}),
    Case("cast", (F,), {"dtype": "bf16"}),
    Case("arange", (), {"end": 7, "step": 2}),
    Case("linear", (In("f32[T,16]"), In("f32[8,16]", kind="param"), In("f32[8]", kind="param")),
         bad=((1, "f32[8,16,1]"), (2, "f32[7]"), (0, "f32[T,15]"))),
    Case("linear", (In("f32[T,16]"), In("f32[8,16]", kind="param")), name="linear-no-bias"),
    Case("matmul", (In("f32[2,T,4]"), In("f32[4,5]")), bad=((0, "f32[4]"),)),
    Case("rms_norm", (In("f32[T,16]"), In("f32[16]", kind="param")), {"eps": 1e-6}, bad=((1, "f32[3]"),)),
    Case("embedding", (In("f32[32,8]", kind="param"), In("i64[T]", ints(32))), bad=((0, "f32[32]"),)),
    Case("slice", (In("f32[T,10]"),), {"dim": 1, "start": 2, "end": 8, "step": 2}, bad=((0, "f32[T]"),)),
    Case("slice", (In("f32[T,10]"),), {"dim": 0}, name="slice-default-bounds"),
    Case("split", (In("f32[T,10]"),), {"dim": -1, "sizes": [4, 6]}, bad=((0, "f32[T,9]"),)),
    Case("cat", (In("f32[T,3]"), In("f32[T,5]")), {"dim": 1}, bad=((1, "f32[4,5]"),)),
    Case("view", (In("f32[T,6]"),), {"shape": [-1, 3]}, bad=((0, "f32[4,7]"),)),
    Case("view", (In("f32[T,6]"),), {"shape": ["T", 2, 3]}, name="view-symbolic"),
    Case("unsqueeze", (F,), {"dim": -1}),
    Case("gather", (In("f32[T,6]"), In("i64[T,2]", ints(6))), {"dim": 1}, bad=((1, "i64[T]"), (1, "f32[T,2]"))),
    Case("sum", (In("f32[T,4,5]"),), {"dims": [1], "keepdim": True}, bad=((0, "f32[T]"),)),
    Case("sum", (In("f32[T,4,5]"),), {"dims": [0, 2]}, name="sum-drop"),
    Case("fallback", (F,), {"target": "aten.relu.default", "args": {"args": [{"$": 0}], "kwargs": {}},
                            "out_types": ["f32[T,8]"]}),
    Case("dequantize", (In("nvfp4[T,32]"),), bad=((0, "f32[T,32]"),)),
    Case("dequantize", (In("mxfp8[8,64]", kind="param"),), name="dequantize-mxfp8"),
    Case("quantize", (In("f32[T,32]"),), {"dtype": "nvfp4"}, bad=((0, "f32[T,30]"),)),
    Case("quantize", (In("f32[T,64]"),), {"dtype": "mxfp8"}, name="quantize-mxfp8"),
    Case("quantize", (In("f32[T,8]"), In("f32[]")), {"dtype": "fp8e4m3"}, name="quantize-fp8"),
    Case("paged_write", (In("nvfp4[T,2,32]"), In("i64[T]", ctx_value("slot_mapping")), KC),
         ctx=paged_ctx("nvfp4"), bad=((2, "nvfp4[NB,8,64]"), (1, "i64[T,1]"))),
    Case("indexer_block_scores", (In("f32[T,2,32]"), In("nvfp4[NB,8,1,32]", ctx_value("index_k"), "state"), In(None),
                                  *META), {"block_size": 8}, ctx=paged_ctx("nvfp4"), bad=((6, "i32[R]"),)),
    Case("select_blocks", (In("f32[T,2,MB]", ctx_value("scores")), META[0]), {"block_size": 8, "top_k": 2},
         ctx=paged_ctx("nvfp4"), bad=((0, "f32[T,MB]"),)),
    Case("sparse_attention", (In("f32[T,4,32]"), KC, In(None), VC, In(None),
                              In("i64[T,2,2]", ctx_value("selected")), *META),
         {"block_size": 8, "scale": 0.17677669529663687}, ctx=paged_ctx("nvfp4"), bad=((0, "f32[T,128]"),)),
    Case("paged_attention", (In("f32[T,4,32]"), KC, In(None), VC, In(None), *META),
         {"block_size": 8, "scale": 0.125}, ctx=paged_ctx("nvfp4"), bad=((1, "nvfp4[NB,8,16]"),)),
    Case("paged_attention", (In("f32[T,4,32]"), In("fp8e4m3[NB,8,2,32]", ctx_value("k"), "state"),
                             In("f32[]", ctx_value("k_scale")), In("fp8e4m3[NB,8,2,32]", ctx_value("v"), "state"),
                             In("f32[]", ctx_value("v_scale")), *META),
         {"block_size": 8, "scale": 0.125}, ctx=paged_ctx("fp8"), name="paged_attention-fp8"),
    Case("topk", (F,), {"k": 3}, bad=((0, "f32[]"),)),
    Case("qkv_norm_rope_kvinsert",
         (In("f32[T,32]"), In("mxfp8[352,32]", kind="param"), *(In("bf16[32]", kind="param") for _ in range(4)),
          In("f32[T,8]"), In("f32[T,8]"), In("i64[T]", ctx_value("slot_mapping")), KC, VC,
          In("nvfp4[NB,8,1,32]", ctx_value("index_k"), "state")),
         {"num_q_heads": 4, "num_kv_heads": 2, "num_index_heads": 2, "head_dim": 32, "eps": 1e-6},
         ctx=paged_ctx("nvfp4"), bad=((1, "mxfp8[320,32]"), (9, "f32[NB,8,2,32]"))),
    Case("msa_attention", (In("f32[T,4,32]"), In("f32[T,2,32]"), In("nvfp4[NB,8,1,32]", ctx_value("index_k"), "state"),
                           In(None), KC, In(None), VC, In(None), *META),
         {"block_size": 8, "top_k": 2, "scale": 0.17677669529663687}, ctx=paged_ctx("nvfp4"),
         bad=((1, "f32[T,1,32]"), (2, "nvfp4[NB,8,2,32]"))),
    Case("megamoe", (In("f32[T,32]"), In("bf16[4,32]", kind="param"), In("f32[4]", kind="param"),
                     In("nvfp4[4,32,32]", nvfp4_experts, "param"), In("nvfp4[4,32,16]", nvfp4_experts, "param"),
                     In("mxfp8[64,32]", kind="param"), In("mxfp8[32,32]", kind="param")),
         {"top_k": 2, "routed_scaling_factor": 2.5, "norm_topk_prob": True, "router_dtype": "f32"},
         bad=((1, "bf16[5,32]"), (5, "mxfp8[60,32]"))),
    Case("rope", (In("f32[T,4,32]"), In("f32[T,8]"), In("f32[T,8]")), bad=((1, "f32[T]"), (2, "f32[T,20]"))),
    Case("grouped_gemm", (In("f32[T,32]"), In("i64[T,2]", ints(4)), EXPERTS),
         bad=((2, "nvfp4[16,32]"), (0, "f32[T,16]"))),
    Case("grouped_gemm", (In("f32[T,2,64]"), In("i64[T,2]", ints(4)), In("mxfp8[4,16,64]", kind="param")),
         name="grouped_gemm-mxfp8"),
]


def build(case: Case, types: list[str | None] | None = None) -> tuple[Graph, list[Value]]:
    """A graph holding one node of the case (inputs x0, x1, ...); returns it and the node's outputs."""
    g = Graph(case.id)
    operands: list[Value | None] = []
    for i, spec in enumerate(case.inputs):
        t = types[i] if types else spec.type
        operands.append(None if t is None else g.add_input(f"x{i}", TensorType.parse(t), spec.kind))
    outs = g.add(case.op, operands, case.attrs, scope=f"cases.{case.id}")
    g.outputs = list(outs)
    return g, outs


def runtime_inputs(case: Case, g: Graph, rng: torch.Generator) -> tuple[dict[str, Any], dict[str, int]]:
    """Fresh random values for the case's graph inputs, and the symbol bindings they imply."""
    ctx = case.ctx(rng) if case.ctx else {}
    bindings = dict(ctx.get("bindings", {}))
    for v in g.inputs:
        for d in v.type.shape:
            for s in getattr(d, "free_symbols", ()):
                bindings.setdefault(s.name, int(torch.randint(1, 6, (1,), generator=rng)))
    values = {}
    for v, spec in zip((v for v in g.inputs), (s for s in case.inputs if s.type is not None)):
        shape = tuple(eval_dim(d, bindings) for d in v.type.shape)
        values[v.name] = spec.gen(shape, v.type.dtype, rng, ctx)
    return values, bindings


def test_table_covers_every_op() -> None:
    for mod in pkgutil.iter_modules(m3c.ir.ops.__path__):  # an op module nobody imported yet still counts
        importlib.import_module(f"m3c.ir.ops.{mod.name}")
    missing = set(all_ops()) - {c.op for c in CASES}
    assert not missing, f"ops without a case in tests/ir/test_ops.py CASES: {sorted(missing)}"


def test_importing_the_ops_package_registers_every_op_module() -> None:
    source = inspect.getsource(m3c.ir.ops)
    modules = {m.name for m in pkgutil.iter_modules(m3c.ir.ops.__path__)} - {"infer"}
    unlisted = {m for m in modules if not re.search(rf"\b{m}\b", source)}
    assert not unlisted, f"m3c/ir/ops/__init__.py must import {sorted(unlisted)} so get_op() always finds their ops"


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_infer_and_reference(case: Case, rng: torch.Generator) -> None:
    g, outs = build(case)
    verify(g)
    values, bindings = runtime_inputs(case, g, rng)
    results = interpret(g, values, check_types=True)
    assert len(results) == len(outs)
    for v, r in zip(outs, results):
        want = tuple(eval_dim(d, bindings) for d in v.type.shape)
        assert tuple(r.shape) == want, f"{case.id}: %{v.name} is {list(r.shape)}, inferred {v.type} = {list(want)}"
        if isinstance(r, torch.Tensor):
            assert r.dtype == v.type.dtype.to_torch()


@pytest.mark.parametrize("case", [c for c in CASES if c.bad], ids=lambda c: c.id)
def test_bad_operand_types(case: Case) -> None:
    for index, bad_type in case.bad:
        types = [s.type for s in case.inputs]
        types[index] = bad_type
        with pytest.raises(IRTypeError, match=case.op):
            build(case, types)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_bad_attrs_and_arity(case: Case) -> None:
    op = get_op(case.op)
    with pytest.raises(IRTypeError, match="unknown attribute 'bogus'"):
        build(Case(case.op, case.inputs, {**case.attrs, "bogus": 1}))
    for key in [k for k, v in op.attrs.items() if repr(v) == "REQUIRED"]:
        with pytest.raises(IRTypeError, match=f"missing attribute '{key}'"):
            build(Case(case.op, case.inputs, {k: v for k, v in case.attrs.items() if k != key}))
    if not op.variadic:  # one operand more than declared
        extra = (In("f32[1]"),) * (len(op.operands) + 1 - len(case.inputs))
        with pytest.raises(IRTypeError, match="operands"):
            build(Case(case.op, (*case.inputs, *extra), case.attrs))
    required = [i for i, o in enumerate(op.operands) if not o.endswith("?") and not o.startswith("*")]
    if required:  # the last required operand (and what follows) left out
        with pytest.raises(IRTypeError, match="operands"):
            build(Case(case.op, case.inputs[:required[-1]], case.attrs))


def test_absent_required_operand_is_refused() -> None:
    g = Graph()
    x = g.add_input("x", TensorType.parse("f32[2,2]"))
    with pytest.raises(IRTypeError, match=r"operand 2 \(cache\) is required but absent"):
        g.add("paged_write", [x, x, None])
    with pytest.raises(IRTypeError, match=r"expects 10\.\.10 operands"):
        g.add("sparse_attention", [x] * 9)  # optional scales sit mid-list: they are passed as None, not left out


def test_paged_write_updates_state_in_place(rng: torch.Generator) -> None:
    case = next(c for c in CASES if c.op == "paged_write")
    g, _ = build(case)
    values, _ = runtime_inputs(case, g, rng)
    interpret(g, values, check_types=True)
    src, slots, cache = values["x0"], values["x1"], values["x2"]
    flat = cache.data.flatten(0, 1)[slots]
    assert torch.equal(flat, src.data)
    assert torch.equal(cache.scale.flatten(0, 1)[slots].view(torch.uint8), src.scale.view(torch.uint8))


def test_interpreter_fills_default_attrs(rng: torch.Generator) -> None:
    g = Graph()
    x = g.add_input("x", TensorType.parse("f32[T,4,5]"))
    (s,) = g.add("sum", [x], {"dims": [1]})
    assert "keepdim" not in next(iter(g.nodes)).attrs
    g.outputs = [s]
    (out,) = interpret(g, {"x": torch.randn(3, 4, 5, generator=rng)}, check_types=True)
    assert out.shape == (3, 5)
