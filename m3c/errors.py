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


class TargetError(M3CError, ValueError):
    """A compile target name is unknown, or a target cannot do what was asked of it here."""


class ArtifactError(M3CError, ValueError):
    """A compiled artifact is missing, corrupt, tampered with, of a newer format, or built for another device."""


class CompileError(M3CError, RuntimeError):
    """A model could not be compiled as asked (bad options, an unsupported model or a failed stage)."""
