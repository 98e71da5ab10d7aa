"""``torch.compile(model, backend="m3c")``: the Dynamo door into the same capture, pipeline and runtime.

Registered through the ``torch_dynamo_backends`` entry point (pyproject.toml), so
``torch._dynamo.list_backends()`` lists ``m3c``. For each graph Dynamo hands over:

1. **Re-rooting.** Dynamo passes a module's buffers and parameters as graph inputs. They become
   buffers again, at their module paths (``layers.0.self_attn.qkv_proj.weight``), and user inputs
   get their argument names back (``input_ids``, ``kv_caches_0_k_data``), so the frontend sees the
   model as :func:`m3c.frontend.capture.capture_m3` would: quantized weights stay whole, caches
   become ``kv.<layer>.<name>`` state.
2. **Capture** with ``torch.export``, dims Dynamo made dynamic (``mark_dynamic`` or
   ``dynamic=True``) exported as dynamic, so one compile serves every token count. This happens on
   the first call (outside Dynamo's tracing), once per Dynamo graph.
3. **Passes and lowering** for the cpu target; the program runs on the IR interpreter with the
   current weights bound on every call (so in-place weight updates are seen).
4. **Fallback regions.** Maximal runs of consecutive ``fallback`` nodes (ATen ops the IR has no op
   for) are rebuilt as FX graphs and compiled by TorchInductor, so unknown models still run.

:data:`COUNTERS` counts graphs received, m3c compiles, calls, and Inductor region compiles/calls.
"""

from __future__ import annotations

import contextlib
import operator
import re
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn

from m3c.backends import CompileOptions, Program, lower
from m3c.errors import CompileError
from m3c.ir.graph import Graph, Node, Value
from m3c.ir.interpreter import bind_symbols
from m3c.ir.ops.core import _fill_template, _resolve_aten
from m3c.ir.registry import get_op
from m3c.ir.types import eval_dim, parse_dim

COUNTERS: Counter[str] = Counter()
"""``graphs`` (handed over by Dynamo), ``compiles`` (m3c captures), ``calls``, ``inductor_compiles``
(fallback regions compiled by Inductor), ``inductor_calls`` (fallback regions run)."""

_WEIGHT = re.compile(r"^[LG]\[[^\]]+\]((?:\._modules\['[^']+'\])*)\._(?:buffers|parameters)\['([^']+)'\]$")


def m3c_backend(gm: fx.GraphModule, example_inputs: Sequence[Any], options: Mapping[str, Any] | None = None
                ) -> Callable[..., Any]:
    """The Dynamo backend: returns a callable that compiles `gm` with m3c on its first call, then runs it.

    ``options`` (``torch.compile(..., options={...})``) are CompileOptions fields, e.g. ``verify_each``.
    """
    COUNTERS["graphs"] += 1
    return DynamoGraph(gm, CompileOptions(**dict(options or {})))


@dataclass
class _Region:
    """A run of fallback nodes [start, end) compiled by Inductor: operands in, results out."""

    start: int
    end: int
    inputs: list[Value]
    outputs: list[Value]
    fn: Callable[..., Any]


@dataclass
class _Variant:
    """One m3c compile of a Dynamo graph, for one pattern of equal dynamic sizes."""

    root: fx.GraphModule
    capture: Any
    program: Program
    regions: dict[int, _Region]


