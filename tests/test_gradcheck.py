"""gradcheck and gradgradcheck: what passes, what is caught, and what the report says.

Wrong backwards are written by hand (``jax.custom_vjp`` or vjpkit
Functions); the true derivatives they are compared with come from
``jax.jacobian`` of the same math in plain ``jnp``, never from gradcheck.
"""

import gc
import itertools
import warnings
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from functions import MulWithJvp, SinWithJvp, elementwise, fresh, once
from gc_functions import Exp, HostRowScale, LinearFunction

import vjpkit

# jax.enable_x64 or its older home. Not the x64 fixture:
# A scope inside one check: the true Jacobian in float64, gradcheck itself run with x64 off.
from vjpkit._jax_internals import enable_x64

RNG = np.random.default_rng(0)
X = RNG.standard_normal((2, 3))
W = RNG.standard_normal((4, 3))
V = np.array([0.7, -1.3, 0.4, -0.2, 1.1])  # away from 0, for kinks at 0


def custom_vjp(fn, bwd):
    """``fn`` with the hand-written backward ``bwd(*args, g) -> grads``."""
    f = jax.custom_vjp(fn)
    f.defvjp(lambda *args: (fn(*args), args), lambda args, g: tuple(bwd(*args, g)))
    return f


def linear(x, w):
    return x @ w.T


# Wrong backwards that several tests check with the same inputs and options:
# defined once, so that gradcheck compiles each check once (it caches per function).
SIN_GRAD_TEN_PERCENT_HIGH = custom_vjp(jnp.sin, lambda x, g: (1.1 * g * jnp.cos(x),))
LINEAR_X_GRAD_TEN_PERCENT_HIGH = custom_vjp(linear, lambda x, w, g: (1.1 * (g @ w), g.T @ x))
LINEAR_W_GRAD_TEN_PERCENT_LOW = custom_vjp(linear, lambda x, w, g: (g @ w, 0.9 * (g.T @ x)))
# The backward hides x from differentiation: right to first order, its own derivative misses g * -sin(x).
SIN_RIGHT_TO_FIRST_ORDER_ONLY = custom_vjp(jnp.sin, lambda x, g: (g * jnp.cos(jax.lax.stop_gradient(x)),))


def mismatches(fn, inputs, **kw):
    with pytest.raises(vjpkit.GradcheckError) as info:
        vjpkit.gradcheck(fn, inputs, **kw)
    return info.value.mismatches


def true_jacobian(fn, inputs, output, argnum):
    """The (input elements, output elements) block of fn's Jacobian, from jax.jacobian."""
    with enable_x64(True):
        jac = jax.jacobian(lambda *a: fn(*a)[output] if output is not None else fn(*a), argnum)(*inputs)
        out_size = np.size(fn(*inputs)[output] if output is not None else fn(*inputs))
    return np.asarray(jac).reshape(out_size, -1).T


# ---------------------------------------------------------------------------
# Correct functions pass.


def test_tutorial_linear_function_passes():
    rng = np.random.default_rng(1)
    inputs = (rng.standard_normal((20, 20)), rng.standard_normal((30, 20)))
    assert vjpkit.gradcheck(LinearFunction.apply, inputs, eps=1e-6, atol=1e-4) is True


def test_linear_function_with_bias_passes():
    assert vjpkit.gradcheck(LinearFunction.apply, (X, W, V[:4]))


def test_plain_jnp_function_passes():
    assert vjpkit.gradcheck(lambda x, w: jnp.tanh(x @ w.T) ** 2, (X, W))


def test_hand_written_custom_vjp_passes():
    f = custom_vjp(linear, lambda x, w, g: (g @ w, g.T @ x))
    assert vjpkit.gradcheck(f, (X, W))


def test_pytree_inputs_and_outputs_pass():
    def f(params, x):
        y = x @ params["w"].T + params["b"]
        return {"y": y, "norms": (jnp.sum(y**2), jnp.sum(params["w"] ** 2))}

    assert vjpkit.gradcheck(f, ({"w": W, "b": V[:4]}, X))


def test_list_inputs_are_positional_arguments():
    assert vjpkit.gradcheck(linear, [X, W])


def test_single_array_input_is_one_argument():
    assert vjpkit.gradcheck(jnp.sin, V)


def test_zero_size_input_passes():
    assert vjpkit.gradcheck(lambda x, e: jnp.sin(x) + jnp.sum(e), (V, np.zeros((0, 3))))


def test_zero_size_output_passes():
    assert vjpkit.gradcheck(lambda x: (jnp.sin(x), x[:0] * 2.0), (V,))


