"""snntorch's arc-tangent surrogate spike: a step forward, a smooth slope backward.

Original: jeshraghian/snntorch, snntorch/surrogate.py (``ATan`` and its
closure ``atan(alpha)``). Pattern: a surrogate gradient for a Heaviside
step, its hyperparameter a Python float carried on ctx; ``.float()`` on a
boolean; an in-place ``pow_`` on a temporary.
"""

import jax
import jax.numpy as jnp
import numpy as np
import torch
from port_checks import assert_jit_grad_matches_torch, assert_vmap_matches_loop

import vjpkit
from vjpkit.testing import assert_matches_torch

RNG = np.random.default_rng(23)
MEM = RNG.standard_normal((3, 4))


class TorchATan(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_, alpha):
        ctx.save_for_backward(input_)
        ctx.alpha = alpha
        out = (input_ > 0).float()
        return out

    @staticmethod
    def backward(ctx, grad_output):
        (input_,) = ctx.saved_tensors
        grad_input = grad_output.clone()
        grad = (
            ctx.alpha
            / 2
            / (1 + (torch.pi / 2 * ctx.alpha * input_).pow_(2))
            * grad_input
        )
        return grad, None


def torch_atan(alpha=2.0):
    """ArcTan surrogate gradient enclosed with a parameterized slope."""
    def inner(x):
        return TorchATan.apply(x, alpha)
    return inner


class ATan(vjpkit.Function):
    @staticmethod
    def forward(ctx, input_, alpha):
        ctx.save_for_backward(input_)
        ctx.alpha = alpha  # a Python float: static, one program per value
        return (input_ > 0).astype(jnp.float32)  # .float(): float32, as in PyTorch

    @staticmethod
    def backward(ctx, grad_output):
        (input_,) = ctx.saved_tensors
        grad = ctx.alpha / 2 / (1 + (jnp.pi / 2 * ctx.alpha * input_) ** 2) * grad_output
        return grad, None


def atan(alpha=2.0):
    """ArcTan surrogate gradient enclosed with a parameterized slope."""
    def inner(x):
        return ATan.apply(x, alpha)
    return inner


FROM_TORCH_CASES = [dict(original=TorchATan, port=ATan, args=(MEM, 2.0), second_order=False)]


def test_atan_spikes_and_surrogate_gradient_match_pytorch():
    assert_matches_torch(torch_atan(3.0), atan(3.0), (MEM,))


def test_atan_spike_is_float32_like_pytorchs_float():
    assert TorchATan.apply(torch.tensor(MEM), 2.0).dtype == torch.float32
    assert ATan.apply(jnp.asarray(MEM, jnp.float32), 2.0).dtype == jnp.float32


def test_atan_surrogate_is_the_arctan_derivative():
    x = jnp.linspace(-1.0, 1.0, 5)
    got = jax.grad(lambda x: atan(2.0)(x).sum())(x)
    want = jax.vmap(jax.grad(lambda u: jnp.arctan(jnp.pi / 2 * 2.0 * u) / jnp.pi))(x)
    np.testing.assert_allclose(got, want, rtol=1e-6)


def test_atan_under_jit_grad_and_vmap():
    # The spikes are float32 in both (.float()), so the loss's cos(spike) is float32-rounded.
    assert_jit_grad_matches_torch(TorchATan, ATan, (MEM, 2.0), rtol=1e-6)
    assert_vmap_matches_loop(ATan, (MEM, 2.0), (0, None))
