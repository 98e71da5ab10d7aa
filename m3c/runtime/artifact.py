"""Compiled artifacts on disk: format v1, a directory or a ``.m3c`` zip, checked file by file on load.

Layout (the same entries in both containers)::

    manifest.json        format_version, m3c version, target, options, model config, IR graph hash,
                         op counts, weight bytes, launch plan, created-from info, and the sha256 and
                         size of every other file
    graph.m3cir          the fused IR graph as text (m3c.ir.text)
    weights.safetensors  the prepacked weights, flat (see m3c.backends.program)
    kernels/<name>       kernel binaries (.cubin / .hsaco); none for the cpu target

There is no pickle anywhere: JSON, IR text and safetensors only. There are no timestamps either:
JSON is written with sorted keys, zip entries are sorted and dated 1980-01-01, so the same inputs
give a byte-identical artifact (and the same sha256 of the ``.m3c`` file).

:func:`load_artifact` checks the format version, every file's presence, size and sha256, the
graph hash, and that this machine can run the target; anything wrong raises :class:`ArtifactError`
saying what was wrong and what to do.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import shutil
import tempfile
import zipfile
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import safetensors.torch
import torch
from safetensors.torch import load as load_safetensors

from m3c.backends.options import CompileOptions
from m3c.backends.program import Program
from m3c.backends.target import get_target
from m3c.errors import ArtifactError, CompileError, M3CError
from m3c.ir.registry import all_ops
from m3c.model_defs.config import M3Config

with contextlib.suppress(ImportError):  # `rope` registers in its own module, which m3c.ir.ops does not import yet
    import m3c.ir.ops.rope  # noqa: F401

FORMAT_NAME = "m3c-artifact"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
GRAPH = "graph.m3cir"
WEIGHTS = "weights.safetensors"
KERNELS = "kernels/"
ZIP_SUFFIX = ".m3c"
_ZIP_DATE = (1980, 1, 1, 0, 0, 0)
_REQUIRED_KEYS = ("format_version", "m3c_version", "target", "options", "config", "graph", "files")


def m3c_version() -> str:
    """The installed m3c version (recorded in manifests and cache keys)."""
    import m3c

    return m3c.__version__


def sha256_bytes(data: bytes) -> str:
    """Hex sha256 of `data`."""
    return hashlib.sha256(data).hexdigest()


def _json_bytes(obj: Any) -> bytes:
    return (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode()


# ---- writing -----------------------------------------------------------------------------------
def artifact_files(program: Program, cfg: M3Config | None, created_from: Mapping[str, Any] | None = None
                   ) -> dict[str, bytes]:
    """Every file of the artifact of `program` (name -> bytes), manifest included. Deterministic."""
    from m3c.ir.text import graph_hash, print_graph

    target = get_target(program.target)
    files: dict[str, bytes] = {
        GRAPH: print_graph(program.graph).encode(),
        WEIGHTS: safetensors.torch.save(_contiguous(program.weights), metadata={"format": FORMAT_NAME}),
    }
    for name, blob in sorted(program.kernels.items()):
        files[KERNELS + name] = bytes(blob)
    g = program.graph
    kinds = {k: sum(1 for v in g.inputs if v.kind == k) for k in ("input", "param", "state")}
    manifest = {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "m3c_version": m3c_version(),
        "target": {"name": target.name, "arch": target.arch, "vendor": target.vendor, "runtime": target.runtime},
        "options": program.options.to_dict(),
        "config": cfg.to_dict() if cfg is not None else None,
        "graph": {"name": g.name, "hash": graph_hash(g), "nodes": len(g.nodes), "inputs": kinds,
                  "outputs": len(g.outputs), "op_counts": g.op_counts()},
        "weights": {"tensors": len(program.weights), "bytes": program.weights_nbytes()},
        "kernels": sorted(program.kernels),
        "launch_plan": program.launch_plan,
        "created_from": dict(created_from or {}),
        "files": {name: {"sha256": sha256_bytes(data), "size": len(data)} for name, data in sorted(files.items())},
    }
    files[MANIFEST] = _json_bytes(manifest)
    return files


def _contiguous(weights: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """CPU, contiguous tensors, none sharing storage with another (safetensors refuses shared storage)."""
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name in sorted(weights):
        t = weights[name].detach().to("cpu").contiguous()
        ptr = t.untyped_storage().data_ptr() if t.numel() else -1
        if ptr in seen or t.untyped_storage().nbytes() != t.numel() * t.element_size():
            t = t.clone()
        if t.numel():
            seen.add(t.untyped_storage().data_ptr())
        out[name] = t
    return out


def is_zip_path(path: str | Path) -> bool:
    """Whether `path` names a zip artifact (suffix ``.m3c``) rather than a directory."""
    return Path(path).suffix == ZIP_SUFFIX


def write_artifact_files(files: Mapping[str, bytes], path: str | Path) -> Path:
    """Write artifact files to `path` (``.m3c``: one zip; else a directory), atomically; returns the path.

    An existing artifact at `path` is replaced; any other existing file or non-empty directory is
    left alone and raises ArtifactError.
    """
    path = Path(path)
    if path.exists() and not _is_replaceable(path):
        raise ArtifactError(f"{path} exists and is not an m3c artifact; choose another output path "
                            "(m3c will not overwrite it)")
    path.parent.mkdir(parents=True, exist_ok=True)
    if is_zip_path(path):
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
        with os.fdopen(fd, "wb") as f:
            f.write(zip_bytes(files))
        os.chmod(tmp, 0o666 & ~_umask())
        if path.is_dir():
            shutil.rmtree(path)
        os.replace(tmp, path)
        return path
    tmp_dir = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    for name, data in sorted(files.items()):
        dst = tmp_dir / name
        dst.parent.mkdir(parents=True, exist_ok=True)
        dst.write_bytes(data)
    os.chmod(tmp_dir, 0o777 & ~_umask())
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()
    os.replace(tmp_dir, path)
    return path


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _is_replaceable(path: Path) -> bool:
    if path.is_dir():
        return not any(path.iterdir()) or (path / MANIFEST).is_file()
    return zipfile.is_zipfile(path) and MANIFEST in zipfile.ZipFile(path).namelist()


def zip_bytes(files: Mapping[str, bytes]) -> bytes:
    """A deterministic zip of `files`: sorted entries, fixed dates and permissions; weights and kernels stored."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        for name in sorted(files):
            info = zipfile.ZipInfo(name, date_time=_ZIP_DATE)
            info.external_attr = 0o644 << 16
            info.create_system = 3
            text = name.endswith((".json", ".m3cir"))
            info.compress_type = zipfile.ZIP_DEFLATED if text else zipfile.ZIP_STORED
            zf.writestr(info, files[name], compresslevel=9 if text else None)
    return buf.getvalue()


