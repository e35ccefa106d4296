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
from functions import (  # Exp: the tutorial's Exp, ported
    Exp,
    Identity,
    MulConstantAsWritten,  # a plain class: the tutorial's code, no edit
    Square,
    TanhSavingAStoppedSlope,
)
from gc_functions import LinearFunction  # the tutorial's, ported

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

    from torch_functions import TorchAddOneInPlace, TorchExp

    TorchMulConstant = type("TorchMulConstant", (torch.autograd.Function,), dict(vars(MulConstantAsWritten)))

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
# Their vjpkit ports (Exp and LinearFunction are shared: functions.py, gc_functions.py).


class ReLU(vjpkit.Function):
    @staticmethod
    def forward(ctx, input):
        ctx.save_for_backward(input)
        return jnp.clip(input, min=0)

    @staticmethod
    def backward(ctx, grad_output):
        (input,) = ctx.saved_tensors
        return jnp.where(input < 0, 0.0, grad_output)


MulConstant = vjpkit.function(MulConstantAsWritten)  # the port: no edit


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


class ExpSavingInput(Exp):
    """A typical porting slip: saves the input, which Exp's backward treats as exp(input)."""

    @staticmethod
    def forward(ctx, i):
        ctx.save_for_backward(i)
        return jnp.exp(i)


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


class ExpFirstOrderOnly(Exp):
    """Right first derivative, but backward hides its dependence on the input."""

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


def checkpointed_exp_times_sin(x):
    """A reentrant original: torch's CheckpointFunction refuses torch.autograd.grad."""
    return torch.utils.checkpoint.checkpoint(lambda t: t.exp() * t.sin(), x, use_reentrant=True)


def exp_times_sin(x):
    return jnp.exp(x) * jnp.sin(x)


@needs_torch
def test_a_reentrant_checkpointed_original_matches_its_port():
    assert_matches_torch(checkpointed_exp_times_sin, exp_times_sin, (X,))


@needs_torch
def test_a_reentrant_checkpoints_missing_double_backward_is_blamed_on_pytorch():
    # The reentrant checkpoint recomputes without create_graph: torch's second derivative is zero.
    with pytest.raises(AssertionError, match="agree with vjpkit, not with PyTorch"):
        assert_matches_torch(checkpointed_exp_times_sin, exp_times_sin, (X,), check_second_order=True)


@needs_torch
def test_a_wrong_port_of_a_reentrant_original_is_caught():
    with pytest.raises(AssertionError, match=r"the gradient with respect to input 0 \('x'\)"):
        assert_matches_torch(checkpointed_exp_times_sin, lambda x: jnp.exp(x) * jax.lax.stop_gradient(jnp.sin(x)), (X,))


def test_skips_when_torch_is_not_importable(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)  # import torch now raises ImportError
    with pytest.raises(pytest.skip.Exception, match="needs torch"):
        assert_matches_torch(object, Exp, (X,))


# ---------------------------------------------------------------------------
# Inputs left undifferentiated: needs_input_grad False in both frameworks.


class LinearSlipWithoutInputGrad(vjpkit.Function):
    """Right whenever the input is differentiated; a slip in the weight gradient otherwise."""

    @staticmethod
    def forward(ctx, input, weight, bias):
        ctx.save_for_backward(input, weight)
        return input @ weight.T + bias

    @staticmethod
    def backward(ctx, g):
        input, weight = ctx.saved_tensors
        grad_input = g @ weight if ctx.needs_input_grad[0] else None
        grad_weight = g.T @ input if ctx.needs_input_grad[0] else 2 * g.T @ input
        return grad_input, grad_weight, g.sum(0)


@needs_torch
def test_differentiate_checks_the_paths_where_an_input_needs_no_gradient():
    assert_matches_torch(TorchLinearFunction, LinearSlipWithoutInputGrad, (X, W, B))
    with pytest.raises(AssertionError) as info:
        assert_matches_torch(TorchLinearFunction, LinearSlipWithoutInputGrad, (X, W, B),
                             differentiate=(False, True, True))
    message = str(info.value)
    assert "in 1 place(s)" in message
    assert "the gradient with respect to input 1 ('weight'): 6 of 6 elements differ" in message


