"""What JAX's ``CustomJVPTest`` and ``CustomVJPTest`` share (tests/custom_api_test.py writes it in both).

The two suites run the same programs around a custom rule: a one-step
``lax.scan`` ("initial style"), a two-step scan differentiated, a ``psum``
over a vmap's axis name, ``remat`` at several orders. Each test file keeps
its own rules (a ``jvp`` in one, a ``backward`` in the other) and its
expected numbers; these are the programs around them, and the functions
both suites give a rule (a forward each test subclasses).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import vjpkit


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


# ---------------------------------------------------------------------------
# The functions both suites give a rule: each test subclasses one, adding its jvp or backward.


class HalfCosTwoX(vjpkit.Function):
    """test_invariance's f(x) = cos(2x) / 2."""

    @staticmethod
    def forward(ctx, x):
        return jnp.cos(2 * x) / 2.0


class SinOrCos(vjpkit.Function):
    """test_python_control_flow's f: sin(x) for a positive x, else cos(x). vjpkit: the sign is a static argument
    (forward cannot branch on the traced x), kept in ``ctx.positive`` for the rule."""

    @staticmethod
    def forward(ctx, x, positive):
        ctx.positive = positive
        return jnp.sin(x) if positive else jnp.cos(x)


def check_sin_or_cos_values(cls):
    """test_python_control_flow's values: sin(2) at 2, cos(-2) at -2."""

    def f(x):
        return cls.apply(x, bool(x > 0))

    close(f(2.0), jnp.sin(2.0))
    close(f(-2.0), jnp.cos(-2.0))


class ScaledSum(vjpkit.Function):
    """test_kwargs' f(x, y, c=1.) = c * (x + y); c=2. passed by keyword is a Python float, so static."""

    @staticmethod
    def forward(ctx, x, y, c=1.0):
        return c * (x + y)


def squared_scaled_sum(cls):
    """test_kwargs' program: the sum of (cls(x, y, c=2.))**2, 900 at (10, 5)."""

    def f(x, y):
        return jnp.square(cls.apply(x, y, c=2.0)).sum()

    close(f(jnp.float32(10.0), jnp.float32(5.0)), 900.0)  # vjpkit: Python floats alone would be all static
    return f


class PsumOverFoo(vjpkit.Function):
    """test_initial_style_vmap_with_collective's f: a psum over the vmap axis named "foo"."""

    @staticmethod
    def forward(ctx, x):
        return lax.psum(x, "foo")


class SquareWithoutRule(vjpkit.Function):
    """test_missing_jvp_rule_error_message's and test_missing_vjp_rule_error's f(x) = x**2, with no rule."""

    @staticmethod
    def forward(ctx, x):
        return x**2


def check_resolve_kwargs_error_message():
    """test_resolve_kwargs_error_message (both suites; the rule never runs): vjpkit binds keywords (z=1.0 is
    accepted), and a missing argument raises naming the class."""

    class F(vjpkit.Function):
        @staticmethod
        def forward(ctx, x, y, *, z=None):
            return jnp.sin(x), x + jnp.cos(y)

    with pytest.raises(TypeError, match=r"F.apply missing required argument 'y'"):
        F.apply(0.5)
    close(F.apply(jnp.float32(0.5), 0.1, z=1.0), (jnp.sin(0.5), 0.5 + jnp.cos(0.1)))