class DynamoGraph:
    """One Dynamo graph compiled by m3c (lazily, on the first call, with that call's arguments).

    Dynamo gives every dynamic dim its own symbol, but the IR must know that, say, ``input_ids``
    and ``slot_mapping`` have the same length. So dynamic dims of equal size at compile time share
    one export ``Dim`` (duck sizing, as Dynamo does by default); a call whose pattern of equal
    sizes differs compiles another variant, never a per-length one.
    """

    def __init__(self, gm: fx.GraphModule, options: CompileOptions) -> None:
        self.gm, self.options = gm, options
        # what Dynamo knows about each input, read now: it drops the node metadata after compiling
        self.placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        self.sources = [_source_name(n) for n in self.placeholders]
        self.weights: list[tuple[int, str]] = []  # (argument index, module path)
        self.user: list[int] = []  # argument indices that stay arguments
        self.sizes: dict[int, tuple[str, str, int]] = {}  # SymInt arguments: tensor sizes, recomputed in the graph
        for i, node in enumerate(self.placeholders):
            path = _weight_path(self.sources[i])
            size = _size_of(node) if isinstance(node.meta.get("example_value"), torch.SymInt) else None
            if path is not None:
                self.weights.append((i, path))
            elif size is not None:
                self.sizes[i] = size
            else:
                self.user.append(i)
        self.dynamic = [(i, d) for i in self.user for d in _dynamic_dims(self.placeholders[i])]
        out = next(n for n in gm.graph.nodes if n.op == "output")
        self.returns_tuple = isinstance(out.args[0], (tuple, list))
        self.variants: dict[tuple[int, ...], _Variant] = {}

    def _pattern(self, args: tuple[Any, ...]) -> tuple[int, ...]:
        """Which dynamic dims are equal: each dim's index among the distinct sizes, in order of appearance."""
        sizes = [int(args[i].shape[d]) for i, d in self.dynamic]
        first = {s: k for k, s in reversed(list(enumerate(sizes)))}
        return tuple(first[s] for s in sizes)

    # ---- compile ---------------------------------------------------------------------------
    def _compile(self, args: tuple[Any, ...], pattern: tuple[int, ...]) -> _Variant:
        from torch.export import Dim

        from m3c.compiler import run_passes
        from m3c.frontend.capture import capture

        COUNTERS["compiles"] += 1
        root = _rerooted(self.gm, self.placeholders, self.sources, self.weights, self.user, self.sizes, args)
        dims = {k: Dim(f"D{k}") for k in sorted(set(pattern))}
        spec: dict[int, dict[int, Any]] = {}
        for (i, d), k in zip(self.dynamic, pattern):
            spec.setdefault(i, {})[d] = dims[k]
        user_args = tuple(_example(args[i]) for i in self.user)
        cap = capture(root, user_args, dynamic_shapes=tuple(spec.get(i) for i in self.user), name="dynamo")
        graph = cap.graph
        run_passes(graph, self.options, _context(self.options))
        bound = cap.bind(root, *user_args)
        program = lower(graph, self.options, {v.name: bound[v.name] for v in graph.inputs if v.kind == "param"})
        return _Variant(root, cap, program, {r.start: r for r in _inductor_regions(graph)})

    # ---- run -------------------------------------------------------------------------------
    def __call__(self, *args: Any) -> Any:
        pattern = self._pattern(args)
        variant = self.variants.get(pattern)
        if variant is None:
            variant = self.variants[pattern] = self._compile(args, pattern)
        COUNTERS["calls"] += 1
        for i, path in self.weights:  # the current weights (parameters may have been replaced)
            if _get(variant.root, path) is not args[i]:
                _set(variant.root, path, args[i])
        inputs = variant.capture.bind(variant.root, *(args[i] for i in self.user))
        device = next((a.device for a in args if isinstance(a, torch.Tensor)), torch.device("cpu"))
        on_device = contextlib.nullcontext() if device.type == "cpu" else device  # where the graph makes tensors
        with torch.no_grad(), on_device:
            outs = _execute(variant.program.graph, inputs, variant.regions)
        return tuple(outs) if self.returns_tuple else outs[0]


def _context(options: CompileOptions) -> Any:
    from m3c.passes.manager import PassContext

    return PassContext(verify_each=options.verify_each)


# ---- re-rooting --------------------------------------------------------------------------------
def _source_name(node: fx.Node) -> str:
    arg = node.meta.get("grapharg")
    source = getattr(arg, "source", None)
    name = getattr(source, "name", None)
    return (name() if callable(name) else name) or node.name


def _weight_path(source: str) -> str | None:
    """``layers.0.mlp.w2.weight`` for a placeholder that Dynamo lifted from a module buffer or parameter."""
    m = _WEIGHT.match(source)
    if not m:
        return None
    mods = re.findall(r"\['([^']+)'\]", m.group(1))
    return ".".join([*mods, m.group(2)])


