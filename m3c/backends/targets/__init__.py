"""Built-in targets, one file each; importing this package registers them in the order `m3c targets` lists."""

import importlib

BUILTIN = ("hopper", "blackwell", "rubin", "cdna4", "cpu")
"""Modules under this package, imported (and so registered) in this order."""

for _module in BUILTIN:
    importlib.import_module(f"{__name__}.{_module}")
