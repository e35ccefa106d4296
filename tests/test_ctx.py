"""The ctx object, member by member: save_for_backward and saved_tensors,
needs_input_grad, attributes, set_materialize_grads, mark_non_differentiable,
mark_dirty, the setup_context style, and once_differentiable backwards.

A test that keeps trace-time records (lists appended to from forward or
backward) defines its own Function class: forward and backward run while JAX
traces, once per compiled signature, so a fresh class is what makes the
records exact.
Expected gradients are written out or come from `jax.grad` of the same math
in plain `jnp`.
"""

import re

import chex
import functions
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from functions import Mul  # saves both factors

import vjpkit

X = jnp.array([0.5, -1.0, 2.0])
W = jnp.array([1.5, 2.0, -0.5])
ZEROS = jnp.zeros(3)


# ---------------------------------------------------------------------------
# save_for_backward / saved_tensors


def test_saved_tensors_returns_what_forward_saved():
    gx, gw = jax.grad(lambda x, w: Mul.apply(x, w).sum(), argnums=(0, 1))(X, W)
    chex.assert_trees_all_close((gx, gw), (W, X))


def test_saved_tensors_keeps_none_in_place():
    seen = []

    class Scale(vjpkit.Function):
        @staticmethod
        def forward(ctx, x, w):
            ctx.save_for_backward(None, w, None)
            return x * w

        @staticmethod
        def backward(ctx, g):
            saved = ctx.saved_tensors
            seen.append((len(saved), saved[0] is None, saved[2] is None))
            return g * saved[1], None

    gx = jax.grad(lambda x: Scale.apply(x, W).sum())(X)
    chex.assert_trees_all_close(gx, W)
    assert seen == [(3, True, True)]


def test_save_for_backward_last_call_wins():
    class Square(functions.Square):  # its backward reads one saved x
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(jnp.zeros_like(x), jnp.zeros_like(x))
            ctx.save_for_backward(x)
            return x * x

    chex.assert_trees_all_close(jax.grad(lambda x: Square.apply(x).sum())(X), 2 * X)


def _square_reading_saved_variables():
    """A fresh class each time: the warning comes while JAX traces, once per class and signature."""

    backward = staticmethod(lambda ctx, g: 2 * ctx.saved_variables[0] * g)
    return functions.fresh(functions.Square, backward=backward)  # its forward saves x


def test_saved_variables_is_saved_tensors_with_a_deprecation_warning():
    # PyTorch's old name, still accepted there (with this warning) and common in ported code.
    Square = _square_reading_saved_variables()
    message = "Square.backward: 'saved_variables' is deprecated; use 'saved_tensors'"
    with pytest.warns(DeprecationWarning, match=re.escape(message)):
        got = jax.grad(lambda x: Square.apply(x).sum())(X)
    chex.assert_trees_all_close(got, 2 * X)


def test_saved_variables_warning_points_at_the_users_line():
    Square = _square_reading_saved_variables()
    with pytest.warns(DeprecationWarning, match="saved_variables") as record:
        jax.grad(lambda x: Square.apply(x).sum())(X)
    assert record[0].filename == __file__


def test_saved_tensors_is_empty_when_nothing_was_saved():
    seen = []

    class Double(functions.Double):  # its forward saves nothing
        @staticmethod
        def backward(ctx, g):
            seen.append(ctx.saved_tensors)
            return 2 * g

    chex.assert_trees_all_close(jax.grad(lambda x: Double.apply(x).sum())(X), jnp.full(3, 2.0))
    assert seen == [()]


def test_saved_numpy_array_reaches_backward_as_array():
    class AddConst(vjpkit.Function):
        @staticmethod
        def forward(ctx, x):
            c = np.array([1.0, 2.0, 3.0], dtype=np.float32)
            ctx.save_for_backward(c)
            return x * c

        @staticmethod
        def backward(ctx, g):
            (c,) = ctx.saved_tensors
            return g * c

    chex.assert_trees_all_close(
        jax.grad(lambda x: AddConst.apply(x).sum())(X), jnp.array([1.0, 2.0, 3.0])
    )


# ---------------------------------------------------------------------------
# needs_input_grad


def _needs_seen_in(seen, method):
    return [needs for m, needs in seen if m == method]


def assert_forward_saw(records, expected):
    """forward saw ``expected``; any other trace of it was the primal alone.

    When the call is staged, JAX traces the primal (no differentiation, all
    False) separately from the forward whose residuals feed backward.
    """
    assert expected in records
    assert all(r == expected or not any(r) for r in records), records


