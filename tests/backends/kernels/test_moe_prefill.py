"""MegaMoE prefill kernels (grouped GEMM, in-loop NVFP4 / MXFP8 dequant, GPU permutation) vs the reference.

The reference is ``MoE.forward``'s composition after routing (``torch.ops.m3c.grouped_gemm`` twice,
SiLU·up, routing-weight sum, shared expert through the dequantized weights), computed in float32
(or float64 for the GPU's large shapes) from the same inputs. CPU CI runs the kernels in Triton's
interpreter at tiny shapes; ``-m gpu`` runs them at m3.1-small shapes (64 experts of 6144×1536, top-8).
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
import torch.nn.functional as F
from moe_weights import meta_weights

from m3c.errors import ShapeError
from m3c.model_defs import ops, quant  # noqa: F401  (ops registers torch.ops.m3c.*)


def _mp():
    if not torch.cuda.is_available():
        assert os.environ.get("TRITON_INTERPRET") == "1", "tests/conftest.py sets the interpreter without a GPU"
    from m3c.backends.kernels import moe_prefill

    return moe_prefill


def _quant(w: torch.Tensor, fmt: str):
    """A random float weight in a stored format (NVFP4 with a per-row global scale)."""
    if fmt == "nvfp4":
        gs = (w.abs().amax(-1, keepdim=True) / (6 * 448)).clamp(min=1e-12)
        return quant.nvfp4_quantize(w, gs)
    if fmt == "mxfp8":
        return quant.mxfp8_quantize(w)
    return w.bfloat16()


def _deq(w, fmt: str) -> torch.Tensor:
    if fmt == "nvfp4":
        return quant.nvfp4_dequantize(w)
    if fmt == "mxfp8":
        return quant.mxfp8_dequantize(w)
    return w.float()


def _expert(w, e: int):
    """Expert e of a stacked [E, N, K] weight, in its own format (an NVFP4 per-row tensor scale sliced with it)."""
    if isinstance(w, quant.NVFP4Tensor):
        gs = w.global_scale
        return quant.NVFP4Tensor(w.data[e], w.scale[e], gs[e] if gs is not None and gs.dim() else gs)
    if isinstance(w, quant.MXFP8Tensor):
        return quant.MXFP8Tensor(w.data[e], w.scale[e])
    return w[e]


def _deq_expert(w, fmt: str, e: int) -> torch.Tensor:
    """Expert e of a stacked [E, N, K] weight, dequantized (float32)."""
    return _deq(_expert(w, e), fmt)


def _to(w, device: str):
    if isinstance(w, quant.NVFP4Tensor):
        return quant.NVFP4Tensor(w.data.to(device), w.scale.to(device), w.global_scale.to(device))
    if isinstance(w, quant.MXFP8Tensor):
        return quant.MXFP8Tensor(w.data.to(device), w.scale.to(device))
    return None if w is None else w.to(device)


def _problem(t: int, h: int, inter: int, e: int, k: int, s: int, fmt: str, sfmt: str | None,
             gen: torch.Generator, skew: bool = False, empty: int = 0):
    """Random weights (stored formats), tokens, routing. `skew`: one expert takes most tokens; `empty`:
    that many experts receive no token."""
    w13 = _quant(torch.randn(e, 2 * inter, h, generator=gen) / h**0.5, fmt)
    w2 = _quant(torch.randn(e, h, inter, generator=gen) / inter**0.5, fmt)
    sh13 = sh2 = None
    if sfmt:
        sh13 = _quant(torch.randn(2 * s, h, generator=gen) / h**0.5, sfmt)
        sh2 = _quant(torch.randn(h, s, generator=gen) / s**0.5, sfmt)
    x = torch.randn(t, h, generator=gen)
    live = e - empty
    scores = torch.rand(t, live, generator=gen)
    if skew:
        scores[:, 0] += 1.0  # expert 0 in every token's top-k
    ids = scores.topk(k, dim=1).indices
    perm = torch.randperm(e, generator=gen)[:live]  # the live experts are a random subset
    ids = perm[ids]
    wts = torch.rand(t, k, generator=gen) + 0.1
    return x, ids, wts, w13, w2, sh13, sh2


def _reference(x, ids, wts, w13, w2, sh13, sh2, fmt, sfmt, dtype=torch.float32,
               stored: torch.dtype | None = None) -> torch.Tensor:
    """MoE.forward after routing, in `dtype`, through the reference ops. `stored` (float32 path): also round
    where the kernels store a tensor in the activation dtype — the SiLU·up activations, each slot's weighted
    FC2 row, the shared expert's FC2 row and the output — so few-row cases need no looser bound."""
    xf = x.to(dtype)

    def kept(v: torch.Tensor) -> torch.Tensor:
        return v if stored is None else v.to(stored).to(dtype)

    if dtype == torch.float32:
        s13, g13 = (None, None) if fmt == "bf16" else (w13.scale, getattr(w13, "global_scale", None))
        s2, g2 = (None, None) if fmt == "bf16" else (w2.scale, getattr(w2, "global_scale", None))
        d13 = w13 if fmt == "bf16" else w13.data
        d2 = w2 if fmt == "bf16" else w2.data
        gu = torch.ops.m3c.grouped_gemm(xf, ids, d13, s13, g13, fmt)
        g, u = gu.chunk(2, dim=-1)
        down = torch.ops.m3c.grouped_gemm(kept(F.silu(g) * u), ids, d2, s2, g2, fmt)
    else:  # float64 on the GPU: one dense pass per expert, dequantized one at a time (all 64 of m3.1-small's in
        # float64 were ~15 GB a test process)
        down = torch.zeros(*ids.shape, x.shape[1], dtype=dtype, device=x.device)
        for e in range((w13.data if fmt != "bf16" else w13).shape[0]):
            tok, slot = (ids == e).nonzero(as_tuple=True)
            g, u = (xf[tok] @ _deq_expert(w13, fmt, e).to(dtype).t()).chunk(2, dim=-1)
            down[tok, slot] = (F.silu(g) * u) @ _deq_expert(w2, fmt, e).to(dtype).t()
    out = kept(down * wts.to(dtype).unsqueeze(-1)).sum(dim=1)
    if sfmt:
        sg, su = (xf @ _deq(sh13, sfmt).to(dtype).t()).chunk(2, dim=-1)
        out = out + kept(kept(F.silu(sg) * su) @ _deq(sh2, sfmt).to(dtype).t())
    return kept(out)


