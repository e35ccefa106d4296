"""The layers the examples train with, written as vjpkit Functions.

Each class is what a PyTorch user would write as a ``torch.autograd.Function``;
the only changes are ``vjpkit.Function`` for the base class and ``jnp`` for
the maths (and ``jnp.where`` instead of in-place masking). The examples import
them from here:

    from layers import linear, relu, softmax_cross_entropy

Run this file to gradcheck every layer against finite differences:

    python examples/layers.py
"""

import jax
import jax.numpy as jnp
import numpy as np

import vjpkit


class Linear(vjpkit.Function):
    """``x @ w.T + b`` with PyTorch's weight layout ``(out_features, in_features)``."""

    @staticmethod
    def forward(ctx, x, w, b=None):
        ctx.save_for_backward(x, w, b)
        y = x @ w.T
        return y if b is None else y + b

    @staticmethod
    def backward(ctx, g):
        x, w, b = ctx.saved_tensors
        gx = g @ w if ctx.needs_input_grad[0] else None
        gw = g.T @ x if ctx.needs_input_grad[1] else None
        gb = g.sum(0) if b is not None and ctx.needs_input_grad[2] else None
        return gx, gw, gb


class ReLU(vjpkit.Function):
    """``max(x, 0)``; the backward masks the gradient where the input was negative."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return jnp.maximum(x, 0)

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        # PyTorch: grad_input = g.clone(); grad_input[x < 0] = 0
        return jnp.where(x < 0, 0, g)


class SoftmaxCrossEntropy(vjpkit.Function):
    """Mean cross-entropy of ``logits`` (N, C) against integer ``labels`` (N,).

    Fused: the gradient ``softmax(logits) - one_hot(labels)`` is rebuilt in
    backward from the logits and one log-sum-exp per row, so the only thing
    saved besides the inputs is N floats. Autodiff of the same maths keeps
    the (N, C) softmax alive until the backward pass instead.
    """

    @staticmethod
    def forward(ctx, logits, labels):
        lse = jax.nn.logsumexp(logits, axis=-1)
        ctx.save_for_backward(logits, labels, lse)
        picked = jnp.take_along_axis(logits, labels[:, None], axis=-1)[:, 0]
        return jnp.mean(lse - picked)

    @staticmethod
    def backward(ctx, g):
        logits, labels, lse = ctx.saved_tensors
        probs = jnp.exp(logits - lse[:, None])
        one_hot = jax.nn.one_hot(labels, logits.shape[-1], dtype=logits.dtype)
        # labels are integers: not differentiable, so their gradient is None.
        return (probs - one_hot) * (g / logits.shape[0]), None


linear = Linear.apply
relu = ReLU.apply
softmax_cross_entropy = SoftmaxCrossEntropy.apply


def gradcheck_layers(seed=0):
    """Checks every layer's backward against finite differences; returns their names.

    The inputs are small float64 NumPy arrays (gradcheck runs in float64
    whatever JAX's default). Raises ``vjpkit.GradcheckError`` naming the
    layer, input and worst element if a backward is wrong.
    """
    rng = np.random.default_rng(seed)
    # ReLU's inputs stay away from the kink at 0, where finite differences lie.
    away_from_zero = rng.uniform(0.1, 1.0, size=(4, 5)) * rng.choice([-1.0, 1.0], size=(4, 5))
    checks = {
        "Linear": (linear, (rng.normal(size=(4, 3)), rng.normal(size=(5, 3)), rng.normal(size=5))),
        "ReLU": (relu, (away_from_zero,)),
        "SoftmaxCrossEntropy": (softmax_cross_entropy, (rng.normal(size=(4, 5)), np.array([0, 3, 4, 1]))),
    }
    for fn, inputs in checks.values():
        vjpkit.gradcheck(fn, inputs)
    return list(checks)


if __name__ == "__main__":
    for name in gradcheck_layers():
        print(f"gradcheck {name}: ok")
