"""Lowering for Hopper (sm_90a): fused ops with a kernel family get offline-compiled cubins; the rest runs
through its torch reference on the GPU (listed in the launch plan's ``reference_ops``).

The fused MSA and MegaMoE ops lower through :mod:`m3c.backends.hopper_families` (their plan entries
list the spec keys their host launchers may launch). Each kernel is stored as its cubin and its PTX.
QKV kernels are compiled per distinct layer shape (identical layers share one binary) in the tile sets
of ``qkv_fused_launch.PHASES`` (``decode`` ≤ 64 tokens with split-K so every SM streams weights,
``mid`` ≤ 1024, ``prefill``). Prepacked weights (dequantized to the activation dtype, RoPE rows paired) are added to the Program's weights
as ``<param>.qkv_packed``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from m3c.backends.hopper_families import FAMILIES
from m3c.backends.kernels.qkv_fused_launch import PHASES, QKVShape, fused_spec, prepack_weight
from m3c.backends.options import CompileOptions
from m3c.backends.program import Program, flatten_weights
from m3c.backends.triton_aot import CompiledKernel, compile_kernels
from m3c.errors import CompileError
from m3c.ir.graph import Graph, Node
from m3c.ir.registry import UnknownOpError, get_op
from m3c.ir.types import DType
from m3c.model_defs import quant

TILES = {phase: tiles for phase, (_, tiles) in PHASES.items()}
"""QKV tiles compiled per phase (the one table: qkv_fused_launch.PHASES)."""
_TRITON_DTYPE = {DType.bf16: "bf16", DType.f32: "fp32", DType.f16: "fp16"}


def qkv_shape(node: Node) -> QKVShape:
    """The kernel layout of a qkv_norm_rope_kvinsert node."""
    a = node.attrs
    cos = node.inputs[6]
    assert cos is not None
    return QKVShape(a["num_q_heads"], a["num_kv_heads"], a.get("num_index_heads", 0), a["head_dim"],
                    2 * int(cos.type.shape[1]))


def _packed_weight(value: Any, dtype: torch.dtype, shape: QKVShape) -> torch.Tensor:
    if isinstance(value, quant.NVFP4Tensor):
        w = quant.nvfp4_dequantize(value)
    elif isinstance(value, quant.MXFP8Tensor):
        w = quant.mxfp8_dequantize(value)
    else:
        w = value.float()
    return prepack_weight(w.to(dtype), shape).contiguous()


def lower_hopper(graph: Graph, options: CompileOptions, weights: Mapping[str, Any]) -> Program:
    """A Hopper Program: cubins + launch plan for the fused QKV nodes, torch reference for the other ops."""
    flat = flatten_weights(graph, weights)
    kernels: dict[str, bytes] = {}
    metas: dict[str, dict[str, Any]] = {}
    plan: list[dict[str, Any]] = []
    reference_ops: dict[str, int] = {}
    specs: dict[str, tuple[Any, tuple[int, ...]]] = {}
    for node in graph.nodes:
        try:
            get_op(node.op)
        except UnknownOpError as e:
            raise CompileError(f"cannot lower node {node!r} for hopper: {e}") from None
        if node.op in FAMILIES:
            why, family_specs, launch_args = FAMILIES[node.op](node, options)
            if why:
                reference_ops[node.op] = reference_ops.get(node.op, 0) + 1
                plan.append({"op": node.op, "output": node.outputs[0].name, "kernel": None, "why": why})
                continue
            for spec in family_specs:
                specs.setdefault(spec.key(), (spec, ()))
            plan.append({"op": node.op, "output": node.outputs[0].name,
                         "specs": sorted({s.key() for s in family_specs}),
                         **({"launch_args": launch_args} if launch_args else {})})
            continue
        if node.op != "qkv_norm_rope_kvinsert":
            reference_ops[node.op] = reference_ops.get(node.op, 0) + 1
            continue
        shape = qkv_shape(node)
        why = shape.supported()
        x, w = node.inputs[0], node.inputs[1]
        assert x is not None and w is not None
        act = _TRITON_DTYPE.get(x.type.dtype)
        if why or act is None or w.kind != "param":
            reason = why or (f"activation dtype {x.type.dtype.value}" if act is None else "weight is not a param")
            reference_ops[node.op] = reference_ops.get(node.op, 0) + 1
            plan.append({"op": node.op, "output": node.outputs[0].name, "kernel": None, "why": reason})
            continue
        packed = f"{w.name}.qkv_packed"
        if packed not in flat:
            flat[packed] = _packed_weight(weights[w.name], x.type.dtype.to_torch(), shape)
        entry: dict[str, Any] = {"op": node.op, "output": node.outputs[0].name, "weight": packed, "kernels": {}}
        for phase, tiles in TILES.items():
            spec = fused_spec(shape, tiles, act=act, q_out=act)
            specs.setdefault(spec.key(), (spec, tiles))
            entry["kernels"][phase] = spec.key()
        plan.append(entry)
    for ck, (_, tiles) in zip(compile_kernels([s for s, _ in specs.values()]), specs.values()):
        kernels[f"{ck.key}.cubin"] = ck.binary
        kernels[f"{ck.key}.ptx"] = ck.stages["ptx"].encode()  # kept for disassembly checks and --dump-kernels
        metas[ck.key] = ck.meta() | {"tiles": list(tiles)}
    plan.append({"kernel_meta": metas, "reference_ops": dict(sorted(reference_ops.items()))})
    return Program(target="hopper", graph=graph, weights=flat, options=options, kernels=kernels, launch_plan=plan)


def compiled_kernels(program: Program) -> dict[str, CompiledKernel]:
    """The program's kernels as CompiledKernel records (binary + launch metadata), by key."""
    metas = next((e["kernel_meta"] for e in program.launch_plan if "kernel_meta" in e), {})
    out = {}
    for key, m in metas.items():
        out[key] = CompiledKernel(key, m["family"], m["name"], program.kernels[f"{key}.cubin"], m["shared_bytes"],
                                  m["num_warps"], m["arg_names"], m["arg_types"], m["target"])
    return out
