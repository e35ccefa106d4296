"""torch-ngp's truncated exponential: exp forward, a clamped exp backward.

Original: ashawkey/torch-ngp, activation.py (``_trunc_exp``), copied into
nerfstudio and NeMo as the density activation of instant-NGP models.
Pattern: ``custom_fwd(cast_inputs=torch.float32)`` / ``custom_bwd``, which
cast only inside an autocast region; the port casts nothing.

torch-ngp spells the decorators ``torch.cuda.amp.custom_fwd``, which
PyTorch 2.4 deprecated (a ``FutureWarning``) for
``torch.amp.custom_fwd(device_type="cuda", ...)``: the copy below uses the
current spelling, with the same meaning.
"""

import jax
import jax.numpy as jnp
import numpy as np
import torch
from port_checks import assert_jit_grad_matches_torch, assert_vmap_matches_loop

import vjpkit
from vjpkit.testing import assert_gradgradcheck, assert_matches_torch

RNG = np.random.default_rng(21)
X = np.concatenate([RNG.standard_normal(6), [-20.0, 16.0, 30.0]])  # beyond the clamp at +-15 too


class TorchTruncExp(torch.autograd.Function):
    @staticmethod
    @torch.amp.custom_fwd(device_type="cuda", cast_inputs=torch.float32)
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return torch.exp(x)

    @staticmethod
    @torch.amp.custom_bwd(device_type="cuda")
    def backward(ctx, g):
        x = ctx.saved_tensors[0]
        return g * torch.exp(x.clamp(-15, 15))


class TruncExp(vjpkit.Function):
    # custom_fwd(cast_inputs=...) casts only under autocast, which JAX has not: nothing to port.
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return jnp.exp(x)

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g * jnp.exp(jnp.clip(x, -15, 15))


FROM_TORCH_CASES = [dict(original=TorchTruncExp, port=TruncExp, args=(X,), second_order=True)]


def test_trunc_exp_matches_pytorch_to_second_order():
    assert_matches_torch(TorchTruncExp, TruncExp, (X,), check_second_order=True)


def test_trunc_exp_gradient_is_clamped_beyond_fifteen():
    got = jax.grad(lambda x: TruncExp.apply(x).sum())(jnp.array([16.0, 30.0]))
    np.testing.assert_allclose(got, [np.exp(15.0), np.exp(15.0)], rtol=1e-6)


def test_trunc_exp_keeps_half_precision_like_the_original_outside_autocast():
    x = np.array([0.5, -1.0], np.float16)
    torch_y = TorchTruncExp.apply(torch.tensor(x))  # no autocast region: custom_fwd casts nothing
    y = TruncExp.apply(jnp.asarray(x))
    assert torch_y.dtype == torch.float16 and y.dtype == jnp.float16
    np.testing.assert_allclose(np.asarray(y, np.float32), torch_y.float().numpy(), rtol=1e-3)


def test_trunc_exp_gradgradcheck_inside_the_clamp():
    assert_gradgradcheck(TruncExp.apply, (X[:6],))


def test_trunc_exp_under_jit_grad_and_vmap():
    assert_jit_grad_matches_torch(TorchTruncExp, TruncExp, (X[:6],))
    assert_vmap_matches_loop(TruncExp, (X.reshape(3, 3),), (0,))
