"""host.derived: a value made from a weight once, rebuilt when the weight or a tensor it is also made from changes
(in place, or by being another tensor), the stale value dropped first; derived_ready says whether a call would
rebuild."""

from __future__ import annotations

import gc
import weakref

import torch

from m3c.backends.kernels.host import derived, derived_ready


def test_derived_rebuilds_when_its_source_or_also_changes(rng: torch.Generator) -> None:
    data, scale = torch.randn(8, generator=rng), torch.randn(2, generator=rng)
    made: list[torch.Tensor] = []

    def make(s: torch.Tensor) -> torch.Tensor:
        made.append(data * s.sum())
        return made[-1]

    assert not derived_ready(data, "t", also=(scale,))
    first = derived(data, "t", lambda: make(scale), also=(scale,))
    assert derived_ready(data, "t", also=(scale,)) and derived(data, "t", lambda: make(scale), also=(scale,)) is first
    scale.add_(1.0)  # an in-place change of what it is also made from
    assert not derived_ready(data, "t", also=(scale,))
    second = derived(data, "t", lambda: make(scale), also=(scale,))
    assert second is not first and torch.equal(second, data * scale.sum())
    other = scale.clone()  # another tensor of the same version and values: still rebuilt
    assert not derived_ready(data, "t", also=(other,))
    gone = weakref.ref(second)
    third = derived(data, "t", lambda: make(other), also=(other,))
    del second
    made.clear()
    gc.collect()
    assert gone() is None and third is not None  # the stale value is not kept
    data.mul_(2.0)  # the source itself changed
    assert not derived_ready(data, "t", also=(other,)) and derived_ready(data, "u") is False
    assert torch.equal(derived(data, "t", lambda: make(other), also=(other,)), data * other.sum())
