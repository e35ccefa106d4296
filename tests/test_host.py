"""Host Functions (``host=True``): forward and backward in NumPy, through jax.pure_callback.

Expected values come from jax.numpy autodiff of the same math.
"""

import pathlib
import re
import sys

import functions
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from asynchronous import pending
from functions import Double, Identity, Mul, fresh

import vjpkit

# jax.enable_x64 or its older home. Not the x64 fixture:
# A scope inside one test: traced with x64 on, run with it off.
from vjpkit._jax_internals import enable_x64

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "examples"))
from numpy_rank import TrimmedMean, trimmed_mean_jnp  # noqa: E402
from numpy_solve import Solve  # noqa: E402


def assert_close(got, want, rtol=1e-5, atol=1e-6):
    jax.tree_util.tree_map(lambda g, w: np.testing.assert_allclose(g, w, rtol=rtol, atol=atol), got, want)


def host_identity(name, backward, **options):
    """Identity on the host, named ``name``, with another ``backward``: the gradient a test gets wrong."""
    return fresh(Identity, name, host=True, backward=staticmethod(backward), **options)


def host_function(name, **methods):
    """``@vjpkit.function(host=True)`` on a class named ``name`` with these (plain) functions as its staticmethods."""
    return vjpkit.function(host=True)(type(name, (), {key: staticmethod(f) for key, f in methods.items()}))


def raises_in_callback(message):
    """Errors raised on the host arrive as JAX's runtime error, carrying vjpkit's message.

    They arrive where the program's result is awaited: at the call on the
    CPU, later on a GPU (which runs programs asynchronously), so the tests
    await each result (``block_until_ready``).
    """
    return pytest.raises(jax.errors.JaxRuntimeError, match=re.escape(message))


X = jnp.array([0.5, -1.0, 2.0], dtype=jnp.float32)


@vjpkit.function(host=True)
class Cube:
    @staticmethod
    def forward(ctx, x):
        assert isinstance(x, np.ndarray), type(x)
        square = x * x  # a NumPy intermediate, saved
        ctx.save_for_backward(x, square)
        ctx.factor = 3.0  # a static attribute
        return square * x

    @staticmethod
    def backward(ctx, g):
        assert isinstance(g, np.ndarray), type(g)
        _, square = ctx.saved_tensors
        return ctx.factor * square * g


def cube_loss(cube):
    return lambda x: jnp.sum(cube(x) * jnp.sin(x))


def cube_jnp(x):
    return x**3


# -- values and first derivatives ----------------------------------------------


def test_forward_runs_numpy_and_matches_jnp():
    assert_close(Cube(X), cube_jnp(X))
    assert_close(Cube.apply(X), cube_jnp(X))


def test_jitted_grad_matches_jnp_autodiff():
    assert_close(jax.jit(jax.grad(cube_loss(Cube)))(X), jax.grad(cube_loss(cube_jnp))(X))


def test_value_and_grad_vjp_and_jacrev_match_jnp():
    assert_close(jax.value_and_grad(cube_loss(Cube))(X), jax.value_and_grad(cube_loss(cube_jnp))(X))
    y, pullback = jax.vjp(Cube, X)
    y_ref, pullback_ref = jax.vjp(cube_jnp, X)
    ct = jnp.array([1.0, 2.0, -1.0])
    assert_close((y, pullback(ct)), (y_ref, pullback_ref(ct)))
    assert_close(jax.jacrev(Cube)(X), jax.jacrev(cube_jnp)(X))


def test_works_inside_scan_and_checkpoint():
    def total(cube):
        def body(carry, x):
            return carry + jnp.sum(cube(x)), None

        return lambda xs: jax.lax.scan(body, 0.0, xs)[0]

    xs = jnp.stack([X, 2 * X])
    assert_close(jax.jit(jax.grad(total(Cube)))(xs), jax.grad(total(cube_jnp))(xs))
    assert_close(jax.grad(jax.checkpoint(cube_loss(Cube)))(X), jax.grad(cube_loss(cube_jnp))(X))


def test_jit_false_runs_too():
    @vjpkit.function(host=True, jit=False)
    class Eager:
        forward = Cube.forward
        backward = Cube.backward

    assert_close(jax.grad(cube_loss(Eager))(X), jax.grad(cube_loss(cube_jnp))(X))


def test_host_as_class_attribute_of_a_subclass():
    class Square(functions.Square):  # x * x: NumPy runs it
        host = True

    assert_close(jax.grad(lambda x: Square(x).sum())(X), 2 * X)


def test_setup_context_style():
    Scale = vjpkit.function(host=True)(functions.MulConstantAsWritten)
    assert_close(jax.grad(lambda x: Scale(x, 2.5).sum())(X), jnp.full(3, 2.5))


