"""Hopper (sm_90a): H100 / H200. No FP4 tensor cores: NVFP4 is turned into FP8 by bit arithmetic, then wgmma."""

from m3c.backends.target import KB, Target, register_target
from m3c.backends.targets._stages import NVIDIA_STAGES

HOPPER = register_target(Target(
    name="hopper",
    arch="sm_90a",
    vendor="nvidia",
    products=("H100", "H200"),
    compute_units=132,
    smem_per_block=227 * KB,
    smem_per_sm=228 * KB,
    warp_size=32,
    mma=("wgmma.m64nNk16.bf16", "wgmma.m64nNk32.e4m3", "mma.sync.m16n8k32.e4m3"),
    fp8=True,
    fp4=False,
    nvfp4_dequant="e2m1->fp8 via bit ops + FP8 wgmma",
    pipeline="hopper",
    stages=NVIDIA_STAGES,
    runtime="cuda",
    capability=(9, 0),
    binary_ext="cubin",
    lowering="m3c.backends.hopper:lower_hopper",
    notes="SXM parts: 132 SMs, 228 KB shared memory per SM (227 KB per block)",
))
