"""A small pass manager: passes, pipelines, a context, instruments around each pass, and a report.

Verification, IR dumps and timing are :class:`Instrument` objects hooked before/after every pass,
not part of the passes. The report collects each pass's changed flag, time, dumps and match
records; ``report.explain_text()`` says which patterns matched where and why the others did not.
Targets register their pipeline with one call, ``register_pipeline("hopper", factory)``; shared
code asks ``pipeline_for(target, options)`` and never which target it is.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from m3c.errors import M3CError
from m3c.ir.graph import Graph

if TYPE_CHECKING:
    from m3c.passes.rewrite import MatchRecord


class PassVerifyError(M3CError, RuntimeError):
    """The IR verifier rejected the graph a pass left behind (the message names the pass)."""


@dataclass
class PassResult:
    """What one pass did: whether the graph changed, its match records (rewrite passes), counters."""

    changed: bool
    records: list[MatchRecord] = field(default_factory=list)
    stats: dict[str, int] = field(default_factory=dict)


class Pass(ABC):
    """A graph transformation with a name; `run` edits the graph in place."""

    name: str = ""

    @abstractmethod
    def run(self, graph: Graph, ctx: PassContext) -> PassResult:
        """Transform `graph` in place."""

    def __repr__(self) -> str:
        return f"<pass {self.name}>"


@dataclass(frozen=True)
class Pipeline:
    """A named, ordered list of passes."""

    name: str
    passes: tuple[Pass, ...]

    def __init__(self, name: str, passes: Iterable[Pass]) -> None:
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "passes", tuple(passes))

    def then(self, *passes: Pass) -> Pipeline:
        """This pipeline with `passes` appended."""
        return Pipeline(self.name, (*self.passes, *passes))

    def without(self, names: Iterable[str]) -> Pipeline:
        """This pipeline minus the passes called `names` (each must exist)."""
        names = set(names)
        unknown = names - {p.name for p in self.passes}
        if unknown:
            raise ValueError(f"pipeline {self.name!r} has no pass {sorted(unknown)}; it has "
                             f"{[p.name for p in self.passes]}")
        return Pipeline(self.name, (p for p in self.passes if p.name not in names))


@dataclass
class PassContext:
    """How to run a pipeline: verification, dumps (to `dump_dir`, else in memory), explain, timing."""

    verify_each: bool = False
    dump_ir_after: set[str] | Literal["all"] | None = None
    dump_dir: Path | None = None
    explain: bool = False
    timing: bool = False
    instruments: list[Instrument] = field(default_factory=list)  # extra ones, run after the built-in ones

    def make_instruments(self) -> list[Instrument]:
        """The instruments these settings ask for (timing last: innermost, so it times only the pass)."""
        out: list[Instrument] = []
        if self.verify_each:
            out.append(VerifyInstrument())
        if self.dump_ir_after:
            out.append(DumpInstrument(self.dump_ir_after, self.dump_dir))
        out += self.instruments
        if self.timing:
            out.append(TimingInstrument())
        return out


@dataclass
class PassRecord:
    """One pass's run: name, changed flag, seconds (with timing), its result."""

    name: str
    changed: bool
    result: PassResult
    seconds: float | None = None


@dataclass
class PipelineReport:
    """Everything a pipeline run left to look at."""

    pipeline: str
    graph: str
    passes: list[PassRecord] = field(default_factory=list)
    dumps: dict[str, str] = field(default_factory=dict)  # "02_cse" -> IR text (no dump_dir)
    dump_paths: list[Path] = field(default_factory=list)  # files written (dump_dir)

    @property
    def changed(self) -> bool:
        """Whether any pass changed the graph."""
        return any(p.changed for p in self.passes)

    def records(self, rewrite: str | None = None) -> list[MatchRecord]:
        """Match records of every pass (optionally of one rewrite)."""
        return [r for p in self.passes for r in p.result.records if rewrite is None or r.rewrite == rewrite]

    def applied(self, rewrite: str) -> int:
        """How many times `rewrite` applied."""
        return sum(r.status == "applied" for r in self.records(rewrite))

    def timing_text(self) -> str:
        """One line per pass: seconds and changed flag."""
        lines = [f"timing: pipeline {self.pipeline!r}"]
        for p in self.passes:
            secs = "      -" if p.seconds is None else f"{p.seconds * 1e3:7.2f}"
            lines.append(f"  {p.name:<24} {secs} ms  {'changed' if p.changed else 'unchanged'}")
        return "\n".join(lines)

    def explain_text(self) -> str:
        """For each pass and pattern: where it matched (scopes), refusals, or the closest partial match."""
        from m3c.passes.explain import explain_text

        return explain_text(self)


