"""torch → IR capture: ``torch.export`` the model, walk the functional ATen graph, emit an IR Graph.

Graph inputs: user tensors keep their argument names (kind ``input``); buffers, parameters and
lifted constants become ``param`` inputs named by their module path; mutated user inputs (KV
caches) become ``state``. Quantized values stay whole: the ``weight`` / ``weight_scale`` /
``weight_scale_2`` buffers a QuantLinear hands to the m3c dequantize / grouped_gemm ops become
one ``nvfp4`` / ``mxfp8`` param named by the module (``layers.0.self_attn.qkv_proj``) with the
logical shape; an nvfp4 cache's ``<name>_data`` / ``<name>_scale`` pair becomes one nvfp4 state
``kv.<layer>.<name>``; an fp8 cache is an fp8e4m3 state plus its ``f32[]`` scale state.

The exported graph's ``auto_functionalized_v2(m3c.paged_write)`` calls become IR ``paged_write``
effects on the state inputs (an nvfp4 data/scale pair is one write) and its mutated-input outputs
are dropped. Symbolic sizes become named dims (the names of the ``torch.export.Dim`` s given).
:class:`Capture` keeps what :meth:`Capture.bind` needs to turn a model and real call arguments
into interpreter inputs. :func:`capture_m3` captures the reference model with its dims
``T`` (tokens), ``R`` (requests), ``MB`` (block-table width) and ``NB`` (cache blocks).
"""

from __future__ import annotations

import operator
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import sympy
import torch
from torch import fx, nn
from torch.export import Dim
from torch.export.graph_signature import InputKind, OutputKind
from torch.utils import _pytree as pytree

from m3c.frontend.aten_table import (
    DROP,
    CaptureError,
    QuantPart,
    fallback_template,
    lookup,
    plain_dim,
    quant_weight_args,
    target_name,
)
from m3c.ir.graph import Graph, Node, Value
from m3c.ir.ops.infer import dims_equal
from m3c.ir.registry import IRTypeError
from m3c.ir.types import DType, TensorType, sym
from m3c.model_defs import quant

Path = tuple[Any, ...]


# ---- results -----------------------------------------------------------------------------------
@dataclass
class FallbackUse:
    """An op the table could not map, how often it occurs, and why."""

    target: str
    count: int = 0
    reasons: list[str] = field(default_factory=list)


@dataclass
class CaptureReport:
    """What the capture did: fallbacks (never silent), node counts and time taken."""

    fallbacks: list[FallbackUse] = field(default_factory=list)
    fx_nodes: int = 0
    ir_nodes: int = 0
    op_counts: dict[str, int] = field(default_factory=dict)
    dropped: int = 0  # FX nodes with no IR node of their own (asserts, no-op copies, sizes)
    export_s: float = 0.0
    convert_s: float = 0.0
    stamped: str = ""  # how the graph was stamped from traced layers, if it was

    @property
    def total_s(self) -> float:
        """Seconds for export plus conversion."""
        return self.export_s + self.convert_s

    @property
    def fallback_count(self) -> int:
        """Number of IR fallback nodes."""
        return sum(f.count for f in self.fallbacks)

    def __str__(self) -> str:
        lines = [f"captured {self.fx_nodes} FX nodes into {self.ir_nodes} IR nodes in {self.total_s:.2f} s "
                 f"(export {self.export_s:.2f} s, convert {self.convert_s:.2f} s)"]
        lines += [f"stamped: {self.stamped}"] * bool(self.stamped) + ["fallbacks: none"] * (not self.fallbacks)
        lines += [f"fallback {f.target} x{f.count}: {'; '.join(f.reasons)}" for f in self.fallbacks]
        return "\n".join(lines)


@dataclass(frozen=True)
class InputBinding:
    """Where an IR input's run-time value comes from.

    ``source`` is ``arg`` (refs are paths into the call arguments), ``attr`` (refs are the model's
    buffer or parameter names) or ``const`` (refs name lifted constants kept by the capture);
    ``pack`` is ``plain`` (one tensor) or ``nvfp4`` / ``mxfp8`` (refs are data, scale[, global scale]).
    """

    source: str
    refs: tuple[Any, ...]
    pack: str = "plain"

    def relayer(self, src: int, dst: int) -> InputBinding:
        """The same binding for decoder layer `dst` instead of `src` (module paths and cache list index)."""
        refs = []
        for r in self.refs:
            if isinstance(r, str):
                r = re.sub(rf"^layers\.{src}\.", f"layers.{dst}.", r)
            elif len(r) >= 2 and r[1] == src:
                r = (r[0], dst, *r[2:])
            refs.append(r)
        return replace(self, refs=tuple(refs))


