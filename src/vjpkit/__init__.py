"""vjpkit: PyTorch-style custom autograd Functions for JAX.

Write a class with ``forward(ctx, ...)`` and ``backward(ctx, *grad_outputs)``
as in ``torch.autograd.Function``; vjpkit turns it into a jit-compiled
``jax.custom_vjp`` function that works under every JAX transformation.
"""

from importlib import metadata as _metadata

from . import cpp_extension, testing
from ._anomaly import detect_anomaly
from ._caches import clear_caches
from ._checking import GradcheckError, JacobianMismatch, gradcheck, gradgradcheck
from ._ctx import FunctionCtx
from ._function import CacheInfo, Function, function
from ._host import VmapInfo
from ._once import once_differentiable
from ._torch import from_torch

try:
    __version__: str = _metadata.version("vjpkit")
except _metadata.PackageNotFoundError:  # run from a source tree that was never installed
    __version__ = "0+unknown"

__all__ = [
    "CacheInfo",
    "Function",
    "FunctionCtx",
    "GradcheckError",
    "JacobianMismatch",
    "VmapInfo",
    "clear_caches",
    "cpp_extension",
    "detect_anomaly",
    "from_torch",
    "function",
    "gradcheck",
    "gradgradcheck",
    "once_differentiable",
    "testing",
]