def test_static_and_keyword_arguments():
    @vjpkit.function(host=True)
    class Power:
        @staticmethod
        def forward(ctx, x, *, p=2):
            ctx.save_for_backward(x)
            ctx.p = p
            return x**p

        @staticmethod
        def backward(ctx, g):
            (x,) = ctx.saved_tensors
            return ctx.p * x ** (ctx.p - 1) * g, None

    assert_close(jax.jit(jax.grad(lambda x: Power(x, p=3).sum()))(X), 3 * X**2)
    assert_close(jax.grad(lambda x: Power(x).sum())(X), 2 * X)


def test_jitted_grad_runs_forward_once_on_the_host():
    # backward re-runs forward to rebuild ctx; when the loss does not need
    # forward's output, XLA drops the forward callback: one forward in all.
    calls = []

    class Counted(Double):  # 2 * x, counting the runs of each rule
        host = True

        @staticmethod
        def forward(ctx, x):
            calls.append("forward")
            return Double.forward(ctx, x)

        @staticmethod
        def backward(ctx, g):
            calls.append("backward")
            return Double.backward(ctx, g)

    grad = jax.jit(jax.grad(lambda x: Counted(x).sum()))
    grad(X).block_until_ready()
    calls.clear()
    assert_close(grad(X), jnp.full(3, 2.0))
    assert calls == ["forward", "backward"]


# -- saved arrays, ctx, needs_input_grad -----------------------------------------


def test_saved_integer_intermediate_and_static_attribute_reach_backward():
    seen = {}

    @vjpkit.function(host=True)
    class SortValues:
        @staticmethod
        def forward(ctx, x):
            order = np.argsort(x)
            ctx.save_for_backward(order)
            ctx.n = x.shape[0]
            return x[order]

        @staticmethod
        def backward(ctx, g):
            (order,) = ctx.saved_tensors
            seen["order"], seen["n"] = order, ctx.n
            gx = np.empty_like(g)
            gx[order] = g
            return gx

    weights = jnp.array([1.0, 10.0, 100.0])

    def loss(sort):
        return lambda x: jnp.sum(sort(x) * weights)

    assert_close(jax.jit(jax.grad(loss(SortValues)))(X), jax.grad(loss(jnp.sort))(X))
    np.testing.assert_array_equal(seen["order"], np.argsort(np.asarray(X)))
    assert seen["n"] == 3


def test_needs_input_grad_in_forward_and_backward():
    seen = []

    class Mul(functions.Mul):  # recording needs_input_grad
        host = True

        @staticmethod
        def forward(ctx, a, b):
            seen.append(("forward", ctx.needs_input_grad))
            return functions.Mul.forward(ctx, a, b)

        @staticmethod
        def backward(ctx, g):
            seen.append(("backward", ctx.needs_input_grad))
            a, b = ctx.saved_tensors
            return (g * b if ctx.needs_input_grad[0] else None), (g * a if ctx.needs_input_grad[1] else None)

    a, b = X, X + 1
    assert_close(jax.grad(lambda b: Mul(a, b).sum())(b), a)
    # forward runs twice: once for the primal (its output feeds nothing
    # here, but jax.grad outside jit keeps it), once in backward.
    assert ("backward", (False, True)) in seen and ("forward", (False, True)) in seen
    seen.clear()
    Mul(a, b)
    assert seen == [("forward", (False, False))]


def test_typed_prng_key_input_arrives_as_its_data_and_gets_no_gradient():
    seen = []

    @vjpkit.function(host=True)
    class Jitter:
        @staticmethod
        def forward(ctx, x, key):
            seen.append(("forward", type(key), key.dtype, key.copy()))
            noise = np.random.default_rng(key).uniform(size=x.shape).astype(x.dtype)
            ctx.save_for_backward(noise)
            return x * noise

        @staticmethod
        def backward(ctx, g):
            (noise,) = ctx.saved_tensors
            seen.append(("backward", ctx.needs_input_grad))
            return g * noise, None

    key = jax.random.key(7)
    data = np.asarray(jax.random.key_data(key))
    noise = np.random.default_rng(data).uniform(size=X.shape).astype(np.float32)
    assert_close(Jitter(X, key), X * noise)
    gx, gkey = jax.jit(jax.grad(lambda x, k: Jitter(x, k).sum(), argnums=(0, 1), allow_int=True))(X, key)
    assert_close(gx, noise)
    assert gkey.dtype == jax.dtypes.float0 and gkey.shape == key.shape
    forwards = [s for s in seen if s[0] == "forward"]
    assert all(kind is np.ndarray and dtype == np.uint32 for _, kind, dtype, _ in forwards)
    for _, _, _, got in forwards:
        np.testing.assert_array_equal(got, data)
    assert ("backward", (True, False)) in seen


def test_integer_input_gets_no_gradient_and_is_passed_through():
    class Gather(functions.Gather):  # its forward, in NumPy here
        host = True

        @staticmethod
        def output_shapes(x, idx):
            return jax.ShapeDtypeStruct(idx.shape, x.dtype)

        @staticmethod
        def backward(ctx, g):
            (idx,) = ctx.saved_tensors
            gx = np.zeros(ctx.n, g.dtype)
            np.add.at(gx, idx, g)
            return gx, "ignored: idx is an integer input"

    idx = jnp.array([2, 0, 2])
    assert_close(jax.grad(lambda x: Gather(x, idx).sum())(X), jax.grad(lambda x: x[idx].sum())(X))


