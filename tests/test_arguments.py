"""Arguments and outputs: what is traced, what is static, and how backward's
arguments and results line up with forward's.

Expected values are written out or come from `jax.grad` of the same math in
plain `jnp`.
"""

import inspect

import chex
import functions
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from functions import AddBias, MulByScalar, SinCos
from hypothesis import given, settings
from hypothesis import strategies as st

import vjpkit
from vjpkit._args import Signature  # internals on purpose: the binder is checked against inspect directly

X = jnp.array([0.5, -1.0, 2.0])
W = jnp.array([1.5, 2.0, -0.5])
ZEROS = jnp.zeros(3)


# ---------------------------------------------------------------------------
# Static arguments


def scale_recording(seen):
    """A new ``functions.Scale`` (caches of its own) whose forward appends the type of c it sees to ``seen``."""

    class Scale(functions.Scale):
        @staticmethod
        def forward(ctx, x, c):
            seen.append(type(c))
            return functions.Scale.forward(ctx, x, c)

    return Scale


def test_python_scalar_argument_is_static():
    seen = []
    MulConstant = scale_recording(seen)
    chex.assert_trees_all_close(MulConstant.apply(X, 3.0), 3.0 * X)
    chex.assert_trees_all_close(jax.grad(lambda x: MulConstant.apply(x, 3.0).sum())(X), jnp.full(3, 3.0))
    assert set(seen) == {float}  # the Python value itself, never a tracer


def test_string_argument_selects_code_in_forward():
    class Activate(vjpkit.Function):
        @staticmethod
        def forward(ctx, x, kind):
            ctx.save_for_backward(x)
            ctx.kind = kind
            return jnp.tanh(x) if kind == "tanh" else jnp.sin(x)

        @staticmethod
        def backward(ctx, g):
            (x,) = ctx.saved_tensors
            d = 1 - jnp.tanh(x) ** 2 if ctx.kind == "tanh" else jnp.cos(x)
            return g * d, None

    for kind, fn in (("tanh", jnp.tanh), ("sin", jnp.sin)):
        chex.assert_trees_all_close(Activate.apply(X, kind), fn(X))
        expected = jax.grad(lambda x, fn=fn: fn(x).sum())(X)
        chex.assert_trees_all_close(jax.grad(lambda x, kind=kind: Activate.apply(x, kind).sum())(X), expected)


def test_none_argument_is_static():
    class Linear(vjpkit.Function):
        @staticmethod
        def forward(ctx, x, w, b=None):
            ctx.save_for_backward(x, w, b)
            y = x * w
            return y if b is None else y + b

        @staticmethod
        def backward(ctx, g):
            x, w, b = ctx.saved_tensors
            return g * w, g * x, None if b is None else g

    chex.assert_trees_all_close(Linear.apply(X, W, None), X * W)
    chex.assert_trees_all_close(Linear.apply(X, W, jnp.ones(3)), X * W + 1)
    gx, gw, gb = jax.grad(lambda *a: Linear.apply(*a).sum(), argnums=(0, 1, 2))(X, W, jnp.ones(3))
    chex.assert_trees_all_close((gx, gw, gb), (W, X, jnp.ones(3)))
    assert Linear.cache_info().programs == 2  # b=None and b=array


def test_callable_argument_is_static():
    class Apply(vjpkit.Function):
        @staticmethod
        def forward(ctx, x, fn, dfn):
            ctx.save_for_backward(x)
            ctx.dfn = dfn
            return fn(x)

        @staticmethod
        def backward(ctx, g):
            (x,) = ctx.saved_tensors
            return g * ctx.dfn(x), None, None

    got = jax.grad(lambda x: Apply.apply(x, jnp.exp, jnp.exp).sum())(X)
    chex.assert_trees_all_close(got, jnp.exp(X))
    got = jax.grad(lambda x: Apply.apply(x, jnp.sin, jnp.cos).sum())(X)
    chex.assert_trees_all_close(got, jnp.cos(X))
    assert Apply.cache_info().programs == 2


def test_static_arguments_of_equal_value_but_different_type_are_distinct_programs():
    seen = []
    Scale = scale_recording(seen)
    for c in (1, 1.0, True):
        Scale.apply(X, c)
    assert Scale.cache_info().programs == 3
    assert seen == [int, float, bool]


