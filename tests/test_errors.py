"""Every misuse raises while tracing, with a message naming the Function class,
the method, the position, and expected vs got.

One test per misuse; each asserts the message.
"""

import abc
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from functions import Double, Identity, Mul, Sin, fresh

import vjpkit
from vjpkit import _jax_internals  # a JAX-version flag (which message this JAX gives): no public API says it

X = jnp.array([0.5, -1.0, 2.0])
W = jnp.array([1.5, 2.0, -0.5])


def returning(result_of):
    """A Function ``Bad(x, w, c=2.0)`` whose backward returns ``result_of(g)``."""

    class Bad(vjpkit.Function):
        @staticmethod
        def forward(ctx, x, w, c=2.0):
            return x * w * c

        @staticmethod
        def backward(ctx, g):
            return result_of(g)

    return Bad


def params_returning(result_of):
    """A Function ``Bad(params)``, ``params["w"] * params["b"]``, whose backward returns ``result_of(g)``."""

    class Bad(vjpkit.Function):
        @staticmethod
        def forward(ctx, params):
            return params["w"] * params["b"]

        @staticmethod
        def backward(ctx, g):
            return result_of(g)

    return Bad


def grad_of(f):
    return jax.grad(lambda x, w: f(x, w).sum(), argnums=(0, 1))(X, W)


# ---------------------------------------------------------------------------
# backward's results


def test_too_many_non_none_gradients_raises():
    Bad = returning(lambda g: (g, g, None, g))
    with pytest.raises(TypeError, match=r"Bad\.backward returned 4 gradients, expected 3 \(one per forward input: x, "
                                        r"w, c\)"):
        grad_of(Bad.apply)


def test_too_few_gradients_raises():
    Bad = returning(lambda g: (g, g))
    with pytest.raises(TypeError, match=r"Bad\.backward returned 2 gradients, expected 3 .*x, w, c.*Return None for "
                                        r"inputs"):
        grad_of(Bad.apply)


def test_list_of_gradients_counts_as_one_value():
    Bad = returning(lambda g: [g, g, None])
    with pytest.raises(TypeError, match=r"Bad\.backward returned 1 gradient, expected 3.*A list counts as one value: "
                                        r"return a tuple"):
        grad_of(Bad.apply)


def test_too_many_gradients_for_a_single_input_raises():
    class Bad(Double):
        @staticmethod
        def backward(ctx, g):
            return 2 * g, g

    with pytest.raises(TypeError, match=r"Bad\.backward returned 2 gradients, expected 1 \(one per forward input: x\)"):
        jax.grad(lambda x: Bad.apply(x).sum())(X)


def test_gradient_of_the_wrong_structure_raises():
    Bad = params_returning(lambda g: {"w": g})  # "b" is missing
    params = {"w": X, "b": W}
    with pytest.raises(TypeError, match=r"Bad\.backward returned a gradient for input 0 \('params'\) with structure "
                                        r".*expected the input's structure"):
        jax.grad(lambda p: Bad.apply(p).sum())(params)


def test_gradient_of_the_wrong_shape_raises():
    Bad = returning(lambda g: (g[:2], None, None))
    with pytest.raises(ValueError, match=r"Bad\.backward returned a gradient of shape \(2,\) for input 0 \('x'\): "
                                         r"expected shape \(3,\)"):
        grad_of(Bad.apply)


def test_gradient_of_the_wrong_shape_for_a_leaf_of_a_pytree_input_names_the_leaf():
    Bad = params_returning(lambda g: {"b": g, "w": g[:2]})
    params = {"w": X, "b": W}
    with pytest.raises(ValueError, match=r"Bad\.backward returned a gradient of shape \(2,\) for input 0 "
                                         r"\('params'\) at leaf 1: expected shape \(3,\)"):
        jax.grad(lambda p: Bad.apply(p).sum())(params)