def test_integer_input_is_held_fixed():
    index = np.array([4, 0, 0])
    assert vjpkit.gradcheck(lambda x, i: x[i] ** 2, (V, index))


def test_non_array_inputs_are_held_fixed():
    def f(x, scale, kind):
        return scale * (jnp.sin(x) if kind == "sin" else jnp.cos(x))

    assert vjpkit.gradcheck(f, (V, 3.0, "sin"))


def test_integer_and_non_differentiable_outputs_are_skipped():
    assert vjpkit.gradcheck(lambda x: (jnp.sin(x), jnp.argmax(x), "label"), (V,))


def test_complex_function_passes():
    z = np.array([1.0 + 2.0j, -0.5 + 0.3j])
    assert vjpkit.gradcheck(lambda z: z**2 * jnp.conj(z), (z,))


def test_host_function_passes_without_global_x64():
    # The NumPy code runs on a thread of XLA's, which gradcheck's float64 setting does not reach.
    assert not jax.config.jax_enable_x64
    assert vjpkit.gradcheck(HostRowScale.apply, (X, W[0, :3]))
    assert not jax.config.jax_enable_x64


def test_host_function_with_a_slightly_wrong_backward_is_caught_in_float64():
    # sin in NumPy, saving its input; its slope is 1e-5 too large: lost in float32 rounding.
    Sin = elementwise("Sin", np.sin, lambda x, g: g * np.cos(x) * (1 + 1e-5), "input", doc="a slightly wrong sin")
    Sin = fresh(Sin, host=True)

    (m,) = mismatches(Sin.apply, (V,), atol=1e-9, rtol=1e-7)
    assert m.analytical_value == pytest.approx((1 + 1e-5) * m.numerical_value, rel=1e-9)


# ---------------------------------------------------------------------------
# Wrong backwards are caught, at the right (output, input) pair.


def test_backward_scaled_by_1_1_is_caught():
    f = SIN_GRAD_TEN_PERCENT_HIGH
    (m,) = mismatches(f, (V,))
    assert (m.output_index, m.input_index) == (0, 0)
    assert m.analytical_value == pytest.approx(1.1 * m.numerical_value, rel=1e-6)


def test_transposed_backward_is_caught_for_that_input_only():
    a, b = RNG.standard_normal((3, 3)), RNG.standard_normal((3, 3))
    f = custom_vjp(lambda a, b: a @ b, lambda a, b, g: (g @ b, a.T @ g))  # g @ b.T is right
    (m,) = mismatches(f, (a, b))
    assert (m.output, m.input) == ("output 0", "input 0")


def test_missing_term_is_caught():
    # d/dx x sin(x) = sin(x) + x cos(x); the backward forgets x cos(x).
    f = custom_vjp(lambda x: x * jnp.sin(x), lambda x, g: (g * jnp.sin(x),))
    (m,) = mismatches(f, (V,))
    i = m.input_element[0]
    assert m.output_element == (i,)
    assert m.numerical_value == pytest.approx(np.sin(V[i]) + V[i] * np.cos(V[i]), rel=1e-6)
    assert m.analytical_value == pytest.approx(np.sin(V[i]), rel=1e-12)


def test_wrong_gradient_for_one_input_only_is_reported_for_that_input():
    f = LINEAR_W_GRAD_TEN_PERCENT_LOW
    (m,) = mismatches(f, (X, W))
    assert (m.output_index, m.input_index) == (0, 1)
    assert m.mismatched == np.count_nonzero(true_jacobian(linear, (X, W), None, 1))


def test_backward_wrong_only_where_x_is_negative_is_caught_there():
    def leaky(x):
        return jnp.where(x > 0, x, 0.1 * x)

    f = custom_vjp(leaky, lambda x, g: (jnp.where(x > 0, g, 0.2 * g),))  # slope 0.1 is right
    (m,) = mismatches(f, (V,))
    negative = np.flatnonzero(V < 0)
    assert m.mismatched == len(negative)
    assert m.input_element == (negative[0],)
    assert (m.numerical_value, m.analytical_value) == (pytest.approx(0.1), pytest.approx(0.2))


def test_backward_wrong_only_for_second_output_is_reported_for_that_output():
    def f(x):
        return jnp.sin(x), jnp.cos(x)

    wrong = custom_vjp(f, lambda x, g: (g[0] * jnp.cos(x) + g[1] * jnp.sin(x),))  # -sin is right
    (m,) = mismatches(wrong, (V,))
    assert (m.output, m.input) == ("output 1", "input 0")


