"""Exp that saves its output: PyTorch's tutorial `Exp`, as a class decorator.

    python examples/exp.py

d/dx exp(x) = exp(x), so forward saves its *output* and backward reuses it.
The backward is itself differentiable JAX code, so second derivatives are
right too (PyTorch needs the saved output to be an output for that; here
any saved value works).
"""

import jax
import jax.numpy as jnp
import numpy as np

import vjpkit


@vjpkit.function
class Exp:
    @staticmethod
    def forward(ctx, x):
        y = jnp.exp(x)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, g):
        (y,) = ctx.saved_tensors
        return g * y


def main():
    x = jnp.array([0.0, 0.5, 1.0], dtype=jnp.float32)

    # Both spellings call the Function.
    print("x               ", x)
    print("Exp(x)          ", Exp(x))
    np.testing.assert_allclose(Exp.apply(x), jnp.exp(x), rtol=1e-6)

    grad = jax.jit(jax.grad(lambda x: Exp(x).sum()))
    print("grad of sum     ", grad(x))
    np.testing.assert_allclose(grad(x), jax.grad(lambda x: jnp.exp(x).sum())(x), rtol=1e-6)

    # Second derivative of exp at a scalar point: exp again.
    d2 = jax.grad(jax.grad(lambda s: Exp(s)))(1.0)
    print("d2/dx2 exp(1)   ", d2)
    np.testing.assert_allclose(d2, jax.grad(jax.grad(jnp.exp))(1.0), rtol=1e-6)

    # Full Jacobian, by reverse mode.
    jac = jax.jacrev(Exp)(x)
    np.testing.assert_allclose(jac, jax.jacrev(jnp.exp)(x), rtol=1e-6)
    print("jacobian diag   ", jnp.diag(jac))
    print("exp: ok")


if __name__ == "__main__":
    main()
