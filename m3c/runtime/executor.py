"""The Executor: runs a compiled Program (or a loaded artifact) with the model's forward signature.

For the cpu target the program is the fused IR graph, run by the IR interpreter with the weights
bound to its ``param`` inputs. The paged KV cache belongs to the caller (as with the reference
model): ``kv_caches`` is the list of per-layer dicts of :mod:`m3c.model_defs.kv_cache`, and the
graph's ``state`` inputs ``kv.{layer}.{name}`` are bound to VIEWS of those very tensors, so the
cache writes the graph does land in the caller's cache. Bindings by the state input's IR dtype:

- ``nvfp4``: ``NVFP4Tensor(cache["{name}_data"], cache["{name}_scale"], None)``;
- anything else: ``cache[name]`` if the dict has that key (``k_scale``, the fp8 per-tensor scale),
  else ``cache["{name}_data"]`` (fp8 or bf16 data).

So ``greedy_generate(executor, cache, prompts, steps)`` drives a compiled program exactly like the
reference model.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from m3c.backends.program import Program
from m3c.backends.target import get_target
from m3c.errors import ShapeError, TargetError
from m3c.ir.graph import Graph, Value
from m3c.ir.interpreter import interpret
from m3c.ir.types import DType
from m3c.model_defs import quant
from m3c.runtime.artifact import load_artifact
from m3c.runtime.reference import RunReport

FORWARD_ARGS = ("input_ids", "positions", "slot_mapping", "block_table", "query_start_loc", "seq_lens")
"""The model-forward arguments before ``kv_caches``, by name (the graph's activation inputs use them)."""


def state_bindings(graph: Graph, kv_caches: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, Any]:
    """Runtime values for the graph's ``kv.{layer}.{name}`` state inputs, viewing the caller's cache tensors."""
    out: dict[str, Any] = {}
    for v in graph.inputs:
        if v.kind != "state":
            continue
        out[v.name] = _state_value(v, kv_caches)
    return out


def _state_value(v: Value, kv_caches: Sequence[Mapping[str, torch.Tensor]]) -> Any:
    parts = v.name.split(".")
    if len(parts) != 3 or parts[0] != "kv" or not parts[1].isdigit():
        raise ShapeError(f"state input %{v.name}: the executor binds state named kv.<layer>.<name> only")
    layer, name = int(parts[1]), parts[2]
    if layer >= len(kv_caches):
        raise ShapeError(f"state input %{v.name} needs layer {layer} of kv_caches, but only {len(kv_caches)} "
                         "layer caches were given; build the cache for the compiled model's config")
    cache = kv_caches[layer]

    def get(key: str) -> torch.Tensor:
        try:
            return cache[key]
        except KeyError:
            raise ShapeError(f"state input %{v.name} ({v.type}) needs kv_caches[{layer}][{key!r}], which is "
                             f"missing (it has {sorted(cache)}); was the cache built with the compiled "
                             "model's kv_cache_dtype?") from None

    if v.type.dtype == DType.nvfp4:
        return quant.NVFP4Tensor(get(f"{name}_data"), get(f"{name}_scale"), None)
    t = cache[name] if name in cache else get(f"{name}_data")
    if not v.type.dtype.is_quantized and t.dtype != v.type.dtype.to_torch():
        raise ShapeError(f"state input %{v.name} is {v.type} but kv_caches[{layer}] holds {t.dtype}; build the "
                         "cache with the compiled model's kv_cache_dtype")
    return t


class Executor:
    """Runs a Program on `device` (cpu target: through the IR interpreter).

    Call it like the model's forward, or use :meth:`run` with inputs by IR name.
    """

    def __init__(self, program: Any, device: torch.device | str | None = None, *, check_types: bool = False):
        program = getattr(program, "program", program)  # a LoadedArtifact carries its Program
        if not isinstance(program, Program):
            raise TypeError(f"Executor needs a Program or a loaded artifact, got {type(program).__name__}")
        target = get_target(program.target)
        self.program = program
        self.graph = program.graph
        self.device = torch.device(device or ("cuda" if target.runtime == "cuda" else "cpu"))
        self.check_types = check_types
        self.params = program.params(self.device)
        self.impls: dict[str, Any] = {}
        if target.runtime == "cuda":
            if self.device.type != "cuda" or not target.runnable_here():
                raise TargetError(f"a {target.name} program needs its GPU ({target.arch}); this machine or device "
                                  f"({self.device}) cannot run it — compile for --target cpu to run here")
            from m3c.runtime.cuda_ops import cuda_impls

            with torch.cuda.device(self.device):
                self.impls = cuda_impls(program, self.device)
        elif target.runtime != "cpu":
            raise TargetError(f"this m3c has no {target.runtime} launcher for target {target.name} yet; compile "
                              "for --target cpu (or hopper on an H100/H200)")
        self.activation_inputs = [v.name for v in self.graph.inputs if v.kind == "input"]
        self.calls = 0

    def run(self, inputs: Mapping[str, Any]) -> list[Any]:
        """The graph's outputs for activation and state inputs given by IR name (params are bound already)."""
        self.calls += 1
        if self.device.type == "cpu":
            return interpret(self.graph, {**inputs, **self.params}, check_types=self.check_types, impls=self.impls)
        with self.device:  # tensors the graph creates (arange, ...) are made on the executor's device
            return interpret(self.graph, {**inputs, **self.params}, check_types=self.check_types, impls=self.impls)

    @torch.no_grad()
    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                 block_table: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                 kv_caches: Sequence[Mapping[str, torch.Tensor]]) -> Any:
        """Logits for the new tokens (the model's forward signature); cache writes land in `kv_caches`."""
        given = dict(zip(FORWARD_ARGS, (input_ids, positions, slot_mapping, block_table, query_start_loc, seq_lens)))
        unknown = [n for n in self.activation_inputs if n not in given]
        if unknown:
            raise ShapeError(f"the compiled graph takes inputs {self.activation_inputs}, not the model-forward "
                             f"arguments {list(FORWARD_ARGS)} (unknown: {unknown}); call Executor.run with inputs "
                             "by name instead")
        inputs = {n: given[n] for n in self.activation_inputs}
        inputs.update(state_bindings(self.graph, kv_caches))
        outs = self.run(inputs)
        return outs[0] if len(outs) == 1 else tuple(outs)