def test_float64_numpy_gradient_is_cast_to_the_input_dtype():
    @vjpkit.function(host=True)
    class Double:
        @staticmethod
        def forward(ctx, x):
            return (2 * x).astype(np.float64)  # same kind: cast to float32

        @staticmethod
        def backward(ctx, g):
            return np.full(g.shape, 2.0, np.float64)

    assert Double(X).dtype == jnp.float32
    g = jax.grad(lambda x: Double(x).sum())(X)
    assert g.dtype == jnp.float32
    assert_close(g, jnp.full(3, 2.0))


def test_broadcast_gradient_is_summed_down():
    @vjpkit.function(host=True)
    class AddBias:
        @staticmethod
        def forward(ctx, x, bias):
            return x + bias

        @staticmethod
        def backward(ctx, g):
            return g, g  # bias's gradient has x's shape: summed down to ()

    x = jnp.ones((4, 3))
    g = jax.grad(lambda b: AddBias(x, b).sum())(jnp.float32(1.0))
    assert_close(g, 12.0)


# -- outputs -----------------------------------------------------------------------


def test_output_shapes_declared_for_several_outputs():
    @vjpkit.function(host=True)
    class MeanAndCentered:
        @staticmethod
        def output_shapes(x):
            return jax.ShapeDtypeStruct((), x.dtype), x

        @staticmethod
        def forward(ctx, x):
            m = x.mean()
            return m, x - m

        @staticmethod
        def backward(ctx, g_mean, g_centered):
            return g_mean / g_centered.size + g_centered - g_centered.mean()

    def loss(f):
        def run(x):
            m, c = f(x)
            return m * 3.0 + jnp.sum(c**2)

        return run

    def ref(x):
        return x.mean(), x - x.mean()

    assert_close(jax.jit(jax.grad(loss(MeanAndCentered)))(X), jax.grad(loss(ref))(X))


def test_unused_output_gets_zero_gradient_and_none_without_materialize():
    seen = []

    def make(materialize):
        @vjpkit.function(host=True)
        class Two:
            @staticmethod
            def output_shapes(x):
                return x, x

            @staticmethod
            def forward(ctx, x):
                ctx.set_materialize_grads(materialize)
                return 2 * x, 3 * x

            @staticmethod
            def backward(ctx, g1, g2):
                seen.append(g2)
                return 2 * g1 + (0 if g2 is None else 3 * g2)

        return Two

    assert_close(jax.grad(lambda x: make(True)(x)[0].sum())(X), jnp.full(3, 2.0))
    np.testing.assert_array_equal(seen[-1], np.zeros(3, np.float32))
    assert_close(jax.grad(lambda x: make(False)(x)[0].sum())(X), jnp.full(3, 2.0))
    assert seen[-1] is None


def test_mark_non_differentiable_output_gets_zero_gradient():
    @vjpkit.function(host=True)
    class ValueAndMask:
        @staticmethod
        def output_shapes(x):
            return x, x

        @staticmethod
        def forward(ctx, x):
            mask = (x > 0).astype(x.dtype)
            ctx.mark_non_differentiable(mask)
            return x * mask, mask

        @staticmethod
        def backward(ctx, g, g_mask):
            assert not g_mask.any()
            return g * (g != 0)

    def loss(x):
        return jnp.sum(ValueAndMask(x)[0]) + jnp.sum(ValueAndMask(x)[1] * 100.0)

    assert_close(jax.grad(loss)(jnp.array([1.0, 2.0, 3.0])), jnp.ones(3))


def test_output_shape_inferred_from_first_array_input():
    assert Cube(X).shape == X.shape
    assert jax.eval_shape(Cube, X) == jax.ShapeDtypeStruct(X.shape, X.dtype)


def test_wrong_inferred_output_shape_raises_naming_class_and_output():
    Total = host_function("Total", forward=lambda ctx, x: x.sum())
    with raises_in_callback("Total.forward returned output with shape () and dtype float32, "
                            "but the shape and dtype of input 'x'"):
        Total(X).block_until_ready()


def test_wrong_declared_output_dtype_raises():
    Floor = host_function(
        "Floor",
        output_shapes=lambda x: jax.ShapeDtypeStruct(x.shape, jnp.int32),
        forward=lambda ctx, x: np.floor(x),  # float, declared int: not the same kind
    )
    with raises_in_callback("Floor.forward returned output with shape (3,) and dtype float32, "
                            "but Floor.output_shapes gives shape (3,) and dtype int32"):
        Floor(X).block_until_ready()


