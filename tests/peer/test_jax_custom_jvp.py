"""JAX's ``CustomJVPTest`` (tests/custom_api_test.py), translated into vjpkit Functions.

Each ``jax.custom_jvp`` with its jvp rule becomes a Function with ``forward``
and ``jvp`` (no ``backward``: reverse mode transposes ``jvp``, as JAX
transposes a custom_jvp's rule); what the rule needs of the primals is saved
with ``ctx.save_for_forward``. The expected numbers are JAX's. Each test
names the test it mirrors. Where vjpkit's contract differs from
``jax.custom_jvp`` (Python scalars are static), the comment says so.
"""

import copy

import custom_api
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from custom_api import close
from functions import SinJvpOnly
from jax import lax

import vjpkit


def sine_twice_cos() -> type:
    """JAX's recurring f: sin(x), with jvp 2 * cos(x) * g (not sin's derivative, so tests see jvp run)."""

    class SineTwiceCos(SinJvpOnly):  # its forward: sin(x), saving x for jvp
        @staticmethod
        def jvp(ctx, g):
            (x,) = ctx.saved_tensors
            return 2 * jnp.cos(x) * g

    return SineTwiceCos


def test_basic():
    # CustomJVPTest.test_basic
    f = sine_twice_cos().apply
    x = 3.0
    close(f(jnp.float32(x)), jnp.sin(x))  # vjpkit: a Python float alone is static; save_for_forward takes arrays
    close(jax.jvp(f, (x,), (1.0,)), (jnp.sin(x), 2 * jnp.cos(x)))
    close(jax.grad(f)(x), 2 * jnp.cos(x))


def test_invariance():
    # CustomJVPTest.test_invariance
    class F(custom_api.HalfCosTwoX):
        @staticmethod
        def jvp(ctx, g):
            return 3 * g

    f = F.apply

    def f2(x):
        y, _ = jax.jvp(f, (x,), (x,))
        return y

    def f3(x):
        y, _ = jax.jvp(f2, (x,), (x,))
        return y

    x = 1.0
    close(jax.jvp(f, (x,), (x,)), jax.jvp(f2, (x,), (x,)))
    close(jax.jvp(f, (x,), (x,)), jax.jvp(f3, (x,), (x,)))


