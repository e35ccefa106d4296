"""NAFNet's channel LayerNorm for NCHW images, with a hand-written backward.

Original: megvii-research/NAFNet, basicsr/models/archs/arch_util.py
(``LayerNormFunction``, behind ``LayerNorm2d``). Patterns: a custom
normalization backward; shape reads (``N, C, H, W = x.size()``) that must
become axis-relative for ``vmap``; ``ctx.saved_variables``; a static
``eps``; and a backward that uses saved *intermediates* (the normalized
``y`` and ``var``), so PyTorch's own second derivative is wrong
(pytorch#58509) while the port's is right.
"""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from port_checks import assert_jit_grad_matches_torch, assert_vmap_matches_loop

import vjpkit
from vjpkit.testing import assert_gradcheck, assert_gradgradcheck, assert_matches_torch

RNG = np.random.default_rng(7)
X = RNG.standard_normal((2, 3, 2, 2))
WEIGHT = RNG.standard_normal(3)
BIAS = RNG.standard_normal(3)


class TorchLayerNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, eps):
        ctx.eps = eps
        N, C, H, W = x.size()
        mu = x.mean(1, keepdim=True)
        var = (x - mu).pow(2).mean(1, keepdim=True)
        y = (x - mu) / (var + eps).sqrt()
        ctx.save_for_backward(y, var, weight)
        return weight.view(1, C, 1, 1) * y + bias.view(1, C, 1, 1)

    @staticmethod
    def backward(ctx, grad_output):
        eps = ctx.eps
        N, C, H, W = grad_output.size()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            y, var, weight = ctx.saved_variables  # as the original; deprecated
        g = grad_output * weight.view(1, C, 1, 1)
        mean_g = g.mean(dim=1, keepdim=True)
        mean_gy = (g * y).mean(dim=1, keepdim=True)
        gx = 1.0 / torch.sqrt(var + eps) * (g - y * mean_gy - mean_g)
        return gx, (grad_output * y).sum(dim=(0, 2, 3)), grad_output.sum(dim=(0, 2, 3)), None


class LayerNormFunction(vjpkit.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, eps):
        ctx.eps = eps
        C = x.shape[-3]  # not `N, C, H, W = x.shape`: under vmap forward sees (C, H, W)
        mu = x.mean(-3, keepdims=True)
        var = ((x - mu) ** 2).mean(-3, keepdims=True)
        y = (x - mu) / jnp.sqrt(var + eps)
        ctx.save_for_backward(y, var, weight)
        return weight.reshape(C, 1, 1) * y + bias.reshape(C, 1, 1)

    @staticmethod
    def backward(ctx, grad_output):
        C = grad_output.shape[-3]
        y, var, weight = ctx.saved_tensors
        g = grad_output * weight.reshape(C, 1, 1)
        mean_g = g.mean(-3, keepdims=True)
        mean_gy = (g * y).mean(-3, keepdims=True)
        gx = (g - y * mean_gy - mean_g) / jnp.sqrt(var + ctx.eps)
        # Every axis but the channel one: the batch axis, when there is one, and H, W.
        others = tuple(a for a in range(grad_output.ndim) if a != grad_output.ndim - 3)
        return gx, (grad_output * y).sum(others), grad_output.sum(others), None


class LayerNormSavedVariables(LayerNormFunction):
    """The original's ``ctx.saved_variables``, unchanged."""

    @staticmethod
    def backward(ctx, grad_output):
        y, var, weight = ctx.saved_variables
        C = grad_output.shape[-3]
        g = grad_output * weight.reshape(C, 1, 1)
        gx = (g - y * (g * y).mean(-3, keepdims=True) - g.mean(-3, keepdims=True)) / jnp.sqrt(var + ctx.eps)
        others = tuple(a for a in range(grad_output.ndim) if a != grad_output.ndim - 3)
        return gx, (grad_output * y).sum(others), grad_output.sum(others), None


def test_layer_norm_matches_pytorch():
    assert_matches_torch(TorchLayerNormFunction, LayerNormFunction, (X, WEIGHT, BIAS, 1e-6))


def test_layer_norm_second_order_differs_and_pytorch_is_the_wrong_one():
    with pytest.raises(AssertionError) as info:
        assert_matches_torch(TorchLayerNormFunction, LayerNormFunction, (X, WEIGHT, BIAS, 1e-6),
                             check_second_order=True)
    assert "agree with vjpkit, not with PyTorch: PyTorch's double backward is the wrong one" in str(info.value)
    assert_gradgradcheck(LayerNormFunction.apply, (X, WEIGHT, BIAS, 1e-6))


def test_layer_norm_gradcheck():
    assert_gradcheck(LayerNormFunction.apply, (X, WEIGHT, BIAS, 1e-6))


def test_layer_norm_under_jit_grad_and_vmap():
    assert_jit_grad_matches_torch(TorchLayerNormFunction, LayerNormFunction, (X, WEIGHT, BIAS, 1e-6),
                                  argnums=(0, 1, 2))
    # vmap over the batch: forward sees one (C, H, W) image, backward sums each example's weight gradient.
    assert_vmap_matches_loop(LayerNormFunction, (X, WEIGHT, BIAS, 1e-6), (0, None, None, None), argnums=(0, 1, 2))


def test_layer_norm_with_saved_variables_matches_pytorch():
    # PyTorch warns that saved_variables is deprecated; vjpkit warns the same way.
    with pytest.warns(DeprecationWarning, match="saved_variables"):
        assert_matches_torch(TorchLayerNormFunction, LayerNormSavedVariables, (X, WEIGHT, BIAS, 1e-6))


def test_layer_norm_batch_shape_read_breaks_under_vmap():
    class ReadsFourAxes(vjpkit.Function):
        @staticmethod
        def forward(ctx, x):
            N, C, H, W = x.shape
            return x

        @staticmethod
        def backward(ctx, g):
            return g

    with pytest.raises(ValueError, match="not enough values to unpack"):
        jax.vmap(ReadsFourAxes.apply)(jnp.ones((2, 3, 2, 2)))


# ---------------------------------------------------------------------------
# The originals run unported through vjpkit.from_torch, beside their ports
# (tests/ports/test_ports_from_torch.py collects every module's list).

FROM_TORCH_CASES = [
    # Second order differs: PyTorch's double backward is the wrong one (see above). Not under vmap:
    # the original indexes its batch axis, which a per-example call has not got.
    dict(original=TorchLayerNormFunction, port=LayerNormFunction, args=(X, WEIGHT, BIAS, 1e-6)),
]
