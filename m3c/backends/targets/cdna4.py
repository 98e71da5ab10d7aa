"""CDNA4 (gfx950): MI355X. No NVFP4 instruction: an LDS table of (E4M3 scale × E2M1) FP8 values + v_perm_b32."""

from m3c.backends.target import KB, Target, register_target
from m3c.backends.targets._stages import AMD_STAGES

CDNA4 = register_target(Target(
    name="cdna4",
    arch="gfx950",
    vendor="amd",
    products=("MI350X", "MI355X"),
    compute_units=256,
    smem_per_block=160 * KB,
    smem_per_sm=160 * KB,
    warp_size=64,
    mma=("v_mfma_f32_16x16x128_f8f6f4", "v_mfma_scale_f32_16x16x128_f8f6f4", "v_mfma_f32_32x32x64_f8f6f4"),
    fp8=True,
    fp4=True,
    nvfp4_dequant="LDS table + v_perm_b32 -> FP8 MFMA",
    pipeline="cdna4",
    stages=AMD_STAGES,
    runtime="hip",
    binary_ext="hsaco",
    notes="256 CUs, wave 64, 160 KB LDS per CU",
))
