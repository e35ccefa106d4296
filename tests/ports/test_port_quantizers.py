"""Quantizers with straight-through and learned-step gradients.

Originals:
- distiller: IntelLabs/distiller, distiller/quantization/q_utils.py
  (``LinearQuantizeSTE`` with ``linear_quantize``/``linear_dequantize``):
  an in-place option (``ctx.mark_dirty``) and a straight-through backward.
- IR-Net: htqin/IR-Net, CIFAR-10/ResNet20/1w1a/modules/binaryfunction.py
  (``BinaryQuantize``): sign forward, a tanh-shaped estimator in backward,
  two tensor hyperparameters that get no gradient.
- LSQ: hustzxd/LSQuantization, lsq.py (``FunLSQ``), Esser et al.'s learned
  step size quantization: a scale (step) gradient from a straight-through
  rounding.

gradcheck is meaningless for all three: forward is piecewise constant, so
finite differences see zero (or infinite) slopes while backward returns the
estimator by design. Each port is compared with PyTorch, and the estimator
with ``jax.grad`` of the same estimator written with ``stop_gradient``.
"""

import jax
import jax.numpy as jnp
import numpy as np
import torch
from port_checks import assert_jit_grad_matches_torch, assert_vmap_matches_loop

import vjpkit
from vjpkit.testing import assert_matches_torch

RNG = np.random.default_rng(8)
X = RNG.standard_normal((3, 4)) * 2
SCALE, ZERO_POINT = np.array(3.0), np.array(0.5)
K, T = np.array(1.5), np.array(2.0)
STEP = np.array([0.4])


def round_ste(x):
    """round(x) forward, identity backward."""
    return x + jax.lax.stop_gradient(jnp.round(x) - x)


# --- distiller --------------------------------------------------------------


class TorchLinearQuantizeSTE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input, scale, zero_point, dequantize, inplace):
        if inplace:
            ctx.mark_dirty(input)
            output = input.mul_(scale).sub_(zero_point).round_()
            if dequantize:
                output = output.add_(zero_point).div_(scale)
            return output
        output = torch.round(scale * input - zero_point)
        return (output + zero_point) / scale if dequantize else output

    @staticmethod
    def backward(ctx, grad_output):
        return grad_output, None, None, None, None


class LinearQuantizeSTE(vjpkit.Function):
    @staticmethod
    def forward(ctx, input, scale, zero_point, dequantize, inplace):
        if inplace:
            ctx.mark_dirty(input)  # forward returns the new value; the caller's array is unchanged
        output = jnp.round(scale * input - zero_point)
        return (output + zero_point) / scale if dequantize else output

    @staticmethod
    def backward(ctx, grad_output):
        return grad_output, None, None, None, None


def test_linear_quantize_ste_matches_pytorch_in_place_and_not():
    for dequantize in (True, False):
        for inplace in (True, False):
            assert_matches_torch(TorchLinearQuantizeSTE, LinearQuantizeSTE,
                                 (X, SCALE, ZERO_POINT, dequantize, inplace),
                                 differentiate=(True, False, False, False, False))


def test_linear_quantize_ste_gradient_is_the_straight_through_estimator(x64):
    x = jnp.asarray(X)
    got = jax.grad(lambda x: jnp.sum(jnp.sin(LinearQuantizeSTE.apply(x, SCALE, ZERO_POINT, True, False))))(x)
    want = jax.grad(lambda x: jnp.sum(jnp.sin((round_ste(SCALE * x - ZERO_POINT) + ZERO_POINT) / SCALE)))(x)
    np.testing.assert_allclose(got, want, rtol=1e-12)


def test_linear_quantize_ste_under_jit_grad_and_vmap():
    assert_jit_grad_matches_torch(TorchLinearQuantizeSTE, LinearQuantizeSTE, (X, SCALE, ZERO_POINT, True, True))
    assert_vmap_matches_loop(LinearQuantizeSTE, (X, SCALE, ZERO_POINT, True, True), (0, None, None, None, None))


# --- IR-Net -----------------------------------------------------------------


class TorchBinaryQuantize(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input, k, t):
        ctx.save_for_backward(input, k, t)
        return torch.sign(input)

    @staticmethod
    def backward(ctx, grad_output):
        input, k, t = ctx.saved_tensors
        return k * t * (1 - torch.pow(torch.tanh(input * t), 2)) * grad_output, None, None


class BinaryQuantize(vjpkit.Function):
    @staticmethod
    def forward(ctx, input, k, t):
        ctx.save_for_backward(input, k, t)
        return jnp.sign(input)

    @staticmethod
    def backward(ctx, grad_output):
        input, k, t = ctx.saved_tensors
        return k * t * (1 - jnp.tanh(input * t) ** 2) * grad_output, None, None


def test_binary_quantize_matches_pytorch():
    assert_matches_torch(TorchBinaryQuantize, BinaryQuantize, (X, K, T), differentiate=(True, False, False))
    assert_matches_torch(TorchBinaryQuantize, BinaryQuantize, (X, K, T))  # k, t: None in both


