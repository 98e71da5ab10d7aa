"""The compile cache: artifacts stored under a content hash of everything that decides their bytes.

The key is the sha256 of (model config, IR graph hash and text, CompileOptions, m3c version, a
fingerprint of m3c's source and the torch version, and a weights key naming where the weights came
from: a preset's seed, a checkpoint's files, or the tensors' own hash). Entries are ordinary
``.m3c`` artifacts in ``$M3C_CACHE_DIR`` (default ``~/.cache/m3c``), under ``artifacts/<key>.m3c``;
a damaged entry counts as a miss and is replaced. For the reference M3 model, whose graph follows
from its config and m3c's code, ``aliases/<model key>.json`` maps a key computed before capture to
the full key, so a repeated compile skips the capture too.
Writing is atomic, so concurrent compiles of the same key at worst both write the same bytes.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from m3c.backends.options import CompileOptions
from m3c.backends.program import Program
from m3c.errors import ArtifactError
from m3c.ir.graph import Graph
from m3c.model_defs.config import M3Config
from m3c.runtime.artifact import LoadedArtifact, load_artifact, m3c_version, save_artifact

ENV_VAR = "M3C_CACHE_DIR"


def default_cache_dir() -> Path:
    """``$M3C_CACHE_DIR`` if set, else ``~/.cache/m3c``."""
    env = os.environ.get(ENV_VAR)
    return Path(env) if env else Path.home() / ".cache" / "m3c"


@functools.cache
def code_fingerprint() -> str:
    """sha256 of m3c's own source files (Python, and the CUDA C++ kernels' .cu / .cuh, whose text is part of every
    kernel's key) and the torch version: any change to the compiler changes every key."""
    import m3c

    return source_fingerprint(Path(m3c.__file__).parent)


def source_fingerprint(root: Path) -> str:
    """sha256 of the torch version and every .py / .cu / .cuh file under `root` (names and contents)."""
    h = hashlib.sha256(f"torch {torch.__version__}\n".encode())
    for path in sorted(p for ext in ("*.py", "*.cu", "*.cuh") for p in root.rglob(ext)):
        h.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def _digest(material: dict[str, Any]) -> str:
    material = {**material, "m3c_version": m3c_version(), "code": code_fingerprint()}
    return hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()


def cache_key(cfg: M3Config | None, graph: Graph, options: CompileOptions, weights_key: str) -> str:
    """The hex key of one compile (see the module docstring for what goes in)."""
    from m3c.ir.text import graph_hash, print_graph

    return _digest({
        "config": cfg.to_dict() if cfg is not None else None,
        "graph_hash": graph_hash(graph),
        "graph_text": hashlib.sha256(print_graph(graph).encode()).hexdigest(),  # names bind the weights
        "options": options.to_dict(),
        "weights": weights_key,
    })


def model_key(cfg: M3Config, options: CompileOptions, weights_key: str) -> str:
    """A key computable BEFORE capture, for models whose graph is a function of the config and m3c's code
    (the reference M3 model): it names an alias of the full :func:`cache_key`, so a hit skips the capture."""
    return _digest({"model": "MiniMaxM3ForCausalLM", "config": cfg.to_dict(), "options": options.to_dict(),
                    "weights": weights_key})


def tensors_key(tensors: Mapping[str, Any]) -> str:
    """A content hash of named tensors (quantized values by their parts), for weights without a cheaper name."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        for suffix, t in _parts(tensors[name]):
            t = t.detach().to("cpu").contiguous()
            h.update(f"{name}{suffix}:{t.dtype}:{list(t.shape)}\n".encode())
            h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return "sha256:" + h.hexdigest()


def _parts(value: Any) -> Iterable[tuple[str, torch.Tensor]]:
    if isinstance(value, torch.Tensor):
        yield "", value
        return
    for f in ("data", "scale", "global_scale"):
        t = getattr(value, f, None)
        if isinstance(t, torch.Tensor):
            yield f".{f}", t


def checkpoint_key(path: str | Path) -> str:
    """A cheap fingerprint of a checkpoint directory: its files' names, sizes and modification times."""
    path = Path(path)
    h = hashlib.sha256()
    for p in sorted(path.iterdir()):
        if p.is_file():
            st = p.stat()
            h.update(f"{p.name}:{st.st_size}:{st.st_mtime_ns}\n".encode())
    return f"checkpoint:{path.resolve()}:{h.hexdigest()}"


@dataclass
class CompileCache:
    """Artifacts by compile key in one directory; counts hits and misses."""

    root: Path = field(default_factory=default_cache_dir)
    hits: int = 0
    misses: int = 0

    def __post_init__(self) -> None:
        self.root = Path(self.root)

    def path_for(self, key: str) -> Path:
        """Where the artifact of `key` lives."""
        return self.root / "artifacts" / f"{key}.m3c"

    def get(self, key: str, device: torch.device | str | None = None) -> LoadedArtifact | None:
        """The cached artifact of `key`, or None (a miss; a damaged entry is removed and counts as one)."""
        path = self.path_for(key)
        if path.is_file():
            try:
                loaded = load_artifact(path, device)
            except ArtifactError:
                path.unlink(missing_ok=True)
            else:
                self.hits += 1
                return loaded
        self.misses += 1
        return None

    def put(self, key: str, program: Program, cfg: M3Config | None,
            created_from: Mapping[str, Any] | None = None) -> Path:
        """Store the artifact of a compile under `key`; returns its path."""
        return save_artifact(program, cfg, self.path_for(key), created_from)

    def get_alias(self, model_key: str, device: torch.device | str | None = None) -> LoadedArtifact | None:
        """The artifact a :func:`model_key` points to, or None (not counted as a miss: the full key decides)."""
        alias = self.root / "aliases" / f"{model_key}.json"
        try:
            key = json.loads(alias.read_text())["key"]
        except (OSError, ValueError, KeyError, TypeError):
            return None
        path = self.path_for(str(key))
        if not path.is_file():
            return None
        try:
            loaded = load_artifact(path, device)
        except ArtifactError:
            return None
        self.hits += 1
        return loaded

    def put_alias(self, model_key: str, key: str) -> None:
        """Point `model_key` at the full key `key`."""
        alias = self.root / "aliases" / f"{model_key}.json"
        alias.parent.mkdir(parents=True, exist_ok=True)
        tmp = alias.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps({"key": key}) + "\n")
        os.replace(tmp, alias)

    def entries(self) -> list[Path]:
        """Every cached artifact."""
        d = self.root / "artifacts"
        return sorted(d.glob("*.m3c")) if d.is_dir() else []