@dataclass
class Capture:
    """A captured IR graph, its report, and the recipe that binds run-time values to its inputs."""

    graph: Graph
    report: CaptureReport
    bindings: dict[str, InputBinding]
    constants: dict[str, torch.Tensor] = field(default_factory=dict)

    def bind(self, model: nn.Module, *args: Any) -> dict[str, Any]:
        """Interpreter inputs by IR input name for `model` called with `args` (quantized ones packed)."""
        out: dict[str, Any] = {}
        for v in self.graph.inputs:
            b = self.bindings[v.name]
            parts = [self._fetch(model, args, b.source, r) for r in b.refs]
            if b.pack == "nvfp4":
                out[v.name] = quant.NVFP4Tensor(parts[0], parts[1], parts[2] if len(parts) > 2 else None)
            elif b.pack == "mxfp8":
                out[v.name] = quant.MXFP8Tensor(parts[0], parts[1])
            else:
                out[v.name] = parts[0]
        return out

    def _fetch(self, model: nn.Module, args: tuple[Any, ...], source: str, ref: Any) -> torch.Tensor:
        if source == "arg":
            x: Any = args
            for key in ref:
                x = x[key]
            return x
        if source == "const":
            return self.constants[ref]
        try:
            return model.get_buffer(ref)
        except AttributeError:
            return model.get_parameter(ref).detach()


# ---- the capture ---------------------------------------------------------------------------------
def capture(model: nn.Module, example_args: tuple[Any, ...], dynamic_shapes: Any = None, name: str = "main") -> Capture:
    """Export `model` on `example_args` (torch.export dynamic_shapes welcome) and convert it to IR."""
    t0 = time.perf_counter()
    ep = torch.export.export(model, tuple(example_args), dynamic_shapes=dynamic_shapes)
    ep = ep.run_decompositions({})
    t1 = time.perf_counter()
    names = _dim_names(model, tuple(example_args), dynamic_shapes)
    cap = _Converter(ep, tuple(example_args), names, name).run()
    cap.report.export_s, cap.report.convert_s = t1 - t0, time.perf_counter() - t1
    return cap


@dataclass
class _Written:
    """An auto_functionalized write: getitem i >= 1 is base i - 1 after the write (the state itself)."""

    bases: list[Any]


_PARAM_KINDS = (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR)
_MUTATIONS = (OutputKind.USER_INPUT_MUTATION, OutputKind.BUFFER_MUTATION)
_Entry = tuple[str, TensorType, InputBinding, list[tuple[fx.Node, str]]]  # name, type, binding, (FX input, piece)


