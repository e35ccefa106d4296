"""``vjpkit.testing.assert_matches_torch``: PyTorch's tutorial Functions and
their vjpkit ports agree on outputs, gradients and second derivatives; a
wrong port is caught with a report naming what differs. CI installs torch's
CPU wheel (the ``torch`` extra); without torch these tests skip, except the
one that checks the skip itself.
"""

import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import vjpkit
from vjpkit.testing import assert_matches_torch

try:
    import torch
except ImportError:  # torch is never a dependency of vjpkit
    torch = None

needs_torch = pytest.mark.skipif(torch is None, reason="torch is not installed")

RNG = np.random.default_rng(0)
X = RNG.standard_normal((4, 3))
W = RNG.standard_normal((2, 3))
B = RNG.standard_normal(2)
AWAY_FROM_ZERO = np.array([-2.0, -0.5, 0.25, 1.5, 3.0])  # relu's kink is not sampled


# ---------------------------------------------------------------------------
# The PyTorch tutorial Functions, as the tutorial writes them.

if torch is not None:

    class TorchReLU(torch.autograd.Function):
        @staticmethod
        def forward(ctx, input):
            ctx.save_for_backward(input)
            return input.clamp(min=0)

        @staticmethod
        def backward(ctx, grad_output):
            (input,) = ctx.saved_tensors
            grad_input = grad_output.clone()
            grad_input[input < 0] = 0
            return grad_input

    class TorchExp(torch.autograd.Function):
        @staticmethod
        def forward(ctx, i):
            result = i.exp()
            ctx.save_for_backward(result)
            return result

        @staticmethod
        def backward(ctx, grad_output):
            (result,) = ctx.saved_tensors
            return grad_output * result

    class TorchMulConstant(torch.autograd.Function):
        @staticmethod
        def forward(tensor, constant):
            return tensor * constant

        @staticmethod
        def setup_context(ctx, inputs, output):
            _, constant = inputs
            ctx.constant = constant

        @staticmethod
        def backward(ctx, grad_output):
            return grad_output * ctx.constant, None

    class TorchLinearFunction(torch.autograd.Function):
        @staticmethod
        def forward(input, weight, bias):
            output = input.mm(weight.t())
            if bias is not None:
                output += bias.unsqueeze(0).expand_as(output)
            return output

        @staticmethod
        def setup_context(ctx, inputs, output):
            input, weight, bias = inputs
            ctx.save_for_backward(input, weight, bias)

        @staticmethod
        def backward(ctx, grad_output):
            input, weight, bias = ctx.saved_tensors
            grad_input = grad_weight = grad_bias = None
            if ctx.needs_input_grad[0]:
                grad_input = grad_output.mm(weight)
            if ctx.needs_input_grad[1]:
                grad_weight = grad_output.t().mm(input)
            if bias is not None and ctx.needs_input_grad[2]:
                grad_bias = grad_output.sum(0)
            return grad_input, grad_weight, grad_bias


# ---------------------------------------------------------------------------
# Their vjpkit ports.


class ReLU(vjpkit.Function):
    @staticmethod
    def forward(ctx, input):
        ctx.save_for_backward(input)
        return jnp.clip(input, min=0)

    @staticmethod
    def backward(ctx, grad_output):
        (input,) = ctx.saved_tensors
        return jnp.where(input < 0, 0.0, grad_output)


class Exp(vjpkit.Function):
    @staticmethod
    def forward(ctx, i):
        result = jnp.exp(i)
        ctx.save_for_backward(result)
        return result

    @staticmethod
    def backward(ctx, grad_output):
        (result,) = ctx.saved_tensors
        return grad_output * result


class MulConstant(vjpkit.Function):
    @staticmethod
    def forward(tensor, constant):
        return tensor * constant

    @staticmethod
    def setup_context(ctx, inputs, output):
        _, constant = inputs
        ctx.constant = constant

    @staticmethod
    def backward(ctx, grad_output):
        return grad_output * ctx.constant, None


class LinearFunction(vjpkit.Function):
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


# ---------------------------------------------------------------------------
# Faithful ports match.


@needs_torch
def test_relu_port_matches_pytorch():
    assert_matches_torch(TorchReLU, ReLU, (AWAY_FROM_ZERO,), check_second_order=True)


@needs_torch
def test_exp_port_matches_pytorch_to_second_order():
    assert_matches_torch(TorchExp, Exp, (X,), check_second_order=True)


