"""The MiniMax-M3 reference model in plain PyTorch (the truth every compiled kernel is checked against).

One forward step runs a flattened batch of requests (vLLM style): ``input_ids`` / ``positions`` /
``slot_mapping`` are per new token, ``query_start_loc`` / ``seq_lens`` / ``block_table`` per
request (see :class:`m3c.model_defs.kv_cache.BatchMetadata`). The same code serves prefill (chunked,
against an existing cache) and decode (1–8 rows per request). Per decoder layer:

RMSNorm → one projection over the concatenated q/k/v/index-q/index-k weights → split → per-head
RMSNorm on q, k, index-q, index-k → partial RoPE on the four → K, V, index-K quantized into the
paged cache (``kv_cache_dtype`` / ``indexer_kv_dtype``) → MSA (indexer block scores → top-k block
select → sparse attention) or, on dense layers, causal attention over the cache → o_proj →
residual → RMSNorm → MoE → residual. Then the final norm and the LM head.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from m3c.errors import CheckpointError, ShapeError
from m3c.model_defs.config import M3Config
from m3c.model_defs.kv_cache import BatchMetadata, PagedKVCache, layer_cached_tensors
from m3c.model_defs.layers import MoE, QuantLinear, apply_rope, rms_norm, rope_cos_sin
from m3c.model_defs.weights import layer_prefix


def _norm_weight(dim: int, device: torch.device | str | None) -> torch.Tensor:
    return torch.empty(dim, dtype=torch.bfloat16, device=device)


class Attention(nn.Module):
    """Projections, per-head norms, RoPE, paged-cache writes and MSA (or dense) attention of one layer."""

    def __init__(self, cfg: M3Config, layer: int, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.cfg, self.layer, self.sparse = cfg, layer, cfg.is_sparse(layer)
        self.split_sizes = cfg.qkv_split_sizes(layer)
        proj = cfg.quant.proj_dtype
        self.qkv_proj = QuantLinear(cfg.hidden_size, sum(self.split_sizes), proj, device=device)
        self.o_proj = QuantLinear(cfg.q_size, cfg.hidden_size, proj, device=device)
        self.register_buffer("q_norm", _norm_weight(cfg.head_dim, device))
        self.register_buffer("k_norm", _norm_weight(cfg.head_dim, device))
        if self.sparse:
            self.register_buffer("index_q_norm", _norm_weight(cfg.index_head_dim, device))
            self.register_buffer("index_k_norm", _norm_weight(cfg.index_head_dim, device))
        self.cached = {t.name: t for t in layer_cached_tensors(cfg, layer)}

    def _write(self, name: str, x: torch.Tensor, slot_mapping: torch.Tensor, cache: dict[str, torch.Tensor]) -> None:
        """Quantize x [T, heads, dim] to the cache's format and store it at `slot_mapping`."""
        fmt = self.cached[name].dtype
        if fmt == "nvfp4":
            data, scale = torch.ops.m3c.nvfp4_quantize(x)
            torch.ops.m3c.paged_write(data, slot_mapping, cache[f"{name}_data"])
            torch.ops.m3c.paged_write(scale, slot_mapping, cache[f"{name}_scale"])
        elif fmt == "fp8":
            data = torch.ops.m3c.fp8_quantize(x, cache[f"{name}_scale"])
            torch.ops.m3c.paged_write(data, slot_mapping, cache[f"{name}_data"])
        else:
            torch.ops.m3c.paged_write(x.to(torch.bfloat16), slot_mapping, cache[f"{name}_data"])

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                slot_mapping: torch.Tensor, block_table: torch.Tensor, query_start_loc: torch.Tensor,
                seq_lens: torch.Tensor, cache: dict[str, torch.Tensor]) -> torch.Tensor:
        """Attention output [T, hidden] for normed hidden states x [T, hidden]."""
        cfg, t = self.cfg, x.shape[0]
        parts = torch.split(self.qkv_proj(x), self.split_sizes, dim=-1)
        q = parts[0].view(t, cfg.num_attention_heads, cfg.head_dim)
        k = parts[1].view(t, cfg.num_key_value_heads, cfg.head_dim)
        v = parts[2].view(t, cfg.num_key_value_heads, cfg.head_dim)
        q = apply_rope(rms_norm(q, self.q_norm, cfg.rms_norm_eps), cos, sin)
        k = apply_rope(rms_norm(k, self.k_norm, cfg.rms_norm_eps), cos, sin)
        self._write("k", k, slot_mapping, cache)
        self._write("v", v, slot_mapping, cache)
        fmt = cfg.quant.kv_cache_dtype
        ks, vs = cache.get("k_scale"), cache.get("v_scale")
        bs, scale = cfg.msa_block_size, 1.0 / math.sqrt(cfg.head_dim)
        if self.sparse:
            iq = parts[3].view(t, cfg.index_n_heads, cfg.index_head_dim)
            ik = parts[4].view(t, 1, cfg.index_head_dim)
            iq = apply_rope(rms_norm(iq, self.index_q_norm, cfg.rms_norm_eps), cos, sin)
            ik = apply_rope(rms_norm(ik, self.index_k_norm, cfg.rms_norm_eps), cos, sin)
            self._write("index_k", ik, slot_mapping, cache)
            scores = torch.ops.m3c.indexer_block_scores(
                iq, cache["index_k_data"], cache.get("index_k_scale"), cfg.quant.indexer_kv_dtype,
                positions, query_start_loc, seq_lens, block_table, bs)
            selected = torch.ops.m3c.select_blocks(scores, positions, bs, cfg.msa_topk_blocks)
            out = torch.ops.m3c.sparse_attention(
                q, cache["k_data"], ks, cache["v_data"], vs, fmt, selected,
                positions, query_start_loc, seq_lens, block_table, bs, scale)
        else:
            out = torch.ops.m3c.paged_attention(
                q, cache["k_data"], ks, cache["v_data"], vs, fmt,
                positions, query_start_loc, seq_lens, block_table, bs, scale)
        return self.o_proj(out.reshape(t, cfg.q_size))