def _recording_mul(seen):
    """x * w * scale, recording needs_input_grad in forward and backward."""

    class Mul(vjpkit.Function):
        @staticmethod
        def forward(ctx, x, w, scale=2.0):
            seen.append(("forward", ctx.needs_input_grad))
            ctx.save_for_backward(x, w)
            ctx.scale = scale
            return x * w * scale

        @staticmethod
        def backward(ctx, g):
            seen.append(("backward", ctx.needs_input_grad))
            x, w = ctx.saved_tensors
            gx = g * w * ctx.scale if ctx.needs_input_grad[0] else None
            gw = g * x * ctx.scale if ctx.needs_input_grad[1] else None
            return gx, gw, None

    return Mul


def test_needs_input_grad_is_all_false_in_plain_evaluation():
    seen = []
    Mul = _recording_mul(seen)
    Mul.apply(X, W)
    assert seen == [("forward", (False, False, False))]


@pytest.mark.parametrize(
    ("differentiate", "want_gradient", "needs"),
    [
        (lambda mul: jax.grad(lambda x, w: mul(x, w).sum(), argnums=0)(X, W), 2.0 * W, (True, False, False)),
        (lambda mul: jax.grad(lambda x, w: mul(x, w).sum(), argnums=1)(X, W), 2.0 * X, (False, True, False)),
        (lambda mul: jax.grad(lambda x, w: mul(x, w).sum(), argnums=(0, 1))(X, W), (2.0 * W, 2.0 * X),
         (True, True, False)),
        (lambda mul: jax.grad(lambda x: mul(x, W, scale=3.0).sum())(X), 3.0 * W, (True, False, False)),
    ],
    ids=["only_the_differentiated_input", "follows_argnums", "every_differentiated_input",
         "false_for_a_static_input_passed_by_keyword"],
)
def test_needs_input_grad_is_true_exactly_for_the_differentiated_inputs(differentiate, want_gradient, needs):
    seen = []
    gradient = differentiate(_recording_mul(seen).apply)
    chex.assert_trees_all_close(gradient, want_gradient)
    assert_forward_saw(_needs_seen_in(seen, "forward"), needs)
    assert _needs_seen_in(seen, "backward") == [needs]


def test_needs_input_grad_is_false_for_an_integer_input():
    seen = []

    class Gather(functions.Gather):  # records what forward sees
        @staticmethod
        def forward(ctx, x, idx):
            seen.append(ctx.needs_input_grad)
            return functions.Gather.forward(ctx, x, idx)

    idx = jnp.array([2, 0, 2])
    # allow_int asks JAX to "differentiate" the integer input too.
    gx, _ = jax.grad(lambda x, i: Gather.apply(x, i).sum(), argnums=(0, 1), allow_int=True)(X, idx)
    chex.assert_trees_all_close(gx, jnp.array([1.0, 0.0, 2.0]))
    assert_forward_saw(seen, (True, False))


def test_needs_input_grad_is_readable_in_setup_context():
    seen = []

    class Mul(functions.Mul):  # its backward, with forward's saving done in setup_context
        @staticmethod
        def forward(x, w):
            return x * w

        @staticmethod
        def setup_context(ctx, inputs, output):
            seen.append(ctx.needs_input_grad)
            ctx.save_for_backward(*inputs)

    jax.grad(lambda w: Mul.apply(X, w).sum())(W)
    assert_forward_saw(seen, (False, True))


def test_needs_input_grad_counts_defaults_and_varargs():
    seen = []

    class Sum(vjpkit.Function):
        @staticmethod
        def forward(ctx, *xs, bias=ZEROS):
            seen.append(ctx.needs_input_grad)
            return sum(xs) + bias

        @staticmethod
        def backward(ctx, g):
            return tuple(g if need else None for need in ctx.needs_input_grad)

    gb = jax.grad(lambda b: Sum.apply(X, W, bias=b).sum())(jnp.ones(3))
    chex.assert_trees_all_close(gb, jnp.ones(3))
    assert_forward_saw(seen, (False, False, True))


# ---------------------------------------------------------------------------
# ctx attributes