def test_gradient_whose_shape_is_not_a_broadcast_of_the_input_raises():
    # (3, 1) broadcasts *with* (3,) but is not a broadcast *of* it: no sum-down.
    Bad = returning(lambda g: (g[:, None], None, None))
    with pytest.raises(ValueError, match=r"Bad\.backward returned a gradient of shape \(3, 1\) for input 0 \('x'\): "
                                         r"expected shape \(3,\)"):
        grad_of(Bad.apply)


def test_complex_gradient_for_a_real_input_raises():
    Bad = returning(lambda g: (g * (1 + 1j), None, None))
    with pytest.raises(TypeError, match=r"Bad\.backward returned a complex gradient \(complex64\) for input 0 \('x'\), "
                                        r"which is real \(float32\)"):
        grad_of(Bad.apply)


def test_gradient_for_a_static_input_raises():
    Bad = returning(lambda g: (g, g, jnp.sum(g)))
    with pytest.raises(TypeError, match=r"Bad\.backward returned a gradient for input 2 \('c'\), which is static "
                                        r".*expected None, got array"):
        grad_of(Bad.apply)


def test_non_array_gradient_raises():
    Bad = returning(lambda g: ("oops", None, None))
    with pytest.raises(TypeError, match=r"Bad\.backward returned 'oops' \(str\) as the gradient for input 0 \('x'\): "
                                        r"expected an array of shape \(3,\) and dtype float32, or None"):
        grad_of(Bad.apply)


def test_python_float_gradient_raises():
    Bad = returning(lambda g: (1.0, None, None))
    with pytest.raises(TypeError, match=r"Bad\.backward returned 1\.0 \(float\) as the gradient for input 0 \('x'\)"):
        grad_of(Bad.apply)


# ---------------------------------------------------------------------------
# ctx misuse


def test_save_for_backward_of_a_non_array_raises_naming_the_position():
    class Bad(Identity):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x, None, 3.0)
            return x

    with pytest.raises(TypeError, match=r"Bad\.forward: save_for_backward takes arrays or None, but argument 2 is "
                                        r"float \(3\.0\)"):
        Bad.apply(X)


def test_mark_dirty_of_a_non_input_raises():
    class Bad(Double):
        @staticmethod
        def forward(ctx, x):
            y = x * 2
            ctx.mark_dirty(y)
            return y

    with pytest.raises(ValueError, match=r"Bad\.forward: mark_dirty argument 0 \(array of shape \(3,\) and dtype "
                                         r"float32\) is not an input of forward"):
        Bad.apply(X)


def test_returning_a_dirty_input_unchanged_raises():
    class Bad(Identity):
        @staticmethod
        def forward(ctx, x):
            ctx.mark_dirty(x)
            return x

    with pytest.raises(ValueError, match=r"Bad\.forward marked an input dirty \(ctx\.mark_dirty\) and returned that "
                                         r"same input object unchanged"):
        Bad.apply(X)


def test_ctx_used_after_the_call_raises():
    kept = []

    class Leaky(Double):
        @staticmethod
        def forward(ctx, x):
            kept.append(ctx)
            return Double.forward(ctx, x)

    Leaky.apply(X)
    (ctx,) = kept
    with pytest.raises(RuntimeError, match=r"Leaky: ctx\.save_for_backward was used after the call it belongs to had "
                                           r"finished"):
        ctx.save_for_backward(X)
    with pytest.raises(RuntimeError, match=r"Leaky: ctx\.needs_input_grad was used after"):
        ctx.needs_input_grad  # noqa: B018
    with pytest.raises(RuntimeError, match=r"Leaky: ctx\.k was used after"):
        ctx.k = 1.0


def test_missing_ctx_attribute_in_backward_raises_naming_it():
    class Bad(Double):
        @staticmethod
        def backward(ctx, g):
            return g * ctx.scale

    with pytest.raises(AttributeError, match=r"Bad\.backward: ctx has no attribute 'scale'; set it in forward"):
        jax.grad(lambda x: Bad.apply(x).sum())(X)


