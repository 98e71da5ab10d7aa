"""Shared test fixtures: GPU tests skip (never fake) without CUDA; every test draws fresh random inputs."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    # Without a GPU every Triton kernel runs in Triton's CPU interpreter (set before triton is imported).
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip tests marked `gpu` when no CUDA device is present."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def rng() -> torch.Generator:
    """A generator seeded from the OS, so each run draws fresh inputs (the seed is printed on failure)."""
    seed = int(torch.randint(0, 2**31 - 1, (1,), generator=torch.Generator().manual_seed(torch.seed())))
    print(f"rng seed: {seed}")
    return torch.Generator().manual_seed(seed)
