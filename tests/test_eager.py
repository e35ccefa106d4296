"""Eager runs (``jit=False``, ``jax.disable_jit()``) behave exactly as compiled ones.

Run eagerly, JAX hands a Function's rules its weakly typed scalar wrapper
(a ``float`` subclass) for a Python float being differentiated, where a
compiled run sees a tracer. Expected values come from ``jax.grad`` of the
same math in plain ``jnp``.
"""

import jax
import jax.numpy as jnp
import pytest
from functions import Double, MulByScalar, MulByScalarWithJvp, fresh

X = jnp.array([0.5, -1.0, 2.0])


def _scale(jit: bool, with_jvp: bool = False):
    return fresh(MulByScalarWithJvp if with_jvp else MulByScalar, "Scale", jit=jit)


def _loss(f):
    return lambda c: jnp.sin(f.apply(X, c)).sum()


def _expected_grad(c):
    return jax.grad(lambda c: jnp.sin(X * c).sum())(c)


@pytest.mark.parametrize("with_jvp", [False, True])
def test_grad_with_respect_to_a_python_float_without_jit(with_jvp):
    f = _scale(jit=False, with_jvp=with_jvp)
    assert jnp.allclose(jax.grad(_loss(f))(2.0), _expected_grad(2.0))


@pytest.mark.parametrize("with_jvp", [False, True])
def test_grad_with_respect_to_a_python_float_under_disable_jit(with_jvp):
    f = _scale(jit=True, with_jvp=with_jvp)
    with jax.disable_jit():
        got = jax.grad(_loss(f))(2.0)
    assert jnp.allclose(got, _expected_grad(2.0))


def test_jvp_with_respect_to_a_python_float_without_jit():
    f = _scale(jit=False, with_jvp=True)
    _, got = jax.jvp(_loss(f), (2.0,), (1.0,))
    _, want = jax.jvp(lambda c: jnp.sin(X * c).sum(), (2.0,), (1.0,))
    assert jnp.allclose(got, want)


def test_eager_forward_sees_the_same_input_type_as_compiled():
    seen = []

    def forward(ctx, c):  # Double's, recording what it gets
        seen.append((jnp.shape(c), isinstance(c, jax.Array)))
        return Double.forward(ctx, c)

    Record = fresh(Double, "Record", jit=False, forward=staticmethod(forward))
    assert jax.grad(Record.apply)(3.0) == 2.0
    assert seen == [((), True)]
