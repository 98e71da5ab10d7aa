"""The capacity planner: published cache sizes, per-GPU accounting under TP/DP/EP, and bad inputs."""

from __future__ import annotations

import pytest

from m3c.errors import PlanError
from m3c.model_defs.capacity import GB, GPUS, GPUSpec, Layout, get_gpu, parse_context, plan, weight_bytes
from m3c.model_defs.kv_cache import indexer_bytes_per_token, kv_bytes_per_token
from m3c.model_defs.presets import m31_flash, m31_tiny
from m3c.model_defs.weights import checkpoint_nbytes


@pytest.fixture(scope="module")
def flash():
    return m31_flash()


def test_published_kv_bytes_per_token(flash):
    p = plan(flash, "b300", Layout(tp=4), "256k")
    assert p.kv_bytes_per_token == 34_560
    assert p.fp8_kv is not None and p.fp8_kv.kv_bytes_per_token == 61_440
    assert p.kv_bytes_per_token_per_layer == 576 and p.fp8_kv.kv_bytes_per_token_per_layer == 1_024
    assert p.index_bytes_per_token_per_sparse_layer == 72 and p.fp8_kv.index_bytes_per_token_per_sparse_layer == 128
    assert p.kv_bytes_per_token == kv_bytes_per_token(flash)
    assert p.index_bytes_per_token == indexer_bytes_per_token(flash) == 60 * 72
    assert p.cache_bytes_ratio == pytest.approx(9 / 16)


def test_checkpoint_close_to_published(flash):
    p = plan(flash, "b300", Layout(tp=4), "256k")
    assert p.checkpoint_bytes == checkpoint_nbytes(flash)
    assert abs(p.checkpoint_bytes - 250.1e9) / 250.1e9 < 0.05


def test_index_key_head_replicated_under_tp(flash):
    one = plan(flash, "b300", Layout(tp=1), "256k")
    for tp in (2, 4):
        p = plan(flash, "b300", Layout(tp=tp), "256k")
        assert p.cache_bytes_per_token_per_gpu == 34_560 // tp + 4_320
        assert p.kv_bytes_per_sequence == one.kv_bytes_per_sequence  # whole-sequence bytes do not depend on tp
    assert plan(flash, "b300", Layout(tp=4), "256k").cache_bytes_per_token_per_gpu == 12_960


def test_dp_replicas_hold_sequences_in_full(flash):
    p = plan(flash, "b300", Layout.dep(4), "256k")
    assert p.layout.ep == 4 and p.layout.describe() == "DEP4"
    assert p.cache_bytes_per_token_per_gpu == p.cache_bytes_per_token
    assert p.max_sequences == 4 * p.sequences_per_replica


def test_weights_per_gpu(flash):
    w = weight_bytes(flash)
    assert w.checkpoint == w.routed_experts + w.tp_split + w.replicated
    dep4 = plan(flash, "b300", Layout.dep(4), "256k")
    assert dep4.weight_bytes_per_gpu == w.routed_experts // 4 + w.tp_split + w.replicated
    tp4 = plan(flash, "b300", Layout(tp=4), "256k")
    assert tp4.weight_bytes_per_gpu < dep4.weight_bytes_per_gpu
    no_ep = plan(flash, "b300", Layout(tp=1, dp=4, ep=1), "256k")
    assert no_ep.weight_bytes_per_gpu == w.checkpoint


def test_published_capacity_point(flash):
    """4× B300 DEP4 at 256K: published 76 (M3.1) vs 28 (M3); our memory model predicts 68 vs 28 (see capacity.py)."""
    m31 = plan(flash, "b300", Layout.dep(4), "256k")
    m3 = plan(flash.replace(routed_expert_dtype="mxfp8", kv_cache_dtype="fp8", indexer_kv_dtype="fp8"),
              "b300", Layout.dep(4), "256k")
    assert (m31.max_sequences, m3.max_sequences) == (68, 28)
    assert m31.fp8_kv is not None and m31.fp8_kv.max_sequences == 36  # FP8 KV, NVFP4 experts


def test_sequences_monotone_in_context_and_memory(flash):
    counts = [plan(flash, "b300", Layout(tp=4), c).max_sequences for c in ("32k", "64k", "128k", "256k", "512k", "1m")]
    assert counts == sorted(counts, reverse=True) and counts[0] > counts[-1] > 0
    by_memory = [plan(flash, GPUSpec("x", m * GB, "test"), Layout(tp=4), "256k").max_sequences
                 for m in (100, 141, 180, 288, 400)]
    assert by_memory == sorted(by_memory) and by_memory[-1] > by_memory[0]
    by_util = [plan(flash, "b300", Layout(tp=4), "256k", u).max_sequences for u in (0.5, 0.7, 0.9, 1.0)]
    assert by_util == sorted(by_util)


def test_weights_do_not_fit(flash):
    p = plan(flash, "h200", Layout(tp=1), "4k")
    assert not p.weights_fit and p.max_sequences == 0 and "warning" in p.table()


def test_context_rounds_up_to_blocks():
    cfg = m31_tiny()
    p = plan(cfg, "h200", Layout(tp=2), 9)
    assert p.sequence_tokens == 2 * cfg.msa_block_size


@pytest.mark.parametrize(
    ("layout", "context", "match"),
    [
        (dict(tp=3), "256k", "num_key_value_heads=4"),
        (dict(tp=8), "256k", "num_key_value_heads=4"),
        (dict(tp=1, dp=3), "256k", "n_routed_experts=256"),
        (dict(tp=2, dp=2, ep=3), "256k", "does not divide the 4 GPUs"),
        (dict(tp=4), "2m", "max_position_embeddings"),
    ],
)
def test_bad_layouts_raise(flash, layout, context, match):
    with pytest.raises(PlanError, match=match):
        plan(flash, "b300", Layout(**layout), context)


@pytest.mark.parametrize("kwargs", [dict(tp=0), dict(dp=-1), dict(ep=0), dict(tp=1.5)])
def test_layout_rejects_non_positive(kwargs):
    with pytest.raises(PlanError):
        Layout(**kwargs)


def test_bad_utilization_and_gpu(flash):
    with pytest.raises(PlanError, match=r"\(0, 1\]"):
        plan(flash, "b300", Layout(tp=4), "256k", gpu_memory_utilization=1.5)
    with pytest.raises(PlanError, match="known GPUs: h200, b200, b300, gb300, rubin, mi355x"):
        get_gpu("a100")
    assert get_gpu("B300") is GPUS["b300"] and GPUS["b300"].memory_bytes == 288 * 10**9
    assert "announced" in GPUS["rubin"].note


@pytest.mark.parametrize(
    ("text", "tokens"),
    [("256k", 262_144), ("256K", 262_144), ("1m", 1_048_576), ("131072", 131_072), (" 8k ", 8192), (4096, 4096)],
)
def test_parse_context(text, tokens):
    assert parse_context(text) == tokens


@pytest.mark.parametrize("text", ["", "k", "256kb", "1.5m", "-4k", "0", "abc", "256 k", True])
def test_parse_context_rejects(text):
    with pytest.raises(PlanError):
        parse_context(text)
