"""`--target auto` picks the GPU target this machine runs, else cpu."""

from __future__ import annotations

import torch

from m3c.backends.target import auto_target, get_target


def test_auto_target_matches_the_machine() -> None:
    t = auto_target()
    if torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0):
        assert t.name == "hopper"
    else:
        assert t.name == "cpu"
    assert t.runnable_here() and (t.lowering or t is get_target("cpu"))