def _run(mp, x, ids, wts, w13, w2, sh13, sh2, act: torch.dtype, **kw) -> torch.Tensor:
    xa = x.to(act)
    out = torch.full((x.shape[0], x.shape[1]), float("nan"), dtype=act, device=x.device)
    got = mp.moe_prefill(xa, ids, wts, w13, w2, sh13, sh2, out=out, **kw)
    assert got is out
    return out


def _check(got: torch.Tensor, ref: torch.Tensor, act: torch.dtype) -> None:
    assert torch.isfinite(got).all(), "unwritten (NaN-poisoned) or non-finite outputs"
    rel = float((got.double() - ref.double()).norm() / ref.double().norm())
    worst = float((got.double() - ref.double()).abs().max() / ref.double().abs().max())
    limit = 2e-6 if act == torch.float32 else 1e-2
    assert rel < limit and worst < 5 * limit, (rel, worst)


CASES = {
    # id: (T, H, I, E, k, S, routed fmt, shared fmt, act, skew, empty experts)
    "nvfp4-mxfp8sh-f32": (33, 256, 128, 8, 2, 64, "nvfp4", "mxfp8", torch.float32, False, 2),
    "nvfp4-bf16sh-f32-skew": (200, 128, 64, 8, 2, 64, "nvfp4", "bf16", torch.float32, True, 3),
    "nvfp4-mxfp8sh-bf16": (65, 128, 64, 8, 2, 64, "nvfp4", "mxfp8", torch.bfloat16, False, 1),
    "nvfp4-noshared-bf16-skew": (40, 128, 64, 8, 2, 0, "nvfp4", None, torch.bfloat16, True, 0),
    "mxfp8-mxfp8sh-f32-skew": (65, 128, 64, 8, 2, 64, "mxfp8", "mxfp8", torch.float32, True, 4),
    "bf16-noshared-f32": (5, 128, 64, 8, 2, 0, "bf16", None, torch.float32, False, 0),
}