def _arg_name(source: str, used: set[str]) -> str:
    """A plain argument name from Dynamo's source (``L['kv_caches'][0]['k_data']`` -> ``kv_caches_0_k_data``)."""
    name = re.sub(r"^[LG]\[", "", source)
    name = re.sub(r"\W+", "_", name).strip("_") or "arg"
    if name[0].isdigit():
        name = f"arg_{name}"
    base, k = name, 1
    while name in used:
        k += 1
        name = f"{base}_{k}"
    used.add(name)
    return name


def _get(root: nn.Module, path: str) -> Any:
    mod_path, _, attr = path.rpartition(".")
    return getattr(root.get_submodule(mod_path) if mod_path else root, attr)


def _set(root: nn.Module, path: str, value: Any) -> None:
    """Put `value` at `path`, creating empty submodules on the way (tensors become buffers)."""
    mod: nn.Module = root
    *mods, attr = path.split(".")
    for m in mods:
        if not hasattr(mod, m):
            mod.add_module(m, nn.Module())
        mod = getattr(mod, m)
    if isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter):
        if attr in mod._buffers:
            mod._buffers[attr] = value
        else:
            mod.register_buffer(attr, value)
    else:
        setattr(mod, attr, value)


def _size_of(node: fx.Node) -> tuple[str, str, int] | None:
    """(tensor source name, 'size' | 'stride', dim) for a SymInt placeholder Dynamo lifted from a tensor's size."""
    source = getattr(node.meta.get("grapharg"), "source", None)
    base, prop, idx = (getattr(source, a, None) for a in ("base", "prop", "idx"))
    kind = getattr(prop, "name", "").lower()
    if base is None or kind not in ("size", "stride") or not isinstance(idx, int):
        return None
    name = getattr(base, "name", None)
    return (name() if callable(name) else name), kind, idx


def _rerooted(gm: fx.GraphModule, placeholders: list[fx.Node], sources: list[str], weights: list[tuple[int, str]],
              user: list[int], sizes: dict[int, tuple[str, str, int]], args: tuple[Any, ...]) -> fx.GraphModule:
    """`gm` with lifted weights as buffers at their module paths, user placeholders named after their source,
    and lifted sizes recomputed from their tensors (torch.export then sees them as symbolic sizes)."""
    root = nn.Module()
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    path_of = dict(weights)
    used: set[str] = set()
    for i in user:
        env[placeholders[i]] = graph.placeholder(_arg_name(sources[i], used))
    for i, path in weights:
        _set(root, path, args[i].detach() if isinstance(args[i], nn.Parameter) else args[i])
        env[placeholders[i]] = graph.get_attr(path)
    by_source = {sources[i]: env[placeholders[i]] for i in (*user, *path_of)}
    for i, (source, kind, dim) in sizes.items():
        if source not in by_source:
            raise CompileError(f"Dynamo graph input {placeholders[i].name} is a {kind} of {source}, which is not "
                               "an input of the graph; m3c cannot recompute it")
        fn = torch.ops.aten.sym_size.int if kind == "size" else torch.ops.aten.sym_stride.int
        env[placeholders[i]] = graph.call_function(fn, (by_source[source], dim))
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            if node not in env:
                raise CompileError(f"Dynamo graph input {node.name} ({sources[placeholders.index(node)]}) is neither a tensor, a "
                                   "weight nor a tensor size; m3c's Dynamo backend cannot take it")
            continue
        if node.op == "get_attr":
            _set(root, node.target, _get(gm, node.target))
        elif node.op == "call_module":
            _set(root, node.target, gm.get_submodule(node.target))
        env[node] = graph.node_copy(node, lambda n: env[n])
    out = fx.GraphModule(root, graph, class_name="M3CDynamoGraph")
    return out


def _example(x: Any) -> Any:
    """An export example: a fresh tensor object (export must not touch Dynamo's), a plain int for a SymInt."""
    if isinstance(x, torch.Tensor):
        return x.detach()
    if isinstance(x, torch.SymInt):
        return int(x.node.hint)
    return x


