"""A Function's ``vmap(info, in_dims, *args)`` staticmethod: PyTorch's batching rule, honoured under jax.vmap."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from functions import Identity

import vjpkit


def _sine_with_rule(calls: list, marker: float = 100.0) -> type:
    """sin(x) * k whose vmap rule adds ``marker``, so a test can tell the rule's outputs from forward's."""

    class Sine(vjpkit.Function):
        @staticmethod
        def forward(x, k):
            return jnp.sin(x) * k

        @staticmethod
        def setup_context(ctx, inputs, output):
            ctx.save_for_backward(inputs[0])
            ctx.k = inputs[1]

        @staticmethod
        def backward(ctx, g):
            (x,) = ctx.saved_tensors
            return g * jnp.cos(x) * ctx.k, None

        @staticmethod
        def vmap(info, in_dims, x, k):
            calls.append((info.batch_size, info.randomness, in_dims))
            return Sine.apply(jnp.moveaxis(x, in_dims[0], 0), k) + marker, 0

    return Sine


def test_vmap_runs_the_rule_for_the_outputs():
    calls: list = []
    sine = _sine_with_rule(calls)
    x = jnp.arange(3.0)
    out = jax.vmap(sine.apply, in_axes=(0, None))(x, 2.0)
    np.testing.assert_allclose(out, np.sin(np.arange(3.0)) * 2.0 + 100.0, rtol=1e-6)
    assert calls == [(3, "error", (0, None))]


def test_vmap_rule_batches_along_any_in_axis():
    calls: list = []
    sine = _sine_with_rule(calls)
    x = jnp.arange(6.0).reshape(2, 3)
    out = jax.vmap(sine.apply, in_axes=(1, None))(x, 1.0)
    np.testing.assert_allclose(out, np.sin(np.arange(6.0).reshape(2, 3)).T + 100.0, rtol=1e-6)
    assert calls[0][0] == 3


def test_per_example_gradients_come_from_backward_under_a_vmap_rule():
    sine = _sine_with_rule([])
    x = jnp.arange(3.0)
    grads = jax.vmap(jax.grad(sine.apply), in_axes=(0, None))(x, 2.0)
    np.testing.assert_allclose(grads, 2.0 * np.cos(np.arange(3.0)), rtol=1e-6)


def test_gradient_of_a_vmapped_function_with_a_rule_comes_from_backward():
    sine = _sine_with_rule([])
    x = jnp.arange(3.0)
    grads = jax.jit(jax.grad(lambda x: jax.vmap(sine.apply, in_axes=(0, None))(x, 2.0).sum()))(x)
    np.testing.assert_allclose(grads, 2.0 * np.cos(np.arange(3.0)), rtol=1e-6)


def test_vmap_rule_out_dims_none_broadcasts_an_unbatched_output():
    class Total(vjpkit.Function):
        @staticmethod
        def forward(x):
            return jnp.sum(x), jnp.sum(x) * 0.0

        @staticmethod
        def setup_context(ctx, inputs, output):
            pass

        @staticmethod
        def backward(ctx, g, h):
            return g

        @staticmethod
        def vmap(info, in_dims, x):
            return (jnp.sum(x, axis=1), jnp.float32(7.0)), (0, None)

    out, constant = jax.vmap(Total.apply)(jnp.ones((4, 2)))
    np.testing.assert_allclose(out, [2.0] * 4)
    np.testing.assert_allclose(constant, [7.0] * 4)


def test_vmap_rule_returning_no_pair_names_the_class():
    class Bad(vjpkit.Function):
        @staticmethod
        def forward(x):
            return x * 2.0

        @staticmethod
        def setup_context(ctx, inputs, output):
            pass

        @staticmethod
        def backward(ctx, g):
            return g * 2.0

        @staticmethod
        def vmap(info, in_dims, x):
            return x * 2.0

    with pytest.raises(TypeError, match=r"Bad.vmap returned .*expected a pair \(outputs, out_dims\)"):
        jax.vmap(Bad.apply)(jnp.ones(3))


def test_vmap_rule_with_forward_taking_ctx_raises_naming_the_class():
    with pytest.raises(TypeError, match=r"Classic defines a vmap staticmethod.*Classic.setup_context"):

        class Classic(Identity):  # forward(ctx, x)
            @staticmethod
            def vmap(info, in_dims, x):
                return x, in_dims[0]


class GeneratedSquare(vjpkit.Function):
    """x * x, setup_context style, whose vmap rule is generated: jax.vmap batches forward as written."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x):
        return x * x

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[0])

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return 2.0 * x * g


def test_vmap_rule_and_generate_vmap_rule_together_raise():
    with pytest.raises(TypeError, match=r"Both has both generate_vmap_rule = True and a vmap staticmethod"):

        class Both(GeneratedSquare):
            @staticmethod
            def vmap(info, in_dims, x):
                return x, in_dims[0]


def test_generate_vmap_rule_batches_forward_as_written():
    x = jnp.arange(3.0)
    np.testing.assert_allclose(jax.vmap(GeneratedSquare.apply)(x), [0.0, 1.0, 4.0])
    np.testing.assert_allclose(jax.vmap(jax.grad(GeneratedSquare.apply))(x), [0.0, 2.0, 4.0])
