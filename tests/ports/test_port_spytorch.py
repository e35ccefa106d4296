"""SpyTorch's SuperSpike surrogate: its steepness is a class attribute.

Original: fzenke/spytorch, notebooks/SpyTorchTutorial2.ipynb
(``SurrGradSpike`` with ``scale = 100.0``), the surrogate-gradient tutorial
of Zenke & Ganguli's SuperSpike, copied into many SNN projects. Pattern: a
class-level hyperparameter read in ``backward`` (``SurrGradSpike.scale``),
set by users between experiments; boolean-mask assignment in forward.

vjpkit runs ``backward`` when it traces, so a class attribute is read once
per compiled program: a later ``SurrGradSpike.scale = 10.0`` does not reach
programs already compiled. The port reads the attribute when it is
*called* and passes it as a static argument, so each value gets its own
program, as the cookbook's surrogate-gradient section shows.
"""

import jax
import jax.numpy as jnp
import numpy as np
import torch
from port_checks import assert_jit_grad_matches_torch, assert_vmap_matches_loop

import vjpkit
from vjpkit.testing import assert_matches_torch

RNG = np.random.default_rng(25)
X = RNG.standard_normal((3, 5)) * 0.1


class TorchSurrGradSpike(torch.autograd.Function):
    """
    Here we implement our spiking nonlinearity which also implements
    the surrogate gradient. By subclassing torch.autograd.Function,
    we will be able to use all of PyTorch's autograd functionality.
    Here we use the normalized negative part of a fast sigmoid
    as this was done in Zenke & Ganguli (2018).
    """

    scale = 100.0  # controls steepness of surrogate gradient

    @staticmethod
    def forward(ctx, input):
        ctx.save_for_backward(input)
        out = torch.zeros_like(input)
        out[input > 0] = 1.0
        return out

    @staticmethod
    def backward(ctx, grad_output):
        input, = ctx.saved_tensors
        grad_input = grad_output.clone()
        grad = grad_input / (TorchSurrGradSpike.scale * torch.abs(input) + 1.0) ** 2
        return grad


class SurrGradSpike(vjpkit.Function):
    scale = 100.0  # controls steepness of surrogate gradient; read by spike_fn at each call

    @staticmethod
    def forward(ctx, input, scale):
        ctx.save_for_backward(input)
        ctx.scale = scale
        return jnp.where(input > 0, 1.0, 0.0).astype(input.dtype)

    @staticmethod
    def backward(ctx, grad_output):
        input, = ctx.saved_tensors
        return grad_output / (ctx.scale * jnp.abs(input) + 1.0) ** 2, None


def spike_fn(x):
    return SurrGradSpike.apply(x, SurrGradSpike.scale)  # the attribute's value now, a static key


def torch_spike_fn(x):
    return TorchSurrGradSpike.apply(x)


FROM_TORCH_CASES = [dict(original=TorchSurrGradSpike, port=spike_fn, args=(X,), second_order=False)]


def test_surr_grad_spike_matches_pytorch():
    assert_matches_torch(torch_spike_fn, spike_fn, (X,))


def torch_surrogate(scale):
    t = torch.tensor(X, requires_grad=True)
    TorchSurrGradSpike.apply(t).sum().backward()
    assert TorchSurrGradSpike.scale == scale
    return t.grad.numpy()


def test_a_new_class_attribute_value_reaches_the_gradient_like_pytorch(monkeypatch):
    for scale in (100.0, 10.0):
        monkeypatch.setattr(SurrGradSpike, "scale", scale)
        monkeypatch.setattr(TorchSurrGradSpike, "scale", scale)
        got = jax.grad(lambda x: spike_fn(x).sum())(jnp.asarray(X))
        np.testing.assert_allclose(got, torch_surrogate(scale), rtol=1e-6)


def test_an_outer_jit_keeps_the_value_it_traced_with(monkeypatch):
    grad = jax.jit(jax.grad(lambda x: spike_fn(x).sum()))
    x = jnp.asarray(X)
    before = grad(x)
    monkeypatch.setattr(SurrGradSpike, "scale", 10.0)  # read while tracing: this jit never traces again
    np.testing.assert_array_equal(grad(x), before)
    np.testing.assert_allclose(before, 1 / (100.0 * np.abs(X) + 1.0) ** 2, rtol=1e-6)


def test_surr_grad_spike_under_jit_grad_and_vmap():
    assert_jit_grad_matches_torch(torch_spike_fn, spike_fn, (X,))
    assert_vmap_matches_loop(spike_fn, (X,), (0,))
