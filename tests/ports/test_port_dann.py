"""DANN's gradient reversal layer: identity forward, gradient times -alpha.

Original: fungtion/DANN, models/functions.py (``ReverseLayerF``), the
gradient reversal of Ganin & Lempitsky's domain-adversarial training.
Pattern: gradient reversal with a static option.
"""

import numpy as np
import torch
from port_checks import assert_jit_grad_matches_torch, assert_vmap_matches_loop

import vjpkit
from vjpkit.testing import assert_matches_torch

RNG = np.random.default_rng(1)
X = RNG.standard_normal((5, 2))


class TorchReverseLayerF(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, alpha):
        ctx.alpha = alpha
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad_output):
        return grad_output.neg() * ctx.alpha, None


class ReverseLayerF(vjpkit.Function):
    @staticmethod
    def forward(ctx, x, alpha):
        ctx.alpha = alpha
        return x  # view_as: JAX arrays have no identity to keep apart

    @staticmethod
    def backward(ctx, grad_output):
        return -grad_output * ctx.alpha, None


def test_reverse_layer_matches_pytorch():
    assert_matches_torch(TorchReverseLayerF, ReverseLayerF, (X, 0.7))


def test_reverse_layer_matches_pytorch_to_second_order():
    assert_matches_torch(TorchReverseLayerF, ReverseLayerF, (X, 0.7), check_second_order=True)


def test_reverse_layer_under_jit_grad_and_vmap():
    assert_jit_grad_matches_torch(TorchReverseLayerF, ReverseLayerF, (X, 0.7))
    assert_vmap_matches_loop(ReverseLayerF, (X, 0.7), (0, None))


# ---------------------------------------------------------------------------
# The originals run unported through vjpkit.from_torch, beside their ports
# (tests/ports/test_ports_from_torch.py collects every module's list).

FROM_TORCH_CASES = [
    dict(original=TorchReverseLayerF, port=ReverseLayerF, args=(X, 0.7), second_order=True, in_axes=(0, None)),
]
