"""What a Function does does not depend on what ran before it, or on how its scalars arrive."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from functions import DoubleNoRules, Sin, fresh


def _sine() -> type:
    return fresh(Sin, "Sine")  # a class of its own: the first test depends on what ran before


def test_forward_mode_after_reverse_mode_of_the_same_jit_names_the_class():
    sine = _sine()
    f = jax.jit(sine.apply)
    np.testing.assert_allclose(jax.grad(f)(2.0), np.cos(2.0), rtol=1e-6)
    # JAX reuses the linearization that jax.grad kept; the message is the one a fresh process gives.
    with pytest.raises(TypeError, match=r"Sine has no forward-mode derivative .*Add a jvp\(ctx, \*tangents\)"):
        jax.jvp(f, (2.0,), (1.0,))


def test_second_derivative_under_remat_of_a_python_float():
    sine = _sine()
    # Eager jax.remat hands the tie JAX's weakly typed Python float.
    second = jax.grad(jax.grad(jax.remat(sine.apply)))(2.0)
    np.testing.assert_allclose(second, -np.sin(2.0), rtol=1e-6)


def test_second_derivative_under_remat_of_a_float32_scalar():
    sine = _sine()
    second = jax.grad(jax.grad(jax.remat(sine.apply)))(jnp.float32(2.0))
    np.testing.assert_allclose(second, -np.sin(2.0), rtol=1e-6)


def test_vjp_is_another_name_of_backward():
    # PyTorch's Function documents vjp as an alias of backward.
    class Double(DoubleNoRules):
        @staticmethod
        def vjp(ctx, g):
            return g * 3.0  # not forward's derivative, so the test sees that vjp ran

    np.testing.assert_allclose(jax.grad(Double.apply)(1.0), 3.0)
