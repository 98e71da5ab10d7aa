"""CUDA-graph capture of decode steps: a step function (an Executor) wrapped so that small steps replay.

A step is a decode step when it has at most ``max_rows`` new tokens per request (1 in plain decoding,
up to 8 with speculative decoding); prefill steps run eagerly. The first decode step of a given shape (tokens T, requests R, block-table width, the cache tensors'
addresses) runs once eagerly as a warm-up (it writes the same K/V bytes the real step writes, so it is
idempotent), is captured into a CUDA graph on static input buffers, and every later step of that shape
copies its inputs into those buffers and replays the graph: one launch of the whole step instead of
one Python-driven launch per IR node.

A program whose graph still holds ops that synchronize with the host (torch references of MSA, MoE or
dense paged attention, which loop over requests with ``.tolist()``) cannot be captured; the wrapper
then runs every step eagerly and says why in :attr:`GraphedStep.eager_reason`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from m3c.ir.registry import get_op


def host_sync_ops(program: Any) -> list[str] | None:
    """The ops of `program` that run a host-synchronizing torch reference (``OpDef.host_sync``), so capture
    cannot work; None when `program` is not an m3c Program (nothing is known: capture is tried)."""
    if program is None or not hasattr(program, "graph"):
        return None
    plan = getattr(program, "launch_plan", [])
    listed = next((e["reference_ops"] for e in plan if "reference_ops" in e), None)
    if listed is None:  # a cpu program: every op is a reference
        listed = {n.op for n in program.graph.nodes}
    return sorted(op for op in set(listed) if get_op(op).host_sync)


class GraphedStep:
    """`step` with the model-forward signature; decode steps (<= `max_rows` rows per request) replay CUDA graphs."""

    def __init__(self, step: Callable[..., Any], program: Any = None, max_rows: int = 8, max_graphs: int = 8) -> None:
        self.step, self.max_rows, self.max_graphs = step, max_rows, max_graphs
        blocking = host_sync_ops(program if program is not None else getattr(step, "program", None))
        self.eager_reason: str | None = (f"ops {blocking} run host-synchronizing torch references"
                                         if blocking else None)
        self.graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, list[torch.Tensor], Any]] = {}
        self.replays = 0

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                 block_table: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                 kv_caches: Sequence[Mapping[str, torch.Tensor]]) -> Any:
        """The step's logits; replayed from a captured graph for decode-sized steps on a CUDA device."""
        inputs = [input_ids, positions, slot_mapping, block_table, query_start_loc, seq_lens]
        if self.eager_reason or input_ids.device.type != "cuda" or \
                input_ids.shape[0] > self.max_rows * seq_lens.shape[0]:
            return self.step(*inputs, kv_caches)
        key = (*(tuple(t.shape) for t in inputs),
               tuple(t.data_ptr() for c in kv_caches for t in c.values()))
        entry = self.graphs.get(key)
        if entry is None:
            entry = self._capture(inputs, kv_caches)
            if entry is None:
                return self.step(*inputs, kv_caches)
            if len(self.graphs) >= self.max_graphs:  # oldest first (a new cache or batch shape): free its pool
                self.graphs.pop(next(iter(self.graphs)))
            self.graphs[key] = entry
        graph, static, out = entry
        for dst, src in zip(static, inputs):
            dst.copy_(src, non_blocking=True)
        graph.replay()
        self.replays += 1
        return tuple(o.clone() for o in out) if isinstance(out, tuple) else out.clone()

    def _capture(self, inputs: list[torch.Tensor], kv_caches: Sequence[Mapping[str, torch.Tensor]]
                 ) -> tuple[torch.cuda.CUDAGraph, list[torch.Tensor], Any] | None:
        static = [t.clone() for t in inputs]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self.step(*static, kv_caches)  # warm-up: workspaces allocated, kernels loaded (idempotent writes)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                out = self.step(*static, kv_caches)
        except RuntimeError as e:  # an op synchronized with the host during capture
            torch.cuda.synchronize()
            self.eager_reason = f"capture failed: {str(e).splitlines()[0][:200]}"
            return None
        return graph, static, out
