"""CUDA C++ kernels (what Triton cannot say: explicit MMA fragments, byte-permute decodes): their specification,
offline compilation to cubin with nvcc, and a JIT runner that compiles at first use and launches through the driver.

A :class:`CudaKernelSpec` stands where a Triton :class:`~m3c.backends.triton_aot.KernelSpec` does: it has a
``family`` and a stable ``key()``, :func:`m3c.backends.triton_aot.compile_kernels` compiles it into the same
:class:`~m3c.backends.triton_aot.CompiledKernel` (so artifacts and the runtime's ``CubinRunner`` take it
unchanged), and :func:`m3c.backends.triton_aot.jit_run` launches it. Sources live next to their host launcher
(``m3c/backends/kernels/cuda/*.cu``) and include no system headers, only their shared ``ptx_common.cuh``, so a bare
nvcc compiles them (PyPI's ``nvidia-cuda-nvcc`` on a CPU machine, the toolkit's on a GPU machine); a spec's key
covers the source with that header expanded (:func:`source_text`). Kernels take two trailing unused pointer
arguments, as Triton's do, so one launcher serves both.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from m3c.backends.triton_aot import CompiledKernel, KernelCompileError

SOURCE_DIR = Path(__file__).parent / "kernels" / "cuda"


@dataclass(frozen=True)
class CudaKernelSpec:
    """What to compile: a .cu source under ``kernels/cuda``, the extern "C" kernel in it, -D defines, the runtime
    argument types (Triton signature strings, in order), the block size and the dynamic shared memory."""

    family: str
    source: str
    kernel: str
    arg_types: tuple[tuple[str, str], ...]  # (name, "*u8" / "i32" / "fp32"), in the kernel's order
    defines: tuple[tuple[str, int], ...] = ()
    num_warps: int = 4
    shared_bytes: int = 0
    pdl: bool = False
    """Launch with programmatic dependent launch: the kernel may start while the previous kernel on the stream runs
    and must call ``grid_wait()`` (ptx_common.cuh) before reading that kernel's outputs or writing anything."""
    ptxas_opt: int = 3
    """ptxas's optimization level (``-Xptxas -O<n>``; nvcc's own stays -O3): its instruction scheduling differs by
    level (e.g. where it places loads among the math)."""

    def key(self) -> str:
        """A stable name for this specialization (family + sha of the source text, kernel, defines, launch);
        computed once per spec (launchers call it at every launch)."""
        cached = self.__dict__.get("_key")
        if cached is None:
            blob = json.dumps([self.family, self.source, _source_sha(self.source), self.kernel,
                               list(self.arg_types), list(self.defines), self.num_warps, self.shared_bytes,
                               *(["pdl"] if self.pdl else []),
                               *([f"ptxas -O{self.ptxas_opt}"] if self.ptxas_opt != 3 else [])])
            cached = f"{self.family}_{hashlib.sha256(blob.encode()).hexdigest()[:12]}"
            object.__setattr__(self, "_key", cached)  # frozen: specs are immutable, so the key is too
        return cached


def arg_types(args: str) -> tuple[tuple[str, str], ...]:
    """A kernel's runtime arguments from their names in order, ``*name`` a pointer: "*x T" -> (("x", "*u8"),
    ("T", "i32"))."""
    return tuple((a[1:], "*u8") if a.startswith("*") else (a, "i32") for a in args.split())


@functools.cache
def source_text(source: str) -> str:
    """A kernel source with every ``#include "name"`` of a header under ``kernels/cuda`` replaced by that header's
    text (each once): what nvcc compiles, in one piece (read once per process)."""
    seen: set[str] = set()

    def expand(name: str) -> str:
        out = []
        for line in (SOURCE_DIR / name).read_text().splitlines(keepends=True):
            m = _INCLUDE.match(line)
            if m and (SOURCE_DIR / m.group(1)).exists():
                if m.group(1) not in seen:
                    seen.add(m.group(1))
                    out.append(expand(m.group(1)))
            elif line.strip() != "#pragma once":
                out.append(line)
        return "".join(out)

    return expand(source)


_INCLUDE = re.compile(r'\s*#\s*include\s+"([^"]+)"')


@functools.cache
def _source_sha(source: str) -> str:
    """sha256 of a kernel source with its headers (:func:`source_text`), so a header edit changes every key."""
    return hashlib.sha256(source_text(source).encode()).hexdigest()


