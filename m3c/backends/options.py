"""CompileOptions: everything that changes what a compile produces, as one frozen, hashable record.

Like Triton's backend options, the record is also the compile-cache key (with the model config,
the graph hash and the m3c version): two compiles with equal options and inputs produce the same
artifact bytes. Debug switches that do not change the result (IR dumps, explain reports, progress
lines) are not options; they are arguments of :func:`m3c.compiler.compile_preset`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from typing import Any

from m3c.errors import CompileError
from m3c.model_defs.config import KV_CACHE_DTYPES, M3Config

MOE_PREFILL_PRECISIONS = ("bf16", "fp8")
"""MMA inputs of the MegaMoE grouped GEMMs' routed tiles on Hopper (the wgmma prefill kernels)."""


@dataclass(frozen=True)
class CompileOptions:
    """What to compile for and how (vLLM-style names where vLLM has one)."""

    target: str = "cpu"
    """Registry name of the target (``m3c targets`` lists them)."""
    kv_cache_dtype: str | None = None
    """Format of the cached K and V (nvfp4, fp8, bf16); None keeps the model config's."""
    indexer_kv_dtype: str | None = None
    """Format of the cached MSA index keys; None keeps the model config's."""
    block_size: int | None = None
    """Tokens per KV-cache block; for M3 it must equal the MSA block size (None: the config's)."""
    verify_each: bool = False
    """Run the IR verifier after every pass."""
    disable_passes: tuple[str, ...] = ()
    """Names of pipeline passes to leave out (sorted, so equal sets key alike)."""
    moe_prefill_precision: str | None = None
    """MMA inputs of the MegaMoE prefill's routed experts on Hopper: "bf16" (exact weights, ~0.5% error) or "fp8"
    (E4M3 weights, tokens and act: faster, ~5% error; benchmarks/RESULTS.md session 17); None: bf16."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "disable_passes", tuple(sorted(set(self.disable_passes))))
        for name in ("kv_cache_dtype", "indexer_kv_dtype"):
            value = getattr(self, name)
            if value is not None and value not in KV_CACHE_DTYPES:
                raise CompileError(f"{name}={value!r}: expected one of {', '.join(KV_CACHE_DTYPES)}")
        if self.moe_prefill_precision is not None and self.moe_prefill_precision not in MOE_PREFILL_PRECISIONS:
            raise CompileError(f"moe_prefill_precision={self.moe_prefill_precision!r}: expected one of "
                               f"{', '.join(MOE_PREFILL_PRECISIONS)}")
        if self.block_size is not None and self.block_size < 1:
            raise CompileError(f"block_size={self.block_size}: expected a positive number of tokens")

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready fields."""
        out = dataclasses.asdict(self)
        out["disable_passes"] = list(self.disable_passes)
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CompileOptions:
        """Options from :meth:`to_dict` output; unknown keys raise CompileError naming them."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise CompileError(f"unknown compile options {unknown}; known: {sorted(known)}")
        return cls(**data)

    def key(self) -> str:
        """A stable hex digest of the options (part of the compile-cache key)."""
        return hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True).encode()).hexdigest()

    def apply_to(self, cfg: M3Config) -> M3Config:
        """The model config these options ask for (cache formats replaced; block size checked)."""
        if self.block_size is not None and self.block_size != cfg.msa_block_size:
            raise CompileError(
                f"block_size={self.block_size}, but {cfg.name} uses {cfg.msa_block_size}-token MSA blocks and an "
                f"M3 KV-cache block is one MSA block; pass --block-size {cfg.msa_block_size} or leave it out"
            )
        changes = {k: v for k, v in (("kv_cache_dtype", self.kv_cache_dtype),
                                     ("indexer_kv_dtype", self.indexer_kv_dtype)) if v is not None}
        return cfg.replace(**changes) if changes else cfg
