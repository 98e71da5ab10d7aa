"""m3c: a model compiler for the MiniMax-M3 family of LLMs.

The front doors, imported lazily so ``import m3c`` stays cheap:

- ``m3c.compile(model, example_inputs=None, target="cpu", **options)``: a callable like the model;
- ``m3c.compile_preset(preset_or_cfg, target="cpu", checkpoint=None, ...)``: (Program, config, report);
- ``m3c.save_artifact`` / ``m3c.load_artifact``: artifacts on disk; ``m3c.Executor``: run one;
- ``torch.compile(model, backend="m3c")``: the Dynamo backend (registered by entry point).
"""

from __future__ import annotations

from importlib import import_module
from importlib.metadata import PackageNotFoundError, version
from typing import Any

try:
    __version__ = version("m3c")
except PackageNotFoundError:  # running from a source tree without an install
    __version__ = "0.1.0"

_LAZY = {
    "compile": "m3c.compiler",
    "compile_preset": "m3c.compiler",
    "CompiledModel": "m3c.compiler",
    "CompileReport": "m3c.compiler",
    "CompileOptions": "m3c.backends.options",
    "Program": "m3c.backends.program",
    "get_target": "m3c.backends.target",
    "list_targets": "m3c.backends.target",
    "save_artifact": "m3c.runtime.artifact",
    "load_artifact": "m3c.runtime.artifact",
    "Executor": "m3c.runtime.executor",
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'm3c' has no attribute {name!r}")