def test_ctx_attribute_holding_an_array_reaches_backward_as_an_array():
    class Relu(vjpkit.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.mask = x > 0
            return jnp.where(ctx.mask, x, 0.0)

        @staticmethod
        def backward(ctx, g):
            return jnp.where(ctx.mask, g, 0.0)

    chex.assert_trees_all_close(
        jax.grad(lambda x: Relu.apply(x).sum())(X), jnp.array([1.0, 0.0, 1.0])
    )


def test_ctx_attribute_holding_a_python_value_is_static_in_backward():
    seen = []

    class Activation(vjpkit.Function):
        @staticmethod
        def forward(ctx, x, c):
            ctx.c = c
            ctx.label = "tanh"
            ctx.activation = jnp.tanh
            ctx.save_for_backward(x)
            return ctx.activation(x) * c

        @staticmethod
        def backward(ctx, g):
            # Static values are the Python objects themselves, never tracers.
            seen.append((type(ctx.c), ctx.label, ctx.activation is jnp.tanh))
            (x,) = ctx.saved_tensors
            scale = ctx.c if ctx.c > 0 else 0.0  # Python control flow on it
            return g * scale * (1 - ctx.activation(x) ** 2), None

    expected = jax.grad(lambda x: (jnp.tanh(x) * 3.0).sum())(X)
    chex.assert_trees_all_close(jax.grad(lambda x: Activation.apply(x, 3.0).sum())(X), expected)
    assert seen == [(float, "tanh", True)]


def test_ctx_attributes_named_with_an_underscore_reach_backward():
    class Scaled(vjpkit.Function):
        @staticmethod
        def forward(ctx, x):
            ctx._scale = 3.0
            ctx._x = x
            return 3.0 * x

        @staticmethod
        def backward(ctx, g):
            return g * ctx._scale + 0 * ctx._x

    chex.assert_trees_all_close(jax.grad(lambda x: Scaled.apply(x).sum())(X), jnp.full_like(X, 3.0))


def test_ctx_attributes_mix_static_and_array_values():
    class MulConstant(vjpkit.Function):
        @staticmethod
        def forward(ctx, x, c):
            ctx.c = c
            ctx.t = jnp.tanh(x)
            return ctx.t * c

        @staticmethod
        def backward(ctx, g):
            return g * ctx.c * (1 - ctx.t**2), None

    expected = jax.grad(lambda x: (jnp.tanh(x) * 3.0).sum())(X)
    chex.assert_trees_all_close(jax.grad(lambda x: MulConstant.apply(x, 3.0).sum())(X), expected)


def test_ctx_attribute_holding_a_pytree_of_arrays_reaches_backward():
    class Affine(vjpkit.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.parts = {"a": x * 2, "b": (x, 3)}
            return x * x * 2

        @staticmethod
        def backward(ctx, g):
            x, three = ctx.parts["b"]
            assert three == 3
            return g * ctx.parts["a"] * 2

    chex.assert_trees_all_close(jax.grad(lambda x: Affine.apply(x).sum())(X), 4 * X)


class _Holder:
    def __init__(self, value):
        self.value = value


def _keeps(make_attribute):
    class Keep(vjpkit.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.kept = make_attribute(x * 2)
            return x * x

        @staticmethod
        def backward(ctx, g):
            return g * X

    return Keep


_HOLDS_AN_ARRAY = (
    "Keep.forward: ctx.kept is a {owner} holding an array of shape (3,) and dtype float32 (at ctx.kept{inside}). "
    "A ctx attribute that is not an array or a pytree of arrays travels to backward as static data, fixed "
    "when JAX traces, so the arrays inside it do not. Store the array itself on ctx (ctx.kept_array = ...) "
    "or save it with ctx.save_for_backward, and rebuild the {owner} in backward."
)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "under-jit"])
def test_ctx_attribute_object_holding_an_array_raises_eagerly_and_under_jit(jit):
    Keep = _keeps(_Holder)
    grad = jax.grad(lambda x: Keep.apply(x).sum())
    message = _HOLDS_AN_ARRAY.format(owner="_Holder", inside=".value")
    with pytest.raises(TypeError, match=re.escape(message)):
        (jax.jit(grad) if jit else grad)(X)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "under-jit"])
def test_ctx_attribute_closure_over_an_array_raises_eagerly_and_under_jit(jit):
    Keep = _keeps(lambda y: (lambda: y))
    grad = jax.grad(lambda x: Keep.apply(x).sum())
    message = _HOLDS_AN_ARRAY.format(owner="function", inside=" (its closed-over 'y')")
    with pytest.raises(TypeError, match=re.escape(message)):
        (jax.jit(grad) if jit else grad)(X)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "under-jit"])
