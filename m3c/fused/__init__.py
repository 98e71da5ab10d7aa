"""Public nn.Modules over m3c's compiled kernels, for users' own scripts."""

from m3c.fused.moe import MegaMoE
from m3c.fused.msa import SparseAttention
from m3c.fused.qkv import FusedQKVNormRopeKVInsert

__all__ = ["FusedQKVNormRopeKVInsert", "MegaMoE", "SparseAttention"]