class _Converter:
    """One walk over an ExportedProgram's graph (see the module docstring)."""

    def __init__(self, ep: torch.export.ExportedProgram, args: tuple[Any, ...], dim_names: dict[Path, dict[int, str]],
                 name: str) -> None:
        self.ep, self.args, self.dim_names = ep, args, dim_names
        self.graph = Graph(name)
        self.env: dict[fx.Node, Any] = {}
        self.bindings: dict[str, InputBinding] = {}
        self.constants: dict[str, torch.Tensor] = {}
        self.report = CaptureReport()
        self.sym_map: dict[sympy.Symbol, sympy.Expr] = {}
        self.writes: dict[tuple[Value, Value], tuple[Value, set[str]]] = {}
        self.written: set[Value] = set()
        self._fx: fx.Node | None = None
        self._emitted: list[Node] = []
        self._fallbacks: dict[str, FallbackUse] = {}

    # ---- the Lowerer protocol the table's rules use ----
    @property
    def meta(self) -> Any:
        assert self._fx is not None
        return self._fx.meta.get("val")

    def emit(self, op: str, inputs: Sequence[Value | None], attrs: dict[str, Any] | None = None) -> list[Value]:
        fxn = self._fx
        assert fxn is not None
        typed = self.graph.new_node(op, inputs, attrs)  # infers the output types (its value names are dropped)
        n = len(typed.outputs)
        names = [fxn.name] if n == 1 else [f"{fxn.name}.{i}" for i in range(n)]
        node = self.graph.append(self.graph.make_node(op, typed.inputs, typed.attrs, [v.type for v in typed.outputs],
                                                      names, _scope(fxn)))
        self._emitted.append(node)
        return node.outputs

    # ---- driver ----
    def run(self) -> Capture:
        self._inputs()
        for node in self.ep.graph.nodes:
            if node.op == "call_function":
                self.report.fx_nodes += 1
                self._fx, self._emitted = node, []
                self._call(node)
            elif node.op == "output":
                self._outputs(node)
            elif node.op != "placeholder":
                raise CaptureError(f"FX node {node.name}: unsupported node kind {node.op!r}")
        for (q, cache), (_, parts) in self.writes.items():
            if parts != {"data", "scale"}:
                raise CaptureError(f"the nvfp4 write of %{q.name} into %{cache.name} stores only {sorted(parts)}; "
                                   "the data and the scale must both be written")
        self.report.fallbacks = sorted(self._fallbacks.values(), key=lambda f: f.target)
        self.report.ir_nodes = len(self.graph.nodes)
        self.report.op_counts = self.graph.op_counts()
        annotate_graph(self.graph)
        return Capture(self.graph, self.report, self.bindings, self.constants)

    # ---- inputs ----
    def _inputs(self) -> None:
        sig = self.ep.graph_signature
        specs = {s.arg.name: s for s in sig.input_specs if hasattr(s.arg, "name")}
        leaves = [(tuple(_key(k) for k in path), leaf) for path, leaf in pytree.tree_flatten_with_path(self.args)[0]]
        user = [s for s in sig.input_specs if s.kind == InputKind.USER_INPUT]
        if len(user) != len(leaves):
            raise CaptureError(f"export has {len(user)} user inputs but the arguments flatten to {len(leaves)} leaves")
        paths = {s.arg.name: p for s, (p, _) in zip(user, leaves)}
        mutated = {s.target for s in sig.output_specs if s.kind in _MUTATIONS}
        placeholders = [n for n in self.ep.graph.nodes if n.op == "placeholder"]
        self._name_dims(placeholders, paths)
        groups = self._quant_groups(placeholders, specs)
        pending: dict[str, list[_Entry]] = {"input": [], "param": [], "state": []}
        byname = {n.name: n for n in placeholders}
        states = {n for n in placeholders if n.name in paths and (n.name in mutated or (  # or an fp8 cache's scale
            n.name.endswith("_scale") and re.sub("_scale$", "_data", n.name) in mutated))}
        done: set[fx.Node] = set()
        for ph in placeholders:
            if ph in done or not isinstance(ph.meta.get("val"), torch.Tensor):
                continue
            spec = specs[ph.name]
            if ph in groups:
                fmt, pieces = groups[ph]
                fqns = tuple(specs[p.name].target for p in pieces)
                vname = fqns[0][: -len(".weight")] if fqns[0].endswith(".weight") else f"{fqns[0]}.q"
                pending["param"].append((vname, self._qtype(fmt, ph), InputBinding("attr", fqns, fmt),
                                         list(zip(pieces, ["data", "scale", "global_scale"]))))
                done.update(pieces)
            elif ph in states:
                pending["state"] += self._state(ph, byname, paths, done)
            elif spec.kind == InputKind.USER_INPUT:
                pending["input"].append((ph.name, self._type(ph.meta["val"]), InputBinding("arg", (paths[ph.name],)),
                                         [(ph, "")]))
            elif spec.kind in _PARAM_KINDS and ph.users:
                if spec.target in mutated:
                    raise CaptureError(f"buffer {spec.target} is updated in place; only KV caches passed as "
                                       "arguments may be (written through m3c.paged_write)")
                source = "const" if spec.kind == InputKind.CONSTANT_TENSOR else "attr"
                if source == "const":
                    self.constants[spec.target] = self.ep.constants[spec.target]
                pending["param"].append((spec.target, self._type(ph.meta["val"]), InputBinding(source, (spec.target,)),
                                         [(ph, "")]))
        for kind in ("input", "param", "state"):
            for vname, t, binding, pieces in pending[kind]:
                v = self.graph.add_input(vname, t, kind)
                self.bindings[vname] = binding
                for ph, part in pieces:
                    self.env[ph] = QuantPart(v, part) if part else v

    def _state(self, ph: fx.Node, byname: dict[str, fx.Node], paths: dict[str, Path], done: set[fx.Node]
               ) -> list[_Entry]:
        """One state (an nvfp4 data/scale pair becomes one value; an fp8 cache's scale is its own f32[] state)."""
        base = re.sub(r"_(data|scale)$", "", ph.name)
        data, scale = byname.get(f"{base}_data"), byname.get(f"{base}_scale")
        if data is not None and scale is not None and data.meta["val"].dtype == torch.uint8 and \
                scale.meta["val"].dtype == torch.float8_e4m3fn and data not in done:
            done.update((data, scale))
            return [(_state_name(base), self._qtype("nvfp4", data),
                     InputBinding("arg", (paths[data.name], paths[scale.name]), "nvfp4"), [(data, "data"), (scale, "scale")])]
        done.add(ph)
        name = _state_name(base if ph.name.endswith("_data") else ph.name)
        return [(name, self._type(ph.meta["val"]), InputBinding("arg", (paths[ph.name],)), [(ph, "")])]

    def _quant_groups(self, placeholders: list[fx.Node], specs: dict[str, Any]
                      ) -> dict[fx.Node, tuple[str, tuple[fx.Node, ...]]]:
        """Stored quantized weights: data placeholder -> (format, (data, scale[, global scale]) placeholders)."""
        groups: dict[fx.Node, tuple[str, tuple[fx.Node, ...]]] = {}
        for node in self.ep.graph.nodes:
            found = quant_weight_args(node.target, node.args) if node.op == "call_function" else None
            if found is None:
                continue
            fmt, pieces = found
            pieces = tuple(p for p in pieces if p is not None)
            if not all(isinstance(p, fx.Node) and p.op == "placeholder" and specs[p.name].kind in _PARAM_KINDS
                       for p in pieces):
                raise CaptureError(f"FX node {node.name}: the {fmt} weight pieces must be model buffers or parameters")
            if groups.setdefault(pieces[0], (fmt, pieces)) != (fmt, pieces):
                raise CaptureError(f"FX node {node.name}: weight {pieces[0].name} is used with different pieces")
        for fmt, pieces in groups.values():
            for p in pieces:
                for user in p.users:
                    found = quant_weight_args(user.target, user.args) if user.op == "call_function" else None
                    if found is None or tuple(x for x in found[1] if x is not None) != pieces:
                        raise CaptureError(f"{specs[p.name].target} (a piece of a {fmt} weight) is used directly by "
                                           f"FX node {user.name}; m3c keeps quantized weights whole")
        return groups

    def _qtype(self, fmt: str, data: fx.Node) -> TensorType:
        t = self._type(data.meta["val"])
        shape = (*t.shape[:-1], t.shape[-1] * 2) if fmt == "nvfp4" else t.shape
        return TensorType(DType(fmt), shape)

    # ---- symbolic dims ----
    def _name_dims(self, placeholders: list[fx.Node], paths: dict[str, Path]) -> None:
        for ph in placeholders:
            val = ph.meta.get("val")
            for d, dname in self.dim_names.get(paths.get(ph.name, ()), {}).items():
                if isinstance(val, torch.Tensor) and isinstance(val.shape[d], torch.SymInt):
                    expr = val.shape[d].node.expr
                    if isinstance(expr, sympy.Symbol):
                        self.sym_map[expr] = sym(dname)

    def _dim(self, s: Any) -> Any:
        """An IR dim (int or expression over named symbols) from an int or SymInt."""
        if isinstance(s, int):
            return s
        expr = plain_dim(sympy.sympify(s.node.expr))
        for x in expr.free_symbols:
            self.sym_map.setdefault(x, sym(str(x)))
        expr = expr.xreplace(self.sym_map)
        return int(expr) if expr.is_Integer else expr

    def _type(self, t: torch.Tensor) -> TensorType:
        return TensorType(DType.from_torch(t.dtype), tuple(self._dim(s) for s in t.shape))

    # ---- nodes ----
    def _arg(self, a: Any) -> Any:
        if isinstance(a, fx.Node):
            if a not in self.env:
                raise CaptureError(f"FX node {a.name} is used but has no IR value (an unused parameter?)")
            return self.env[a]
        if isinstance(a, (list, tuple)):
            return type(a)(self._arg(x) for x in a)
        if isinstance(a, torch.SymInt):
            return self._dim(a)
        return a

    def _call(self, node: fx.Node) -> None:
        val = node.meta.get("val")
        if node.target is operator.getitem:
            base, idx = self.env[node.args[0]], node.args[1]
            self.env[node] = (base.bases[idx - 1] if idx else None) if isinstance(base, _Written) else base[idx]
            self.report.dropped += 1
            return
        if isinstance(val, (torch.SymInt, torch.SymBool, torch.SymFloat, int, float, bool)):
            self.env[node] = self._dim(val) if isinstance(val, (torch.SymInt, int)) else None
            self.report.dropped += 1
            return
        if node.target is torch.ops.higher_order.auto_functionalized_v2:
            self._write(node)
            return
        args, kwargs = self._arg(node.args), {k: self._arg(v) for k, v in node.kwargs.items()}
        rule, reason = lookup(node.target), "no table entry"
        if rule is not None:
            try:
                out = rule.convert(self, args, kwargs)
            except IRTypeError as e:
                out, reason = None, f"IR type error: {e}"
            if out is not None and (mismatch := self._mismatch(out, val)):
                out, reason = None, mismatch
            if out is not None:
                self.env[node] = out
                self.report.dropped += out is DROP or not self._emitted
                return
            for n in self._emitted:
                self.graph.remove(n)
            self._emitted = []
            if rule.op and reason == "no table entry":
                reason = f"arguments the {rule.op} rule does not cover"
        self._fallback(node, args, kwargs, reason)

    def _mismatch(self, out: Any, val: Any) -> str:
        """Why the rule's result types differ from torch's ('' when they agree)."""
        outs = out if isinstance(out, list) else [out]
        vals = list(val) if isinstance(val, (list, tuple)) else [val]
        if out is DROP or any(isinstance(o, QuantPart) for o in outs) or len(outs) != len(vals):
            return ""
        for o, t in zip(outs, vals):
            if isinstance(o, Value) and isinstance(t, torch.Tensor):
                want = self._type(t)
                if o.type != want and not (o.type.dtype == want.dtype and o.type.rank == want.rank and all(
                        dims_equal(a, b) for a, b in zip(o.type.shape, want.shape))):
                    return f"the IR op gives {o.type} but torch gives {want}"
        return ""

    def _fallback(self, node: fx.Node, args: tuple[Any, ...], kwargs: dict[str, Any], reason: str) -> None:
        target = target_name(node.target)
        operands, template = fallback_template(args, kwargs, f"FX node {node.name} ({target})")
        val = node.meta.get("val")
        vals = list(val) if isinstance(val, (list, tuple)) else ([] if val is None else [val])
        outs = self.emit("fallback", operands, {"target": target, "args": template,
                                                "out_types": [str(self._type(t)) for t in vals]})
        self.env[node] = outs if isinstance(val, (list, tuple)) else (outs[0] if outs else None)
        use = self._fallbacks.setdefault(target, FallbackUse(target))
        use.count += 1
        if reason not in use.reasons:
            use.reasons.append(reason)

    def _write(self, node: fx.Node) -> None:
        """auto_functionalized_v2(m3c.paged_write, ...) -> one IR paged_write effect on a state input."""
        op, kw = node.args[0], node.kwargs
        if op is not torch.ops.m3c.paged_write.default:
            raise CaptureError(f"FX node {node.name}: in-place op {op} is not supported (only m3c.paged_write)")
        if any(k.startswith("_cache_") and k != "_cache_base_index" for k in kw):  # size/stride/slice: a view
            raise CaptureError(f"FX node {node.name}: paged_write into a view of a cache; pass the cache tensor itself")
        bases = [self._arg(b) for b in kw["_all_bases"]]
        cache, src, slots = bases[kw["_cache_base_index"]], self._arg(kw["src"]), self._arg(kw["slot_mapping"])
        if isinstance(src, QuantPart) or isinstance(cache, QuantPart):
            if not (isinstance(src, QuantPart) and isinstance(cache, QuantPart) and src.part == cache.part):
                raise CaptureError(f"FX node {node.name}: writes {src!r} into {cache!r}; a quantized cache takes the "
                                   "matching piece of one quantized value")
            key = (src.value, cache.value)
            if key not in self.writes:
                self.emit("paged_write", [src.value, slots, cache.value])
                self.writes[key] = (slots, set())
            if self.writes[key][0] is not slots or src.part in self.writes[key][1]:
                raise CaptureError(f"FX node {node.name}: the {src.part} of %{src.value.name} is written twice or "
                                   "to other slots than its other piece")
            self.writes[key][1].add(src.part)
            state = cache.value
        else:
            if not isinstance(cache, Value) or cache.kind != "state":
                raise CaptureError(f"FX node {node.name}: paged_write into {cache!r}, which is not a cache argument")
            self.emit("paged_write", [src, slots, cache])
            state = cache
        self.written.add(state)
        self.env[node] = _Written(bases)

    def _outputs(self, node: fx.Node) -> None:
        outs = node.args[0]
        for spec, a in zip(self.ep.graph_signature.output_specs, outs):
            v = self._arg(a)
            if spec.kind == OutputKind.USER_OUTPUT:
                if not isinstance(v, Value):
                    raise CaptureError(f"model output {spec.arg} is {v!r}, not a tensor the IR computes")
                self.graph.outputs.append(v)
            elif spec.kind in _MUTATIONS:
                state = v.value if isinstance(v, QuantPart) else v
                if state not in self.written:
                    raise CaptureError(f"input {spec.target} is updated in place by something other than "
                                       "m3c.paged_write; m3c only models paged-cache writes as effects")
            else:
                raise CaptureError(f"unsupported exported output kind {spec.kind} ({spec.arg})")


