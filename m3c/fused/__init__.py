"""Public nn.Modules over m3c's compiled kernels, for users' own scripts."""

from m3c.fused.qkv import FusedQKVNormRopeKVInsert

__all__ = ["FusedQKVNormRopeKVInsert"]
