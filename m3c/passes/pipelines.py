"""The built-in pass pipelines and the stages every target's pipeline shares.

A backend adds its pipeline with one call at import::

    register_pipeline("hopper", lambda opts: Pipeline("hopper", [*simplify(), *my_fusions(opts)]))
"""

from __future__ import annotations

from m3c.passes.basic import Canonicalize, CommonSubexpressionElimination, DeadCodeElimination
from m3c.passes.manager import Pass, Pipeline, PipelineOptions, register_pipeline


def simplify() -> list[Pass]:
    """The target-neutral first stage: canonicalize → cse → dce."""
    return [Canonicalize(), CommonSubexpressionElimination(), DeadCodeElimination()]


def cpu_pipeline(options: PipelineOptions) -> Pipeline:
    """The CPU reference target: simplification only (the interpreter runs every op)."""
    return Pipeline("cpu", simplify())


def hopper_pipeline(options: PipelineOptions) -> Pipeline:
    """Hopper: simplification, then the fusions whose kernels the Hopper backend has, then cleanup."""
    from m3c.passes.fuse_moe import fuse_moe_pass
    from m3c.passes.fuse_msa import fuse_msa_pass
    from m3c.passes.fuse_qkv import fuse_qkv_pass

    return Pipeline("hopper", [*simplify(), fuse_qkv_pass(), fuse_moe_pass(), fuse_msa_pass(),
                               CommonSubexpressionElimination(), DeadCodeElimination()])


register_pipeline("cpu", cpu_pipeline)
register_pipeline("hopper", hopper_pipeline)
