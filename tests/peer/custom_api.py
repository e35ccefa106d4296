"""What JAX's ``CustomJVPTest`` and ``CustomVJPTest`` share (tests/custom_api_test.py writes it in both).

The two suites run the same programs around a custom rule: a one-step
``lax.scan`` ("initial style"), a two-step scan differentiated, a ``psum``
over a vmap's axis name, ``remat`` at several orders. Each test file keeps
its own Functions (a ``jvp`` rule in one, a ``backward`` in the other) and
its expected numbers; these are the programs around them.
"""

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax


def close(actual, expected, rtol=1e-6):
    jax.tree_util.tree_map(lambda a, e: np.testing.assert_allclose(a, e, rtol=rtol, atol=1e-7), actual, expected)


def in_one_step_scan(f):
    """``f`` called in the body of a one-step ``lax.scan`` (JAX's "initial style"), carrying its output."""

    def foo(x):
        out, _ = lax.scan(lambda c, _: (f(c), None), x, None, length=1)
        return out

    return foo


def grad_of_two_step_scan(f):
    """test_run_rules_more_than_once's program: the gradient of a two-step scan carrying ``(f(x, y), x)``."""

    def body(x_y, _):
        x, y = x_y
        return (f(x, y), x), None

    @jax.grad
    def g(x):
        (out, _), _ = lax.scan(body, (x, 1.0), xs=None, length=2)
        return out

    return g


def psum_over_vmap_axis(f):
    """test_initial_style_vmap_with_collective's program: ``f`` psums 2.0 over a vmap of 4 named ``"foo"``."""
    summed = jax.vmap(lambda _, x: f(x), axis_name="foo", in_axes=(0, None), out_axes=None)
    return summed(jnp.arange(4.0), jnp.float32(2.0))


def check_remat_higher_order(f):
    """test_remat_higher_order: ``f(f(x))`` under ``jax.checkpoint`` (``jax.remat``) at orders 2 and 3, at 2.0."""

    def g(x):
        return f(f(x))

    close(jax.grad(jax.grad(jax.checkpoint(g)))(2.0), jax.grad(jax.grad(g))(2.0))
    close(jax.grad(jax.checkpoint(jax.grad(g)))(2.0), jax.grad(jax.grad(g))(2.0))
    close(jax.grad(jax.grad(jax.grad(jax.checkpoint(g))))(2.0), jax.grad(jax.grad(jax.grad(g)))(2.0))
