"""The compile driver: capture → pass pipeline → lowering → Program (and the compile cache around it).

Two entries share it:

- :func:`compile_preset` compiles an M3 model named by a preset, a config or a checkpoint (what
  ``m3c compile`` runs) and returns ``(Program, config, CompileReport)``;
- :func:`compile` (``m3c.compile``) compiles a model object and returns a :class:`CompiledModel`,
  callable like the model (an M3 model: the forward signature with ``kv_caches``).

Stages: ``capture`` (frontend: torch → IR), ``passes`` (the target's pipeline), ``lower`` (the
target's code generator), ``save`` (into the compile cache). With ``progress`` (default: when
stderr is a terminal) each stage prints one line to stderr.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from m3c.backends import CompileOptions, Program, get_target, lower
from m3c.errors import CompileError
from m3c.ir.graph import Graph
from m3c.model_defs.config import M3Config
from m3c.model_defs.minimax_m3 import MiniMaxM3ForCausalLM
from m3c.runtime.compile_cache import CompileCache, cache_key, checkpoint_key, model_key, tensors_key
from m3c.runtime.executor import Executor

_DEBUG_KWARGS = ("cache", "dump_ir_after", "dump_dir", "explain", "progress", "timing")


# ---- report and progress -------------------------------------------------------------------------
@dataclass
class CompileReport:
    """What a compile did: capture findings, pass records, node counts, stage times, cache use."""

    model: str
    target: str
    options: CompileOptions
    fallback_ops: list[str] = field(default_factory=list)
    """ATen ops the frontend had no IR op for (run by torch); none for the M3 presets."""
    capture_report: Any = None
    nodes_captured: int = 0
    nodes_compiled: int = 0
    op_counts: dict[str, int] = field(default_factory=dict)
    """Op counts of the compiled graph."""
    weights_bytes: int = 0
    stage_seconds: dict[str, float] = field(default_factory=dict)
    cache: str = "off"
    """``hit``, ``miss`` or ``off``."""
    cache_key: str | None = None
    cache_path: Path | None = None
    pipeline: Any = None
    """The passes' PipelineReport (None on a cache hit)."""
    explain: str | None = None
    created_from: dict[str, Any] = field(default_factory=dict)
    """How the model was made (preset/config/checkpoint, seed): what the artifact records."""

    @property
    def compile_seconds(self) -> float:
        """Wall time of all stages."""
        return sum(self.stage_seconds.values())

    def text(self) -> str:
        """A short human-readable report."""
        stages = ", ".join(f"{k} {v:.2f}s" for k, v in self.stage_seconds.items())
        lines = [
            f"compiled   {self.model} for {self.target} in {self.compile_seconds:.2f}s ({stages}); cache {self.cache}",
            (f"graph      {self.nodes_captured} nodes captured -> {self.nodes_compiled} after passes; "
             if self.capture_report is not None else
             f"graph      {self.nodes_compiled} nodes (capture and passes skipped: cache hit); ")
            + f"weights {self.weights_bytes:,} bytes",
            "fallback   " + (", ".join(self.fallback_ops) if self.fallback_ops else
                             "none (every op has an IR op)" if self.capture_report is not None else "n/a (not captured)"),
            "ops        " + ", ".join(f"{op} {n}" for op, n in
                                      sorted(self.op_counts.items(), key=lambda kv: (-kv[1], kv[0]))),
        ]
        if self.pipeline is not None and any(p.seconds is not None for p in self.pipeline.passes):
            lines.append(self.pipeline.timing_text())
        if self.explain:
            lines.append(self.explain)
        return "\n".join(lines)


