"""Perturbed top-k: a differentiable top-k from Gaussian noise drawn in forward.

Original: the PyTorch ``PerturbedTopKFunction`` of Cordonnier et al.'s
"Differentiable Patch Selection for Image Recognition" (Berthet et al.'s
perturbed optimizers), as copied in rapanti/adversarial-dino-stn,
diff_patch_selection/perturbed_topk.py and many patch-selection projects.
Patterns: randomness in forward (``torch.normal``), the same noise reused in
backward (``ctx.noise``), tensors stashed as ctx attributes instead of
``save_for_backward``, ``one_hot(...).float()``.

The port follows the cookbook's recipe: the noise comes from a key argument
(``jax.random.normal(key, ...)``), and backward redraws the same noise from
the same key instead of keeping it. To compare with PyTorch, the tests hand
the original the port's noise through ``torch.normal`` (``vjpkit.from_torch``
runs the original inside a ``TorchFunctionMode`` that does so).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from torch.overrides import TorchFunctionMode

import vjpkit

# jax.enable_x64 or its older home. Not the x64 fixture: a fixture draws float64 noise for a test
# that runs in float32.
from vjpkit._jax_internals import enable_x64
from vjpkit.testing import assert_matches_torch

RNG = np.random.default_rng(29)
X = RNG.standard_normal((2, 6))
K, NUM_SAMPLES, SIGMA = 2, 20, 0.5


class TorchPerturbedTopKFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, k: int, num_samples: int = 1000, sigma: float = 0.05):
        b, d = x.shape
        # for Gaussian: noise and gradient are the same.
        noise = torch.normal(mean=0.0, std=1.0, size=(b, num_samples, d)).to(x.device)

        perturbed_x = x[:, None, :] + noise * sigma  # b, nS, d
        topk_results = torch.topk(perturbed_x, k=k, dim=-1, sorted=False)
        indices = topk_results.indices  # b, nS, k
        indices = torch.sort(indices, dim=-1).values  # b, nS, k

        # b, nS, k, d
        perturbed_output = torch.nn.functional.one_hot(indices, num_classes=d).float()
        indicators = perturbed_output.mean(dim=1)  # b, k, d

        # constants for backward
        ctx.k = k
        ctx.num_samples = num_samples
        ctx.sigma = sigma

        # tensors for backward
        ctx.perturbed_output = perturbed_output
        ctx.noise = noise

        return indicators

    @staticmethod
    def backward(ctx, grad_output):
        if grad_output is None:
            return tuple([None] * 5)

        noise_gradient = ctx.noise
        expected_gradient = (
            torch.einsum("bnkd,bnd->bkd", ctx.perturbed_output, noise_gradient)
            / ctx.num_samples
            / ctx.sigma
        )
        grad_input = torch.einsum("bkd,bkd->bd", grad_output, expected_gradient)
        return (grad_input,) + tuple([None] * 5)


def perturbed_topk_one_hot(x, noise, k, sigma):
    """The sorted top-k indices of each perturbed copy of x, one-hot: (..., nS, k, d)."""
    perturbed_x = x[..., None, :] + noise * sigma
    _, indices = jax.lax.top_k(perturbed_x, k)
    return jax.nn.one_hot(jnp.sort(indices, axis=-1), x.shape[-1], dtype=jnp.float32)  # .float()


class PerturbedTopKFunction(vjpkit.Function):
    @staticmethod
    def forward(ctx, x, key, k, num_samples=1000, sigma=0.05):
        # torch.normal(...) in forward -> a key argument; the shape from the end, so vmap can add axes.
        noise = jax.random.normal(key, (*x.shape[:-1], num_samples, x.shape[-1]), x.dtype)
        ctx.save_for_backward(x, key)
        ctx.k, ctx.num_samples, ctx.sigma = k, num_samples, sigma
        return perturbed_topk_one_hot(x, noise, k, sigma).mean(axis=-3)

    @staticmethod
    def backward(ctx, grad_output):
        x, key = ctx.saved_tensors
        noise = jax.random.normal(key, (*x.shape[:-1], ctx.num_samples, x.shape[-1]), x.dtype)  # the same draw
        perturbed_output = perturbed_topk_one_hot(x, noise, ctx.k, ctx.sigma)
        expected_gradient = jnp.einsum("...nkd,...nd->...kd", perturbed_output, noise) / ctx.num_samples / ctx.sigma
        return jnp.einsum("...kd,...kd->...d", grad_output, expected_gradient), None, None, None, None


KEY = jax.random.key(0)
with enable_x64(True):  # the noise the port draws from KEY for X
    NOISE = np.asarray(jax.random.normal(KEY, (*X.shape[:-1], NUM_SAMPLES, X.shape[-1]), jnp.float64))


class PortsNoise(TorchFunctionMode):
    """Inside it, torch.normal returns the port's noise (in float32, as torch.normal draws it: the
    original's einsum mixes it with a float32 one-hot); every other torch call runs as it is."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.normal:
            return torch.tensor(NOISE, dtype=torch.float32)
        return func(*args, **(kwargs or {}))