@pytest.mark.parametrize("result", [np.array([1, 0, 2]), np.array([True, False, True])], ids=["int", "bool"])
def test_int_or_bool_output_where_float_is_declared_raises_naming_class_and_output(result):
    @vjpkit.function(host=True)
    class Count:
        @staticmethod
        def output_shapes(x):
            return {"n": x}

        @staticmethod
        def forward(ctx, x):
            return {"n": result}

    kind = "integer" if result.dtype != bool else "bool"
    with raises_in_callback(f"Count.forward returned output['n'] with shape (3,) and dtype {result.dtype}, "
                            "but Count.output_shapes gives shape (3,) and dtype float32. vjpkit casts an "
                            f"output only within its kind of dtype (float64 to float32), not across kinds "
                            f"({kind} to floating)."):
        Count(X)["n"].block_until_ready()


def test_float64_output_where_float32_is_declared_is_cast():
    @vjpkit.function(host=True)
    class Half:
        @staticmethod
        def forward(ctx, x):
            return np.asarray(x, np.float64) / 2

    out = Half(X)
    assert out.dtype == jnp.float32
    assert_close(out, X / 2)


def test_scalar_float64_output_crosses_with_x64_on(x64):
    x = jnp.arange(3.0, dtype=jnp.float64)
    assert SumOfCubes(x) == 9.0 and SumOfCubes(x).shape == ()  # forward's np.sum: a NumPy float64 scalar
    assert jax.grad(SumOfCubes)(x).tolist() == [0.0, 3.0, 12.0]


def test_wrong_output_count_raises_naming_class():
    Pair = host_function("Pair", output_shapes=lambda x: x, forward=lambda ctx, x: (x, x))
    with raises_in_callback("Pair.forward returned 2 outputs"):
        Pair(X).block_until_ready()


def test_output_shapes_returning_a_non_shape_raises_while_tracing():
    Bad = host_function("Bad", output_shapes=lambda x: (x, (3,)), forward=lambda ctx, x: (x, x))
    with pytest.raises(TypeError, match=re.escape("Bad.output_shapes returned 3 for output[1][0]")):
        Bad(X)


def test_no_array_input_without_output_shapes_raises():
    Constant = host_function("Constant", forward=lambda ctx, n: np.zeros(n))
    with pytest.raises(TypeError, match="Constant is a host Function with no array input"):
        Constant(3)


# -- backward errors ---------------------------------------------------------


def test_wrong_gradient_count_raises_naming_class():
    TooMany = host_identity("TooMany", lambda ctx, g: (g, g))
    with raises_in_callback("TooMany.backward returned 2 gradients, expected 1"):
        jax.grad(lambda x: TooMany(x).sum())(X).block_until_ready()


def test_wrong_gradient_shape_raises_naming_class_and_input():
    BadShape = host_identity("BadShape", lambda ctx, g: np.ones(5, np.float32))
    with raises_in_callback("BadShape.backward returned a gradient of shape (5,) for input 0 ('x')"):
        jax.grad(lambda x: BadShape(x).sum())(X).block_until_ready()


# -- higher order --------------------------------------------------------------------


@pytest.mark.parametrize(
    "second_order",
    [
        lambda f: jax.grad(jax.grad(lambda s: f(s)))(jnp.float32(2.0)),
        lambda f: jax.hessian(lambda x: f(x).sum())(X),
        lambda f: jax.jacfwd(jax.grad(lambda x: f(x).sum()))(X),
    ],
    ids=["grad_of_grad", "hessian", "jacfwd_of_grad"],
)
def test_second_derivative_raises_naming_the_class(second_order):
    with pytest.raises(RuntimeError, match=r"Cube\.backward runs in NumPy \(host=True\), so it cannot be "
                                           r"differentiated") as info:
        second_order(Cube)
    assert type(info.value) is RuntimeError


def test_forward_mode_raises_naming_the_class():
    with pytest.raises(TypeError, match="Cube"):
        jax.jvp(Cube, (X,), (X,))


def test_jvp_on_a_host_function_raises_at_class_creation():
    with pytest.raises(TypeError, match="HostJvp is a host Function .* and defines jvp"):
        host_function("HostJvp", forward=lambda ctx, x: x, jvp=lambda ctx, t: t)


# -- vmap ----------------------------------------------------------------------------


def test_vmap_is_sequential_by_default():
    shapes = []

    class Rows(Cube):  # recording the shape each forward gets
        @staticmethod
        def forward(ctx, x):
            shapes.append(x.shape)
            return Cube.forward(ctx, x)

    xs = jnp.stack([X, 2 * X])
    assert_close(jax.vmap(Rows)(xs), xs**3)
    assert shapes == [(3,), (3,)]
    assert_close(jax.vmap(jax.grad(cube_loss(Rows)))(xs), jax.vmap(jax.grad(cube_loss(cube_jnp)))(xs))


