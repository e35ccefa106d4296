"""timm's memory-efficient activations: Mish, HardSigmoid, HardSwish.

Original: huggingface/pytorch-image-models, timm/layers/activations_me.py
(``MishAutoFn``, ``HardSigmoidAutoFn``, ``HardSwishAutoFn`` with their
``*_fwd``/``*_bwd`` helpers). Each saves the input and recomputes in
backward. Patterns: memory-efficient activations; ``F.softplus`` (its
``beta``/``threshold`` form); piecewise backward masks.
"""

import jax
import jax.numpy as jnp
import numpy as np
import torch
import torch.nn.functional as F
from port_checks import assert_jit_grad_matches_torch, assert_vmap_matches_loop

import vjpkit
from vjpkit.testing import assert_gradcheck, assert_gradgradcheck, assert_matches_torch

RNG = np.random.default_rng(3)
X = RNG.standard_normal((3, 5)) * 3
AWAY_FROM_KINKS = np.array([-4.5, -3.5, -2.5, -1.0, 0.5, 2.0, 2.9, 3.2, 5.0])  # kinks at -3 and 3


def softplus(x, beta=1.0, threshold=20.0):
    """``F.softplus(x, beta, threshold)``: linear where ``beta * x > threshold``."""
    return jnp.where(beta * x > threshold, x, jnp.logaddexp(beta * x, 0.0) / beta)


class TorchMishAutoFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x.mul(torch.tanh(F.softplus(x)))

    @staticmethod
    def backward(ctx, grad_output):
        x = ctx.saved_tensors[0]
        x_sigmoid = torch.sigmoid(x)
        x_tanh_sp = F.softplus(x).tanh()
        return grad_output.mul(x_tanh_sp + x * x_sigmoid * (1 - x_tanh_sp * x_tanh_sp))


class MishAutoFn(vjpkit.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * jnp.tanh(softplus(x))

    @staticmethod
    def backward(ctx, grad_output):
        (x,) = ctx.saved_tensors
        x_sigmoid = jax.nn.sigmoid(x)
        x_tanh_sp = jnp.tanh(softplus(x))
        return grad_output * (x_tanh_sp + x * x_sigmoid * (1 - x_tanh_sp * x_tanh_sp))


class TorchHardSigmoidAutoFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return (x + 3).clamp(min=0, max=6).div(6.0)

    @staticmethod
    def backward(ctx, grad_output):
        x = ctx.saved_tensors[0]
        m = torch.ones_like(x) * ((x >= -3.0) & (x <= 3.0)) / 6.0
        return grad_output * m


class HardSigmoidAutoFn(vjpkit.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return jnp.clip(x + 3, 0, 6) / 6.0

    @staticmethod
    def backward(ctx, grad_output):
        (x,) = ctx.saved_tensors
        return grad_output * jnp.where((x >= -3.0) & (x <= 3.0), 1 / 6.0, 0.0)


class TorchHardSwishAutoFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * (x + 3).clamp(min=0, max=6).div(6.0)

    @staticmethod
    def backward(ctx, grad_output):
        x = ctx.saved_tensors[0]
        m = torch.ones_like(x) * (x >= 3.0)
        m = torch.where((x >= -3.0) & (x <= 3.0), x / 3.0 + 0.5, m)
        return grad_output * m


class HardSwishAutoFn(vjpkit.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * jnp.clip(x + 3, 0, 6) / 6.0

    @staticmethod
    def backward(ctx, grad_output):
        (x,) = ctx.saved_tensors
        m = jnp.where(x >= 3.0, 1.0, 0.0)
        m = jnp.where((x >= -3.0) & (x <= 3.0), x / 3.0 + 0.5, m)
        return grad_output * m


def test_softplus_helper_matches_torch_beta_and_threshold(x64):
    x = np.linspace(-30, 30, 61)
    got = softplus(jnp.asarray(x), beta=2.0, threshold=10.0)
    np.testing.assert_allclose(got, F.softplus(torch.tensor(x), beta=2.0, threshold=10.0).numpy(), rtol=1e-12)


def test_mish_matches_pytorch_to_second_order():
    assert_matches_torch(TorchMishAutoFn, MishAutoFn, (X,), check_second_order=True)


def test_mish_gradcheck_and_gradgradcheck():
    assert_gradcheck(MishAutoFn.apply, (X,))
    assert_gradgradcheck(MishAutoFn.apply, (X,))


def test_hard_sigmoid_and_hard_swish_match_pytorch_to_second_order():
    assert_matches_torch(TorchHardSigmoidAutoFn, HardSigmoidAutoFn, (AWAY_FROM_KINKS,), check_second_order=True)
    assert_matches_torch(TorchHardSwishAutoFn, HardSwishAutoFn, (AWAY_FROM_KINKS,), check_second_order=True)


def test_hard_sigmoid_and_hard_swish_gradcheck():
    assert_gradcheck(HardSigmoidAutoFn.apply, (AWAY_FROM_KINKS,))
    assert_gradcheck(HardSwishAutoFn.apply, (AWAY_FROM_KINKS,))


def test_timm_activations_under_jit_grad_and_vmap():
    for torch_fn, port in [(TorchMishAutoFn, MishAutoFn), (TorchHardSwishAutoFn, HardSwishAutoFn)]:
        assert_jit_grad_matches_torch(torch_fn, port, (X,))
        assert_vmap_matches_loop(port, (X,), (0,))


# ---------------------------------------------------------------------------
# The originals run unported through vjpkit.from_torch, beside their ports
# (tests/ports/test_ports_from_torch.py collects every module's list).

FROM_TORCH_CASES = [
    dict(original=TorchMishAutoFn, port=MishAutoFn, args=(X,), second_order=True, in_axes=(0,)),
    dict(original=TorchHardSigmoidAutoFn, port=HardSigmoidAutoFn, args=(AWAY_FROM_KINKS,), second_order=True,
         in_axes=(0,)),
    dict(original=TorchHardSwishAutoFn, port=HardSwishAutoFn, args=(AWAY_FROM_KINKS,), second_order=True,
         in_axes=(0,)),
]