def test_static_argument_of_the_same_value_reuses_the_program():
    Scale = functions.fresh(functions.Scale)  # a class of its own: the test counts its programs
    Scale.apply(X, 2.0)
    Scale.apply(X + 1, 2.0)
    Scale.apply(X, 3.0)
    info = Scale.cache_info()
    assert (info.programs, info.hits, info.misses) == (2, 1, 2)


def test_traced_scalar_via_jnp_asarray_gets_a_gradient():
    gc = jax.grad(lambda c: MulByScalar.apply(X, c).sum())(jnp.asarray(2.0))
    chex.assert_trees_all_close(gc, X.sum())


# ---------------------------------------------------------------------------
# Binding: keywords, defaults, *args


def _affine():
    class Affine(vjpkit.Function):
        @staticmethod
        def forward(ctx, x, w, b=ZEROS, *, scale=1.0):
            ctx.save_for_backward(x, w)
            ctx.scale = scale
            return (x * w + b) * scale

        @staticmethod
        def backward(ctx, g):
            x, w = ctx.saved_tensors
            g = g * ctx.scale
            return g * w, g * x, g, None

    return Affine


def test_keyword_arguments_bind_to_forward_parameters():
    Affine = _affine()
    b = jnp.ones(3)
    chex.assert_trees_all_close(Affine.apply(x=X, w=W, b=b, scale=2.0), (X * W + b) * 2.0)
    chex.assert_trees_all_close(Affine.apply(X, b=b, w=W), X * W + b)


def test_default_argument_is_an_input():
    Affine = _affine()
    chex.assert_trees_all_close(Affine.apply(X, W), X * W)
    # A default array is an input like any other; it gets its own gradient slot.
    gx = jax.grad(lambda x: Affine.apply(x, W, scale=3.0).sum())(X)
    chex.assert_trees_all_close(gx, 3.0 * W)


def test_keyword_and_positional_calls_share_a_program():
    Affine = _affine()
    Affine.apply(X, W, jnp.ones(3))
    Affine.apply(x=X, w=W, b=jnp.ones(3))
    Affine.apply(X, W, b=jnp.ones(3), scale=1.0)
    assert Affine.cache_info().programs == 1


def test_gradients_by_keyword_match_plain_jnp():
    Affine = _affine()

    def plain(x, w, b):
        return ((x * w + b) * 2.0).sum()

    got = jax.grad(lambda x, w, b: Affine.apply(x, w=w, b=b, scale=2.0).sum(), argnums=(0, 1, 2))(
        X, W, jnp.ones(3)
    )
    chex.assert_trees_all_close(got, jax.grad(plain, argnums=(0, 1, 2))(X, W, jnp.ones(3)))


def test_varargs_get_one_gradient_each():
    class Product(vjpkit.Function):
        @staticmethod
        def forward(ctx, *xs):
            ctx.save_for_backward(*xs)
            out = xs[0]
            for x in xs[1:]:
                out = out * x
            return out

        @staticmethod
        def backward(ctx, g):
            xs = ctx.saved_tensors
            total = g
            for x in xs:
                total = total * x
            return tuple(total / x for x in xs)

    z = jnp.array([2.0, 3.0, 4.0])
    got = jax.grad(lambda *a: Product.apply(*a).sum(), argnums=(0, 1, 2))(X, W, z)
    expected = jax.grad(lambda a, b, c: (a * b * c).sum(), argnums=(0, 1, 2))(X, W, z)
    chex.assert_trees_all_close(got, expected)
    chex.assert_trees_all_close(Product.apply(X, W), X * W)


def test_keyword_only_array_gets_its_gradient_after_varargs():
    class Combine(vjpkit.Function):
        @staticmethod
        def forward(ctx, x, *rest, w, scale=2.0):
            ctx.save_for_backward(x, w)
            ctx.scale = scale
            return x * w * scale + sum(rest)

        @staticmethod
        def backward(ctx, g):
            x, w = ctx.saved_tensors
            # Order: positional, each *rest value, then keyword-only.
            return g * w * ctx.scale, g, g * x * ctx.scale, None

    z = jnp.array([2.0, 3.0, 4.0])
    got = jax.grad(lambda x, w, z: Combine.apply(x, z, w=w).sum(), argnums=(0, 1, 2))(X, W, z)
    expected = jax.grad(lambda x, w, z: (x * w * 2.0 + z).sum(), argnums=(0, 1, 2))(X, W, z)
    chex.assert_trees_all_close(got, expected)