@needs_torch
def test_mul_constant_port_matches_pytorch_with_a_static_constant():
    assert_matches_torch(TorchMulConstant, MulConstant, (X, 2.5), check_second_order=True)


@needs_torch
def test_linear_function_port_matches_pytorch_with_bias():
    assert_matches_torch(TorchLinearFunction, LinearFunction, (X, W, B), check_second_order=True)


@needs_torch
def test_linear_function_port_matches_pytorch_without_bias():
    assert_matches_torch(TorchLinearFunction, LinearFunction, (X, W, None), check_second_order=True)


@needs_torch
def test_explicit_grad_outputs_are_used_for_both():
    assert_matches_torch(TorchExp, Exp, (X,), grad_outputs=[np.ones_like(X)])


@needs_torch
def test_float32_inputs_are_compared_in_float64():
    assert_matches_torch(TorchExp, Exp, (X.astype(np.float32),), rtol=1e-12, atol=0.0)


# ---------------------------------------------------------------------------
# Wrong ports are caught, with a report.


class ExpSavingInput(vjpkit.Function):
    """A typical porting slip: saves the input, then treats it as exp(input)."""

    @staticmethod
    def forward(ctx, i):
        ctx.save_for_backward(i)
        return jnp.exp(i)

    @staticmethod
    def backward(ctx, grad_output):
        (result,) = ctx.saved_tensors
        return grad_output * result


@needs_torch
def test_a_wrong_backward_is_caught_naming_the_input():
    with pytest.raises(AssertionError) as info:
        assert_matches_torch(TorchExp, ExpSavingInput, (X,))
    message = str(info.value)
    assert "the port ExpSavingInput does not match TorchExp (PyTorch) in 1 place(s)" in message
    assert "the gradient with respect to input 0 ('i'): 12 of 12 elements differ" in message
    assert "worst: element (" in message and "torch:" in message and "vjpkit:" in message


class LinearWithoutBias(vjpkit.Function):
    """Drops the bias in forward and in backward: self-consistent, so gradcheck passes."""

    @staticmethod
    def forward(ctx, input, weight, bias=None):
        ctx.save_for_backward(input, weight)
        return input @ weight.T

    @staticmethod
    def backward(ctx, grad_output):
        input, weight = ctx.saved_tensors
        return grad_output @ weight, grad_output.T @ input, None


@needs_torch
def test_a_self_consistent_but_wrong_port_is_caught_where_gradcheck_is_not():
    assert vjpkit.gradcheck(LinearWithoutBias.apply, (X, W, B))
    with pytest.raises(AssertionError) as info:
        assert_matches_torch(TorchLinearFunction, LinearWithoutBias, (X, W, B))
    message = str(info.value)
    assert "in 2 place(s)" in message
    assert "- output 0: 8 of 8 elements differ" in message
    assert "- the gradient with respect to input 2 ('bias'): 2 of 2 elements differ" in message


class ExpFirstOrderOnly(vjpkit.Function):
    """Right first derivative, but backward hides its dependence on the input."""

    @staticmethod
    def forward(ctx, i):
        result = jnp.exp(i)
        ctx.save_for_backward(result)
        return result

    @staticmethod
    def backward(ctx, grad_output):
        (result,) = ctx.saved_tensors
        return grad_output * jax.lax.stop_gradient(result)


@needs_torch
def test_a_wrong_second_derivative_is_caught_only_when_asked():
    assert_matches_torch(TorchExp, ExpFirstOrderOnly, (X,))
    with pytest.raises(AssertionError, match=r"the second derivative with respect to input 0 \('i'\)"):
        assert_matches_torch(TorchExp, ExpFirstOrderOnly, (X,), check_second_order=True)


@needs_torch
def test_an_output_count_mismatch_is_reported():
    class TwoOutputs(vjpkit.Function):
        @staticmethod
        def forward(ctx, i):
            return jnp.exp(i), i

        @staticmethod
        def backward(ctx, g1, g2):
            return g1 + g2

    with pytest.raises(AssertionError, match=r"TorchExp returned 1 output\(s\), the port TwoOutputs returned 2"):
        assert_matches_torch(TorchExp, TwoOutputs, (X,))


def test_skips_when_torch_is_not_importable(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)  # import torch now raises ImportError
    with pytest.raises(pytest.skip.Exception, match="needs torch"):
        assert_matches_torch(object, Exp, (X,))
