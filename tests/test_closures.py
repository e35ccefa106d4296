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
    grads = jax.vmap(lambda y: jax.grad(_scale_by(y).apply)(1.0))(jnp.arange(3.0))
    np.testing.assert_allclose(grads, np.arange(3.0))


# ---------------------------------------------------------------------------
# Reverse mode runs backward and forward mode runs jvp, however the class is built. The rules are not
# forward's derivative (forward rounds; jvp has slope 5 s, backward 2 s), so plain autodiff of forward is
# no reference: a jax.custom_vjp with the same backward and a jax.custom_jvp with the same jvp are.

_X = jnp.array([0.3, 1.2, 2.6])
_T = jnp.array([1.0, 2.0, 4.0])


def _rounding(s, rules=("jvp", "backward")):
    """round(x * s), with a jvp of slope 5 s and a straight-through backward of slope 2 s; all close over s."""
    methods = {"forward": staticmethod(lambda ctx, x: jnp.round(x * s))}
    if "jvp" in rules:
        methods["jvp"] = staticmethod(lambda ctx, t: 5.0 * s * t)
    if "backward" in rules:
        methods["backward"] = staticmethod(lambda ctx, g: 2.0 * s * g)
    return type("Rounding", (vjpkit.Function,), methods).apply


def _rounding_by_custom_vjp(s):
    f = jax.custom_vjp(lambda x: jnp.round(x * s))
    f.defvjp(lambda x: (jnp.round(x * s), None), lambda _, g: (2.0 * s * g,))
    return f


def _rounding_by_custom_jvp(s):
    f = jax.custom_jvp(lambda x: jnp.round(x * s))
    f.defjvp(lambda p, t: (jnp.round(p[0] * s), 5.0 * s * t[0]))
    return f


def _gradient(f):
    return jax.grad(lambda x: (f(x) * x).sum())(_X)


def _tangent(f):
    return jax.jvp(f, (_X,), (_T,))[1]


# How the class is built: each runs ``derivative(make(s))`` for s = 1.5 (s = [1.5, 3.0] under vmap).
_BUILT = {
    "at_module_level": lambda derivative, make: derivative(make(1.5)),
    "inside_jit": lambda derivative, make: jax.jit(lambda s: derivative(make(s)))(1.5),
    "inside_vmap": lambda derivative, make: jax.vmap(lambda s: derivative(make(s)))(jnp.array([1.5, 3.0])),
    "inside_jit_of_vmap": lambda derivative, make: jax.jit(jax.vmap(lambda s: derivative(make(s))))(
        jnp.array([1.5, 3.0])),
    "inside_vmap_of_jit": lambda derivative, make: jax.vmap(jax.jit(lambda s: derivative(make(s))))(
        jnp.array([1.5, 3.0])),
    # Inside a function that jax.grad differentiates (with respect to c, which weighs the result).
    "inside_grad": lambda derivative, make: jax.jit(
        lambda s: jax.grad(lambda c: (c * derivative(make(s))).sum())(jnp.ones(3)))(1.5),
}


@pytest.mark.parametrize("built", sorted(_BUILT))
def test_reverse_mode_runs_backward_however_the_class_is_built(built):
    got = _BUILT[built](_gradient, _rounding)
    np.testing.assert_allclose(got, _BUILT[built](_gradient, _rounding_by_custom_vjp), rtol=1e-6)
    if built == "at_module_level":  # 2 s x + round(s x), s = 1.5
        np.testing.assert_allclose(got, [0.9, 5.6, 11.8], rtol=1e-6)


@pytest.mark.parametrize("built", sorted(_BUILT))
def test_forward_mode_runs_jvp_however_the_class_is_built(built):
    got = _BUILT[built](_tangent, _rounding)
    np.testing.assert_allclose(got, _BUILT[built](_tangent, _rounding_by_custom_jvp), rtol=1e-6)
    if built == "at_module_level":  # 5 s t, s = 1.5
        np.testing.assert_allclose(got, [7.5, 15.0, 30.0], rtol=1e-6)


