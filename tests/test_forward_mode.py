"""Forward mode: ``jvp`` alone, and ``jvp`` with ``backward`` on one Function.

Every expected value is JAX autodiff of the same math written in plain jnp.
"""

import collections
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from functions import (
    Double,
    DoubleNoRules,
    ExpWithJvp,
    SinCosWithJvp,
    SinJvpOnly,
    SinWithJvp,
    StraightThroughZeroJvp,
    fresh,
)

import vjpkit
from vjpkit import _jax_internals

# ---------------------------------------------------------------------------
# Functions with both rules, each paired with its plain-jnp reference.


class Linear(vjpkit.Function):
    @staticmethod
    def forward(ctx, x, w, b):
        ctx.save_for_backward(x, w)
        ctx.save_for_forward(x, w)
        return x @ w.T + b

    @staticmethod
    def jvp(ctx, tx, tw, tb):
        x, w = ctx.saved_tensors
        return tx @ w.T + x @ tw.T + tb

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        return g @ w, g.T @ x, g.sum(0)


class Softmax(vjpkit.Function):
    @staticmethod
    def forward(ctx, x):
        y = jax.nn.softmax(x, axis=-1)
        ctx.save_for_backward(y)
        ctx.save_for_forward(y)
        return y

    @staticmethod
    def jvp(ctx, t):
        (y,) = ctx.saved_tensors
        return y * (t - (y * t).sum(-1, keepdims=True))

    @staticmethod
    def backward(ctx, g):
        (y,) = ctx.saved_tensors
        return y * (g - (y * g).sum(-1, keepdims=True))


W = jnp.array([[0.3, -0.2, 0.5], [0.1, 0.4, -0.6]])
B = jnp.array([0.05, -0.1])

# name -> (vjpkit function of x, plain-jnp function of x)
CASES = {
    "sin": (SinWithJvp.apply, jnp.sin),
    "exp": (ExpWithJvp.apply, jnp.exp),
    "linear": (lambda x: Linear.apply(x, W, B), lambda x: x @ W.T + B),
    "softmax": (Softmax.apply, lambda x: jax.nn.softmax(x, axis=-1)),
}
X = jnp.array([[0.2, -0.5, 0.9], [1.1, 0.3, -0.7]])


def scalar(f):
    return lambda x: jnp.sum(f(x) ** 2)


def scan_of(f):
    def body(carry, row):
        return carry + jnp.sum(f(row[None])), None

    return lambda x: jax.lax.scan(body, 0.0, x)[0]


# transformation name -> how to apply it to (function, x)
TRANSFORMS = {
    "jvp": lambda f, x: jax.jvp(f, (x,), (jnp.ones_like(x),)),
    "linearize": lambda f, x: jax.linearize(f, x)[1](jnp.ones_like(x)),
    "jacfwd": lambda f, x: jax.jacfwd(f)(x),
    "grad": lambda f, x: jax.grad(scalar(f))(x),
    "vjp": lambda f, x: jax.vjp(f, x)[1](jnp.ones_like(f(x))),
    "jacrev": lambda f, x: jax.jacrev(f)(x),
    "hessian": lambda f, x: jax.hessian(scalar(f))(x),
    "jacfwd(jacrev)": lambda f, x: jax.jacfwd(jax.jacrev(scalar(f)))(x),
    "jacrev(jacfwd)": lambda f, x: jax.jacrev(jax.jacfwd(scalar(f)))(x),
    "jit(jacfwd)": lambda f, x: jax.jit(jax.jacfwd(f))(x),
    "vmap(jacfwd)": lambda f, x: jax.vmap(jax.jacfwd(lambda r: f(r[None])[0]))(x),
    "vmap(grad)": lambda f, x: jax.vmap(jax.grad(lambda r: jnp.sum(f(r[None]) ** 2)))(x),
    "jvp(vmap)": lambda f, x: jax.jvp(jax.vmap(lambda r: f(r[None])[0]), (x,), (jnp.ones_like(x),)),
    "grad(scan)": lambda f, x: jax.grad(scan_of(f))(x),
    "jvp(scan)": lambda f, x: jax.jvp(scan_of(f), (x,), (jnp.ones_like(x),)),
    "grad(checkpoint)": lambda f, x: jax.grad(jax.checkpoint(scalar(f)))(x),
    "jvp(checkpoint)": lambda f, x: jax.jvp(jax.checkpoint(f), (x,), (jnp.ones_like(x),)),
    "jit(hessian)": lambda f, x: jax.jit(jax.hessian(scalar(f)))(x),
}


