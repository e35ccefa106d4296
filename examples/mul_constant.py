"""Multiply by a Python constant: PyTorch's tutorial `MulConstant`, ported.

    python examples/mul_constant.py

A Python number is a static argument: it is stored on ctx as plain data (no
residual array), it is part of the compile-cache key, and its gradient slot
must be `None`. To differentiate with respect to the constant, pass it as an
array (`jnp.asarray(c)`) instead.
"""

import jax
import jax.numpy as jnp
import numpy as np

import vjpkit


class MulConstant(vjpkit.Function):
    @staticmethod
    def forward(ctx, x, constant):
        ctx.constant = constant
        return x * constant

    @staticmethod
    def backward(ctx, g):
        # One gradient per forward parameter; None for the Python constant.
        return g * ctx.constant, None


def main():
    x = jnp.array([1.0, -2.0, 3.0])
    print("x                    ", x)
    print("MulConstant(x, 3.0)  ", MulConstant.apply(x, 3.0))
    # Keyword arguments bind to forward's signature, as in a normal call.
    print("... constant=0.5     ", MulConstant.apply(x, constant=0.5))
    np.testing.assert_allclose(MulConstant.apply(x, constant=0.5), x * 0.5)

    for c in (3.0, 0.5, -1.0):
        g = jax.grad(lambda x, c=c: (MulConstant.apply(x, c) ** 2).sum())(x)
        expected = jax.grad(lambda x, c=c: ((x * c) ** 2).sum())(x)
        print(f"grad, constant={c:<5}", g)
        np.testing.assert_allclose(g, expected)

    # Under an outer jit the constant is closed over, so it stays static.
    @jax.jit
    def scaled_norm(x):
        return jnp.sqrt((MulConstant.apply(x, 2.0) ** 2).sum())

    g = jax.grad(scaled_norm)(x)
    print("grad of |2x| (jit)   ", g)
    np.testing.assert_allclose(g, jax.grad(lambda x: jnp.sqrt(((2.0 * x) ** 2).sum()))(x), rtol=1e-6)

    # vmap over a batch: one row at a time, the same constant for every row.
    batch = jnp.arange(6.0).reshape(2, 3)
    rows = jax.vmap(lambda r: MulConstant.apply(r, 10.0))(batch)
    print("vmapped rows         ", rows.tolist())
    np.testing.assert_allclose(rows, batch * 10.0)
    print("mul_constant: ok")


if __name__ == "__main__":
    main()
