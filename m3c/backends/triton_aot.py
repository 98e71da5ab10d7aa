"""Ahead-of-time compilation of Triton kernels to target binaries (cubin now; hsaco later), no GPU needed.

Named stages (ttir → ttgir → llir → ptx → cubin for CUDA) are kept so `--dump-kernels` can write
them. The result is plain data (bytes + JSON-able metadata) that the artifact stores and the CUDA
driver launcher loads without the Triton JIT.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from m3c.errors import M3CError


class KernelCompileError(M3CError, RuntimeError):
    """A kernel failed to compile for a target."""


@dataclass(frozen=True)
class KernelSpec:
    """What to compile: a Triton function, runtime argument types, constexprs and launch options."""

    family: str
    fn: Any  # triton.JITFunction
    arg_types: dict[str, str]  # runtime args only, Triton signature strings ("*bf16", "i32", "fp32")
    constexprs: dict[str, Any]
    num_warps: int = 4
    num_stages: int = 3
    divisible_16: tuple[str, ...] = ()  # args known to be 16-aligned (pointers) / multiples of 16 (ints)
    enable_fp_fusion: bool = False  # off: the epilogue's float math rounds like the reference

    def key(self) -> str:
        """A stable name for this specialization (family + sha of the constants and options)."""
        blob = json.dumps([self.family, self.arg_types, {k: repr(v) for k, v in self.constexprs.items()},
                           self.num_warps, self.num_stages, list(self.divisible_16), self.enable_fp_fusion],
                          sort_keys=True)
        return f"{self.family}_{hashlib.sha256(blob.encode()).hexdigest()[:12]}"


@dataclass
class CompiledKernel:
    """A compiled kernel: binary, entry name, launch facts, and the intermediate stages."""

    key: str
    family: str
    name: str
    binary: bytes
    shared_bytes: int
    num_warps: int
    arg_names: list[str]
    arg_types: list[str]
    target: str
    stages: dict[str, str] = field(default_factory=dict)

    def meta(self) -> dict[str, Any]:
        """JSON-able launch metadata (everything but the binary and stages)."""
        return {"key": self.key, "family": self.family, "name": self.name, "shared_bytes": self.shared_bytes,
                "num_warps": self.num_warps, "arg_names": self.arg_names, "arg_types": self.arg_types,
                "target": self.target}

    def dump(self, directory: Path) -> list[Path]:
        """Write every stage (source, ttir, ttgir, llir, ptx) and the binary under `directory`."""
        directory.mkdir(parents=True, exist_ok=True)
        out = []
        for stage, text in self.stages.items():
            p = directory / f"{self.key}.{stage}"
            p.write_text(text)
            out.append(p)
        p = directory / f"{self.key}.cubin"
        p.write_bytes(self.binary)
        return [*out, p]


def compile_kernel(spec: KernelSpec, backend: str = "cuda", arch: int | str = 90, warp_size: int = 32,
                   target_name: str = "hopper") -> CompiledKernel:
    """Compile one specialization offline for (backend, arch)."""
    names = list(spec.fn.arg_names)
    signature = {n: spec.arg_types.get(n, "constexpr") for n in names}
    missing = [n for n in names if n not in spec.arg_types and n not in spec.constexprs]
    if missing:
        raise KernelCompileError(f"{spec.family}: arguments {missing} have neither a type nor a constexpr value")
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in spec.divisible_16}
    try:
        src = ASTSource(spec.fn, signature, dict(spec.constexprs), attrs)
        cc = triton.compile(src, target=GPUTarget(backend, arch, warp_size),
                            options={"num_warps": spec.num_warps, "num_stages": spec.num_stages,
                                     "enable_fp_fusion": spec.enable_fp_fusion})
    except Exception as e:  # Triton raises many error types
        raise KernelCompileError(f"{spec.family} for {backend}:{arch} failed to compile: {e}") from e
    binary = cc.asm.get("cubin") or cc.asm.get("hsaco")
    stages = {k: v for k, v in cc.asm.items() if isinstance(v, str)}
    runtime = [n for n in names if n in spec.arg_types]
    return CompiledKernel(spec.key(), spec.family, cc.metadata.name, bytes(binary), int(cc.metadata.shared),
                          spec.num_warps, runtime, [spec.arg_types[n] for n in runtime], target_name, stages)