@pytest.mark.parametrize("transform", TRANSFORMS)
@pytest.mark.parametrize("case", CASES)
def test_both_rules_match_autodiff_under(case, transform):
    f, reference = CASES[case]
    apply_transform = TRANSFORMS[transform]
    # The plain-jnp reference jitted: op by op, it would compile a program per operation.
    chex.assert_trees_all_close(
        apply_transform(f, X), jax.jit(lambda x: apply_transform(reference, x))(X), rtol=1e-5, atol=1e-6
    )


# ---------------------------------------------------------------------------
# Each mode uses its own rule.


def counting_sin():
    calls = collections.Counter()

    class CountingSin(SinWithJvp):  # its forward
        @staticmethod
        def jvp(ctx, t):
            calls["jvp"] += 1
            (x,) = ctx.saved_tensors
            return jnp.cos(x) * t

        @staticmethod
        def backward(ctx, g):
            calls["backward"] += 1
            (x,) = ctx.saved_tensors
            return jnp.cos(x) * g

    return CountingSin, calls


@pytest.mark.parametrize(
    ("run", "rule", "other_rule"),
    [
        (lambda f, x: jax.jvp(f, (x,), (x,)), "jvp", "backward"),
        (lambda f, x: jax.jacfwd(f)(x), "jvp", "backward"),
        (lambda f, x: jax.linearize(f, x)[1](x), "jvp", "backward"),
        (lambda f, x: jax.grad(lambda x: f(x).sum())(x), "backward", "jvp"),
        (lambda f, x: jax.vjp(f, x)[1](x), "backward", "jvp"),
        (lambda f, x: jax.jacrev(f)(x), "backward", "jvp"),
    ],
    ids=["forward-jvp", "forward-jacfwd", "forward-linearize", "reverse-grad", "reverse-vjp", "reverse-jacrev"],
)
def test_forward_mode_calls_jvp_and_reverse_mode_backward_never_the_other(run, rule, other_rule):
    cls, calls = counting_sin()
    run(cls.apply, jnp.arange(3.0))
    assert calls[rule] >= 1
    assert calls[other_rule] == 0


# ---------------------------------------------------------------------------
# ctx in jvp.


@pytest.mark.parametrize("batched", [False, True], ids=["one", "vmap"])
def test_linearize_runs_jvp_when_the_rules_differ(batched):
    # Before JAX 0.9 jax.linearize shares reverse mode's record of the call; evaluated, the record runs jvp,
    # under a vmap too, as the loop over the examples does (it ran backward transposed there: 2s, not 0s).
    x, w, t = jnp.arange(6.0).reshape(3, 2), jnp.float32(2.0), jnp.ones((3, 2))

    def linearized(x, t):
        _, f_jvp = jax.linearize(StraightThroughZeroJvp.apply, x, w)
        return f_jvp(t, jnp.float32(1.0))

    loop = jnp.stack([linearized(x[i], t[i]) for i in range(3)])
    chex.assert_trees_all_close(loop, jnp.zeros((3, 2)))
    got = jax.vmap(linearized)(x, t) if batched else linearized(x, t)
    chex.assert_trees_all_close(got, loop if batched else jnp.zeros((3, 2)))


def test_saved_tensors_in_jvp_are_what_save_for_forward_saved():
    # backward's saved value is 10 x: a jvp that saw it would give 10x the tangent.
    class Both(vjpkit.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x * 10)
            ctx.save_for_forward(x)
            return x**2

        @staticmethod
        def jvp(ctx, t):
            (x,) = ctx.saved_tensors
            return 2 * x * t

        @staticmethod
        def backward(ctx, g):
            (x10,) = ctx.saved_tensors
            return 2 * (x10 / 10) * g

    x = jnp.array([1.0, 2.0])
    _, tangent = jax.jvp(Both.apply, (x,), (jnp.ones(2),))
    np.testing.assert_allclose(tangent, [2.0, 4.0])
    np.testing.assert_allclose(jax.grad(lambda x: Both.apply(x).sum())(x), [2.0, 4.0])


def test_jvp_gets_none_for_static_inputs_and_zeros_for_unperturbed_inputs():
    seen = {}

    class Scale(vjpkit.Function):
        @staticmethod
        def forward(ctx, x, y, k):
            ctx.save_for_forward(x, y)
            return x * y * k

        @staticmethod
        def jvp(ctx, tx, ty, tk):
            seen.update(ty_shape=None if ty is None else ty.shape, tk=tk, needs=ctx.needs_input_grad)
            x, y = ctx.saved_tensors
            return (tx * y + x * ty) * 3.0

    x, y = jnp.array([1.0, 2.0]), jnp.array([3.0, 4.0])
    _, t = jax.jvp(lambda x: Scale.apply(x, y, 3.0), (x,), (jnp.ones(2),))
    np.testing.assert_allclose(t, 3.0 * y)
    assert seen["tk"] is None
    assert seen["ty_shape"] == (2,)  # zeros: the result above has no x * ty term
    assert seen["needs"] == (True, False, False)


