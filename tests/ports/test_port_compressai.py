"""CompressAI's lower bound: max(x, bound) whose gradient lets x climb back.

Original: InterDigitalInc/CompressAI, compressai/ops/bound_ops.py
(``LowerBoundFunction``, used by ``LowerBound`` in GDN and the entropy
bottleneck's likelihood floor). Pattern: a gradient passed where the
forward was flat, chosen by the sign of the incoming gradient; a tensor
``bound`` that gets no gradient.
"""

import jax
import jax.numpy as jnp
import numpy as np
import torch
from port_checks import assert_jit_grad_matches_torch, assert_vmap_matches_loop

import vjpkit
from vjpkit.testing import assert_matches_torch

RNG = np.random.default_rng(22)
X = RNG.standard_normal((4, 5))
BOUND = np.array(0.1)


class TorchLowerBoundFunction(torch.autograd.Function):
    """Autograd function for the `LowerBound` operator."""

    @staticmethod
    def forward(ctx, input_, bound):
        ctx.save_for_backward(input_, bound)
        return torch.max(input_, bound)

    @staticmethod
    def backward(ctx, grad_output):
        input_, bound = ctx.saved_tensors
        pass_through_if = (input_ >= bound) | (grad_output < 0)
        return pass_through_if * grad_output, None


class LowerBoundFunction(vjpkit.Function):
    """Autograd function for the `LowerBound` operator."""

    @staticmethod
    def forward(ctx, input_, bound):
        ctx.save_for_backward(input_, bound)
        return jnp.maximum(input_, bound)

    @staticmethod
    def backward(ctx, grad_output):
        input_, bound = ctx.saved_tensors
        pass_through_if = (input_ >= bound) | (grad_output < 0)
        return pass_through_if * grad_output, None


FROM_TORCH_CASES = [dict(original=TorchLowerBoundFunction, port=LowerBoundFunction, args=(X, BOUND),
                         second_order=False)]


def test_lower_bound_matches_pytorch():
    assert_matches_torch(TorchLowerBoundFunction, LowerBoundFunction, (X, BOUND),
                         differentiate=(True, False))


def test_lower_bound_passes_a_gradient_that_raises_x_below_the_bound():
    x = jnp.array([-1.0, -1.0, 1.0])
    _, pullback = jax.vjp(lambda x: LowerBoundFunction.apply(x, jnp.asarray(0.0)), x)
    (gx,) = pullback(jnp.array([-2.0, 3.0, 3.0]))  # descent on -2 raises x: passed; on +3 below the bound: blocked
    assert gx.tolist() == [-2.0, 0.0, 3.0]


def test_lower_bound_bound_gets_no_gradient_even_when_asked():
    gb = jax.grad(lambda b: LowerBoundFunction.apply(jnp.asarray(X), b).sum())(jnp.asarray(BOUND))
    assert gb == 0.0


def test_lower_bound_under_jit_grad_and_vmap():
    assert_jit_grad_matches_torch(TorchLowerBoundFunction, LowerBoundFunction, (X, BOUND))
    assert_vmap_matches_loop(LowerBoundFunction, (X, BOUND), (0, None))