class Relu(vjpkit.Function):
    """jax.nn.relu as a Function: test_deepcopy copies it, test_hard_stuff3 writes its rule with lax.select."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_forward(x)
        return jnp.maximum(x, 0)

    @staticmethod
    def jvp(ctx, t):
        (x,) = ctx.saved_tensors
        return lax.select(x > 0, t, lax.full_like(t, 0))


def test_deepcopy():
    # CustomJVPTest.test_deepcopy (JAX copies jax.nn.relu, a custom_jvp): a copied Function's apply.
    f = copy.deepcopy(Relu.apply)
    close(jax.grad(f)(1.0), 1.0)


def test_python_control_flow():
    # CustomJVPTest.test_python_control_flow. vjpkit: forward branches on a static sign passed alongside,
    # since the traced x has no Python value.
    class F(custom_api.SinOrCos):
        @staticmethod
        def jvp(ctx, g, _):
            return 2 * g if ctx.positive else 3 * g

    custom_api.check_sin_or_cos_values(F)
    x = 2.0
    close(jax.jvp(lambda x: F.apply(x, True), (x,), (1.0,)), (jnp.sin(x), 2.0))
    close(jax.jvp(lambda x: F.apply(x, False), (-x,), (1.0,)), (jnp.cos(-x), 3.0))
    close(jax.grad(lambda x: F.apply(x, True))(x), 2.0)
    close(jax.grad(lambda x: F.apply(x, False))(-x), 3.0)


def test_vmap():
    # CustomJVPTest.test_vmap
    class F(vjpkit.Function):
        @staticmethod
        def forward(ctx, x):
            assert jnp.ndim(x) == 0
            ctx.save_for_forward(x)
            return jnp.sin(x)

        @staticmethod
        def jvp(ctx, g):
            (x,) = ctx.saved_tensors
            assert jnp.ndim(x) == jnp.ndim(g) == 0
            return 2 * jnp.cos(x) * g

    f = F.apply
    x = jnp.arange(3.0)
    xx = jnp.arange(6.0).reshape(2, 3)
    close(jax.vmap(f)(x), jnp.sin(x))
    close(jax.vmap(jax.vmap(f))(xx), jnp.sin(xx))
    close(jax.vmap(lambda x: jax.jvp(f, (x,), (x,)))(x), (jnp.sin(x), 2 * jnp.cos(x) * x))
    close(jax.vmap(jax.vmap(lambda x: jax.jvp(f, (x,), (x,))))(xx), (jnp.sin(xx), 2 * jnp.cos(xx) * xx))
    close(jax.jvp(jax.vmap(f), (x,), (x,)), (jnp.sin(x), 2 * jnp.cos(x) * x))
    close(jax.jvp(jax.vmap(jax.vmap(f)), (xx,), (xx,)), (jnp.sin(xx), 2 * jnp.cos(xx) * xx))
    close(jax.vmap(lambda x: jax.jvp(jax.vmap(f), (x,), (x,)))(xx), (jnp.sin(xx), 2 * jnp.cos(xx) * xx))


def test_jit():
    # CustomJVPTest.test_jit
    f = sine_twice_cos().apply
    x = 3.0
    close(jax.jit(f)(x), jnp.sin(x))
    close(jax.jit(jax.jit(f))(x), jnp.sin(x))
    close(jax.jit(lambda x: jax.jvp(f, (x,), (x,)))(x), (jnp.sin(x), 2 * jnp.cos(x) * x))
    close(jax.jvp(jax.jit(f), (x,), (x,)), (jnp.sin(x), 2 * jnp.cos(x) * x))


def test_pytrees():
    # CustomJVPTest.test_pytrees
    class F(vjpkit.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_forward(x["a"])
            return {"b": jnp.sin(x["a"])}

        @staticmethod
        def jvp(ctx, g):
            (a,) = ctx.saved_tensors
            return {"b": 2 * jnp.cos(a) * g["a"]}

    x = {"a": 3.0}
    close(F.apply({"a": jnp.float32(3.0)})["b"], jnp.sin(3.0))
    close(jax.jvp(F.apply, (x,), (x,)), ({"b": jnp.sin(3.0)}, {"b": 2 * jnp.cos(3.0) * 3.0}))


def test_kwargs():
    # CustomJVPTest.test_kwargs (jax#1938). vjpkit: c=2. is a Python float, so static; its tangent is None.
    class MyFun(custom_api.ScaledSum):
        @staticmethod
        def jvp(ctx, t_x, t_y, t_c):
            assert t_c is None
            return t_x + t_y

    f = custom_api.squared_scaled_sum(MyFun)
    # The tangent of (2 (x + y))^2 through jvp t_x + t_y: 2 * 30 * 2.
    close(jax.jvp(f, (10.0, 5.0), (1.0, 1.0)), (900.0, 120.0))


def _three_x_jvp_two() -> type:
    class F(vjpkit.Function):
        @staticmethod
        def forward(ctx, x):
            assert jnp.ndim(x) == 0
            return 3 * x

        @staticmethod
        def jvp(ctx, g):
            return 2 * g

    return F


def test_initial_style():
    # CustomJVPTest.test_initial_style
    foo = custom_api.in_one_step_scan(_three_x_jvp_two().apply)
    close(jax.grad(foo)(3.0), 2.0)
    close(jax.grad(jax.jit(foo))(3.0), 2.0)
    close(jax.jit(jax.grad(foo))(3.0), 2.0)
    close(jax.grad(jax.grad(foo))(3.0), 0.0)
    close(jax.grad(jax.grad(jax.jit(foo)))(3.0), 0.0)
    close(jax.grad(jax.jit(jax.grad(foo)))(3.0), 0.0)
    close(jax.jit(jax.grad(jax.grad(foo)))(3.0), 0.0)


def check_grad_of_vmap_is_two(foo):
    """The gradient of the sum of vmap(foo) at ones(3) is 2 everywhere, with jit at each place."""
    ones = jnp.ones(3)
    close(jax.grad(lambda x: jax.vmap(foo)(x).sum())(ones), 2.0 * ones)
    close(jax.grad(lambda x: jax.vmap(jax.jit(foo))(x).sum())(ones), 2.0 * ones)
    close(jax.grad(lambda x: jax.jit(jax.vmap(foo))(x).sum())(ones), 2.0 * ones)
    close(jax.grad(jax.jit(lambda x: jax.vmap(foo)(x).sum()))(ones), 2.0 * ones)
    close(jax.jit(jax.grad(lambda x: jax.vmap(foo)(x).sum()))(ones), 2.0 * ones)


def test_initial_style_vmap():
    # CustomJVPTest.test_initial_style_vmap
    foo = custom_api.in_one_step_scan(_three_x_jvp_two().apply)
    ones = jnp.ones(3)
    close(jax.vmap(foo)(ones), 3.0 * ones)
    close(jax.vmap(jax.jit(foo))(ones), 3.0 * ones)
    close(jax.jit(jax.vmap(foo))(ones), 3.0 * ones)
    check_grad_of_vmap_is_two(foo)


def test_initial_style_vmap_with_collective():
    # CustomJVPTest.test_initial_style_vmap_with_collective
    class F(custom_api.PsumOverFoo):
        @staticmethod
        def jvp(ctx, t):
            return t

    close(custom_api.psum_over_vmap_axis(F.apply), 8.0)


def test_closed_over_tracers_error_message():
    # CustomJVPTest.test_closed_over_tracers_error_message. JAX raises UnexpectedTracerError; vjpkit names the
    # class and says to pass the value as an argument.
    def f(x):
        class G(vjpkit.Function):
            @staticmethod
            def forward(ctx, y):
                ctx.save_for_forward(y)
                return x + y

            @staticmethod
            def jvp(ctx, t):
                (y,) = ctx.saved_tensors
                return 2 * y

        return G.apply(jnp.float32(1.0))

    message = r"G.forward uses a value that JAX is differentiating but that is not an argument of G.apply"
    with pytest.raises(TypeError, match=message):
        jax.jvp(f, (3.0,), (1.0,))
    with pytest.raises(TypeError, match=message):
        jax.grad(f)(3.0)


def _app(slope=3.0) -> type:
    """JAX's nondiff_argnums ``app(f, x) = f(x)``, its jvp ``slope * t`` (f is static: its tangent is None)."""

    class App(vjpkit.Function):
        @staticmethod
        def forward(ctx, f, x):
            return f(x)

        @staticmethod
        def jvp(ctx, _, t):
            return slope * t

    return App