def test_mismatch_names_pytree_paths_of_input_and_output():
    def f(params, x):
        return {"y": x @ params["w"].T + params["b"]}

    wrong = custom_vjp(f, lambda p, x, g: ({"w": g["y"].T @ x, "b": 2 * g["y"].sum(0)}, g["y"] @ p["w"]))
    (m,) = mismatches(wrong, ({"b": V[:4], "w": W}, X))
    assert (m.input, m.output) == ("input 0 ['b']", "output 0 ['y']")
    assert (m.input_index, m.input_path, m.output_path) == (0, "['b']", "['y']")


def test_mismatch_holds_both_jacobians_in_pytorch_layout():
    f = LINEAR_X_GRAD_TEN_PERCENT_HIGH
    (m,) = mismatches(f, (X, W))
    expected = true_jacobian(linear, (X, W), None, 0)  # (input elements, output elements)
    np.testing.assert_allclose(m.numerical, expected, atol=1e-8)
    np.testing.assert_allclose(m.analytical, 1.1 * expected, atol=1e-12)


def test_worst_element_is_indexed_in_the_leaves_own_shapes():
    # d y[i, j] / d x[i, k] = w[j, k]: only those pairs are nonzero.
    f = LINEAR_X_GRAD_TEN_PERCENT_HIGH
    (m,) = mismatches(f, (X, W))
    (i, j), (i2, k) = m.output_element, m.input_element
    assert i == i2
    assert m.numerical_value == pytest.approx(W[j, k], rel=1e-6)


def test_complex_mismatch_names_real_and_imaginary_parts():
    z = np.array([1.0 + 2.0j, -0.5 + 0.3j])
    # JAX's VJP of a holomorphic f is g * f'(z); PyTorch's conjugates it.
    f = custom_vjp(lambda z: z**2, lambda z, g: (g * jnp.conj(2 * z),))
    (m,) = mismatches(f, (z,))
    assert m.input_element[-1] in ("real", "imag") and m.output_element[-1] in ("real", "imag")


def test_output_marked_non_differentiable_is_compared_with_a_hint():
    class SinAndSorted(vjpkit.Function):
        @staticmethod
        def forward(ctx, x):
            s = jnp.sort(x)
            ctx.mark_non_differentiable(s)
            ctx.save_for_backward(x)
            return jnp.sin(x), s

        @staticmethod
        def backward(ctx, g, g_sorted):
            (x,) = ctx.saved_tensors
            return g * jnp.cos(x)

    with pytest.raises(vjpkit.GradcheckError, match="(?s)^Jacobian mismatch for output 1 with respect to input 0:"
                       ".*The analytical Jacobian is zero. If output 1 is not meant to be differentiated"):
        vjpkit.gradcheck(SinAndSorted.apply, (V,))
    assert vjpkit.gradcheck(lambda x: SinAndSorted.apply(x)[0], (V,))


def test_every_mismatching_pair_is_reported():
    f = custom_vjp(linear, lambda x, w, g: (2 * (g @ w), 2 * (g.T @ x)))
    assert [(m.output_index, m.input_index) for m in mismatches(f, (X, W))] == [(0, 0), (0, 1)]


def test_nan_gradient_is_a_mismatch():
    f = custom_vjp(jnp.sin, lambda x, g: (g * jnp.nan,))
    (m,) = mismatches(f, (V,))
    assert np.isnan(m.analytical_value)


# ---------------------------------------------------------------------------
# The report.


def test_report_names_pair_worst_element_values_and_differences():
    f = LINEAR_W_GRAD_TEN_PERCENT_LOW
    with pytest.raises(vjpkit.GradcheckError) as info:
        vjpkit.gradcheck(f, (X, W))
    (m,) = info.value.mismatches
    report = str(info.value)
    assert report.startswith("Jacobian mismatch for output 0 with respect to input 1:")
    assert f"worst: output 0 element {m.output_element} with respect to input 1 element {m.input_element}" in report
    assert f"numerical:  {m.numerical_value!r}" in report
    assert f"analytical: {m.analytical_value!r}" in report
    assert f"abs diff:   {m.abs_diff:.6g}" in report and f"rel diff: {m.rel_diff:.6g}" in report
    assert "numerical Jacobian (rows: elements of input 1, columns: elements of output 0), shape (12, 8)" in report


def test_report_truncates_large_jacobians():
    rng = np.random.default_rng(2)
    inputs = (rng.standard_normal((8, 8)), rng.standard_normal((10, 8)))
    f = LINEAR_X_GRAD_TEN_PERCENT_HIGH
    with pytest.raises(vjpkit.GradcheckError) as info:
        vjpkit.gradcheck(f, inputs, eps=1e-6, atol=1e-4)
    report = str(info.value)
    assert "shape (64, 80)" in report and "..." in report
    assert len(report) < 5000  # each Jacobian in full: 5,120 numbers


