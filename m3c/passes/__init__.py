"""Passes over the IR: the pass manager, the pattern rewriter, and the passes built on them."""

from m3c.passes.manager import (
    Pass,
    PassContext,
    PassResult,
    Pipeline,
    PipelineOptions,
    PipelineReport,
    pipeline_for,
    register_pipeline,
    run_pipeline,
)
from m3c.passes.rewrite import Check, MatchRecord, P, Rewrite, RewritePass, V, X, apply_rewrites

__all__ = [
    "Check",
    "MatchRecord",
    "P",
    "Pass",
    "PassContext",
    "PassResult",
    "Pipeline",
    "PipelineOptions",
    "PipelineReport",
    "Rewrite",
    "RewritePass",
    "V",
    "X",
    "apply_rewrites",
    "pipeline_for",
    "register_pipeline",
    "run_pipeline",
]
