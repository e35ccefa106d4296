"""ReLU with a hand-written backward: PyTorch's tutorial `MyReLU`, ported.

    python examples/relu.py

The only edits from the PyTorch version: `torch.autograd.Function` becomes
`vjpkit.Function`, `clamp(min=0)` becomes `jnp.clip(x, min=0)`, and the
in-place `grad[x < 0] = 0` becomes `jnp.where` (JAX arrays are immutable).
"""

import jax
import jax.numpy as jnp
import numpy as np

import vjpkit


class MyReLU(vjpkit.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return jnp.clip(x, min=0)

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return jnp.where(x < 0, 0.0, g)


def relu_reference(x):
    """The same math in plain jnp, differentiated by JAX itself."""
    return jnp.clip(x, min=0)


def main():
    x = jnp.array([-2.0, -0.5, 0.5, 3.0])
    y = MyReLU.apply(x)
    print("x               ", x)
    print("relu(x)         ", y)
    np.testing.assert_allclose(y, relu_reference(x))

    # jax.grad and jax.jit see an ordinary JAX function.
    loss = jax.jit(jax.grad(lambda x: (MyReLU.apply(x) * jnp.arange(1.0, 5.0)).sum()))
    expected = jax.grad(lambda x: (relu_reference(x) * jnp.arange(1.0, 5.0)).sum())(x)
    print("grad            ", loss(x))
    np.testing.assert_allclose(loss(x), expected)

    # Per-example gradients: vmap over a batch of rows.
    batch = jnp.array([[-1.0, 2.0, -3.0], [4.0, -5.0, 6.0]])
    per_row = jax.vmap(jax.grad(lambda r: (MyReLU.apply(r) ** 2).sum()))(batch)
    expected = jax.vmap(jax.grad(lambda r: (relu_reference(r) ** 2).sum()))(batch)
    print("per-row grads   ", per_row.tolist())
    np.testing.assert_allclose(per_row, expected)
    print("relu: ok")


if __name__ == "__main__":
    main()