def test_gradcheck_error_is_a_runtime_error():
    assert issubclass(vjpkit.GradcheckError, RuntimeError)


def test_raise_exception_false_returns_false():
    f = SIN_GRAD_TEN_PERCENT_HIGH
    assert vjpkit.gradcheck(f, (V,), raise_exception=False) is False


def test_tolerances_decide_what_passes():
    f = custom_vjp(jnp.sin, lambda x, g: (1.01 * g * jnp.cos(x),))  # 1% off
    assert not vjpkit.gradcheck(f, (V,), rtol=1e-3, raise_exception=False)
    assert vjpkit.gradcheck(f, (V,), rtol=2e-2)


# ---------------------------------------------------------------------------
# fast_mode.


def test_fast_mode_passes_correct_function():
    rng = np.random.default_rng(1)
    inputs = (rng.standard_normal((20, 20)), rng.standard_normal((30, 20)))
    assert vjpkit.gradcheck(LinearFunction.apply, inputs, eps=1e-6, atol=1e-4, fast_mode=True)


def test_fast_mode_failure_reports_projection_and_full_jacobians():
    f = custom_vjp(linear, lambda x, w, g: (g @ w, 1.1 * (g.T @ x)))
    with pytest.raises(vjpkit.GradcheckError) as info:
        vjpkit.gradcheck(f, (X, W), fast_mode=True)
    report = str(info.value)
    assert report.startswith("Fast-mode Jacobian mismatch for output 0 with respect to input 1: v^T J u")
    assert "The full Jacobians (slow mode)" in report
    assert "Jacobian mismatch for output 0 with respect to input 1:" in report
    assert [(m.output_index, m.input_index) for m in info.value.mismatches] == [(0, 1)]


def test_fast_mode_raise_exception_false_returns_false():
    f = SIN_GRAD_TEN_PERCENT_HIGH
    assert vjpkit.gradcheck(f, (V,), fast_mode=True, raise_exception=False) is False


# ---------------------------------------------------------------------------
# check_undefined_grad.