def save_artifact(program: Program, cfg: M3Config | None, path: str | Path,
                  created_from: Mapping[str, Any] | None = None) -> Path:
    """Save `program` (compiled from a model of config `cfg`) as an artifact at `path`; returns the path.

    `created_from` records how it was made (preset or checkpoint, seed), never a time or a host.
    """
    return write_artifact_files(artifact_files(program, cfg, created_from), path)


# ---- reading -----------------------------------------------------------------------------------
class _Container:
    """Read access to the entries of a directory or zip artifact."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._zip: zipfile.ZipFile | None = None
        if not path.exists():
            raise ArtifactError(f"{path}: no such artifact; check the path, or create it with "
                                "`m3c compile --preset m3.1-tiny -o <path>`")
        if path.is_file():
            try:
                self._zip = zipfile.ZipFile(path)
            except (zipfile.BadZipFile, OSError) as e:
                raise ArtifactError(f"{path}: not a readable .m3c zip ({e}); the file is corrupt or truncated, "
                                    "compile it again") from None

    def names(self) -> list[str]:
        if self._zip is not None:
            return sorted(n for n in self._zip.namelist() if not n.endswith("/"))
        return sorted(p.relative_to(self.path).as_posix() for p in self.path.rglob("*") if p.is_file())

    def read(self, name: str) -> bytes:
        try:
            if self._zip is not None:
                return self._zip.read(name)
            return (self.path / name).read_bytes()
        except KeyError:
            raise ArtifactError(f"{self.path}: file {name!r} is missing from the artifact; it is incomplete, "
                                "compile it again") from None
        except FileNotFoundError:
            raise ArtifactError(f"{self.path}: file {name!r} is missing from the artifact; it is incomplete, "
                                "compile it again") from None
        except (zipfile.BadZipFile, zlib.error, EOFError) as e:
            raise ArtifactError(f"{self.path}: entry {name!r} is corrupt ({e}); the file was damaged or "
                                "tampered with, compile it again") from None


def read_manifest(path: str | Path) -> dict[str, Any]:
    """The manifest of an artifact, checked for shape and format version (files are not checked)."""
    return _read_manifest(_Container(Path(path)))


def _read_manifest(box: _Container) -> dict[str, Any]:
    if MANIFEST not in box.names():
        raise ArtifactError(f"{box.path}: no {MANIFEST}; this is not an m3c artifact (or it is incomplete), "
                            "compile it again with `m3c compile`")
    raw = box.read(MANIFEST)
    try:
        manifest = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ArtifactError(f"{box.path}: {MANIFEST} is not valid JSON ({e}); the artifact is damaged, "
                            "compile it again") from None
    if not isinstance(manifest, dict):
        raise ArtifactError(f"{box.path}: {MANIFEST} must hold a JSON object; compile the artifact again")
    version = manifest.get("format_version")
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise ArtifactError(f"{box.path}: unknown artifact format version {version!r} (this m3c reads version "
                            f"{FORMAT_VERSION}); compile the artifact again")
    if version > FORMAT_VERSION:
        raise ArtifactError(f"{box.path}: artifact format version {version} was written by a newer m3c "
                            f"({manifest.get('m3c_version', '?')}); this m3c ({m3c_version()}) reads version "
                            f"{FORMAT_VERSION}: upgrade m3c, or compile the artifact again with this one")
    missing = [k for k in _REQUIRED_KEYS if k not in manifest]
    if missing:
        raise ArtifactError(f"{box.path}: {MANIFEST} lacks {missing}; the artifact is damaged, compile it again")
    files = manifest["files"]
    if not isinstance(files, dict) or not all(
        isinstance(v, dict) and isinstance(v.get("sha256"), str) and isinstance(v.get("size"), int)
        for v in files.values()
    ):
        raise ArtifactError(f"{box.path}: {MANIFEST} 'files' must map names to {{sha256, size}}; compile it again")
    return manifest


def _verified_files(box: _Container, manifest: dict[str, Any]) -> dict[str, bytes]:
    """Every listed file's bytes after checking presence, size and sha256; unlisted files are refused."""
    listed: dict[str, dict[str, Any]] = manifest["files"]
    present = set(box.names())
    for name in (GRAPH, WEIGHTS):
        if name not in listed:
            raise ArtifactError(f"{box.path}: {MANIFEST} does not list {name}; the artifact is damaged, compile it again")
    extra = sorted(present - set(listed) - {MANIFEST})
    if extra:
        raise ArtifactError(f"{box.path}: unlisted files {extra} (not in {MANIFEST}); someone added them, "
                            "remove them or compile the artifact again")
    out: dict[str, bytes] = {}
    for name, info in sorted(listed.items()):
        if name not in present:
            raise ArtifactError(f"{box.path}: file {name!r} is missing from the artifact; it is incomplete, "
                                "compile it again")
        data = box.read(name)
        if len(data) != info["size"]:
            how = "truncated" if len(data) < info["size"] else "longer than recorded"
            raise ArtifactError(f"{box.path}: {name} is {how} ({len(data)} bytes, the manifest says "
                                f"{info['size']}); the artifact is damaged, compile it again")
        if sha256_bytes(data) != info["sha256"]:
            raise ArtifactError(f"{box.path}: {name} does not match its sha256 in {MANIFEST}; the file was "
                                "modified (tampered with or damaged) after compiling; compile it again")
        out[name] = data
    return out