def test_nondiff_argnums():
    # CustomJVPTest.test_nondiff_argnums: the callable is a static argument, its tangent None.
    app = _app().apply
    close(app(lambda x: 2 * x, jnp.asarray(1)), 2)  # vjpkit: a Python int alone would make no array output
    close(jax.jvp(lambda x: app(lambda y: 2 * y, x), (1.0,), (1.0,)), (2.0, 3.0))


def test_nondiff_argnames():
    # CustomJVPTest.test_nondiff_argnames: the callable passed by keyword.
    app = _app().apply
    close(app(f=lambda x: 2 * x, x=jnp.asarray(1)), 2)


def test_nondiff_arg_vmap_tracer():
    # CustomJVPTest.test_nondiff_arg_vmap_tracer. vjpkit: x is an array, so traced; jvp ignores its tangent.
    class F(vjpkit.Function):
        @staticmethod
        def forward(ctx, x, y):
            return x * y

        @staticmethod
        def jvp(ctx, t_x, t_y):
            return 5 * t_y

    g = jax.vmap(F.apply)
    ans = jax.jvp(lambda y: g(jnp.array([2.0]), y), (jnp.array([3.0]),), (jnp.array([1.0]),))
    close(ans, (jnp.array([6.0]), jnp.array([5.0])))


def test_nondiff_arg_hiding_jvp_tracer():
    # CustomJVPTest.test_nondiff_arg_hiding_jvp_tracer: a static function argument closing over the
    # differentiated x. JAX raises UnexpectedTracerError; vjpkit names the class.
    G = _app(slope=2.0)

    def f(x):
        return G.apply(lambda y: x + y, x)

    with pytest.raises(TypeError, match=r"App.forward uses a value that JAX is differentiating"):
        jax.jvp(f, (2.0,), (1.0,))


def test_missing_jvp_rule_error_message():
    # CustomJVPTest.test_missing_jvp_rule_error_message. vjpkit: evaluation needs no rule; differentiation
    # raises naming the class.
    close(custom_api.SquareWithoutRule.apply(jnp.float32(2.0)), 4.0)
    message = r"SquareWithoutRule cannot be differentiated: it defines no backward \(and no jvp\)"
    with pytest.raises(TypeError, match=message):
        jax.jvp(custom_api.SquareWithoutRule.apply, (2.0,), (1.0,))
    with pytest.raises(TypeError, match=message):
        jax.grad(custom_api.SquareWithoutRule.apply)(2.0)