class SinCos(vjpkit.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(x)
        return jnp.sin(x), jnp.cos(x)

    @staticmethod
    def backward(ctx, g_sin, g_cos):
        (x,) = ctx.saved_tensors
        g = jnp.zeros_like(x)
        if g_sin is not None:
            g = g + g_sin * jnp.cos(x)
        if g_cos is not None:
            g = g - g_cos * jnp.sin(x)
        return g


class SinCosAssumingGradients(SinCos):
    @staticmethod
    def backward(ctx, g_sin, g_cos):
        (x,) = ctx.saved_tensors
        return g_sin * jnp.cos(x) - g_cos * jnp.sin(x)  # fails on None


class SinCosWrongWhenUndefined(SinCos):
    @staticmethod
    def backward(ctx, g_sin, g_cos):
        (x,) = ctx.saved_tensors
        if g_cos is None:
            return 2 * g_sin * jnp.cos(x)
        return g_sin * jnp.cos(x) - g_cos * jnp.sin(x)


def test_backward_handling_undefined_gradients_passes():
    assert vjpkit.gradcheck(SinCos.apply, (V,))


def test_backward_failing_on_undefined_gradient_is_reported():
    with pytest.raises(vjpkit.GradcheckError, match=r"(?s)Backward failed with undefined output gradients: "
                       r"using only output 0 .*raised TypeError"):
        vjpkit.gradcheck(SinCosAssumingGradients.apply, (V,))


def test_backward_wrong_for_undefined_gradient_is_reported():
    with pytest.raises(vjpkit.GradcheckError, match="Backward mishandles undefined output gradients: "
                       "for output 0 with respect to input 0"):
        vjpkit.gradcheck(SinCosWrongWhenUndefined.apply, (V,))


def test_check_undefined_grad_false_skips_that_check():
    assert vjpkit.gradcheck(SinCosAssumingGradients.apply, (V,), check_undefined_grad=False)


# ---------------------------------------------------------------------------
# check_batched_grad, and functions that cannot be vmapped.


def callback_vjp(callback, vmap_method):
    """sin, whose backward calls ``callback(x, g)`` on the host."""

    def bwd(x, g):
        shape = jax.ShapeDtypeStruct(g.shape, g.dtype)
        if vmap_method is None:
            return (_without_vmap(callback, shape)(x, g),)
        return (jax.pure_callback(callback, shape, x, g, vmap_method=vmap_method),)

    return custom_vjp(jnp.sin, bwd)


def _without_vmap(callback, shape):
    """A host call that vmap refuses with NotImplementedError.

    What JAX's pure_callback without a vmap_method does from JAX 0.5 on
    (0.4.38 loops over the batch instead, with a DeprecationWarning).
    """

    @jax.custom_batching.custom_vmap
    def host_call(x, g):
        return jax.pure_callback(callback, shape, x, g, vmap_method="sequential")

    @host_call.def_vmap
    def no_rule(axis_size, in_batched, x, g):
        raise NotImplementedError("this host call has no vmap rule")

    return host_call


def sin_backward(x, g):
    return np.cos(x) * g


def first_example_only(x, g):
    out = np.cos(x) * g
    return out if out.ndim == 1 else np.broadcast_to(out[:1], out.shape)  # ignores the batch


def test_batched_grad_passes_correct_function():
    assert vjpkit.gradcheck(LinearFunction.apply, (X, W), check_batched_grad=True)


def test_backward_wrong_under_vmap_fails_batched_grad_check():
    f = callback_vjp(first_example_only, "expand_dims")
    with pytest.raises(vjpkit.GradcheckError, match="Batched gradient mismatch for output 0 with respect to input 0"):
        vjpkit.gradcheck(f, (V,), check_batched_grad=True)


def test_function_without_vmap_is_checked_in_a_loop_with_a_warning():
    f = callback_vjp(sin_backward, None)
    with pytest.warns(UserWarning, match="the VJP does not support vmap, so gradcheck evaluated it in a sequential "
                                         "loop"):
        assert vjpkit.gradcheck(f, (V,))


def test_backward_without_vmap_fails_batched_grad_check():
    f = callback_vjp(sin_backward, None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(vjpkit.GradcheckError, match="vmap of the VJP over gradients of output 0 raised "
                                                        "NotImplementedError"):
            vjpkit.gradcheck(f, (V,), check_batched_grad=True)


# ---------------------------------------------------------------------------
# nondet_tol.


def noisy_backward(step):
    calls = itertools.count(1)
    return lambda x, g: np.cos(x) * g + step * next(calls)  # differs on every call


def test_nondeterministic_backward_is_reported():
    f = callback_vjp(noisy_backward(1e-9), "sequential")
    with pytest.raises(vjpkit.GradcheckError, match="Backward is not reentrant: .* nondet_tol=0"):
        vjpkit.gradcheck(f, (V,))


def test_nondeterminism_within_nondet_tol_passes():
    f = callback_vjp(noisy_backward(1e-9), "sequential")
    assert vjpkit.gradcheck(f, (V,), nondet_tol=1e-6)


# ---------------------------------------------------------------------------
# check_forward_ad and check_backward_ad.


class SinWithWrongJvp(SinWithJvp):
    @staticmethod
    def jvp(ctx, t):
        (x,) = ctx.saved_tensors
        return 1.1 * t * jnp.cos(x)


class SinWithWrongBackward(SinWithJvp):
    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return 1.1 * g * jnp.cos(x)


def test_forward_ad_passes_for_plain_jax_and_for_a_function_with_jvp():
    assert vjpkit.gradcheck(lambda x, w: jnp.tanh(x @ w.T), (X, W), check_forward_ad=True)
    assert vjpkit.gradcheck(SinWithJvp.apply, (V,), check_forward_ad=True)


def test_wrong_jvp_is_caught_in_forward_mode():
    (m,) = mismatches(SinWithWrongJvp.apply, (V,), check_forward_ad=True)
    assert (m.mode, m.output, m.input) == ("forward", "output 0", "input 0")
    assert m.analytical_value == pytest.approx(1.1 * m.numerical_value, rel=1e-6)


def test_forward_ad_is_skipped_with_a_warning_naming_the_class_without_jvp():
    with pytest.warns(UserWarning, match="skipped check_forward_ad because fn has no forward mode .*LinearFunction"):
        assert vjpkit.gradcheck(LinearFunction.apply, (X, W), check_forward_ad=True)


def test_forward_ad_is_skipped_for_a_custom_vjp():
    f = custom_vjp(jnp.sin, lambda x, g: (g * jnp.cos(x),))
    with pytest.warns(UserWarning, match="skipped check_forward_ad .*custom_vjp"):
        assert vjpkit.gradcheck(f, (V,), check_forward_ad=True)


def test_forward_only_check_without_forward_mode_fails():
    with pytest.raises(vjpkit.GradcheckError, match="Nothing was checked: check_backward_ad=False"):
        vjpkit.gradcheck(LinearFunction.apply, (X, W), check_forward_ad=True, check_backward_ad=False)


def test_check_backward_ad_false_does_not_check_backward():
    assert vjpkit.gradcheck(SinWithWrongBackward.apply, (V,), check_forward_ad=True, check_backward_ad=False)
    assert not vjpkit.gradcheck(SinWithWrongBackward.apply, (V,), raise_exception=False)


def test_fast_mode_checks_forward_ad_too():
    assert vjpkit.gradcheck(SinWithJvp.apply, (V,), fast_mode=True, check_forward_ad=True)
    assert not vjpkit.gradcheck(SinWithWrongJvp.apply, (V,), fast_mode=True, check_forward_ad=True,
                                raise_exception=False)


class Mul(MulWithJvp):
    """MulWithJvp with materialization off: its jvp gets None for an input without a tangent, and handles it."""

    @staticmethod
    def forward(ctx, x, y):
        ctx.set_materialize_grads(False)
        return MulWithJvp.forward(ctx, x, y)

    @staticmethod
    def jvp(ctx, tx, ty):
        x, y = ctx.saved_tensors
        out = jnp.zeros_like(x)
        if tx is not None:
            out = out + tx * y
        if ty is not None:
            out = out + x * ty
        return out


class MulAssumingTangents(Mul):
    @staticmethod
    def jvp(ctx, tx, ty):
        x, y = ctx.saved_tensors
        return tx * y + x * ty  # fails on None


class MulWrongWhenUndefined(Mul):
    @staticmethod
    def jvp(ctx, tx, ty):
        x, y = ctx.saved_tensors
        if ty is None:
            return 2 * tx * y
        return tx * y + x * ty if tx is not None else x * ty


def test_jvp_handling_undefined_tangents_passes():
    assert vjpkit.gradcheck(Mul.apply, (V, V[::-1]), check_forward_ad=True)


def test_jvp_failing_on_undefined_tangent_is_reported():
    with pytest.raises(vjpkit.GradcheckError, match=r"(?s)Forward mode failed with undefined input tangents: "
                       r"differentiating with respect to input 0 alone .*raised TypeError"):
        vjpkit.gradcheck(MulAssumingTangents.apply, (V, V[::-1]), check_forward_ad=True)


def test_jvp_wrong_for_undefined_tangent_is_reported():
    with pytest.raises(vjpkit.GradcheckError, match="Forward mode mishandles undefined input tangents: "
                       "for output 0 with respect to input 0"):
        vjpkit.gradcheck(MulWrongWhenUndefined.apply, (V, V[::-1]), check_forward_ad=True)


def test_fast_mode_forward_mismatch_is_reported():
    with pytest.raises(vjpkit.GradcheckError, match="Fast-mode Jacobian computed with forward mode mismatch for "
                       "output 0 with respect to input 0: J u differs from the numerical J u by up to"):
        vjpkit.gradcheck(SinWithWrongJvp.apply, (V,), fast_mode=True, check_forward_ad=True)


def test_fast_mode_failure_that_slow_mode_passes_says_so():
    # Every element is 0.09% off (within rtol=0.1%), always upwards, while the signs of
    # the derivatives alternate: the projection v^T J u nearly cancels, its error does not.
    signs = np.where(np.arange(400) % 2 == 0, 1.0, -1.0)
    f = custom_vjp(lambda x: x * signs, lambda x, g: (g * (signs + 9e-4),))
    with pytest.raises(vjpkit.GradcheckError, match="The full Jacobians \\(slow mode\\) agree element by element "
                       "within atol and rtol: fast mode failed only through its projected tolerance"):
        vjpkit.gradcheck(f, (np.ones(400),), atol=0.0, fast_mode=True)
    assert vjpkit.gradcheck(f, (np.ones(400),), atol=0.0)


# ---------------------------------------------------------------------------
# Precision: float64 for gradcheck's own work, nothing leaks out.


def test_float32_input_warns_and_is_checked_in_float64():
    with pytest.warns(UserWarning, match="input 0 has dtype float32; gradcheck casts it to double precision"):
        assert vjpkit.gradcheck(jnp.sin, (V.astype(np.float32),))


def test_float32_output_warns():
    with pytest.warns(UserWarning, match="output 0 has dtype float32 although fn ran on float64 inputs"):
        vjpkit.gradcheck(lambda x: jnp.sin(x).astype(jnp.float32), (V,), atol=1e-2, raise_exception=False)


def test_warnings_name_the_callers_line_also_through_vjpkit_testing():
    with pytest.warns(UserWarning, match="input 0 has dtype float32") as direct:
        vjpkit.gradcheck(jnp.sin, (V.astype(np.float32),))
    with pytest.warns(UserWarning, match="input 0 has dtype float32") as through_testing:
        vjpkit.testing.assert_gradcheck(jnp.sin, (V.astype(np.float32),))
    assert [w.filename for w in direct] == [__file__]
    assert [w.filename for w in through_testing] == [__file__]


def test_x64_setting_does_not_leak_into_the_caller():
    before = jax.config.jax_enable_x64
    vjpkit.gradcheck(jnp.sin, (V,))
    assert jax.config.jax_enable_x64 == before
    assert jnp.zeros(1).dtype == (jnp.float64 if before else jnp.float32)


# ---------------------------------------------------------------------------
# Compilation: one program per (function, input signature, options).


def counting_sin(traces):
    """``sin``; appends to ``traces`` each time JAX traces it."""

    def f(x):
        traces.append(1)
        return jnp.sin(x)

    return f


def test_repeated_check_does_not_retrace():
    traces = []
    f = counting_sin(traces)
    vjpkit.gradcheck(f, (V,))
    first = len(traces)
    vjpkit.gradcheck(f, (V + 1.0,), eps=1e-5, atol=1e-4, rtol=1e-2)
    assert len(traces) == first


def test_new_input_shape_compiles_a_new_program():
    traces = []
    f = counting_sin(traces)
    vjpkit.gradcheck(f, (V,))
    first = len(traces)
    vjpkit.gradcheck(f, (V[:3],))
    assert len(traces) > first


def test_a_bound_method_is_checked_from_the_cache_the_second_time():
    class Model:
        def __init__(self):
            self.traces = 0

        def __call__(self, x):
            self.traces += 1
            return jnp.sin(x)

        def apply(self, x):
            return self(x)

    model = Model()
    vjpkit.gradcheck(model.apply, (V,))
    first = model.traces
    vjpkit.gradcheck(model.apply, (V,))  # a new bound method object, the same method
    assert model.traces == first


def scaled_sin_over(scale):
    def scaled_sin(x):
        return jnp.sin(x) * scale[: x.shape[0]]

    return scaled_sin


def test_deleting_a_checked_function_frees_the_array_its_closure_holds():
    big = np.linspace(0.5, 1.5, 1 << 20)  # 8 MB
    released = weakref.ref(big)
    fn = scaled_sin_over(big)
    del big  # now only fn's closure holds it
    assert vjpkit.gradcheck(fn, (V,))
    del fn
    gc.collect()
    assert released() is None


def test_clear_caches_makes_the_next_check_trace_again():
    traces = []
    f = counting_sin(traces)
    vjpkit.gradcheck(f, (V,))
    first = len(traces)
    vjpkit.clear_caches()
    vjpkit.gradcheck(f, (V,))
    assert len(traces) > first


def times_int8_successor(x, n):
    """``x * (n + int8(1))``: for n = 127, 128 when n is a strong int32, -128 when weakly typed (int8 wraps)."""
    return x * (n + jnp.int8(1)).astype(x.dtype)


# The backward is right only where n + int8(1) is 128: for a strongly typed n.
TIMES_128_BACKWARD = custom_vjp(times_int8_successor, lambda x, n, g: (g * 128.0, None))


def test_a_weakly_typed_integer_input_is_checked_apart_from_a_strongly_typed_one():
    strong, weak = jnp.asarray(127, dtype=jnp.int32), jnp.asarray(127)
    assert (strong.weak_type, weak.weak_type) == (False, True)
    assert vjpkit.gradcheck(TIMES_128_BACKWARD, (V, strong))
    assert vjpkit.gradcheck(TIMES_128_BACKWARD, (V, weak), raise_exception=False) is False


def test_a_check_under_another_jax_configuration_traces_again():
    f = lambda x: x + x[:, None]  # noqa: E731  # rank promotion
    assert vjpkit.gradcheck(f, (V,))
    with jax.numpy_rank_promotion("raise"):
        with pytest.raises(ValueError, match="jax_numpy_rank_promotion='raise'"):
            vjpkit.gradcheck(f, (V,))


def test_a_check_under_detect_anomaly_traces_again():
    traces = []
    f = counting_sin(traces)
    vjpkit.gradcheck(f, (V,))
    first = len(traces)
    with vjpkit.detect_anomaly():
        vjpkit.gradcheck(f, (V,))
    assert len(traces) > first


class MulWithWrongBackwardForY(Mul):
    @staticmethod
    def backward(ctx, g):
        x, y = ctx.saved_tensors
        return g * y, 1.1 * g * x


def test_a_failing_check_run_again_reports_the_same_mismatch():
    # The first failure also compiles the report program, whose rows come in another order.
    for _ in range(2):
        found = mismatches(MulWithWrongBackwardForY.apply, (V, V + 1.0), check_forward_ad=True)
        assert [(m.mode, m.input) for m in found] == [("backward", "input 1")]


# ---------------------------------------------------------------------------
# Argument errors.


def test_both_modes_off_is_an_error():
    with pytest.raises(ValueError, match="expected at least one of check_forward_ad or check_backward_ad to be True"):
        vjpkit.gradcheck(jnp.sin, (V,), check_backward_ad=False)


def test_batched_grad_without_backward_is_an_error():
    with pytest.raises(ValueError, match="check_batched_grad=True checks vmap of the VJP, so it requires "
                                         "check_backward_ad=True"):
        vjpkit.gradcheck(jnp.sin, (V,), check_batched_grad=True, check_forward_ad=True, check_backward_ad=False)


def test_non_positive_eps_is_an_error():
    with pytest.raises(ValueError, match="eps must be positive, got 0.0"):
        vjpkit.gradcheck(jnp.sin, (V,), eps=0.0)


def test_negative_tolerance_is_an_error():
    with pytest.raises(ValueError, match="atol must be non-negative, got -1.0"):
        vjpkit.gradcheck(jnp.sin, (V,), atol=-1.0)


def test_no_floating_point_input_is_an_error():
    with pytest.raises(ValueError, match="no floating-point or complex array among the inputs"):
        vjpkit.gradcheck(lambda i: i * 2, (np.arange(3),))


def test_errors_raised_by_the_function_propagate():
    def f(x):
        raise KeyError("boom")

    with pytest.raises(KeyError, match="boom"):
        vjpkit.gradcheck(f, (V,), raise_exception=False)


# ---------------------------------------------------------------------------
# gradgradcheck.


def test_gradgradcheck_passes_plain_jax():
    assert vjpkit.gradgradcheck(lambda x, w: jnp.tanh(x @ w.T), (X, W))


def test_gradgradcheck_passes_function_whose_backward_uses_saved_output():
    assert vjpkit.gradgradcheck(Exp.apply, (V,))


def test_gradgradcheck_passes_tutorial_linear_function_with_bias():
    assert vjpkit.gradgradcheck(LinearFunction.apply, (X, W, V[:4]))


def test_gradgradcheck_catches_backward_that_is_right_only_to_first_order():
    # The backward hides x from differentiation: its own derivative is missing g * -sin(x).
    f = SIN_RIGHT_TO_FIRST_ORDER_ONLY
    assert vjpkit.gradcheck(f, (V,))
    with pytest.raises(vjpkit.GradcheckError) as info:
        vjpkit.gradgradcheck(f, (V,))
    (m,) = info.value.mismatches
    assert (m.output, m.input) == ("the gradient of input 0", "input 0")


def test_gradgradcheck_names_grad_outputs_in_the_report():
    # The backward hides g from differentiation: its derivative in g is missing.
    f = custom_vjp(jnp.sin, lambda x, g: (jax.lax.stop_gradient(g) * jnp.cos(x),))
    with pytest.raises(vjpkit.GradcheckError) as info:
        vjpkit.gradgradcheck(f, (V,))
    (m,) = info.value.mismatches
    assert (m.output, m.input) == ("the gradient of input 0", "grad_outputs[0]")
    assert "Jacobian mismatch for the gradient of input 0 with respect to grad_outputs[0]:" in str(info.value)


def test_gradgradcheck_uses_given_grad_outputs():
    # The missing second-order term is -g * sin(x): invisible where g is zero.
    f = SIN_RIGHT_TO_FIRST_ORDER_ONLY
    assert vjpkit.gradgradcheck(f, (V,), (np.zeros(5),))
    assert vjpkit.gradgradcheck(f, (V,), np.zeros(5))  # a single array for a single output
    assert not vjpkit.gradgradcheck(f, (V,), (np.ones(5),), raise_exception=False)


def test_gradgradcheck_rejects_grad_outputs_of_the_wrong_shape():
    with pytest.raises(ValueError, match=r"grad_outputs must hold one floating-point array per differentiable "
                       r"output of fn, with shapes \[\(5,\)\]; got \['ndarray\(4,\)'\]"):
        vjpkit.gradgradcheck(jnp.sin, (V,), (np.ones(4),))


def test_gradgradcheck_of_once_differentiable_backward_raises_its_error():
    OnceExp = once(Exp, "OnceExp")
    assert vjpkit.gradcheck(OnceExp.apply, (V,))
    with pytest.raises(RuntimeError, match="OnceExp.backward is decorated with @once_differentiable") as info:
        vjpkit.gradgradcheck(OnceExp.apply, (V,))
    assert type(info.value) is RuntimeError  # the decorator's own error, not a GradcheckError


def test_gradgradcheck_raise_exception_false_returns_false():
    f = SIN_RIGHT_TO_FIRST_ORDER_ONLY
    assert vjpkit.gradgradcheck(f, (V,), raise_exception=False) is False
