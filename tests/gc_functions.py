"""Functions the gradcheck, testing and CLI tests check (importable as ``gc_functions``)."""

import numpy as np
from functions import (
    Exp,  # noqa: F401  (re-exported: the gradcheck, testing and CLI tests use gc_functions.Exp)
    Linear,
)

import vjpkit


class LinearFunction(vjpkit.Function):
    """The PyTorch tutorial's LinearFunction, ported as the tutorial writes it (with setup_context)."""

    @staticmethod
    def forward(input, weight, bias=None):
        output = input @ weight.T
        return output if bias is None else output + bias

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs)

    @staticmethod
    def backward(ctx, grad_output):
        input, weight, bias = ctx.saved_tensors
        grad_input = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_input = grad_output @ weight
        if ctx.needs_input_grad[1]:
            grad_weight = grad_output.T @ input
        if bias is not None and ctx.needs_input_grad[2]:
            grad_bias = grad_output.sum(0)
        return grad_input, grad_weight, grad_bias


class ScaledLinearFunction(Linear):
    """LinearFunction without bias whose weight gradient is 1.1 times too large (forward is Linear's)."""

    @staticmethod
    def backward(ctx, grad_output):
        input, weight = ctx.saved_tensors
        return grad_output @ weight, 1.1 * (grad_output.T @ input)


class HostRowScale(vjpkit.Function):
    """sin(x) * w in NumPy (host=True): x (rows, n), w (n,); w's gradient is broadcast and summed down."""

    host = True

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return np.sin(x) * w

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        return g * np.cos(x) * w, g * np.sin(x)


def square(x):
    """A plain JAX function: the command line checks any function of arrays."""
    return x * x


NOT_A_FUNCTION = 3