def torch_perturbed_topk_with_the_ports_noise(x):
    """The original, its forward and backward as published, drawing the port's noise from torch.normal.

    From torch's global generator it would draw new noise on every run, and from_torch runs forward
    again to differentiate: the gradient would belong to other noise than the output.
    """
    with PortsNoise():
        return TorchPerturbedTopKFunction.apply(x, K, NUM_SAMPLES, SIGMA)


def perturbed_topk(x):
    return PerturbedTopKFunction.apply(x, KEY, K, NUM_SAMPLES, SIGMA)


FROM_TORCH_CASES = [dict(original=torch_perturbed_topk_with_the_ports_noise, port=perturbed_topk, args=(X,),
                         atol=1e-5)]


@pytest.fixture
def same_noise(monkeypatch):
    """Makes the original's torch.normal return the noise the port draws from KEY."""
    monkeypatch.setattr(torch, "normal", lambda mean, std, size: torch.tensor(NOISE, dtype=torch.float32))


def test_perturbed_topk_matches_pytorch_given_the_same_noise(same_noise):
    assert_matches_torch(lambda x: TorchPerturbedTopKFunction.apply(x, K, NUM_SAMPLES, SIGMA),
                         lambda x: PerturbedTopKFunction.apply(x, KEY, K, NUM_SAMPLES, SIGMA), (X,),
                         rtol=1e-5, atol=1e-6)


def test_perturbed_topk_same_key_same_output_new_key_new_noise():
    x = jnp.asarray(X, jnp.float32)
    a = PerturbedTopKFunction.apply(x, KEY, K, NUM_SAMPLES, SIGMA)
    assert jnp.array_equal(a, PerturbedTopKFunction.apply(x, KEY, K, NUM_SAMPLES, SIGMA))
    assert not jnp.array_equal(a, PerturbedTopKFunction.apply(x, jax.random.key(1), K, NUM_SAMPLES, SIGMA))


def test_perturbed_topk_backward_uses_the_forward_noise(x64):
    # The original's estimator: d indicators[k, d] / d x[d] = mean_n(one_hot[n, k, d] * Z[n, d]) / sigma,
    # with forward's Z (only that diagonal: x[e] for e != d gets nothing).
    x = jnp.asarray(X[0])
    noise = jax.random.normal(KEY, (NUM_SAMPLES, X.shape[-1]), jnp.float64)
    jac = jax.jacrev(lambda x: PerturbedTopKFunction.apply(x, KEY, K, NUM_SAMPLES, SIGMA))(x)
    diagonal = np.asarray((perturbed_topk_one_hot(x, noise, K, SIGMA) * noise[:, None, :]).mean(0) / SIGMA)
    np.testing.assert_allclose(jac, diagonal[:, :, None] * np.eye(X.shape[-1]), rtol=1e-6, atol=1e-12)


def test_perturbed_topk_under_jit_grad_and_vmap_with_a_key_per_example(x64):
    keys = jax.random.split(KEY, len(X))
    x = jnp.asarray(X)

    def loss(x, key):
        return jnp.sin(PerturbedTopKFunction.apply(x, key, K, NUM_SAMPLES, SIGMA)).sum()

    batched = jax.jit(jax.vmap(jax.grad(loss)))(x, keys)
    for b in range(len(X)):
        np.testing.assert_allclose(batched[b], jax.grad(loss)(x[b], keys[b]), rtol=1e-10)