class DecoderLayer(nn.Module):
    """Pre-norm attention and MoE with residuals."""

    def __init__(self, cfg: M3Config, layer: int, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.eps = cfg.rms_norm_eps
        self.register_buffer("input_layernorm", _norm_weight(cfg.hidden_size, device))
        self.register_buffer("post_attention_layernorm", _norm_weight(cfg.hidden_size, device))
        self.self_attn = Attention(cfg, layer, device)
        self.mlp = MoE(cfg, device)

    def forward(self, x: torch.Tensor, *attn_args: torch.Tensor, cache: dict[str, torch.Tensor]) -> torch.Tensor:
        """The layer's output hidden states."""
        x = x + self.self_attn(rms_norm(x, self.input_layernorm, self.eps), *attn_args, cache=cache)
        return x + self.mlp(rms_norm(x, self.post_attention_layernorm, self.eps))


class MiniMaxM3ForCausalLM(nn.Module):
    """The whole model. Weights are buffers in their stored formats; load them with `load_hf_weights`."""

    def __init__(self, cfg: M3Config, device: torch.device | str | None = None, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.cfg, self.dtype = cfg, dtype
        self.register_buffer("embed_tokens", torch.empty(cfg.vocab_size, cfg.hidden_size, dtype=torch.bfloat16,
                                                         device=device))
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, device) for i in range(cfg.num_hidden_layers))
        self.register_buffer("norm", _norm_weight(cfg.hidden_size, device))
        if not cfg.tie_word_embeddings:
            self.register_buffer("lm_head", torch.empty(cfg.vocab_size, cfg.hidden_size, dtype=torch.bfloat16,
                                                        device=device))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                block_table: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                kv_caches: list[dict[str, torch.Tensor]]) -> torch.Tensor:
        """Logits [T, vocab] (float32) for the new tokens; K/V/index-K of the new tokens land in `kv_caches`."""
        cfg = self.cfg
        x = F.embedding(input_ids, self.embed_tokens).to(self.dtype)
        cos, sin = rope_cos_sin(positions, cfg.rotary_dim, cfg.rope_theta, self.dtype)
        for layer, cache in zip(self.layers, kv_caches):
            x = layer(x, cos, sin, positions, slot_mapping, block_table, query_start_loc, seq_lens, cache=cache)
        x = rms_norm(x, self.norm, cfg.rms_norm_eps)
        head = self.embed_tokens if cfg.tie_word_embeddings else self.lm_head
        return F.linear(x, head.to(self.dtype)).float()

    def step(self, input_ids: torch.Tensor, meta: BatchMetadata, cache: PagedKVCache) -> torch.Tensor:
        """`forward` with the metadata and cache objects of :mod:`m3c.model_defs.kv_cache`."""
        if input_ids.dim() != 1 or input_ids.shape[0] != meta.positions.shape[0]:
            raise ShapeError(
                f"input_ids has shape {tuple(input_ids.shape)}, expected [{meta.positions.shape[0]}] "
                "(one flattened row of new tokens for the batch)"
            )
        return self(input_ids, meta.positions, meta.slot_mapping, meta.block_table, meta.query_start_loc,
                    meta.seq_lens, cache.layers)

    # ---- weights ---------------------------------------------------------------------------
    @torch.no_grad()
    def load_hf_weights(self, tensors: dict[str, torch.Tensor]) -> None:
        """Copy HF-named checkpoint tensors (see m3c.model_defs.weights) into the packed model buffers.

        Tensors must already be validated (m3c.model_defs.checkpoint does); a missing one raises
        CheckpointError naming it.
        """
        cfg = self.cfg

        def get(name: str) -> torch.Tensor:
            try:
                return tensors[name]
            except KeyError:
                raise CheckpointError(f"checkpoint tensor {name!r} is missing") from None

        def put(dst: torch.Tensor, src: torch.Tensor) -> None:
            if dst.dtype.itemsize == 1:
                dst.view(torch.uint8).copy_(src.reshape(dst.shape).view(torch.uint8))
            else:
                dst.copy_(src.reshape(dst.shape))

        def load_linear(lin: QuantLinear, names: list[str], expert: int | None = None) -> None:
            """Concatenate the rows of HF linears `names` into `lin` (or expert slot `expert` of a stack)."""
            fields = ["weight", "weight_scale"] if lin.fmt != "bf16" else ["weight"]
            for field in fields:
                dst = getattr(lin, field)
                put(dst if expert is None else dst[expert], torch.cat([get(f"{n}.{field}") for n in names]))
            if lin.fmt == "nvfp4":
                rows = [torch.full((get(f"{n}.weight").shape[0], 1), float(get(f"{n}.weight_scale_2")))
                        for n in names]
                dst = lin.weight_scale_2
                put(dst if expert is None else dst[expert], torch.cat(rows))

        put(self.embed_tokens, get("model.embed_tokens.weight"))
        put(self.norm, get("model.norm.weight"))
        if not cfg.tie_word_embeddings:
            put(self.lm_head, get("lm_head.weight"))
        for i, layer in enumerate(self.layers):
            p = layer_prefix(i)
            a = f"{p}.self_attn"
            put(layer.input_layernorm, get(f"{p}.input_layernorm.weight"))
            put(layer.post_attention_layernorm, get(f"{p}.post_attention_layernorm.weight"))
            projs = ["q_proj", "k_proj", "v_proj"] + (["index_q_proj", "index_k_proj"] if cfg.is_sparse(i) else [])
            load_linear(layer.self_attn.qkv_proj, [f"{a}.{n}" for n in projs])
            load_linear(layer.self_attn.o_proj, [f"{a}.o_proj"])
            for norm in ("q_norm", "k_norm") + (("index_q_norm", "index_k_norm") if cfg.is_sparse(i) else ()):
                put(getattr(layer.self_attn, norm), get(f"{a}.{norm}.weight"))
            m, moe = f"{p}.mlp", layer.mlp
            put(moe.gate.weight, get(f"{m}.gate.weight"))
            put(moe.e_score_correction_bias, get(f"{m}.gate.e_score_correction_bias"))
            for e in range(cfg.n_routed_experts):
                x = f"{m}.experts.{e}"
                load_linear(moe.w13, [f"{x}.gate_proj", f"{x}.up_proj"], expert=e)
                load_linear(moe.w2, [f"{x}.down_proj"], expert=e)
            if moe.shared is not None:
                s = f"{m}.shared_experts"
                load_linear(moe.shared[0], [f"{s}.gate_proj", f"{s}.up_proj"])
                load_linear(moe.shared[1], [f"{s}.down_proj"])