# ---------------------------------------------------------------------------
# Differentiating what cannot be differentiated


class OnlyForward(vjpkit.Function):
    """2 * x, with neither backward nor jvp."""

    @staticmethod
    def forward(ctx, x):
        return 2 * x


def test_grad_of_a_function_without_backward_raises():
    np.testing.assert_allclose(OnlyForward.apply(X), 2 * X)  # plain evaluation is fine
    with pytest.raises(TypeError, match=r"OnlyForward cannot be differentiated: it defines no backward"):
        jax.grad(lambda x: OnlyForward.apply(x).sum())(X)


def test_jvp_of_a_function_with_only_forward_raises():
    with pytest.raises(TypeError, match=r"OnlyForward cannot be differentiated"):
        jax.jvp(OnlyForward.apply, (X,), (jnp.ones(3),))


def _reverse_only():
    return fresh(Sin, "ReverseOnly")


NO_JVP = (
    r"ReverseOnly has no forward-mode derivative .*defines backward but no jvp.*"
    r"Add a jvp\(ctx, \*tangents\) staticmethod to ReverseOnly"
)


def test_jvp_of_a_function_without_jvp_raises():
    f = _reverse_only().apply
    with pytest.raises(TypeError, match=NO_JVP):
        jax.jvp(f, (X,), (jnp.ones(3),))


def test_jvp_inside_jit_of_a_function_without_jvp_raises():
    f = _reverse_only().apply
    with pytest.raises(TypeError, match=NO_JVP):
        jax.jit(lambda x, t: jax.jvp(f, (x,), (t,)))(X, jnp.ones(3))


def test_jacfwd_of_a_function_without_jvp_raises():
    f = _reverse_only().apply
    with pytest.raises(TypeError, match=NO_JVP):
        jax.jacfwd(f)(X)


def test_jacfwd_inside_jit_of_a_function_without_jvp_raises():
    f = _reverse_only().apply
    with pytest.raises(TypeError, match=NO_JVP):
        jax.jit(jax.jacfwd(f))(X)


def test_jvp_of_a_checkpointed_function_without_jvp_raises():
    f = _reverse_only().apply
    with pytest.raises(TypeError, match=NO_JVP):
        jax.jvp(jax.checkpoint(f), (X,), (jnp.ones(3),))


@pytest.mark.skipif(
    not _jax_internals.LINEARIZE_IS_TOLD_FROM_VJP,
    reason="this JAX lacks LinearizeTrace.is_vjp (jax.linearize is told from jax.vjp from JAX 0.9 on)",
)
def test_linearize_of_a_function_without_jvp_raises():
    f = _reverse_only().apply
    with pytest.raises(TypeError, match=NO_JVP):
        _, f_jvp = jax.linearize(f, X)
        f_jvp(jnp.ones(3))


@pytest.mark.skipif(
    not _jax_internals.LINEARIZE_IS_TOLD_FROM_VJP,
    reason="this JAX lacks LinearizeTrace.is_vjp (jax.linearize is told from jax.vjp from JAX 0.9 on)",
)
def test_linearize_after_grad_of_the_same_function_raises_and_grad_still_works():
    f = _reverse_only().apply
    expected = jax.grad(lambda x: f(x).sum())(X)
    with pytest.raises(TypeError, match=NO_JVP):
        jax.linearize(f, X)
    assert jnp.array_equal(jax.grad(lambda x: f(x).sum())(X), expected)


def test_jvp_after_grad_of_the_same_function_still_raises():
    # Reverse mode first, so JAX may reuse a forward rule it has already traced.
    f = _reverse_only().apply
    jax.grad(lambda x: f(x).sum())(X)
    with pytest.raises(TypeError, match=NO_JVP):
        jax.jvp(f, (X,), (jnp.ones(3),))


# ---------------------------------------------------------------------------
# Defining and calling


