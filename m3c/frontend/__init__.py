"""torch → IR: capture (torch.export), the op mapping tables, identical-layer grouping, ONNX export.

Names are imported lazily so ``import m3c.frontend`` stays cheap.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

_LAZY = {
    "Capture": "m3c.frontend.capture",
    "CaptureReport": "m3c.frontend.capture",
    "capture": "m3c.frontend.capture",
    "capture_m3": "m3c.frontend.capture",
    "CaptureError": "m3c.frontend.aten_table",
    "ATEN_TABLE": "m3c.frontend.aten_table",
    "layer_groups": "m3c.frontend.layers",
    "stamp_layers": "m3c.frontend.layers",
    "to_onnx": "m3c.frontend.onnx_export",
    "save_onnx": "m3c.frontend.onnx_export",
}

__all__ = list(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'm3c.frontend' has no attribute {name!r}")
