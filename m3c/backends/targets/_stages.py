"""Stage lists shared by the GPU target files (Triton's names for its compilation stages)."""

NVIDIA_STAGES = ("ir", "fused-ir", "ttir", "ttgir", "llir", "ptx", "cubin")
AMD_STAGES = ("ir", "fused-ir", "ttir", "ttgir", "llir", "amdgcn", "hsaco")
