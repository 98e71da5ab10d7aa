"""The paged KV cache: byte layout, poison, block allocator and per-step metadata (fresh random schedules)."""

from __future__ import annotations

import pytest
import torch

from m3c.errors import KVCacheCapacityError, ShapeError
from m3c.model_defs.generate import make_cache
from m3c.model_defs.kv_cache import (
    BatchMetadata,
    BlockAllocator,
    PagedKVCache,
    allocate_layer_cache,
    indexer_bytes_per_token,
    kv_bytes_per_token,
    layer_cached_tensors,
)
from m3c.model_defs.presets import m31_flash, m31_tiny


def _randint(rng: torch.Generator, lo: int, hi: int) -> int:
    """A random int in [lo, hi]."""
    return int(torch.randint(lo, hi + 1, (1,), generator=rng))


# ---------------------------------------------------------------------------------------------
# Byte layout
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kv,kv_bytes,idx,idx_bytes",
    [("nvfp4", 34_560, "nvfp4", 60 * 72), ("fp8", 61_440, "fp8", 60 * 128), ("bf16", 122_880, "bf16", 60 * 256)],
)
def test_full_preset_bytes_per_token(kv: str, kv_bytes: int, idx: str, idx_bytes: int) -> None:
    cfg = m31_flash().replace(kv_cache_dtype=kv, indexer_kv_dtype=idx)
    assert kv_bytes_per_token(cfg) == kv_bytes
    assert indexer_bytes_per_token(cfg) == idx_bytes
    assert kv_bytes_per_token(cfg) == 60 * 2 * 4 * 128 * {"nvfp4": 9 / 16, "fp8": 1, "bf16": 2}[kv]


def test_published_reduction() -> None:
    nv, fp8 = m31_flash(), m31_flash().replace(kv_cache_dtype="fp8")
    assert 1 - kv_bytes_per_token(nv) / kv_bytes_per_token(fp8) == pytest.approx(0.4375)