def test_vmap_expand_dims_calls_numpy_once_with_the_batch():
    shapes = []

    class Scaled(Mul):  # recording the shapes each forward gets
        host, vmap_method = True, "expand_dims"

        @staticmethod
        def forward(ctx, x, w):
            shapes.append((x.shape, w.shape))
            return Mul.forward(ctx, x, w)

    xs = jnp.stack([X, 2 * X, 3 * X])
    w = jnp.array([1.0, 2.0, 3.0])
    assert_close(jax.vmap(Scaled, in_axes=(0, None))(xs, w), xs * w)
    assert shapes == [((3, 3), (1, 3))]  # one call; the unbatched w has a size-1 axis
    per_example = jax.vmap(jax.grad(lambda x: jnp.sum(Scaled(x, w) ** 2)))(xs)
    assert_close(per_example, jax.vmap(jax.grad(lambda x: jnp.sum((x * w) ** 2)))(xs))
    # The per-example gradient of the unbatched w: one per example, not summed.
    per_example_w = jax.vmap(jax.grad(lambda w, x: jnp.sum(Scaled(x, w) ** 2)), in_axes=(None, 0))(w, xs)
    assert_close(per_example_w, jax.vmap(jax.grad(lambda w, x: jnp.sum((x * w) ** 2)), in_axes=(None, 0))(w, xs))


# x (rows, n) times w (n,) in NumPy: w's gradient is broadcast over the rows, and summed down.
RowScale = fresh(Mul, "RowScale", host=True, vmap_method="expand_dims")


def test_vmap_expand_dims_broadcast_gradient_of_an_unbatched_input_is_summed_per_example():
    x = jnp.array([[0.5, -1.0, 2.0], [1.0, 2.0, 3.0]])
    xs = jnp.stack([x, 2 * x, -x, x + 1])
    w = jnp.array([1.0, 2.0, 3.0])

    def per_example(row_scale):
        return jax.vmap(jax.grad(lambda x, w: jnp.sum(row_scale(x, w) ** 2), argnums=(0, 1)), in_axes=(0, None))

    want = per_example(lambda x, w: x * w)(xs, w)
    gx, gw = per_example(RowScale)(xs, w)
    assert gw.shape == (4, 3)
    assert_close((gx, gw), want)
    assert_close(jax.jit(per_example(RowScale))(xs, w), want)


def test_vmap_expand_dims_wrong_per_example_gradient_shape_is_reported_per_example():
    Transposed = host_identity("Transposed", lambda ctx, g: np.swapaxes(g, -1, -2), vmap_method="expand_dims")
    xs = jnp.ones((4, 2, 3))
    with raises_in_callback("Transposed.backward returned a gradient of shape (3, 2) for input 0 ('x'): "
                            "expected shape (2, 3)"):
        jax.vmap(jax.grad(lambda x: Transposed(x).sum()))(xs).block_until_ready()


def test_vmap_expand_dims_gradient_without_the_batch_axes_raises():
    # leading axis 2: neither the batch (4) nor 1
    FirstOnly = host_identity("FirstOnly", lambda ctx, g: np.concatenate([g, g]), vmap_method="expand_dims")
    xs = jnp.ones((4, 3))
    with raises_in_callback("FirstOnly.backward returned a gradient whose leading (batch) axes do not match "
                            "the batch (4,) under jax.vmap with vmap_method='expand_dims'"):
        jax.vmap(jax.grad(lambda x: FirstOnly(x).sum()))(xs).block_until_ready()


def test_vmap_staticmethod_in_pytorch_style_batches_forward():
    calls = []

    @vjpkit.function(host=True)
    class Affine:
        @staticmethod
        def output_shapes(x, w):
            return jax.ShapeDtypeStruct(w.shape[1:], x.dtype)

        @staticmethod
        def forward(ctx, x, w):
            ctx.save_for_backward(x, w)
            return x @ w

        @staticmethod
        def backward(ctx, g):
            x, w = ctx.saved_tensors
            return g @ w.T, np.outer(x, g)

        @staticmethod
        def vmap(info, in_dims, x, w):
            calls.append((info.batch_size, in_dims))
            assert in_dims == (0, None)
            return x @ w, 0

    xs = jnp.stack([X, 2 * X, -X, X + 1])
    w = jnp.arange(6.0).reshape(3, 2)
    assert_close(jax.vmap(Affine, in_axes=(0, None))(xs, w), xs @ w)
    assert calls == [(4, (0, None))]
    # Per-example gradients: backward runs once per example (sequential).
    per_example = jax.vmap(jax.grad(lambda x: jnp.sum(Affine(x, w) ** 2)))(xs)
    assert_close(per_example, jax.vmap(jax.grad(lambda x: jnp.sum((x @ w) ** 2)))(xs))


def test_unknown_vmap_method_raises_at_class_creation():
    with pytest.raises(ValueError, match="Bad: vmap_method='vectorized' is not one of"):

        @vjpkit.function(host=True, vmap_method="vectorized")
        class Bad:
            @staticmethod
            def forward(ctx, x):
                return x


# -- NumPy in a Function that is not host-side ------------------------------------


