"""EfficientNet-PyTorch's memory-efficient Swish: saves the input only.

Original: lukemelas/EfficientNet-PyTorch, efficientnet_pytorch/utils.py
(``SwishImplementation``, behind ``MemoryEfficientSwish``). Autodiff would
keep ``sigmoid(x)``; this keeps ``x`` and recomputes the sigmoid in backward.
Pattern: a memory-efficient activation saving its input.
"""

import contextlib
import io

import jax
import jax.ad_checkpoint
import jax.numpy as jnp
import numpy as np
import torch
from port_checks import assert_jit_grad_matches_torch, assert_vmap_matches_loop

import vjpkit
from vjpkit.testing import assert_gradcheck, assert_gradgradcheck, assert_matches_torch

RNG = np.random.default_rng(2)
X = RNG.standard_normal((3, 4)) * 3


class TorchSwishImplementation(torch.autograd.Function):
    @staticmethod
    def forward(ctx, i):
        result = i * torch.sigmoid(i)
        ctx.save_for_backward(i)
        return result

    @staticmethod
    def backward(ctx, grad_output):
        i = ctx.saved_tensors[0]
        sigmoid_i = torch.sigmoid(i)
        return grad_output * (sigmoid_i * (1 + i * (1 - sigmoid_i)))


class SwishImplementation(vjpkit.Function):
    @staticmethod
    def forward(ctx, i):
        ctx.save_for_backward(i)
        return i * jax.nn.sigmoid(i)

    @staticmethod
    def backward(ctx, grad_output):
        (i,) = ctx.saved_tensors
        sigmoid_i = jax.nn.sigmoid(i)
        return grad_output * (sigmoid_i * (1 + i * (1 - sigmoid_i)))


def test_swish_matches_pytorch_to_second_order():
    assert_matches_torch(TorchSwishImplementation, SwishImplementation, (X,), check_second_order=True)


def test_swish_gradcheck_and_gradgradcheck():
    assert_gradcheck(SwishImplementation.apply, (X,))
    assert_gradgradcheck(SwishImplementation.apply, (X,))


def test_swish_under_jit_grad_and_vmap():
    assert_jit_grad_matches_torch(TorchSwishImplementation, SwishImplementation, (X,))
    assert_vmap_matches_loop(SwishImplementation, (X,), (0,))


def test_swish_keeps_one_residual_the_input():
    # JAX's own account of what a VJP keeps (the same report on every JAX version).
    report = io.StringIO()
    with contextlib.redirect_stdout(report):
        jax.ad_checkpoint.print_saved_residuals(SwishImplementation.apply, jnp.ones(3))
    assert report.getvalue().splitlines() == ["f32[3] from the argument args[0]"]


# ---------------------------------------------------------------------------
# The originals run unported through vjpkit.from_torch, beside their ports
# (tests/ports/test_ports_from_torch.py collects every module's list).

FROM_TORCH_CASES = [
    dict(original=TorchSwishImplementation, port=SwishImplementation, args=(X,), second_order=True, in_axes=(0,)),
]
