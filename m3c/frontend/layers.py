"""Identical decoder layers: recognize them in a captured graph, and stamp one traced layer many times.

A node belongs to layer N when its scope is ``layers.N`` or below. A layer's *signature* is its
nodes printed with values renamed by position, graph inputs by their layer-normalized names
(``layers.N.x`` → ``layers.*.x``, ``kv.N.x`` → ``kv.*.x``), and values from outside the layer by
their order of first use; layers with equal signatures are structurally identical (the same
kernels can serve them). :func:`layer_groups` lists them, ``graph.meta["layer_groups"]`` keeps it.

:func:`stamp_layers` builds a deep model from a shallow trace: prelude, one copy of a traced layer
per planned layer (inputs renamed to that layer, the residual chain rewired), epilogue. It needs
the layout every decoder stack has: prelude, layers in order, epilogue, each layer handing exactly
one value to the next; anything else raises :class:`StampError`. :func:`capture_m3_stamped` does
this for the reference model: it traces two layers of each kind and stamps all of them.
"""

from __future__ import annotations

import copy
import hashlib
import json
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from torch import nn

from m3c.errors import M3CError
from m3c.ir.graph import Graph, Node, Value

if TYPE_CHECKING:
    from m3c.frontend.capture import Capture

_LAYER = re.compile(r"^layers\.(\d+)(?:\.|$)")
_LAYER_NAME = re.compile(r"^(layers|kv)\.(\d+)\.")


class StampError(M3CError, ValueError):
    """A graph whose layers cannot be stamped (unusual layout or layers that are not identical)."""


def layer_of(scope: str) -> int | None:
    """The decoder layer index of a node scope ('layers.3.self_attn' -> 3), or None."""
    m = _LAYER.match(scope)
    return int(m.group(1)) if m else None


def normalize_name(name: str) -> str:
    """A graph input name with its layer index replaced by '*'."""
    return _LAYER_NAME.sub(r"\1.*.", name)


def rename_layer(name: str, src: int, dst: int) -> str:
    """A layer-owned input name moved from layer `src` to `dst` (other names unchanged)."""
    return re.sub(rf"^(layers|kv)\.{src}\.", rf"\g<1>.{dst}.", name)


@dataclass
class _Layer:
    """One layer's nodes, the non-input values it uses from outside (first-use order), and what leaves it."""

    index: int
    nodes: list[Node] = field(default_factory=list)
    ext: list[Value] = field(default_factory=list)
    escapes: list[Value] = field(default_factory=list)


def _layers(graph: Graph) -> dict[int, _Layer]:
    layers: dict[int, _Layer] = {}
    for node in graph.nodes:
        i = layer_of(node.scope)
        if i is not None:
            layers.setdefault(i, _Layer(i)).nodes.append(node)
    inputs = set(graph.inputs)
    users = graph.users()
    outputs = set(graph.outputs)
    for layer in layers.values():
        mine = set(layer.nodes)
        produced = {v for n in layer.nodes for v in n.outputs}
        seen: set[Value] = set()
        for n in layer.nodes:
            for v in n.inputs:
                if v is not None and v not in produced and v not in inputs and v not in seen:
                    seen.add(v)
                    layer.ext.append(v)
        layer.escapes = [v for n in layer.nodes for v in n.outputs
                         if v in outputs or any(u not in mine for u in users.get(v, []))]
    return dict(sorted(layers.items()))


def _signature(layer: _Layer) -> str:
    local: dict[Value, str] = {}
    ext = {v: i for i, v in enumerate(layer.ext)}

    def ref(v: Value | None) -> str:
        if v is None:
            return "_"
        if v in local:
            return local[v]
        if v in ext:
            return f"$ext{ext[v]}:{v.type}"
        return f"@{normalize_name(v.name)}:{v.type}:{v.kind}"

    lines = []
    for i, node in enumerate(layer.nodes):
        for k, v in enumerate(node.outputs):
            local[v] = f"%{i}.{k}"
        outs = ", ".join(f"{local[v]}:{v.type}" for v in node.outputs)
        attrs = json.dumps(node.attrs, sort_keys=True, default=str)
        lines.append(f"{outs} = {node.op}({', '.join(ref(v) for v in node.inputs)}) {attrs}")
    lines.append("escapes " + ", ".join(ref(v) for v in layer.escapes))
    return "\n".join(lines)


def layer_hashes(graph: Graph) -> dict[int, str]:
    """sha256 of each layer's name-normalized signature, by layer index."""
    return {i: hashlib.sha256(_signature(layer).encode()).hexdigest() for i, layer in _layers(graph).items()}


def layer_groups(graph: Graph) -> list[list[int]]:
    """Layers whose subgraphs are structurally identical, e.g. [[0, 1], [2]], ordered by first layer."""
    groups: dict[str, list[int]] = {}
    for i, h in layer_hashes(graph).items():
        groups.setdefault(h, []).append(i)
    return sorted(groups.values(), key=lambda g: g[0])


