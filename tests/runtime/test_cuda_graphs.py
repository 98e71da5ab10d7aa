"""CUDA-graph replay of decode steps: the wrapper's dispatch on CPU, and on the GPU equal tokens to eager."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from m3c.compiler import compile_preset
from m3c.model_defs.generate import greedy_generate, make_cache
from m3c.model_defs.presets import get_preset
from m3c.runtime.bench import random_prompts
from m3c.runtime.cuda_graphs import GraphedStep, host_sync_ops
from m3c.runtime.executor import Executor


def test_cpu_program_lists_its_host_synchronizing_references() -> None:
    program, _, _ = compile_preset("m3.1-tiny", target="cpu", cache=False)
    ops = host_sync_ops(program)
    assert "paged_attention" in ops and "grouped_gemm" in ops  # tiny's dense layer 2 and every MoE


def test_graphed_step_runs_cpu_steps_eagerly_with_equal_logits() -> None:
    program, cfg, _ = compile_preset("m3.1-tiny", target="cpu", cache=False)
    ex = Executor(program)
    graphed = GraphedStep(ex)
    assert graphed.eager_reason and "grouped_gemm" in graphed.eager_reason
    prompts = random_prompts(cfg, 2, 9, seed=int(torch.randint(0, 1000, (1,))))
    a = greedy_generate(ex, make_cache(cfg, 16, 2), prompts, 3)
    b = greedy_generate(graphed, make_cache(cfg, 16, 2), prompts, 3)
    assert a.tokens == b.tokens and graphed.replays == 0 and not graphed.graphs


@pytest.mark.gpu
def test_decode_replays_graphs_with_the_eager_tokens() -> None:
    """All-sparse tiny model on Hopper: every op is a kernel or sync-free, so decode steps replay graphs."""
    cfg = dataclasses.replace(get_preset("m3.1-tiny"), sparse_layers=(0, 1, 2))
    program, cfg, _ = compile_preset(cfg, target="hopper", cache=False)
    assert host_sync_ops(program) == []
    ex = Executor(program, "cuda")
    graphed = GraphedStep(ex)
    prompts = random_prompts(cfg, 3, 21, seed=int(torch.randint(0, 1000, (1,))))
    a = greedy_generate(ex, make_cache(cfg, 40, 3, "cuda"), prompts, 12)
    b = greedy_generate(graphed, make_cache(cfg, 40, 3, "cuda"), prompts, 12)
    assert graphed.eager_reason is None and graphed.replays == 12 and len(graphed.graphs) == 1
    assert a.tokens == b.tokens