def find_nvcc() -> str:
    """The nvcc to use: $M3C_NVCC, PyPI's nvidia-cuda-nvcc, the one on PATH, or /usr/local/cuda's."""
    env = os.environ.get("M3C_NVCC")
    if env:
        return env
    try:
        import nvidia  # the PyPI CUDA wheels' namespace package

        for base in getattr(nvidia, "__path__", []):
            for sub in ("cu13", "cuda_nvcc"):
                p = Path(base) / sub / "bin" / "nvcc"
                if p.exists():
                    return str(p)
    except ImportError:
        pass
    for p in (shutil.which("nvcc"), "/usr/local/cuda/bin/nvcc"):
        if p and Path(p).exists():
            return p
    raise KernelCompileError("no nvcc found for the CUDA C++ kernels: pip install nvidia-cuda-nvcc, or set M3C_NVCC "
                             "to an nvcc binary (CUDA >= 12.8 for sm_90a / sm_100a)")


def compile_cuda(spec: CudaKernelSpec, arch: str = "sm_90a", target_name: str = "hopper",
                 keep_sass: bool = False) -> CompiledKernel:
    """nvcc -cubin for `arch` (one nvcc run per source and defines: the kernels of one .cu share it); the
    CompiledKernel's stages hold the source, the PTX (and the SASS with `keep_sass`)."""
    binary, ptx = _nvcc(spec.source, spec.defines, arch, spec.ptxas_opt)
    stages = {"cu": source_text(spec.source), "ptx": ptx}
    if keep_sass:
        stages["sass"] = disassemble(binary)
    names = [n for n, _ in spec.arg_types]
    return CompiledKernel(spec.key(), spec.family, spec.kernel, binary, spec.shared_bytes, spec.num_warps, names,
                          [t for _, t in spec.arg_types], target_name, stages)


@functools.lru_cache(maxsize=64)
def _nvcc(source: str, defines: tuple[tuple[str, int], ...], arch: str, ptxas_opt: int = 3) -> tuple[bytes, str]:
    """(cubin, ptx) of one source with -D defines and ptxas at -O`ptxas_opt` (cached per process; the source's sha
    is in every spec key)."""
    src = SOURCE_DIR / source
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "k.cubin"
        cmd = [find_nvcc(), f"-arch={arch}", "-cubin", "-O3", "-std=c++17", "-keep", "-keep-dir", tmp, "-o", str(out),
               str(src), *[f"-D{k}={v}" for k, v in defines], *(["-Xptxas", f"-O{ptxas_opt}"] if ptxas_opt != 3 else [])]
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode:
            raise KernelCompileError(f"{source}: nvcc failed for {arch}:\n{' '.join(cmd)}\n{res.stderr[-3000:]}")
        ptx = next(Path(tmp).glob("*.ptx"), None)
        return out.read_bytes(), ptx.read_text() if ptx else ""


def cuobjdump(cubin: bytes, *flags: str) -> str:
    """cuobjdump's output for a cubin with these flags (``-sass``, ``-res-usage``; the tool from Triton's wheel or
    the toolkit)."""
    import triton

    tools = [Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump", shutil.which("cuobjdump")]
    tool = next((str(t) for t in tools if t and Path(t).exists()), None)
    if tool is None:
        raise KernelCompileError("no cuobjdump found to read a cubin")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        res = subprocess.run([tool, *flags, f.name], capture_output=True, text=True)
    if res.returncode:
        raise KernelCompileError(f"cuobjdump failed: {res.stderr[-2000:]}")
    return res.stdout


def disassemble(cubin: bytes) -> str:
    """The SASS of a cubin."""
    return cuobjdump(cubin, "-sass")


_LOADED: dict[str, Any] = {}


def cuda_jit_run(spec: CudaKernelSpec, grid: tuple[int, ...], args: Sequence[Any]) -> None:
    """Compile `spec` for this GPU at first use (cached per process), then launch it on the current stream."""
    kernel = _LOADED.get(spec.key())
    if kernel is None:
        import torch

        from m3c.backends.cuda_driver import CubinKernel

        major, minor = torch.cuda.get_device_capability()
        arch = f"sm_{major}{minor}{'a' if major >= 9 else ''}"
        ck = compile_cuda(spec, arch)
        kernel = CubinKernel(ck.binary, ck.name, ck.shared_bytes, ck.num_warps, ck.arg_types)
        _LOADED[spec.key()] = kernel
    kernel(grid, *args, pdl=spec.pdl)