def test_jvp_rule_inconsistent_pytree_structures_error_message():
    # CustomJVPTest.test_jvp_rule_inconsistent_pytree_structures_error_message: a list of two tangents for a
    # tuple of one output.
    class F(vjpkit.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_forward(x)
            return (x**2,)

        @staticmethod
        def jvp(ctx, t):
            (x,) = ctx.saved_tensors
            return [2 * x * t, x]

    F.apply(jnp.float32(2.0))
    with pytest.raises(TypeError, match=r"F.jvp returned .*tangent"):
        jax.jvp(F.apply, (2.0,), (1.0,))


def test_primal_tangent_aval_disagreement_error_message():
    # CustomJVPTest.test_primal_tangent_aval_disagreement_error_message
    class F(vjpkit.Function):
        @staticmethod
        def forward(ctx, x):
            return x**2

        @staticmethod
        def jvp(ctx, t):
            return jnp.reshape(t, (1,))

    F.apply(jnp.float32(2.0))
    with pytest.raises(ValueError, match=r"F.jvp returned a tangent of shape \(1,\) for output 0: expected shape \(\)"):
        jax.jvp(F.apply, (jnp.float32(2.0),), (jnp.float32(1.0),))


class Expit(vjpkit.Function):
    """JAX's expit (the sigmoid), a custom_jvp in test_multiple_rule_invocations, test_eval_shape and
    test_concurrent_initial_style."""

    @staticmethod
    def forward(ctx, x):
        ans = 1 / (1 + lax.exp(-x))
        ctx.save_for_forward(ans)
        return ans

    @staticmethod
    def jvp(ctx, t):
        (ans,) = ctx.saved_tensors
        return t * ans * (1 - ans)


def test_multiple_rule_invocations():
    # CustomJVPTest.test_multiple_rule_invocations
    def scanned_fun(c, _):
        return [Expit.apply(c[0])] + [c[i - 1] + c[i] for i in range(1, len(c))], None

    def foo(x):
        zero = jnp.zeros_like(x)
        c, _ = lax.scan(scanned_fun, [x, zero, zero, zero, zero], None, length=10)
        return c[-1]

    def plain(x):
        def body(c, _):
            return [jax.nn.sigmoid(c[0])] + [c[i - 1] + c[i] for i in range(1, len(c))], None

        zero = jnp.zeros_like(x)
        c, _ = lax.scan(body, [x, zero, zero, zero, zero], None, length=10)
        return c[-1]

    close(foo(jnp.float32(3.0)), plain(3.0), rtol=1e-5)
    close(jax.grad(foo)(3.0), jax.grad(plain)(3.0), rtol=1e-5)
    close(jax.grad(lambda x: jax.vmap(foo)(x).sum())(jnp.arange(3.0)),
          jax.grad(lambda x: jax.vmap(plain)(x).sum())(jnp.arange(3.0)), rtol=1e-5)


def test_hard_stuff2():
    # CustomJVPTest.test_hard_stuff2: the output does not depend on x (a constant of x's shape).
    class F(vjpkit.Function):
        @staticmethod
        def forward(ctx, x):
            return jnp.zeros(x.shape, x.dtype)

        @staticmethod
        def jvp(ctx, t):
            return t

    f = F.apply
    x = jnp.arange(3.0)
    close(jax.jit(jax.vmap(f))(x), np.zeros(3))
    close(jax.jit(jax.vmap(jax.grad(f)))(x), np.ones(3))
    close(jax.jit(jax.grad(lambda x: jax.vmap(f)(x).sum()))(x), np.ones(3))
    close(jax.grad(lambda x: jax.vmap(f)(x).sum())(x), np.ones(3))
    close(jax.jvp(jax.vmap(f), (x,), (jnp.ones(3),)), (np.zeros(3), np.ones(3)))


def test_hard_stuff3():
    # CustomJVPTest.test_hard_stuff3
    def scanned(relu):
        def f(x):
            def body(c, _):
                return [relu(c[0])] + [c[i - 1] + c[i] for i in range(1, len(c))], None

            zero = jnp.zeros_like(x)
            c, _ = lax.scan(body, [x, zero, zero, zero, zero], None, length=10)
            return c[-1]

        return f

    f, plain = scanned(Relu.apply), scanned(jax.nn.relu)
    x = jnp.arange(3.0)
    close(jax.jit(jax.vmap(f))(x), jax.vmap(plain)(x))
    close(jax.jit(jax.vmap(jax.grad(f)))(x), jax.vmap(jax.grad(plain))(x))
    close(jax.jit(jax.grad(lambda x: jax.vmap(f)(x).sum()))(x), jax.grad(lambda x: jax.vmap(plain)(x).sum())(x))
    close(jax.grad(lambda x: jax.vmap(f)(x).sum())(x), jax.grad(lambda x: jax.vmap(plain)(x).sum())(x))
    close(jax.jvp(jax.jit(jax.vmap(f)), (x,), (jnp.ones(3),)), jax.jvp(jax.vmap(plain), (x,), (jnp.ones(3),)))


def test_eval_shape():
    # CustomJVPTest.test_eval_shape
    assert jax.eval_shape(Expit.apply, jnp.ones((2, 3))).shape == (2, 3)
    assert jax.eval_shape(jax.grad(lambda x: Expit.apply(x).sum()), jnp.ones((2, 3))).shape == (2, 3)


def test_jaxpr_zeros():
    # CustomJVPTest.test_jaxpr_zeros (jax#2657)
    class F(vjpkit.Function):
        @staticmethod
        def forward(ctx, a, b):
            ctx.save_for_forward(a, b)
            return a @ b

        @staticmethod
        def jvp(ctx, da, db):
            a, b = ctx.saved_tensors
            return a @ db + da @ b

    def experiment(theta):
        def step(q, _):
            z = F.apply(jnp.eye(3), jnp.ones(3) * theta)
            q += z[0]
            return q, q

        q, _ = lax.scan(step, 0.0, None, 4)
        return q

    close(jax.grad(experiment)(1.0), 4.0)


def test_linear_in_scan():
    # CustomJVPTest.test_linear_in_scan: jvp calls the Function itself on the tangent.
    class F(vjpkit.Function):
        @staticmethod
        def forward(ctx, x):
            return -x

        @staticmethod
        def jvp(ctx, x_dot):
            return F.apply(x_dot)

    foo = custom_api.in_one_step_scan(F.apply)
    close(jax.grad(foo)(3.0), -1.0)


def test_custom_jvps_first_rule_is_none():
    # CustomJVPTest.test_custom_jvps_first_rule_is_none (jax#3389): no tangent rule for y (defjvps(None, ...)).
    class F(vjpkit.Function):
        @staticmethod
        def forward(ctx, x, y):
            ctx.save_for_forward(x, y)
            return x**2 * y

        @staticmethod
        def jvp(ctx, x_dot, y_dot):
            x, y = ctx.saved_tensors
            return 2 * x * y * y_dot  # x's rule is None in JAX's defjvps: no tangent from x

    close(jax.grad(F.apply, 1)(jnp.float32(2.0), 3.0), 12.0)


def test_concurrent_initial_style():
    # CustomJVPTest.test_concurrent_initial_style (jax#3843): a Function in a scan, differentiated in threads.
    import concurrent.futures

    def unroll(param, sequence):
        def scan_f(prev_state, inputs):
            return prev_state, Expit.apply(param * inputs)  # the sigmoid

        return jnp.sum(lax.scan(scan_f, None, sequence)[1])

    def run():
        return jax.grad(unroll)(jnp.array(1.0), jnp.array([1.0]))

    expected = jax.grad(lambda p: jax.nn.sigmoid(p * 1.0))(1.0)
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as e:
        results = [f.result() for f in [e.submit(run) for _ in range(2)]]
    for ans in results:
        close(ans, expected)


def test_nondiff_argnums_vmap_tracer():
    # CustomJVPTest.test_nondiff_argnums_vmap_tracer (jax#3964): shape is static, the key array is traced (and
    # not differentiable), so vmap over keys needs no nondiff_argnums.
    class Sample(vjpkit.Function):
        @staticmethod
        def forward(ctx, shape, param, seed):
            samples = jax.random.uniform(key=seed, shape=shape, minval=param)
            ctx.save_for_forward(samples)
            ctx.shape = shape
            return samples

        @staticmethod
        def jvp(ctx, _, dparam, __):
            (samples,) = ctx.saved_tensors
            return samples * jnp.broadcast_to(dparam, ctx.shape)  # JAX's dummy jvp

    samples = jax.vmap(lambda seed: Sample.apply((2, 3), jnp.float32(1.0), seed))(
        jax.random.split(jax.random.key(1), 10)
    )
    assert samples.shape == (10, 2, 3)
    primal, tangent = jax.jvp(lambda x: Sample.apply((2, 3), x, jax.random.key(1)), (1.0,), (1.0,))
    close(tangent, primal)


def test_closure_with_vmap():
    # CustomJVPTest.test_closure_with_vmap (jax#3822): the class closes over the vmapped key.
    alpha = jnp.float32(2.0)

    def sample(seed):
        class F(vjpkit.Function):
            @staticmethod
            def forward(ctx, alpha):
                s = jax.random.gamma(seed, alpha, shape=[])
                ctx.save_for_forward(alpha, s)
                return s

            @staticmethod
            def jvp(ctx, dalpha):
                alpha, s = ctx.saved_tensors
                return lax.random_gamma_grad(alpha, s) * dalpha

        return F.apply(alpha)

    assert jax.vmap(sample)(jax.random.split(jax.random.key(1), 3)).shape == (3,)


def _times(c) -> type:
    """f(y) = c * y with jvp c * ydot, c closed over (test_closure_with_vmap2, test_custom_jvp_unbroadcasting)."""

    class G(vjpkit.Function):
        @staticmethod
        def forward(ctx, y):
            return c * y

        @staticmethod
        def jvp(ctx, ydot):
            return c * ydot

    return G


def test_closure_with_vmap2():
    # CustomJVPTest.test_closure_with_vmap2 (jax#8783): jvp closes over the vmap tracer x.
    def h(z):
        def f(x):
            return _times(x).apply(z)  # no vmapped argument; the class closes over the vmap tracer x

        return jax.vmap(f)(jnp.arange(3.0, dtype="float32"))

    primals, tangents = jax.jvp(h, (jnp.float32(1.0),), (jnp.float32(2.0),))
    close(primals, jnp.arange(3.0))
    close(tangents, 2 * jnp.arange(3.0))


class PairWithTangentTwo(vjpkit.Function):
    """test_float0's f(x, y) = (x, y), whose jvp gives x's output the tangent 2.0 and y's (an integer) None."""

    @staticmethod
    def forward(ctx, x, y):
        return x, y

    @staticmethod
    def jvp(ctx, t_x, t_y):
        return jnp.float32(2.0), None


def check_float0_tangent(out, tangents):
    """PairWithTangentTwo's value at (2.0, 3) and its tangents: 2.0, and float0 for the integer."""
    close(out, (2.0, 3))
    close(tangents[0], 2.0)
    assert tangents[1].dtype == jax.dtypes.float0


def test_float0():
    # CustomJVPTest.test_float0: an integer input's tangent is float0; its output's tangent too.
    primals = (jnp.float32(2.0), jnp.int32(3))
    scalar_float0 = np.zeros((), dtype=jax.dtypes.float0)
    out, tangents = jax.jvp(PairWithTangentTwo.apply, primals, (jnp.ones(()), scalar_float0))
    check_float0_tangent(out, tangents)


def test_float0_initial_style():
    # CustomJVPTest.test_float0_initial_style: the same, inside a scan.
    foo = custom_api.in_one_step_scan(lambda x_y: PairWithTangentTwo.apply(*x_y))
    scalar_float0 = np.zeros((), dtype=jax.dtypes.float0)
    out, tangents = jax.jvp(lambda x, y: foo((x, y)), (jnp.float32(2.0), jnp.int32(3)), (jnp.ones(()), scalar_float0))
    check_float0_tangent(out, tangents)


def test_remat():
    # CustomJVPTest.test_remat
    f = sine_twice_cos().apply

    @jax.remat
    def g(x):
        return f(f(x))

    close(g(jnp.float32(2.0)), np.sin(np.sin(2.0)))
    close(jax.grad(g)(2.0), 4.0 * jax.grad(lambda x: jnp.sin(jnp.sin(x)))(2.0))


def test_remat_higher_order():
    # CustomJVPTest.test_remat_higher_order
    custom_api.check_remat_higher_order(sine_twice_cos().apply)


def test_initial_style_vmap_2():
    # CustomJVPTest.test_initial_style_vmap_2: forward closes over an array constant.
    y = jnp.arange(1.0, 4.0)

    class F(vjpkit.Function):
        @staticmethod
        def forward(ctx, x):
            assert jnp.ndim(x) == 0
            return 3 * x * jnp.sum(y)

        @staticmethod
        def jvp(ctx, g):
            return 2 * g

    foo = custom_api.in_one_step_scan(F.apply)
    check_grad_of_vmap_is_two(foo)


def test_custom_jvp_vmap_broadcasting_interaction():
    # CustomJVPTest.test_custom_jvp_vmap_broadcasting_interaction (jax#6452): JAX's logaddexp is a custom_jvp;
    # here a Function computes it.
    class LogAddExp(vjpkit.Function):
        @staticmethod
        def forward(ctx, a, b):
            out = jnp.logaddexp(a, b)
            ctx.save_for_forward(a, b, out)
            return out

        @staticmethod
        def jvp(ctx, ta, tb):
            a, b, out = ctx.saved_tensors
            return ta * jnp.exp(a - out) + tb * jnp.exp(b - out)

    def f2(y, z):
        return LogAddExp.apply(z, jnp.sum(y) + z)

    def f1(y, z):
        return jnp.sum(jax.vmap(lambda _y: f2(_y, z))(y))

    y = jnp.ones((3, 2))
    val, g = jax.value_and_grad(lambda z: f1(y, z))(0.1)
    assert val.shape == () and g.shape == ()
    close(g, jax.grad(lambda z: jnp.sum(jax.vmap(lambda _y: jnp.logaddexp(z, jnp.sum(_y) + z))(y)))(0.1))


def test_custom_jvp_vmap_broadcasting_interaction_2():
    # CustomJVPTest.test_custom_jvp_vmap_broadcasting_interaction_2 (jax#5849): forward branches on a shape.
    class Transform(vjpkit.Function):
        @staticmethod
        def forward(ctx, box, r):
            ctx.save_for_forward(box, r)
            if box.size == 1:
                return r * box
            return jnp.einsum("ij,j->i", box, r)

        @staticmethod
        def jvp(ctx, dbox, dr):
            box, r = ctx.saved_tensors
            return dr + Transform.apply(dbox, r)

    def energy_fn(box):
        def d(ra, rb):
            return Transform.apply(box, ra - rb)

        d = jax.vmap(jax.vmap(d, (None, 0)), (0, None))
        r = jax.random.uniform(jax.random.key(0), (25, 2))
        return jnp.sum(d(r, r) ** 2)

    assert jax.grad(energy_fn)(1.0).shape == ()


def test_custom_jvp_implicit_broadcasting():
    # CustomJVPTest.test_custom_jvp_implicit_broadcasting (jax#6357): projection onto the unit simplex.
    class Projection(vjpkit.Function):
        @staticmethod
        def forward(ctx, x):
            n_features = x.shape[0]
            u = jnp.sort(x)[::-1]
            cssv = jnp.cumsum(u) - 1.0
            ind = jnp.arange(n_features, dtype=x.dtype) + 1
            idx = jnp.count_nonzero(u - cssv / ind > 0)
            out = jax.nn.relu(x - cssv[idx - 1] / idx.astype(x.dtype))
            ctx.save_for_forward(out)
            return out

        @staticmethod
        def jvp(ctx, x_dot):
            (out,) = ctx.saved_tensors
            supp = (out > 0).astype(x_dot.dtype)
            card = jnp.count_nonzero(supp).astype(x_dot.dtype)
            return supp * x_dot - (jnp.dot(supp, x_dot) / card) * supp

    rng = np.random.RandomState(0)
    x = rng.rand(5).astype(np.float32)
    p = Projection.apply(x)
    support = (p > 0).astype(jnp.float32)
    j_true = jnp.diag(support) - jnp.outer(support, support) / jnp.count_nonzero(support).astype(jnp.float32)
    close(jax.jacfwd(Projection.apply)(x), j_true)
    close(jax.jacrev(Projection.apply)(x), j_true)

    def fun(xs):
        return jnp.sum(jax.vmap(Projection.apply)(xs) ** 2)

    xs = rng.rand(4, 5).astype(np.float32)
    u = rng.rand(4, 5)
    u = (u / np.sqrt(np.sum(u**2))).astype(np.float32)
    eps = 1e-3
    numeric = (fun(xs + eps * u) - fun(xs - eps * u)) / (2 * eps)
    np.testing.assert_allclose(jnp.vdot(jax.grad(fun)(xs), u), numeric, atol=1e-3)


def test_vmap_inside_defjvp():
    # CustomJVPTest.test_vmap_inside_defjvp (jax#3201): jvp vmaps inside; aux=0.5 is a Python float, so static.
    mat = jax.random.normal(jax.random.key(47), (2, 3))

    class F(vjpkit.Function):
        @staticmethod
        def forward(ctx, mat, aux):
            ctx.save_for_forward(mat)
            ctx.aux = aux
            num_rows, num_cols = mat.shape
            return jnp.ones((num_rows, 1)) / num_cols

        @staticmethod
        def jvp(ctx, vec, _):
            (mat,) = ctx.saved_tensors
            aux = ctx.aux
            num_rows, num_cols = mat.shape
            size = num_rows * num_cols
            bd_mat = jnp.tile(mat.reshape(1, 1, num_rows, num_cols), reps=(num_rows, num_cols))
            bd_mat = bd_mat.reshape(size, num_rows, num_cols)
            bd_rowsum = jnp.tile(jnp.sum(mat, axis=1, keepdims=True), reps=(1, num_rows))
            bd_colsum = jnp.tile(jnp.sum(mat, axis=0, keepdims=True), reps=(num_cols, 1))
            bd_vec = vec.reshape(size, 1)

            def operate(mx, val):
                buf = 0
                for i in range(2):
                    buf = buf + jnp.matmul(mx, bd_colsum) / jnp.power(aux, i)
                return jnp.matmul(bd_rowsum, buf) * val[None, :]

            bd_buf = jax.vmap(operate, in_axes=(0, 0), out_axes=0)(bd_mat, bd_vec) / aux
            return jnp.mean(jnp.sum(bd_buf, axis=0), axis=1, keepdims=True)

    assert jax.grad(lambda mat, aux: jnp.sum(F.apply(mat, aux)))(mat, 0.5).shape == (2, 3)


def test_custom_jvp_unbroadcasting():
    # CustomJVPTest.test_custom_jvp_unbroadcasting (jax#3056)
    a = jnp.array([1.0, 1.0])

    g = jax.grad(lambda x: jnp.sum(_times(a).apply(x)))(jnp.array(1.0))
    assert g.shape == ()
    close(g, 2.0)


@pytest.mark.parametrize("maybe_jit", [True, False], ids=["jit", "eager"])
@pytest.mark.parametrize("maybe_vmap", [True, False], ids=["vmap", "novmap"])
def test_symbolic_zero_custom_jvp(maybe_jit, maybe_vmap):
    # CustomJVPTest.test_symbolic_zero_custom_jvp. vjpkit: the Python float static_scalar is static (its tangent
    # None, its output static); JAX's SymbolicZero tangent of the unperturbed static_array is None with
    # ctx.set_materialize_grads(False).
    class F(vjpkit.Function):
        @staticmethod
        def forward(ctx, static_scalar, static_array, dyn_scalar, dyn_array):
            ctx.set_materialize_grads(False)
            ctx.static_scalar = static_scalar
            return static_scalar + dyn_scalar, static_array + dyn_array

        @staticmethod
        def jvp(ctx, t_static, t_static_arr, t_dyn_scalar, t_dyn_array):
            assert t_static is None and t_static_arr is None
            return ctx.static_scalar + 90 + 0 * t_dyn_scalar, t_dyn_array + 91

    def g(dyn_scalar, dyn_array):
        if maybe_vmap:
            out = jax.vmap(F.apply, in_axes=(None, None, 0, 0))(1.0, jnp.array([2.0, 3.0]), dyn_scalar[None],
                                                                dyn_array[None])
            return jax.tree_util.tree_map(lambda o: o[0], out)
        return F.apply(1.0, jnp.array([2.0, 3.0]), dyn_scalar, dyn_array)

    def run(primal_ins, tangent_ins):
        return jax.jvp(g, primal_ins, tangent_ins)

    if maybe_jit:
        run = jax.jit(run)
    (p1, p2), (t1, t2) = run((jnp.float32(4.0), jnp.array([5.0, 6.0])), (jnp.float32(7.0), jnp.array([8.0, 9.0])))
    close(p1, 5.0)
    close(t1, 91.0)
    close(p2, jnp.array([7.0, 9.0]))
    close(t2, jnp.array([99.0, 100.0]))


class _XTimesY(vjpkit.Function):
    """f(x, y) = x * y with materialization off: a tangent not computed reaches jvp as None."""

    @staticmethod
    def forward(ctx, x, y):
        ctx.set_materialize_grads(False)
        return x * y


def _x_times_y_tangent_y(seen: list) -> type:
    class F(_XTimesY):
        @staticmethod
        def jvp(ctx, x_dot, y_dot):
            seen.append((x_dot is None, y_dot is None))
            return y_dot

    return F


def test_symbolic_zero_custom_jvp_vmap_output():
    # CustomJVPTest.test_symbolic_zero_custom_jvp_vmap_output: y's tangent is None (y is not differentiated).
    seen: list = []
    f = _x_times_y_tangent_y(seen).apply
    close(jax.grad(lambda x, y: jax.vmap(f)(x, y).sum())(jnp.ones(3), jnp.ones(3)), np.zeros(3))
    assert (False, True) in seen


def test_symbolic_zeros_memoization_caching():
    # CustomJVPTest.test_symbolic_zeros_memoization_caching: the Function's jaxpr, linearized twice.
    from jax.extend.core import jaxpr_as_fun

    f = _x_times_y_tangent_y([]).apply
    f_ = jaxpr_as_fun(jax.make_jaxpr(f)(jnp.float32(2.0), jnp.float32(3.0)))
    _, f_jvp = jax.linearize(f_, 2.0, 3.0)
    close(f_jvp(1.0, 1.0), [1.0])
    _, f_jvp = jax.linearize(lambda x: f_(x, 3.0), 2.0)
    close(f_jvp(1.0), [0.0])


def test_symbolic_zeros_under_jit():
    # CustomJVPTest.test_symbolic_zeros_under_jit (jax#14833): jacfwd moves one input at a time.
    class F(_XTimesY):
        @staticmethod
        def jvp(ctx, tx, ty):
            assert tx is not None or ty is not None
            return ty if tx is None else tx if ty is None else tx + ty

    close(jax.jacfwd(jax.jit(F.apply))(jnp.float32(0.1), jnp.float32(0.2)), 1.0)


def test_custom_jvp_functools_partial():
    # CustomJVPTest.test_custom_jvp_functools_partial: a=0.1 bound with functools.partial, a static keyword.
    import functools

    def fun(x, y, a):
        return x + y * a

    class F(vjpkit.Function):
        @staticmethod
        def forward(ctx, x, y, a):
            ctx.a = a
            return fun(x, y, a)

        @staticmethod
        def jvp(ctx, tx, ty, _):
            return tx + ty * ctx.a

    fn = functools.partial(F.apply, a=0.1)
    close(jax.grad(lambda args: fn(*args))((1.0, 2.0)), (1.0, 0.1))


def _projection(argnum) -> type:
    """f(x, y) = (x, y)[argnum], its jvp passing that tangent on; materialization off, so the other may be None."""

    class F(vjpkit.Function):
        @staticmethod
        def forward(ctx, x, y):
            ctx.set_materialize_grads(False)
            return (x, y)[argnum]

        @staticmethod
        def jvp(ctx, x_dot, y_dot):
            return (x_dot, y_dot)[argnum]

    return F


def test_run_rules_more_than_once():
    # CustomJVPTest.test_run_rules_more_than_once (jax#16614)
    F = _projection(0)  # f(x, y) = x
    close(custom_api.grad_of_two_step_scan(F.apply)(1.0), 1.0)


def test_dce_symbolic_zeros():
    # CustomJVPTest.test_dce_symbolic_zeros (jax#31448): forward over reverse of a jitted tuple-input Function.
    class F(vjpkit.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.set_materialize_grads(False)
            return x

        @staticmethod
        def jvp(ctx, tx):
            return tx

    @jax.jacfwd
    @jax.jacrev
    def f_wrapped(x):
        return jax.jit(F.apply)((x, 3.0))

    hessians = f_wrapped(jnp.zeros(2))
    close(hessians[0], np.zeros((2, 2, 2)))


def test_resolve_kwargs_error_message():
    # CustomJVPTest.test_resolve_kwargs_error_message: the same test as CustomVJPTest's in vjpkit, since JAX's
    # rule never runs.
    custom_api.check_resolve_kwargs_error_message()


def test_symbolic_zero_custom_jvp_vmap_doesnt_instantiate():
    # CustomJVPTest.test_symbolic_zero_custom_jvp_vmap_doesnt_instantiate. vjpkit: a None tangent returned by
    # jvp is a zero array for the next Function (JAX passes its SymbolicZero on), so only the values are checked.
    F = _projection(1)  # f(x, y) = y
    def g(x):
        return F.apply(x, F.apply(x, jnp.float32(1.0)))

    out, tangent = jax.jvp(jax.vmap(g), (jnp.ones(3),), (jnp.ones(3),))
    close((out, tangent), (np.ones(3), np.zeros(3)))


def test_symbolic_zero_under_vmap_of_jit():
    # CustomJVPTest.test_symbolic_zero_under_vmap_of_jit (jax#28144): jvp returns None, a zero tangent.
    class F(vjpkit.Function):
        @staticmethod
        def forward(ctx, x):
            return x + 1

        @staticmethod
        def jvp(ctx, t):
            return None

    x = jnp.arange(3.0)
    close(jax.jvp(jax.vmap(jax.jit(F.apply)), (x,), (x,)), (x + 1, np.zeros(3)))


def test_custom_jvp_transpose_vjp3():
    # CustomJVPTest.test_custom_jvp_transpose_vjp3: reverse mode transposes jvp, which calls the Function.
    class Div(vjpkit.Function):
        @staticmethod
        def forward(ctx, x, y):
            ctx.save_for_forward(y)
            return x / y

        @staticmethod
        def jvp(ctx, x_dot, y_dot):
            (y,) = ctx.saved_tensors
            return Div.apply(x_dot, y)  # y_dot ignored, as in JAX's test

    _, f_vjp = jax.vjp(lambda x: Div.apply(x, jnp.float32(2.0)), 1.0)
    (ans,) = f_vjp(1.0)
    close(ans, 0.5)


def test_ensure_compile_time_eval():
    # CustomJVPTest.test_ensure_compile_time_eval: forward sees a concrete value under ensure_compile_time_eval.
    class F(vjpkit.Function):
        @staticmethod
        def forward(ctx, x):
            assert x == 0.0  # concrete: the Python float is static
            return jnp.asarray(x)

        @staticmethod
        def jvp(ctx, t):
            return t

    @jax.jit
    def g():
        with jax.ensure_compile_time_eval():
            return F.apply(0.0)

    close(g(), 0.0)


def test_hard_stuff():
    # CustomJVPTest.test_hard_stuff: jit of vmap of a determinant (JAX's det is a custom_jvp; here a Function).
    class Det(vjpkit.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_forward(x)
            return jnp.linalg.det(x)

        @staticmethod
        def jvp(ctx, t):
            (x,) = ctx.saved_tensors
            return jnp.linalg.det(x) * jnp.trace(jnp.linalg.solve(x, t))

    arr = jnp.ones((5, 2, 2)) + jnp.eye(2)
    close(jax.jit(jax.vmap(Det.apply))(arr), np.full(5, 3.0))
    close(jax.jit(jax.vmap(jax.grad(Det.apply)))(arr), jax.vmap(jax.grad(jnp.linalg.det))(arr), rtol=1e-5)