def _dynamic_dims(node: fx.Node) -> list[int]:
    """The dims of a tensor placeholder that Dynamo traced as symbols (mark_dynamic, dynamic=True)."""
    val = node.meta.get("example_value")
    if not isinstance(val, torch.Tensor):
        return []
    return [d for d, s in enumerate(val.shape) if isinstance(s, torch.SymInt)]


# ---- fallback regions -> Inductor ----------------------------------------------------------------
def _inductor_regions(graph: Graph) -> list[_Region]:
    """Every maximal run of consecutive fallback nodes, compiled by Inductor."""
    nodes, out = graph.nodes, []
    later_uses: dict[Value, int] = {}
    for j, node in enumerate(nodes):
        for v in node.inputs:
            if v is not None:
                later_uses[v] = j
    for v in graph.outputs:
        later_uses[v] = len(nodes)
    i = 0
    while i < len(nodes):
        if nodes[i].op != "fallback":
            i += 1
            continue
        j = i
        while j < len(nodes) and nodes[j].op == "fallback":
            j += 1
        run = nodes[i:j]
        defined = {v for n in run for v in n.outputs}
        inputs = list(dict.fromkeys(v for n in run for v in n.inputs if v is not None and v not in defined))
        outputs = [v for n in run for v in n.outputs if later_uses.get(v, -1) >= j]
        out.append(_Region(i, j, inputs, outputs, _compile_region(run, inputs, outputs)))
        i = j
    return out


def _compile_region(run: list[Node], inputs: list[Value], outputs: list[Value]) -> Callable[..., Any]:
    """An FX graph of the run's ATen calls, wrapped in torch.compile with the (counting) Inductor backend."""
    g = fx.Graph()
    env: dict[Value, Any] = {v: g.placeholder(f"in{k}") for k, v in enumerate(inputs)}
    for node in run:
        op = _resolve_aten(node.attrs["target"])
        call = _fill_template(node.attrs["args"], [env[v] for v in node.inputs])
        result = g.call_function(op, tuple(call["args"]), call["kwargs"])
        returns = op._schema.returns
        if len(returns) == 1 and not str(returns[0].type).startswith("List"):
            env[node.outputs[0]] = result
        else:
            for k, v in enumerate(node.outputs):
                env[v] = g.call_function(operator.getitem, (result, k))
    g.output(tuple(env[v] for v in outputs))
    compiled = torch.compile(fx.GraphModule(nn.Module(), g), backend=_counting_inductor)

    def run_region(*xs: Any) -> Any:
        COUNTERS["inductor_calls"] += 1
        return compiled(*xs)

    return run_region


def _counting_inductor(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
    from torch._inductor.compile_fx import compile_fx

    COUNTERS["inductor_compiles"] += 1
    return compile_fx(gm, list(example_inputs))


def _execute(graph: Graph, inputs: Mapping[str, Any], regions: Mapping[int, _Region]) -> list[Any]:
    """The IR interpreter's loop, with Inductor-compiled regions standing in for runs of fallback nodes."""
    if not regions:
        from m3c.ir.interpreter import interpret

        return interpret(graph, inputs)
    bindings = bind_symbols(graph, inputs)
    env: dict[Value, Any] = {v: inputs[v.name] for v in graph.inputs}
    nodes, i = graph.nodes, 0
    while i < len(nodes):
        region = regions.get(i)
        if region is not None:
            env.update(zip(region.outputs, region.fn(*(env[v] for v in region.inputs))))
            i = region.end
            continue
        node = nodes[i]
        op = get_op(node.op)
        attrs = op.full_attrs(node.attrs)
        for name in op.dim_attrs:
            attrs[name] = _bind_dims(attrs[name], bindings)
        out = op.reference(*(None if v is None else env[v] for v in node.inputs), **attrs)
        if node.outputs:
            env.update(zip(node.outputs, out if isinstance(out, (tuple, list)) else [out]))
        i += 1
    return [env[v] for v in graph.outputs]


def _bind_dims(value: Any, bindings: dict[str, int]) -> Any:
    if isinstance(value, list):
        return [_bind_dims(v, bindings) for v in value]
    return eval_dim(parse_dim(value), bindings) if isinstance(value, str) else value
