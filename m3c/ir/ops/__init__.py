"""IR op definitions: importing this package registers every op (each module below defines some)."""

from m3c.ir.ops import core, fused, fused_moe, fused_msa, model, rope  # noqa: F401
