"""A GraphCast-style loss: latitude- and variable-weighted mean squared error.

After google-deepmind/graphcast, graphcast/losses.py
(``weighted_mse_per_level`` and ``normalized_latitude_weights``): squared
errors on a latitude/longitude grid, weighted by the cosine of latitude
normalized to mean 1, averaged over the grid and summed over variables with
per-variable weights. GraphCast writes it in JAX with autodiff; here it is
a PyTorch Function with a hand-written backward, as a PyTorch port of the
loss would be, and its vjpkit port. Pattern: a loss with non-tensor options
(a tuple of per-variable weights), a non-differentiated tensor input.
"""

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from port_checks import assert_jit_grad_matches_torch, assert_vmap_matches_loop

import vjpkit
from vjpkit.testing import assert_gradcheck, assert_gradgradcheck, assert_matches_torch

RNG = np.random.default_rng(11)
PRED = RNG.standard_normal((3, 5, 8))  # variables, latitudes, longitudes
TARGET = RNG.standard_normal((3, 5, 8))
LATITUDES = np.linspace(-80.0, 80.0, 5)
VARIABLE_WEIGHTS = (1.0, 0.1, 0.5)


class TorchWeightedMSE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, pred, target, latitudes, variable_weights):
        lat_w = torch.cos(torch.deg2rad(latitudes))
        lat_w = (lat_w / lat_w.mean())[:, None]
        w = torch.tensor(variable_weights, dtype=pred.dtype, device=pred.device)[:, None, None]
        ctx.save_for_backward(pred - target, lat_w, w)
        return (w * lat_w * (pred - target) ** 2).mean(dim=(-2, -1)).sum()

    @staticmethod
    def backward(ctx, g):
        diff, lat_w, w = ctx.saved_tensors
        grad = g * 2 * w * lat_w * diff / (diff.shape[-2] * diff.shape[-1])
        return grad, -grad, None, None


class WeightedMSE(vjpkit.Function):
    @staticmethod
    def forward(ctx, pred, target, latitudes, variable_weights):
        lat_w = jnp.cos(jnp.deg2rad(latitudes))
        lat_w = (lat_w / lat_w.mean())[:, None]
        w = jnp.asarray(variable_weights, pred.dtype)[:, None, None]  # a static tuple becomes a constant
        ctx.save_for_backward(pred - target, lat_w, w)
        return (w * lat_w * (pred - target) ** 2).mean(axis=(-2, -1)).sum()

    @staticmethod
    def backward(ctx, g):
        diff, lat_w, w = ctx.saved_tensors
        grad = g * 2 * w * lat_w * diff / (diff.shape[-2] * diff.shape[-1])
        return grad, -grad, None, None


ARGS = (PRED, TARGET, LATITUDES, VARIABLE_WEIGHTS)


def test_weighted_mse_matches_pytorch():
    assert_matches_torch(TorchWeightedMSE, WeightedMSE, ARGS, differentiate=(True, True, False, False))


def test_weighted_mse_second_order_differs_and_pytorch_is_the_wrong_one():
    # backward uses the saved intermediate pred - target, a constant to PyTorch's double backward.
    with pytest.raises(AssertionError, match="agree with vjpkit, not with PyTorch"):
        assert_matches_torch(TorchWeightedMSE, WeightedMSE, ARGS, differentiate=(True, True, False, False),
                             check_second_order=True)


def test_weighted_mse_gradcheck():
    assert_gradcheck(lambda p, t: WeightedMSE.apply(p, t, LATITUDES, VARIABLE_WEIGHTS), (PRED, TARGET))
    assert_gradgradcheck(lambda p, t: WeightedMSE.apply(p, t, LATITUDES, VARIABLE_WEIGHTS), (PRED, TARGET))


def test_weighted_mse_under_jit_grad_and_vmap():
    assert_jit_grad_matches_torch(TorchWeightedMSE, WeightedMSE, ARGS, argnums=(0, 1))
    batch = (np.stack([PRED, PRED * 2]), np.stack([TARGET, -TARGET]), LATITUDES, VARIABLE_WEIGHTS)
    assert_vmap_matches_loop(WeightedMSE, batch, (0, 0, None, None), argnums=(0, 1))


# ---------------------------------------------------------------------------
# The originals run unported through vjpkit.from_torch, beside their ports
# (tests/ports/test_ports_from_torch.py collects every module's list).

FROM_TORCH_CASES = [
    # Second order differs: PyTorch's double backward is the wrong one (see above).
    dict(original=TorchWeightedMSE, port=WeightedMSE, args=ARGS, argnums=(0, 1),
         vmap_args=(np.stack([PRED, PRED * 2]), np.stack([TARGET, -TARGET]), LATITUDES, VARIABLE_WEIGHTS),
         in_axes=(0, 0, None, None)),
]