@needs_torch
def test_differentiate_false_reaches_torch_as_requires_grad_false():
    seen = []

    class TorchRecordsNeeds(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a, b):
            return a * b

        @staticmethod
        def backward(ctx, g):
            seen.append(tuple(ctx.needs_input_grad))
            return g * 0 if ctx.needs_input_grad[0] else None, None

    assert_matches_torch(TorchRecordsNeeds, lambda a, b: a * jax.lax.stop_gradient(0 * b),
                         (X, X), differentiate=[True, False], atol=np.inf)
    assert seen == [(True, False)]


@needs_torch
def test_differentiate_needs_one_flag_per_input():
    with pytest.raises(ValueError, match=r"differentiate has 2 flag\(s\) for 3 input\(s\); give one bool per input"):
        assert_matches_torch(TorchLinearFunction, LinearFunction, (X, W, B), differentiate=(True, True))


@needs_torch
def test_differentiate_rejects_an_input_that_is_not_a_floating_array():
    with pytest.raises(ValueError, match=r"differentiate\[1\] is True, but input 1 \('constant'\) is a float, "
                                         r"not a floating or complex array"):
        assert_matches_torch(TorchMulConstant, MulConstant, (X, 2.5), differentiate=(True, True))


# ---------------------------------------------------------------------------
# In-place originals (mark_dirty) need no clone wrapper.

