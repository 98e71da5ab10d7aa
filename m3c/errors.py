"""Named errors: every bad input m3c refuses raises one of these, saying what was wrong and what to do."""

from __future__ import annotations


class M3CError(Exception):
    """Base of every error m3c raises on purpose."""


class ConfigError(M3CError, ValueError):
    """A model configuration field is unknown, missing, mistyped or inconsistent."""


class QuantizationError(M3CError, ValueError):
    """A tensor cannot be quantized or dequantized as asked (shape not divisible by the block, wrong dtype)."""


class ShapeError(M3CError, ValueError):
    """A tensor handed to m3c has the wrong shape, dtype or device."""


class CheckpointError(M3CError, ValueError):
    """A checkpoint tensor is missing, unexpected, misshapen or of the wrong dtype."""


class KVCacheCapacityError(M3CError, RuntimeError):
    """A request needs more KV-cache blocks than the cache (or its block table) holds."""


class PlanError(M3CError, ValueError):
    """The capacity planner was given an unknown GPU, layout or context length."""