@pytest.mark.parametrize("kv", ["nvfp4", "fp8", "bf16"])
@pytest.mark.parametrize("idx", ["nvfp4", "fp8", "bf16"])
def test_allocated_layout_matches_accounting(kv: str, idx: str) -> None:
    """Tensors allocated per layer: documented shapes/dtypes, bytes = bytes_per_token x slots, all poison."""
    cfg = m31_tiny().replace(kv_cache_dtype=kv, indexer_kv_dtype=idx)
    nb, bs = 3, cfg.msa_block_size
    per_value = {"nvfp4": (torch.uint8, 2), "fp8": (torch.float8_e4m3fn, 1), "bf16": (torch.bfloat16, 1)}
    total = 0
    for layer in range(cfg.num_hidden_layers):
        t = allocate_layer_cache(cfg, layer, nb)
        names = {"k", "v"} | ({"index_k"} if cfg.is_sparse(layer) else set())
        assert {c.name for c in layer_cached_tensors(cfg, layer)} == names
        for name in names:
            heads = 1 if name == "index_k" else cfg.num_key_value_heads
            dim = cfg.index_head_dim if name == "index_k" else cfg.head_dim
            fmt = idx if name == "index_k" else kv
            dtype, div = per_value[fmt]
            data = t[f"{name}_data"]
            assert data.dtype == dtype and tuple(data.shape) == (nb, bs, heads, dim // div)
            if fmt == "nvfp4":
                s = t[f"{name}_scale"]
                assert s.dtype == torch.float8_e4m3fn and tuple(s.shape) == (nb, bs, heads, dim // 16)
                assert bool((s.view(torch.uint8) == 0xFF).all())
            elif fmt == "fp8":
                s = t[f"{name}_scale"]
                assert s.dtype == torch.float32 and s.shape == () and float(s) == 1.0
            else:
                assert f"{name}_scale" not in t
            # poison: every byte 0xFF (E4M3 NaN) for one-byte formats, NaN for bf16
            if data.element_size() == 1:
                assert bool((data.view(torch.uint8) == 0xFF).all())
            else:
                assert bool(torch.isnan(data).all())
        assert set(t) <= {f"{n}_{s}" for n in names for s in ("data", "scale")}
        total += sum(x.numel() * x.element_size() for x in t.values() if x.dim() > 0)
    assert total == nb * bs * (kv_bytes_per_token(cfg) + indexer_bytes_per_token(cfg))
    cache = PagedKVCache(cfg, nb, 2)
    scalars = 4 * sum(1 for layer in cache.layers for x in layer.values() if x.dim() == 0)
    assert cache.nbytes() == total + scalars


# ---------------------------------------------------------------------------------------------
# Allocator
# ---------------------------------------------------------------------------------------------


def test_allocator_exhausts_and_stays_consistent(rng: torch.Generator) -> None:
    n = _randint(rng, 5, 40)
    a = BlockAllocator(n)
    assert a.allocate(0) == []
    held: list[int] = []
    while a.num_free:
        take = _randint(rng, 1, a.num_free)
        got = a.allocate(take)
        assert len(got) == take
        held += got
        assert a.num_free + len(held) == n
    assert sorted(held) == list(range(n))
    with pytest.raises(KVCacheCapacityError, match=rf"\b1\b.*\b0 of {n}\b"):
        a.allocate(1)
    assert a.num_free == 0
    # give some back, ask for one more than free: fails taking nothing
    back = held[: _randint(rng, 1, n)]
    held = held[len(back):]
    a.free(back)
    assert a.num_free == len(back)
    with pytest.raises(KVCacheCapacityError, match=f"{len(back) + 1} more blocks"):
        a.allocate(len(back) + 1)
    assert a.num_free == len(back)
    again = a.allocate(len(back))
    assert sorted(again) == sorted(back) and not set(again) & set(held)
    assert a.num_free == 0


def test_allocator_rejects_double_and_foreign_free(rng: torch.Generator) -> None:
    n = _randint(rng, 3, 20)
    a = BlockAllocator(n)
    held = a.allocate(n)
    back = held[: _randint(rng, 1, n - 1)]
    a.free(back)
    free = a.num_free
    for bad in ([back[0]], [held[-1], held[-1]], [n], [-1], [held[-1], back[-1]]):
        with pytest.raises(ShapeError):
            a.free(bad)
        assert a.num_free == free, f"a refused free({bad}) changed the free list"
    assert sorted(a.allocate(free)) == sorted(back)  # every block handed out once


# ---------------------------------------------------------------------------------------------
# PagedKVCache bookkeeping
# ---------------------------------------------------------------------------------------------


def _check_meta(cache: PagedKVCache, meta: BatchMetadata, new: dict[int, int], before: dict[int, int]) -> None:
    bs = cache.cfg.msa_block_size
    assert meta.query_start_loc.dtype == torch.int32 and meta.seq_lens.dtype == torch.int32
    assert meta.block_table.dtype == torch.int32
    assert meta.positions.dtype == torch.int64 and meta.slot_mapping.dtype == torch.int64
    reqs = list(new)
    starts = [0]
    for r in reqs:
        starts.append(starts[-1] + new[r])
    assert meta.query_start_loc.tolist() == starts
    assert meta.seq_lens.tolist() == [before[r] + new[r] for r in reqs]
    assert tuple(meta.block_table.shape) == (len(reqs), cache.max_blocks_per_seq)
    assert meta.positions.shape == meta.slot_mapping.shape == (starts[-1],)
    for i, r in enumerate(reqs):
        rows = slice(starts[i], starts[i + 1])
        length = before[r] + new[r]
        assert cache.lengths[r] == length
        n_blocks = -(-length // bs)
        assert len(cache.blocks[r]) == n_blocks
        assert meta.block_table[i, :n_blocks].tolist() == cache.blocks[r]
        assert not meta.block_table[i, n_blocks:].any()
        pos = meta.positions[rows]
        assert pos.tolist() == list(range(before[r], length))
        expect = meta.block_table[i].long()[pos // bs] * bs + pos % bs
        assert torch.equal(meta.slot_mapping[rows], expect)


def test_prepare_many_steps(rng: torch.Generator) -> None:
    """Random requests of different lengths over several steps: metadata consistent, slots never shared."""
    cfg = m31_tiny()
    bs = cfg.msa_block_size
    max_blocks = 6
    n_req = _randint(rng, 2, 5)
    cache = PagedKVCache(cfg, num_blocks=n_req * max_blocks, max_blocks_per_seq=max_blocks)
    assert cache.capacity_tokens == max_blocks * bs
    # shuffle the free list so block tables are not contiguous ranges
    perm = cache.allocator.allocate(cache.num_blocks)
    cache.allocator.free([perm[i] for i in torch.randperm(len(perm), generator=rng).tolist()])
    reqs = [int(x) for x in torch.randperm(100, generator=rng)[:n_req]]
    for r in reqs:
        cache.add_request(r)
    owner: dict[int, tuple[int, int]] = {}  # slot -> (request, position)
    for _ in range(8):
        room = {r: cache.capacity_tokens - cache.lengths[r] for r in reqs}
        active = [r for r in reqs if room[r] > 0 and _randint(rng, 0, 3)]
        if not active:
            continue
        new = {r: _randint(rng, 1, min(room[r], 2 * bs + 3)) for r in active}
        before = dict(cache.lengths)
        meta = cache.prepare(new)
        _check_meta(cache, meta, new, before)
        token_reqs = [q for q in active for _ in range(new[q])]
        for r, pos, slot in zip(token_reqs, meta.positions.tolist(), meta.slot_mapping.tolist()):
            assert slot not in owner, f"slot {slot} given to {(r, pos)} already holds {owner[slot]}"
            assert 0 <= slot < cache.num_blocks * bs
            owner[slot] = (r, pos)
        held = [b for r in reqs for b in cache.blocks[r]]
        assert len(held) == len(set(held))
        assert cache.allocator.num_free + len(held) == cache.num_blocks
    # every token ever written sits at the slot the final block tables say
    for slot, (r, pos) in owner.items():
        assert cache.blocks[r][pos // bs] * bs + pos % bs == slot


def test_capacity_exceeded_changes_nothing(rng: torch.Generator) -> None:
    cfg = m31_tiny()
    bs = cfg.msa_block_size
    max_blocks = _randint(rng, 2, 5)
    cache = PagedKVCache(cfg, num_blocks=4 * max_blocks, max_blocks_per_seq=max_blocks)
    cache.add_request(0)
    cache.add_request(1)
    cache.prepare({0: _randint(rng, 1, cache.capacity_tokens - 1), 1: 1})
    lengths, blocks, free = dict(cache.lengths), {r: list(b) for r, b in cache.blocks.items()}, cache.allocator.num_free
    too_many = cache.capacity_tokens - lengths[0] + 1
    with pytest.raises(KVCacheCapacityError, match=rf"{cache.capacity_tokens}\b.*{max_blocks} blocks of {bs}"):
        cache.prepare({1: 2, 0: too_many})  # request 1 alone would fit: it must not advance either
    assert cache.lengths == lengths and cache.blocks == blocks and cache.allocator.num_free == free
    # exactly filling the table still works
    meta = cache.prepare({0: too_many - 1})
    assert cache.lengths[0] == cache.capacity_tokens and int(meta.seq_lens[0]) == cache.capacity_tokens
    with pytest.raises(KVCacheCapacityError):
        cache.prepare({0: 1})


def test_pool_exhausted_changes_nothing(rng: torch.Generator) -> None:
    cfg = m31_tiny()
    bs = cfg.msa_block_size
    cache = PagedKVCache(cfg, num_blocks=3, max_blocks_per_seq=3)
    for r in range(2):
        cache.add_request(r)
    cache.prepare({0: 2 * bs})
    state = (dict(cache.lengths), {r: list(b) for r, b in cache.blocks.items()}, cache.allocator.num_free)
    with pytest.raises(KVCacheCapacityError, match="2 more blocks but only 1 of 3"):
        cache.prepare({0: 1, 1: _randint(rng, 1, bs)})  # needs 1 + 1 blocks, 1 free
    assert (cache.lengths, cache.blocks, cache.allocator.num_free) == state
    cache.free_request(0)
    assert cache.allocator.num_free == 3 and 0 not in cache.blocks and 0 not in cache.lengths
    meta = cache.prepare({1: 3 * bs})
    assert sorted(cache.blocks[1]) == [0, 1, 2] and int(meta.seq_lens[0]) == 3 * bs


def test_free_returns_blocks(rng: torch.Generator) -> None:
    cfg = m31_tiny()
    cache = make_cache(cfg, 5 * cfg.msa_block_size, num_seqs=3)
    assert cache.num_blocks == 15 and cache.max_blocks_per_seq == 5
    for r in range(3):
        cache.add_request(r)
        cache.prepare({r: _randint(rng, 1, 5 * cfg.msa_block_size)})
    held = {r: list(b) for r, b in cache.blocks.items()}
    free = cache.allocator.num_free
    victim = _randint(rng, 0, 2)
    cache.free_request(victim)
    assert cache.allocator.num_free == free + len(held[victim])
    cache.add_request(victim)  # the id may be reused after freeing
    assert cache.lengths[victim] == 0 and cache.blocks[victim] == []
    cache.prepare({victim: len(held[victim]) * cfg.msa_block_size})
    others = {b for r, bl in held.items() if r != victim for b in bl}
    assert not set(cache.blocks[victim]) & others
    assert {r: cache.blocks[r] for r in held if r != victim} == {r: held[r] for r in held if r != victim}


def test_bad_requests_raise_shape_error() -> None:
    cache = PagedKVCache(m31_tiny(), num_blocks=4, max_blocks_per_seq=2)
    cache.add_request(7)
    with pytest.raises(ShapeError, match="7"):
        cache.add_request(7)
    with pytest.raises(ShapeError, match="3"):
        cache.prepare({7: 1, 3: 1})
    with pytest.raises(ShapeError, match="at least one token"):
        cache.prepare({7: 0})
    assert cache.lengths == {7: 0} and cache.blocks == {7: []} and cache.allocator.num_free == 4


def test_free_unknown_request_raises_shape_error() -> None:
    cache = PagedKVCache(m31_tiny(), num_blocks=4, max_blocks_per_seq=2)
    with pytest.raises(ShapeError, match="5"):
        cache.free_request(5)
    cache.add_request(5)
    cache.free_request(5)
    with pytest.raises(ShapeError, match="5"):  # twice
        cache.free_request(5)
    assert cache.allocator.num_free == 4


def test_batch_metadata_to() -> None:
    cache = PagedKVCache(m31_tiny(), num_blocks=4, max_blocks_per_seq=2)
    cache.add_request(0)
    meta = cache.prepare({0: 3})
    moved = meta.to("meta")
    for f in meta.__dataclass_fields__:
        a, b = getattr(meta, f), getattr(moved, f)
        assert b.is_meta and a.shape == b.shape and a.dtype == b.dtype