def test_numpy_on_a_traced_array_points_to_host_mode():
    class NotHost(vjpkit.Function):
        @staticmethod
        def forward(ctx, x):
            return np.sin(np.asarray(x))

    with pytest.raises(TypeError, match=r"NotHost\.forward converted a traced JAX array to NumPy.*host=True"):
        NotHost(X)


# -- the examples, and gradcheck ----------------------------------------------------


def test_trimmed_mean_example_matches_jnp():
    rows = jnp.asarray(np.random.default_rng(1).normal(size=(4, 7)), dtype=jnp.float32)

    def loss(f):
        return lambda r: jnp.sum(f(r, 2) ** 2)

    assert_close(jax.jit(jax.grad(loss(TrimmedMean.apply)))(rows), jax.grad(loss(trimmed_mean_jnp))(rows))


def test_solve_example_matches_jnp():
    rng = np.random.default_rng(2)
    A = jnp.asarray(rng.normal(size=(5, 5)) + 5 * np.eye(5), dtype=jnp.float32)
    b = jnp.asarray(rng.normal(size=5), dtype=jnp.float32)

    def grad(solve):
        return jax.grad(lambda A, b: jnp.sum(jnp.sin(solve(A, b))), argnums=(0, 1))(A, b)

    assert_close(grad(Solve), grad(jnp.linalg.solve), rtol=1e-4, atol=1e-5)


def test_gradcheck_solve():
    rng = np.random.default_rng(3)
    A = rng.normal(size=(3, 3)) + 3 * np.eye(3)  # float64, with x64 off process-wide
    b = rng.normal(size=3)
    assert vjpkit.gradcheck(Solve.apply, (A, b))


def test_gradcheck_trimmed_mean():
    x = np.random.default_rng(4).normal(size=6)  # distinct values: differentiable there
    assert vjpkit.gradcheck(lambda x: TrimmedMean.apply(x, 1), (x,))


def test_64_bit_arrays_cross_exactly_where_the_callback_thread_has_x64_off():
    """Traced under jax.enable_x64() (thread-local), run where x64 is off.

    That is where XLA may run the callback (a thread of its own); here the
    compiled programs run after the context is left, so every run has x64
    off in the thread of the callback.
    """
    seen = []

    @vjpkit.function(host=True)
    class Wide:
        @staticmethod
        def output_shapes(x, n, z):
            return x, n, z

        @staticmethod
        def forward(ctx, x, n, z):
            seen.append((x.dtype, n.dtype, z.dtype))
            ctx.save_for_backward(x)
            return np.sin(x), n + 2**40, 2 * z

        @staticmethod
        def backward(ctx, gx, gn, gz):
            (x,) = ctx.saved_tensors
            seen.append((gx.dtype, gz.dtype))
            return gx * np.cos(x), None, 2 * gz

    x = np.array([1 / 3, 2.0, -0.7])
    n = np.array([1, -5, 2**50], np.int64)
    z = np.array([1 / 3 + 1e-12j, -2.5j, 1.0])

    def loss(wide):
        def total(x, z):
            y, _, w = wide(x, n, z)
            return jnp.sum(y) + jnp.sum(jnp.real(w) * jnp.arange(3.0) + jnp.imag(w))

        return jax.grad(total, argnums=(0, 1))

    with enable_x64(True):
        x, n, z = jnp.asarray(x), jnp.asarray(n), jnp.asarray(z)
        forward = jax.jit(Wide).lower(x, n, z).compile()
        gradient = jax.jit(loss(Wide)).lower(x, z).compile()
        want_gx, want_gz = loss(lambda x, n, z: (jnp.sin(x), n, 2 * z))(x, z)
    y, m, w = forward(x, n, z)
    gx, gz = gradient(x, z)
    np.testing.assert_array_equal(y, np.sin(np.asarray(x)))
    np.testing.assert_array_equal(m, np.asarray(n) + 2**40)
    np.testing.assert_array_equal(w, 2 * np.asarray(z))
    assert (y.dtype, m.dtype, w.dtype) == (np.float64, np.int64, np.complex128)
    np.testing.assert_allclose(gx, want_gx, rtol=1e-15)
    np.testing.assert_allclose(gz, want_gz, rtol=1e-15)
    f64, i64, c128 = np.dtype(np.float64), np.dtype(np.int64), np.dtype(np.complex128)
    assert set(seen) == {(f64, i64, c128), (f64, c128)}


def test_host_backward_ctx_holds_only_the_users_attributes():
    seen = []

    class Scale(functions.Scale):  # forward sets ctx.c
        host = True

        @staticmethod
        def backward(ctx, g):
            seen.append(sorted(vars(ctx)))
            return functions.Scale.backward(ctx, g)

    assert_close(jax.grad(lambda x: Scale(x).sum())(X), jnp.full(3, 2.0))
    assert seen == [["c"]]


# -- 0-d arrays ----------------------------------------------------------------------


