"""Shared by the MoE kernel tests: m3.1-small-shaped expert weights on the meta device (no data)."""

from __future__ import annotations

import torch

from m3c.model_defs import quant


def meta_weights(e: int, h: int, inter: int, s: int):
    """(w13, w2, shared_w13, shared_w2): NVFP4 experts with per-row tensor scales, MXFP8 shared expert."""
    m = "meta"
    w13 = quant.NVFP4Tensor(torch.empty(e, 2 * inter, h // 2, dtype=torch.uint8, device=m),
                            torch.empty(e, 2 * inter, h // 16, dtype=torch.float8_e4m3fn, device=m),
                            torch.empty(e, 2 * inter, 1, device=m))
    w2 = quant.NVFP4Tensor(torch.empty(e, h, inter // 2, dtype=torch.uint8, device=m),
                           torch.empty(e, h, inter // 16, dtype=torch.float8_e4m3fn, device=m),
                           torch.empty(e, h, 1, device=m))
    s13 = quant.MXFP8Tensor(torch.empty(2 * s, h, dtype=torch.float8_e4m3fn, device=m),
                            torch.empty(2 * s, h // 32, dtype=torch.uint8, device=m))
    s2 = quant.MXFP8Tensor(torch.empty(h, s, dtype=torch.float8_e4m3fn, device=m),
                           torch.empty(h, s // 32, dtype=torch.uint8, device=m))
    return w13, w2, s13, s2
