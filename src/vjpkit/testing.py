"""Gradient checks that read well in a test suite.

The key difference to calling ``vjpkit.gradcheck`` directly is that a
failure is an ``AssertionError`` carrying the full report (the mismatching
output and input, the worst element, both Jacobians), so a test runner shows
it as a test failure with the report as its message. None of these needs
pytest: they work in any test runner, or none. ``assert_matches_torch``,
``assert_port_matches_original`` and ``port_differences`` compare a port
with its PyTorch original, and need torch.

Examples:
    A test module's tests, here called directly:

    >>> import vjpkit
    >>> from vjpkit.testing import assert_gradcheck, random_inputs
    >>> class Linear(vjpkit.Function):
    ...     @staticmethod
    ...     def forward(ctx, x, w):
    ...         ctx.save_for_backward(x, w)
    ...         return x @ w.T
    ...
    ...     @staticmethod
    ...     def backward(ctx, g):
    ...         x, w = ctx.saved_tensors
    ...         return g @ w, g.T @ x
    >>> def test_linear_gradients():
    ...     x, w = random_inputs("f64[4,3] f64[2,3]")
    ...     assert_gradcheck(Linear.apply, (x, w))
    >>> test_linear_gradients()  # passes: no output, no exception
"""

from ._checking.assertions import assert_gradcheck, assert_gradgradcheck
from ._checking.port_check import assert_port_matches_original, port_differences
from ._checking.random_inputs import random_inputs
from ._checking.torch_parity import assert_matches_torch

__all__ = [
    "assert_gradcheck",
    "assert_gradgradcheck",
    "assert_matches_torch",
    "assert_port_matches_original",
    "port_differences",
    "random_inputs",
]