def test_binary_quantize_gradient_is_the_tanh_estimator(x64):
    x = jnp.asarray(X)
    got = jax.grad(lambda x: jnp.sum(BinaryQuantize.apply(x, K, T)))(x)
    want = jax.grad(lambda x: jnp.sum(K * jnp.tanh(x * T)))(x)
    np.testing.assert_allclose(got, want, rtol=1e-9)


def test_binary_quantize_under_jit_grad_and_vmap():
    assert_jit_grad_matches_torch(TorchBinaryQuantize, BinaryQuantize, (X, K, T))
    assert_vmap_matches_loop(BinaryQuantize, (X, K, T), (0, None, None))


# --- LSQ --------------------------------------------------------------------


class TorchFunLSQ(torch.autograd.Function):
    @staticmethod
    def forward(ctx, weight, alpha, g, Qn, Qp):
        assert alpha > 0, f"alpha = {alpha}"
        ctx.save_for_backward(weight, alpha)
        ctx.other = g, Qn, Qp
        return (weight / alpha).round().clamp(Qn, Qp) * alpha

    @staticmethod
    def backward(ctx, grad_weight):
        weight, alpha = ctx.saved_tensors
        g, Qn, Qp = ctx.other
        q_w = weight / alpha
        small, big = (q_w < Qn).to(q_w.dtype), (q_w > Qp).to(q_w.dtype)
        middle = 1.0 - small - big
        grad_alpha = ((small * Qn + big * Qp + middle * (-q_w + q_w.round())) * grad_weight * g).sum().unsqueeze(0)
        return middle * grad_weight, grad_alpha, None, None, None


class FunLSQ(vjpkit.Function):
    @staticmethod
    def forward(ctx, weight, alpha, g, Qn, Qp):
        # `assert alpha > 0` reads a traced value: not possible while tracing (see docs/porting.md).
        ctx.save_for_backward(weight, alpha)
        ctx.other = g, Qn, Qp  # Python numbers: static
        return jnp.clip(jnp.round(weight / alpha), Qn, Qp) * alpha

    @staticmethod
    def backward(ctx, grad_weight):
        weight, alpha = ctx.saved_tensors
        g, Qn, Qp = ctx.other
        q_w = weight / alpha
        small, big = (q_w < Qn).astype(q_w.dtype), (q_w > Qp).astype(q_w.dtype)
        middle = 1.0 - small - big
        grad_alpha = ((small * Qn + big * Qp + middle * (jnp.round(q_w) - q_w)) * grad_weight * g).sum()[None]
        return middle * grad_weight, grad_alpha, None, None, None


LSQ_ARGS = (X, STEP, 1 / np.sqrt(X.size * 7), -4, 3)  # 3-bit signed: Qn=-4, Qp=3; g = 1/sqrt(N Qp) as LSQ suggests


def test_lsq_matches_pytorch_with_a_step_gradient():
    assert_matches_torch(TorchFunLSQ, FunLSQ, LSQ_ARGS)
    assert_matches_torch(TorchFunLSQ, FunLSQ, LSQ_ARGS, differentiate=(False, True, False, False, False))


def test_lsq_step_gradient_is_the_straight_through_rounding_one(x64):
    _, alpha, g, Qn, Qp = LSQ_ARGS
    w, a = jnp.asarray(X), jnp.asarray(alpha)
    loss = lambda f: lambda w, a: jnp.sum(jnp.sin(f(w, a)))  # noqa: E731
    got = jax.grad(loss(lambda w, a: FunLSQ.apply(w, a, g, Qn, Qp)), argnums=(0, 1))(w, a)
    # LSQ's estimator: round straight through, the step's gradient scaled by g.
    scaled = lambda a: a * g + jax.lax.stop_gradient(a - a * g)  # noqa: E731
    want = jax.grad(loss(lambda w, a: jnp.clip(round_ste(w / scaled(a)), Qn, Qp) * scaled(a)),
                    argnums=(0, 1))(w, a)
    for x, y in zip(got, want, strict=True):
        np.testing.assert_allclose(x, y, rtol=1e-10, atol=1e-12)


def test_lsq_under_jit_grad_and_vmap():
    assert_jit_grad_matches_torch(TorchFunLSQ, FunLSQ, LSQ_ARGS, argnums=(0, 1))
    assert_vmap_matches_loop(FunLSQ, LSQ_ARGS, (0, None, None, None, None), argnums=(0, 1))


# ---------------------------------------------------------------------------
# The originals run unported through vjpkit.from_torch, beside their ports
# (tests/ports/test_ports_from_torch.py collects every module's list).

FROM_TORCH_CASES = [
    # The in-place variant (mark_dirty) needs from_torch(..., copy_inputs=True): see test_from_torch.py.
    dict(original=TorchLinearQuantizeSTE, port=LinearQuantizeSTE, args=(X, SCALE, ZERO_POINT, True, False),
         argnums=(0,), in_axes=(0, None, None, None, None)),
    dict(original=TorchBinaryQuantize, port=BinaryQuantize, args=(X, K, T), argnums=(0,), in_axes=(0, None, None)),
    dict(original=TorchFunLSQ, port=FunLSQ, args=LSQ_ARGS, argnums=(0, 1), in_axes=(0, None, None, None, None)),
]
