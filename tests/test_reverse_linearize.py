"""Reverse mode of a Function called under a staging trace (``jax.jit(jax.grad(...))``).

There ``apply`` makes reverse mode's linearization itself (forward on the
primal trace, the ``linear_call`` on the tangent trace), as JAX does for a
``custom_vjp``: these pin down what that path must keep from the
``custom_jvp`` rule it stands for. Expected values come from ``jax.grad`` of
the same math in plain ``jnp``.
"""

import chex
import jax
import jax.numpy as jnp
import pytest
from functions import Linear, LinearFunction, SinWithJvp, StoppedExpWithJvp

import vjpkit

X = jnp.array([[0.5, -1.0], [2.0, 0.25]])
W = jnp.array([[1.5, -0.5], [0.75, 2.0]])


def test_jit_of_grad_runs_backward_with_the_differentiated_inputs_as_needs_input_grad():
    seen = []

    class Recorded(LinearFunction):
        @staticmethod
        def backward(ctx, g):
            seen.append(tuple(ctx.needs_input_grad))
            return LinearFunction.backward(ctx, g)

    def loss(x, w):
        return Recorded.apply(x, w).sum()

    def reference(x, w):
        return (x @ w.T).sum()

    for argnums, needs in (((0,), (True, False, False)), ((1,), (False, True, False)),
                           ((0, 1), (True, True, False))):
        seen.clear()
        got = jax.jit(jax.grad(loss, argnums))(X, W)
        chex.assert_trees_all_close(got, jax.grad(reference, argnums)(X, W), rtol=1e-6)
        assert seen == [needs]


class ScaleByCount(vjpkit.Function):
    """x * n for an integer array n (no gradient), and n + 1 returned as a second, integer output."""

    @staticmethod
    def forward(ctx, x, n):
        ctx.save_for_backward(n)
        return x * n, n + 1

    @staticmethod
    def backward(ctx, g, g_count):
        (n,) = ctx.saved_tensors
        return g * n, None


def test_integer_input_and_integer_output_under_jit_of_grad():
    n = jnp.array([2, 3])
    x = jnp.array([0.5, -1.5])

    def loss(x, n):
        y, count = ScaleByCount.apply(x, n)
        return (y * count).sum()

    got = jax.jit(jax.grad(loss))(x, n)
    chex.assert_trees_all_close(got, jax.grad(lambda x: (x * n * (n + 1)).sum())(x))


def test_vjp_under_jit_with_a_cotangent_for_one_output_only():
    def f(x, w):
        return Linear.apply(x, w), SinWithJvp.apply(x)

    def g(x, w):
        return x @ w.T, jnp.sin(x)

    cts = (jnp.ones((2, 2)), jnp.zeros((2, 2)))
    got = jax.jit(lambda x, w: jax.vjp(f, x, w)[1](cts))(X, W)
    chex.assert_trees_all_close(got, jax.vjp(g, X, W)[1](cts), rtol=1e-6)


def test_a_later_different_call_is_not_answered_by_an_earlier_linearization():
    """The same program differentiated along x, then w, then both, then at new shapes: each its own backward."""

    def loss(x, w):
        return jnp.tanh(LinearFunction.apply(x, w)).sum()

    def reference(x, w):
        return jnp.tanh(x @ w.T).sum()

    wide_x, wide_w = jnp.ones((3, 4)) * 0.1, jnp.arange(8.0).reshape(2, 4) / 8
    for x, w in ((X, W), (wide_x, wide_w)):
        for argnums in ((0,), (1,), (0, 1)):
            got = jax.jit(jax.grad(loss, argnums))(x, w)
            chex.assert_trees_all_close(got, jax.grad(reference, argnums)(x, w), rtol=1e-5)


@pytest.mark.parametrize("differentiate", ["jacrev of jacrev", "hessian"])
def test_second_order_under_jit_uses_the_functions_own_rules(differentiate):
    # exp under stop_gradient: only the Function's rules give it a derivative.
    def f(x):
        return StoppedExpWithJvp.apply(x).sum()

    hessian = jax.jacrev(jax.jacrev(f)) if differentiate == "jacrev of jacrev" else jax.hessian(f)
    x = jnp.array([0.25, -0.5])
    chex.assert_trees_all_close(jax.jit(hessian)(x), jnp.diag(jnp.exp(x)), rtol=1e-6)
