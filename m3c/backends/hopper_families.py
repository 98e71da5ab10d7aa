"""Hopper kernel families of the fused MSA and MegaMoE ops: whether a node's layout runs as kernels, and
which kernel specializations (:class:`~m3c.backends.triton_aot.KernelSpec`) its host launcher may launch.

The lowering compiles exactly these specs; at run time the host launchers of
:mod:`m3c.backends.kernels` build the same specs (same ``key()``) and the runtime's CubinRunner
launches the matching cubins. A layout a family cannot run returns a reason, and the node runs its
torch reference instead (listed in the launch plan with that reason).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

from m3c.backends.options import CompileOptions
from m3c.backends.triton_aot import KernelSpec
from m3c.ir.graph import Node, Value
from m3c.ir.types import DType

FamilyPlan = Callable[[Node, CompileOptions], tuple[str | None, list[KernelSpec], dict[str, Any]]]
"""(node, options) -> (reason it cannot run as kernels, or None; the specs its launcher may use; the launcher's
extra keyword arguments, JSON values: the launch plan keeps them as the entry's ``launch_args``)."""

_ACT = {DType.bf16: "bf16", DType.f32: "fp32"}


def _int(v: Value | None, dim: int) -> int | None:
    if v is None:
        return None
    d = v.type.shape[dim]
    return d if isinstance(d, int) else None


def msa_plan(node: Node, options: CompileOptions) -> tuple[str | None, list[KernelSpec], dict[str, Any]]:
    """The MSA indexer + sparse-attention kernels of one ``msa_attention`` node."""
    from m3c.backends.kernels.msa_attention import attention_specs
    from m3c.backends.kernels.msa_indexer import indexer_specs

    q, iq, ikc, _, kc, _, vc = node.inputs[:7]
    assert q is not None and iq is not None and ikc is not None and kc is not None and vc is not None
    for name, v in (("index_k_cache", ikc), ("k_cache", kc), ("v_cache", vc)):
        if v.type.dtype != DType.nvfp4:
            return f"{name} is {v.type.dtype.value}; the MSA kernels read nvfp4 caches", [], {}
    act = _ACT.get(q.type.dtype)
    if act is None or iq.type.dtype != q.type.dtype:
        return f"query dtypes {q.type.dtype.value}/{iq.type.dtype.value}: the kernels take bf16 or f32", [], {}
    dims = (_int(q, 1), _int(kc, 2), _int(q, 2), _int(iq, 1), _int(iq, 2))
    if any(d is None for d in dims):
        return "symbolic head counts or dims", [], {}
    h, kvh, d, g, di = dims
    bs, top_k = node.attrs["block_size"], node.attrs["top_k"]
    try:
        specs = indexer_specs(g, di, bs, top_k, act) + attention_specs(h, kvh, d, bs, top_k, act)
    except ValueError as e:  # includes ShapeError: a layout the kernels do not take
        return str(e), [], {}
    return None, specs, {}


def moe_plan(node: Node, options: CompileOptions) -> tuple[str | None, list[KernelSpec], dict[str, Any]]:
    """The routed-expert (+ shared expert) kernels of one ``megamoe`` node, the prefill's routed tiles in
    ``options.moe_prefill_precision`` (passed on to :func:`m3c.backends.kernels.megamoe.megamoe`)."""
    from m3c.backends.kernels.megamoe import megamoe_specs, megamoe_supported, prefill_wgmma_unsupported

    x, _, _, w13, w2, sw13, _ = (*node.inputs, None, None)[:7]
    assert x is not None and w13 is not None and w2 is not None
    act = _ACT.get(x.type.dtype)
    if act is None:
        return f"activation dtype {x.type.dtype.value}: the kernels take bf16 or f32", [], {}
    experts, two_inter, hidden = (_int(w13, i) for i in range(3))
    shared_inter = _int(sw13, 0) // 2 if sw13 is not None and _int(sw13, 0) else 0
    if experts is None or two_inter is None or hidden is None:
        return "symbolic expert dims", [], {}
    a = node.attrs
    if a.get("router_dtype", "f32") != "f32" or a.get("renorm_eps", 1e-20) != 1e-20:
        return (f"router in {a.get('router_dtype')} with renorm eps {a.get('renorm_eps', 1e-20)}: the kernels "
                "route in float32 with eps 1e-20 (as MoE.route does for bf16 / float32 models)"), [], {}
    sw2 = node.inputs[6] if len(node.inputs) > 6 else None
    if w2.type.dtype != w13.type.dtype or (sw13 is None) != (sw2 is None) or \
            (sw13 is not None and sw2 is not None and sw2.type.dtype != sw13.type.dtype):
        return "w13/w2 (or the shared pair) are stored in different formats", [], {}
    fmt = w13.type.dtype.value
    sfmt = sw13.type.dtype.value if sw13 is not None else None
    args = (hidden, two_inter // 2, experts, node.attrs["top_k"], shared_inter, act, fmt, sfmt)
    why = megamoe_supported(*args)
    if why:
        return why, [], {}
    precision = options.moe_prefill_precision
    why_not = prefill_wgmma_unsupported(hidden, two_inter // 2, shared_inter, act, fmt, sfmt) \
        if precision == "fp8" else None
    if why_not:
        hint = " (compile a bfloat16 model: `m3c compile --dtype bfloat16`)" \
            if why_not.startswith("activations are") else ""
        warnings.warn(f"moe_prefill_precision='fp8' asked for, but {node.outputs[0].name}'s MegaMoE prefill cannot "
                      f"run the fp8 wgmma kernels: {why_not}{hint}", UserWarning, stacklevel=2)
        precision = None
    return None, megamoe_specs(*args, prefill_precision=precision), \
        ({"prefill_precision": precision} if precision else {})


FAMILIES: dict[str, FamilyPlan] = {"msa_attention": msa_plan, "megamoe": moe_plan}
"""Fused op name -> its Hopper kernel family plan."""
