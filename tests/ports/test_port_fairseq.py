"""fairseq's GradMultiply: identity forward, gradient scaled by a Python float.

Original: facebookresearch/fairseq, fairseq/modules/grad_multiply.py
(``GradMultiply``), used to scale the gradient reaching a shared module.
Pattern: gradient scaling with a static (non-tensor) option.
"""

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from port_checks import assert_jit_grad_matches_torch, assert_vmap_matches_loop

import vjpkit
from vjpkit.testing import assert_gradcheck, assert_matches_torch

RNG = np.random.default_rng(0)
X = RNG.standard_normal((4, 3))


class TorchGradMultiply(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scale):
        ctx.scale = scale
        return x.new(x)  # a new tensor sharing nothing with x's graph

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale, None


class GradMultiply(vjpkit.Function):
    @staticmethod
    def forward(ctx, x, scale):
        ctx.scale = scale  # a Python float: static, part of the compile key
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale, None


def test_grad_multiply_matches_pytorch():
    assert_matches_torch(TorchGradMultiply, GradMultiply, (X, 0.25))


def test_grad_multiply_matches_pytorch_to_second_order():
    assert_matches_torch(TorchGradMultiply, GradMultiply, (X, 0.25), check_second_order=True)


def test_grad_multiply_gradcheck_sees_the_intended_scale():
    # gradcheck compares with finite differences of forward (scale 1): only scale=1 passes.
    assert_gradcheck(lambda x: GradMultiply.apply(x, 1.0), (X,))
    with pytest.raises(AssertionError, match="Jacobian mismatch"):
        assert_gradcheck(lambda x: GradMultiply.apply(x, 0.25), (X,))


def test_grad_multiply_under_jit_grad_and_vmap():
    assert_jit_grad_matches_torch(TorchGradMultiply, GradMultiply, (X, 0.25))
    assert_vmap_matches_loop(GradMultiply, (X, 0.25), (0, None))
    assert GradMultiply.apply(jnp.ones(2), 3.0).tolist() == [1.0, 1.0]


# ---------------------------------------------------------------------------
# The originals run unported through vjpkit.from_torch, beside their ports
# (tests/ports/test_ports_from_torch.py collects every module's list).

FROM_TORCH_CASES = [
    dict(original=TorchGradMultiply, port=GradMultiply, args=(X, 0.25), second_order=True, in_axes=(0, None)),
]