def test_unknown_decorator_option_raises():
    with pytest.raises(TypeError, match=r"vjpkit\.function got unknown option\(s\) jitt; expected some of: .*jit"):

        @vjpkit.function(jitt=False)
        class Typo:
            @staticmethod
            def forward(ctx, x):
                return x


def test_apply_with_too_many_arguments_raises():
    with pytest.raises(TypeError, match=r"Mul\.apply takes 2 positional arguments \(x, w\) but 3 were given"):
        Mul.apply(X, W, X)


def test_apply_with_an_unexpected_keyword_raises():
    with pytest.raises(TypeError, match=r"Mul\.apply got an unexpected keyword argument 'v'"):
        Mul.apply(X, v=W)


def test_apply_with_a_missing_argument_raises():
    with pytest.raises(TypeError, match=r"Mul\.apply missing required argument 'w'"):
        Mul.apply(X)


def test_apply_with_an_argument_given_twice_raises():
    with pytest.raises(TypeError, match=r"Mul\.apply got multiple values for argument 'x'"):
        Mul.apply(X, W, x=X)


def test_forward_without_ctx_parameter_raises_at_class_creation():
    with pytest.raises(TypeError, match=r"NoCtx\.forward must take ctx as its first parameter"):

        class NoCtx(vjpkit.Function):
            @staticmethod
            def forward(*, x):
                return x


def test_forward_with_var_keyword_raises_at_class_creation():
    with pytest.raises(TypeError, match=r"Kw\.forward takes \*\*kwargs"):

        class Kw(vjpkit.Function):
            @staticmethod
            def forward(ctx, x, **kwargs):
                return x


def test_forward_returning_no_array_raises():
    class NoArray(vjpkit.Function):
        @staticmethod
        def forward(ctx, x):
            return "done"

    with pytest.raises(TypeError, match=r"NoArray\.forward returned no array \('done'\)"):
        NoArray.apply(X)


@pytest.mark.parametrize("jit", [True, False])
def test_forward_without_a_return_statement_raises(jit):
    class NoReturn(vjpkit.Function):
        @staticmethod
        def forward(ctx, x):
            x * 2

    NoReturn.jit = jit
    NoReturn = vjpkit.function(NoReturn)
    message = "NoReturn.forward returned None: a Function must return at least one array. Did forward forget"
    with pytest.raises(TypeError, match=re.escape(message)):
        NoReturn.apply(X)


@pytest.mark.parametrize("size", [0, -1, 2.5, True])
def test_cache_size_that_is_not_a_positive_int_raises_at_class_creation(size):
    message = f"Tiny.cache_size must be a positive int (the number of compiled programs kept per class), got {size!r}."
    with pytest.raises(ValueError, match=re.escape(message)):

        class Tiny(vjpkit.Function):
            cache_size = size

            @staticmethod
            def forward(ctx, x):
                return x


def test_cache_size_decorator_option_is_checked_too():
    with pytest.raises(ValueError, match=r"Tiny\.cache_size must be a positive int .*got 0\."):

        @vjpkit.function(cache_size=0)
        class Tiny:
            @staticmethod
            def forward(ctx, x):
                return x


def test_decorating_an_abc_subclass_makes_a_function():
    @vjpkit.function
    class PortedDouble(abc.ABC):  # noqa: B024 - an ABC without abstract methods, as ported code has
        forward = staticmethod(Double.forward)  # 2 * x
        backward = staticmethod(Double.backward)

    assert isinstance(PortedDouble, abc.ABCMeta)
    assert jnp.array_equal(PortedDouble(X), 2 * X)
    assert jnp.array_equal(jax.grad(lambda x: PortedDouble.apply(x).sum())(X), jnp.full(3, 2.0))