# ---- helpers -----------------------------------------------------------------------------------
def _key(k: Any) -> Any:
    """The plain index / key / attribute name of a pytree key-path entry."""
    return getattr(k, "idx", getattr(k, "key", getattr(k, "name", k)))


def _state_name(base: str) -> str:
    m = re.fullmatch(r"kv_caches_(\d+)_(.+)", base)
    return f"kv.{m.group(1)}.{m.group(2)}" if m else base


def _scope(node: fx.Node) -> str:
    """Innermost module path of an FX node ('' at the top)."""
    stack = node.meta.get("nn_module_stack") or {}
    paths = [v[0] for k, v in stack.items() if not str(k).startswith("_empty")]
    return paths[-1] if paths else ""


def _dim_names(model: nn.Module, args: tuple[Any, ...], dynamic_shapes: Any) -> dict[Path, dict[int, str]]:
    """Argument path -> {dim index: Dim name} for every root (non-derived) Dim in `dynamic_shapes`."""
    if dynamic_shapes is None:
        return {}
    import inspect

    params = list(inspect.signature(model.forward).parameters.values())
    per_param = [dynamic_shapes.get(p.name) for p in params] if isinstance(dynamic_shapes, dict) \
        else list(dynamic_shapes)
    specs: list[Any] = []
    for p, spec in zip(params, per_param):
        if p.kind == p.VAR_POSITIONAL:  # one spec per extra positional argument
            specs.extend(spec if spec is not None else [None] * (len(args) - len(specs)))
        elif p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            specs.append(spec)
    out: dict[Path, dict[int, str]] = {}

    def walk(arg: Any, spec: Any, path: Path) -> None:
        if spec is None:
            return
        if isinstance(arg, torch.Tensor):
            items = spec.items() if isinstance(spec, dict) else enumerate(spec)
            for d, dim in items:
                if dim is not None and hasattr(dim, "__name__") and not hasattr(dim, "root"):
                    out.setdefault(path, {})[d] = dim.__name__
        elif isinstance(arg, (list, tuple)):
            for i, (a, s) in enumerate(zip(arg, spec)):
                walk(a, s, (*path, i))
        elif isinstance(arg, dict):
            for k, a in arg.items():
                walk(a, spec.get(k), (*path, k))

    for i, (a, s) in enumerate(zip(args, specs)):
        walk(a, s, (i,))
    return out


