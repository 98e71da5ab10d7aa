"""Blackwell (sm_100a, B200) and Blackwell Ultra (sm_103a, B300): tcgen05 MMA with TMEM, and QMUL4.

QMUL4 is PTX ``mul.e4m3x4.e2m1x4.e4m3x4`` (CUDA ≥ 13.4): four NVFP4 codes times their E4M3 block
scale become four FP8 values in one instruction, which then feed the FP8 tcgen05 MMA.
"""

from dataclasses import replace

from m3c.backends.target import KB, Target, register_target
from m3c.backends.targets._stages import NVIDIA_STAGES

_MMA = (
    "tcgen05.mma.cta_group::1.kind::f16",
    "tcgen05.mma.cta_group::2.kind::f8f6f4",
    "tcgen05.mma.kind::mxf4nvf4.block_scale",
)
_DEQUANT = "QMUL4 (mul.e4m3x4.e2m1x4.e4m3x4) + tcgen05 FP8"

BLACKWELL = register_target(Target(
    name="blackwell",
    arch="sm_100a",
    vendor="nvidia",
    products=("B200", "GB200"),
    compute_units=148,
    smem_per_block=227 * KB,
    smem_per_sm=228 * KB,
    warp_size=32,
    mma=_MMA,
    fp8=True,
    fp4=True,
    nvfp4_dequant=_DEQUANT,
    pipeline="blackwell",
    stages=NVIDIA_STAGES,
    runtime="cuda",
    capability=(10, 0),
    tmem_columns=512,
    binary_ext="cubin",
))

BLACKWELL_ULTRA = register_target(replace(
    BLACKWELL,
    name="blackwell-ultra",
    arch="sm_103a",
    products=("B300", "GB300"),
    capability=(10, 3),
    notes="SM count as for B200 (working figure; the enabled count may differ per SKU)",
))