def annotate_layers(graph: Graph) -> list[list[int]]:
    """Store :func:`layer_groups` in ``graph.meta["layer_groups"]`` (when the graph has layers)."""
    groups = layer_groups(graph)
    if groups:
        graph.meta["layer_groups"] = groups
    else:
        graph.meta.pop("layer_groups", None)
    return groups


# ---- stamping --------------------------------------------------------------------------------------
def _layout(graph: Graph, layers: dict[int, _Layer]) -> tuple[list[Node], list[Node]]:
    """(prelude, epilogue) nodes; StampError unless the graph is prelude, layers 0..k-1 in order, epilogue."""
    labels = [layer_of(n.scope) for n in graph.nodes]
    where = [i for i, lab in enumerate(labels) if lab is not None]
    if not where:
        raise StampError("the graph has no decoder layers (no node scope 'layers.N')")
    middle = labels[where[0]: where[-1] + 1]
    runs = [lab for i, lab in enumerate(middle) if i == 0 or lab != middle[i - 1]]
    if runs != list(range(len(layers))):
        raise StampError(f"layers are not contiguous runs 0..{len(layers) - 1} in program order (runs: {runs[:12]})")
    return graph.nodes[: where[0]], graph.nodes[where[-1] + 1:]


def _chain(graph: Graph, layers: dict[int, _Layer], prelude: list[Node]) -> list[Value]:
    """chain[j]: the value entering layer j from before it (chain[k] leaves the last layer)."""
    pre = {v for n in prelude for v in n.outputs}
    hashes = {i: hashlib.sha256(_signature(layer).encode()).hexdigest() for i, layer in layers.items()}
    for j, layer in layers.items():
        if len(layer.escapes) != 1:
            raise StampError(f"layer {j} hands {len(layer.escapes)} values onward; stamping needs exactly one")
        if j and [v for v in layer.ext if v not in pre] != layers[j - 1].escapes:
            raise StampError(f"layer {j} uses values of layers other than its predecessor's output")
    twin = next((j for j in layers if j and hashes[j] == hashes[0]), None)
    if twin is None:
        raise StampError("layer 0 has no identical twin to find its input by; trace two layers of its kind")
    entry = layers[0].ext[layers[twin].ext.index(layers[twin - 1].escapes[0])]
    return [entry] + [layers[j].escapes[0] for j in layers]


def stamp_layers(graph: Graph, plan: Sequence[int], rename: Callable[[str, int, int], str] = rename_layer,
                 ) -> tuple[Graph, dict[str, tuple[str, int, int]]]:
    """A graph of len(plan) layers, layer L a copy of traced layer plan[L]; and, for each layer-owned
    input of the result, (the traced input it copies, traced layer, new layer)."""
    layers = _layers(graph)
    prelude, epilogue = _layout(graph, layers)
    chain = _chain(graph, layers, prelude)
    if any(j not in layers for j in plan):
        raise StampError(f"plan {list(plan)} names layers the graph does not have (it has {len(layers)})")
    inside = {n for layer in layers.values() for n in layer.nodes}
    for v in (v for n in epilogue for v in n.inputs if v is not None and v.producer in inside):
        if v is not chain[-1]:
            raise StampError(f"the epilogue uses %{v.name} from inside a layer; only the last layer's output may")

    # which inputs belong to one layer (renamed per copy) and which are shared
    users = graph.users()
    owner: dict[Value, int] = {}
    for v in graph.inputs:
        labs = {layer_of(u.scope) for u in users.get(v, [])}
        if len(labs) == 1 and None not in labs and rename(v.name, next(iter(labs)), -1) != v.name:
            owner[v] = next(iter(labs))
        elif any(rename(v.name, j, -1) != v.name for j in labs if j is not None):
            raise StampError(f"input %{v.name} is named for one layer but used by several places ({sorted(map(str, labs))})")

    new = Graph(graph.name)
    new.meta = {k: copy.deepcopy(v) for k, v in graph.meta.items() if k not in ("layer_groups", "effect_order")}
    entries: list[tuple[Value, int | None, int | None]] = [(v, None, None) for v in graph.inputs if v not in owner]
    for L, j in enumerate(plan):
        entries += [(v, j, L) for v in graph.inputs if owner.get(v) == j]
    kinds = ("input", "param", "state")
    entries.sort(key=lambda e: kinds.index(e[0].kind))
    vmap: dict[Value, Value] = {}
    per_layer: dict[int, dict[Value, Value]] = {L: {} for L in range(len(plan))}
    origin: dict[str, tuple[str, int, int]] = {}
    for v, j, L in entries:
        if j is None:
            vmap[v] = new.add_input(v.name, v.type, v.kind)
        else:
            assert L is not None
            nv = new.add_input(rename(v.name, j, L), v.type, v.kind)
            per_layer[L][v] = nv
            origin[nv.name] = (v.name, j, L)

    def copy_node(node: Node, m: dict[Value, Value], names: list[str], scope: str) -> None:
        ins = [None if v is None else m[v] for v in node.inputs]
        out = new.make_node(node.op, ins, copy.deepcopy(node.attrs), [v.type for v in node.outputs], names, scope)
        new.append(out)
        m.update(zip(node.outputs, out.outputs))

    for node in prelude:
        copy_node(node, vmap, [v.name for v in node.outputs], node.scope)
    current = vmap[chain[0]]
    for L, j in enumerate(plan):
        m = {**vmap, **per_layer[L], chain[j]: current}
        counts: dict[str, int] = {}
        scope_re = re.compile(rf"^layers\.{j}(?=\.|$)")
        for node in layers[j].nodes:
            names = []
            if node.outputs:  # 'rms_norm_7' -> 'rms_norm.l5', 'rms_norm_1.l5', ...; 'split_3.1' -> 'split.1.l5'
                base = re.sub(r"_\d+$", "", node.outputs[0].name.split(".")[0])
                k = counts[base] = counts.get(base, -1) + 1
                parts = [v.name[len(v.name.split(".")[0]):] for v in node.outputs]
                names = [f"{base}{f'_{k}' if k else ''}{part}.l{L}" for part in parts]
            copy_node(node, m, names, scope_re.sub(f"layers.{L}", node.scope))
        current = m[chain[j + 1]]
    m = {**vmap, chain[-1]: current}
    for node in epilogue:
        copy_node(node, m, [v.name for v in node.outputs], node.scope)
    new.outputs = [m[v] for v in graph.outputs]
    return new, origin