def annotate_graph(graph: Graph) -> None:
    """Record the effect order (verifier) and identical-layer groups in ``graph.meta``."""
    from m3c.frontend.layers import annotate_layers
    from m3c.ir.verifier import record_effect_order

    annotate_layers(graph)
    record_effect_order(graph)


# ---- the reference model ---------------------------------------------------------------------------
STAMP_MIN_LAYERS = 5
"""capture_m3 stamps (traces one layer pair per kind) from this many layers up; below it traces all."""


def m3_example_inputs(cfg: Any, device: str | torch.device = "cpu", num_blocks: int = 11,
                      max_blocks: int = 5) -> tuple[Any, ...]:
    """Example forward arguments: 2 requests (4 new tokens from 0, 3 new after 9 cached), fresh caches.

    Sizes are chosen distinct (T=7, R=2, MB=5, NB=11) so export keeps every dynamic dim its own symbol.
    """
    from m3c.model_defs.kv_cache import allocate_layer_cache

    bs = cfg.msa_block_size
    positions = torch.tensor([0, 1, 2, 3, 9, 10, 11])
    table = torch.zeros(2, max_blocks, dtype=torch.int32)
    table[0, 0], table[1, : -(-12 // bs)] = 1, torch.arange(2, 2 + -(-12 // bs), dtype=torch.int32)
    req = torch.tensor([0, 0, 0, 0, 1, 1, 1])
    slots = table[req, positions // bs].long() * bs + positions % bs
    meta = (torch.arange(7) * 37 % cfg.vocab_size, positions, slots, table, torch.tensor([0, 4, 7], dtype=torch.int32),
            torch.tensor([4, 12], dtype=torch.int32))
    caches = [allocate_layer_cache(cfg, i, num_blocks, device) for i in range(cfg.num_hidden_layers)]
    return (*(t.to(device) for t in meta), caches)


def m3_dynamic_shapes(caches: list[dict[str, torch.Tensor]]) -> dict[str, Any]:
    """The dynamic_shapes spec of the reference model's forward: T, R (and R+1), MB, NB."""
    T, R, MB, NB = Dim("T"), Dim("R"), Dim("MB"), Dim("NB")
    return {"input_ids": {0: T}, "positions": {0: T}, "slot_mapping": {0: T}, "block_table": {0: R, 1: MB},
            "query_start_loc": {0: R + 1}, "seq_lens": {0: R},
            "kv_caches": [{k: ({0: NB} if v.dim() else None) for k, v in layer.items()} for layer in caches]}


def capture_m3(cfg: Any, device: str | torch.device = "cpu", model: nn.Module | None = None,
               stamp: bool | None = None) -> Capture:
    """Capture the reference MiniMax-M3 model of `cfg` (built on `device` unless `model` is given).

    With `stamp` (default: from STAMP_MIN_LAYERS layers up) two layers of each distinct layer kind
    are traced, checked identical, and stamped for every layer (see :func:`m3c.frontend.layers.stamp_layers`);
    if the check fails the whole model is traced.
    """
    from m3c.model_defs.checkpoint import build_model
    from m3c.model_defs.minimax_m3 import MiniMaxM3ForCausalLM

    if stamp is None:
        stamp = cfg.num_hidden_layers >= STAMP_MIN_LAYERS
    if stamp and (model is None or type(model) is MiniMaxM3ForCausalLM):
        from m3c.frontend.layers import capture_m3_stamped

        cap = capture_m3_stamped(cfg, model)
        if cap is not None:
            return cap
    model = model if model is not None else build_model(cfg, device=device)
    args = m3_example_inputs(cfg, device)
    return capture(model, args, m3_dynamic_shapes(args[-1]), name=graph_name(cfg))


def graph_name(cfg: Any) -> str:
    """A graph name from a config name ('m3.1-tiny' -> 'm3.1_tiny')."""
    return re.sub(r"[^\w.]", "_", cfg.name)
