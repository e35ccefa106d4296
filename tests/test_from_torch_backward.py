"""``vjpkit.from_torch``: how torch computes the gradients, and gradients delivered by side effect.

By default torch computes them with ``torch.autograd.grad``; with
``reentrant=True`` with ``.backward()`` (no ``inputs``), which PyTorch's
reentrant checkpoint needs. Either way a gradient that the original's own
backward puts into an argument's ``.grad`` (RevTorch's reversible block,
a checkpointed module's parameters) is part of that argument's gradient.
Expected values are ``jax.grad`` of the same maths written in JAX.
"""

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import vjpkit

torch = pytest.importorskip("torch")  # CI installs the torch extra
from torch.utils.checkpoint import CheckpointFunction, checkpoint  # noqa: E402
from torch_functions import TORCH_DEVICE  # noqa: E402

RNG = np.random.default_rng(0)
X = RNG.standard_normal((2, 3))
W = RNG.standard_normal((3, 3))


class TScaleByHeldWeight(torch.autograd.Function):
    """x * holder.w: the weight is no input; backward delivers its gradient into ``holder.w.grad``."""

    @staticmethod
    def forward(ctx, x, holder):
        ctx.save_for_backward(x)
        ctx.holder = holder
        return x * holder.w

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        with torch.enable_grad():
            (x.detach() * ctx.holder.w).backward(g)  # the weight's gradient, by side effect
        return g * ctx.holder.w.detach(), None


def scale_plus_weight(x, w):
    """w's gradient: 1 from the sum, plus what the Function's backward delivers into w.grad."""
    return TScaleByHeldWeight.apply(x, types.SimpleNamespace(w=w)) + w


def checkpointed_layer(x, w):
    return checkpoint(lambda x: torch.tanh(x @ w), x, use_reentrant=True)


def sin_loss(fn):
    return lambda x, w: jnp.sin(fn(x, w)).sum()


def test_gradient_delivered_into_an_arguments_grad_adds_to_torchs_own(x64):
    fn = vjpkit.from_torch(scale_plus_weight)
    got = jax.jit(jax.grad(sin_loss(fn), argnums=(0, 1)))(X, W[0])
    want = jax.grad(sin_loss(lambda x, w: x * w + w), argnums=(0, 1))(X, W[0])
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-12)


def test_reentrant_checkpoint_is_differentiated_through_backward(x64):
    fn = vjpkit.from_torch(checkpointed_layer, reentrant=True)
    got = jax.jit(jax.grad(sin_loss(fn), argnums=(0, 1)))(X, W)
    want = jax.grad(sin_loss(lambda x, w: jnp.tanh(x @ w)), argnums=(0, 1))(X, W)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-12)


def test_reentrant_class_takes_the_option_too(x64):
    Checkpoint = vjpkit.from_torch(CheckpointFunction, reentrant=True)
    got = jax.grad(lambda x: jnp.sin(Checkpoint.apply(torch.tanh, True, x)).sum())(X)
    np.testing.assert_allclose(got, jax.grad(lambda x: jnp.sin(jnp.tanh(x)).sum())(X), rtol=1e-12)


def test_reentrant_original_without_the_option_raises_pointing_to_it(x64):
    fn = vjpkit.from_torch(checkpointed_layer)
    with pytest.raises(RuntimeError, match=r"checkpointed_layer \(torch autograd\) \(PyTorch, run by "
                                           r"vjpkit\.from_torch\) raised RuntimeError: .*\.grad\(\).*\n"
                                           r"checkpointed_layer needs a full \.backward\(\) .*: pass "
                                           r"reentrant=True to vjpkit\.from_torch"):
        jax.block_until_ready(jax.jit(jax.grad(sin_loss(fn)))(X, W))


def test_reentrant_grad_of_grad_clears_each_levels_grad(x64):
    fn = vjpkit.from_torch(lambda x: torch.sin(x) * x, reentrant=True)
    got = jax.jit(jax.grad(lambda x: jax.grad(lambda x: fn(x).sum())(x).sum()))(X[0])
    want = jax.grad(lambda x: jax.grad(lambda x: (jnp.sin(x) * x).sum())(x).sum())(X[0])
    np.testing.assert_allclose(got, want, rtol=1e-12)


def test_reentrant_hessian_by_forward_over_reverse(x64):
    fn = vjpkit.from_torch(lambda x: torch.sin(x) * x, reentrant=True)
    got = jax.jit(jax.hessian(lambda x: fn(x).sum()))(X[0])
    want = jax.hessian(lambda x: (jnp.sin(x) * x).sum())(X[0])
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-15)


def test_by_default_a_closed_over_parameter_gets_no_grad(x64):
    w = torch.tensor(W, requires_grad=True, device=TORCH_DEVICE)  # where the inputs arrive
    fn = vjpkit.from_torch(lambda x: torch.tanh(x @ w))
    jax.block_until_ready(jax.grad(lambda x: fn(x).sum())(X))
    assert w.grad is None


def test_reentrant_a_closed_over_parameter_accumulates_grad_as_under_backward(x64):
    w = torch.tensor(W, requires_grad=True, device=TORCH_DEVICE)  # where the inputs arrive
    fn = vjpkit.from_torch(lambda x: torch.tanh(x @ w), reentrant=True)
    jax.block_until_ready(jax.grad(lambda x: fn(x).sum())(X))
    want = jax.grad(lambda w: jnp.tanh(X @ w).sum())(W)
    np.testing.assert_allclose(w.grad.cpu().numpy(), want, rtol=1e-12)