@dataclass
class ArtifactRunReport(RunReport):
    """A RunReport of a compiled artifact's run (the same lines, naming the artifact as the path)."""

    artifact: str = ""
    target: str = ""
    graphs: str = ""

    def text(self) -> str:
        """A short human-readable report."""
        text = super().text().replace(f"path: reference on {self.device}",
                                      f"path: artifact {self.artifact} ({self.target} target) on {self.device}")
        return text + (f"\ngraphs    {self.graphs}" if self.graphs else "")


def run_artifact(path: str, prompt_tokens: int = 40, decode_steps: int = 16, batch: int = 1,
                 prefill_chunk: int | None = None, seed: int = 0, device: str = "auto",
                 cuda_graphs: bool = True) -> ArtifactRunReport:
    """Load an artifact, prefill `batch` random prompts and decode greedily through the Executor.

    Prompts are drawn exactly as :func:`m3c.runtime.reference.run_reference` draws them for the
    same `seed`, so a compiled run and a reference run of the same weights can be compared. On a GPU,
    decode steps replay CUDA graphs (:class:`m3c.runtime.cuda_graphs.GraphedStep`) unless `cuda_graphs`
    is False or the program still runs host-synchronizing references (the report says which).
    """
    from m3c.model_defs.generate import greedy_generate, make_cache
    from m3c.runtime.reference import resolve_device

    if prompt_tokens < 1 or decode_steps < 0 or batch < 1:
        raise ShapeError("--prompt-tokens and --batch must be >= 1 and --decode-steps >= 0")
    dev = resolve_device(device)
    loaded = load_artifact(path, dev)
    cfg = loaded.cfg
    if cfg is None:
        raise ShapeError(f"{path}: not an M3 model artifact (no config), so `m3c run` cannot generate with it; "
                         "load it with m3c.load_artifact and call Executor.run")
    executor: Any = Executor(loaded, dev)
    graphs = ""
    if cuda_graphs and torch.device(dev).type == "cuda":
        from m3c.runtime.cuda_graphs import GraphedStep

        executor = GraphedStep(executor)
    gen = torch.Generator().manual_seed(seed + 1)
    prompts = [torch.randint(0, cfg.vocab_size, (prompt_tokens,), generator=gen).tolist() for _ in range(batch)]
    cache = make_cache(cfg, prompt_tokens + decode_steps + 1, batch, device=dev)
    result = greedy_generate(executor, cache, prompts, decode_steps, prefill_chunk)
    if hasattr(executor, "replays"):
        graphs = (f"decode steps eager: {executor.eager_reason}" if executor.eager_reason
                  else f"decode replayed CUDA graphs {executor.replays}× ({len(executor.graphs)} captured)")

    return ArtifactRunReport(cfg, dev, prompt_tokens, batch, result, artifact=str(path), target=loaded.target,
                             graphs=graphs)
