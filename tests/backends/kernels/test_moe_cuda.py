"""The CUDA C++ MegaMoE decode: prepacked layouts (CPU: a Python twin of the kernel's loads and decode must give
back every weight exactly), offline sm_90a compile and SASS (needs nvcc: PyPI's nvidia-cuda-nvcc is a test
dependency), and the kernels on the GPU against the reference MoE."""

from __future__ import annotations

import itertools
import math
import re
from pathlib import Path

import pytest
import torch

from m3c.backends.cuda_aot import compile_cuda, disassemble
from m3c.backends.kernels import moe_cuda
from m3c.errors import ConfigError, ShapeError
from m3c.model_defs import quant

F16_HIGH = (0x00, 0x38, 0x3C, 0x3E, 0x40, 0x42, 0x44, 0x46)  # f16 high bytes of 0, .5, 1, 1.5, 2, 3, 4, 6


def _random_nvfp4(rows: int, k: int, gen: torch.Generator) -> quant.NVFP4Tensor:
    w = torch.randn(rows, k, generator=gen) * torch.rand(rows, 1, generator=gen).add(0.05)
    w[0, :16] = 0.0  # a zero block (scale 0)
    w[1, 16:32] *= 1e-4  # a tiny block (subnormal E4M3 scale)
    return quant.nvfp4_quantize(w, None)


def _f16_from_high(byte: torch.Tensor) -> torch.Tensor:
    return (byte.to(torch.int32) << 8).to(torch.int16).view(torch.float16).to(torch.float32)


def _emulate_nvfp4(codes: torch.Tensor, scales: torch.Tensor, rows: int, k: int) -> torch.Tensor:
    """What the kernel's NVFP4 stream (load_nvfp4 / mma_nvfp4) feeds its MMAs, as a [rows, K] matrix: words read at the kernel's offsets
    (tile, super-chunk, chunk, lane, step), prmt decode of decode_nvfp4 (DECODE 0), times the lane's scales."""
    tiles, nsc = rows // 16, k // 256
    words = codes.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    words = words.reshape(tiles, nsc, 4, 32, 4)  # tile, sc, c, lane, s
    lut = torch.tensor(F16_HIGH, dtype=torch.int64)
    m = words & 0x77777777
    oa = [lut[(m >> (4 * i)) & 7] | (((words >> (8 * i + 7)) & 1) << 7) for i in range(4)]
    ob = [lut[(m >> (16 + 4 * i)) & 7] | (((words >> (8 * i + 3)) & 1) << 7) for i in range(4)]
    # A registers: a0 = (oa0, oa1) row g, k0 k1; a1 = (oa2, oa3) row g+8; a2 = (ob0, ob1) row g, k2 k3; a3 row g+8
    vals = torch.stack([torch.stack([_f16_from_high(v) for v in (oa[0], oa[1], ob[0], ob[1])], -1),
                        torch.stack([_f16_from_high(v) for v in (oa[2], oa[3], ob[2], ob[3])], -1)], -2)
    # vals: tile, sc, c, lane, s, h, e
    sc = scales.reshape(tiles, nsc, 32, 4, 2).view(torch.float8_e4m3fn).to(torch.float32)  # tile, sc, lane, c, h
    vals = vals * sc.permute(0, 1, 3, 2, 4)[:, :, :, :, None, :, None]
    vals = vals.reshape(tiles, nsc, 4, 8, 4, 4, 2, 4)  # tile, sc, c, g, j, s, h, e
    return vals.permute(0, 6, 3, 1, 2, 4, 5, 7).reshape(rows, k)  # row = 16 tile + 8 h + g; k = 256sc+64c+16j+4s+e


@pytest.mark.parametrize("rows,k", [(16, 256), (48, 512)])
def test_prepack_nvfp4_twin_recovers_every_weight(rows: int, k: int) -> None:
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    q = _random_nvfp4(rows, k, gen)
    codes, scales = moe_cuda.prepack_nvfp4(q.data, q.scale)
    assert codes.numel() == rows * k // 2 and scales.numel() == rows * k // 16
    want = quant.e2m1_decode(quant.unpack_nibbles(q.data)) * q.scale.to(torch.float32).repeat_interleave(16, -1)
    got = _emulate_nvfp4(codes, scales, rows, k)
    assert torch.equal(got, want)
    assert (want[2:] != 0).any() and (want < 0).any()  # signs and magnitudes both exercised


def test_prepack_nvfp4_mutation_is_caught() -> None:
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    q = _random_nvfp4(16, 256, gen)
    codes, scales = moe_cuda.prepack_nvfp4(q.data, q.scale)
    want = quant.e2m1_decode(quant.unpack_nibbles(q.data)) * q.scale.to(torch.float32).repeat_interleave(16, -1)
    bad = codes.clone()
    bad[16 * 5 + 1] ^= 0x11  # nibbles 2, 3 of lane 5 step 0: row 9, k 16, 17 (not the zero / tiny blocks)
    assert not torch.equal(_emulate_nvfp4(bad, scales, 16, 256), want)


