"""The CPU target: the fused graph runs through the IR interpreter (reference semantics); no kernels."""

from m3c.backends.target import Target, register_target

CPU = register_target(Target(
    name="cpu",
    arch="cpu",
    vendor="cpu",
    products=("any CPU",),
    compute_units=0,
    smem_per_block=0,
    smem_per_sm=0,
    warp_size=1,
    mma=(),
    fp8=False,
    fp4=False,
    nvfp4_dequant="reference",
    pipeline="cpu",
    stages=("ir", "fused-ir", "program"),
    runtime="cpu",
    lowering="m3c.backends.cpu:lower_cpu",
    notes="runs the IR interpreter over the fused graph; the truth GPU programs are checked against",
))
