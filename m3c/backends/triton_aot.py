"""Ahead-of-time compilation of Triton kernels to target binaries (cubin now; hsaco later), no GPU needed.

Named stages (ttir → ttgir → llir → ptx → cubin for CUDA) are kept so `--dump-kernels` can write
them. The result is plain data (bytes + JSON-able metadata) that the artifact stores and the CUDA
driver launcher loads without the Triton JIT.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
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
        cached = self.__dict__.get("_key")
        if cached is not None:
            return cached
        blob = json.dumps([self.family, self.arg_types, {k: repr(v) for k, v in self.constexprs.items()},
                           self.num_warps, self.num_stages, list(self.divisible_16), self.enable_fp_fusion],
                          sort_keys=True)
        key = f"{self.family}_{hashlib.sha256(blob.encode()).hexdigest()[:12]}"
        object.__setattr__(self, "_key", key)  # frozen: specs are immutable, so the key is too
        return key


Runner = Callable[[KernelSpec, tuple[int, ...], Sequence[Any]], None]
"""Launches one kernel: ``runner(spec, grid, runtime_args)``. Host launchers take a runner so the same
argument-building code serves Triton's JIT (:func:`jit_run`, also the CPU interpreter) and the
runtime's offline-compiled cubins (``m3c.runtime.cuda_launcher.CubinRunner``, found by ``spec.key()``)."""


def jit_run(spec: KernelSpec, grid: tuple[int, ...], args: Sequence[Any]) -> None:
    """Launch `spec` through Triton's JIT (on the GPU, or in the interpreter under TRITON_INTERPRET=1); a CUDA C++
    spec (:class:`m3c.backends.cuda_aot.CudaKernelSpec`) is compiled with nvcc at first use instead."""
    if not isinstance(spec, KernelSpec):
        from m3c.backends.cuda_aot import cuda_jit_run

        cuda_jit_run(spec, grid, args)
        return
    spec.fn[grid](*args, **spec.constexprs, num_warps=spec.num_warps, num_stages=spec.num_stages,
                  enable_fp_fusion=spec.enable_fp_fusion)


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


def compile_kernels(specs: list[KernelSpec], backend: str = "cuda", arch: int | str = 90, warp_size: int = 32,
                    target_name: str = "hopper") -> list[CompiledKernel]:
    """Compile several specializations, in parallel child processes (one per core, at most 8).

    Under TRITON_INTERPRET=1 (where @triton.jit functions are interpreted and cannot be compiled) the
    children run without it; a single spec outside the interpreter compiles in this process.
    """
    if any(not isinstance(s, KernelSpec) for s in specs):  # CUDA C++ specs: nvcc, in this process
        from m3c.backends.cuda_aot import compile_cuda

        triton_specs = [s for s in specs if isinstance(s, KernelSpec)]
        done = iter(compile_kernels(triton_specs, backend, arch, warp_size, target_name))
        sm = f"sm_{arch}a" if isinstance(arch, int) and arch >= 90 else f"sm_{arch}"
        return [next(done) if isinstance(s, KernelSpec) else compile_cuda(s, sm, target_name) for s in specs]
    interp = os.environ.get("TRITON_INTERPRET") == "1"
    if not specs:
        return []
    workers = min(len(specs), os.cpu_count() or 1, 8)  # >= 1
    if workers <= 1 and not interp:
        return [compile_kernel(s, backend, arch, warp_size, target_name) for s in specs]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out: list[CompiledKernel | None] = [None] * len(specs)
    with tempfile.TemporaryDirectory() as tmp:
        procs = []
        for w in range(workers):
            mine = list(range(w, len(specs), workers))
            d = Path(tmp) / str(w)
            d.mkdir()
            job = [{"index": i, "module": specs[i].fn.fn.__module__ if hasattr(specs[i].fn, "fn")
                    else specs[i].fn.__module__, "name": specs[i].fn.__name__, "family": specs[i].family,
                    "arg_types": specs[i].arg_types, "constexprs": specs[i].constexprs,
                    "num_warps": specs[i].num_warps, "num_stages": specs[i].num_stages,
                    "divisible_16": list(specs[i].divisible_16), "enable_fp_fusion": specs[i].enable_fp_fusion}
                   for i in mine]
            (d / "job.json").write_text(json.dumps({"specs": job, "backend": backend, "arch": arch,
                                                    "warp_size": warp_size, "target": target_name}))
            with open(d / "log", "w") as log:  # a file, not a pipe: no child can block on a full pipe
                procs.append((subprocess.Popen([sys.executable, "-m", "m3c.backends.triton_aot", str(d)], env=env,
                                               stdout=log, stderr=subprocess.STDOUT), d))
        for p, d in procs:
            if p.wait():
                err = (d / "log").read_text()
                raise KernelCompileError(f"offline kernel compile failed in a child process:\n{err[-3000:]}")
        for w in range(workers):
            d = Path(tmp) / str(w)
            for j in json.loads((d / "job.json").read_text())["specs"]:
                i = j["index"]
                meta = json.loads((d / f"{i}.json").read_text())
                out[i] = CompiledKernel(specs[i].key(), meta["family"], meta["name"], (d / f"{i}.bin").read_bytes(),
                                        meta["shared_bytes"], meta["num_warps"], meta["arg_names"],
                                        meta["arg_types"], meta["target"], meta["stages"])
    return [c for c in out if c is not None]


def _child(tmp: str) -> None:
    """Child-process entry of compile_kernels: compile the job in `tmp` and write binaries + metadata."""
    job = json.loads((Path(tmp) / "job.json").read_text())
    for j in job["specs"]:
        i = j["index"]
        fn = getattr(importlib.import_module(j["module"]), j["name"])
        spec = KernelSpec(j["family"], fn, j["arg_types"], j["constexprs"], j["num_warps"], j["num_stages"],
                          tuple(j["divisible_16"]), j["enable_fp_fusion"])
        ck = compile_kernel(spec, job["backend"], job["arch"], job["warp_size"], job["target"])
        (Path(tmp) / f"{i}.bin").write_bytes(ck.binary)
        (Path(tmp) / f"{i}.json").write_text(json.dumps(ck.meta() | {"stages": ck.stages}))


def compile_kernel(spec: KernelSpec, backend: str = "cuda", arch: int | str = 90, warp_size: int = 32,
                   target_name: str = "hopper") -> CompiledKernel:
    """Compile one specialization offline for (backend, arch) (not under TRITON_INTERPRET; see compile_kernels)."""
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


if __name__ == "__main__":
    _child(sys.argv[1])
