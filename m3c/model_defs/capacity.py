"""The capacity planner: how many sequences of a given context length fit on a set of GPUs.

Every byte count comes from the model's own layouts: K/V and index-key bytes from
:mod:`m3c.model_defs.kv_cache`, weight bytes from :func:`m3c.model_defs.weights.weight_specs` /
:func:`~m3c.model_defs.weights.checkpoint_nbytes`. Nothing here re-derives a byte count.

Memory model (per GPU, all sizes in decimal bytes; GB = 1e9, as GPU vendors publish them)::

    usable  = memory × gpu_memory_utilization          (vLLM's --gpu-memory-utilization, default 0.9)
    free    = usable − weights_per_gpu − activation_reserve_bytes   (reserve default 4 GB)
    blocks  = floor(free / (cache_bytes_per_token_per_gpu × msa_block_size))
    seqs    = dp × floor(blocks / ceil(context / msa_block_size))

Assumptions:
- The reserve stands for everything that is neither weights nor KV cache (activations of a prefill
  chunk, MoE workspaces, CUDA graphs, NCCL buffers). 4 GB is a round guess, not fitted to anything.
- Tensor parallelism (``tp``) splits the K/V heads across the GPUs of a group, but the one shared
  index-key head is replicated on every rank. Data parallelism (``dp``) replicas hold their own
  sequences in full. All GPUs of a TP group hold the same sequences, so the group is limited by one
  GPU's free memory.
- Weights: routed experts are split over ``ep`` GPUs (each holds ``n_routed_experts / ep`` experts);
  the other matrices (attention projections, index-query projection, shared experts, embedding,
  lm_head) are split over ``tp`` and replicated over ``dp``; norms, router, its bias and the
  single-head index-key projection are replicated on every GPU.
- KV is allocated in whole ``msa_block_size``-token blocks; per-tensor FP8 scales (a few bytes per
  layer) and the drafter's cache are ignored.

Published capacity point (shared/M31_FACTS.md): 4× B300, DEP4 (dp=4, tp=1, ep=4), 256K-token
sequences: 76 sequences for M3.1 (NVFP4 K/V and index keys, NVFP4 routed experts) vs 28 for M3
(FP8 K/V and index keys, MXFP8 routed experts). With the defaults above this model predicts
**68 vs 28** (2.43× instead of ≈2.7×); no factor was tuned to close the gap. Per GPU: M3.1 weights
74.9 GB, free 180.3 GB, 10.19 GB per sequence (38,880 B/token) -> 17.7, so 17 per GPU; 19 per GPU
would need 193.6 GB free. M3: weights 125.8 GB, free 129.4 GB, 18.12 GB per sequence -> 7.1, so 7.
Likely reasons for the M3.1 gap, none verifiable here: the preset's guess that all 60 layers are
sparse (with 3 to 23 sparse layers, i.e. fewer index-key caches, both points reproduce at these
defaults), a higher utilization in the published run (0.935-0.94 with no reserve, or 0.95 with
4 GB, reproduces both, in a narrow window), or a published count that leaves the index keys out
(then 76 vs 32). Our checkpoint is also 3.3% (8.2 GB) larger than the published 250.1 GB: ~2 GB
per GPU if the excess is in the routed experts, 8.2 GB if it were all in replicated weights; 19 per
GPU needs 13.3 GB more free memory than we find.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from dataclasses import dataclass
from typing import Any

from m3c.errors import PlanError
from m3c.model_defs.config import M3Config
from m3c.model_defs.kv_cache import (
    indexer_bytes_per_token,
    kv_bytes_per_token,
    layer_cached_tensors,
)
from m3c.model_defs.weights import WeightSpec, checkpoint_nbytes, weight_specs

GB = 10**9
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9
DEFAULT_ACTIVATION_RESERVE_BYTES = 4 * GB


@dataclass(frozen=True)
class GPUSpec:
    """One accelerator: its memory in decimal bytes (vendor's 'GB' × 1e9) and where the figure comes from."""

    name: str
    memory_bytes: int
    vendor: str
    note: str = ""


GPUS: dict[str, GPUSpec] = {
    g.name: g
    for g in (
        GPUSpec("h200", 141 * GB, "NVIDIA H200", "141 GB HBM3e"),
        GPUSpec("b200", 180 * GB, "NVIDIA B200", "180 GB HBM3e"),
        GPUSpec("b300", 288 * GB, "NVIDIA B300", "Blackwell Ultra, 288 GB HBM3e"),
        GPUSpec("gb300", 288 * GB, "NVIDIA GB300", "Grace Blackwell Ultra superchip, 288 GB HBM3e per GPU"),
        GPUSpec("rubin", 288 * GB, "NVIDIA Rubin", "288 GB HBM4; announced figure, not a shipping spec"),
        GPUSpec("mi355x", 288 * GB, "AMD Instinct MI355X", "288 GB HBM3E"),
    )
}
"""Known GPUs by lower-case name. Vendors publish decimal GB; the driver may report a slightly different usable size."""


def get_gpu(gpu: str | GPUSpec) -> GPUSpec:
    """The GPU called `gpu` (case-insensitive), or `gpu` itself; an unknown name raises PlanError listing the known ones."""
    if isinstance(gpu, GPUSpec):
        return gpu
    try:
        return GPUS[gpu.strip().lower()]
    except KeyError:
        raise PlanError(f"unknown GPU {gpu!r}; known GPUs: {', '.join(GPUS)}") from None


_CONTEXT_RE = re.compile(r"^(\d+)([km]?)$")
_CONTEXT_UNITS = {"": 1, "k": 1024, "m": 1024 * 1024}


def parse_context(text: str | int) -> int:
    """Tokens in a context length: '262144', '256k' (k = 1024) or '1m' (m = 1048576); PlanError otherwise."""
    if isinstance(text, bool):
        raise PlanError(f"context {text!r}: expected a token count like 262144, 256k or 1m")
    if isinstance(text, int):
        value = text
    else:
        match = _CONTEXT_RE.match(str(text).strip().lower().replace("_", ""))
        if not match:
            raise PlanError(
                f"context {text!r}: expected a token count like 262144, 256k or 1m (k = 1024, m = 1048576)"
            )
        value = int(match.group(1)) * _CONTEXT_UNITS[match.group(2)]
    if value <= 0:
        raise PlanError(f"context {text!r}: must be at least 1 token")
    return value


@dataclass(frozen=True)
class Layout:
    """How the model is spread over GPUs: ``tp × dp`` GPUs in all.

    - ``tp``: tensor parallelism inside one replica (attention heads, shared experts, embedding split).
    - ``dp``: data-parallel replicas of the attention, each serving its own sequences.
    - ``ep``: GPUs the routed experts are spread over; default ``tp × dp`` (every GPU holds
      ``n_routed_experts / ep`` experts). ``Layout.dep(n)`` is vLLM's "DEP": data-parallel
      attention + expert-parallel MoE (tp=1, dp=n, ep=n).
    """

    tp: int = 1
    dp: int = 1
    ep: int | None = None

    def __post_init__(self) -> None:
        for name in ("tp", "dp"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise PlanError(f"{name}={value!r}: expected a positive integer")
        if self.ep is None:
            object.__setattr__(self, "ep", self.tp * self.dp)
        ep = self.ep
        if not isinstance(ep, int) or isinstance(ep, bool) or ep < 1:
            raise PlanError(f"ep={ep!r}: expected a positive integer")
        if self.num_gpus % ep:
            raise PlanError(
                f"ep={ep} does not divide the {self.num_gpus} GPUs (tp={self.tp} × dp={self.dp}); "
                "experts are spread over ep GPUs and replicated over the rest"
            )

    @classmethod
    def dep(cls, n: int) -> Layout:
        """DEP-n: n data-parallel attention replicas with the routed experts spread over all n GPUs."""
        return cls(tp=1, dp=n, ep=n)

    @property
    def num_gpus(self) -> int:
        """GPUs in the whole system."""
        return self.tp * self.dp

    @property
    def expert_shards(self) -> int:
        """``ep`` as a plain int (it is always set after construction)."""
        assert self.ep is not None
        return self.ep

    def describe(self) -> str:
        """Short name: 'TP4', 'DEP4' or 'TP2 × DP2, EP4'."""
        if self.tp == 1 and self.dp > 1 and self.ep == self.dp:
            return f"DEP{self.dp}"
        parts = [f"TP{self.tp}"] + ([f"DP{self.dp}"] if self.dp > 1 else [])
        name = " × ".join(parts)
        return name if self.ep == self.num_gpus else f"{name}, EP{self.ep}"

    def check(self, cfg: M3Config) -> None:
        """Raise PlanError if `cfg`'s heads or experts cannot be split this way."""
        if cfg.num_key_value_heads % self.tp:
            raise PlanError(
                f"tp={self.tp} does not divide num_key_value_heads={cfg.num_key_value_heads}: tensor "
                f"parallelism gives each GPU whole KV heads (GQA groups); use a tp that divides "
                f"{cfg.num_key_value_heads}, and dp for more GPUs"
            )
        if cfg.n_routed_experts % self.expert_shards:
            raise PlanError(
                f"ep={self.ep} does not divide n_routed_experts={cfg.n_routed_experts}: every GPU must hold "
                "the same number of whole experts"
            )


@dataclass(frozen=True)
class WeightBytes:
    """Checkpoint bytes by how they are placed on GPUs."""

    checkpoint: int
    routed_experts: int
    tp_split: int
    replicated: int

    def per_gpu(self, layout: Layout) -> int:
        """Bytes of weights one GPU holds under `layout`."""
        return self.routed_experts // layout.expert_shards + -(-self.tp_split // layout.tp) + self.replicated


def _placement(spec: WeightSpec) -> str:
    """'expert' (split over ep), 'replicated' (every GPU) or 'tp' (split over tp) for one weight."""
    if ".mlp.experts." in spec.name:
        return "expert"
    if len(spec.shape) == 1 or spec.name.endswith((".mlp.gate", ".index_k_proj")):
        return "replicated"  # norms, router + bias, and the one shared index-key head's projection
    return "tp"


@functools.lru_cache(maxsize=16)
def weight_bytes(cfg: M3Config) -> WeightBytes:
    """The checkpoint's bytes split by placement (cached: the full model has ~47k weights)."""
    parts = {"expert": 0, "tp": 0, "replicated": 0}
    for spec in weight_specs(cfg):
        parts[_placement(spec)] += spec.nbytes()
    total = checkpoint_nbytes(cfg)
    assert total == sum(parts.values()), "weight placement must cover every checkpoint tensor once"
    return WeightBytes(total, parts["expert"], parts["tp"], parts["replicated"])


def _layer_bytes_per_token(cfg: M3Config, layer: int, names: tuple[str, ...]) -> int:
    """Cache bytes per token of layer `layer`'s cached tensors called `names`."""
    return int(sum(t.bytes_per_token() for t in layer_cached_tensors(cfg, layer) if t.name in names))


@dataclass(frozen=True)
class Plan:
    """What fits: cache bytes per token, weights per GPU and the number of concurrent sequences.

    Byte fields are decimal bytes. ``fp8_kv`` is the same plan with an FP8 K/V and index-key cache
    (weights unchanged), for comparison; it is None on that comparison plan itself.
    """

    model: str
    gpu: GPUSpec
    layout: Layout
    context_tokens: int
    gpu_memory_utilization: float
    activation_reserve_bytes: int
    kv_cache_dtype: str
    indexer_kv_dtype: str
    num_layers: int
    num_sparse_layers: int
    kv_bytes_per_token_per_layer: int
    kv_bytes_per_token: int
    index_bytes_per_token_per_sparse_layer: int
    index_bytes_per_token: int
    cache_bytes_per_token: int
    cache_bytes_per_token_per_gpu: int
    sequence_tokens: int
    kv_bytes_per_sequence: int
    kv_bytes_per_sequence_per_gpu: int
    checkpoint_bytes: int
    weight_bytes_per_gpu: int
    free_bytes_per_gpu: int
    kv_blocks_per_gpu: int
    sequences_per_replica: int
    max_sequences: int
    fp8_kv: Plan | None = None

    @property
    def weights_fit(self) -> bool:
        """Whether the weights (plus the reserve) fit in the usable memory of each GPU."""
        return self.free_bytes_per_gpu >= 0

    @property
    def cache_bytes_ratio(self) -> float | None:
        """This plan's cache bytes per token ÷ the FP8 plan's (0.5625 for NVFP4)."""
        return self.cache_bytes_per_token / self.fp8_kv.cache_bytes_per_token if self.fp8_kv else None

    @property
    def sequences_ratio(self) -> float | None:
        """This plan's max sequences ÷ the FP8 plan's (None without a comparison or when FP8 fits none)."""
        if self.fp8_kv is None or self.fp8_kv.max_sequences == 0:
            return None
        return self.max_sequences / self.fp8_kv.max_sequences

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready contents, with the layout's GPU count and the FP8 ratios."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "fp8_kv"}
        out["gpu"] = dataclasses.asdict(self.gpu)
        out["layout"] = {**dataclasses.asdict(self.layout), "num_gpus": self.layout.num_gpus,
                         "name": self.layout.describe()}
        out["weights_fit"] = self.weights_fit
        if self.fp8_kv is not None:
            out["fp8_kv"] = self.fp8_kv.to_dict()
            out["cache_bytes_ratio"] = self.cache_bytes_ratio
            out["sequences_ratio"] = self.sequences_ratio
        return out

    def table(self) -> str:
        """A readable side-by-side table of this plan and its FP8-KV comparison."""
        cols = [self] + ([self.fp8_kv] if self.fp8_kv else [])
        head = [f"K/V {p.kv_cache_dtype}, idx {p.indexer_kv_dtype}" for p in cols]

        def count(v: int) -> str:
            return f"{v:,}"

        def gb(v: int) -> str:
            return f"{v / GB:,.2f} GB"

        rows: list[tuple[str, Any]] = [
            ("K/V bytes/token per layer", lambda p: count(p.kv_bytes_per_token_per_layer)),
            (f"K/V bytes/token ({self.num_layers} layers)", lambda p: count(p.kv_bytes_per_token)),
            ("index-key bytes/token per sparse layer", lambda p: count(p.index_bytes_per_token_per_sparse_layer)),
            (f"index-key bytes/token ({self.num_sparse_layers} sparse layers)",
             lambda p: count(p.index_bytes_per_token)),
            ("cache bytes/token (K/V + index keys)", lambda p: count(p.cache_bytes_per_token)),
            (f"cache bytes/token per GPU (K/V ÷ tp={self.layout.tp})", lambda p: count(p.cache_bytes_per_token_per_gpu)),
            (f"KV cache per sequence ({self.sequence_tokens:,} tokens)", lambda p: gb(p.kv_bytes_per_sequence)),
            ("KV cache per sequence per GPU", lambda p: gb(p.kv_bytes_per_sequence_per_gpu)),
            ("checkpoint (all weights)", lambda p: gb(p.checkpoint_bytes)),
            ("weights per GPU", lambda p: gb(p.weight_bytes_per_gpu)),
            ("free for KV cache per GPU", lambda p: gb(p.free_bytes_per_gpu)),
            (f"sequences per replica (dp={self.layout.dp})", lambda p: count(p.sequences_per_replica)),
            ("max concurrent sequences", lambda p: count(p.max_sequences)),
        ]
        cells = [(label, [fn(p) for p in cols]) for label, fn in rows]
        w0 = max(len(label) for label, _ in cells)
        ws = [max(len(head[i]), *(len(vals[i]) for _, vals in cells)) for i in range(len(cols))]
        g = self.gpu
        lines = [
            f"{self.model} on {self.layout.num_gpus}× {g.vendor} ({g.memory_bytes / GB:,.0f} GB each), "
            f"{self.layout.describe()} (tp={self.layout.tp}, dp={self.layout.dp}, ep={self.layout.ep}), "
            f"{self.context_tokens:,}-token context",
            f"memory model: {self.gpu_memory_utilization:.0%} of each GPU usable, "
            f"{self.activation_reserve_bytes / GB:,.1f} GB per GPU reserved for activations; GB = 1e9 bytes",
            "",
            "  ".join([" " * w0, *(h.rjust(w) for h, w in zip(head, ws))]),
        ]
        lines += ["  ".join([label.ljust(w0), *(v.rjust(w) for v, w in zip(vals, ws))]) for label, vals in cells]
        if self.fp8_kv is not None:
            ratio = self.sequences_ratio
            lines += [
                "",
                f"cache bytes vs FP8: {self.cache_bytes_ratio:.4f}×; sequences vs FP8: "
                + (f"{ratio:.2f}×" if ratio is not None else "n/a (FP8 fits none)"),
            ]
        if not self.weights_fit:
            lines.append("warning: the weights alone do not fit; use more GPUs (tp, dp/ep) or a larger GPU")
        return "\n".join(lines)


def plan(
    cfg: M3Config,
    gpu: str | GPUSpec,
    layout: Layout,
    context_tokens: int | str,
    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION,
    activation_reserve_bytes: int = DEFAULT_ACTIVATION_RESERVE_BYTES,
    compare_fp8: bool = True,
) -> Plan:
    """Plan `cfg` on ``layout.num_gpus`` × `gpu` at `context_tokens` per sequence (see the module docstring).

    Raises PlanError for an unknown GPU, a layout that does not split the heads or experts, a context
    that is not positive or exceeds ``max_position_embeddings``, or a utilization outside (0, 1].
    """
    spec = get_gpu(gpu)
    layout.check(cfg)
    context = parse_context(context_tokens)
    if context > cfg.max_position_embeddings:
        raise PlanError(
            f"context {context:,} tokens exceeds the model's max_position_embeddings={cfg.max_position_embeddings:,}"
        )
    if not 0 < gpu_memory_utilization <= 1:
        raise PlanError(f"gpu_memory_utilization={gpu_memory_utilization}: must be in (0, 1]")
    if activation_reserve_bytes < 0:
        raise PlanError(f"activation_reserve_bytes={activation_reserve_bytes}: must be >= 0")

    sparse = [i for i in range(cfg.num_hidden_layers) if cfg.is_sparse(i)]
    kv = kv_bytes_per_token(cfg)
    index = indexer_bytes_per_token(cfg)
    # K/V heads are split over the tp ranks (layout.check: tp divides them); the index-key head is replicated.
    per_gpu = -(-kv // layout.tp) + index
    block = cfg.msa_block_size
    blocks_per_seq = -(-context // block)
    weights = weight_bytes(cfg)
    weights_per_gpu = weights.per_gpu(layout)
    free = math.floor(spec.memory_bytes * gpu_memory_utilization) - weights_per_gpu - int(activation_reserve_bytes)
    blocks = max(free, 0) // (per_gpu * block)
    per_replica = blocks // blocks_per_seq
    fp8 = None
    if compare_fp8:
        fp8 = plan(
            cfg.replace(kv_cache_dtype="fp8", indexer_kv_dtype="fp8"), spec, layout, context,
            gpu_memory_utilization, activation_reserve_bytes, compare_fp8=False,
        )
    return Plan(
        model=cfg.name,
        gpu=spec,
        layout=layout,
        context_tokens=context,
        gpu_memory_utilization=gpu_memory_utilization,
        activation_reserve_bytes=int(activation_reserve_bytes),
        kv_cache_dtype=cfg.quant.kv_cache_dtype,
        indexer_kv_dtype=cfg.quant.indexer_kv_dtype,
        num_layers=cfg.num_hidden_layers,
        num_sparse_layers=len(sparse),
        kv_bytes_per_token_per_layer=_layer_bytes_per_token(cfg, 0, ("k", "v")),
        kv_bytes_per_token=kv,
        index_bytes_per_token_per_sparse_layer=_layer_bytes_per_token(cfg, sparse[0], ("index_k",)) if sparse else 0,
        index_bytes_per_token=index,
        cache_bytes_per_token=kv + index,
        cache_bytes_per_token_per_gpu=per_gpu,
        sequence_tokens=blocks_per_seq * block,
        kv_bytes_per_sequence=(kv + index) * blocks_per_seq * block,
        kv_bytes_per_sequence_per_gpu=per_gpu * blocks_per_seq * block,
        checkpoint_bytes=weights.checkpoint,
        weight_bytes_per_gpu=weights_per_gpu,
        free_bytes_per_gpu=free,
        kv_blocks_per_gpu=blocks,
        sequences_per_replica=per_replica,
        max_sequences=layout.dp * per_replica,
        fp8_kv=fp8,
    )