@vjpkit.function(host=True)
class SumOfCubes:
    """A vector in, a 0-d array out."""

    @staticmethod
    def output_shapes(x):
        return jax.ShapeDtypeStruct((), x.dtype)

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return np.sum(x**3)

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return 3 * x**2 * g


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.complex64, np.complex128])
def test_0d_input_and_output_eager_and_jit(dtype, x64):
    x = np.array(0.7, dtype)
    want = jnp.asarray(x) ** 3
    for cube in (Cube.apply, jax.jit(Cube.apply)):
        y = cube(x)
        assert (y.shape, y.dtype) == ((), dtype)
        assert_close(y, want)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_0d_input_grad_and_jit_grad(dtype, x64):
    x = np.array(0.7, dtype)
    want = jax.grad(lambda x: jnp.sin(x**3))(jnp.asarray(x))
    for grad in (jax.grad(lambda x: jnp.sin(Cube(x))), jax.jit(jax.grad(lambda x: jnp.sin(Cube(x))))):
        g = grad(x)
        assert (g.shape, g.dtype) == ((), dtype)
        assert_close(g, want)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_vmap_of_0d_examples_sequential_and_expand_dims(dtype, x64):
    @vjpkit.function(host=True, vmap_method="expand_dims")
    class BatchedCube:
        forward = Cube.forward
        backward = Cube.backward

    xs = np.array([0.7, -1.5, 2.0], dtype)
    want_y = jnp.asarray(xs) ** 3
    want_g = jax.vmap(jax.grad(lambda x: jnp.sin(x**3)))(jnp.asarray(xs))
    for cube in (Cube, BatchedCube):  # sequential hands each example over as a 0-d array
        assert_close(jax.vmap(cube)(xs), want_y)
        g = jax.jit(jax.vmap(jax.grad(lambda x, cube=cube: jnp.sin(cube(x)))))(xs)
        assert g.dtype == dtype
        assert_close(g, want_g)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_0d_output_of_a_vector_input(dtype, x64):
    x = np.array([0.5, -1.0, 2.0], dtype)
    y = SumOfCubes(x)
    assert (y.shape, y.dtype) == ((), dtype)
    assert_close(y, np.sum(x**3))
    assert_close(jax.jit(jax.grad(SumOfCubes))(x), 3 * x**2)
    xs = np.stack([x, 2 * x])
    assert_close(jax.vmap(SumOfCubes)(xs), np.sum(xs**3, axis=1))
    assert_close(jax.vmap(jax.grad(SumOfCubes))(xs), 3 * xs**2)


@pytest.mark.parametrize("dtype", [np.int32, np.int64, np.uint64, np.bool_])
def test_0d_integer_and_bool_arrays_cross_both_ways(dtype, x64):
    @vjpkit.function(host=True)
    class Same:
        @staticmethod
        def forward(ctx, n):
            assert n.shape == () and n.dtype == dtype, (n.shape, n.dtype)
            return n.copy()

    n = np.array(2**40 + 3 if np.dtype(dtype).itemsize == 8 else 1, dtype)
    for same in (Same.apply, jax.jit(Same.apply)):
        m = same(n)
        assert (m.shape, m.dtype) == ((), dtype)
        assert m == n


# -- a vmap staticmethod that returns something malformed ----------------------------


def host_pair(vmap_rule):
    """x -> (2x, x.sum()), batched by ``vmap_rule(xs)``, which returns (outputs, out_dims)."""

    @vjpkit.function(host=True)
    class Pair:
        @staticmethod
        def output_shapes(x):
            return x, jax.ShapeDtypeStruct((), x.dtype)

        @staticmethod
        def forward(ctx, x):
            return 2 * x, x.sum()

        @staticmethod
        def vmap(info, in_dims, x):
            return vmap_rule(x)

    return Pair


XS = jnp.stack([X, 2 * X, -X, X + 1])  # a batch of 4 examples of shape (3,)
PAIR_WANT = (2 * XS, XS.sum(1))


def test_vmap_staticmethod_int_out_dims_applies_to_every_output():
    assert_close(jax.vmap(host_pair(lambda x: ((2 * x, x.sum(1)), 0)))(XS), PAIR_WANT)


def test_vmap_staticmethod_out_dims_by_output_negative_and_none():
    first = X.sum()
    rule = lambda x: ((2 * x.T, np.asarray(first)), (-1, None))  # noqa: E731
    y, s = jax.vmap(host_pair(rule))(XS)
    assert_close(y, 2 * XS)
    assert_close(s, jnp.full(4, first))


def test_vmap_staticmethod_out_dims_of_another_structure_raises_naming_the_class_and_structures():
    pair = host_pair(lambda x: ((2 * x, x.sum(1)), (0, 0, 0)))
    with raises_in_callback("Pair.vmap returned out_dims=(0, 0, 0) for outputs 2 outputs (structure "
                            "PyTreeDef((*, *))): expected an int or None for every output, or a pytree of them"):
        jax.block_until_ready(jax.vmap(pair)(XS))


