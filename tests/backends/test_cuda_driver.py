"""The CUDA driver launcher (m3c.backends.cuda_driver): every launch must carry its own arguments, launches from
several threads and streams at once included."""

from __future__ import annotations

import threading

import pytest
import torch

from m3c.backends.cuda_aot import cuda_jit_run
from m3c.backends.kernels import moe_cuda


def _staged(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What moe_stage_x writes: x * 2^-e per row as f16 (e from the row's largest magnitude) and 2^e."""
    amax = x.float().abs().amax(1)
    e = (torch.frexp(amax).exponent - 15).clamp(-126, 126).float()  # amax's binary exponent - 14
    return (x.float() * torch.exp2(-e)[:, None]).half(), torch.exp2(e)


@pytest.mark.gpu
def test_launches_from_threads_each_get_their_own_arguments() -> None:
    """moe_stage_x (pointers and an int) launched 20 times from each of 3 threads, each on its own stream with its
    own tokens and width (so the slots' pointers and ints differ launch by launch): every output as the reference,
    nothing left unwritten (outputs start NaN)."""
    spec = moe_cuda.mma_specs(1024, 256, 256, "bf16", 1)[0]
    errors: list[str] = []

    def work(seed: int) -> None:
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            for i in range(20):
                t, h = 1 + (seed + i) % 5, 128 * (1 + (seed * 7 + i) % 6)
                x = (torch.randn(t, h, device="cuda") * (10.0 ** ((i % 5) - 2))).bfloat16()
                x16 = torch.full((t, h), float("nan"), dtype=torch.float16, device="cuda")
                xmult = torch.full((t,), float("nan"), device="cuda")
                cuda_jit_run(spec, (t,), [x, h, x16, xmult])
                want16, want_mult = _staged(x)
                stream.synchronize()
                if not (torch.equal(x16, want16) and torch.equal(xmult, want_mult)):
                    errors.append(f"thread {seed} launch {i}: T = {t}, H = {h}")

    cuda_jit_run(spec, (1,), [torch.ones(1, 128, dtype=torch.bfloat16, device="cuda"), 128,
                              torch.empty(1, 128, dtype=torch.float16, device="cuda"), torch.empty(1, device="cuda")])
    threads = [threading.Thread(target=work, args=(s,)) for s in range(3)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors
