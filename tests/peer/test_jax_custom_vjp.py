"""JAX's ``CustomVJPTest`` (tests/custom_api_test.py), translated into vjpkit Functions.

Each ``jax.custom_vjp`` with its fwd/bwd rules becomes a Function whose
forward saves what fwd returned as residuals and whose backward is bwd; the
expected numbers are JAX's. Each test names the test it mirrors. Where
vjpkit's contract differs from ``jax.custom_vjp`` (Python scalars are static,
backward's ``None`` means zero), the comment says so.
"""

import custom_api
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from custom_api import close
from functions import Identity, Mul, MulByScalar
from jax import lax
from jax.test_util import check_grads

import vjpkit


def sine_twice_cos() -> type:
    """JAX's recurring f: sin(x), with backward 2 * cos(x) * g (not sin's derivative, so tests see backward run)."""

    class SineTwiceCos(vjpkit.Function):
        @staticmethod
        def forward(ctx, x):
            assert jnp.ndim(x) == 0  # test_vmap's check that vmap hands forward one example; the others pass scalars
            ctx.save_for_backward(jnp.cos(x))
            return jnp.sin(x)

        @staticmethod
        def backward(ctx, g):
            (cos_x,) = ctx.saved_tensors
            return 2 * cos_x * g

    return SineTwiceCos


def test_basic():
    # CustomVJPTest.test_basic
    f = sine_twice_cos().apply
    x = 3.0
    close(f(x), jnp.sin(x))
    close(jax.grad(f)(x), 2 * jnp.cos(x))
    close(jax.value_and_grad(f)(x), (jnp.sin(x), 2 * jnp.cos(x)))


def test_invariance():
    # CustomVJPTest.test_invariance
    class F(custom_api.HalfCosTwoX):
        @staticmethod
        def backward(ctx, g):
            return g * 3

    f = F.apply

    def f2(x):
        y, _ = jax.value_and_grad(f)(x)
        return y

    def f3(x):
        y, _ = jax.value_and_grad(f2)(x)
        return y

    x = 1.0
    close(f(x), f2(x))
    close(f(x), f3(x))
    close(jax.grad(f)(x), jax.grad(f2)(x))
    close(jax.grad(f)(x), jax.grad(f3)(x))


def test_deepcopy():
    # CustomVJPTest.test_deepcopy: a copied Function (its apply) differentiates the same.
    import copy

    g = copy.deepcopy(sine_twice_cos().apply)
    close(jax.grad(g)(1.0), 2 * jnp.cos(1.0))


def test_python_control_flow():
    # CustomVJPTest.test_python_control_flow. vjpkit: a Python float argument is static, so forward may branch
    # on it; under jax.grad it is traced, so the branch is on the static sign passed alongside instead.
    class F(custom_api.SinOrCos):
        @staticmethod
        def backward(ctx, g):
            return (2 * g if ctx.positive else 3 * g), None

    custom_api.check_sin_or_cos_values(F)
    x = 2.0
    close(jax.value_and_grad(lambda x: F.apply(x, True))(x), (jnp.sin(x), 2.0))
    close(jax.value_and_grad(lambda x: F.apply(x, False))(-x), (jnp.cos(-x), 3.0))


def test_python_control_flow_bwd():
    # CustomVJPTest.test_python_control_flow_bwd: the primal branches with lax.cond; backward on the saved sign.
    class F(vjpkit.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x > 0)
            return lax.cond(x > 0, jnp.sin, jnp.cos, x)

        @staticmethod
        def backward(ctx, g):
            (positive,) = ctx.saved_tensors
            return jnp.where(positive, 2 * g, 3 * g)

    x = jnp.float32(2.0)  # vjpkit: a Python float would be static (forward would see a Python bool)
    close(F.apply(x), jnp.sin(x))
    close(F.apply(-x), jnp.cos(-x))
    close(jax.value_and_grad(F.apply)(x), (jnp.sin(x), 2.0))
    close(jax.value_and_grad(F.apply)(-x), (jnp.cos(-x), 3.0))


def test_vmap():
    # CustomVJPTest.test_vmap
    f = sine_twice_cos().apply  # forward asserts that it sees a scalar
    x = jnp.arange(3.0)
    xx = jnp.arange(6.0).reshape(2, 3)
    close(jax.vmap(f)(x), jnp.sin(x))
    close(jax.vmap(jax.vmap(f))(xx), jnp.sin(xx))
    close(jax.vmap(jax.grad(f))(x), 2 * jnp.cos(x))
    close(jax.vmap(jax.value_and_grad(f))(x), (jnp.sin(x), 2 * jnp.cos(x)))
    close(jax.vmap(jax.vmap(jax.grad(f)))(xx), 2 * jnp.cos(xx))
    close(jax.vmap(jax.vmap(jax.value_and_grad(f)))(xx), (jnp.sin(xx), 2 * jnp.cos(xx)))
    close(jax.grad(lambda x: jax.vmap(f)(x).sum())(x), 2 * jnp.cos(x))
    close(jax.grad(lambda x: jax.vmap(jax.vmap(f))(x).sum())(xx), 2 * jnp.cos(xx))
    close(jax.vmap(jax.grad(lambda x: jax.vmap(f)(x).sum()))(xx), 2 * jnp.cos(xx))


def test_jit():
    # CustomVJPTest.test_jit
    f = sine_twice_cos().apply
    x = 3.0
    close(jax.jit(f)(x), jnp.sin(x))
    close(jax.jit(jax.jit(f))(x), jnp.sin(x))
    close(jax.jit(jax.grad(f))(x), 2 * jnp.cos(x))
    close(jax.grad(jax.jit(f))(x), 2 * jnp.cos(x))


def test_pytrees():
    # CustomVJPTest.test_pytrees. vjpkit: a dict output gets one gradient of the dict's structure.
    class F(vjpkit.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.r = jnp.cos(x["a"])
            return {"b": jnp.sin(x["a"])}

        @staticmethod
        def backward(ctx, g):
            return {"a": 2 * ctx.r * g["b"]}

    x = {"a": 3.0}
    close(F.apply(x)["b"], jnp.sin(x["a"]))
    close(jax.grad(lambda x: F.apply(x)["b"])(x), {"a": 2 * jnp.cos(x["a"])})


def test_jvp_error():
    # CustomVJPTest.test_jvp_error. vjpkit names the class and says to define jvp.
    f = sine_twice_cos().apply
    message = r"SineTwiceCos has no forward-mode derivative .*Add a jvp\(ctx, \*tangents\) staticmethod"
    with pytest.raises(TypeError, match=message):
        jax.jvp(f, (3.0,), (1.0,))
    with pytest.raises(TypeError, match=message):
        jax.jvp(jax.vmap(f), (jnp.arange(3.0),), (jnp.ones(3),))
    with pytest.raises(TypeError, match=message):
        jax.jvp(jax.jit(f), (3.0,), (1.0,))


def test_kwargs():
    # CustomVJPTest.test_kwargs (jax#1938). vjpkit: c=2. is a Python float, so static; backward's slot is None.
    class MyFun(custom_api.ScaledSum):
        @staticmethod
        def backward(ctx, g):
            return g, g, None

    f = custom_api.squared_scaled_sum(MyFun)
    # backward is g, g: d/dx of (2 (x + y))^2 through it is 2 * 30 * 1.
    close(jax.grad(f)(10.0, jnp.float32(5.0)), 60.0)


def test_initial_style():
    # CustomVJPTest.test_initial_style
    foo = custom_api.in_one_step_scan(sine_twice_cos().apply)
    close(jax.grad(foo)(3.0), 2.0 * jnp.cos(3.0))
    close(jax.grad(jax.grad(foo))(3.0), -2.0 * jnp.sin(3.0))


def test_initial_style_vmap():
    # CustomVJPTest.test_initial_style_vmap
    class F(vjpkit.Function):
        @staticmethod
        def forward(ctx, x):
            assert jnp.ndim(x) == 0
            ctx.save_for_backward(jnp.cos(x))
            return 3 * x

        @staticmethod
        def backward(ctx, g):
            (cos_x,) = ctx.saved_tensors
            return 2 * cos_x * g

    foo = custom_api.in_one_step_scan(F.apply)
    close(jax.vmap(foo)(jnp.arange(3.0)), 3.0 * jnp.arange(3.0))
    close(jax.grad(lambda x: jax.vmap(foo)(x).sum())(jnp.arange(3.0)), 2.0 * jnp.cos(jnp.arange(3.0)))


def _app() -> type:
    """JAX's nondiff_argnums ``app(f, x)``: in vjpkit a callable argument is simply static."""

    class App(vjpkit.Function):
        @staticmethod
        def forward(ctx, f, x):
            ctx.save_for_backward(jnp.cos(x))
            return f(x)

        @staticmethod
        def backward(ctx, g):
            (cos_x,) = ctx.saved_tensors
            return None, cos_x * g

    return App


def test_nondiff_argnums():
    # CustomVJPTest.test_nondiff_argnums: the callable is a static argument, no nondiff_argnums needed.
    app = _app().apply
    close(app(lambda x: 2 * x, jnp.asarray(1)), 2)  # vjpkit: a Python int alone would make no array output
    close(jax.value_and_grad(lambda x: app(lambda y: 2 * y, x))(1.0), (2.0, jnp.cos(1.0)))


def test_nondiff_argnums_unhashable():
    # CustomVJPTest.test_nondiff_argnums_unhashable: an unhashable list is static, keyed by its contents.
    class F(vjpkit.Function):
        @staticmethod
        def forward(ctx, lst, x):
            ctx.lst = lst
            ctx.save_for_backward(jnp.cos(x))
            return lst[0] * jnp.sin(x)

        @staticmethod
        def backward(ctx, g):
            (cos_x,) = ctx.saved_tensors
            return None, ctx.lst[0] * cos_x * g

    f = F.apply
    lst = [2.0]
    close(f(lst, 3.0), 2.0 * jnp.sin(3.0))
    close(jax.grad(f, argnums=1)(lst, 3.0), 2.0 * jnp.cos(3.0))
    close(jax.jit(lambda x: jax.grad(f, argnums=1)(lst, x))(3.0), 2.0 * jnp.cos(3.0))
    close(jax.vmap(jax.grad(lambda x: f(lst, x)))(jnp.arange(3.0)), 2.0 * jnp.cos(jnp.arange(3.0)))


def test_nondiff_argnums_argnames():
    # CustomVJPTest.test_nondiff_argnums_argnames: two static callables, one passed by keyword.
    class App(vjpkit.Function):
        @staticmethod
        def forward(ctx, f, g, x):
            ctx.save_for_backward(jnp.cos(x))
            return f(x) + g(x)

        @staticmethod
        def backward(ctx, v):
            (cos_x,) = ctx.saved_tensors
            return None, None, cos_x * v

    def f(x):
        return 2 * x

    close(App.apply(f, f, jnp.asarray(1)), 4)  # vjpkit: a Python int alone would make no array output
    close(jax.value_and_grad(lambda x: App.apply(f, g=f, x=x))(1.0), (4.0, jnp.cos(1.0)))


def test_closed_over_vmap_tracer():
    # CustomVJPTest.test_closed_over_vmap_tracer: forward closes over a vmap tracer.
    def outer(x):
        class F(vjpkit.Function):
            @staticmethod
            def forward(ctx, y):
                ctx.save_for_backward(jnp.cos(y))
                return x * y

            @staticmethod
            def backward(ctx, g):
                (cos_y,) = ctx.saved_tensors
                return cos_y * g

        return F.apply

    ans = jax.vmap(lambda x: outer(x)(3.0))(np.arange(3.0))
    close(ans, np.arange(3.0) * 3)


def test_closed_over_tracer3():
    # CustomVJPTest.test_closed_over_tracer3: the closed-over vmap tracer saved for backward.
    def outer(x):
        class F(vjpkit.Function):
            @staticmethod
            def forward(ctx, y):
                ctx.save_for_backward(x, jnp.cos(y))
                return x * y

            @staticmethod
            def backward(ctx, g):
                x, cos_y = ctx.saved_tensors
                return cos_y * g * x

        return jax.grad(F.apply)

    ans = jax.vmap(lambda x: outer(x)(3.0))(np.arange(3.0))
    close(ans, np.cos(3.0) * np.arange(3.0))


def test_nondiff_arg_tracer_error():
    # CustomVJPTest.test_nondiff_arg_tracer_error. vjpkit: an array argument is never static, so the jit tracer
    # x is simply traced (and differentiable); there is no error to raise.
    class F(vjpkit.Function):
        @staticmethod
        def forward(ctx, x, y):
            ctx.save_for_backward(jnp.cos(y))
            return x * y

        @staticmethod
        def backward(ctx, g):
            (cos_y,) = ctx.saved_tensors
            return None, cos_y * g

    g = jax.jit(F.apply)
    close(g(2.0, 3.0), 6.0)
    close(jax.grad(g, 1)(2.0, 3.0), jnp.cos(3.0))


def test_nondiff_arg_nested_tracer_error():
    # CustomVJPTest.test_nondiff_arg_nested_tracer_error: a tracer inside a tuple argument is traced too.
    class F(vjpkit.Function):
        @staticmethod
        def forward(ctx, xs, y):
            ctx.save_for_backward(jnp.cos(y))
            return xs[0] * y

        @staticmethod
        def backward(ctx, g):
            (cos_y,) = ctx.saved_tensors
            return None, cos_y * g

    g = jax.jit(lambda x, y: F.apply((x,), y))
    close(g(2.0, 3.0), 6.0)
    close(jax.grad(g, 1)(2.0, 3.0), jnp.cos(3.0))


def test_missing_vjp_rule_error():
    # CustomVJPTest.test_missing_vjp_rule_error. vjpkit: evaluation works without backward; differentiation
    # raises naming the class.
    close(custom_api.SquareWithoutRule.apply(jnp.float32(2.0)), 4.0)
    with pytest.raises(TypeError, match=r"SquareWithoutRule cannot be differentiated: it defines no backward"):
        jax.grad(custom_api.SquareWithoutRule.apply)(2.0)


def test_vjp_rule_inconsistent_pytree_structures_error():
    # CustomVJPTest.test_vjp_rule_inconsistent_pytree_structures_error. vjpkit: extra gradients must be None.
    class F(Identity):  # forward returns its input
        @staticmethod
        def backward(ctx, g):
            return g, g

    F.apply(jnp.float32(2.0))
    with pytest.raises(TypeError, match=r"F.backward returned 2 gradients, expected 1"):
        jax.grad(F.apply)(2.0)


def test_vjp_bwd_returns_non_tuple_error():
    # CustomVJPTest.test_vjp_bwd_returns_non_tuple_error. vjpkit: a bare array is the gradient of the only input.
    class F(Identity):  # forward returns its input
        @staticmethod
        def backward(ctx, g):
            return 2.0 * g

    close(jax.grad(F.apply)(3.0), 2.0)


def test_issue2511():
    # CustomVJPTest.test_issue2511: vmap of a Function computing a determinant under jit.
    class Det(vjpkit.Function):
        @staticmethod
        def forward(ctx, x):
            return jnp.linalg.det(x)

    arr = jnp.ones((5, 2, 2))
    close(jax.jit(jax.vmap(Det.apply))(arr), np.zeros(5))


def test_clip_gradient():
    # CustomVJPTest.test_clip_gradient (jax#2784). vjpkit: lo=-0.1 is a Python float, so static; hi is traced.
    class ClipGradient(vjpkit.Function):
        @staticmethod
        def forward(ctx, lo, hi, x):
            ctx.lo = lo
            ctx.save_for_backward(hi)
            return x

        @staticmethod
        def backward(ctx, g):
            (hi,) = ctx.saved_tensors
            return None, None, jnp.clip(g, ctx.lo, hi)

    def clip_gradient(x):
        return ClipGradient.apply(-0.1, x + 0.1, x)

    close(jax.grad(clip_gradient)(0.1), 0.2)


def test_nestable_vjp():
    # CustomVJPTest.test_nestable_vjp (jax#3667): backward uses jax.vjp of forward's function.
    def f(x):
        return x**2

    class G(vjpkit.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return f(x)

        @staticmethod
        def backward(ctx, y_bar):
            (x,) = ctx.saved_tensors
            _, f_vjp = jax.vjp(f, x)
            return f_vjp(y_bar)[0]

    _, g_vjp = jax.vjp(G.apply, 1.0)
    (y,) = g_vjp(1.0)
    close(y, 2.0)

    @jax.jit
    def z(x):
        _, g_vjp = jax.vjp(G.apply, x)
        return g_vjp

    (y,) = z(1.0)(3.0)
    close(y, 6.0)


def test_initial_style_vmap_2():
    # CustomVJPTest.test_initial_style_vmap_2 (jax#4173): grad of vmap inside a scan body.
    class CustomFun(vjpkit.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(jnp.ones_like(x))
            return x.sum()

        @staticmethod
        def backward(ctx, g):
            (ones,) = ctx.saved_tensors
            return g * ones

    def train_fun(x):
        return jax.grad(lambda x: jax.vmap(CustomFun.apply)(x).sum())(x)

    _, grads = lax.scan(lambda carry, _: (carry, train_fun(carry)), jnp.ones((10, 3)), jnp.arange(4))
    close(grads, np.ones((4, 10, 3)))


def test_initial_style_vmap_3():
    # CustomVJPTest.test_initial_style_vmap_3: forward closes over an array constant.
    y = jnp.arange(1.0, 4.0)

    class F(vjpkit.Function):
        @staticmethod
        def forward(ctx, x):
            assert jnp.ndim(x) == 0
            ctx.save_for_backward(jnp.cos(x))
            return 3 * x * jnp.sum(y)

        @staticmethod
        def backward(ctx, g):
            (cos_x,) = ctx.saved_tensors
            return 2 * cos_x * g

    foo = custom_api.in_one_step_scan(F.apply)
    close(jax.vmap(foo)(jnp.arange(3.0)), 3.0 * jnp.arange(3.0) * 6)
    close(jax.grad(lambda x: jax.vmap(foo)(x).sum())(jnp.arange(3.0)), 2.0 * jnp.cos(jnp.arange(3.0)))


def test_initial_style_vmap_with_collective():
    # CustomVJPTest.test_initial_style_vmap_with_collective: a psum over the vmap's axis name in forward.
    class F(custom_api.PsumOverFoo):
        @staticmethod
        def backward(ctx, dx):
            return dx

    close(custom_api.psum_over_vmap_axis(F.apply), 8.0)


def check_gradient_is_two_cos_y(f):
    """test_bwd_closes_over_tracer's and test_fwd_closes_over_tracer's checks: f(y) = 2 cos(y), under transforms."""
    close(jax.jit(f)(2.0), 2.0 * jnp.cos(2.0))
    close(jax.vmap(f)(jnp.arange(3.0)), 2.0 * jnp.cos(jnp.arange(3.0)))
    close(jax.jit(jax.vmap(f))(jnp.arange(3.0)), 2.0 * jnp.cos(jnp.arange(3.0)))
    close(jax.vmap(jax.jit(f))(jnp.arange(3.0)), 2.0 * jnp.cos(jnp.arange(3.0)))
    close(jax.grad(f)(4.0), -2.0 * jnp.sin(4.0))


def test_bwd_closes_over_tracer():
    # CustomVJPTest.test_bwd_closes_over_tracer: the class is made inside the transformed function.
    def f(y):
        class F(vjpkit.Function):
            @staticmethod
            def forward(ctx, x):
                return 2.0 * jnp.sin(x)

            @staticmethod
            def backward(ctx, g):
                return 2.0 * jnp.cos(y) * g  # capture!

        return jax.grad(F.apply)(1.0)

    check_gradient_is_two_cos_y(f)


def test_fwd_closes_over_tracer():
    # CustomVJPTest.test_fwd_closes_over_tracer: forward saves the closed-over tracer for backward.
    def f(y):
        class F(vjpkit.Function):
            @staticmethod
            def forward(ctx, x):
                ctx.save_for_backward(y)
                return 2.0 * jnp.sin(x)

            @staticmethod
            def backward(ctx, g):
                (y_saved,) = ctx.saved_tensors
                return 2.0 * jnp.cos(y_saved) * g

        return jax.grad(F.apply)(1.0)

    check_gradient_is_two_cos_y(f)


class _FirstInput(vjpkit.Function):
    """JAX's f(x, y) = x, to which each test gives its own backward."""

    @staticmethod
    def forward(ctx, x, y):
        return x


class _FirstElement(vjpkit.Function):
    """JAX's f(x) = x[0], to which each test gives its own backward."""

    @staticmethod
    def forward(ctx, x):
        return x[0]


def test_float0():
    # CustomVJPTest.test_float0: an integer input's backward slot may hold anything; it is dropped.
    class F(_FirstInput):  # forward(ctx, x, y) returns x
        @staticmethod
        def backward(ctx, g):
            # vjpkit: a gradient is an array (a Python float is refused, as in PyTorch); the int slot may hold 1.
            return jnp.float32(2.0), 1

    x = jnp.float32(2.0)  # vjpkit: a Python float passed alone would be static (forward would return no array)
    grads = jax.grad(F.apply, allow_int=True, argnums=(0, 1))(x, jnp.int32(3))
    close(grads[0], 2.0)
    assert grads[1].dtype == jax.dtypes.float0 and grads[1].shape == ()


def test_float0_initial_style():
    # CustomVJPTest.test_float0_initial_style: a (float, int) tuple input, inside a scan.
    class F(Identity):  # forward returns its input
        @staticmethod
        def backward(ctx, g_x, g_y):
            # vjpkit: a tuple output gives one gradient per element, and the tuple input takes a tuple back.
            return (jnp.float32(2.0), jnp.zeros((), dtype=jax.dtypes.float0))

    foo = custom_api.in_one_step_scan(F.apply)
    grads = jax.grad(lambda x, y: foo((x, y))[0], allow_int=True, argnums=(0, 1))(2.0, 3)
    close(grads[0], 2.0)
    assert grads[1].dtype == jax.dtypes.float0


def test_remat():
    # CustomVJPTest.test_remat
    f = sine_twice_cos().apply

    @jax.remat
    def g(x):
        return f(f(x))

    close(g(2.0), np.sin(np.sin(2.0)))
    close(jax.grad(g)(2.0), 4.0 * jax.grad(lambda x: jnp.sin(jnp.sin(x)))(2.0))


def test_remat_pytree_arg():
    # CustomVJPTest.test_remat_pytree_arg
    class F(vjpkit.Function):
        @staticmethod
        def forward(ctx, xy):
            ctx.xy = xy
            return xy["a"] * xy["b"]

        @staticmethod
        def backward(ctx, g):
            return {"a": g * ctx.xy["b"], "b": g * ctx.xy["a"]}

    @jax.remat
    def g(xy):
        return jnp.sin(F.apply(xy))

    xy = {"a": 2.0, "b": 3.0}
    close(g({"a": jnp.float32(2.0), "b": jnp.float32(3.0)}), np.sin(6.0))
    close(jax.grad(g)(xy), {"a": np.cos(6.0) * 3.0, "b": np.cos(6.0) * 2.0})


def test_remat_nondiff_argnums():
    # CustomVJPTest.test_remat_nondiff_argnums: k=2. is a Python float, so static.
    class F(vjpkit.Function):
        @staticmethod
        def forward(ctx, k, x):
            ctx.k = k
            ctx.save_for_backward(jnp.cos(k * x))
            return jnp.sin(k * x)

        @staticmethod
        def backward(ctx, g):
            (cos_kx,) = ctx.saved_tensors
            return None, ctx.k * cos_kx * g

    @jax.remat
    def g(x):
        return F.apply(2.0, x) * 3.0

    close(g(jnp.float32(0.5)), 3.0 * np.sin(2.0 * 0.5))
    close(jax.grad(g)(0.5), 3.0 * 2.0 * np.cos(2.0 * 0.5))


def test_symbolic_zeros_nondiff_argnums():
    # CustomVJPTest.test_symbolic_zeros_nondiff_argnums: the static k arrives raw; needs_input_grad says which
    # inputs are differentiated (JAX's CustomVJPPrimal.perturbed).
    seen = []

    class F(vjpkit.Function):
        @staticmethod
        def forward(ctx, k, x):
            assert isinstance(k, float)
            seen.append(ctx.needs_input_grad)
            ctx.k = k
            return k * x

        @staticmethod
        def backward(ctx, g):
            return None, ctx.k * g

    close(jax.grad(lambda x: F.apply(2.0, x))(3.0), 2.0)
    assert seen[-1] == (False, True)


def test_remat_higher_order():
    # CustomVJPTest.test_remat_higher_order (jax.remat is jax.checkpoint)
    custom_api.check_remat_higher_order(sine_twice_cos().apply)


def _x_sin_y() -> type:
    class F(vjpkit.Function):
        @staticmethod
        def forward(ctx, x, y):
            ctx.save_for_backward(jnp.cos(y))
            return x * jnp.sin(y)

        @staticmethod
        def backward(ctx, g):
            (cos,) = ctx.saved_tensors
            return None, 2 * cos * g

    return F


def test_bwd_nones():
    # CustomVJPTest.test_bwd_nones
    f = _x_sin_y().apply
    close(jax.grad(lambda x: f(x, x))(3.0), 2 * jnp.cos(3.0))


def test_bwd_nones_vmap():
    # CustomVJPTest.test_bwd_nones_vmap
    f = _x_sin_y().apply
    close(jax.grad(lambda x: jax.vmap(f)(x, x).sum())(jnp.arange(3.0)), 2 * jnp.cos(jnp.arange(3.0)))


def test_bwd_nones_pytree():
    # CustomVJPTest.test_bwd_nones_pytree: None for a tuple input is a zero gradient of its structure.
    class F(vjpkit.Function):
        @staticmethod
        def forward(ctx, xs, y):
            x1, x2 = xs
            ctx.save_for_backward(jnp.cos(y))
            return x1 * x2 * jnp.sin(y)

        @staticmethod
        def backward(ctx, g):
            (cos,) = ctx.saved_tensors
            return None, 2 * cos * g

    close(jax.grad(lambda x: F.apply((x, x), x))(3.0), 2 * jnp.cos(3.0))


def test_custom_vjp_closure_4521():
    # CustomVJPTest.test_custom_vjp_closure_4521 (jax#4521). vjpkit: forward must return an array (JAX's g returns
    # None), so it returns y, which the vmap does not batch (out_axes=None); f drops it, as JAX's f drops g's None,
    # so no cotangent reaches backward.
    class G(vjpkit.Function):
        @staticmethod
        def forward(ctx, x, y):
            return y

        @staticmethod
        def backward(ctx, z_bar):
            raise AssertionError("backward must not run")

    def f(xs, y):
        jax.vmap(G.apply, in_axes=(0, None), out_axes=None)(xs, y)

    def scan_body(xs, _):
        y = jnp.zeros(1)
        _, vjp_f = jax.vjp(f, xs, y)
        vjp_f(None)
        return xs, None

    lax.scan(scan_body, jnp.ones(5), None, 100)  # doesn't crash


def test_float0_bwd_none():
    # CustomVJPTest.test_float0_bwd_none: None for an integer input.
    class F(vjpkit.Function):
        @staticmethod
        def forward(ctx, i, x):
            ctx.save_for_backward(jnp.cos(x))
            return jnp.sin(x)

        @staticmethod
        def backward(ctx, g):
            (cos_x,) = ctx.saved_tensors
            return None, 2 * cos_x * g

    close(jax.grad(F.apply, 1)(jnp.array([1, 2]), 3.0), 2 * jnp.cos(3.0))


def test_custom_gradient():
    # CustomVJPTest.test_custom_gradient: jax.custom_gradient's f(x) = x**2 with vjp g * x, as a Function. Also
    # CustomVJPTest.test_custom_gradient_can_return_singleton_value_in_vjp: in vjpkit the same test (backward
    # returns a bare array in both).
    class F(vjpkit.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return x**2

        @staticmethod
        def backward(ctx, g):
            (x,) = ctx.saved_tensors
            return g * x

    close(F.apply(jnp.float32(3.0)), 9.0)
    close(jax.grad(F.apply)(3.0), 3.0)
    close(jax.grad(jax.grad(F.apply))(3.0), 1.0)


def test_custom_gradient_2():
    # CustomVJPTest.test_custom_gradient_2. JAX's vjp ignores g (returns (y, x)); so does this backward.
    class F(Mul):  # forward: x * y, saving both
        @staticmethod
        def backward(ctx, g):
            x, y = ctx.saved_tensors
            return y, x

    close(F.apply(jnp.float32(3.0), jnp.float32(4.0)), 12.0)
    close(jax.grad(F.apply, argnums=(0, 1))(3.0, 4.0), (4.0, 3.0))


def test_custom_gradient_3():
    # CustomVJPTest.test_custom_gradient_3
    class F(vjpkit.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return jnp.sum(jnp.sin(x))

        @staticmethod
        def backward(ctx, g):
            (x,) = ctx.saved_tensors
            return jnp.cos(x) * jnp.arange(3.0, 6.0)

    close(F.apply(jnp.arange(3)), jnp.sum(jnp.sin(jnp.arange(3.0))))
    expected = jax.grad(lambda x: jnp.sum(jnp.sin(x)))(jnp.arange(3.0)) * jnp.arange(3.0, 6.0)
    close(jax.grad(F.apply)(jnp.arange(3.0)), expected)


def test_closure_convert():
    # CustomVJPTest.test_closure_convert. vjpkit needs no closure conversion: the function is a static argument
    # and the closed-over c is passed as an argument, with its gradient from backward.
    class CosAfter(vjpkit.Function):
        @staticmethod
        def forward(ctx, fn, x, c):
            ctx.save_for_backward(x, c)
            return jnp.cos(fn(x, c))

        @staticmethod
        def backward(ctx, g):
            x, c = ctx.saved_tensors
            return None, 17.0 * x, 42.0 * c

    def dist(x, c):
        return jnp.sum((x - c) ** 2.0)

    def solve(c, x):
        return CosAfter.apply(dist, x, c)

    c, x = 2.0 * jnp.ones(2), jnp.ones(2)
    close(solve(c, x), jnp.cos(dist(x, c)))
    g_c, g_x = jax.grad(solve, argnums=(0, 1))(c, x)
    close(g_c, 42.0 * c)
    close(g_x, 17.0 * x)


def test_closure_convert_mixed_consts():
    # CustomVJPTest.test_closure_convert_mixed_consts (jax#6415): one passed value differentiated, one not.
    class CosAfter(vjpkit.Function):
        @staticmethod
        def forward(ctx, fn, x, c, s):
            ctx.save_for_backward(x, c, s)
            return jnp.cos(fn(x, c, s))

        @staticmethod
        def backward(ctx, g):
            x, c, s = ctx.saved_tensors
            return None, 17.0 * x, 42.0 * c, 42.0 * s

    def dist(x, c, s):
        return jnp.sum(s * (x - c) ** 2.0)

    def solve(c, s, x):
        return CosAfter.apply(dist, x, c, s)

    c, s, x = 2.0 * jnp.ones(2), 3.0 * jnp.ones(2), jnp.ones(2)
    close(solve(c, s, x), jnp.cos(dist(x, c, s)))
    g_c, g_x = jax.grad(solve, argnums=(0, 2))(c, s, x)
    close(g_c, 42.0 * c)
    close(g_x, 17.0 * x)


def test_float0_cotangents_automatically_handled():
    # CustomVJPTest.test_float0_cotangents_automatically_handled: an int input's gradient 1 is dropped.
    class F(_FirstInput):  # forward(ctx, x, y) returns x
        @staticmethod
        def backward(ctx, zbar):
            return jnp.float32(0.0), 1  # vjpkit: the float gradient as an array

    ct = jax.jit(lambda y: jax.vjp(F.apply, jnp.float32(0.0), y)[1](jnp.float32(1.0)))(1)
    close(ct[0], 0.0)


def test_custom_vjp_scan_batching_edge_case():
    # CustomVJPTest.test_custom_vjp_scan_batching_edge_case (jax#5832)
    Mul = MulByScalar  # JAX's mul: x * coeff, the gradient of the scalar coeff a sum

    def scan_over_mul(x, coeff):
        y, _ = lax.scan(lambda x, t: (Mul.apply(x, coeff), None), x, jnp.arange(3))
        return y

    key1, key2 = jax.random.split(jax.random.key(0), 2)
    x_batch = jax.random.normal(key1, (3, 2))
    covector_batch = jax.random.normal(key2, (3, 2))
    coeff = jnp.array(1.0, dtype=x_batch.dtype)
    batched = jax.vmap(scan_over_mul, in_axes=(0, None), out_axes=0)
    _, vjp_fun = jax.vjp(batched, x_batch, coeff)
    vjp_fun(covector_batch)
    check_grads(batched, (x_batch, coeff), order=2, modes=["rev"])


def test_closure_with_vmap2():
    # CustomVJPTest.test_closure_with_vmap2 (jax#8783): the class closes over the vmap tracer x.
    def h(z):
        def f(x):
            class G(vjpkit.Function):
                @staticmethod
                def forward(ctx, y):
                    ctx.save_for_backward(x, x * y, y)
                    return x * y

                @staticmethod
                def backward(ctx, w_bar):
                    x_saved, *_ = ctx.saved_tensors
                    return x_saved * w_bar

            return G.apply(z)

        return jax.vmap(f)(jnp.arange(3.0, dtype="float32")).sum()

    check_grads(h, (jnp.float32(3.14),), order=1, modes=["rev"])


def test_pytrees_not_required_to_contain_nones():
    # CustomVJPTest.test_pytrees_not_required_to_contain_nones: a list subclass whose unflatten rejects None.
    class A(list):
        pass

    def unflatten(_, children):
        assert children[0] is not None
        return A(children)

    jax.tree_util.register_pytree_node(A, lambda x: (x, None), unflatten)

    class F(_FirstElement):  # forward returns x[0]
        @staticmethod
        def backward(ctx, g):
            return A([g])

    grad = jax.grad(F.apply)(A([1.0]))
    assert type(grad) is A
    close(list(grad), [1.0])


def test_vmap_vjp_called_twice():
    # CustomVJPTest.test_vmap_vjp_called_twice (jax#14728)
    F = Identity  # JAX's f: the identity, its vjp passing the cotangent through
    _, f_vjp = jax.vjp(jax.vmap(F.apply), jnp.array([3.0]))
    close(f_vjp(jnp.array([3.0])), (jnp.array([3.0]),))
    close(f_vjp(jnp.array([3.0])), (jnp.array([3.0]),))


def _x_twice(calls: list, materialize: bool) -> type:
    """JAX's symbolic-zeros f(x, y, z) = (x, x): records needs_input_grad, and which gradients arrive as None."""

    class F(vjpkit.Function):
        @staticmethod
        def forward(ctx, x, y, z):
            ctx.set_materialize_grads(materialize)
            return x, x

        @staticmethod
        def backward(ctx, g1, g2):
            calls.append((ctx.needs_input_grad, g1 is None, g2 is None))
            g1 = jnp.zeros(()) if g1 is None else g1
            g2 = jnp.zeros(()) if g2 is None else g2
            return g1, g1, g2

    return F


def test_symbolic_zero_custom_vjp_basic():
    # CustomVJPTest.test_symbolic_zero_custom_vjp_basic. vjpkit: JAX's CustomVJPPrimal.perturbed is
    # ctx.needs_input_grad, and a SymbolicZero cotangent is None with ctx.set_materialize_grads(False).
    calls: list = []
    f = _x_twice(calls, materialize=False).apply
    x, y, z = jnp.float32(4.0), jnp.float32(5.0), jnp.float32(6.0)
    jax.jacrev(lambda x: f(x, y, z))(x)
    assert calls == [((True, False, False), False, False)]

    calls.clear()
    _, vjp = jax.vjp(lambda *xs: f(*xs)[0], x, y, z)
    _, _, gz = vjp(x)
    close(gz, 0.0)
    assert calls == [((True, True, True), False, True)]

    calls.clear()
    _, vjp = jax.vjp(lambda *xs: f(*xs)[1], x, y, z)
    gx, gy, _ = vjp(x)
    close((gx, gy), (0.0, 0.0))
    assert calls == [((True, True, True), True, False)]


def test_symbolic_zero_custom_vjp_bwd_shape_error():
    # CustomVJPTest.test_symbolic_zero_custom_vjp_bwd_shape_error: swapped gradients raise, naming the class.
    class F(vjpkit.Function):
        @staticmethod
        def forward(ctx, x, y, z):
            return x, y, z

        @staticmethod
        def backward(ctx, x_bar, y_bar, z_bar):
            return y_bar, x_bar, z_bar  # swapped!

    with pytest.raises(ValueError, match=r"F.backward returned a gradient of shape \(1,\) for input 1 \('y'\)"):
        jax.grad(lambda x, y, z: F.apply(x, y, z)[2].sum())(jnp.ones(1), jnp.ones(2), jnp.ones(3))


@pytest.mark.parametrize(
    "maybe_jit, maybe_vmap",
    [
        (True, True),
        (True, False),
        (False, True),
        (False, False),
    ],
    ids=["jit_vmap", "jit", "vmap", "eager"],
)
def test_symbolic_zero_custom_vjp(maybe_jit, maybe_vmap):
    # CustomVJPTest.test_symbolic_zero_custom_vjp. vjpkit: the Python float static_scalar is static, so its
    # output is static too and its backward slot is None; a None cotangent marks an output JAX passes none for.
    seen = []

    class F(vjpkit.Function):
        @staticmethod
        def forward(ctx, static_scalar, static_array, dyn_scalar, dyn_array):
            ctx.set_materialize_grads(False)
            seen.append(ctx.needs_input_grad)
            ctx.static_scalar = static_scalar
            return static_scalar + dyn_scalar, static_array + dyn_array, static_array

        @staticmethod
        def backward(ctx, t_dyn_scalar, t_dyn_array, t_static_arr):
            assert t_static_arr is not None
            return None, t_static_arr + 91, t_dyn_scalar + ctx.static_scalar + 90 + 92, t_dyn_array + 93

    def g(dyn_scalar, dyn_array):
        f = F.apply
        if maybe_vmap:
            out = jax.vmap(f, in_axes=(None, None, 0, 0))(1.0, jnp.array([2.0, 3.0]), dyn_scalar[None],
                                                          dyn_array[None])
            return jax.tree_util.tree_map(lambda o: o[0], out)
        return f(1.0, jnp.array([2.0, 3.0]), dyn_scalar, dyn_array)

    def run(primal_ins, cotangent_outs):
        primal_outs, vjp = jax.vjp(g, *primal_ins)
        return primal_outs, vjp(cotangent_outs)

    if maybe_jit:
        run = jax.jit(run)
    primal_ins = (jnp.float32(4.0), jnp.array([5.0, 6.0]))
    cotangent_outs = (jnp.float32(7.0), jnp.array([8.0, 9.0]), jnp.array([10.0, 11.0]))
    (out1, out2, out3), (ct_in1, ct_in2) = run(primal_ins, cotangent_outs)
    close(out1, 5.0)
    close(out2, jnp.array([7.0, 9.0]))
    close(out3, jnp.array([2.0, 3.0]))
    close(ct_in1, 7.0 + 1.0 + 90 + 92)
    close(ct_in2, jnp.array([101.0, 102.0]))
    if maybe_vmap:
        # The third output does not vary along the vmap: its batching is read from the Function's derivative
        # along every float input (any may move in a derivative taken later), forward traced once more knowing
        # all of them. The call that ran knew these.
        assert (False, False, True, True) in seen
    else:
        assert seen[-1] == (False, False, True, True)


def test_symbolic_zero_custom_vjp_vmap_output():
    # CustomVJPTest.test_symbolic_zero_custom_vjp_vmap_output: under vmap, the unused output's gradient is None.
    seen = []

    class F(vjpkit.Function):
        @staticmethod
        def forward(ctx, x, y):
            ctx.set_materialize_grads(False)
            seen.append(ctx.needs_input_grad)
            return x, y

        @staticmethod
        def backward(ctx, g_x, g_y):
            assert g_y is None
            return g_x, g_y

    close(jax.grad(lambda x, y: jax.vmap(F.apply)(x, y)[0].sum())(jnp.ones(3), jnp.ones(3)), np.ones(3))
    assert seen[-1] == (True, False)


def test_symbolic_zero_custom_vjp_custom_pytree():
    # CustomVJPTest.test_symbolic_zero_custom_vjp_custom_pytree: a registered class as an input.
    @jax.tree_util.register_pytree_node_class
    class Box:
        def __init__(self, x):
            self.x = x

        def tree_flatten(self):
            return [self.x], None

        @classmethod
        def tree_unflatten(cls, aux, xs):
            return cls(*xs)

    seen = []

    class F(vjpkit.Function):
        @staticmethod
        def forward(ctx, box, y):
            seen.append(ctx.needs_input_grad)
            ctx.save_for_backward(box.x, y)
            return box.x * y

        @staticmethod
        def backward(ctx, g):
            x, y = ctx.saved_tensors
            return Box(y * g), x * g

    x, y = Box(jnp.array(72.0)), jnp.array(73.0)
    close(jax.grad(F.apply, argnums=0)(x, y).x, 73.0)
    close(jax.grad(F.apply, argnums=1)(x, y), 72.0)
    assert (True, False) in seen and seen[-1] == (False, True)


def test_symbolic_zeros_memoization_caching():
    # CustomVJPTest.test_symbolic_zeros_memoization_caching: the Function's jaxpr, differentiated twice.
    class F(vjpkit.Function):
        @staticmethod
        def forward(ctx, x, y):
            return x * y

        @staticmethod
        def backward(ctx, z_bar):
            return z_bar, None

    from jax.extend.core import jaxpr_as_fun

    f_ = jaxpr_as_fun(jax.make_jaxpr(F.apply)(jnp.float32(2.0), jnp.float32(3.0)))
    close(jax.vjp(f_, 2.0, 3.0)[1]([jnp.float32(1.0)]), (1.0, 0.0))
    close(jax.vjp(lambda x: f_(x, 3.0), 2.0)[1]([jnp.float32(1.0)]), (1.0,))


def test_run_rules_more_than_once():
    # CustomVJPTest.test_run_rules_more_than_once (jax#16614): forward's ctx differs with needs_input_grad.
    class F(vjpkit.Function):
        @staticmethod
        def forward(ctx, x, y):
            ctx.res = None if ctx.needs_input_grad[1] else []
            return x + y

        @staticmethod
        def backward(ctx, ct):
            return ct, ct

    close(custom_api.grad_of_two_step_scan(F.apply)(1.0), 2.0)


def test_symbolic_zeros_remat():
    # CustomVJPTest.test_symbolic_zeros_remat
    F = Identity  # JAX's f: the identity, its vjp passing the cotangent through

    @jax.remat
    def foo(x):
        return F.apply(F.apply(x))

    close(jax.grad(foo)(3.0), 1.0)


def _first_of_pair_with_none_gradients() -> type:
    """f(x) = x[0] of x = (a, (b, c)), whose bwd returns None for the (b, c) subtree."""

    class F(_FirstElement):
        @staticmethod
        def backward(ctx, z_bar):
            return (z_bar, (None, None))

    return F


def test_nones_representing_zeros_in_subtrees_returned_by_bwd():
    # CustomVJPTest.test_nones_representing_zeros_in_subtrees_returned_by_bwd (jax#8356)
    F = _first_of_pair_with_none_gradients()
    close(jax.grad(F.apply)((1.0, (2.0, 3.0))), (1.0, (0.0, 0.0)))


def test_pytree_nones_returned_by_bwd():
    # CustomVJPTest.test_pytree_nones_returned_by_bwd: a None leaf in the input, and in its gradient.
    F = _first_of_pair_with_none_gradients()
    close(jax.grad(F.apply)((1.0, (2.0, None))), (1.0, (0.0, None)))


def test_bwd_rule_shape_mismatch():
    # CustomVJPTest.test_bwd_rule_shape_mismatch: the message names the class, input and shapes.
    class Foo(_FirstInput):  # forward(ctx, x, y) returns x
        @staticmethod
        def backward(ctx, g):
            return jnp.zeros(3), jnp.zeros(3)

    with pytest.raises(ValueError, match=r"Foo.backward returned a gradient of shape \(3,\) for input 1 \('y'\)"):
        jax.grad(lambda x, y: Foo.apply(x, y * y).sum(), 1)(jnp.ones(3), jnp.ones(4))


def test_bwd_rule_can_produce_list_or_tuple():
    # CustomVJPTest.test_bwd_rule_can_produce_list_or_tuple. vjpkit follows PyTorch: a list is one value, so
    # backward must return a tuple; the error says so.
    class F(Mul):  # forward: x * y, saving both
        @staticmethod
        def backward(ctx, g):
            x, y = ctx.saved_tensors
            return [g * y, x * g]

    with pytest.raises(TypeError, match=r"F.backward returned 1 gradient, expected 2 .*return a tuple"):
        jax.grad(F.apply)(1.0, jnp.float32(2.0))


def test_resolve_kwargs_error_message():
    # CustomVJPTest.test_resolve_kwargs_error_message: the same test as CustomJVPTest's in vjpkit, since JAX's
    # rule never runs.
    custom_api.check_resolve_kwargs_error_message()


def test_nondiff_argnames():
    # CustomVJPTest.test_nondiff_argnames: the callable passed by keyword is static.
    app = _app().apply
    close(app(f=lambda x: 2 * x, x=jnp.asarray(1)), 2)
    close(jax.value_and_grad(lambda x: app(f=lambda y: 2 * y, x=x))(1.0), (2.0, jnp.cos(1.0)))


def test_lowering_out_of_traces():
    # CustomVJPTest.test_lowering_out_of_traces (jax#2578): a callable namedtuple (a pytree) passed through jit.
    import collections

    class Relu(vjpkit.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return jax.nn.relu(x)

        @staticmethod
        def backward(ctx, g):
            (x,) = ctx.saved_tensors
            return jnp.where(x > 0, g, 0.0)

    class F(collections.namedtuple("F", ["a"])):
        def __call__(self, x):
            return Relu.apply(self.a) * x

    g = jax.jit(lambda f, x: f(x))
    close(jax.grad(g, argnums=(1,))(F(2.0), 0.0), (2.0,))
