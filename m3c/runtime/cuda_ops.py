"""CUDA implementations the executor hands the interpreter for a Hopper Program's kernel-backed ops.

Each loaded cubin is launched through the CUDA driver (:mod:`m3c.runtime.cuda_launcher`); no Triton
JIT runs at load. Ops without an entry here run their torch reference on the GPU.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from m3c.backends.hopper import compiled_kernels, qkv_shape
from m3c.backends.kernels.qkv_fused_launch import fused_launch, make_outputs, tile_phase
from m3c.backends.program import Program
from m3c.ir.graph import Node
from m3c.ir.interpreter import OpImpl
from m3c.runtime.cuda_launcher import CubinKernel, CubinRunner


class QKVLauncher:
    """Runs qkv_norm_rope_kvinsert nodes with the program's cubins (decode or prefill tiles by token count)."""

    def __init__(self, program: Program, device: torch.device, kernels: dict[str, CubinKernel]) -> None:
        self.kernels = kernels
        metas = next((e["kernel_meta"] for e in program.launch_plan if "kernel_meta" in e), {})
        self.tiles = {key: m["tiles"] for key, m in metas.items()}
        self.entries = {e["output"]: e for e in program.launch_plan
                        if e.get("kernels") and e.get("op") == "qkv_norm_rope_kvinsert"}
        self.packed = {e["weight"]: program.weights[e["weight"]].to(device) for e in self.entries.values()}
        self.launches = 0

    def __call__(self, node: Node, args: list[Any], attrs: dict[str, Any]) -> Any:
        """Launch the node's kernel; returns q (, index-q) like the reference."""
        entry = self.entries.get(node.outputs[0].name)
        if entry is None:
            from m3c.ir.registry import get_op

            return get_op(node.op).reference(*args, **attrs)
        x, _, qn, kn, iqn, ikn, cos, sin, slots, kc, vc, ikc = args
        shape = qkv_shape(node)
        t = x.shape[0]
        key = entry["kernels"][tile_phase(t)]
        x = x.contiguous()
        q, iq = make_outputs(x, shape)
        norms = (qn, kn, iqn, ikn) if shape.num_index_heads else (qn, kn)
        cos, sin = cos.float().contiguous(), sin.float().contiguous()  # the kernel reads float32 angles
        grid, cargs = fused_launch(x, self.packed[entry["weight"]], cos, sin, slots, norms, kc, vc, ikc, shape,
                                   attrs["eps"], tuple(self.tiles[key]), q, iq)
        self.kernels[key](grid, *cargs)
        self.launches += 1
        return (q, iq) if shape.num_index_heads else (q,)


class FamilyLauncher:
    """Runs the nodes of one fused op whose plan entry lists kernel specs, through the program's cubins;
    nodes the lowering left to the reference (an entry with a reason) run their torch reference."""

    def __init__(self, program: Program, op: str, launch: Callable[..., Any], runner: CubinRunner) -> None:
        self.op, self.launch, self.runner = op, launch, runner
        self.entries = {e["output"]: e for e in program.launch_plan if e.get("op") == op and e.get("specs")}

    def __call__(self, node: Node, args: list[Any], attrs: dict[str, Any]) -> Any:
        """The node's outputs (a tuple, like the reference's)."""
        if node.outputs[0].name not in self.entries:
            from m3c.ir.registry import get_op

            return get_op(node.op).reference(*args, **attrs)
        return self.launch(args, attrs | self.entries[node.outputs[0].name].get("launch_args", {}), self.runner)


def launch_msa(args: list[Any], attrs: dict[str, Any], runner: CubinRunner) -> torch.Tensor:
    """msa_attention: the indexer (scores + top-k select) then the sparse attention, on nvfp4 caches."""
    from m3c.backends.kernels.msa import msa

    q, iq, ikc, _, kc, _, vc, _, pos, qsl, seq_lens, table = args
    return msa(q, iq, ikc, kc, vc, pos, qsl, seq_lens, table, attrs["block_size"], attrs["top_k"], attrs["scale"],
               runner=runner)


def launch_moe(args: list[Any], attrs: dict[str, Any], runner: CubinRunner) -> torch.Tensor:
    """megamoe: routing, then the routed experts with the shared expert fused in (``prefill_precision`` from the
    launch plan: the compile option ``moe_prefill_precision``)."""
    from m3c.backends.kernels.megamoe import megamoe

    x, gate_w, bias, w13, w2, sw13, sw2 = (*args, None, None)[:7]
    return megamoe(x, gate_w, bias, w13, w2, sw13, sw2, top_k=attrs["top_k"],
                   routed_scaling_factor=attrs["routed_scaling_factor"], norm_topk_prob=attrs["norm_topk_prob"],
                   runner=runner, prefill_precision=attrs.get("prefill_precision"))


def cuda_impls(program: Program, device: torch.device) -> dict[str, OpImpl]:
    """Op name -> implementation for the interpreter, for a Hopper program on a CUDA device."""
    kernels = {key: CubinKernel(k.binary, k.name, k.shared_bytes, k.num_warps, k.arg_types)
               for key, k in compiled_kernels(program).items()}
    runner = CubinRunner(kernels)
    return {"qkv_norm_rope_kvinsert": QKVLauncher(program, device, kernels),
            "msa_attention": FamilyLauncher(program, "msa_attention", launch_msa, runner),
            "megamoe": FamilyLauncher(program, "megamoe", launch_moe, runner)}