@pytest.mark.parametrize("built", ["inside_jit", "inside_vmap"])
def test_reverse_mode_runs_backward_of_a_class_with_one_rule(built):
    # Only backward: as a jax.custom_vjp. Only jvp: reverse mode transposes it (slope 5 s).
    got = _BUILT[built](_gradient, lambda s: _rounding(s, ("backward",)))
    np.testing.assert_allclose(got, _BUILT[built](_gradient, _rounding_by_custom_vjp), rtol=1e-6)
    got = _BUILT[built](_gradient, lambda s: _rounding(s, ("jvp",)))
    np.testing.assert_allclose(got, _BUILT[built](_gradient, _rounding_by_custom_jvp), rtol=1e-6)


@pytest.mark.parametrize("built", ["inside_jit", "inside_vmap"])
def test_second_order_takes_each_mode_from_its_own_rule(built):
    # d/dx of the gradient 2 s x + round(s x): 2 s from the product, and round's own derivative by the outer
    # mode's rule: backward's 2 s under jacrev of jacrev, jvp's 5 s under jax.hessian (jacfwd of jacrev).
    def diagonal(hessian):
        return lambda f: jnp.diag(hessian(lambda x: (f(x) * x).sum())(_X))

    s = np.array([[1.5], [3.0]]) if built == "inside_vmap" else 1.5
    by_reverse = _BUILT[built](diagonal(lambda g: jax.jacrev(jax.jacrev(g))), _rounding)
    np.testing.assert_allclose(by_reverse, np.broadcast_to(4.0 * s, np.shape(by_reverse)), rtol=1e-6)
    by_forward = _BUILT[built](diagonal(jax.hessian), _rounding)
    np.testing.assert_allclose(by_forward, np.broadcast_to(7.0 * s, np.shape(by_forward)), rtol=1e-6)


def test_jitted_step_with_a_zero_jvp_and_a_straight_through_backward_gets_backward():
    # The class defined inside the jitted (or vmapped) step, closing over a traced value that is not
    # differentiated: eager, jit and vmap give backward's gradient, 1 per element (as jax.custom_vjp would).
    def step(x, scale):
        class StraightThrough(vjpkit.Function):
            @staticmethod
            def forward(ctx, x):
                return jnp.round(x * scale) / scale

            @staticmethod
            def jvp(ctx, t):
                return jnp.zeros_like(t)

            @staticmethod
            def backward(ctx, g):
                return g

        return jax.grad(lambda x: (StraightThrough.apply(x) * jnp.arange(1.0, 4.0)).sum())(x)

    x = jnp.array([0.2, 0.7, 1.4])
    np.testing.assert_allclose(step(x, 2.0), [1.0, 2.0, 3.0])
    np.testing.assert_allclose(jax.jit(step)(x, 2.0), [1.0, 2.0, 3.0])
    np.testing.assert_allclose(jax.vmap(step, (None, 0))(x, jnp.array([2.0, 4.0])), [[1.0, 2.0, 3.0]] * 2)


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


# ---------------------------------------------------------------------------
# A static argument holding a tracer of an enclosing transformation: the cookbook's Checkpoint with
# functools.partial(layer, key=key) under jax.jit and jax.vmap, answered as eagerly and as the loop.


class _Checkpoint(vjpkit.Function):
    # docs/cookbook.md's recipe: the function called is a static argument, kept on ctx for backward.
    @staticmethod
    def forward(ctx, run_function, *args):
        ctx.run_function, ctx.args = run_function, args
        return run_function(*args)

    @staticmethod
    def backward(ctx, *grads):
        outputs, pullback = jax.vjp(ctx.run_function, *ctx.args)
        return (None, *pullback(grads if isinstance(outputs, tuple) else grads[0]))


def _noisy_layer(w, x, key):
    return jnp.tanh(x * w + jax.random.normal(key, x.shape))


def _checkpointed_loss(w, x, key):
    return _Checkpoint.apply(functools.partial(_noisy_layer, key=key), w, x).sum()


def _plain_loss(w, x, key):
    return _noisy_layer(w, x, key).sum()


_W, _XS = jnp.array([0.5, -1.0, 2.0]), jnp.array([0.3, 0.2, -0.4])
_KEYS = jax.random.split(jax.random.PRNGKey(0), 3)