# The binder on apply's per-call path is hand-written for speed; Python's own
# inspect.Signature.bind is the reference it must agree with, call for call.
_POSITIONAL_KINDS = st.sampled_from([inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD])


@st.composite
def _signatures(draw):
    """Parameters p0, p1, ...: positional-only, then positional-or-keyword, an optional *rest, then
    keyword-only; positional defaults form a suffix, keyword-only ones come in any pattern."""
    kinds = sorted(draw(st.lists(_POSITIONAL_KINDS, max_size=4)))
    first_default = draw(st.integers(0, len(kinds)))
    params = [
        inspect.Parameter(f"p{i}", kind, default=f"default{i}" if i >= first_default else inspect.Parameter.empty)
        for i, kind in enumerate(kinds)
    ]
    if draw(st.booleans()):
        params.append(inspect.Parameter("rest", inspect.Parameter.VAR_POSITIONAL))
    for i in range(len(kinds), len(kinds) + draw(st.integers(0, 3))):
        default = f"default{i}" if draw(st.booleans()) else inspect.Parameter.empty
        params.append(inspect.Parameter(f"p{i}", inspect.Parameter.KEYWORD_ONLY, default=default))
    return inspect.Signature(params)


@st.composite
def _calls(draw, signature):
    """Positional values, then keywords: parameter names (any kind, even positional-only) or unknown ones."""
    n_args = draw(st.integers(0, len(signature.parameters) + 2))
    names = st.sampled_from([*signature.parameters, "unknown"])
    keywords = draw(st.lists(names, unique=True, max_size=4))
    args = tuple(f"arg{i}" for i in range(n_args))
    return args, {name: f"kw_{name}" for name in keywords}


def _bind_like_python(signature, args, kwargs):
    """inspect's binding, in vjpkit's order: positional, each *args value, keyword-only; defaults filled."""
    bound = signature.bind(*args, **kwargs)
    bound.apply_defaults()
    values = []
    for name, param in signature.parameters.items():
        value = bound.arguments[name]
        values.extend(value if param.kind is inspect.Parameter.VAR_POSITIONAL else [value])
    return tuple(values)


@given(st.data())
def test_binding_agrees_with_inspect_signature_bind(data):
    signature = data.draw(_signatures(), label="signature")
    args, kwargs = data.draw(_calls(signature), label="call")

    def forward(*args, **kwargs):
        raise AssertionError("only the signature is used")

    forward.__signature__ = signature
    binder = Signature("Random", forward, skip_first=False)
    try:
        expected = _bind_like_python(signature, args, kwargs)
    except TypeError:
        with pytest.raises(TypeError, match=r"^Random\.apply "):
            binder.bind(args, kwargs)
    else:
        assert binder.bind(args, kwargs) == expected


# ---------------------------------------------------------------------------
# Pytrees in and out


def test_dict_of_parameters_gets_a_dict_gradient():
    class Dense(vjpkit.Function):
        @staticmethod
        def forward(ctx, params, x):
            ctx.save_for_backward(params["w"], x)
            return x @ params["w"] + params["b"]

        @staticmethod
        def backward(ctx, g):
            w, x = ctx.saved_tensors
            return {"w": x.T @ g, "b": g.sum(0)}, g @ w.T

    params = {"w": jnp.arange(6.0).reshape(3, 2) / 6, "b": jnp.array([0.1, -0.2])}
    x = jnp.arange(12.0).reshape(4, 3) / 12

    def plain(params, x):
        return jnp.tanh(x @ params["w"] + params["b"]).sum()

    got = jax.grad(lambda p, x: jnp.tanh(Dense.apply(p, x)).sum(), argnums=(0, 1))(params, x)
    expected = jax.grad(plain, argnums=(0, 1))(params, x)
    assert set(got[0]) == {"w", "b"}
    chex.assert_trees_all_close(got, expected, rtol=1e-6)


