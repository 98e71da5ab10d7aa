"""The fused QKV + norm + RoPE + NVFP4 KV-insert kernel against the reference math.

CPU CI runs it in Triton's interpreter at tiny shapes; `-m gpu` runs it at m3.1-small shapes.
K/V/index-K bytes must equal the reference quantizer's except where the kernel's float32 accumulation
order (GPU and interpreter alike) moves a value across a rounding boundary: a small count of differing
blocks is reported and bounded.
"""

from __future__ import annotations

import os

import pytest
import torch

from m3c.model_defs import quant
from m3c.model_defs.layers import apply_rope, rms_norm, rope_cos_sin

SHAPES = {
    # name: (HQ, HKV, G, D, ROT, K)
    "tiny-sparse": (4, 2, 2, 64, 32, 128),
    "tiny-dense": (4, 2, 0, 64, 32, 128),
    "small": (16, 1, 1, 128, 64, 6144),
}


def _kernels():
    if not torch.cuda.is_available():
        assert os.environ.get("TRITON_INTERPRET") == "1", "tests/conftest.py sets the interpreter without a GPU"
    from m3c.backends.kernels import qkv_fused_launch

    return qkv_fused_launch


def _poisoned_cache(nb: int, bs: int, heads: int, d: int, device: str) -> quant.NVFP4Tensor:
    data = torch.full((nb, bs, heads, d // 2), 0xFF, dtype=torch.uint8, device=device)
    scale = torch.full((nb, bs, heads, d // 16), 0x7F, dtype=torch.uint8, device=device).view(torch.float8_e4m3fn)
    return quant.NVFP4Tensor(data, scale, None)


def _reference(x, w, cos, sin, norms, shape, eps):
    """f32 reference of the unfused chain on the same (bf16-exact) inputs."""
    t = x.shape[0]
    hq, hkv, g, d = shape.num_q_heads, shape.num_kv_heads, shape.num_index_heads, shape.head_dim
    y = x.double().matmul(w.double().t()).float()
    sizes = [hq * d, hkv * d, hkv * d] + ([g * d, d] if g else [])
    parts = torch.split(y, sizes, -1)
    q = apply_rope(rms_norm(parts[0].view(t, hq, d), norms[0], eps), cos, sin)
    k = apply_rope(rms_norm(parts[1].view(t, hkv, d), norms[1], eps), cos, sin)
    v = parts[2].view(t, hkv, d)
    out = {"q": q, "k": k, "v": v}
    if g:
        out["iq"] = apply_rope(rms_norm(parts[3].view(t, g, d), norms[2], eps), cos, sin)
        out["ik"] = apply_rope(rms_norm(parts[4].view(t, 1, d), norms[3], eps), cos, sin)
    return out


def _run(name: str, t: int, fused: bool, device: str, rng_seed: int) -> dict[str, float]:
    qf = _kernels()
    hq, hkv, g, d, rot, k = SHAPES[name]
    shape = qf.QKVShape(hq, hkv, g, d, rot)
    gen = torch.Generator().manual_seed(rng_seed)
    n = shape.num_heads * d
    x = torch.randn(t, k, generator=gen).bfloat16().to(device)
    w = (torch.randn(n, k, generator=gen) / k**0.5).bfloat16().to(device)
    pos = torch.randint(0, 1 << 20, (t,), generator=gen).to(device)
    cos, sin = rope_cos_sin(pos, rot, 5e6, torch.float32)
    bs = 16
    nb = (t + bs - 1) // bs * 2
    slots = torch.randperm(nb * bs, generator=gen)[:t].to(device)
    norms = tuple((1 + 0.1 * torch.randn(d, generator=gen)).bfloat16().to(device) for _ in range(4))
    caches = {"k": _poisoned_cache(nb, bs, hkv, d, device), "v": _poisoned_cache(nb, bs, hkv, d, device),
              "ik": _poisoned_cache(nb, bs, 1, d, device)}
    launch = qf.launch_fused if fused else qf.launch_unfused
    extra = {} if fused else {"qkv_dtype": torch.float32}
    wk = qf.prepack_weight(w, shape) if fused else w
    q, iq = launch(x, wk, cos, sin, slots, norms, caches["k"], caches["v"], caches["ik"] if g else None, shape,
                   1e-6, q_dtype=torch.float32, **extra)
    ref = _reference(x.float(), w.float(), cos, sin, norms, shape, 1e-6)
    report = {"q_rel": float((q - ref["q"]).norm() / ref["q"].norm())}
    if g:
        assert iq is not None
        report["iq_rel"] = float((iq - ref["iq"]).norm() / ref["iq"].norm())
    written = torch.zeros(nb * bs, dtype=torch.bool, device=device)
    written[slots] = True
    for key in ("k", "v") + (("ik",) if g else ()):
        c, r = caches[key], quant.nvfp4_quantize(ref[key])
        data, scale = c.data.flatten(0, 1), c.scale.flatten(0, 1).view(torch.uint8)
        assert bool((data[~written] == 0xFF).all()) and bool((scale[~written] == 0x7F).all()), f"{key}: stray writes"
        report[f"{key}_scale_diff"] = int((scale[slots] != r.scale.view(torch.uint8)).sum())
        report[f"{key}_byte_diff"] = int((data[slots] != r.data).sum())
        report[f"{key}_blocks"] = r.scale.numel()
    if not g:
        assert bool((caches["ik"].data == 0xFF).all()), "dense layers must not write index keys"
    return report


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "unfused"])
@pytest.mark.parametrize("name,t", [("tiny-sparse", 37), ("tiny-dense", 5), ("tiny-sparse", 1), ("tiny-dense", 12)])
def test_kernel_matches_reference_interpreter(name: str, t: int, fused: bool, rng: torch.Generator) -> None:
    """Interpreter (CPU) or GPU: q within f32 rounding, K/V/index-K bytes those of the reference quantizer up to a
    few rounding-boundary blocks."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    seed = int(torch.randint(0, 2**31 - 1, (1,), generator=rng))
    rep = _run(name, t, fused, device, seed)
    assert rep["q_rel"] < 1e-5, rep
    if "iq_rel" in rep:
        assert rep["iq_rel"] < 1e-5, rep
    for key in ("k", "v", "ik"):
        if f"{key}_blocks" in rep:
            _check_bytes(rep, key)


def _check_bytes(rep: dict[str, float], key: str) -> None:
    """Cache bytes equal the reference quantizer's except for a few boundary blocks: the kernel sums in float32 in
    its own order (GPU and interpreter alike), the reference in float64, so a value within ~1 ulp of a rounding
    boundary of the E4M3 scale or an E2M1 code can land on the other side (seen in the interpreter: rng
    seed 490894985, tiny-dense, 12 rows, fused: one K scale byte and 4 code bytes of 96 blocks)."""
    blocks = rep[f"{key}_blocks"]
    limit = max(2 if torch.cuda.is_available() else 1, blocks // 500)  # boundary blocks (a scale byte each)
    assert rep[f"{key}_scale_diff"] <= limit, rep
    assert rep[f"{key}_byte_diff"] <= 8 * limit + blocks // 50, rep  # their 8 code bytes, plus code boundaries


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 16, 64, 65, 512, 2048])
def test_kernel_small_shapes_gpu(t: int, rng: torch.Generator) -> None:
    """m3.1-small shapes on the GPU: q close, byte differences only from accumulation order (reported)."""
    seed = int(torch.randint(0, 2**31 - 1, (1,), generator=rng))
    rep = _run("small", t, True, "cuda", seed)
    print(rep)
    assert rep["q_rel"] < 1e-5 and rep["iq_rel"] < 1e-5, rep
    for key in ("k", "v", "ik"):
        _check_bytes(rep, key)