@pytest.fixture(autouse=True)
def _poison_workspaces(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fill the kernels' internal buffers (act, y) with NaN so rows a launch forgets to write show up."""
    monkeypatch.setattr(_mp(), "POISON_WORKSPACES", True)


@pytest.mark.parametrize("case", list(CASES))
def test_matches_reference(case: str, rng: torch.Generator) -> None:
    """Interpreter (or GPU): the three launches equal the reference composition within dtype rounding."""
    t, h, inter, e, k, s, fmt, sfmt, act, skew, empty = CASES[case]
    mp = _mp()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    x, ids, wts, w13, w2, sh13, sh2 = _problem(t, h, inter, e, k, s, fmt, sfmt, rng, skew, empty)
    x = x.to(act).float()  # bf16-exact inputs: the reference sees what the kernel sees
    ref = _reference(x, ids, wts, w13, w2, sh13, sh2, fmt, sfmt)
    got = _run(mp, *(_to(v, dev) for v in (x, ids, wts, w13, w2, sh13, sh2)), act)
    _check(got.cpu(), ref, act)


GEMV_CASES = {
    # id: (T, H, I, E, k, S, routed fmt, shared fmt, act)
    "nvfp4-mxfp8sh-f32": (4, 256, 64, 8, 2, 64, "nvfp4", "mxfp8", torch.float32),
    "nvfp4-bf16sh-bf16": (3, 128, 64, 8, 3, 32, "nvfp4", "bf16", torch.bfloat16),
    "mxfp8-noshared-f32": (2, 128, 64, 4, 2, 0, "mxfp8", None, torch.float32),
    "bf16-mxfp8sh-f32": (1, 128, 32, 8, 2, 32, "bf16", "mxfp8", torch.float32),
}


def _one_expert_problem(case: str, rng: torch.Generator, t: int | None = None):
    """A GEMV_CASES problem where one expert takes every token's first slot (more rows than a 1- or 2-row GEMV
    tile, or a 16-row swap tile at t > 16, holds) and, at t > 1, an id outside [0, E) in the last row; returns
    the problem on the test device, its reference and the activation dtype."""
    t0, h, inter, e, k, s, fmt, sfmt, act = GEMV_CASES[case]
    t = t or t0
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    x, ids, wts, w13, w2, sh13, sh2 = _problem(t, h, inter, e, k, s, fmt, sfmt, rng)
    ids[:, 0] = ids[0, 0]
    ids[:, 1:] = torch.where(ids[:, 1:] == ids[0, 0], (ids[0, 0] + 1) % e, ids[:, 1:])
    x = x.to(act).float()
    keep = wts.clone()
    if t > 1:  # ids outside [0, E) contribute nothing (the reference sees them as weight 0 on a valid id)
        bad = ids.clone()
        bad[t - 1, k - 1] = -1 if t % 2 else e
        keep[t - 1, k - 1] = 0.0
    else:
        bad = ids
    ref = _reference(x, ids, keep, w13, w2, sh13, sh2, fmt, sfmt, stored=act)
    prob = tuple(_to(v, dev) for v in (x.to(act), bad, wts, w13, w2, sh13, sh2))
    return prob, ref, act


@pytest.mark.parametrize("bucket,pipe", [("gemv1", 0), ("gemv2", 0), ("gemv4", 0), ("gemv1", 3), ("gemv4", 2)])
@pytest.mark.parametrize("case", list(GEMV_CASES))
def test_gemv_tiles_match_reference(case: str, bucket: str, pipe: int, rng: torch.Generator) -> None:
    """The FMA (GEMV) tiles, 1 / 2 / 4 rows per tile, bytes prefetched in registers or pipelined by Triton
    (``pipe``), in every weight format: experts holding more rows than a tile, tiles with fewer rows than their
    size, and the shared expert's partial last tile all match."""
    mp = _mp()
    prob, ref, act = _one_expert_problem(case, rng)
    lay = mp._layout(*prob)
    tiles = dataclasses.replace(mp._tile_options(lay, bucket, mp.interpreting()), pipe=pipe)
    assert tiles.gemv and tiles.bm == int(bucket[4:])
    out = torch.full_like(prob[0], float("nan"))
    mp._launch(*prob, lay, tiles, mp.jit_run, out)
    _check(out.cpu(), ref, act)


@pytest.mark.parametrize("t,pipe", [(None, 0), (None, 2), (20, 0), (20, 3)])
@pytest.mark.parametrize("case", list(GEMV_CASES))
def test_swap_tiles_match_reference(case: str, t: int | None, pipe: int, rng: torch.Generator) -> None:
    """The weight-stationary tensor-core tiles (``moe_swap``), bytes prefetched in registers (pipe 0) or
    pipelined by Triton, in every weight format: a few tokens, and 20 tokens where one expert's rows span two
    16-token tiles (the second partly empty)."""
    mp = _mp()
    prob, ref, act = _one_expert_problem(case, rng, t)
    lay = mp._layout(*prob)
    tiles = dataclasses.replace(mp._tile_options(lay, "swap", mp.interpreting()), pipe=pipe)
    assert tiles.swap and not tiles.gemv and mp._specs(lay, tiles, mp.interpreting())[0].constexprs["SWAP"]
    out = torch.full_like(prob[0], float("nan"))
    mp._launch(*prob, lay, tiles, mp.jit_run, out)
    _check(out.cpu(), ref, act)


def test_swap_tiles_need_four_code_bytes_per_thread(rng: torch.Generator, monkeypatch: pytest.MonkeyPatch) -> None:
    """On the GPU path (bf16, NVFP4, no interpreter) a swap tiling whose threads would hold < 4 code bytes a step
    is refused: its PTX would read undefined lanes."""
    mp = _mp()
    x, ids, wts, w13, w2, sh13, sh2 = _problem(2, 128, 64, 8, 2, 64, "nvfp4", "mxfp8", rng)
    lay = mp._layout(x.bfloat16(), ids, wts, w13, w2, sh13, sh2)
    monkeypatch.setattr(mp, "interpreting", lambda: False)
    good = dataclasses.replace(mp._tile_options(lay, "swap", False), bn1=32, bn2=32, bk=32, warps=1)
    mp._check_tiles(lay, good)  # 32 · 32 / 2 = 512 bytes over 32 threads
    with pytest.raises(ShapeError, match="4 code bytes per thread"):
        mp._check_tiles(lay, dataclasses.replace(good, bn1=16, bn2=16, warps=4))


def test_rejects_tilings_that_do_not_fit(rng: torch.Generator) -> None:
    """Explicit tilings (benchmarks) are checked: GEMV tiles of 1, 2 or 4 rows only, swap tiles of MMA shapes,
    tiles dividing the dims."""
    mp = _mp()
    x, ids, wts, w13, w2, sh13, sh2 = _problem(2, 128, 64, 8, 2, 64, "nvfp4", "mxfp8", rng)
    lay = mp._layout(x, ids, wts, w13, w2, sh13, sh2)
    with pytest.raises(ShapeError, match="1, 2 or 4 rows"):
        mp._tile_options(lay, "gemv8", False)
    good = mp._tile_options(lay, "gemv1", True)
    for bad, match in ((dataclasses.replace(good, bm=8), "1, 2 or 4 rows"), (dataclasses.replace(good, bk=96), "bk=96"),
                       (dataclasses.replace(good, bn1=48), "bn1=48"),
                       (dataclasses.replace(mp._tile_options(lay, "small", True), pipe=3), "pipe"),
                       (dataclasses.replace(mp._tile_options(lay, "swap", True), bm=8), "power of two >= 16"),
                       (dataclasses.replace(mp._tile_options(lay, "swap", True), bn2=8), "bn1, bn2 >= 16"),
                       (dataclasses.replace(good, swap=True), "either gemv or swap")):
        with pytest.raises(ShapeError, match=match):
            mp._launch(x, ids, wts, w13, w2, sh13, sh2, lay, bad, mp.jit_run, None)


def test_tiny_batch_invalid_ids_and_determinism(rng: torch.Generator) -> None:
    """T = 1 and 3, an id outside [0, E) contributes nothing, and repeated runs are bit-identical."""
    mp = _mp()
    x, ids, wts, w13, w2, sh13, sh2 = _problem(3, 128, 32, 8, 2, 32, "nvfp4", "mxfp8", rng)
    got1 = _run(mp, x[:1], ids[:1], wts[:1], w13, w2, sh13, sh2, torch.float32)
    _check(got1, _reference(x[:1], ids[:1], wts[:1], w13, w2, sh13, sh2, "nvfp4", "mxfp8"), torch.float32)
    bad = ids.clone()
    bad[1, 0] = -1
    bad[2, 1] = 8
    keep = wts.clone()
    keep[1, 0] = 0.0
    keep[2, 1] = 0.0
    got = _run(mp, x, bad, wts, w13, w2, sh13, sh2, torch.float32)
    ref = _reference(x, ids, keep, w13, w2, sh13, sh2, "nvfp4", "mxfp8")
    _check(got, ref, torch.float32)
    again = _run(mp, x, bad, wts, w13, w2, sh13, sh2, torch.float32)
    assert torch.equal(got, again)


def test_rejects_bad_inputs(rng: torch.Generator) -> None:
    """Shape, dtype and format mismatches raise ShapeError before any launch."""
    mp = _mp()
    x, ids, wts, w13, w2, sh13, sh2 = _problem(4, 128, 32, 8, 2, 32, "nvfp4", "mxfp8", rng)
    with pytest.raises(ShapeError, match="topk_ids"):
        mp.moe_prefill(x, ids[:3], wts, w13, w2, sh13, sh2)
    with pytest.raises(ShapeError, match="x must be"):
        mp.moe_prefill(x.half(), ids, wts, w13, w2, sh13, sh2)
    with pytest.raises(ShapeError, match="w2"):
        mp.moe_prefill(x, ids, wts, w13, w13, sh13, sh2)
    with pytest.raises(ShapeError, match="both"):
        mp.moe_prefill(x, ids, wts, w13, w2, sh13, None)
    with pytest.raises(ShapeError, match="global_scale"):
        mp.moe_prefill(x, ids, wts, w13, quant.NVFP4Tensor(w2.data, w2.scale, None), sh13, sh2)
    with pytest.raises(ShapeError, match="out"):
        mp.moe_prefill(x, ids, wts, w13, w2, sh13, sh2, out=torch.empty(4, 64))
    assert mp.moe_prefill_supported(6144, 1536, 64, 8, 1536, "bf16", "nvfp4", "mxfp8") is None
    assert mp.moe_prefill_supported(100, 1536, 64, 8, 1536, "bf16", "nvfp4", "mxfp8") is not None
    assert mp.moe_prefill_supported(6144, 1536, 64, 8, 1536, "fp16", "nvfp4", "mxfp8") is not None


def test_launched_specs_are_listed_and_compile(monkeypatch: pytest.MonkeyPatch) -> None:
    """At m3.1-small shapes the launcher only uses specs that moe_prefill_specs lists (checked on the meta
    device: no data, no host sync possible), with fixed grids per T; the specs AOT-compile for sm_90a
    without register spills."""
    from m3c.backends.triton_aot import compile_kernels

    mp = _mp()
    monkeypatch.setattr(mp, "interpreting", lambda: False)  # the GPU's tiles and dot settings
    monkeypatch.setattr(mp, "POISON_WORKSPACES", False)
    h, inter, e, k, s = 6144, 1536, 64, 8, 1536
    specs = mp.moe_prefill_specs(h, inter, e, k, s, "bf16", "nvfp4", "mxfp8")
    listed = {sp.key() for sp in specs}
    w13, w2, sh13, sh2 = meta_weights(e, h, inter, s)
    for t in (1, 3, 4, 16, 17, 65, 512, 4096, 16384):
        seen: list = []
        x = torch.empty(t, h, dtype=torch.bfloat16, device="meta")
        ids = torch.empty(t, k, dtype=torch.int64, device="meta")
        wts = torch.empty(t, k, device="meta")
        mp.moe_prefill(x, ids, wts, w13, w2, sh13, sh2, runner=lambda sp, grid, args, seen=seen: seen.append((sp, grid, args)))
        assert len(seen) == 3 and {sp.key() for sp, _, _ in seen} <= listed, t
        for sp, _, args in seen:
            assert len(args) == len(sp.arg_types), sp.family
    # the T >= 4096 bucket (the small one differs only in tile sizes), the GEMV tiles (T <= 3), the swap tiles
    large = [sp for sp in specs if sp.constexprs.get("BM", 0) == 128 or sp.family == "moe_prefill_combine"]
    gemv = [sp for sp in specs if sp.constexprs.get("GEMV")]
    swap = [sp for sp in specs if sp.constexprs.get("SWAP")]
    assert len(gemv) == 2 and all(sp.enable_fp_fusion for sp in gemv) and len(swap) == 2
    lay = mp.Layout(h, inter, e, k, s, "bf16", "nvfp4", "mxfp8")  # + the pipelined GEMV option (benchmarked)
    piped = list(mp._specs(lay, dataclasses.replace(mp._tile_options(lay, "gemv1", False), pipe=3), False)[:2])
    built = compile_kernels(large + gemv + swap + piped)
    assert all("cp.async" in b.stages["ptx"] for b in built[-2:])  # Triton streams the weight bytes
    assert all("cp.async" not in b.stages["ptx"] for b in built[-6:-4])  # GEMV pipe 0: register prefetch only
    for b in built[-4:-2]:  # swap tiles: NVFP4 decoded by the PTX (bf16x2 scale multiplies), wgmma, cp.async
        assert all(op in b.stages["ptx"] for op in ("mul.rn.bf16x2", "wgmma.mma_async", "cp.async")), b.name
        assert _asm_bytes_per_thread(b.stages["ttgir"]) % 4 == 0, b.name  # the PTX reads 4 consecutive code bytes
    built = built[:-2]
    assert sorted(b.name for b in built) == sorted(["moe_combine_kernel"] + ["moe_fc1_kernel", "moe_fc2_kernel"] * 3)
    for b, sp in zip(built, large + gemv + swap):
        if b.name != "moe_combine_kernel":  # tensor-core tiles use wgmma; the GEMV tiles no MMA at all
            assert b.binary and ("wgmma.mma_async" in b.stages["ptx"]) != bool(sp.constexprs["GEMV"]), b.name
        spills = _ptxas_spills(b.stages["ptx"])
        assert spills in (None, 0), f"{b.name} spills {spills} bytes"


def _asm_bytes_per_thread(ttgir: str) -> int:
    """Consecutive elements per thread (last dim) of the swap decode's inline-asm operands: the smallest over its
    calls (the PTX decodes four packed code bytes, so anything but a multiple of 4 would feed it undefined lanes)."""
    import re

    layouts = dict(re.findall(r"^(#blocked\d*) = #ttg\.blocked<\{sizePerThread = \[([\d, ]+)\]", ttgir, re.M))
    calls = [line for line in ttgir.splitlines() if "elementwise_inline_asm" in line and "bf16x2" in line]
    assert calls, "no swap decode asm found"
    return min(int(layouts[enc].split(",")[-1]) for line in calls for enc in re.findall(r"xi8, (#blocked\d*)>", line))


def _ptxas_spills(ptx: str) -> int | None:
    """Spill bytes ptxas reports for sm_90a (None when Triton's ptxas for this PTX version is not there)."""
    import subprocess
    import tempfile
    from pathlib import Path

    import triton

    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas-blackwell"
    if not ptxas.exists():
        return None
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.ptx"
        src.write_text(ptx)
        r = subprocess.run([str(ptxas), "-v", "--gpu-name", "sm_90a", str(src), "-o", str(Path(tmp) / "k.o")],
                           capture_output=True, text=True)
    if r.returncode:
        return None
    nums = [int(w) for line in r.stderr.splitlines() if "spill" in line
            for w, nxt in zip(line.split(), line.split()[1:]) if nxt == "bytes" and w.isdigit()]
    return sum(nums)


# ---------------------------------------------------------------------------------------------
# GPU: m3.1-small shapes (64 experts of 6144×1536, top-8, MXFP8 shared expert)
# ---------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 4, 512, 4096])
@pytest.mark.parametrize("skew", [False, True], ids=["uniform", "skewed"])
def test_m31_small_gpu(t: int, skew: bool, rng: torch.Generator) -> None:
    """bf16 activations at m3.1-small shapes against a float64 reference on the GPU."""
    mp = _mp()
    h, inter, e, k, s = 6144, 1536, 64, 8, 1536
    x, ids, wts, w13, w2, sh13, sh2 = _problem(t, h, inter, e, k, s, "nvfp4", "mxfp8", rng, skew=skew,
                                               empty=3 if skew else 0)
    x = x.bfloat16().float()
    args = [_to(v, "cuda") for v in (x, ids, wts, w13, w2, sh13, sh2)]
    got = _run(mp, *args, torch.bfloat16)
    ref = _reference(*args, "nvfp4", "mxfp8", dtype=torch.float64)
    _check(got, ref, torch.bfloat16)
    again = _run(mp, *args, torch.bfloat16)
    assert torch.equal(got, again), "not deterministic"


@pytest.mark.gpu
@pytest.mark.parametrize("t", [300, 3], ids=["tensor-core-tiles", "gemv-tiles"])
def test_cuda_graph_capture_gpu(t: int, rng: torch.Generator) -> None:
    """The whole launcher (sort, offsets, three launches) captures into a CUDA graph and replays correctly."""
    mp = _mp()
    h, inter, e, k, s = 1024, 256, 16, 4, 256
    x, ids, wts, w13, w2, sh13, sh2 = _problem(t, h, inter, e, k, s, "nvfp4", "mxfp8", rng)
    args = [_to(v, "cuda") for v in (x.bfloat16(), ids, wts, w13, w2, sh13, sh2)]
    out = torch.empty(t, h, dtype=torch.bfloat16, device="cuda")
    mp.moe_prefill(*args, out=out)  # warm-up: JIT compiles outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        mp.moe_prefill(*args, out=out)
    x2, ids2, wts2, *_ = _problem(t, h, inter, e, k, s, "nvfp4", "mxfp8", rng)
    args[0].copy_(x2.bfloat16())
    args[1].copy_(ids2)
    args[2].copy_(wts2)
    graph.replay()
    torch.cuda.synchronize()
    ref = _reference(*[a.float() if i == 0 else a for i, a in enumerate(args)], "nvfp4", "mxfp8",
                     dtype=torch.float64)
    _check(out, ref, torch.bfloat16)


def test_per_expert_and_per_tensor_global_scales(rng: torch.Generator) -> None:
    """ModelOpt-style NVFP4 scales (one per expert, or one per tensor) give the per-row result."""
    mp = _mp()
    x, ids, wts, w13, w2, _, _ = _problem(5, 128, 32, 4, 2, 32, "nvfp4", None, rng)
    for lead_shape in ((4, 1, 1), ()):  # per expert, per tensor
        gs = torch.rand(lead_shape, generator=rng) + 0.5
        rows13 = gs.reshape(-1, 1, 1).expand(4, 64, 1).contiguous()
        rows2 = gs.reshape(-1, 1, 1).expand(4, 128, 1).contiguous()
        coarse = [quant.NVFP4Tensor(w.data, w.scale, gs) for w in (w13, w2)]
        per_row = [quant.NVFP4Tensor(w13.data, w13.scale, rows13), quant.NVFP4Tensor(w2.data, w2.scale, rows2)]
        got = _run(mp, x, ids, wts, *coarse, None, None, torch.float32)
        want = _run(mp, x, ids, wts, *per_row, None, None, torch.float32)
        assert torch.equal(got, want)
    # the per-row expansion is made once per scale tensor version (not at every step) and sees in-place updates
    gs = torch.rand(4, 1, 1, generator=rng) + 0.5
    w = quant.NVFP4Tensor(w13.data, w13.scale, gs)
    first = mp.weight_args(w, "nvfp4", (4, 64, 128), "w13")[2]
    assert mp.weight_args(w, "nvfp4", (4, 64, 128), "w13")[2].data_ptr() == first.data_ptr()  # no new copy
    gs.mul_(2)
    again = mp.weight_args(w, "nvfp4", (4, 64, 128), "w13")[2]
    assert again.data_ptr() != first.data_ptr() and torch.equal(again, 2 * first) and again.shape == (4, 64, 1)
