"""maskrcnn-benchmark helpers: an empty-tensor op and the sigmoid focal loss.

Originals: facebookresearch/maskrcnn-benchmark,
maskrcnn_benchmark/layers/misc.py (``_NewEmptyTensorOp``: ``new_empty`` in
forward, itself again in backward, for layers fed zero detections) and
maskrcnn_benchmark/layers/sigmoid_focal_loss.py (``_SigmoidFocalLoss``,
whose forward and backward call CUDA kernels; here both kernels are written
out as tensor code with the same formulas). Patterns: ``new_empty`` and
zero-size arrays; a loss with non-tensor options (``num_classes``,
``gamma``, ``alpha``) and integer targets.
"""

import jax
import jax.numpy as jnp
import numpy as np
import torch
from port_checks import assert_jit_grad_matches_torch, assert_vmap_matches_loop

import vjpkit
from vjpkit.testing import assert_gradcheck, assert_gradgradcheck, assert_matches_torch

RNG = np.random.default_rng(10)
LOGITS = RNG.standard_normal((6, 3))
TARGETS = np.array([0, 1, 2, 3, -1, 2])  # 0: background, c + 1: class c, -1: ignored
OPTIONS = (3, 2.0, 0.25)  # num_classes, gamma, alpha


# --- _NewEmptyTensorOp -------------------------------------------------------------


class TorchNewEmptyTensorOp(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, new_shape):
        ctx.shape = x.shape
        return x.new_empty(new_shape)

    @staticmethod
    def backward(ctx, grad):
        return TorchNewEmptyTensorOp.apply(grad, ctx.shape), None


class NewEmptyTensorOp(vjpkit.Function):
    @staticmethod
    def forward(ctx, x, new_shape):
        ctx.shape = x.shape
        return jnp.empty(new_shape, x.dtype)  # new_empty; JAX's "empty" is zeros

    @staticmethod
    def backward(ctx, grad):
        return NewEmptyTensorOp.apply(grad, ctx.shape), None


def test_new_empty_tensor_op_matches_pytorch_for_zero_detections():
    assert_matches_torch(TorchNewEmptyTensorOp, NewEmptyTensorOp, (np.zeros((0, 4)), (0, 7)),
                         check_second_order=True)


def test_new_empty_tensor_op_under_jit_grad_and_vmap(x64):
    g = jax.jit(jax.grad(lambda x: NewEmptyTensorOp.apply(x, (0, 7)).sum()))(jnp.zeros((0, 4)))
    assert g.shape == (0, 4)
    assert jax.vmap(lambda x: NewEmptyTensorOp.apply(x, (0, 7)))(jnp.zeros((2, 0, 4))).shape == (2, 0, 7)


# --- _SigmoidFocalLoss ---------------------------------------------------------------


def _torch_focal_masks(targets, num_classes, dtype):
    classes = torch.arange(1, num_classes + 1, dtype=targets.dtype, device=targets.device)[None, :]
    t = targets[:, None]
    return (t == classes).to(dtype), ((t >= 0) & (t != classes)).to(dtype)


class TorchSigmoidFocalLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, num_classes, gamma, alpha):
        ctx.save_for_backward(logits, targets)
        ctx.num_classes, ctx.gamma, ctx.alpha = num_classes, gamma, alpha
        positive, negative = _torch_focal_masks(targets, num_classes, logits.dtype)
        p = torch.sigmoid(logits)
        return (-positive * alpha * (1 - p) ** gamma * torch.log(p)
                - negative * (1 - alpha) * p ** gamma * torch.log(1 - p))

    @staticmethod
    def backward(ctx, d_loss):
        logits, targets = ctx.saved_tensors
        gamma, alpha = ctx.gamma, ctx.alpha
        positive, negative = _torch_focal_masks(targets, ctx.num_classes, logits.dtype)
        p = torch.sigmoid(logits)
        d_positive = -alpha * (1 - p) ** gamma * (1 - p - gamma * p * torch.log(p))
        d_negative = -(1 - alpha) * p ** gamma * (gamma * (1 - p) * torch.log(1 - p) - p)
        return d_loss * (positive * d_positive + negative * d_negative), None, None, None, None


def _focal_masks(targets, num_classes, dtype):
    classes = jnp.arange(1, num_classes + 1)
    t = targets[..., None]  # per anchor: a vmap over anchors sees a scalar target
    return (t == classes).astype(dtype), ((t >= 0) & (t != classes)).astype(dtype)


class SigmoidFocalLoss(vjpkit.Function):
    @staticmethod
    def forward(ctx, logits, targets, num_classes, gamma, alpha):
        ctx.save_for_backward(logits, targets)
        ctx.num_classes, ctx.gamma, ctx.alpha = num_classes, gamma, alpha  # static options
        positive, negative = _focal_masks(targets, num_classes, logits.dtype)
        p = jax.nn.sigmoid(logits)
        return (-positive * alpha * (1 - p) ** gamma * jnp.log(p)
                - negative * (1 - alpha) * p ** gamma * jnp.log1p(-p))

    @staticmethod
    def backward(ctx, d_loss):
        logits, targets = ctx.saved_tensors
        gamma, alpha = ctx.gamma, ctx.alpha
        positive, negative = _focal_masks(targets, ctx.num_classes, logits.dtype)
        p = jax.nn.sigmoid(logits)
        d_positive = -alpha * (1 - p) ** gamma * (1 - p - gamma * p * jnp.log(p))
        d_negative = -(1 - alpha) * p ** gamma * (gamma * (1 - p) * jnp.log1p(-p) - p)
        return d_loss * (positive * d_positive + negative * d_negative), None, None, None, None


def test_sigmoid_focal_loss_matches_pytorch_to_second_order():
    assert_matches_torch(TorchSigmoidFocalLoss, SigmoidFocalLoss, (LOGITS, TARGETS, *OPTIONS),
                         check_second_order=True)


def test_sigmoid_focal_loss_gradcheck():
    f = lambda logits: SigmoidFocalLoss.apply(logits, TARGETS, *OPTIONS)  # noqa: E731
    assert_gradcheck(f, (LOGITS,))
    assert_gradgradcheck(f, (LOGITS,))


def test_sigmoid_focal_loss_under_jit_grad_and_vmap():
    assert_jit_grad_matches_torch(TorchSigmoidFocalLoss, SigmoidFocalLoss, (LOGITS, TARGETS, *OPTIONS))
    assert_vmap_matches_loop(SigmoidFocalLoss, (LOGITS, TARGETS, *OPTIONS), (0, 0, None, None, None))


# ---------------------------------------------------------------------------
# The originals run unported through vjpkit.from_torch, beside their ports
# (tests/ports/test_ports_from_torch.py collects every module's list).

FROM_TORCH_CASES = [  # not under vmap: the original indexes its batch axis, which a per-example call has not got
    dict(original=TorchNewEmptyTensorOp, port=NewEmptyTensorOp, args=(np.zeros((0, 4)), (0, 7)), second_order=True),
    dict(original=TorchSigmoidFocalLoss, port=SigmoidFocalLoss, args=(LOGITS, TARGETS, *OPTIONS), second_order=True),
]