def test_jvp_gets_none_for_unperturbed_inputs_without_materialization():
    seen = {}

    class Mul(vjpkit.Function):
        @staticmethod
        def forward(ctx, x, y):
            ctx.set_materialize_grads(False)
            ctx.save_for_forward(x, y)
            return x * y

        @staticmethod
        def jvp(ctx, tx, ty):
            seen["ty"] = ty
            x, y = ctx.saved_tensors
            return tx * y if ty is None else tx * y + x * ty

    x, y = jnp.array([1.0, 2.0]), jnp.array([3.0, 4.0])
    _, t = jax.jvp(lambda x: Mul.apply(x, y), (x,), (jnp.ones(2),))
    np.testing.assert_allclose(t, y)
    assert seen["ty"] is None


def test_backward_sees_none_for_unused_output_without_materialization_on_the_both_rules_path():
    seen = {}

    class Pair(vjpkit.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.set_materialize_grads(False)
            return x * 2, x * 3

        @staticmethod
        def jvp(ctx, t):
            return t * 2, t * 3

        @staticmethod
        def backward(ctx, g_first, g_second):
            seen["second"] = g_second
            return 2 * g_first

    np.testing.assert_allclose(jax.grad(lambda x: Pair.apply(x)[0].sum())(jnp.ones(2)), [2.0, 2.0])
    assert seen["second"] is None


def test_tuple_output_gets_one_tangent_per_element():
    x = jnp.array([0.3, 0.7])
    _, (ts, tc) = jax.jvp(SinCosWithJvp.apply, (x,), (jnp.ones(2),))
    np.testing.assert_allclose(ts, jnp.cos(x), rtol=1e-6)
    np.testing.assert_allclose(tc, -jnp.sin(x), rtol=1e-6)


# ---------------------------------------------------------------------------
# jvp only: reverse mode by transposing the jvp.


@pytest.mark.parametrize("transform", ["grad", "vjp", "jacrev", "hessian", "vmap(grad)", "jacrev(jacfwd)"])
def test_jvp_only_gets_reverse_mode_by_transposing_the_jvp(transform):
    apply_transform = TRANSFORMS[transform]
    chex.assert_trees_all_close(
        apply_transform(SinJvpOnly.apply, X), apply_transform(jnp.sin, X), rtol=1e-5, atol=1e-6
    )


def test_jvp_only_with_a_nonlinear_jvp_raises_naming_the_class_in_reverse_mode():
    class NotLinear(DoubleNoRules):
        @staticmethod
        def jvp(ctx, t):
            return t**2  # not linear in t

    with pytest.raises(TypeError, match=r"NotLinear defines jvp but no backward.*linear in the tangents"):
        jax.grad(lambda x: NotLinear.apply(x).sum())(jnp.ones(2))


@pytest.mark.parametrize(
    "jvp", [lambda ctx, t: t * t, lambda ctx, t: jnp.where(t > 0, t, 0.0)], ids=["product", "comparison"]
)
def test_jvp_only_with_a_nonlinear_jvp_says_what_is_not_linear(jvp):
    # JAX's own report there is an internal assertion: empty, or a tuple of its accumulators.
    NotLinear = fresh(DoubleNoRules, "NotLinear", jvp=staticmethod(jvp))
    message = (
        "transposing it failed: JAX met an operation that is not linear in the tangents (such as a product "
        "of two tangents, or a comparison or branch on one). Define NotLinear.backward(ctx, *grad_outputs) instead."
    )
    with pytest.raises(TypeError, match=re.escape(message)):
        jax.grad(lambda x: NotLinear.apply(x).sum())(jnp.ones(2))


# ---------------------------------------------------------------------------
# jvp misuse.


def test_jvp_returning_too_many_tangents_raises_naming_the_class():
    class TooMany(vjpkit.Function):
        @staticmethod
        def forward(ctx, x):
            return x, 2 * x

        @staticmethod
        def jvp(ctx, t):
            return t, 2 * t, 3 * t

    with pytest.raises(TypeError, match=r"TooMany\.jvp returned 3 tangents, expected 2 \(one per output"):
        jax.jvp(TooMany.apply, (jnp.ones(2),), (jnp.ones(2),))


def test_jvp_returning_a_wrong_shape_raises_naming_the_class():
    class BadShape(DoubleNoRules):
        @staticmethod
        def jvp(ctx, t):
            return jnp.ones(5)

    with pytest.raises(ValueError, match=r"BadShape\.jvp returned a tangent of shape \(5,\) for output 0: expected "
                                         r"shape \(2,\)"):
        jax.jvp(BadShape.apply, (jnp.ones(2),), (jnp.ones(2),))


def test_jvp_returning_a_complex_tangent_for_a_real_output_raises():
    # As backward's complex gradient for a real input does: no silent cast to the real part.
    class Complexify(DoubleNoRules):
        @staticmethod
        def jvp(ctx, t):
            return 2 * t * (1 + 1j)

    with pytest.raises(TypeError, match=re.escape(
        "Complexify.jvp returned a complex tangent (complex64) for output 0, which is real (float32): "
        "expected dtype float32. Take the real part explicitly if that is what you mean."
    )):
        jax.jvp(Complexify.apply, (jnp.ones(2),), (jnp.ones(2),))


def test_backward_only_function_still_raises_naming_the_class_in_forward_mode():
    OnlyBackward = fresh(Double, "OnlyBackward")

    with pytest.raises(TypeError, match=r"OnlyBackward has no forward-mode derivative.*define|OnlyBackward has no "
                                        r"forward-mode derivative.*jvp\(ctx, \*tangents\)"):
        jax.jacfwd(OnlyBackward.apply)(jnp.ones(2))


def test_once_differentiable_backward_raises_under_hessian_with_both_rules():
    class Cube(vjpkit.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            ctx.save_for_forward(x)
            return x**3

        @staticmethod
        def jvp(ctx, t):
            (x,) = ctx.saved_tensors
            return 3 * x**2 * t

        @staticmethod
        @vjpkit.once_differentiable
        def backward(ctx, g):
            (x,) = ctx.saved_tensors
            return 3 * x**2 * g

    x = jnp.array([1.0, 2.0])
    np.testing.assert_allclose(jax.grad(lambda x: Cube.apply(x).sum())(x), [3.0, 12.0])
    with pytest.raises(RuntimeError, match=r"Cube\.backward is decorated with @once_differentiable") as info:
        jax.jacrev(jax.grad(lambda x: Cube.apply(x).sum()))(x)
    assert type(info.value) is RuntimeError


# ---------------------------------------------------------------------------
# The linear function of jax.linearize, and a remat policy: what jvp computes from the residuals is kept.


def counting_sin_and_cos(counts):
    """``sin`` and ``cos`` that count their runs (host callbacks: each run of the program calls them)."""

    def counted(name, fn):
        def host(x):
            counts[name] += 1
            return fn(x).astype(x.dtype)

        return lambda x: jax.pure_callback(host, jax.ShapeDtypeStruct(x.shape, x.dtype), x)

    return counted("sin", np.sin), counted("cos", np.cos)


POLICIES = {
    "no checkpoint": None,
    "everything_saveable": jax.checkpoint_policies.everything_saveable,
    "save_anything_except_these_names": jax.checkpoint_policies.save_anything_except_these_names("other"),
    "nothing_saveable": jax.checkpoint_policies.nothing_saveable,
}


@pytest.mark.skipif(
    not _jax_internals.LINEARIZE_IS_TOLD_FROM_VJP,
    reason="this JAX lacks LinearizeTrace.is_vjp (jax.linearize is told from jax.vjp from JAX 0.9 on)",
)
@pytest.mark.parametrize("policy", POLICIES)
def test_the_linear_function_keeps_what_jvp_computes_from_the_residuals_as_a_custom_jvp_does(policy):
    # Issue 29 item 4: jax.linearize's linear function ran jvp's cos(x) again on every call, (sin, cos) runs
    # (0, 1) per call where jax.custom_jvp gives (0, 0), and no remat policy could save it.
    counts = collections.Counter()
    sin, cos = counting_sin_and_cos(counts)

    class CountedSin(vjpkit.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_forward(x)
            ctx.save_for_backward(x)
            return sin(x)

        @staticmethod
        def jvp(ctx, t):
            (x,) = ctx.saved_tensors
            return cos(x) * t

        @staticmethod
        def backward(ctx, g):
            (x,) = ctx.saved_tensors
            return cos(x) * g

    reference = jax.custom_jvp(sin)
    reference.defjvp(lambda primals, tangents: (sin(primals[0]), cos(primals[0]) * tangents[0]))

    def runs_per_call(f):
        if POLICIES[policy] is not None:
            f = jax.checkpoint(f, policy=POLICIES[policy])
        x = jnp.array([0.3, -1.2])
        _, f_jvp = jax.linearize(f, x)
        counts.clear()
        tangents = [f_jvp(t) for t in (jnp.ones(2), 2 * jnp.ones(2))]
        np.testing.assert_allclose(tangents[1], 2 * np.cos(x), rtol=1e-6)
        return counts["sin"] / 2, counts["cos"] / 2

    expected = runs_per_call(reference)
    assert expected == ((0, 1) if policy == "nothing_saveable" else (0, 0))
    assert runs_per_call(CountedSin.apply) == expected
