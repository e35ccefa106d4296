"""vjpkit: PyTorch-style custom autograd Functions for JAX.

Write a class with ``forward(ctx, ...)`` and ``backward(ctx, *grad_outputs)``
as in ``torch.autograd.Function``; vjpkit turns it into a jit-compiled
``jax.custom_vjp`` function that works under every JAX transformation.
"""

from ._anomaly import detect_anomaly
from ._ctx import FunctionCtx
from ._function import CacheInfo, Function, function
from ._gradcheck import GradcheckError, gradcheck, gradgradcheck
from ._once import once_differentiable
from . import testing
from . import cpp_extension

__all__ = [
    "CacheInfo",
    "Function",
    "FunctionCtx",
    "GradcheckError",
    "cpp_extension",
    "detect_anomaly",
    "function",
    "gradcheck",
    "gradgradcheck",
    "once_differentiable",
    "testing",
]
