"""Load and launch cubins through the CUDA driver (cuda-python): no Triton JIT. The runtime launches an
artifact's kernels with it; the backends' JIT runner launches CUDA C++ kernels compiled at first use.

Arguments are the kernel's runtime arguments in order (tensors by device pointer, ints as int32,
floats as float32), then the two scratch pointers Triton kernels take (passed as null).
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch

from m3c.errors import M3CError


class CudaLaunchError(M3CError, RuntimeError):
    """A CUDA driver call failed while loading or launching a kernel."""


def _driver() -> Any:
    try:
        from cuda.bindings import driver
    except ImportError:  # older cuda-python
        try:
            from cuda import cuda as driver  # type: ignore[no-redef]
        except ImportError as e:
            raise CudaLaunchError("cuda-python is not installed: pip install cuda-python") from e
    return driver


def _check(result: Any, what: str) -> Any:
    err, *rest = result if isinstance(result, tuple) else (result,)
    if int(err) != 0:
        raise CudaLaunchError(f"{what} failed: CUDA error {int(err)} ({err})")
    return rest[0] if len(rest) == 1 else rest


_CTYPES = {"i32": ctypes.c_int32, "i64": ctypes.c_int64, "fp32": ctypes.c_float, "u32": ctypes.c_uint32}


class CubinKernel:
    """One loaded cubin function, launchable on the current torch CUDA stream."""

    def __init__(self, binary: bytes, name: str, shared_bytes: int, num_warps: int, arg_types: list[str]) -> None:
        torch.cuda.init()
        torch.cuda.current_stream()  # makes torch's primary context current
        self.cu = _driver()
        self.module = _check(self.cu.cuModuleLoadData(binary), "cuModuleLoadData")
        self.func = _check(self.cu.cuModuleGetFunction(self.module, name.encode()), f"cuModuleGetFunction({name})")
        self.shared, self.threads, self.arg_types = shared_bytes, 32 * num_warps, arg_types
        self._configs: dict[tuple[int, int, int, int], Any] = {}
        if shared_bytes > 48 * 1024:
            attr = self.cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
            _check(self.cu.cuFuncSetAttribute(self.func, attr, shared_bytes), "cuFuncSetAttribute")

    def __call__(self, grid: tuple[int, ...], *args: Any, pdl: bool = False) -> None:
        """Launch over `grid` with the runtime arguments in signature order; ``pdl``: as a programmatic dependent
        launch (``cuLaunchKernelEx`` with programmatic stream serialization: the kernel may start before the
        previous one on the stream ends and waits for it with ``griddepcontrol.wait``)."""
        if len(args) != len(self.arg_types):
            raise CudaLaunchError(f"kernel takes {len(self.arg_types)} arguments, got {len(args)}")
        values, types = [], []
        for a, t in zip(args, self.arg_types):
            if t.startswith("*"):
                values.append(a.data_ptr() if isinstance(a, torch.Tensor) else int(a))
                types.append(ctypes.c_void_p)
            else:
                values.append(a)
                types.append(_CTYPES[t])
        values += [0, 0]  # global and profile scratch: unused by our kernels
        types += [ctypes.c_void_p, ctypes.c_void_p]
        gx, gy, gz = (*grid, 1, 1)[:3]
        stream = torch.cuda.current_stream().cuda_stream
        params = (tuple(values), tuple(types))
        if pdl:
            _check(self.cu.cuLaunchKernelEx(self._pdl_config(gx, gy, gz, stream), self.func, params, 0),
                   "cuLaunchKernelEx")
            return
        _check(self.cu.cuLaunchKernel(self.func, gx, gy, gz, self.threads, 1, 1, self.shared, stream, params, 0),
               "cuLaunchKernel")

    def _pdl_config(self, gx: int, gy: int, gz: int, stream: int) -> Any:
        """A CUlaunchConfig with the programmatic-stream-serialization attribute (one per launch shape, reused)."""
        key = (gx, gy, gz, stream)
        cfg = self._configs.get(key)
        if cfg is None:
            cu = self.cu
            attr = cu.CUlaunchAttribute()
            attr.id = cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
            attr.value.programmaticStreamSerializationAllowed = 1
            cfg = cu.CUlaunchConfig()
            cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = gx, gy, gz
            cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = self.threads, 1, 1
            cfg.sharedMemBytes = self.shared
            cfg.hStream = cu.CUstream(stream)
            cfg.attrs = [attr]
            cfg.numAttrs = 1
            self._configs[key] = cfg
        return cfg
