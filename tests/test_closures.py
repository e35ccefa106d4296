"""Functions whose methods close over values of an enclosing transformation (classes made inside it).

A forward saving a closed-over vmap tracer is peer/test_jax_custom_vjp.py's test_closed_over_tracer3.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from functions import DoubleNoRules, fresh

import vjpkit


def _grad_with_backward_closing_over(y):
    class Sine(vjpkit.Function):
        @staticmethod
        def forward(ctx, x):
            return 2.0 * jnp.sin(x)

        @staticmethod
        def backward(ctx, g):
            return 2.0 * jnp.cos(y) * g  # y: the enclosing function's argument

    return jax.grad(Sine.apply)(1.0)


@pytest.mark.parametrize(
    "transform",
    [jax.vmap, lambda f: jax.jit(jax.vmap(f)), lambda f: jax.vmap(jax.jit(f))],
    ids=["vmap", "jit_of_vmap", "vmap_of_jit"],
)
def test_backward_closing_over_a_vmap_tracer(transform):
    ys = jnp.arange(3.0)
    np.testing.assert_allclose(transform(_grad_with_backward_closing_over)(ys), 2.0 * np.cos(ys), rtol=1e-6)


def test_backward_closing_over_a_value_being_differentiated():
    # The outer jax.grad differentiates the inner gradient through backward's use of y.
    np.testing.assert_allclose(jax.grad(_grad_with_backward_closing_over)(4.0), -2.0 * np.sin(4.0), rtol=1e-6)


def _grad_with_backward_reaching_y_through(helper_of):
    def inner(y):
        slope = helper_of(y)  # backward reaches y only through this helper's closure

        class Sine(vjpkit.Function):
            @staticmethod
            def forward(ctx, x):
                return 2.0 * jnp.sin(x)

            @staticmethod
            def backward(ctx, g):
                return slope(g)

        return jax.grad(Sine.apply)(1.0)

    return inner


def _partial_slope(y):
    return functools.partial(lambda y, g: 2.0 * jnp.cos(y) * g, y)


@pytest.mark.parametrize(
    "helper_of",
    [lambda y: (lambda g: 2.0 * jnp.cos(y) * g), lambda y: (lambda g: (lambda h: 2.0 * jnp.cos(y) * h)(g)),
     _partial_slope],
    ids=["helper", "helper_of_a_helper", "partial"],
)
def test_backward_reaching_a_value_being_differentiated_through_a_helper(helper_of):
    # The gradient is 2cos(y); its derivative along y, from jax.grad of that maths, is -2sin(y).
    expected = jax.grad(lambda y: 2.0 * jnp.cos(y))(4.0)
    np.testing.assert_allclose(jax.grad(_grad_with_backward_reaching_y_through(helper_of))(4.0), expected, rtol=1e-6)


def test_jvp_closing_over_a_vmap_tracer():
    def per_example(y):
        class Scale(DoubleNoRules):
            @staticmethod
            def jvp(ctx, t):
                return t * y

        return jax.jvp(Scale.apply, (1.0,), (1.0,))[1]

    np.testing.assert_allclose(jax.vmap(per_example)(jnp.arange(3.0)), np.arange(3.0))


def _scale_closing_over(w, rule):
    """``Scale``: x * w, with one ``rule`` ("backward" or "jvp") multiplying by w too; both close over w."""

    class ForwardOnly(vjpkit.Function):
        @staticmethod
        def forward(ctx, x):
            return x * w

    return fresh(ForwardOnly, "Scale", **{rule: staticmethod(lambda ctx, t: t * w)})


def test_forward_closing_over_a_differentiated_value_names_the_class():
    def loss(w):
        return _scale_closing_over(w, "backward").apply(jnp.float32(2.0))

    with pytest.raises(TypeError, match=r"Scale.forward uses a value that JAX is differentiating.*Scale closes over"):
        jax.grad(loss)(3.0)


def test_jvp_function_closing_over_a_differentiated_value_names_the_class():
    def output(w):
        return _scale_closing_over(w, "jvp").apply(jnp.float32(2.0))

    with pytest.raises(TypeError, match=r"Scale.forward uses a value that JAX is differentiating"):
        jax.jvp(output, (3.0,), (1.0,))


def test_function_argument_closing_over_a_differentiated_value_names_the_class():
    # PyTorch's checkpoint pattern: the parameters reach forward only through the function passed in.
    class Checkpoint(vjpkit.Function):
        @staticmethod
        def forward(ctx, fn, x):
            ctx.fn = fn
            ctx.save_for_backward(x)
            return fn(x)

        @staticmethod
        def backward(ctx, g):
            (x,) = ctx.saved_tensors
            _, fn_vjp = jax.vjp(ctx.fn, x)
            return None, fn_vjp(g)[0]

    with pytest.raises(TypeError, match=r"Checkpoint.forward uses a value .*pass the value as an argument"):
        jax.grad(lambda w: Checkpoint.apply(lambda x: jnp.sin(x * w), jnp.ones(3)).sum())(2.0)


def test_function_argument_taking_the_parameters_as_an_argument():
    # What the error says to do: w passed to apply, its gradient returned by backward.
    class Checkpoint(vjpkit.Function):
        @staticmethod
        def forward(ctx, fn, x, w):
            ctx.fn = fn
            ctx.save_for_backward(x, w)
            return fn(x, w)

        @staticmethod
        def backward(ctx, g):
            x, w = ctx.saved_tensors
            _, fn_vjp = jax.vjp(ctx.fn, x, w)
            return None, *fn_vjp(g)

    def f(x, w):
        return jnp.sin(x * w)

    x = jnp.array([0.5, 1.0, 2.0])
    got = jax.grad(lambda w: Checkpoint.apply(f, x, w).sum())(2.0)
    np.testing.assert_allclose(got, jax.grad(lambda w: f(x, w).sum())(2.0), rtol=1e-6)


def _scale_by(y):
    """A class made inside the transformed function, with jvp and backward both closing over its y."""

    jvp, backward = staticmethod(lambda ctx, t: t * y), staticmethod(lambda ctx, g: g * y)
    return fresh(DoubleNoRules, "Scale", jvp=jvp, backward=backward)


def test_jvp_and_backward_closing_over_a_vmap_tracer_in_forward_mode():
    tangents = jax.vmap(lambda y: jax.jvp(_scale_by(y).apply, (1.0,), (1.0,))[1])(jnp.arange(3.0))
    np.testing.assert_allclose(tangents, np.arange(3.0))


def test_jvp_and_backward_closing_over_a_vmap_tracer_in_reverse_mode():
    # jvp runs inline where the tracer lives, and reverse mode transposes it (as for a jax.custom_jvp).
    grads = jax.vmap(lambda y: jax.grad(_scale_by(y).apply)(1.0))(jnp.arange(3.0))
    np.testing.assert_allclose(grads, np.arange(3.0))


def test_ctx_attribute_closing_over_a_vmap_tracer():
    def per_example(y):
        class Scale(vjpkit.Function):
            @staticmethod
            def forward(ctx, x):
                ctx.scale = lambda g: g * y  # static data closing over the enclosing vmap's tracer
                return x * 2.0

            @staticmethod
            def backward(ctx, g):
                return ctx.scale(g)

        return jax.grad(Scale.apply)(1.0)

    np.testing.assert_allclose(jax.vmap(per_example)(jnp.arange(3.0)), np.arange(3.0))


def test_function_argument_closing_over_a_vmap_tracer_under_grad():
    # A static function argument holding the enclosing vmap's tracer (not differentiated): per-example gradients.
    class App(vjpkit.Function):
        @staticmethod
        def forward(ctx, f, x):
            ctx.save_for_backward(x)
            return f(x)

        @staticmethod
        def backward(ctx, g):
            (x,) = ctx.saved_tensors
            return None, 3.0 * g * x  # not f's derivative, so the test sees backward run

    grads = jax.vmap(lambda y: jax.grad(lambda x: App.apply(lambda x: x * y, x))(2.0))(jnp.arange(3.0))
    np.testing.assert_allclose(grads, np.full(3, 6.0))
