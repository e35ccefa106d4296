"""SpikingJelly's sigmoid surrogate spike: saves only when a gradient is needed.

Original: fangwei123456/spikingjelly,
spikingjelly/activation_based/surrogate.py (``sigmoid``, with
``heaviside`` and ``sigmoid_backward``; ``Sigmoid(alpha=4.0)`` is the
module that calls it). Pattern: ``if x.requires_grad:`` around
``save_for_backward`` becomes ``ctx.needs_input_grad``; a backward helper
that returns the ``(grad, None)`` tuple itself.

SpikingJelly wraps ``heaviside`` and ``sigmoid_backward`` in
``@torch.jit.script``, deprecated since PyTorch 2.9 (a
``DeprecationWarning``); the copy leaves the decorator off, with the same
results.
"""

import jax
import jax.numpy as jnp
import numpy as np
import torch
from port_checks import assert_jit_grad_matches_torch, assert_vmap_matches_loop

import vjpkit
from vjpkit.testing import assert_matches_torch

RNG = np.random.default_rng(24)
X = np.concatenate([RNG.standard_normal(7), [0.0]])  # heaviside(0) = 1 here, unlike snntorch's


def torch_heaviside(x: torch.Tensor):
    return (x >= 0).to(x)


def torch_sigmoid_backward(grad_output: torch.Tensor, x: torch.Tensor, alpha: float):
    sgax = (x * alpha).sigmoid_()
    return grad_output * (1. - sgax) * sgax * alpha, None


class TorchSigmoid(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, alpha):
        if x.requires_grad:
            ctx.save_for_backward(x)
            ctx.alpha = alpha
        return torch_heaviside(x)

    @staticmethod
    def backward(ctx, grad_output):
        return torch_sigmoid_backward(grad_output, ctx.saved_tensors[0], ctx.alpha)


def heaviside(x):
    return (x >= 0).astype(x.dtype)  # .to(x): x's dtype


def sigmoid_backward(grad_output, x, alpha):
    sgax = jax.nn.sigmoid(x * alpha)
    return grad_output * (1. - sgax) * sgax * alpha, None


class Sigmoid(vjpkit.Function):
    @staticmethod
    def forward(ctx, x, alpha):
        if ctx.needs_input_grad[0]:  # x.requires_grad: True exactly when JAX differentiates x
            ctx.save_for_backward(x)
            ctx.alpha = alpha
        return heaviside(x)

    @staticmethod
    def backward(ctx, grad_output):
        return sigmoid_backward(grad_output, ctx.saved_tensors[0], ctx.alpha)


FROM_TORCH_CASES = [dict(original=TorchSigmoid, port=Sigmoid, args=(X, 4.0), second_order=False)]


def test_sigmoid_spike_matches_pytorch():
    assert_matches_torch(TorchSigmoid, Sigmoid, (X, 4.0))


def test_sigmoid_spike_saves_nothing_when_not_differentiated():
    # Plain evaluation sees needs_input_grad False, as PyTorch sees requires_grad False.
    assert Sigmoid.apply(jnp.asarray(X), 4.0).tolist() == TorchSigmoid.apply(torch.tensor(X), 4.0).tolist()


def test_sigmoid_surrogate_is_the_sigmoid_derivative():
    x = jnp.asarray(X)
    got = jax.grad(lambda x: Sigmoid.apply(x, 4.0).sum())(x)
    np.testing.assert_allclose(got, jax.vmap(jax.grad(lambda u: jax.nn.sigmoid(4.0 * u)))(x), rtol=1e-6)


def test_sigmoid_spike_under_jit_grad_and_vmap():
    assert_jit_grad_matches_torch(TorchSigmoid, Sigmoid, (X, 4.0))
    assert_vmap_matches_loop(Sigmoid, (X.reshape(2, 4), 4.0), (0, None))
