"""Launch an artifact's offline-compiled cubins (:class:`CubinKernel`, from :mod:`m3c.backends.cuda_driver`) by
kernel specialization key: no Triton JIT at load."""

from __future__ import annotations

from typing import Any

from m3c.backends.cuda_driver import CubinKernel, CudaLaunchError
from m3c.errors import M3CError

__all__ = ["CubinKernel", "CubinRunner", "CudaLaunchError", "MissingKernelError"]


class MissingKernelError(M3CError, LookupError):
    """A launch asked for a kernel specialization the program was not compiled with."""


class CubinRunner:
    """A :data:`m3c.backends.triton_aot.Runner` over a program's loaded cubins, found by ``spec.key()``."""

    def __init__(self, kernels: dict[str, CubinKernel]) -> None:
        self.kernels = kernels
        self.launches = 0

    def __call__(self, spec: Any, grid: tuple[int, ...], args: Any) -> None:
        """Launch the cubin compiled for `spec` over `grid`."""
        kernel = self.kernels.get(spec.key())
        if kernel is None:
            have = sorted(k for k in self.kernels if k.startswith(spec.family))
            raise MissingKernelError(
                f"the program has no compiled {spec.family} kernel for this launch (key {spec.key()}; it has "
                f"{have or 'none of this family'}); the runtime shapes need a specialization the compile did not "
                "make — recompile the artifact with this m3c version and the cache shapes you run")
        kernel(grid, *args, pdl=getattr(spec, "pdl", False))
        self.launches += 1