def test_prepack_mxfp8_layout() -> None:
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    rows, k = 32, 256
    data = torch.randint(0, 256, (rows, k), generator=gen, dtype=torch.uint8)
    packed = moe_cuda.prepack_mxfp8(data.view(torch.float8_e4m3fn))
    # the kernel's gemv_mxfp8: uint4 unit (q // 2) of lane (g, j); words w0 / w1 of step q at .x/.y (q even) or
    # .z/.w (q odd); w0 = rows (g, g+8) x k (0, 1), w1 = x k (2, 3); k = 128 sc + 16 q + 4 j + e
    b = packed.reshape(rows // 16, k // 128, 4, 32, 2, 2, 2, 2)  # tile, sc, u, lane, qq, ew, h, e2
    for tile, sc, q, lane, e, h in [(0, 0, 0, 0, 0, 0), (1, 1, 7, 31, 3, 1), (0, 1, 5, 13, 2, 0), (1, 0, 2, 6, 1, 1)]:
        g, j = lane // 4, lane % 4
        got = b[tile, sc, q // 2, lane, q % 2, e // 2, h, e % 2]
        assert got == data[16 * tile + 8 * h + g, 128 * sc + 16 * q + 4 * j + e]
    assert torch.equal(packed.sort().values, data.reshape(-1).sort().values)  # a permutation: nothing lost


def test_prepack_rejects_bad_shapes() -> None:
    with pytest.raises(ShapeError, match="K % 256"):
        moe_cuda.prepack_nvfp4(torch.zeros(16, 64, dtype=torch.uint8), torch.zeros(16, 8, dtype=torch.uint8))
    with pytest.raises(ShapeError, match="N % 16"):
        moe_cuda.prepack_mxfp8(torch.zeros(8, 128, dtype=torch.uint8))


def test_supported_reasons() -> None:
    assert moe_cuda.mma_supported(6144, 1536, 64, 8, 1536, "bf16", "nvfp4", "mxfp8", 1) is None
    assert moe_cuda.mma_supported(6144, 1536, 64, 8, 1536, "bf16", "nvfp4", "mxfp8", 64) is None
    assert "1..64" in moe_cuda.mma_supported(6144, 1536, 64, 8, 1536, "bf16", "nvfp4", "mxfp8", 65)
    assert "MXFP8 or none" in moe_cuda.mma_supported(6144, 1536, 64, 8, 1536, "bf16", "nvfp4", "bf16", 1)
    assert "multiples of 256" in moe_cuda.mma_supported(6144 + 128, 1536, 64, 8, 1536, "bf16", "nvfp4", None, 1)
    # H = 256 x 29: one FC1 K split, so 16 staged tokens (NT = 2, above NT1_MAX_TOKENS) need 237,696 bytes of
    # shared memory (> 227 KB); 8 at a time fit (the NT = 1 builds, looping over groups of 8 above 8 tokens)
    big = moe_cuda.NT1_MAX_TOKENS + 1
    assert "shared memory" in moe_cuda.mma_supported(7424, 1536, 64, 8, 1536, "bf16", "nvfp4", "mxfp8", big)
    for t in (8, 16, moe_cuda.NT1_MAX_TOKENS):
        assert moe_cuda.mma_supported(7424, 1536, 64, 8, 1536, "bf16", "nvfp4", "mxfp8", t) is None
    from m3c.backends.cuda_aot import CudaKernelSpec
    from m3c.backends.kernels.megamoe import megamoe_specs

    listed = [sp for sp in megamoe_specs(7424, 1536, 64, 8, 1536, "bf16", "nvfp4", "mxfp8")
              if isinstance(sp, CudaKernelSpec)]
    cuda = [sp for sp in listed if sp.family != "megamoe_prefill_wgmma"]
    assert len(listed) - len(cuda) == 2  # the wgmma prefill's FC1 and FC2 (H = 7424 is a multiple of 256)
    decode = [sp for sp in cuda if sp.kernel != "moe_route_stage"]  # the NT = 1 builds, plain and looping
    assert len(decode) == 10 and all(dict(sp.defines)["NT"] == 1 for sp in decode)
    assert len(cuda) - len(decode) == 3  # routing for 8, 16 and 64 tokens (up to 32 run here)
    assert all(sp.shared_bytes <= moe_cuda.SMEM_LIMIT for sp in cuda)


@pytest.mark.parametrize("natural", [False, True])
def test_kernels_compile_for_sm90a_with_mma_and_prmt(natural: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(moe_cuda, "NATURAL", natural)
    specs = moe_cuda.mma_specs(6144, 1536, 1536, "bf16")
    assert ("NATURAL", 1) in specs[1].defines if natural else all("NATURAL" not in dict(sp.defines) for sp in specs)
    for spec in specs:
        ck = compile_cuda(spec, "sm_90a")
        assert ck.binary[:4] == b"\x7fELF" and ck.name == spec.kernel
        if spec.kernel == "moe_fc1":
            sass = disassemble(ck.binary)
            assert "HMMA.16816.F32" in sass and "PRMT" in sass and "HMUL2" in sass
            assert "LDG.E.NA.128" in sass  # the weights streamed in 16-byte loads without L1 allocation
            assert "STL" not in sass  # no register spills


def kernel_sass(spec) -> str:
    """The sm_90a SASS of the spec's own kernel (its binary holds the source's other kernels too)."""
    sass = disassemble(compile_cuda(spec, "sm_90a").binary).split(f"Function : {spec.kernel}")[1]
    return sass.split("Function :")[0]


def kernel_opcodes(spec) -> list[str]:
    """The opcodes (with their modifiers) of the spec's own kernel's SASS, in order; predicated ones too."""
    words = [line.split("*/")[1].split() for line in kernel_sass(spec).splitlines()
             if re.search(r"/\*[0-9a-f]{4,5}\*/", line)]
    return [w[1] if w[0].startswith("@") else w[0] for w in words]


@pytest.mark.parametrize("tokens", [1, 9, 33])  # the decode builds megamoe runs: 1..8, 9..32, 33..64 tokens
def test_dependent_launches_wait_and_release_in_sass(tokens: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """PDL: FC1 / act / FC2 / combine are launched programmatically where PDL says (per NT), wait on their
    predecessor (SASS ACQBULK) and release their dependents (PREEXIT), spilling at most a few words (FC2 of the NT = 1
    looping build: 4); the staging launch is never programmatic, and the same kernels without PDL have other keys
    (one compiled binary each)."""
    nt, wide = moe_cuda.decode_build(tokens)
    monkeypatch.setattr(moe_cuda, "PDL", {nt: moe_cuda.PDL_KERNELS})
    specs = moe_cuda.mma_specs(6144, 1536, 2048, "bf16", nt, wide)
    assert [sp.pdl for sp in specs] == [False, True, True, True, True]
    for spec in specs:
        sass = kernel_sass(spec)
        assert "ACQBULK" in sass and "PREEXIT" in sass, spec.kernel
        assert sass.count("STL") <= (4 if spec.kernel == "moe_fc2" and (nt, wide) == (1, True) else 0), spec.kernel
    assert "FC1_MIN_CTAS" not in dict(specs[1].defines)  # the compiler's choice in every build that runs
    monkeypatch.setattr(moe_cuda, "PDL", {})
    plain = moe_cuda.mma_specs(6144, 1536, 2048, "bf16", nt, wide)
    assert not any(sp.pdl for sp in plain)
    assert all(a.key() != b.key() for a, b in zip(specs[1:], plain[1:])) and specs[0].key() == plain[0].key()


@pytest.mark.parametrize("tokens, programmatic", [
    (1, ()),  # the folded build: nothing (FC1 or FC2 programmatic was 1-2 us slower, RESULTS.md session 33)
    (4, ("moe_fc1", "moe_fc2")), (16, ("moe_fc1", "moe_fc2")), (32, ("moe_fc1", "moe_fc2")),
    (40, moe_cuda.PDL_KERNELS)])
def test_default_dependent_launches_per_build(tokens: int, programmatic: tuple[str, ...]) -> None:
    """The shipped PDL choice at m3.1-small's layout: the kernels a call of T tokens launches programmatically."""
    build = moe_cuda.call_build(tokens, 6144, 1536, 64, 8, 1536)
    assert build[2] == (tokens == 1)  # one token folds there, more do not
    specs = moe_cuda.mma_specs(6144, 1536, 1536, "bf16", *build)
    assert tuple(sp.kernel for sp in specs if sp.pdl) == programmatic


def _case(t: int, hidden: int, inter: int, experts: int, top_k: int, shared: str, act: torch.dtype,
          x_scale: float = 1.0):
    from m3c.backends.kernels.moe_routing import moe_route
    from m3c.fused.moe import MegaMoE, random_moe

    gen = torch.Generator(device="cuda").manual_seed(int(torch.randint(0, 2**31, ())))
    moe = random_moe(hidden, inter, experts, top_k, shared, gen, device="cuda")
    mm = MegaMoE.from_reference(moe)
    x = (torch.randn(t, hidden, generator=gen, device="cuda") * x_scale).to(act)
    ids, w = moe_route(x, moe.gate.weight, moe.e_score_correction_bias, top_k=top_k,
                       routed_scaling_factor=moe.cfg.routed_scaling_factor, norm_topk_prob=moe.cfg.norm_topk_prob)
    return moe, mm, x, ids, w


def nvfp4(*shape: int, device: str = "meta", offset: int = 0) -> quant.NVFP4Tensor:
    """An uninitialized NVFP4 weight of logical shape [E, N, K] (meta tensors stand in for the GPU: no data); its
    codes start `offset` bytes into their storage."""
    n = math.prod(shape) // 2
    data = torch.empty(n + offset, dtype=torch.uint8, device=device)[offset:].view(*shape[:-1], shape[-1] // 2)
    return quant.NVFP4Tensor(data, torch.empty(*shape[:-1], shape[-1] // 16, dtype=torch.float8_e4m3fn,
                                               device=device), torch.empty(shape[0], shape[1], 1, device=device))


def mxfp8(*shape: int) -> quant.MXFP8Tensor:
    """An uninitialized MXFP8 meta weight of logical shape [N, K]."""
    return quant.MXFP8Tensor(torch.empty(*shape, dtype=torch.float8_e4m3fn, device="meta"),
                             torch.empty(*shape[:-1], shape[-1] // 32, dtype=torch.uint8, device="meta"))


def test_wide_build_compiles_without_spills() -> None:
    """Above NT1_MAX_TOKENS tokens: the NT = 2 looping build (TMAX = 64, column groups of 16) is its own set of
    binaries, FC1 at the compiler's register choice (FC1_MIN_CTAS["wide"] = 0), and neither GEMV kernel spills."""
    narrow = moe_cuda.mma_specs(6144, 1536, 1536, "bf16", 2)
    wide = moe_cuda.mma_specs(6144, 1536, 1536, "bf16", 2, wide=True)
    assert all(dict(sp.defines).get("TMAX") == 64 for sp in wide) and "TMAX" not in dict(narrow[1].defines)
    assert "FC1_MIN_CTAS" not in dict(wide[1].defines) and ("FC1_MIN_CTAS", 4) in narrow[1].defines
    assert not {sp.key() for sp in wide} & {sp.key() for sp in narrow}
    assert [sp.shared_bytes for sp in wide] == [sp.shared_bytes for sp in narrow]  # 16 columns staged at a time
    for spec in (wide[1], wide[3]):
        sass = kernel_sass(spec)
        assert "HMMA.16816.F32" in sass and "STL" not in sass, spec.kernel


def test_nt1_looping_build_takes_9_to_nt1_max_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    """9..NT1_MAX_TOKENS tokens: the NT = 1 build whose CTAs loop over column groups of 8 (TMAX = NT1_MAX_TOKENS),
    its own binaries, staging what the 8-token build stages, FC1 without spills and FC2 with at most 4 spilled
    words; more tokens take the NT = 2 looping build, and a setting outside 8..64 is refused by name."""
    plain = moe_cuda.mma_specs(6144, 1536, 1536, "bf16", 1)
    loop = moe_cuda.mma_specs(6144, 1536, 1536, "bf16", *moe_cuda.decode_build(9))
    assert moe_cuda.decode_build(9) == (1, True) == moe_cuda.decode_build(moe_cuda.NT1_MAX_TOKENS)
    assert moe_cuda.decode_build(moe_cuda.NT1_MAX_TOKENS + 1) == (2, True) and moe_cuda.decode_build(8) == (1, False)
    assert all(dict(sp.defines)["TMAX"] == moe_cuda.NT1_MAX_TOKENS and dict(sp.defines)["NT"] == 1 for sp in loop)
    assert not {sp.key() for sp in loop} & {sp.key() for sp in plain}
    assert [sp.shared_bytes for sp in loop] == [sp.shared_bytes for sp in plain]
    for spec, spills in ((loop[1], 0), (loop[3], 4)):
        sass = kernel_sass(spec)
        assert "HMMA.16816.F32" in sass and sass.count("STL") <= spills, spec.kernel
    monkeypatch.setattr(moe_cuda, "NT1_MAX_TOKENS", 16)
    assert moe_cuda.decode_build(17) == (2, True) and moe_cuda._first_tokens(moe_cuda.decode_build, 64) == (1, 9, 17)
    monkeypatch.setattr(moe_cuda, "NT1_MAX_TOKENS", 4)
    with pytest.raises(ConfigError, match="NT1_MAX_TOKENS = 4"):
        moe_cuda.mma_specs(6144, 1536, 1536, "bf16", 1, wide=True)


def test_load_probe_build_streams_the_weights_without_math(monkeypatch: pytest.MonkeyPatch) -> None:
    """DECODE = 2 (bench_moe_mma.py's probe of the weight stream alone): FC1 / FC2 keep their 16-byte weight loads but
    neither decode nor MMA, so the probe's time is the loads', staging's and grids' (and its binaries are their own)."""
    real = moe_cuda.mma_specs(6144, 1536, 1536, "bf16", 1)
    monkeypatch.setattr(moe_cuda, "DECODE", 2)
    probe = moe_cuda.mma_specs(6144, 1536, 1536, "bf16", 1)
    assert ("DECODE", 2) in probe[1].defines and probe[1].key() != real[1].key()
    for spec in (probe[1], probe[3]):
        sass = kernel_sass(spec)
        assert sass.count("LDG.E.NA.128") >= 16, spec.kernel  # two tiles x 4 pieces x 2 buffers, at least
        assert "HMMA" not in sass and "HMUL2" not in sass, spec.kernel


def test_natural_launches_read_the_weights_in_place(monkeypatch: pytest.MonkeyPatch) -> None:
    """NATURAL: FC1 / FC2 get the routed experts' own codes and scales (no prepacked copy made), the shared expert
    stays prepacked; misaligned or mis-shaped routed weights and DECODE = 1 are refused before any launch (meta and
    CPU tensors stand in for the GPU)."""
    h, inter, e, k, s, t = 512, 256, 8, 2, 256, 3
    monkeypatch.setattr(moe_cuda, "NATURAL", True)

    w13, w2, s13, s2 = nvfp4(e, 2 * inter, h), nvfp4(e, h, inter), mxfp8(2 * s, h), mxfp8(h, s)
    x = torch.empty(t, h, dtype=torch.bfloat16, device="meta")
    ids = torch.zeros(t, k, dtype=torch.int64, device="meta")
    wts = torch.empty(t, k, device="meta")
    seen: list = []
    moe_cuda.moe_decode_mma(x, ids, wts, w13, w2, s13, s2, runner=lambda sp, grid, args: seen.append((sp, args)))
    fc = {sp.kernel: dict(zip((n for n, _ in sp.arg_types), args)) for sp, args in seen}
    assert ("NATURAL", 1) in next(sp for sp, _ in seen if sp.kernel == "moe_fc1").defines
    assert fc["moe_fc1"]["rcode"].shape == w13.data.shape and fc["moe_fc1"]["rscale"].shape == w13.scale.shape
    assert fc["moe_fc2"]["rcode"].shape == w2.data.shape and fc["moe_fc2"]["rscale"].shape == w2.scale.shape
    assert fc["moe_fc1"]["scode"].dim() == 1  # the shared expert's prepacked codes
    assert not getattr(w13.data, "_m3c_derived", {}) and not getattr(w2.data, "_m3c_derived", {})
    cpu = dict(device="cpu")
    xc, idc, wc = torch.zeros(t, h, dtype=torch.bfloat16), torch.zeros(t, k, dtype=torch.int64), torch.zeros(t, k)
    with pytest.raises(ShapeError, match="16-byte aligned"):
        moe_cuda.moe_decode_mma(xc, idc, wc, nvfp4(e, 2 * inter, h, offset=1, **cpu), nvfp4(e, h, inter, **cpu),
                                None, None, runner=lambda *a: None)
    with pytest.raises(ShapeError, match="w2"):
        moe_cuda.moe_decode_mma(xc, idc, wc, nvfp4(e, 2 * inter, h, **cpu), nvfp4(e, h, 2 * inter, **cpu),
                                None, None, runner=lambda *a: None)
    monkeypatch.setattr(moe_cuda, "DECODE", 1)
    with pytest.raises(ConfigError, match="DECODE"):
        moe_cuda.moe_decode_mma(xc, idc, wc, nvfp4(e, 2 * inter, h, **cpu), nvfp4(e, h, inter, **cpu), None, None,
                                runner=lambda *a: None)


def test_fc1_splits_moe_act_cannot_sum_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """moe_act (or, folded, FC1's act tail) sums FC1's K splits by templates for 1, 2, 3, 4, 6 and 8 splits (another
    count would read other splits' rows as its own): a split table giving 5 / 10 is refused before any launch, the
    default one launches (this small layout folds: no act launch); so is one splitting the shared expert less than the routed
    ones."""
    from m3c.errors import ConfigError

    h, inter, e, k, t = 768, 256, 8, 2, 3
    w13, w2, s13, s2 = nvfp4(e, 2 * inter, h, device="cpu"), nvfp4(e, h, inter, device="cpu"), None, None
    x, ids, wts = torch.zeros(t, h, dtype=torch.bfloat16), torch.zeros(t, k, dtype=torch.int64), torch.zeros(t, k)
    monkeypatch.setattr(moe_cuda, "NATURAL", True)  # no prepacked copy of the (uninitialized) weights
    seen: list = []
    moe_cuda.moe_decode_mma(x, ids, wts, w13, w2, s13, s2, runner=lambda sp, grid, args: seen.append(sp.kernel))
    assert seen == ["moe_stage_x", "moe_fc1", "moe_fc2"]
    monkeypatch.setattr(moe_cuda, "_splits", lambda *_: (5, 10, 2))
    seen.clear()
    with pytest.raises(ConfigError, match="1, 2, 3, 4, 6 or 8"):
        moe_cuda.moe_decode_mma(x, ids, wts, w13, w2, s13, s2, runner=lambda sp, grid, args: seen.append(sp.kernel))
    assert not seen
    # FC1's shared memory holds the routed split's K range: a shared expert split into fewer pieces would overflow it
    monkeypatch.setattr(moe_cuda, "_splits", lambda *_: (2, 1, 2))
    with pytest.raises(ConfigError, match="at least the routed"):
        moe_cuda.moe_decode_mma(x, ids, wts, w13, w2, s13, s2, runner=lambda sp, grid, args: seen.append(sp.kernel))
    assert not seen


@pytest.mark.parametrize("tokens", [1, 9, 33])
def test_early_weight_loads_come_before_the_staging_in_sass(tokens: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """EARLY_LOAD: in the builds the set names, FC1 and FC2 issue weight loads (128-bit, no L1 allocation) before
    their first token-staging load (128-bit, plain), elsewhere not; launched programmatically, FC2 still reads
    nothing of act (no staging load) and writes nothing before it waits (SASS ACQBULK); each build its own key, no
    spill the other lacks."""
    nt, wide = moe_cuda.decode_build(tokens)
    monkeypatch.setattr(moe_cuda, "PDL", {nt: moe_cuda.PDL_KERNELS})
    seen = {}
    for early in (False, True):
        monkeypatch.setattr(moe_cuda, "EARLY_LOAD", frozenset({(nt, wide)} if early else {(nt, not wide)}))
        specs = moe_cuda.mma_specs(6144, 1536, 2048, "bf16", nt, wide)
        for spec in (specs[1], specs[3]):
            assert (dict(spec.defines).get("EARLY") == 1) == early
            ops = kernel_opcodes(spec)
            first_weight = ops.index("LDG.E.NA.128.CONSTANT")
            first_staging = ops.index("LDG.E.128")
            assert (first_weight < first_staging) == early, (spec.kernel, early)
            if spec.kernel == "moe_fc2":
                wait = ops.index("ACQBULK")
                assert wait < first_staging and not any(op.startswith("STG") for op in ops[:wait])
            seen[spec.kernel, early] = (ops.count("STL"), spec.key())
    for kernel in ("moe_fc1", "moe_fc2"):
        assert seen[kernel, True][0] <= seen[kernel, False][0] and seen[kernel, True][1] != seen[kernel, False][1]


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 13, 40])
@pytest.mark.parametrize("pdl", [False, True])
def test_early_weight_loads_change_nothing_but_time(t: int, pdl: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """EARLY_LOAD moves only independent loads: MegaMoE's decode is bitwise the default build's output, with plain
    and programmatic launches, eagerly and replayed from a CUDA graph with new tokens copied in."""
    monkeypatch.setattr(moe_cuda, "PDL", {1: moe_cuda.PDL_KERNELS, 2: moe_cuda.PDL_KERNELS} if pdl else {})
    _bitwise_the_default(t, lambda on: monkeypatch.setattr(
        moe_cuda, "EARLY_LOAD", frozenset({(1, False), (1, True), (2, True)} if on else ())))


def _bitwise_the_default(t: int, knob) -> None:
    """knob(True) changes only where or when the decode loads: MegaMoE's output is bitwise knob(False)'s (which is
    near the reference), eagerly and replayed from a CUDA graph (captured with the knob on) with new tokens."""
    moe, mm, x, _, _ = _case(t, 6144, 1536, 64, 8, "mxfp8", torch.bfloat16)
    knob(False)
    default = mm(x)
    assert float((default.float() - moe(x.float())).norm() / moe(x.float()).norm()) < 1.5e-2
    knob(True)
    assert torch.equal(mm(x), default)
    static = x.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = mm(static)
    new = (torch.randn(x.shape, device="cuda") * 3).to(x.dtype)
    static.copy_(new)
    out.fill_(float("nan"))
    graph.replay()
    knob(False)
    assert torch.equal(out, mm(new))


FOLDS = [("FOLD_ACT",), ("FOLD_COMBINE",), ("FOLD_ACT", "FOLD_COMBINE"), ("FOLD_ACT", "FOLD_COMBINE", "ACQUIRE_LAST")]


def _fold(monkeypatch: pytest.MonkeyPatch, knobs: tuple[str, ...], on: bool) -> None:
    """The folds named in `knobs` on at every T (not only where the grids fit one wave), or no fold at all; the K
    splits the same either way (every grid counts as one wave: BALANCE_SHARED's 6 shared FC1 splits wherever the
    layout takes them, as the default at T = 1)."""
    monkeypatch.setattr(moe_cuda, "SMS", 1 << 30)
    for knob in ("FOLD_ACT", "FOLD_COMBINE", "ACQUIRE_LAST"):
        monkeypatch.setattr(moe_cuda, knob, on and knob in knobs)


@pytest.mark.parametrize("tokens", [1, 9, 33])
def test_folded_builds_in_sass(tokens: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The folded builds: no act / combine kernel; FC1 and FC2 count arrivals with a global atomic, FC2 finds the act
    rows' scales with shared-memory atomics, neither spills more than a word beyond the unfolded build (kept across
    the GEMV: a store before it, a load after; FC1 of the NT = 1 looping build, which folds only for small layouts,
    4 words outside the GEMV), and launched programmatically FC1 releases FC2 (PREEXIT) only after waiting
    for the routing (ACQBULK): FC2 reads the routing before its own wait."""
    nt, wide = moe_cuda.decode_build(tokens)
    monkeypatch.setattr(moe_cuda, "PDL", {nt: moe_cuda.PDL_KERNELS})
    specs = {sp.kernel: sp for sp in moe_cuda.mma_specs(6144, 1536, 2048, "bf16", nt, wide, fold=True)}
    plain = {sp.kernel: sp for sp in moe_cuda.mma_specs(6144, 1536, 2048, "bf16", nt, wide)}
    assert list(specs) == ["moe_stage_x", "moe_fc1", "moe_fc2"]
    for kernel in ("moe_fc1", "moe_fc2"):
        ops = kernel_opcodes(specs[kernel])
        assert any(op.startswith("ATOMG.E.ADD") for op in ops), kernel
        spills = (sum(op.startswith("STL") for op in ops)
                  - sum(op.startswith("STL") for op in kernel_opcodes(plain[kernel])))
        assert spills <= (4 if (kernel, nt, wide) == ("moe_fc1", 1, True) else 1), (kernel, spills)
        if kernel == "moe_fc1":
            assert ops.index("ACQBULK") < ops.index("PREEXIT")
        else:
            assert any(op.startswith("ATOMS.") for op in ops)


@pytest.mark.parametrize("acquire_last", [False, True])
def test_fold_arrivals_invalidate_l1_as_chosen_in_sass(acquire_last: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each fold arrival (FC1's act chunks, FC2's row blocks: a global atomic add) is an acq_rel atomic, whose
    acquire invalidates the SM's L1 (CCTL.IVALL) right after it; with ACQUIRE_LAST a release atomic, the
    invalidation only in the last CTA's branch (after the compare and branch on the atomic's old value)."""
    monkeypatch.setattr(moe_cuda, "ACQUIRE_LAST", acquire_last)
    specs = {sp.kernel: sp for sp in moe_cuda.mma_specs(6144, 1536, 1536, "bf16", 1, False, fold=True)}
    for kernel in ("moe_fc1", "moe_fc2"):
        ops = kernel_opcodes(specs[kernel])
        arrivals = [i for i, op in enumerate(ops) if op.startswith("ATOMG.E.ADD")]
        assert arrivals and ops.count("CCTL.IVALL") == len(arrivals), (kernel, len(arrivals))
        for i in arrivals:
            after = ops[i + 1:ops.index("CCTL.IVALL", i)]
            assert any(op == "BRA" for op in after) == acquire_last, (kernel, after)


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 5, 13, 40, 64])
@pytest.mark.parametrize("pdl", [False, True])
@pytest.mark.parametrize("knobs", FOLDS)
def test_folded_launches_are_bitwise_the_launches(t: int, pdl: bool, knobs: tuple[str, ...],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """FOLD_ACT computes the act launch's values and scales in FC1's last CTAs and FC2's staging, FOLD_COMBINE the
    combine launch's sums in FC2's last CTAs: MegaMoE's decode is bitwise the launches' output, plain and
    programmatic, eagerly and from a CUDA graph replay."""
    monkeypatch.setattr(moe_cuda, "PDL", {1: moe_cuda.PDL_KERNELS, 2: moe_cuda.PDL_KERNELS} if pdl else {})
    _bitwise_the_default(t, lambda on: _fold(monkeypatch, knobs, on))


@pytest.mark.gpu
@pytest.mark.parametrize("t, hot, shared, dtype", [(1, 0, "mxfp8", torch.float32), (3, 3, "none", torch.bfloat16),
                                                   (13, 9, "mxfp8", torch.float32), (40, 33, "none", torch.bfloat16),
                                                   (64, 64, "mxfp8", torch.bfloat16)])
@pytest.mark.parametrize("knobs", FOLDS)
def test_folded_launches_call_after_call(t: int, hot: int, shared: str, dtype: torch.dtype, knobs: tuple[str, ...],
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The folds' counters are left at zero by every launch: call after call (new tokens each time, hot experts, no
    shared expert, float32 tokens scaled past f16's range), eagerly and replayed, the output is bitwise the
    launches'."""
    from m3c.fused.moe import hot_routing

    moe, mm, x, _, _ = _case(t, 6144, 1536, 64, 8, shared, dtype)
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    ids, w = hot_routing(t, 64, 8, hot, gen, "cuda")
    moe.route = lambda _x: (ids, w)
    w13, w2, s13, s2 = mm.weights()

    def run(tokens: torch.Tensor, fold: bool) -> torch.Tensor:
        _fold(monkeypatch, knobs, fold)
        out = torch.full_like(tokens, float("nan"))
        return moe_cuda.moe_decode_mma(tokens, ids, w, w13, w2, s13, s2, out=out)

    scales = (1.0, 3e5 if dtype == torch.float32 else 40.0, 1e-3)
    for scale in scales:
        new = (torch.randn(x.shape, device="cuda") * scale).to(dtype)
        want = run(new, False)
        truth = moe(new.float())
        assert float((want.float() - truth).norm() / truth.norm()) < 1.5e-2, scale
        assert torch.equal(run(new, True), want), scale
    static = x.clone()
    run(static, True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run(static, True)
    for scale in scales:
        new = (torch.randn(x.shape, device="cuda") * scale).to(dtype)
        static.copy_(new)
        out.fill_(float("nan"))
        graph.replay()
        assert torch.equal(out, run(new, False)), scale


@pytest.mark.parametrize("tokens", [1, 9, 33])
def test_epilogue_loads_come_before_its_stores_in_sass(tokens: int) -> None:
    """FC1 and FC2's epilogue loads every row factor, token multiplier and routing weight before its first store:
    no global load sits inside a run of epilogue stores (an LDG before each STG cost the decode 2-4%, session 30)."""
    nt, wide = moe_cuda.decode_build(tokens)
    specs = moe_cuda.mma_specs(6144, 1536, 2048, "bf16", nt, wide)
    for spec in (specs[1], specs[3]):
        ops = [op.split(".")[0] for op in kernel_opcodes(spec)]  # (predicated too)
        stores = [k for k, op in enumerate(ops) if op == "STG"]
        assert len(stores) >= 8, spec.kernel
        # loads between consecutive stores less than 40 instructions apart (one run of epilogue stores)
        between = sum(op == "LDG" for a, b in itertools.pairwise(stores) if b - a < 40 for op in ops[a:b])
        assert between == 0, (spec.kernel, between)


@pytest.mark.gpu
@pytest.mark.parametrize("decode", [0, 1])
@pytest.mark.parametrize("t", [1, 3, 8, 13, 16, 17, 32, 33, 40, 64])
@pytest.mark.parametrize("shared", ["mxfp8", "none"])
def test_moe_decode_mma_matches_reference(t: int, shared: str, decode: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(moe_cuda, "DECODE", decode)
    err = _decode_error(t, 8, shared)
    assert err < 1.5e-2, err


def _decode_error(t: int, top_k: int, shared: str) -> float:
    """moe_decode_mma's relative error against the reference for T random tokens of a random MoE (H = 6144,
    I = 1536, 64 experts, top-k), its output poisoned first (NaN where unwritten)."""
    moe, mm, x, ids, w = _case(t, 6144, 1536, 64, top_k, shared, torch.bfloat16)
    w13, w2, s13, s2 = mm.weights()
    out = torch.full_like(x, float("nan"))
    moe_cuda.moe_decode_mma(x, ids, w.float(), w13, w2, s13, s2, out=out)
    truth = moe(x.float())
    assert torch.isfinite(out).all()
    return float((out.float() - truth).norm() / truth.norm())


def _sid_cap() -> int:
    """find_block's SID_CAP (moe_decode_items.cuh): the routing ids a CTA keeps in shared memory for find_tokens."""
    text = (Path(moe_cuda.__file__).parent / "cuda" / "moe_decode_items.cuh").read_text()
    return int(re.search(r"#define SID_CAP (\d+)", text)[1])


@pytest.mark.gpu
@pytest.mark.parametrize("over", [0, 128])
def test_routing_ids_on_both_sides_of_the_shared_copy_match_reference(over: int) -> None:
    """Up to SID_CAP routing ids (T x top-k) find_block keeps in shared memory and find_tokens reads them there;
    past it find_tokens reads them from global memory again: top-16 at the cap (32 tokens: the NT = 1 looping
    build) and 128 ids past it (40 tokens: NT = 2), each against the reference."""
    err = _decode_error((_sid_cap() + over) // 16, 16, "mxfp8")
    assert err < 1.5e-2, err


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 5, 16])
def test_natural_layout_matches_prepacked_without_a_copy(t: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """NATURAL reads the routed experts in place (no prepacked copy is built for them) and agrees with the
    prepacked stream to float32 rounding (the same products, summed in another order) and with the reference."""
    moe, mm, x, ids, w = _case(t, 6144, 1536, 64, 8, "mxfp8", torch.bfloat16)
    w13, w2, s13, s2 = mm.weights()
    monkeypatch.setattr(moe_cuda, "NATURAL", True)
    out = torch.full_like(x, float("nan"))
    moe_cuda.moe_decode_mma(x, ids, w.float(), w13, w2, s13, s2, out=out)
    assert not getattr(w13.data, "_m3c_derived", {}) and not getattr(w2.data, "_m3c_derived", {})
    monkeypatch.setattr(moe_cuda, "NATURAL", False)
    packed = moe_cuda.moe_decode_mma(x, ids, w.float(), w13, w2, s13, s2)
    truth = moe(x.float())
    assert torch.isfinite(out).all()
    assert float((out.float() - packed.float()).norm() / packed.float().norm()) < 4e-3  # bf16 outputs
    assert float((out.float() - truth).norm() / truth.norm()) < 1.5e-2


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 6, 13, 40])
@pytest.mark.parametrize("shared", ["mxfp8", "none"])
def test_dependent_launches_match_plain_launches_and_graph_replays(t: int, shared: str,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """MegaMoE's decode (routing launch + experts) with programmatic dependent launches is bitwise the output of
    plain launches: eagerly, and replayed from a CUDA graph with new tokens copied in (a kernel that read its
    predecessor's outputs before grid_wait() would differ)."""
    moe, mm, x, _, _ = _case(t, 6144, 1536, 64, 8, shared, torch.bfloat16)
    on = {1: moe_cuda.PDL_KERNELS, 2: moe_cuda.PDL_KERNELS}
    monkeypatch.setattr(moe_cuda, "PDL", {})
    plain = mm(x)
    truth = moe(x.float())
    assert float((plain.float() - truth).norm() / truth.norm()) < 1.5e-2
    monkeypatch.setattr(moe_cuda, "PDL", on)
    assert torch.equal(mm(x), plain)
    static = x.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = mm(static)
    for scale in (1.0, 40.0):
        new = (torch.randn(x.shape, device="cuda") * scale).to(x.dtype)
        static.copy_(new)
        out.fill_(float("nan"))
        graph.replay()
        monkeypatch.setattr(moe_cuda, "PDL", {})
        assert torch.equal(out, mm(new)), scale
        monkeypatch.setattr(moe_cuda, "PDL", on)


@pytest.mark.gpu
@pytest.mark.parametrize("t, hot", [(16, 16), (12, 9), (16, 8), (5, 5), (64, 64), (40, 33), (24, 17), (64, 16)])
def test_hot_expert_columns(t: int, hot: int) -> None:
    """Each CTA runs only the tokens that picked its expert, as compacted MMA columns (one 8-column tile; above 8
    tokens column groups one after another: of 8 up to NT1_MAX_TOKENS tokens, of 16 above): an expert picked by
    `hot` tokens (the first `hot` of them, slot 0), the other slots distinct random experts, must match the reference
    routed the same way, token by token (a token dropped from an expert's columns, or mapped back to another token's row, would be
    far off)."""
    moe, mm, x, _, _ = _case(t, 6144, 1536, 64, 8, "mxfp8", torch.bfloat16)
    from m3c.fused.moe import hot_routing

    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    ids, w = hot_routing(t, 64, 8, hot, gen, "cuda")  # expert 0: `hot` tokens, the others 1..63
    moe.route = lambda _x: (ids, w)
    w13, w2, s13, s2 = mm.weights()
    out = torch.full_like(x, float("nan"))
    moe_cuda.moe_decode_mma(x, ids, w, w13, w2, s13, s2, out=out)
    truth = moe(x.float())
    assert torch.isfinite(out).all()
    err = float((out.float() - truth).norm() / truth.norm())
    assert err < 1.5e-2, err
    per_token = (out.float() - truth).norm(dim=1) / truth.norm(dim=1)
    assert float(per_token.max()) < 3e-2, per_token


@pytest.mark.gpu
def test_moe_decode_mma_float32_tokens_and_large_activations() -> None:
    # tokens past f16's range (and FC1 outputs far past it): the per-row power-of-two staging must keep them
    moe, mm, x, ids, w = _case(4, 1024, 256, 16, 4, "mxfp8", torch.float32, x_scale=3e5)
    w13, w2, s13, s2 = mm.weights()
    out = moe_cuda.moe_decode_mma(x, ids, w.float(), w13, w2, s13, s2)
    truth = moe(x)
    err = float((out - truth).norm() / truth.norm())
    assert err < 5e-3, err


def test_megamoe_lowering_lists_and_compiles_the_cuda_kernels() -> None:
    from m3c.backends.cuda_aot import CudaKernelSpec
    from m3c.backends.kernels.megamoe import megamoe_specs
    from m3c.backends.triton_aot import compile_kernels

    specs = megamoe_specs(6144, 1536, 64, 8, 1536, "bf16", "nvfp4", "mxfp8")
    cuda = [s for s in specs if isinstance(s, CudaKernelSpec)]
    names = ["moe_stage_x", "moe_fc1", "moe_act", "moe_fc2", "moe_combine", "moe_route_stage"]
    # the decode builds: 1 token (its grids fit one wave: folded, no act / combine launch), 2..8, 9..NT1_MAX_TOKENS
    # and more tokens; the routing launch's for 8, 16 and 64; the wgmma prefill
    assert [moe_cuda.decode_folds(t, 6144, 1536, 64, 8, 1536) for t in (1, 2, 8)] == [True, False, False]
    folded = ["moe_stage_x", "moe_fc1", "moe_fc2"]
    assert [s.kernel for s in cuda] == folded + names[:5] * 3 + names[5:] * 3 + ["moe_pf_fc1", "moe_pf_fc2"]
    assert len({s.key() for s in cuda}) == 23
    builds = [(dict(s.defines)["NT"], dict(s.defines).get("TMAX"), dict(s.defines).get("FOLD_ACT"),
               dict(s.defines).get("FOLD_COMBINE")) for s in cuda[:18]]
    assert builds == [(1, None, 1, 1)] * 3 + [(1, None, None, None)] * 5 + \
        [(1, moe_cuda.NT1_MAX_TOKENS, None, None)] * 5 + [(2, 64, None, None)] * 5
    assert [dict(s.defines)["NT"] for s in cuda[18:21]] == [1, 2, 8]
    got = compile_kernels(cuda[:2])
    assert [k.key for k in got] == [s.key() for s in cuda[:2]] and got[1].shared_bytes == cuda[1].shared_bytes
    assert got[1].arg_types[:4] == ["*u8", "*u8", "*u8", "i32"]  # fc1: x, x16, xmult, T
    # a layout the CUDA kernels do not take (I not a multiple of 256) lowers to the Triton kernels only
    tiny = megamoe_specs(256, 128, 8, 2, 128, "bf16", "nvfp4", "mxfp8")
    assert tiny and not any(isinstance(s, CudaKernelSpec) for s in tiny)


@pytest.mark.parametrize("cuda_route", [True, False])
def test_cuda_dispatch_launches_only_listed_specs(cuda_route: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """T <= 64 on a CUDA device goes to the CUDA kernels (routing + staging in one CUDA launch with ``CUDA_ROUTE``,
    else the GEMV + fused_route + moe_stage_x); every launch is a spec the offline lowering compiled (meta tensors
    stand in for the GPU: no data, no sync), with the grids the kernels expect."""
    from m3c.backends.kernels import megamoe as mm_mod
    from m3c.backends.kernels import moe_routing
    from m3c.backends.kernels.megamoe import megamoe, megamoe_specs

    monkeypatch.setattr(moe_routing, "interpreting", lambda: False)  # the GPU's routing spec, as the lowering lists

    h, inter, e, k, s = 6144, 1536, 64, 8, 1536
    listed = {sp.key() for sp in megamoe_specs(h, inter, e, k, s, "bf16", "nvfp4", "mxfp8")}
    monkeypatch.setattr(mm_mod, "_mma_ok", lambda x, w13, sw13, top_k: x.shape[0] <= moe_cuda.MAX_TOKENS)
    monkeypatch.setattr(mm_mod, "CUDA_ROUTE", cuda_route)

    w13, w2 = nvfp4(e, 2 * inter, h), nvfp4(e, h, inter)
    s13, s2 = mxfp8(2 * s, h), mxfp8(h, s)
    for t in (1, 8, 9, 16, 17, 32, 33, 40, 64):
        seen: list = []
        x = torch.empty(t, h, dtype=torch.bfloat16, device="meta")
        megamoe(x, torch.empty(e, h, device="meta"), torch.empty(e, device="meta"), w13, w2, s13, s2, top_k=k,
                routed_scaling_factor=2.5, norm_topk_prob=True,
                runner=lambda sp, grid, args, seen=seen: seen.append((sp, grid, args)))
        kernels = [sp.kernel for sp, _, _ in seen if getattr(sp, "kernel", None)]
        routed_here = cuda_route  # else GEMV + fused_route + moe_stage_x
        folds = t == 1  # the grids of one token fit one wave: no act / combine launch (decode_folds)
        assert kernels == ["moe_route_stage" if routed_here else "moe_stage_x", "moe_fc1",
                           *(() if folds else ("moe_act",)), "moe_fc2", *(() if folds else ("moe_combine",))], \
            (t, kernels)
        launches = 3 if folds else 5
        assert len(seen) == (launches if routed_here else launches + 1), t  # the old path: fused_route (Triton) too
        assert all(sp.key() in listed for sp, _, _ in seen), t
        defines = dict(next(sp for sp, _, _ in seen if getattr(sp, "kernel", "") == "moe_fc1").defines)
        nt = defines["NT"]
        loop_tmax = moe_cuda.NT1_MAX_TOKENS if t <= moe_cuda.NT1_MAX_TOKENS else 64
        assert nt == (1 if t <= moe_cuda.NT1_MAX_TOKENS else 2), t
        assert defines.get("TMAX") == (loop_tmax if t > 8 else None), t
        for sp, _grid, args in seen:
            if getattr(sp, "kernel", None):
                assert len(args) == len(sp.arg_types), sp.kernel
        fc1_grid = next(g for sp, g, _ in seen if getattr(sp, "kernel", "") == "moe_fc1")
        fc2_grid = next(g for sp, g, _ in seen if getattr(sp, "kernel", "") == "moe_fc2")
        ks1, groups = 2 * nt, -(-t // (8 * nt))  # the shared expert: a CTA per column group of 8 NT
        wider = 3 if t == 1 else 2  # one token: the shared rows split 3x the routed ones, FC1 one full wave (528)
        assert moe_cuda.call_splits(t, h, inter, e, k, s) == (ks1, wider * ks1, 2), t
        assert fc1_grid[0] == min(e, t * k) * (2 * inter // 128) * ks1 + (2 * s // 128) * wider * ks1 * groups
        assert fc2_grid[0] == min(e, t * k) * (h // 128) + (h // 128) * 2 * groups
        if routed_here:
            grid0 = next(g for sp, g, _ in seen if getattr(sp, "kernel", "") == "moe_route_stage")
            assert grid0 == (t + (e // 8) * moe_cuda.route_split(h, e)[1],)


@pytest.mark.parametrize("named_width", [3072, 8192])
def test_no_shared_expert_launches_only_listed_specs(named_width: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """A model without a shared expert whose config still names a shared width (wider than the routed one; 8192:
    wider than the decode kernels take): the decode launches with S = 0, and the lowering lists those builds (their
    shared memory and whether they run at all follow S), not the width's."""
    from m3c.backends.kernels import megamoe as mm_mod
    from m3c.backends.kernels import moe_routing
    from m3c.backends.kernels.megamoe import megamoe, megamoe_specs

    monkeypatch.setattr(moe_routing, "interpreting", lambda: False)
    monkeypatch.setattr(mm_mod, "_mma_ok", lambda x, w13, sw13, top_k: x.shape[0] <= moe_cuda.MAX_TOKENS)
    h, inter, e, k = 6144, 1536, 64, 8
    listed = {sp.key() for sp in megamoe_specs(h, inter, e, k, named_width, "bf16", "nvfp4", "none")}
    w13, w2 = nvfp4(e, 2 * inter, h), nvfp4(e, h, inter)
    for t in (1, 8, 16, 40):
        seen: list = []
        x = torch.empty(t, h, dtype=torch.bfloat16, device="meta")
        megamoe(x, torch.empty(e, h, device="meta"), torch.empty(e, device="meta"), w13, w2, None, None, top_k=k,
                routed_scaling_factor=2.5, norm_topk_prob=True, runner=lambda sp, grid, args, seen=seen: seen.append(sp))
        fc = [sp for sp in seen if getattr(sp, "kernel", "") in ("moe_fc1", "moe_fc2")]
        assert len(fc) == 2 and all(sp.key() in listed for sp in seen), t


@pytest.mark.gpu
@pytest.mark.parametrize("t", [3, 20, 40])
@pytest.mark.parametrize("knobs", [(), *FOLDS])
def test_out_of_range_expert_id_gives_nan_not_garbage(t: int, knobs: tuple[str, ...],
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A routed id outside [0, E) (what NaN router logits select) has no CTA writing its rows: that token is NaN,
    the others are unaffected (with the folds too: the slot left unused still arrives at FC2's counters)."""
    _fold(monkeypatch, knobs, True)
    _, mm, x, ids, w = _case(t, 6144, 1536, 64, 8, "mxfp8", torch.bfloat16)
    w13, w2, s13, s2 = mm.weights()
    good = moe_cuda.moe_decode_mma(x, ids, w.float(), w13, w2, s13, s2)
    bad_ids = ids.clone()
    bad_ids[1, 3] = 64
    out = moe_cuda.moe_decode_mma(x, bad_ids, w.float(), w13, w2, s13, s2)
    assert torch.isnan(out[1]).all()
    keep = torch.arange(t, device=out.device) != 1
    assert torch.equal(out[keep], good[keep])


@pytest.mark.gpu
def test_capture_without_warm_up_is_refused() -> None:
    _, mm, x, ids, w = _case(1, 6144, 1536, 64, 8, "none", torch.bfloat16)
    w13, w2, _, _ = mm.weights()
    w13 = quant.NVFP4Tensor(w13.data.clone(), w13.scale.clone(), w13.global_scale)  # nothing prepacked yet
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(moe_cuda.CaptureError, match="warm-up"), torch.cuda.graph(graph):
        moe_cuda.moe_decode_mma(x, ids, w.float(), w13, w2, None, None)