def test_apply_on_an_instance_works_with_a_deprecation_warning():
    # PyTorch's legacy style: MyFunction().apply(x), which PyTorch only warns about.
    message = "Double should not be instantiated. Methods on Functions are all static, so you should invoke them"
    with pytest.warns(DeprecationWarning, match=re.escape(message)):
        double = Double()
    assert jnp.array_equal(double.apply(X), 2 * X)
    assert jnp.array_equal(jax.grad(lambda x: double.apply(x).sum())(X), jnp.full(3, 2.0))


def test_calling_a_function_without_inputs_still_calls_it():
    class Constant(vjpkit.Function):
        @staticmethod
        def forward(ctx, scale=2.0):
            return jnp.full(3, scale)

    assert jnp.array_equal(Constant(), jnp.full(3, 2.0))


def _user_code_message(method: str, line: str) -> str:
    # The message ends with the place in the user's code: this file, and the line's source.
    return method + r".* At line \d+ of " + re.escape(__file__) + ": `" + re.escape(line) + "`"


def test_item_of_a_traced_array_in_backward_names_the_line_and_the_jax_idiom():
    class Clamp(vjpkit.Function):
        @staticmethod
        def forward(ctx, x, alpha):
            ctx.save_for_backward(alpha)
            return x

        @staticmethod
        def backward(ctx, g):
            (alpha,) = ctx.saved_tensors
            return jnp.clip(g, -alpha.item(), alpha.item()), None

    start = re.escape(
        "Clamp.backward converted a traced array to a Python number (.item(), float(), int() or an index). "
        "backward runs while JAX traces, so its arrays have no values yet: keep the value an array "
        "(jnp.clip(x, -alpha, alpha) takes array bounds"
    )
    line = "return jnp.clip(g, -alpha.item(), alpha.item()), None"
    with pytest.raises(TypeError, match=start + _user_code_message("", line)):
        jax.grad(lambda x: Clamp.apply(x, jnp.asarray(1.0)).sum())(X)


def test_float_of_a_traced_array_in_forward_names_the_line():
    class Scale(vjpkit.Function):
        @staticmethod
        def forward(ctx, x):
            return x * float(x.sum())

    with pytest.raises(TypeError, match=_user_code_message(
        re.escape("Scale.forward converted a traced array to a Python number"), "return x * float(x.sum())"
    )):
        Scale.apply(X)


def test_python_if_on_a_traced_array_names_the_line_and_the_jax_idiom():
    class Sign(vjpkit.Function):
        @staticmethod
        def forward(ctx, x):
            if jnp.any(x > 0):
                return x
            return -x

    start = re.escape(
        "Sign.forward used a traced array as a Python bool (an if, while, and/or, or assert on an array's "
        "value). forward runs while JAX traces, so its arrays have no values yet: select values with "
        "jnp.where(condition, x, y), branch with jax.lax.cond, loop with jax.lax.while_loop."
    )
    with pytest.raises(TypeError, match=start + _user_code_message("", "if jnp.any(x > 0):")):
        Sign.apply(X)


def test_python_while_on_a_traced_array_in_jvp_names_the_method():
    class Halve(vjpkit.Function):
        @staticmethod
        def forward(ctx, x):
            return x / 2

        @staticmethod
        def jvp(ctx, t):
            while jnp.max(jnp.abs(t)) > 1:
                t = t / 2
            return t

    with pytest.raises(TypeError, match=_user_code_message(
        re.escape("Halve.jvp used a traced array as a Python bool"), "while jnp.max(jnp.abs(t)) > 1:"
    )):
        jax.jvp(Halve.apply, (X,), (jnp.ones(3),))


def test_numpy_on_a_traced_array_raises_with_a_hint():
    class HostCode(vjpkit.Function):
        @staticmethod
        def forward(ctx, x):
            return jnp.asarray(np.sort(np.asarray(x)))

        @staticmethod
        def backward(ctx, g):
            return g

    with pytest.raises(TypeError, match=re.escape("HostCode.forward converted a traced JAX array to NumPy")) as info:
        HostCode.apply(X)
    assert "host=True" in str(info.value)