def test_ctx_attribute_object_holding_an_array_is_fine_where_nothing_is_differentiated(jit):
    # Only backward would read it; forward alone (PyTorch under no_grad) keeps nothing for it.
    Keep = _keeps(_Holder)
    chex.assert_trees_all_close((jax.jit(Keep.apply) if jit else Keep.apply)(X), X * X)


def test_ctx_attribute_object_holding_python_values_reaches_backward():
    Keep = _keeps(lambda y: _Holder(3.0))
    chex.assert_trees_all_close(jax.grad(lambda x: Keep.apply(x).sum())(X), X)


# ---------------------------------------------------------------------------
# Output gradients: materialization and non-differentiable outputs


def _sin_cos(seen, materialize=True, mark=False):
    class SinCos(vjpkit.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.set_materialize_grads(materialize)
            ctx.save_for_backward(x)
            s, c = jnp.sin(x), jnp.cos(x)
            if mark:
                ctx.mark_non_differentiable(c)
            return s, c

        @staticmethod
        def backward(ctx, gs, gc):
            seen.append((gs is None, gc is None))
            (x,) = ctx.saved_tensors
            total = jnp.zeros_like(x)
            if gs is not None:
                total += gs * jnp.cos(x)
            if gc is not None:
                total -= gc * jnp.sin(x)
            return total

    return SinCos


def test_unused_output_gets_zero_gradient():
    seen = []
    SinCos = _sin_cos(seen)
    g = jax.grad(lambda x: SinCos.apply(x)[0].sum())(X)
    chex.assert_trees_all_close(g, jnp.cos(X))
    assert seen == [(False, False)]  # an array of zeros, not None


def test_unused_output_gets_none_with_materialization_off():
    seen = []
    SinCos = _sin_cos(seen, materialize=False)
    g = jax.grad(lambda x: SinCos.apply(x)[0].sum())(X)
    chex.assert_trees_all_close(g, jnp.cos(X))
    assert seen == [(False, True)]


def test_used_outputs_both_get_their_gradients():
    seen = []
    SinCos = _sin_cos(seen, materialize=False)

    def loss(x):
        s, c = SinCos.apply(x)
        return (s * c).sum()

    expected = jax.grad(lambda x: (jnp.sin(x) * jnp.cos(x)).sum())(X)
    chex.assert_trees_all_close(jax.grad(loss)(X), expected, rtol=1e-6)
    assert seen == [(False, False)]


def test_non_differentiable_output_carries_no_gradient():
    seen = []
    SinCos = _sin_cos(seen, mark=True)

    def loss(x):
        s, c = SinCos.apply(x)
        return (s + c).sum()  # c is used, but marked non-differentiable

    chex.assert_trees_all_close(jax.grad(loss)(X), jnp.cos(X))
    assert seen == [(False, False)]  # its slot holds zeros


def test_non_differentiable_output_slot_is_none_with_materialization_off():
    seen = []
    SinCos = _sin_cos(seen, materialize=False, mark=True)

    def loss(x):
        s, c = SinCos.apply(x)
        return (s + c).sum()

    chex.assert_trees_all_close(jax.grad(loss)(X), jnp.cos(X))
    assert seen == [(False, True)]


def test_non_differentiable_output_keeps_its_value():
    SinCos = _sin_cos([], mark=True)
    s, c = SinCos.apply(X)
    chex.assert_trees_all_close((s, c), (jnp.sin(X), jnp.cos(X)))


def _nearest_code(mark: bool):
    class NearestCode(vjpkit.Function):
        @staticmethod
        def forward(ctx, x, codebook):
            distances = jnp.abs(x[:, None] - codebook[None, :])
            codes = jnp.argmin(distances, axis=1)
            if mark:  # a float output declared non-differentiable
                codes = codes.astype(x.dtype)
                ctx.mark_non_differentiable(codes)
            return codes

        @staticmethod
        def backward(ctx, g):
            raise RuntimeError("backward must not be called: no output carries a gradient")

    return NearestCode


@pytest.mark.parametrize("mark", [False, True], ids=["integer-output", "marked-output"])
def test_backward_is_not_called_when_no_output_carries_a_gradient(mark):
    NearestCode = _nearest_code(mark)
    codebook = jnp.array([0.0, 1.0, -1.0])
    codes, vjp = jax.vjp(NearestCode.apply, X, codebook)
    chex.assert_trees_all_close(codes.astype(jnp.int32), jnp.array([0, 2, 1]))
    gx, gc = vjp(jnp.ones_like(codes))
    chex.assert_trees_all_close((gx, gc), (jnp.zeros(3), jnp.zeros(3)))


def test_grad_through_an_unused_non_differentiable_function_is_zero():
    NearestCode = _nearest_code(mark=True)
    codebook = jnp.array([0.0, 1.0, -1.0])
    got = jax.jit(jax.grad(lambda x: (NearestCode.apply(x, codebook) * x).sum()))(X)
    chex.assert_trees_all_close(got, jnp.array([0.0, 2.0, 1.0]))  # only through the product's x


# ---------------------------------------------------------------------------
# mark_dirty


def test_mark_dirty_returns_the_new_value_of_the_input():
    class ZeroFirst(vjpkit.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.mark_dirty(x)
            return x.at[0].set(0.0) * 2

        @staticmethod
        def backward(ctx, g):
            return (g * 2).at[0].set(0.0)

    x = jnp.array([1.0, 2.0, 3.0])
    chex.assert_trees_all_close(ZeroFirst.apply(x), jnp.array([0.0, 4.0, 6.0]))
    expected = jax.grad(lambda x: (x.at[0].set(0.0) * 2).sum())(x)
    chex.assert_trees_all_close(jax.grad(lambda x: ZeroFirst.apply(x).sum())(x), expected)


# ---------------------------------------------------------------------------
# setup_context style


def test_setup_context_style_receives_inputs_and_output():
    seen = []

    class Exp(vjpkit.Function):
        @staticmethod
        def forward(x, scale=1.0):
            return jnp.exp(x) * scale

        @staticmethod
        def setup_context(ctx, inputs, output):
            x, scale = inputs
            seen.append((len(inputs), scale))
            ctx.scale = scale
            ctx.save_for_backward(output)

        @staticmethod
        def backward(ctx, g):
            (y,) = ctx.saved_tensors
            return g * y, None

    expected = jax.grad(lambda x: (jnp.exp(x) * 2.0).sum())(X)
    chex.assert_trees_all_close(jax.grad(lambda x: Exp.apply(x, scale=2.0).sum())(X), expected)
    chex.assert_trees_all_close(Exp.apply(X), jnp.exp(X))
    assert seen[0] == (2, 2.0)


def test_setup_context_style_with_decorator_and_tuple_output():
    @vjpkit.function
    class SinCos:
        @staticmethod
        def forward(x):
            return jnp.sin(x), jnp.cos(x)

        @staticmethod
        def setup_context(ctx, inputs, output):
            ctx.save_for_backward(*output)

        @staticmethod
        def backward(ctx, gs, gc):
            s, c = ctx.saved_tensors
            return gs * c - gc * s

    def loss(f, x):
        s, c = f(x)
        return (s * 2 + c**2).sum()

    expected = jax.grad(lambda x: loss(lambda x: (jnp.sin(x), jnp.cos(x)), x))(X)
    chex.assert_trees_all_close(jax.grad(lambda x: loss(SinCos, x))(X), expected)


# ---------------------------------------------------------------------------
# once_differentiable


def _once_differentiable_square():
    return functions.once(functions.Square, "Square")  # a new class each call


def test_once_differentiable_backward_works_at_first_order():
    Square = _once_differentiable_square()
    chex.assert_trees_all_close(jax.grad(lambda x: Square.apply(x).sum())(X), 2 * X)
    chex.assert_trees_all_close(jax.jit(jax.grad(lambda x: Square.apply(x).sum()))(X), 2 * X)


def test_once_differentiable_backward_raises_at_second_order():
    Square = _once_differentiable_square()
    with pytest.raises(RuntimeError, match=r"Square\.backward.*once_differentiable") as info:
        jax.hessian(lambda x: Square.apply(x).sum())(X)
    assert type(info.value) is RuntimeError


def test_once_differentiable_backward_raises_under_grad_of_grad():
    Square = _once_differentiable_square()

    def first(x):
        return jax.grad(lambda x: Square.apply(x).sum())(x).sum()

    with pytest.raises(RuntimeError, match=r"Square\.backward.*once_differentiable") as info:
        jax.grad(first)(X)
    assert type(info.value) is RuntimeError


def test_needs_input_grad_is_real_under_an_outer_jit():
    seen = []
    Mul = _recording_mul(seen)
    gw = jax.jit(jax.grad(lambda x, w: Mul.apply(x, w).sum(), argnums=1))(X, W)
    chex.assert_trees_all_close(gw, 2.0 * X)
    assert_forward_saw(_needs_seen_in(seen, "forward"), (False, True, False))
    assert _needs_seen_in(seen, "backward") == [(False, True, False)]