def test_pytree_output_gets_one_gradient_with_its_structure():
    seen = []

    class Split(vjpkit.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return {"sin": jnp.sin(x), "parts": [x * 2, x**2]}

        @staticmethod
        def backward(ctx, g):
            seen.append(sorted(g))
            (x,) = ctx.saved_tensors
            return g["sin"] * jnp.cos(x) + g["parts"][0] * 2 + g["parts"][1] * 2 * x

    def loss(f, x):
        out = f(x)
        return (out["sin"] * out["parts"][0] + out["parts"][1]).sum()

    plain = lambda x: {"sin": jnp.sin(x), "parts": [x * 2, x**2]}  # noqa: E731
    chex.assert_trees_all_close(
        jax.grad(lambda x: loss(Split.apply, x))(X), jax.grad(lambda x: loss(plain, x))(X), rtol=1e-6
    )
    assert seen == [["parts", "sin"]]


def test_tuple_output_spreads_to_backward_positional_arguments():
    # SinCos.backward(ctx, g_sin, g_cos)
    def loss(f, x):
        s, c = f(x)
        return (s * 3 + c**2).sum()

    plain = lambda x: (jnp.sin(x), jnp.cos(x))  # noqa: E731
    chex.assert_trees_all_close(
        jax.grad(lambda x: loss(SinCos.apply, x))(X), jax.grad(lambda x: loss(plain, x))(X), rtol=1e-6
    )


def test_non_array_output_leaves_pass_through_as_static():
    class Tagged(vjpkit.Function):
        @staticmethod
        def forward(ctx, x):
            return {"y": 2 * x, "name": "double", "n": 3}

        @staticmethod
        def backward(ctx, g):
            return 2 * g["y"]

    out = Tagged.apply(X)
    assert out["name"] == "double" and out["n"] == 3
    chex.assert_trees_all_close(out["y"], 2 * X)
    chex.assert_trees_all_close(jax.grad(lambda x: Tagged.apply(x)["y"].sum())(X), jnp.full(3, 2.0))


@pytest.mark.parametrize(
    "returned",
    [
        lambda gradient: gradient,  # matches the parameter's structure: its gradient
        lambda gradient: (gradient,),  # the tuple of per-parameter gradients
    ],
    ids=["its_gradient", "a_one_element_tuple_of_it"],
)
def test_one_parameter_whose_value_is_a_tuple_gets_a_tuple_gradient(returned):
    class Mul(vjpkit.Function):
        @staticmethod
        def forward(ctx, pair):
            a, b = pair
            ctx.save_for_backward(a, b)
            return a * b

        @staticmethod
        def backward(ctx, g):
            a, b = ctx.saved_tensors
            return returned((g * b, g * a))

    ga, gb = jax.grad(lambda p: Mul.apply(p).sum())((X, W))
    chex.assert_trees_all_close((ga, gb), (W, X))


# ---------------------------------------------------------------------------
# Integer and boolean values


def test_integer_input_gets_no_gradient_and_its_slot_is_dropped():
    class Gather(functions.Gather):  # its forward
        @staticmethod
        def backward(ctx, g):
            (idx,) = ctx.saved_tensors
            # Anything in an integer input's slot is dropped.
            return jnp.zeros(ctx.n, g.dtype).at[idx].add(g), jnp.ones(3)

    idx = jnp.array([2, 0, 2])
    chex.assert_trees_all_close(Gather.apply(X, idx), X[idx])
    gx = jax.grad(lambda x: (Gather.apply(x, idx) ** 2).sum())(X)
    expected = jax.grad(lambda x: (x[idx] ** 2).sum())(X)
    chex.assert_trees_all_close(gx, expected)


def test_integer_and_bool_outputs_are_non_differentiable():
    seen = []

    class Argmax(vjpkit.Function):
        @staticmethod
        def forward(ctx, x):
            i = jnp.argmax(x)
            ctx.save_for_backward(i)
            ctx.n = x.shape[0]
            return x[i], i, x > 0

        @staticmethod
        def backward(ctx, g_max, g_index, g_positive):
            seen.append((g_index is None, g_positive is None))
            (i,) = ctx.saved_tensors
            return jnp.zeros(ctx.n, g_max.dtype).at[i].set(g_max)

    m, i, positive = Argmax.apply(X)
    assert int(i) == 2 and float(m) == 2.0
    assert positive.dtype == jnp.bool_
    chex.assert_trees_all_close(jax.grad(lambda x: Argmax.apply(x)[0])(X), jnp.array([0.0, 0.0, 1.0]))
    assert seen == [(False, False)]  # slots exist, materialized (as zeros)


# ---------------------------------------------------------------------------
# What backward may return


def test_trailing_extra_none_gradients_are_allowed():
    class Double(functions.Double):
        @staticmethod
        def backward(ctx, g):
            return 2 * g, None, None

    chex.assert_trees_all_close(jax.grad(lambda x: Double.apply(x).sum())(X), jnp.full(3, 2.0))


def test_none_gradient_means_zero():
    class Mul(functions.Mul):
        @staticmethod
        def backward(ctx, g):
            return None, None

    gx, gw = jax.grad(lambda x, w: Mul.apply(x, w).sum(), argnums=(0, 1))(X, W)
    chex.assert_trees_all_close((gx, gw), (jnp.zeros(3), jnp.zeros(3)))


def test_numpy_array_inputs_are_traced():
    seen = []

    class Mul(functions.Mul):  # records whether w arrived as an array
        @staticmethod
        def forward(ctx, x, w):
            seen.append(isinstance(w, jax.Array))
            return functions.Mul.forward(ctx, x, w)

    x = np.array([0.5, -1.0, 2.0], dtype=np.float32)
    w = np.array([1.5, 2.0, -0.5], dtype=np.float32)
    chex.assert_trees_all_close(Mul.apply(x, w), x * w)
    chex.assert_trees_all_close(jax.grad(lambda x: Mul.apply(x, w).sum())(x), w)
    # A NumPy array of another value reuses the same program: it is traced.
    Mul.apply(x + 1, w)
    assert Mul.cache_info().programs == 1
    assert all(seen)


def test_broadcast_gradient_is_summed_down_to_the_input_shape():
    # AddBias's backward returns g, of x's shape (4, 3), for b of shape (1, 3).
    x = jnp.arange(12.0).reshape(4, 3)
    b = jnp.array([[1.0, 2.0, 3.0]])
    gb = jax.grad(lambda b: (AddBias.apply(x, b) * x).sum())(b)
    expected = jax.grad(lambda b: ((x + b) * x).sum())(b)
    assert gb.shape == (1, 3)
    chex.assert_trees_all_close(gb, expected)


def test_broadcast_gradient_with_leading_axes_is_summed_down():
    # AddBias's backward returns g, of shape (2, 4, 3), for b of shape (3,).
    x = jnp.ones((2, 4, 3))
    gb = jax.grad(lambda b: AddBias.apply(x, b).sum())(jnp.zeros(3))
    chex.assert_trees_all_close(gb, jnp.full(3, 8.0))


@settings(max_examples=6, deadline=None)
@given(
    b_shape=st.lists(st.sampled_from([1, 2]), min_size=0, max_size=3),
    lead=st.lists(st.integers(1, 3), min_size=0, max_size=2),
)
def test_any_broadcast_gradient_is_summed_down_like_autodiff(b_shape, lead):
    # x has the full broadcast shape; b is broadcast up to it in forward.
    b_shape = tuple(b_shape)
    x_shape = (*lead, *(2 for _ in b_shape))
    x = jnp.arange(np.prod(x_shape), dtype=jnp.float32).reshape(x_shape)
    b = jnp.ones(b_shape)
    gb = jax.grad(lambda b: (AddBias.apply(x, b) * x).sum())(b)
    expected = jax.grad(lambda b: ((x + b) * x).sum())(b)
    assert gb.shape == b_shape
    chex.assert_trees_all_close(gb, expected)


def test_gradient_of_another_float_dtype_is_cast_to_the_input_dtype():
    class Half(functions.Double):
        @staticmethod
        def backward(ctx, g):
            return (g * 2).astype(jnp.bfloat16)

    gx = jax.grad(lambda x: Half.apply(x).sum())(X)
    assert gx.dtype == jnp.float32
    chex.assert_trees_all_close(gx, jnp.full(3, 2.0))


def test_real_gradient_for_a_complex_input_is_cast():
    class Scale(functions.Double):  # 2 * z
        @staticmethod
        def backward(ctx, g):
            return jnp.real(g) * 2  # float32 for a complex64 input

    z = jnp.array([1 + 1j, 2 - 1j], dtype=jnp.complex64)
    _, vjp = jax.vjp(Scale.apply, z)
    (gz,) = vjp(jnp.ones(2, jnp.complex64))
    assert gz.dtype == jnp.complex64
    chex.assert_trees_all_close(gz, jnp.full(2, 2.0 + 0j, jnp.complex64))


def test_one_parameter_whose_value_is_a_one_element_tuple_gets_its_gradient():
    class Scale(vjpkit.Function):
        @staticmethod
        def forward(ctx, single):
            (a,) = single
            return a * 3

        @staticmethod
        def backward(ctx, g):
            return (g * 3,)  # matches the parameter's structure: its gradient

    (ga,) = jax.grad(lambda p: Scale.apply(p).sum())((X,))
    chex.assert_trees_all_close(ga, jnp.full(3, 3.0))