# ---- the reference model: trace a layer pair per kind, stamp the rest ---------------------------------
def _layer_kind(cfg: Any, layer: int) -> tuple[Any, ...]:
    from m3c.model_defs.kv_cache import layer_cached_tensors

    return cfg.is_sparse(layer), cfg.qkv_split_sizes(layer), tuple(layer_cached_tensors(cfg, layer))


def _module_fingerprint(layer: nn.Module) -> tuple[Any, ...]:
    bufs = tuple((n, tuple(b.shape), b.dtype) for n, b in layer.named_buffers())
    params = tuple((n, tuple(p.shape), p.dtype) for n, p in layer.named_parameters())
    return bufs, params, tuple((n, type(m).__qualname__) for n, m in layer.named_modules())


def capture_m3_stamped(cfg: Any, model: nn.Module | None = None) -> Capture | None:
    """The reference M3 model of `cfg`, tracing two layers per distinct layer kind (on meta) and stamping.

    Layers count as one kind when their config (sparse or dense, projection split, cached tensors)
    and their modules (buffers, shapes, dtypes, classes) agree; the two traced copies of each kind
    must then come out identical (:func:`layer_groups`). Returns None when any check fails (the
    caller traces the whole model). `model` (meta by default) is only inspected, never run.
    """
    from m3c.frontend.capture import Capture, annotate_graph, capture, graph_name, m3_dynamic_shapes, m3_example_inputs
    from m3c.model_defs.minimax_m3 import MiniMaxM3ForCausalLM

    t0 = time.perf_counter()
    kinds = [_layer_kind(cfg, i) for i in range(cfg.num_hidden_layers)]
    distinct = list(dict.fromkeys(kinds))
    small_kinds = [k for k in distinct for _ in range(2)]
    small_cfg = cfg.replace(num_hidden_layers=len(small_kinds),
                            sparse_layers=tuple(i for i, k in enumerate(small_kinds) if k[0]))
    if [_layer_kind(small_cfg, i) for i in range(len(small_kinds))] != small_kinds:
        return None
    full = model if model is not None else MiniMaxM3ForCausalLM(cfg, device="meta")
    small = MiniMaxM3ForCausalLM(small_cfg, device="meta")
    plan = [2 * distinct.index(k) + 1 for k in kinds]
    if any(_module_fingerprint(full.layers[i]) != _module_fingerprint(small.layers[j]) for i, j in enumerate(plan)):
        return None
    args = m3_example_inputs(small_cfg, "meta")
    cap = capture(small, args, m3_dynamic_shapes(args[-1]), name=graph_name(cfg))
    groups = [set(g) for g in layer_groups(cap.graph)]
    if not all(any({2 * i, 2 * i + 1} <= g for g in groups) for i in range(len(distinct))):
        return None
    graph, origin = stamp_layers(cap.graph, plan)
    bindings = {v.name: cap.bindings[origin[v.name][0]].relayer(*origin[v.name][1:]) if v.name in origin
                else cap.bindings[v.name] for v in graph.inputs}
    annotate_graph(graph)
    report = replace(cap.report, ir_nodes=len(graph.nodes), op_counts=graph.op_counts(),
                     stamped=f"traced {len(small_kinds)} layers ({len(distinct)} kind(s) x 2, checked identical), "
                             f"stamped {len(plan)} layers from layers {sorted(set(plan))}")
    report.convert_s = time.perf_counter() - t0 - report.export_s
    return Capture(graph, report, bindings, cap.constants)