class AddOneInPlace(vjpkit.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.mark_dirty(x)
        return x + 1

    @staticmethod
    def backward(ctx, g):
        return g


@needs_torch
def test_an_in_place_original_is_called_on_copies_of_the_inputs():
    x = X.copy()
    assert_matches_torch(TorchAddOneInPlace, AddOneInPlace, (x,), check_second_order=True)
    np.testing.assert_array_equal(x, X)  # the caller's array is untouched


# ---------------------------------------------------------------------------
# Complex numbers: PyTorch's gradient is the conjugate of JAX's.

Z = RNG.standard_normal((3, 2)) + 1j * RNG.standard_normal((3, 2))
Z2 = RNG.standard_normal((3, 2)) + 1j * RNG.standard_normal((3, 2))

if torch is not None:

    class TorchSquare(torch.autograd.Function):
        @staticmethod
        def forward(ctx, z):
            ctx.save_for_backward(z)
            return z * z

        @staticmethod
        def backward(ctx, g):
            (z,) = ctx.saved_tensors
            return g * (2 * z).conj()  # PyTorch's convention: conjugate Wirtinger


# functions.Square's backward follows JAX's convention: the cotangent times the derivative.


class SquareCopiedVerbatim(Square):
    """PyTorch's backward copied as it is: conjugated, so wrong in JAX."""

    @staticmethod
    def backward(ctx, g):
        (z,) = ctx.saved_tensors
        return g * (2 * z).conj()


@needs_torch
def test_identical_complex_outputs_match():
    assert_matches_torch(lambda z, w: z * w.conj(), lambda z, w: z * jnp.conj(w), (Z, Z2))


@needs_torch
def test_complex_outputs_that_differ_are_reported_with_complex_values():
    with pytest.raises(AssertionError) as info:
        assert_matches_torch(lambda z: z * 1j, lambda z: z * 1j + 1e-3, (Z,))
    message = str(info.value)
    assert "- output 0: 6 of 6 elements differ" in message
    assert "j)" in message and "abs diff: 0.001" in message


@needs_torch
def test_a_complex_port_in_jax_convention_matches_pytorch_to_second_order():
    assert_matches_torch(TorchSquare, Square, (Z,), check_second_order=True)


@needs_torch
def test_a_complex_backward_copied_with_pytorchs_conjugation_is_caught():
    with pytest.raises(AssertionError, match=r"the gradient with respect to input 0 \('z'\): 6 of 6 elements differ"):
        assert_matches_torch(TorchSquare, SquareCopiedVerbatim, (Z,))


@needs_torch
def test_a_real_input_with_a_complex_output_matches():
    assert_matches_torch(lambda x, w: x * w, lambda x, w: x * w, (X[:3, :2], Z), check_second_order=True)


# ---------------------------------------------------------------------------
# Second order through a nonlinear function of the outputs, and the verdict.

if torch is not None:

    class TorchTanhSavingOutput(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            y = x.tanh()
            ctx.save_for_backward(y)
            return y

        @staticmethod
        def backward(ctx, g):
            (y,) = ctx.saved_tensors
            return g * (1 - y**2)

    class TorchSinhSavingIntermediates(torch.autograd.Function):
        """pytorch#58509's shape: backward uses intermediates, not outputs."""

        @staticmethod
        def forward(ctx, x):
            expx, expnegx = x.exp(), (-x).exp()
            ctx.save_for_backward(expx, expnegx)
            return (expx - expnegx) / 2

        @staticmethod
        def backward(ctx, g):
            expx, expnegx = ctx.saved_tensors
            return g * (expx + expnegx) / 2


class SinhSavingIntermediates(vjpkit.Function):
    @staticmethod
    def forward(ctx, x):
        expx, expnegx = jnp.exp(x), jnp.exp(-x)
        ctx.save_for_backward(expx, expnegx)
        return (expx - expnegx) / 2

    @staticmethod
    def backward(ctx, g):
        expx, expnegx = ctx.saved_tensors
        return g * (expx + expnegx) / 2


def second_order_mismatch(torch_function, function, inputs):
    """The message of assert_matches_torch's failure to second order."""
    with pytest.raises(AssertionError) as info:
        assert_matches_torch(torch_function, function, inputs, check_second_order=True)
    return str(info.value)


# TanhSavingAStoppedSlope saves an intermediate computed with code that has no derivative; the original
# saves its output.
@needs_torch
def test_second_order_sees_a_saved_intermediates_wrong_derivative():
    message = second_order_mismatch(TorchTanhSavingOutput, TanhSavingAStoppedSlope, (AWAY_FROM_ZERO,))
    assert "the second derivative with respect to input 0 ('x'): 5 of 5 elements differ" in message


@needs_torch
def test_second_order_verdict_names_vjpkit_when_finite_differences_side_with_pytorch():
    message = second_order_mismatch(TorchTanhSavingOutput, TanhSavingAStoppedSlope, (AWAY_FROM_ZERO,))
    assert ("verdict: for the second derivatives with respect to the inputs, finite differences of the first "
            "derivative (central, eps=1e-06, atol=1e-05, rtol=0.001) agree with PyTorch, not with vjpkit: "
            "the port's second derivative is the wrong one.") in message
    assert "stop_gradient" in message and "save the output" in message


@needs_torch
def test_second_order_verdict_names_pytorch_when_its_backward_uses_a_saved_intermediate():
    message = second_order_mismatch(TorchSinhSavingIntermediates, SinhSavingIntermediates, (X,))
    assert "the second derivative with respect to input 0 ('x'): 12 of 12 elements differ" in message
    assert "agree with vjpkit, not with PyTorch: PyTorch's double backward is the wrong one" in message
    assert "intermediate saved in forward" in message and "pytorch#58509" in message
    assert vjpkit.gradgradcheck(SinhSavingIntermediates.apply, (X,))


@needs_torch
def test_second_order_verdict_is_absent_when_second_orders_agree():
    assert_matches_torch(TorchSinhSavingIntermediates, SinhSavingIntermediates, (X,))
    assert_matches_torch(TorchExp, Exp, (X,), check_second_order=True)


class ScaleGradient(Identity):
    @staticmethod
    def backward(ctx, g):
        return 0.5 * g


@needs_torch
def test_gradient_scaling_matches_pytorch_to_second_order():
    # Both take the output's derivative from backward: the Hessian of sin(y) gets the scale twice.
    class TorchScaleGradient(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            return 0.5 * g

    assert_matches_torch(TorchScaleGradient, ScaleGradient, (X,), check_second_order=True)