def test_vmap_staticmethod_tuple_out_dims_for_one_output_raises():
    @vjpkit.function(host=True)
    class Double:
        @staticmethod
        def forward(ctx, x):
            return 2 * x

        @staticmethod
        def vmap(info, in_dims, x):
            return 2 * x, (0,)

    with raises_in_callback("Double.vmap returned out_dims=(0,) for outputs array of shape (4, 3) and dtype "
                            "float32 (structure PyTreeDef(*)): expected an int or None for every output"):
        jax.vmap(Double)(XS).block_until_ready()


@pytest.mark.parametrize("out_dims", ["0", 0.0, True])
def test_vmap_staticmethod_out_dims_that_are_not_ints_raise(out_dims):
    pair = host_pair(lambda x: ((2 * x, x.sum(1)), out_dims))
    with raises_in_callback(f"Pair.vmap returned out_dims={out_dims!r} for outputs 2 outputs"):
        jax.block_until_ready(jax.vmap(pair)(XS))


def test_vmap_staticmethod_wrong_number_of_outputs_raises_naming_vmap():
    pair = host_pair(lambda x: ((2 * x, x.sum(1), x), 0))
    with raises_in_callback("Pair.vmap returned outputs 3 outputs (structure PyTreeDef((*, *, *))), but "
                            "Pair.output_shapes gives 2 output(s) with structure PyTreeDef((*, *))"):
        jax.block_until_ready(jax.vmap(pair)(XS))


def test_vmap_staticmethod_out_dims_out_of_range_raises():
    pair = host_pair(lambda x: ((2 * x, x.sum(1)), (0, 1)))
    with raises_in_callback("Pair.vmap returned output[1] of shape (4,) with out_dims 1, which is not one of "
                            "its axes (expected shape (4,) with the batch of 4 at axis 0, or () with out_dims None)"):
        jax.block_until_ready(jax.vmap(pair)(XS))


def test_vmap_staticmethod_batch_axis_of_the_wrong_size_raises():
    pair = host_pair(lambda x: ((2 * x, x.sum()), 0))  # the sum over the whole batch: shape ()
    with raises_in_callback("Pair.vmap returned output[1] of shape () with out_dims 0, which is not one of its axes"):
        jax.block_until_ready(jax.vmap(pair)(XS))
    pair = host_pair(lambda x: ((2 * x, x.sum(0)), 0))  # summed over the batch, not the example: shape (3,)
    with raises_in_callback("Pair.vmap returned output[1] of shape (3,) whose batch axis (out_dims 0) has size 3, "
                            "but the batch has 4 examples (info.batch_size)"):
        jax.block_until_ready(jax.vmap(pair)(XS))


def test_vmap_staticmethod_wrong_example_shape_raises():
    pair = host_pair(lambda x: ((2 * x[:, :2], x.sum(1)), 0))
    with raises_in_callback("Pair.vmap returned output[0] of shape (4, 2) and dtype float32 with out_dims 0: one "
                            "example of shape (2,), but Pair.output_shapes gives shape (3,) and dtype float32"):
        jax.block_until_ready(jax.vmap(pair)(XS))


def test_an_error_in_a_program_that_runs_asynchronously_arrives_where_the_result_is_awaited():
    # As on a GPU: given an input still being computed, the call returns before the NumPy code runs.
    batched = jax.jit(jax.vmap(host_pair(lambda x: ((2 * x, x.sum(1)), (0, 0, 0)))))
    with raises_in_callback("Pair.vmap returned out_dims=(0, 0, 0)"):
        jax.block_until_ready(batched(XS))  # compiled here (on the CPU the call itself raises)
    out = batched(pending(XS))
    with raises_in_callback("Pair.vmap returned out_dims=(0, 0, 0)"):
        jax.block_until_ready(out)
    with raises_in_callback("Pair.vmap returned out_dims=(0, 0, 0)"):
        # Internals on purpose: jax.effects_barrier, then its failed token dropped (JAX would raise it at exit).
        from vjpkit._jax_internals import effects_barrier

        effects_barrier()


def test_the_hosts_own_exception_is_carried_beside_the_runtimes_error():
    # Internals on purpose: what vjpkit (and tests/test_misuse_catalogue.py) read instead of the runtime's
    # text, which each backend words its own way.
    from vjpkit import _callback_errors

    Total = host_function("Total", forward=lambda ctx, x: x.sum())
    start = _callback_errors.mark()
    with raises_in_callback("Total.forward returned output with shape ()"):
        Total(X).block_until_ready()
    (carried,) = _callback_errors.carried_since(start, "host")
    assert type(carried) is ValueError
    assert str(carried) == (
        "Total.forward returned output with shape () and dtype float32, but the shape and dtype of input 'x' "
        "(inferred: Total defines no output_shapes) gives shape (3,) and dtype float32. Fix forward, or define (or "
        "fix) the staticmethod Total.output_shapes(*inputs) returning a jax.ShapeDtypeStruct per output."
    )
