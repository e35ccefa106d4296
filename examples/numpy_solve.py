# requires: numpy
"""A NumPy linear solve x = solve(A, b) with its adjoint backward, as a host Function.

    python examples/numpy_solve.py

forward and backward are NumPy code (``host=True``): vjpkit runs them
through ``jax.pure_callback``, so the Function works under jit, grad and
vmap. The output has b's shape, not A's (the first input), so the class
declares ``output_shapes``.

Backward is the standard adjoint: with lam = solve(A^T, g),
dL/db = lam and dL/dA = -lam x^T.
"""

import jax
import jax.numpy as jnp
import numpy as np

import vjpkit


@vjpkit.function(host=True)
class Solve:
    @staticmethod
    def output_shapes(A, b):
        return b  # x has the shape and dtype of b

    @staticmethod
    def forward(ctx, A, b):
        x = np.linalg.solve(A, b)
        ctx.save_for_backward(A, x)
        return x

    @staticmethod
    def backward(ctx, g):
        A, x = ctx.saved_tensors
        lam = np.linalg.solve(A.T, g)
        gA = -np.outer(lam, x) if ctx.needs_input_grad[0] else None
        return gA, lam


def loss(solve, A, b):
    x = solve(A, b)
    return jnp.sum(x**2) + x[0]


def main():
    rng = np.random.default_rng(0)
    A = jnp.asarray(rng.normal(size=(4, 4)) + 4 * np.eye(4), dtype=jnp.float32)
    b = jnp.asarray(rng.normal(size=4), dtype=jnp.float32)

    x = Solve(A, b)
    print("x = solve(A, b)  ", x)
    np.testing.assert_allclose(x, jnp.linalg.solve(A, b), rtol=1e-5, atol=1e-6)

    grad = jax.jit(jax.grad(lambda A, b: loss(Solve, A, b), argnums=(0, 1)))
    gA, gb = grad(A, b)
    gA_ref, gb_ref = jax.grad(lambda A, b: loss(jnp.linalg.solve, A, b), argnums=(0, 1))(A, b)
    print("dL/db            ", gb)
    print("dL/dA row 0      ", gA[0])
    np.testing.assert_allclose(gA, gA_ref, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(gb, gb_ref, rtol=1e-4, atol=1e-5)

    # Per-example gradients over a batch of right-hand sides: vmap runs the
    # NumPy code once per example (vmap_method="sequential", the default).
    bs = jnp.asarray(rng.normal(size=(3, 4)), dtype=jnp.float32)
    per_example = jax.vmap(jax.grad(lambda b: loss(Solve, A, b)))(bs)
    reference = jax.vmap(jax.grad(lambda b: loss(jnp.linalg.solve, A, b)))(bs)
    print("per-example dL/db", per_example.shape)
    np.testing.assert_allclose(per_example, reference, rtol=1e-4, atol=1e-5)

    # backward is NumPy, so a second derivative raises, naming the class.
    try:
        jax.hessian(lambda b: loss(Solve, A, b))(b)
    except RuntimeError as e:
        assert "Solve.backward" in str(e)
        print("hessian          ", str(e).split(":")[0])
    else:
        raise AssertionError("a second derivative of a host Function should raise")
    print("numpy_solve: ok")


if __name__ == "__main__":
    main()