# ---- instruments -------------------------------------------------------------------------------
class Instrument:
    """Hooks around every pass (both do nothing by default)."""

    def before_pass(self, graph: Graph, p: Pass, index: int, report: PipelineReport) -> None:
        """Called before pass number `index` (from 1) runs."""

    def after_pass(self, graph: Graph, p: Pass, index: int, record: PassRecord, report: PipelineReport) -> None:
        """Called after it ran, with its record."""


class VerifyInstrument(Instrument):
    """Runs the IR verifier on the input and after every pass; a failure names the pass."""

    def before_pass(self, graph: Graph, p: Pass, index: int, report: PipelineReport) -> None:
        if index == 1:
            self._verify(graph, f"the input of pipeline {report.pipeline!r} (before pass {p.name!r})")

    def after_pass(self, graph: Graph, p: Pass, index: int, record: PassRecord, report: PipelineReport) -> None:
        self._verify(graph, f"pass {p.name!r} (#{index} of pipeline {report.pipeline!r})")

    @staticmethod
    def _verify(graph: Graph, where: str) -> None:
        from m3c.ir.verifier import IRVerifyError, verify

        try:
            verify(graph)
        except IRVerifyError as err:
            raise PassVerifyError(f"IR verification failed after {where}: {err}") from err


class DumpInstrument(Instrument):
    """Prints the IR after the named passes (or all, plus the input) to files or into the report."""

    def __init__(self, after: set[str] | Literal["all"], dump_dir: Path | None) -> None:
        self.after, self.dump_dir = after, dump_dir

    def before_pass(self, graph: Graph, p: Pass, index: int, report: PipelineReport) -> None:
        if index == 1 and self.after == "all":
            self._dump(graph, "00_input", report)

    def after_pass(self, graph: Graph, p: Pass, index: int, record: PassRecord, report: PipelineReport) -> None:
        if self.after == "all" or p.name in self.after:
            self._dump(graph, f"{index:02d}_{p.name}", report)

    def _dump(self, graph: Graph, key: str, report: PipelineReport) -> None:
        from m3c.ir.text import print_graph

        text = print_graph(graph)
        if self.dump_dir is None:
            report.dumps[key] = text
            return
        self.dump_dir.mkdir(parents=True, exist_ok=True)
        path = self.dump_dir / f"{report.pipeline}.{key}.m3ir"
        path.write_text(text)
        report.dump_paths.append(path)


class TimingInstrument(Instrument):
    """Wall-clock seconds of each pass, into its record."""

    def __init__(self) -> None:
        self._start = 0.0

    def before_pass(self, graph: Graph, p: Pass, index: int, report: PipelineReport) -> None:
        self._start = time.perf_counter()

    def after_pass(self, graph: Graph, p: Pass, index: int, record: PassRecord, report: PipelineReport) -> None:
        record.seconds = time.perf_counter() - self._start


def run_pipeline(graph: Graph, pipeline: Pipeline, ctx: PassContext | None = None) -> PipelineReport:
    """Run every pass of `pipeline` on `graph` (in place) under `ctx`'s instruments."""
    ctx = ctx or PassContext()
    instruments = ctx.make_instruments()
    report = PipelineReport(pipeline.name, graph.name)
    for index, p in enumerate(pipeline.passes, start=1):
        for inst in instruments:
            inst.before_pass(graph, p, index, report)
        result = p.run(graph, ctx)
        record = PassRecord(p.name, result.changed, result)
        for inst in reversed(instruments):
            inst.after_pass(graph, p, index, record, report)
        report.passes.append(record)
    return report


# ---- pipelines per target ----------------------------------------------------------------------
@dataclass(frozen=True)
class PipelineOptions:
    """Target-neutral pipeline options (frozen: part of the compile-cache key)."""

    disable: frozenset[str] = frozenset()  # pass names to leave out


PipelineFactory = Callable[[PipelineOptions], Pipeline]
_PIPELINES: dict[str, PipelineFactory] = {}


def register_pipeline(target: str, factory: PipelineFactory, *, replace: bool = False) -> None:
    """Make `factory(options)` the pipeline of `target` (a backend calls this once)."""
    if target in _PIPELINES and not replace:
        raise ValueError(f"a pipeline for target {target!r} is already registered")
    _PIPELINES[target] = factory


def registered_targets() -> list[str]:
    """Targets that have a pipeline."""
    _ensure_builtin()
    return sorted(_PIPELINES)


def pipeline_for(target: str, options: PipelineOptions | None = None) -> Pipeline:
    """The pipeline registered for `target`, built for `options` (disabled passes removed)."""
    _ensure_builtin()
    options = options or PipelineOptions()
    try:
        factory = _PIPELINES[target]
    except KeyError:
        raise M3CError(f"no pass pipeline for target {target!r}; registered: {sorted(_PIPELINES)}") from None
    pipeline = factory(options)
    return pipeline.without(options.disable) if options.disable else pipeline


def _ensure_builtin() -> None:
    import m3c.passes.pipelines  # noqa: F401  (registers the built-in pipelines)

