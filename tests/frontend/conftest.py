"""Frontend fixtures: the tiny preset's model and its capture, built once per session."""

from __future__ import annotations

import pytest
import torch

from m3c.frontend.capture import Capture, capture_m3
from m3c.model_defs.checkpoint import build_model
from m3c.model_defs.config import M3Config
from m3c.model_defs.minimax_m3 import MiniMaxM3ForCausalLM
from m3c.model_defs.presets import get_preset


@pytest.fixture(scope="session")
def tiny_cfg() -> M3Config:
    """The m3.1-tiny preset."""
    return get_preset("m3.1-tiny")


@pytest.fixture(scope="session")
def tiny_model(tiny_cfg: M3Config) -> MiniMaxM3ForCausalLM:
    """A tiny reference model with random weights (seed drawn fresh)."""
    return build_model(tiny_cfg, seed=int(torch.randint(0, 2**31 - 1, (1,))))


@pytest.fixture(scope="session")
def tiny_capture(tiny_cfg: M3Config, tiny_model: MiniMaxM3ForCausalLM) -> Capture:
    """The tiny model captured once (T=7, R=2 examples; symbolic in T, R, MB, NB)."""
    return capture_m3(tiny_cfg, model=tiny_model)
