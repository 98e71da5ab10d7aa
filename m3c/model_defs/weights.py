"""Every weight of an M3 checkpoint: its HF name, logical shape and storage format.

One list, read by the reference model (which buffers to create), the checkpoint loader and writer
(which tensors a file must hold, with which shapes and dtypes) and the capacity planner (how many
bytes the weights take). Logical shapes are those of the dequantized matrix `[out, in]`.

Stored tensors per format (ModelOpt / HF naming):
- ``bf16``: ``<name>.weight`` bfloat16 ``[out, in]``.
- ``f32``: ``<name>`` float32 (the router's score-correction bias).
- ``mxfp8``: ``<name>.weight`` float8_e4m3fn ``[out, in]`` and ``<name>.weight_scale`` uint8 (E8M0)
  ``[out, in/32]``.
- ``nvfp4``: ``<name>.weight`` uint8 ``[out, in/2]`` (two E2M1 codes a byte), ``<name>.weight_scale``
  float8_e4m3fn ``[out, in/16]``, ``<name>.weight_scale_2`` float32 ``[]`` (per-tensor scale) and
  ``<name>.input_scale`` float32 ``[]`` (activation scale; optional, unused by the reference).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from m3c.model_defs.config import M3Config

FORMATS = ("bf16", "f32", "mxfp8", "nvfp4")


@dataclass(frozen=True)
class WeightSpec:
    """One logical weight: HF name (without the `.weight` suffix), logical shape, storage format."""

    name: str
    shape: tuple[int, ...]
    fmt: str

    def stored(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """The checkpoint tensors this weight is stored as: full name -> (shape, dtype)."""
        if self.fmt == "f32":
            return {self.name: (self.shape, torch.float32)}
        if self.fmt == "bf16":
            return {f"{self.name}.weight": (self.shape, torch.bfloat16)}
        *lead, k = self.shape
        if self.fmt == "mxfp8":
            return {
                f"{self.name}.weight": (self.shape, torch.float8_e4m3fn),
                f"{self.name}.weight_scale": ((*lead, k // 32), torch.uint8),
            }
        if self.fmt == "nvfp4":
            return {
                f"{self.name}.weight": ((*lead, k // 2), torch.uint8),
                f"{self.name}.weight_scale": ((*lead, k // 16), torch.float8_e4m3fn),
                f"{self.name}.weight_scale_2": ((), torch.float32),
            }
        raise ValueError(f"unknown weight format {self.fmt!r}")

    def optional(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Tensors a checkpoint may carry for this weight but need not (NVFP4 activation scales)."""
        if self.fmt == "nvfp4":
            return {f"{self.name}.input_scale": ((), torch.float32)}
        return {}

    def nbytes(self) -> int:
        """Bytes the stored tensors take."""
        total = 0
        for shape, dtype in self.stored().values():
            n = 1
            for d in shape:
                n *= d
            total += n * dtype.itemsize
        return total


def layer_prefix(i: int) -> str:
    """HF name prefix of decoder layer `i`."""
    return f"model.layers.{i}"


def layer_weight_specs(cfg: M3Config, i: int) -> list[WeightSpec]:
    """The weights of decoder layer `i`."""
    p = layer_prefix(i)
    h, proj, routed = cfg.hidden_size, cfg.quant.proj_dtype, cfg.quant.routed_expert_dtype
    specs = [
        WeightSpec(f"{p}.input_layernorm", (h,), "bf16"),
        WeightSpec(f"{p}.self_attn.q_proj", (cfg.q_size, h), proj),
        WeightSpec(f"{p}.self_attn.k_proj", (cfg.kv_size, h), proj),
        WeightSpec(f"{p}.self_attn.v_proj", (cfg.kv_size, h), proj),
        WeightSpec(f"{p}.self_attn.o_proj", (h, cfg.q_size), proj),
        WeightSpec(f"{p}.self_attn.q_norm", (cfg.head_dim,), "bf16"),
        WeightSpec(f"{p}.self_attn.k_norm", (cfg.head_dim,), "bf16"),
    ]
    if cfg.is_sparse(i):
        specs += [
            WeightSpec(f"{p}.self_attn.index_q_proj", (cfg.index_q_size, h), proj),
            WeightSpec(f"{p}.self_attn.index_k_proj", (cfg.index_head_dim, h), proj),
            WeightSpec(f"{p}.self_attn.index_q_norm", (cfg.index_head_dim,), "bf16"),
            WeightSpec(f"{p}.self_attn.index_k_norm", (cfg.index_head_dim,), "bf16"),
        ]
    specs += [
        WeightSpec(f"{p}.post_attention_layernorm", (h,), "bf16"),
        WeightSpec(f"{p}.mlp.gate", (cfg.n_routed_experts, h), "bf16"),
        WeightSpec(f"{p}.mlp.gate.e_score_correction_bias", (cfg.n_routed_experts,), "f32"),
    ]
    inter = cfg.moe_intermediate_size
    for e in range(cfg.n_routed_experts):
        q = f"{p}.mlp.experts.{e}"
        specs += [
            WeightSpec(f"{q}.gate_proj", (inter, h), routed),
            WeightSpec(f"{q}.up_proj", (inter, h), routed),
            WeightSpec(f"{q}.down_proj", (h, inter), routed),
        ]
    if cfg.n_shared_experts:
        s_inter = inter * cfg.n_shared_experts
        q = f"{p}.mlp.shared_experts"
        specs += [
            WeightSpec(f"{q}.gate_proj", (s_inter, h), proj),
            WeightSpec(f"{q}.up_proj", (s_inter, h), proj),
            WeightSpec(f"{q}.down_proj", (h, s_inter), proj),
        ]
    return specs


def weight_specs(cfg: M3Config) -> list[WeightSpec]:
    """Every weight of the model, in checkpoint order."""
    specs = [WeightSpec("model.embed_tokens", (cfg.vocab_size, cfg.hidden_size), "bf16")]
    for i in range(cfg.num_hidden_layers):
        specs += layer_weight_specs(cfg, i)
    specs.append(WeightSpec("model.norm", (cfg.hidden_size,), "bf16"))
    if not cfg.tie_word_embeddings:
        specs.append(WeightSpec("lm_head", (cfg.vocab_size, cfg.hidden_size), "bf16"))
    return specs


def checkpoint_nbytes(cfg: M3Config) -> int:
    """Bytes of every stored checkpoint tensor (without the optional activation scales)."""
    return sum(s.nbytes() for s in weight_specs(cfg))