class Progress:
    """One stderr line per stage when enabled (default: when stderr is a terminal)."""

    def __init__(self, enabled: bool | None = None) -> None:
        self.enabled = sys.stderr.isatty() if enabled is None else enabled

    @contextmanager
    def stage(self, name: str, what: str, seconds: dict[str, float]) -> Iterator[None]:
        """Time a stage into `seconds[name]`, printing `what` and then its time."""
        if self.enabled:
            print(f"m3c: {name:<8} {what} ...", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        yield
        seconds[name] = time.perf_counter() - t0
        if self.enabled:
            print(f"m3c: {name:<8} done in {seconds[name]:.2f}s", file=sys.stderr, flush=True)


# ---- shared driver -----------------------------------------------------------------------------
def _pass_context(options: CompileOptions, dump_ir_after: Any, dump_dir: str | Path | None, explain: bool,
                  timing: bool) -> Any:
    from m3c.passes.manager import PassContext

    if isinstance(dump_ir_after, str):
        dump_ir_after = "all" if dump_ir_after == "all" else {dump_ir_after}
    elif dump_ir_after:
        dump_ir_after = "all" if "all" in dump_ir_after else set(dump_ir_after)
    return PassContext(verify_each=options.verify_each, dump_ir_after=dump_ir_after or None,
                       dump_dir=Path(dump_dir) if dump_dir else None, explain=explain, timing=timing)


def make_pipeline(options: CompileOptions, ctx: Any) -> Any:
    """The target's pass pipeline for `options`; names in --disable-pass / --dump-ir-after must exist."""
    from m3c.passes.manager import PipelineOptions, pipeline_for

    target = get_target(options.target)
    try:
        pipeline = pipeline_for(target.pipeline, PipelineOptions(disable=frozenset(options.disable_passes)))
    except ValueError as e:  # a disabled pass the pipeline does not have
        raise CompileError(str(e)) from None
    names = [p.name for p in pipeline.passes]
    asked = ctx.dump_ir_after if isinstance(ctx.dump_ir_after, set) else set()
    if asked - set(names):
        raise CompileError(f"--dump-ir-after {sorted(asked - set(names))}: pipeline {pipeline.name!r} has no such "
                           f"pass; its passes are {names} (or use 'all')")
    return pipeline


def run_passes(graph: Graph, options: CompileOptions, ctx: Any) -> Any:
    """Run the target's pipeline on `graph` in place; returns the PipelineReport."""
    from m3c.passes.manager import run_pipeline

    return run_pipeline(graph, make_pipeline(options, ctx), ctx)


def _fallback_ops(capture: Any) -> list[str]:
    """The ATen ops the capture could not map, as 'target xN' (from its report, else its fallback nodes)."""
    uses = getattr(getattr(capture, "report", None), "fallbacks", None)
    if uses is not None:
        return [f"{u.target} x{u.count}" for u in uses]
    return sorted({str(n.attrs.get("target")) for n in capture.graph.find("fallback")})


@dataclass
class _Job:
    """One compile: how to capture the graph and bind its params, and its cache identity."""

    name: str
    cfg: M3Config | None
    capture: Callable[[], Any]
    """() -> Capture (frontend)."""
    params: Callable[[Any], Mapping[str, Any]]
    """Capture -> the param values by IR input name."""
    weights_key: str
    created_from: dict[str, Any]
    model_key: bool = False
    """Whether the graph follows from the config alone (the reference M3 model): allows a pre-capture key."""


def _compile_job(job: _Job, options: CompileOptions, *, cache: CompileCache | None, dump_ir_after: Any,
                 dump_dir: str | Path | None, explain: bool, timing: bool, progress: Progress,
                 seconds: dict[str, float]) -> tuple[Program, CompileReport, Any]:
    """Capture (unless the cache answers first), run the passes, lower, store; returns (program, report, capture)."""
    from m3c.passes.manager import run_pipeline

    report = CompileReport(job.name, options.target, options, stage_seconds=seconds, created_from=job.created_from)
    ctx = _pass_context(options, dump_ir_after, dump_dir, explain, timing)
    pipeline = make_pipeline(options, ctx)  # bad pass names fail before any work
    debug = bool(dump_ir_after) or explain  # dumps and explain need the passes to run
    pre = model_key(job.cfg, options, job.weights_key) if cache and job.model_key and job.cfg else None
    if cache is not None and pre is not None and not debug:
        hit = cache.get_alias(pre)
        if hit is not None:
            report.cache, report.cache_path = "hit", hit.path
            report.cache_key = hit.path.stem
            _finish(report, hit.program)
            return hit.program, report, None
    with progress.stage("capture", f"{job.name} with torch.export", seconds):
        cap = job.capture()
    graph = cap.graph
    report.capture_report = cap.report
    report.fallback_ops = _fallback_ops(cap)
    report.nodes_captured = len(graph.nodes)
    if cache is not None:
        report.cache_key = key = cache_key(job.cfg, graph, options, job.weights_key)
        report.cache_path = cache.path_for(key)
        hit = None if debug else cache.get(key)
        if hit is not None:
            report.cache = "hit"
            if pre is not None:
                cache.put_alias(pre, key)
            _finish(report, hit.program)
            return hit.program, report, cap
        report.cache = "miss"
    with progress.stage("passes", f"{pipeline.name} pipeline on {len(graph.nodes)} nodes", seconds):
        report.pipeline = run_pipeline(graph, pipeline, ctx)
    if explain:
        report.explain = report.pipeline.explain_text()
    with progress.stage("lower", f"to a {options.target} program", seconds):
        program = lower(graph, options, job.params(cap))
    if cache is not None and report.cache_key is not None:
        with progress.stage("save", f"into the compile cache {cache.root}", seconds):
            cache.put(report.cache_key, program, job.cfg, job.created_from)
            if pre is not None:
                cache.put_alias(pre, report.cache_key)
    _finish(report, program)
    return program, report, cap


def _finish(report: CompileReport, program: Program) -> None:
    report.nodes_compiled = len(program.graph.nodes)
    report.op_counts = program.graph.op_counts()
    report.weights_bytes = program.weights_nbytes()


def _make_cache(cache: bool | str | Path | CompileCache | None) -> CompileCache | None:
    if cache is None or cache is False:
        return None
    if cache is True:
        return CompileCache()
    if isinstance(cache, CompileCache):
        return cache
    return CompileCache(Path(cache))


# ---- M3 models ---------------------------------------------------------------------------------
def m3_params(capture: Any, model: MiniMaxM3ForCausalLM) -> dict[str, Any]:
    """The param inputs of an M3 capture bound to `model`'s weights (via `Capture.bind` on example arguments)."""
    from m3c.frontend.capture import m3_example_inputs

    bound = capture.bind(model, *m3_example_inputs(model.cfg, model.embed_tokens.device))
    return {v.name: bound[v.name] for v in capture.graph.inputs if v.kind == "param"}


def _with_config(model: MiniMaxM3ForCausalLM, cfg: M3Config) -> MiniMaxM3ForCausalLM:
    """`model`'s weights under another config of the same weight shapes (e.g. another KV-cache dtype)."""
    if cfg == model.cfg:
        return model
    new = MiniMaxM3ForCausalLM(cfg, device="meta", dtype=model.dtype)
    new.load_state_dict(model.state_dict(), assign=True)
    return new.eval()


def _m3_job(model: MiniMaxM3ForCausalLM | Callable[[], MiniMaxM3ForCausalLM], cfg: M3Config, weights_key: str,
            created_from: dict[str, Any]) -> _Job:
    """The job of an M3 model (or of a factory that builds it only if the cache cannot answer)."""
    from m3c.frontend.capture import capture_m3

    get = functools.cache(lambda: _with_config(model() if callable(model) and not isinstance(model, nn.Module)
                                               else model, cfg))
    exact = not isinstance(model, nn.Module) or type(model) is MiniMaxM3ForCausalLM
    return _Job(cfg.name, cfg, lambda: capture_m3(cfg, model=get()), lambda cap: m3_params(cap, get()),
                weights_key, created_from, model_key=exact)


def compile_preset(preset_or_cfg: str | M3Config | None = "m3.1-tiny", target: str = "cpu",
                   checkpoint: str | Path | None = None, options: CompileOptions | None = None, *, seed: int = 0,
                   cache: bool | str | Path | CompileCache | None = True, dump_ir_after: Any = None,
                   dump_dir: str | Path | None = None, explain: bool = False, timing: bool = True,
                   progress: bool | None = None,
                   dtype: torch.dtype | str = torch.float32) -> tuple[Program, M3Config, CompileReport]:
    """Compile an M3 model: a preset name or config with random weights from `seed`, or a checkpoint.

    `dtype` is the model's activation and dense-weight dtype (:data:`~m3c.model_defs.config.MODEL_DTYPES`): float32
    (the default) gives the reference model's tokens; bfloat16 is what the Hopper kernels are built for (the wgmma
    MegaMoE prefill takes only bf16 activations). Returns ``(program, config, report)``; the config is the one
    compiled (options applied).
    `cache` is True (``$M3C_CACHE_DIR`` / ``~/.cache/m3c``), a directory, a CompileCache, or
    False/None for no cache. `dump_ir_after` is a pass name, a list of them, or ``"all"``.
    """
    from m3c.model_defs.checkpoint import build_model, load_checkpoint, model_dtype
    from m3c.model_defs.presets import get_preset

    dtype = model_dtype(dtype)
    options = options or CompileOptions(target=target)
    if options.target != target and target != "cpu":
        options = dataclasses.replace(options, target=target)
    get_target(options.target).lowering_fn()  # unknown targets, or ones without a code generator, fail first
    prog = Progress(progress)
    seconds: dict[str, float] = {}
    with prog.stage("load", "model config", seconds):
        if checkpoint is not None:
            cfg = M3Config.load(Path(checkpoint) / "config.json")
            weights_key = checkpoint_key(checkpoint)
            created_from: dict[str, Any] = {"checkpoint": Path(checkpoint).name}
        else:
            cfg = get_preset(preset_or_cfg) if isinstance(preset_or_cfg, str) else preset_or_cfg
            if not isinstance(cfg, M3Config):
                raise CompileError("compile_preset needs a preset name, an M3Config or a checkpoint directory")
            weights_key = f"random:seed={seed}"
            created_from = {"preset" if isinstance(preset_or_cfg, str) else "config": cfg.name,
                            "weights": f"random, seed {seed}"}
        cfg = options.apply_to(cfg)
        if dtype != torch.float32:  # (float32 keeps the keys of artifacts cached before the option existed)
            created_from["dtype"] = str(dtype).removeprefix("torch.")
            weights_key += f";dtype={created_from['dtype']}"

    def build() -> MiniMaxM3ForCausalLM:  # only when the cache cannot answer
        tensors = load_checkpoint(checkpoint)[1] if checkpoint is not None else None
        return build_model(cfg, tensors, seed=seed, dtype=dtype)

    job = _m3_job(build, cfg, weights_key, created_from)
    program, report, _ = _compile_job(job, options, cache=_make_cache(cache), dump_ir_after=dump_ir_after,
                                      dump_dir=dump_dir, explain=explain, timing=timing, progress=prog,
                                      seconds=seconds)
    return program, cfg, report


# ---- any model -----------------------------------------------------------------------------------
class CompiledModel:
    """A compiled model, callable like the original (an M3 model: forward(..., kv_caches))."""

    def __init__(self, program: Program, report: CompileReport, cfg: M3Config | None = None,
                 capture: Any = None, model: nn.Module | None = None, device: torch.device | str | None = None):
        self.program, self.report, self.cfg = program, report, cfg
        self.executor = Executor(program, device)
        self._capture, self._model = capture, model

    @property
    def graph(self) -> Graph:
        """The compiled (fused) IR graph."""
        return self.program.graph

    def __call__(self, *args: Any) -> Any:
        if self.cfg is not None:
            return self.executor(*args)
        bound = self._capture.bind(self._model, *args)
        inputs = {k: v for k, v in bound.items() if k not in self.executor.params}
        outs = self.executor.run(inputs)
        return outs[0] if len(outs) == 1 else tuple(outs)

    def save(self, path: str | Path) -> Path:
        """Save the program as an artifact (see m3c.runtime.artifact)."""
        from m3c.runtime.artifact import save_artifact

        return save_artifact(self.program, self.cfg, path, {"model": self.report.model})


def compile(model: nn.Module, example_inputs: Sequence[Any] | None = None, target: str = "cpu",
            **options: Any) -> CompiledModel:
    """Compile `model` for `target`; returns a CompiledModel callable like it.

    An ``MiniMaxM3ForCausalLM`` needs no example inputs (its capture is symbolic in the token and
    request counts); any other module is captured with ``example_inputs``. Keyword options are
    CompileOptions fields (kv_cache_dtype, block_size, verify_each, ...) plus ``cache`` (default
    False here), ``dump_ir_after``, ``dump_dir``, ``explain``, ``timing`` and ``progress``.
    """
    debug = {k: options.pop(k) for k in list(options) if k in _DEBUG_KWARGS}
    try:
        opts = CompileOptions(target=target, **options)
    except TypeError as e:
        known = [f.name for f in dataclasses.fields(CompileOptions)] + list(_DEBUG_KWARGS)
        raise CompileError(f"m3c.compile: {e}; known options: {known}") from None
    get_target(opts.target).lowering_fn()
    cache = _make_cache(debug.get("cache", False))
    cfg: M3Config | None = None
    call_model: nn.Module | None = None
    if isinstance(model, MiniMaxM3ForCausalLM):
        cfg = opts.apply_to(model.cfg)
        job = _m3_job(model, cfg, tensors_key(dict(model.state_dict())) if cache else "", {"model": cfg.name})
    else:
        if example_inputs is None:
            raise CompileError(f"m3c.compile({type(model).__name__}): pass example_inputs (a tuple of the "
                               "arguments of one call) so the model can be captured")
        from m3c.frontend.capture import capture

        name, args = type(model).__name__, tuple(example_inputs)

        def params(cap: Any) -> Mapping[str, Any]:
            bound = cap.bind(model, *args)
            return {v.name: bound[v.name] for v in cap.graph.inputs if v.kind == "param"}

        weights = tensors_key(dict(model.state_dict())) if cache else ""
        job = _Job(name, None, lambda: capture(model, args, name=name), params, weights, {"model": name})
        call_model = model
    program, report, cap = _compile_job(
        job, opts, cache=cache, dump_ir_after=debug.get("dump_ir_after"), dump_dir=debug.get("dump_dir"),
        explain=bool(debug.get("explain")), timing=debug.get("timing", True), progress=Progress(debug.get("progress")),
        seconds={})
    return CompiledModel(program, report, cfg, cap, call_model)
