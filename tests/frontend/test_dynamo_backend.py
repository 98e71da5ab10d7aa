"""torch.compile(model, backend="m3c"): registered by entry point, equal to eager, one compile for every
token count, and ops the IR lacks handed to TorchInductor."""

from __future__ import annotations

from importlib.metadata import entry_points

import pytest
import torch
from torch import nn

from m3c.frontend import dynamo_backend
from m3c.frontend.dynamo_backend import COUNTERS, m3c_backend
from m3c.model_defs.checkpoint import build_model
from m3c.model_defs.generate import make_cache
from m3c.model_defs.presets import get_preset


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    COUNTERS.clear()
    yield
    torch._dynamo.reset()


def test_registered_as_a_dynamo_backend() -> None:
    assert "m3c" in torch._dynamo.list_backends()
    (ep,) = [e for e in entry_points(group="torch_dynamo_backends") if e.name == "m3c"]
    assert ep.load() is m3c_backend


def _prefill(cfg, tokens: int, seed: int, dynamic: bool, device: str = "cpu"):
    cache = make_cache(cfg, 64, 1, device=device)
    cache.add_request(0)
    meta = cache.prepare({0: tokens})
    ids = torch.randint(0, cfg.vocab_size, (tokens,), generator=torch.Generator().manual_seed(seed)).to(device)
    args = [ids, meta.positions, meta.slot_mapping, meta.block_table, meta.query_start_loc, meta.seq_lens]
    if dynamic:
        for t in args[:3]:
            torch._dynamo.mark_dynamic(t, 0)
    return (*args, cache.layers)


def test_tiny_equals_eager_without_recompiling_per_length(rng: torch.Generator) -> None:
    cfg = get_preset("m3.1-tiny")
    model = build_model(cfg, seed=int(torch.randint(0, 100, (1,), generator=rng)))
    compiled = torch.compile(model, backend="m3c", options={"verify_each": True})
    for tokens in (20, 13, 29):  # > top-k 2 × block 8 tokens reach the sparse selection
        seed = int(torch.randint(0, 10**6, (1,), generator=rng))
        ref_args, our_args = _prefill(cfg, tokens, seed, False), _prefill(cfg, tokens, seed, True)
        with torch.no_grad():
            want = model(*ref_args)
            got = compiled(*our_args)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        for name, t in ref_args[-1][0].items():  # the cache writes landed in the caller's cache
            assert torch.equal(t.reshape(-1).view(torch.uint8), our_args[-1][0][name].reshape(-1).view(torch.uint8))
    assert COUNTERS["graphs"] == 1 and COUNTERS["compiles"] == 1 and COUNTERS["calls"] == 3
    assert COUNTERS["inductor_compiles"] == 0  # every op of the preset has an IR op
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1


class _InverseToy(nn.Module):
    """A projection (IR), a matrix inverse (no IR op: fallback -> Inductor), SiLU and a scale (IR)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 16)
        self.register_buffer("shift", 4 * torch.eye(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        m = self.proj(x).view(-1, 4, 4) + self.shift
        return torch.nn.functional.silu(torch.linalg.inv(m).reshape(-1, 16)) * 2.0


def test_unsupported_ops_run_through_inductor(rng: torch.Generator, monkeypatch: pytest.MonkeyPatch) -> None:
    toy = _InverseToy()
    compiled_graphs: list[dynamo_backend.DynamoGraph] = []
    real = dynamo_backend.DynamoGraph

    def spy(*args, **kwargs):
        compiled_graphs.append(real(*args, **kwargs))
        return compiled_graphs[-1]

    monkeypatch.setattr(dynamo_backend, "DynamoGraph", spy)
    compiled = torch.compile(toy, backend="m3c")
    for batch in (5, 3):
        x = torch.randn(batch, 16, generator=rng)
        torch._dynamo.mark_dynamic(x, 0)
        with torch.no_grad():
            torch.testing.assert_close(compiled(x), toy(x), rtol=1e-5, atol=1e-5)
    assert COUNTERS["compiles"] == 1 and COUNTERS["inductor_compiles"] >= 1 and COUNTERS["inductor_calls"] == 2
    (variant,) = compiled_graphs[0].variants.values()
    graph = variant.program.graph
    assert {n.attrs["target"] for n in graph.find("fallback")} == {"aten.linalg_inv.default"}
    assert graph.find("linear") and graph.find("silu")  # the rest stayed in m3c's IR
    assert len(variant.regions) == 1


@pytest.mark.gpu
def test_tiny_on_cuda_equals_eager() -> None:
    cfg = get_preset("m3.1-tiny")
    model = build_model(cfg, seed=0, device="cuda")
    compiled = torch.compile(model, backend=m3c_backend)
    for tokens in (20, 13):
        ref_args, our_args = _prefill(cfg, tokens, tokens, False, "cuda"), _prefill(cfg, tokens, tokens, True, "cuda")
        with torch.no_grad():
            torch.testing.assert_close(compiled(*our_args), model(*ref_args), rtol=1e-4, atol=1e-4)
    assert COUNTERS["compiles"] == 1
