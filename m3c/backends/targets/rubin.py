"""Rubin (sm_107a): NVFP4 -> FP16 directly, FP16 score MMA, block scale applied with packed f32x2.f16x2 FMA."""

from m3c.backends.target import KB, Target, register_target
from m3c.backends.targets._stages import NVIDIA_STAGES

RUBIN = register_target(Target(
    name="rubin",
    arch="sm_107a",
    vendor="nvidia",
    products=("Rubin",),
    compute_units=212,
    smem_per_block=327 * KB,
    smem_per_sm=328 * KB,
    warp_size=32,
    mma=("tcgen05.mma.kind::f16", "tcgen05.mma.kind::f8f6f4.k64", "tcgen05.mma.kind::mxf4nvf4.block_scale"),
    fp8=True,
    fp4=True,
    nvfp4_dequant="NVFP4->FP16 direct + packed fma.rn.f32x2.f16x2",
    pipeline="rubin",
    stages=NVIDIA_STAGES,
    runtime="cuda",
    capability=(10, 7),
    tmem_columns=576,
    binary_ext="cubin",
    notes="212 SMs, 328 KB smem, 576 TMEM columns, FP8 MMA with K=64, 3 CTAs/SM for MSA (M31_FACTS.md); "
    "per-block limit is a working figure",
))
