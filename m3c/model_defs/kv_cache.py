"""The paged KV cache: its byte layout, its allocator and the per-batch metadata (block tables, slots).

Layout (kernels, the planner and artifacts depend on it). The cache is a pool of ``num_blocks``
blocks of ``block_size`` tokens. For each layer it holds ``k`` and ``v`` (``num_key_value_heads``
heads × ``head_dim``) and, on sparse layers, ``index_k`` (one head × ``index_head_dim``). Every
cached tensor has the shape ``[num_blocks, block_size, heads, stored_dim]``; token ``t`` of a
request lives at slot ``block_table[t // block_size] * block_size + t % block_size``.

Per KV dtype:
- ``nvfp4``: ``<name>_data`` uint8 ``[..., dim/2]`` (two E2M1 codes a byte, element 2i in the low
  nibble) and ``<name>_scale`` float8_e4m3fn ``[..., dim/16]``; no per-tensor scale (global 1.0).
  0.5625 bytes per value.
- ``fp8``: ``<name>_data`` float8_e4m3fn ``[..., dim]``, one float32 per-tensor scale per layer and
  tensor (``<name>_scale``, shape ``[]``, 1.0 unless calibrated). 1 byte per value.
- ``bf16``: ``<name>_data`` bfloat16 ``[..., dim]``. 2 bytes per value.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from fractions import Fraction

import torch

from m3c.errors import KVCacheCapacityError, ShapeError
from m3c.model_defs.config import M3Config

BYTES_PER_VALUE = {"nvfp4": Fraction(9, 16), "fp8": Fraction(1), "bf16": Fraction(2)}


@dataclass(frozen=True)
class CachedTensor:
    """One cached quantity of one layer (k, v or index_k): heads × dim in `dtype`."""

    name: str
    heads: int
    dim: int
    dtype: str

    def block_tensors(self, block_size: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Name -> (shape of one block, torch dtype) of the tensors that store this quantity.

        Per-tensor scales (fp8) have shape () and are not per block.
        """
        if self.dtype == "nvfp4":
            return {
                f"{self.name}_data": ((block_size, self.heads, self.dim // 2), torch.uint8),
                f"{self.name}_scale": ((block_size, self.heads, self.dim // 16), torch.float8_e4m3fn),
            }
        if self.dtype == "fp8":
            return {f"{self.name}_data": ((block_size, self.heads, self.dim), torch.float8_e4m3fn)}
        if self.dtype == "bf16":
            return {f"{self.name}_data": ((block_size, self.heads, self.dim), torch.bfloat16)}
        raise ShapeError(f"unknown KV-cache dtype {self.dtype!r}")

    def bytes_per_token(self) -> Fraction:
        """Bytes one token of this quantity occupies."""
        return BYTES_PER_VALUE[self.dtype] * self.heads * self.dim


def layer_cached_tensors(cfg: M3Config, layer: int) -> list[CachedTensor]:
    """The quantities layer `layer` caches: k, v and (sparse layers) index_k."""
    kv = cfg.quant.kv_cache_dtype
    out = [
        CachedTensor("k", cfg.num_key_value_heads, cfg.head_dim, kv),
        CachedTensor("v", cfg.num_key_value_heads, cfg.head_dim, kv),
    ]
    if cfg.is_sparse(layer):
        out.append(CachedTensor("index_k", 1, cfg.index_head_dim, cfg.quant.indexer_kv_dtype))
    return out


def kv_bytes_per_token(cfg: M3Config) -> int:
    """Bytes of attention K/V per token over all layers (without the indexer keys)."""
    total = sum(
        t.bytes_per_token() for i in range(cfg.num_hidden_layers) for t in layer_cached_tensors(cfg, i)
        if t.name in ("k", "v")
    )
    return int(total)


def indexer_bytes_per_token(cfg: M3Config) -> int:
    """Bytes of index keys per token over all sparse layers."""
    total = sum(
        t.bytes_per_token() for i in range(cfg.num_hidden_layers) for t in layer_cached_tensors(cfg, i)
        if t.name == "index_k"
    )
    return int(total)


def allocate_layer_cache(
    cfg: M3Config, layer: int, num_blocks: int, device: torch.device | str = "cpu"
) -> dict[str, torch.Tensor]:
    """Fresh cache tensors of one layer. Data starts as NaN-poison bytes (0xFF) so unwritten slots show."""
    out: dict[str, torch.Tensor] = {}
    for t in layer_cached_tensors(cfg, layer):
        for name, (shape, dtype) in t.block_tensors(cfg.msa_block_size).items():
            buf = torch.empty((num_blocks, *shape), dtype=torch.uint8 if dtype.itemsize == 1 else dtype, device=device)
            if dtype.itemsize == 1:
                buf.fill_(0xFF)  # E4M3 0xFF is NaN; a uint8 pair of E2M1 -0.5... poisons scales and stands out
                buf = buf.view(dtype)
            else:
                buf.fill_(float("nan"))
            out[name] = buf
        if t.dtype == "fp8":
            out[f"{t.name}_scale"] = torch.ones((), dtype=torch.float32, device=device)
    return out


class BlockAllocator:
    """A free list over the cache's blocks."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))

    @property
    def num_free(self) -> int:
        """Blocks not held by any request."""
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        """Take `n` blocks; raises KVCacheCapacityError (taking none) when fewer are free."""
        if n > len(self._free):
            raise KVCacheCapacityError(
                f"the KV cache needs {n} more blocks but only {len(self._free)} of {self.num_blocks} are free; "
                "free finished requests or build the cache with more blocks (num_blocks / --gpu-memory-utilization)"
            )
        return [self._free.pop() for _ in range(n)]

    def free(self, blocks: list[int]) -> None:
        """Give blocks back; a block that is already free or out of range raises ShapeError (nothing freed)."""
        free = set(self._free)
        for b in blocks:
            if not 0 <= b < self.num_blocks or b in free:
                raise ShapeError(f"block {b} is not held (already free or not in 0..{self.num_blocks - 1})")
            free.add(b)
        self._free.extend(reversed(blocks))


@dataclass
class BatchMetadata:
    """Where each token of a flattened batch of requests sits, for one forward step.

    ``query_start_loc[r]:query_start_loc[r+1]`` are request r's new tokens; ``seq_lens[r]`` is its
    context length after this step (cached + new); ``positions`` are the new tokens' absolute
    positions; ``slot_mapping`` their cache slots; ``block_table[r]`` request r's blocks (padded
    with 0 past its length).
    """

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    block_table: torch.Tensor

    def to(self, device: torch.device | str) -> BatchMetadata:
        """The same metadata on another device."""
        return BatchMetadata(*(getattr(self, f).to(device) for f in self.__dataclass_fields__))


@dataclass
class PagedKVCache:
    """The cache tensors of every layer plus the per-request block bookkeeping."""

    cfg: M3Config
    num_blocks: int
    max_blocks_per_seq: int
    device: torch.device | str = "cpu"
    layers: list[dict[str, torch.Tensor]] = field(init=False)
    allocator: BlockAllocator = field(init=False)
    blocks: dict[int, list[int]] = field(init=False, default_factory=dict)
    lengths: dict[int, int] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        self.layers = [
            allocate_layer_cache(self.cfg, i, self.num_blocks, self.device) for i in range(self.cfg.num_hidden_layers)
        ]
        self.allocator = BlockAllocator(self.num_blocks)

    @property
    def capacity_tokens(self) -> int:
        """Tokens one request may hold (its block table's width)."""
        return self.max_blocks_per_seq * self.cfg.msa_block_size

    def add_request(self, req: int) -> None:
        """Start an empty request."""
        if req in self.blocks:
            raise ShapeError(f"request {req} already exists in the KV cache")
        self.blocks[req] = []
        self.lengths[req] = 0

    def free_request(self, req: int) -> None:
        """Drop a request and return its blocks."""
        if req not in self.blocks:
            raise ShapeError(f"request {req} is not in the KV cache")
        self.allocator.free(self.blocks.pop(req))
        self.lengths.pop(req)

    def prepare(self, new_tokens: dict[int, int]) -> BatchMetadata:
        """Reserve room for `new_tokens[req]` more tokens of each request and describe the step.

        Raises KVCacheCapacityError, changing nothing, if a request would pass its block table's
        capacity or the pool runs out of blocks.
        """
        bs = self.cfg.msa_block_size
        need: dict[int, int] = {}
        for req, n in new_tokens.items():
            if req not in self.blocks:
                raise ShapeError(f"request {req} is not in the KV cache; call add_request first")
            if n <= 0:
                raise ShapeError(f"request {req}: a step must add at least one token, got {n}")
            total = self.lengths[req] + n
            if total > self.capacity_tokens:
                raise KVCacheCapacityError(
                    f"request {req} would hold {total} tokens but the KV cache's block table allows "
                    f"{self.capacity_tokens} ({self.max_blocks_per_seq} blocks of {bs}); shorten the "
                    "context or build the cache with a larger max_blocks_per_seq"
                )
            need[req] = -(-total // bs) - len(self.blocks[req])
        if sum(need.values()) > self.allocator.num_free:
            self.allocator.allocate(sum(need.values()))  # raises with the counts
        for req, n in need.items():
            self.blocks[req] += self.allocator.allocate(n)
        reqs = list(new_tokens)
        starts, positions, slots = [0], [], []
        table = torch.zeros((len(reqs), self.max_blocks_per_seq), dtype=torch.int32)
        for r, req in enumerate(reqs):
            start = self.lengths[req]
            pos = torch.arange(start, start + new_tokens[req], dtype=torch.int64)
            blocks = torch.tensor(self.blocks[req], dtype=torch.int64)
            positions.append(pos)
            slots.append(blocks[pos // bs] * bs + pos % bs)
            table[r, : len(self.blocks[req])] = blocks.to(torch.int32)
            starts.append(starts[-1] + new_tokens[req])
            self.lengths[req] = start + new_tokens[req]
        return BatchMetadata(
            query_start_loc=torch.tensor(starts, dtype=torch.int32),
            seq_lens=torch.tensor([self.lengths[q] for q in reqs], dtype=torch.int32),
            positions=torch.cat(positions),
            slot_mapping=torch.cat(slots),
            block_table=table,
        ).to(self.device)

    def nbytes(self) -> int:
        """Bytes the cache tensors occupy."""
        return sum(t.numel() * t.element_size() for layer in self.layers for t in layer.values())
