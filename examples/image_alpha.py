"""Two outputs, one of them unused by the loss: an image and its alpha mask.

    python examples/image_alpha.py

A rasterizer-like Function returns `(image, alpha)`. When the loss uses only
the image, the alpha gradient still has a slot in backward:

- by default (materialized), it arrives as an array of zeros, so backward
  can add it without checking;
- after `ctx.set_materialize_grads(False)` it arrives as `None`, and
  backward skips the work for it.

Either way the gradients are the same as JAX's own for the plain math.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np

import vjpkit

# backward runs while JAX traces (once per compiled signature); we record
# what arrived for the alpha gradient so the script can show it.
alpha_grad_arrived = {}


@vjpkit.function
class Composite:
    """image = rgb * sigmoid(logits), alpha = sigmoid(logits)."""

    @staticmethod
    def forward(ctx, rgb, logits, materialize=True):
        alpha = jax.nn.sigmoid(logits)
        ctx.set_materialize_grads(materialize)
        ctx.materialize = materialize  # static data, readable in backward
        ctx.save_for_backward(rgb, alpha)
        return rgb * alpha[..., None], alpha

    @staticmethod
    def backward(ctx, g_image, g_alpha):
        rgb, alpha = ctx.saved_tensors
        alpha_grad_arrived[ctx.materialize] = (
            None if g_alpha is None else f"zeros-shaped array {g_alpha.shape}"
        )
        g_rgb = None
        g_alpha_total = jnp.zeros_like(alpha)
        if g_image is not None:
            g_rgb = g_image * alpha[..., None]
            g_alpha_total += (g_image * rgb).sum(-1)
        if g_alpha is not None:
            g_alpha_total += g_alpha
        g_logits = g_alpha_total * alpha * (1 - alpha)
        return g_rgb, g_logits, None  # None: `materialize` is static


def composite_reference(rgb, logits):
    alpha = jax.nn.sigmoid(logits)
    return rgb * alpha[..., None], alpha


def main():
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    rgb = jax.random.uniform(k1, (4, 5, 3))
    logits = jax.random.normal(k2, (4, 5))
    target = jax.random.uniform(k3, (4, 5, 3))

    def image_loss(composite, rgb, logits):
        image, _alpha = composite(rgb, logits)
        return ((image - target) ** 2).mean()

    def image_and_alpha_loss(composite, rgb, logits):
        image, alpha = composite(rgb, logits)
        return ((image - target) ** 2).mean() + alpha.mean()

    for materialize in (True, False):
        composite = functools.partial(Composite, materialize=materialize)
        for loss in (image_loss, image_and_alpha_loss):
            grad = jax.jit(jax.grad(functools.partial(loss, composite), argnums=(0, 1)))
            g_rgb, g_logits = grad(rgb, logits)
            e_rgb, e_logits = jax.grad(functools.partial(loss, composite_reference), argnums=(0, 1))(rgb, logits)
            np.testing.assert_allclose(g_rgb, e_rgb, rtol=1e-5, atol=1e-7)
            np.testing.assert_allclose(g_logits, e_logits, rtol=1e-5, atol=1e-7)

            if loss is image_loss:
                arrived = alpha_grad_arrived[materialize]
                print(f"materialize={materialize!s:<5}: image-only loss, alpha gradient arrived as {arrived}")
                assert (arrived is None) == (not materialize), arrived
                print("  d loss / d logits[0] =", np.array2string(np.asarray(g_logits[0]), precision=5))
    print("gradients match jax.grad of the plain math in all four cases")
    print("image_alpha: ok")


if __name__ == "__main__":
    main()