@dataclass
class LoadedArtifact:
    """An artifact read back and checked: its manifest, the model config and the Program."""

    path: Path
    manifest: dict[str, Any]
    program: Program
    cfg: M3Config | None
    files: dict[str, int] = field(default_factory=dict)
    """File name -> size in bytes (all verified)."""

    @property
    def target(self) -> str:
        """The target name the artifact was compiled for."""
        return self.program.target


def load_artifact(path: str | Path, device: torch.device | str | None = None, *,
                  check_device: bool = True) -> LoadedArtifact:
    """Read, verify and rebuild the Program of an artifact (weights on `device`, default CPU).

    With `check_device` (the default) an artifact whose target this machine cannot run is refused;
    ``m3c inspect`` passes False to look at any artifact.
    """
    from m3c.ir.text import graph_hash, parse_graph

    box = _Container(Path(path))
    manifest = _read_manifest(box)
    files = _verified_files(box, manifest)
    target_info = manifest["target"]
    name = target_info.get("name") if isinstance(target_info, dict) else None
    try:
        target = get_target(str(name))
    except M3CError as e:
        raise ArtifactError(f"{box.path}: {e}; upgrade m3c to one that knows that target, or compile the artifact again for a known one") from None
    if check_device:
        _check_device(box.path, target, device)
    try:
        graph = parse_graph(files[GRAPH].decode())
    except (M3CError, ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
        raise ArtifactError(f"{box.path}: {GRAPH} does not parse ({e}); compile the artifact again") from None
    unknown = sorted({n.op for n in graph.nodes if n.op not in all_ops()})
    if unknown:
        raise ArtifactError(f"{box.path}: the graph uses ops this m3c does not know: {unknown}; the artifact was "
                            "written by another m3c version: use that one, or compile the artifact again")
    want = manifest["graph"].get("hash") if isinstance(manifest["graph"], dict) else None
    if graph_hash(graph) != want:
        raise ArtifactError(f"{box.path}: the graph's hash differs from the manifest's ({want}); the artifact is "
                            "inconsistent, compile it again")
    try:
        weights = load_safetensors(files[WEIGHTS])  # safetensors bytes: no code runs
    except Exception as e:  # safetensors raises its own error types
        raise ArtifactError(f"{box.path}: {WEIGHTS} is not a readable safetensors file ({e}); compile it again") from None
    if device is not None:
        weights = {k: v.to(device) for k, v in weights.items()}
    try:
        options = CompileOptions.from_dict(dict(manifest["options"]))
        cfg = M3Config.from_dict(manifest["config"]) if manifest["config"] is not None else None
    except (M3CError, TypeError, ValueError) as e:
        raise ArtifactError(f"{box.path}: {MANIFEST} holds bad options or config ({e}); compile it again") from None
    kernels = {n[len(KERNELS):]: d for n, d in files.items() if n.startswith(KERNELS)}
    program = Program(target=target.name, graph=graph, weights=weights, options=options, kernels=kernels,
                      launch_plan=list(manifest.get("launch_plan") or []))
    try:
        program.params()  # every param input has its tensors
    except CompileError as e:
        raise ArtifactError(f"{box.path}: {e}; the weights do not fit the graph, compile it again") from None
    sizes = {n: len(d) for n, d in files.items()}
    return LoadedArtifact(box.path, manifest, program, cfg, sizes)


def _check_device(path: Path, target: Any, device: torch.device | str | None) -> None:
    """Refuse an artifact this machine (or the asked-for device) cannot run."""
    if not target.runnable_here():
        products = "/".join(target.products)
        raise ArtifactError(
            f"{path}: compiled for target {target.name} ({target.arch}, {products}) but this machine has no such "
            f"device; run it on a {products}, or recompile for this machine with "
            "`m3c compile ... --target cpu` (see `m3c targets` for what runs here)"
        )
    if device is not None and target.runtime != "cpu" and torch.device(device).type == "cpu":
        raise ArtifactError(f"{path}: target {target.name} runs on the GPU, not on device {device!r}; "
                            "leave the device out or pass a cuda device")


def verify_artifact(path: str | Path) -> dict[str, Any]:
    """Check every file of an artifact (not the device); returns its manifest."""
    box = _Container(Path(path))
    manifest = _read_manifest(box)
    _verified_files(box, manifest)
    return manifest


def describe(loaded: LoadedArtifact) -> str:
    """A human-readable summary of a verified artifact (what ``m3c inspect`` prints)."""
    m, prog = loaded.manifest, loaded.program
    target = get_target(prog.target)
    kind = "zip" if loaded.path.is_file() else "directory"
    opts = ", ".join(f"{k}={v}" for k, v in sorted(prog.options.to_dict().items()) if k != "target")
    g = prog.graph
    kinds = {k: sum(1 for v in g.inputs if v.kind == k) for k in ("input", "param", "state")}
    lines = [
        f"artifact   {loaded.path} ({kind}, format {m['format_version']}, written by m3c {m['m3c_version']})",
        f"target     {target.name} ({target.arch}, {'/'.join(target.products)}); runnable here: "
        f"{'yes' if target.runnable_here() else 'no'}",
        f"options    {opts}",
    ]
    cfg = loaded.cfg
    if cfg is not None:
        lines.append(
            f"model      {cfg.name}: {cfg.num_hidden_layers} layers ({len(cfg.sparse_layers)} sparse), hidden "
            f"{cfg.hidden_size}, vocab {cfg.vocab_size}, {cfg.num_attention_heads} q / {cfg.num_key_value_heads} KV "
            f"heads × {cfg.head_dim}, {cfg.n_routed_experts} experts (top-{cfg.num_experts_per_tok}), MSA blocks "
            f"of {cfg.msa_block_size} (top-{cfg.msa_topk_blocks}), KV {cfg.quant.kv_cache_dtype}, indexer KV "
            f"{cfg.quant.indexer_kv_dtype}"
        )
    else:
        lines.append("model      (not an M3 model: no config)")
    made = m.get("created_from") or {}
    if made:
        lines.append("created    " + ", ".join(f"{k}={v}" for k, v in sorted(made.items())))
    lines.append(f"graph      @{g.name}: {len(g.nodes)} nodes; inputs {kinds['input']} activation / {kinds['param']} "
                 f"param / {kinds['state']} state; {len(g.outputs)} output(s); hash {m['graph']['hash'][:16]}… OK")
    ops = g.op_counts()
    lines.append("ops        " + ", ".join(f"{op} {n}" for op, n in sorted(ops.items(), key=lambda kv: (-kv[1], kv[0]))))
    lines.append(f"weights    {len(prog.weights)} tensors, {prog.weights_nbytes():,} bytes")
    if prog.kernels:
        kernels = ", ".join(sorted(prog.kernels))
    else:
        kernels = f"none ({target.name} runs the IR interpreter)" if target.runtime == "cpu" else "none"
    lines.append(f"kernels    {kernels}")
    lines.append("files      (sha256 checked)")
    for name, info in sorted(m["files"].items()):
        lines.append(f"  {name:<28} {info['size']:>14,} B  sha256 {info['sha256'][:16]}… OK")
    return "\n".join(lines)