@pytest.mark.parametrize("transform", [
    pytest.param(lambda g: g, id="eager"),
    pytest.param(jax.jit, id="jit_of_grad"),
])
def test_static_partial_over_a_key_under_jit_equals_the_eager_answer(transform):
    grad = jax.grad(_checkpointed_loss, (0, 1))
    expected = jax.grad(_plain_loss, (0, 1))(_W, _XS, _KEYS[0])
    np.testing.assert_allclose(transform(grad)(_W, _XS, _KEYS[0]), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("order", ["grad_of_jit", "vjp_of_jit"])
def test_static_partial_over_a_key_differentiated_from_outside_a_jit(order):
    # JAX differentiates the jit's program after its trace ended: the key must reach backward as an input.
    expected = jax.grad(_plain_loss)(_W, _XS, _KEYS[0])
    jitted = jax.jit(_checkpointed_loss)
    got = jax.grad(jitted)(_W, _XS, _KEYS[0]) if order == "grad_of_jit" else jax.vjp(
        lambda w: jitted(w, _XS, _KEYS[0]), _W)[1](1.0)[0]
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("transform", [
    pytest.param(lambda f: f, id="vmap"),
    pytest.param(jax.jit, id="jit_of_vmap"),
])
def test_static_partial_over_a_batched_key_under_vmap_equals_the_loop(transform):
    grad = jax.grad(_checkpointed_loss, (0, 1))
    loop = [jax.grad(_plain_loss, (0, 1))(_W, _XS, key) for key in _KEYS]
    expected = [np.stack([g[i] for g in loop]) for i in range(2)]
    got = transform(jax.vmap(grad, (None, None, 0)))(_W, _XS, _KEYS)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


def test_gradient_of_a_vmap_over_keys_of_a_static_partial_equals_the_loop():
    # Reverse mode outside the vmap: backward runs after the vmap's trace, with the batched keys as residuals.
    got = jax.grad(lambda w: jax.vmap(_checkpointed_loss, (None, None, 0))(w, _XS, _KEYS).sum())(_W)
    expected = sum(jax.grad(_plain_loss)(_W, _XS, key) for key in _KEYS)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


def test_static_partial_over_a_differentiated_value_names_the_class():
    # The partial holds w, which the outer jax.grad differentiates: Checkpoint's rules cannot give w's gradient.
    message = r"_Checkpoint.forward uses a value that JAX is differentiating.*holds it in a closure passed in"
    with pytest.raises(TypeError, match=message):
        jax.grad(lambda w: _Checkpoint.apply(functools.partial(_noisy_layer, w, key=_KEYS[0]), _XS).sum())(_W)


# A class whose backward closes over a tracer of an enclosing transformation, differentiated from outside
# it: JAX runs backward after that trace ended, where the tracer no longer lives.


def _noisy_sum(x, key):
    noise = jax.random.normal(key, x.shape)

    class Noisy(vjpkit.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return jnp.tanh(x + noise)

        @staticmethod
        def backward(ctx, g):
            (x,) = ctx.saved_tensors
            return 3.0 * g * (1 - jnp.tanh(x + noise) ** 2)  # 3 times the derivative: backward must run

    return Noisy.apply(x).sum()


def _noisy_expected(x, key):
    return 3.0 * jax.grad(lambda x: jnp.tanh(x + jax.random.normal(key, x.shape)).sum())(x)


@pytest.mark.xfail(strict=True, reason="a backward closing over a jit tracer, run after the jit's trace: "
                   "TypeError: No constant handler for type DynamicJaxprTracer")
def test_gradient_of_a_jit_of_a_class_whose_backward_closes_over_its_tracer():
    got = jax.grad(jax.jit(_noisy_sum))(_XS, _KEYS[0])
    np.testing.assert_allclose(got, _noisy_expected(_XS, _KEYS[0]), rtol=1e-5, atol=1e-6)


@pytest.mark.xfail(strict=True, reason="a backward closing over a vmap tracer, run after the vmap's trace: "
                   "UnexpectedTracerError")
def test_gradient_of_a_vmap_of_a_class_whose_backward_closes_over_its_tracer():
    got = jax.grad(lambda x: jax.vmap(_noisy_sum, (None, 0))(x, _KEYS).sum())(_XS)
    np.testing.assert_allclose(got, sum(_noisy_expected(_XS, key) for key in _KEYS), rtol=1e-5, atol=1e-6)
