"""The pass manager: pipelines per target, instruments (verify, dump, timing) and the explain report."""

from __future__ import annotations

from pathlib import Path

import pytest
from passes_helpers import attention_graph, rope_graph

from m3c.errors import M3CError
from m3c.ir.graph import Graph
from m3c.ir.text import parse_graph
from m3c.ir.verifier import record_effect_order
from m3c.passes import Pass, PassContext, PassResult, Pipeline, PipelineOptions, pipeline_for, run_pipeline
from m3c.passes.manager import Instrument, PassVerifyError, register_pipeline, registered_targets


class BreakUses(Pass):
    """A deliberately broken pass: makes the first node use the last node's output."""

    name = "break_uses"

    def run(self, graph: Graph, ctx: PassContext) -> PassResult:
        graph.nodes[0].inputs[0] = graph.nodes[-1].outputs[0]
        return PassResult(True)


def test_cpu_pipeline_is_registered() -> None:
    assert "cpu" in registered_targets()
    assert [p.name for p in pipeline_for("cpu").passes] == ["canonicalize", "cse", "dce"]
    assert [p.name for p in pipeline_for("cpu", PipelineOptions(frozenset({"cse"}))).passes] == ["canonicalize", "dce"]
    with pytest.raises(ValueError, match="has no pass"):
        pipeline_for("cpu", PipelineOptions(frozenset({"fuse_everything"})))
    with pytest.raises(M3CError, match=r"no pass pipeline for target 'nope'; registered: .*cpu"):
        pipeline_for("nope")


def test_a_target_registers_its_pipeline_with_one_call() -> None:
    register_pipeline("test-target", lambda opts: pipeline_for("cpu", opts).then(BreakUses()), replace=True)
    assert [p.name for p in pipeline_for("test-target").passes][-1] == "break_uses"
    with pytest.raises(ValueError, match="already registered"):
        register_pipeline("test-target", lambda opts: Pipeline("x", []))


def test_verify_each_names_the_broken_pass() -> None:
    g = rope_graph()
    pipeline = pipeline_for("cpu").then(BreakUses())
    with pytest.raises(PassVerifyError, match=r"after pass 'break_uses' \(#4 of pipeline 'cpu'\)"):
        run_pipeline(g, pipeline, PassContext(verify_each=True))


def test_verify_each_checks_the_input_too() -> None:
    g = rope_graph()
    BreakUses().run(g, PassContext())
    with pytest.raises(PassVerifyError, match="the input of pipeline 'cpu'"):
        run_pipeline(g, pipeline_for("cpu"), PassContext(verify_each=True))


def test_without_verify_a_broken_pass_goes_unnoticed() -> None:
    report = run_pipeline(rope_graph(), Pipeline("p", [BreakUses()]))
    assert report.changed and [p.name for p in report.passes] == ["break_uses"]


def test_dump_after_a_named_pass_in_memory() -> None:
    report = run_pipeline(rope_graph(), pipeline_for("cpu"), PassContext(dump_ir_after={"canonicalize"}))
    assert list(report.dumps) == ["01_canonicalize"]
    assert parse_graph(report.dumps["01_canonicalize"]).op_counts() == {"rope": 1}
    assert report.dump_paths == []


def test_dump_after_all_passes_to_a_directory(tmp_path: Path) -> None:
    report = run_pipeline(rope_graph(), pipeline_for("cpu"), PassContext(dump_ir_after="all", dump_dir=tmp_path))
    assert report.dumps == {}
    assert [p.name for p in report.dump_paths] == [
        "cpu.00_input.m3ir", "cpu.01_canonicalize.m3ir", "cpu.02_cse.m3ir", "cpu.03_dce.m3ir"]
    assert "cat(" in report.dump_paths[0].read_text() and "rope(" in report.dump_paths[3].read_text()


def test_timing_and_changed_flags() -> None:
    report = run_pipeline(attention_graph(), pipeline_for("cpu"), PassContext(timing=True))
    assert [(p.name, p.changed) for p in report.passes] == [("canonicalize", True), ("cse", True), ("dce", True)]
    assert all(p.seconds is not None and p.seconds >= 0 for p in report.passes)
    assert "canonicalize" in report.timing_text() and " ms " in report.timing_text()
    untimed = run_pipeline(rope_graph(), pipeline_for("cpu"))
    assert all(p.seconds is None for p in untimed.passes)


def test_extra_instruments_see_every_pass() -> None:
    seen: list[tuple[str, str]] = []

    class Log(Instrument):
        def before_pass(self, graph, p, index, report) -> None:  # type: ignore[no-untyped-def]
            seen.append(("before", p.name))

        def after_pass(self, graph, p, index, record, report) -> None:  # type: ignore[no-untyped-def]
            seen.append(("after", f"{p.name}:{record.changed}"))

    run_pipeline(rope_graph(), pipeline_for("cpu"), PassContext(instruments=[Log()]))
    assert seen == [("before", "canonicalize"), ("after", "canonicalize:True"), ("before", "cse"),
                    ("after", "cse:False"), ("before", "dce"), ("after", "dce:False")]


def test_explain_lists_matches_with_scopes_and_the_first_failed_constraint() -> None:
    g = attention_graph((True, False))
    record_effect_order(g)
    report = run_pipeline(g, pipeline_for("cpu"), PassContext(explain=True, verify_each=True))
    text = report.explain_text()
    lines = text.splitlines()
    assert lines[0] == "explain: pipeline 'cpu' on graph 'attn'"
    assert "  rope: applied 6× at layers.0.self_attn ×4, layers.1.self_attn ×2" in lines
    assert "  cast_noop: applied 6× at layers.0.self_attn ×4, layers.1.self_attn ×2" in lines
    i = next(i for i, line in enumerate(lines) if line.startswith("  split_noop: no match; closest: split"))
    assert "(layers.0.self_attn)" in lines[i] and "constraints held; first failed:" in lines[i]
    assert lines[i + 1].strip().endswith("check 'one piece' failed")
    assert any(line.startswith("  no root op in the graph: ") and "sum_dims" in line for line in lines)
    assert "pass 2 cse: changed (merged=2)" in lines and "pass 3 dce: changed (removed=2)" in lines
    assert report.applied("rope") == 6
