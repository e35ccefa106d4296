"""The NumPy evaluator of jaxprs (gradcheck's first runs): each primitive it evaluates agrees with JAX.

Every primitive in the evaluator's table has cases here (a test fails for
one without): each case is traced to a jaxpr, evaluated with NumPy, and
compared with ``jax.jit`` of the same function. Integers and bools must be
equal; floats equal to a few units in the last place (XLA's own ``exp``,
``log``, ... differ from libm's in the last bits). Edge cases are those
where lax's semantics differ from NumPy's.
"""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.extend.core import primitives as P

import vjpkit
from vjpkit._gradcheck import _compile_lowered
from vjpkit._jax_internals import enable_x64
from vjpkit._numpy_eval import _SUBJAXPR_RULES, TABLE, numpy_evaluator

NAN, INF = np.nan, np.inf
F = np.array([-2.5, -1.5, -0.5, -0.0, 0.0, 0.49999999999999994, 0.5, 1.5, 2.5, 3.7, NAN, INF, -INF])
POS = np.array([0.1, 0.5, 1.0, 2.0, 7.3, 1e-3])
UNIT = np.array([-0.9, -0.5, 0.0, 0.3, 0.99])
I32 = np.array([-7, -6, -1, 0, 1, 5, 7, np.iinfo(np.int32).min, np.iinfo(np.int32).max], np.int32)
I32_DIVISOR = np.array([2, -4, 0, 3, -1, 0, -2, -1, 7], np.int32)
U8 = np.array([0, 1, 7, 200, 255, 3, 128, 9, 64], np.uint8)
B = np.array([True, False, True, False])
B2 = np.array([True, True, False, False])
C = np.array([1 + 2j, -0.5 + 0j, 0j, 3 - 4j, complex(INF, 1.0)])
C2 = np.array([2 - 1j, 1 + 1j, 1j, -2 + 0.5j, 1 + 0j])
M = np.arange(24.0).reshape(2, 3, 4) / 7 - 1.5
EMPTY = np.zeros((0, 3))


def c(f, *args):
    """A case: ``f`` applied to ``args`` (NumPy arrays)."""
    return f, args


def unary(f, *inputs):
    return [c(f, x) for x in inputs]


def binary(f, *pairs):
    return [c(f, x, y) for x, y in pairs]


FLOATS = (F, F.astype(np.float32), EMPTY)
FLOAT_PAIRS = ((F, F[::-1]), (F.astype(np.float32), np.float32(1.5) * F[::-1].astype(np.float32)))
INT_PAIRS = (
    (I32, I32_DIVISOR),
    (I32, I32_DIVISOR[::-1]),  # INT_MIN and INT_MAX by other divisors
    (U8, U8[::-1]),
    (I32.astype(np.int64), I32_DIVISOR.astype(np.int64)),
)

CASES = {
    "neg": unary(lax.neg, F, I32, C),
    "sign": unary(lax.sign, F, I32, U8, C),
    "floor": unary(lax.floor, *FLOATS),
    "ceil": unary(lax.ceil, *FLOATS),
    "round": [
        c(lambda x: lax.round(x, lax.RoundingMethod.AWAY_FROM_ZERO), F),
        c(lambda x: lax.round(x, lax.RoundingMethod.TO_NEAREST_EVEN), F),
        c(lambda x: lax.round(x, lax.RoundingMethod.AWAY_FROM_ZERO), F.astype(np.float32)),
    ],
    "is_finite": unary(lax.is_finite, *FLOATS),
    "exp": unary(lax.exp, F, C, F.astype(np.float32)),
    "exp2": unary(lax.exp2, F),
    "log": unary(lax.log, POS, F, C2),
    "log1p": unary(lax.log1p, POS, UNIT),
    "expm1": unary(lax.expm1, F, UNIT),
    "tanh": unary(lax.tanh, F, C2),
    "logistic": unary(lax.logistic, F, M, np.array([-800.0, 800.0])),
    "sin": unary(lax.sin, F, C2),
    "cos": unary(lax.cos, F, C2),
    "tan": unary(lax.tan, UNIT),
    "asin": unary(lax.asin, UNIT),
    "acos": unary(lax.acos, UNIT),
    "atan": unary(lax.atan, F),
    "sinh": unary(lax.sinh, UNIT),
    "cosh": unary(lax.cosh, UNIT),
    "asinh": unary(lax.asinh, F),
    "acosh": unary(lax.acosh, POS + 1.0),
    "atanh": unary(lax.atanh, UNIT),
    "sqrt": unary(lax.sqrt, POS, F, C2),
    "rsqrt": unary(lax.rsqrt, POS, F),
    "cbrt": unary(lax.cbrt, F, -POS),
    "abs": unary(lax.abs, F, I32, C),
    "square": unary(lax.square, F, I32, C),
    "integer_pow": [
        c(lambda x: lax.integer_pow(x, 3), F),
        c(lambda x: lax.integer_pow(x, -2), POS),
        c(lambda x: lax.integer_pow(x, 0), F),
        c(lambda x: lax.integer_pow(x, 5), I32),
        c(lambda x: lax.integer_pow(x, 2), C),
    ],
    "real": unary(lax.real, C),
    "imag": unary(lax.imag, C),
    "conj": unary(lax.conj, C, C.astype(np.complex64)),
    "complex": binary(lax.complex, (F, F[::-1]), (F.astype(np.float32), F.astype(np.float32))),
    "add": binary(lax.add, *FLOAT_PAIRS, *INT_PAIRS, (C, C2)),
    "add_any": binary(P.add_jaxvals_p.bind, (F, F[::-1]), (I32, I32_DIVISOR)),
    "sub": binary(lax.sub, *FLOAT_PAIRS, *INT_PAIRS, (C, C2)),
    "mul": binary(lax.mul, *FLOAT_PAIRS, *INT_PAIRS, (C, C2)),
    "div": binary(lax.div, *FLOAT_PAIRS, *INT_PAIRS, (C, C2)),
    "rem": binary(lax.rem, *FLOAT_PAIRS, *INT_PAIRS),
    "pow": binary(lax.pow, (POS, POS[::-1]), (F, np.full_like(F, 2.0)), (F, np.full_like(F, 0.5)), (F, F[::-1])),
    "max": binary(lax.max, *FLOAT_PAIRS, *INT_PAIRS, (B, B2)),
    "min": binary(lax.min, *FLOAT_PAIRS, *INT_PAIRS, (B, B2)),
    "atan2": binary(lax.atan2, *FLOAT_PAIRS),
    "nextafter": binary(lax.nextafter, *FLOAT_PAIRS),
    "clamp": [
        c(lax.clamp, np.float64(-1.0), F, np.float64(1.0)),
        c(lax.clamp, -F, F, np.full_like(F, 2.0)),
        c(lax.clamp, np.int32(-3), I32, np.int32(4)),
    ],
    "not": unary(lax.bitwise_not, B, I32, U8),
    "and": binary(lax.bitwise_and, (B, B2), *INT_PAIRS),
    "or": binary(lax.bitwise_or, (B, B2), *INT_PAIRS),
    "xor": binary(lax.bitwise_xor, (B, B2), *INT_PAIRS),
    "shift_left": binary(
        lax.shift_left, (I32, I32_DIVISOR * 9), (U8, np.array([0, 1, 7, 8, 9, 3, 1, 255, 2], np.uint8))
    ),
    "shift_right_logical": binary(
        lax.shift_right_logical, (I32, I32_DIVISOR * 9), (U8, np.array([0, 1, 7, 8, 9, 3, 1, 255, 2], np.uint8))
    ),
    "shift_right_arithmetic": binary(
        lax.shift_right_arithmetic, (I32, I32_DIVISOR * 9), (U8, np.array([0, 1, 7, 8, 9, 3, 1, 255, 2], np.uint8))
    ),
    "eq": binary(lax.eq, *FLOAT_PAIRS, *INT_PAIRS, (C, C2), (B, B2)),
    "ne": binary(lax.ne, *FLOAT_PAIRS, *INT_PAIRS, (C, C2), (B, B2)),
    "lt": binary(lax.lt, *FLOAT_PAIRS, *INT_PAIRS, (B, B2)),
    "le": binary(lax.le, *FLOAT_PAIRS, *INT_PAIRS),
    "gt": binary(lax.gt, *FLOAT_PAIRS, *INT_PAIRS),
    "ge": binary(lax.ge, *FLOAT_PAIRS, *INT_PAIRS),
    "select_n": [
        c(lax.select_n, F > 0, F, -F),
        c(lax.select_n, np.array([0, 2, 1, 2], np.int32), *(B, B2, ~B)),
        c(lax.select_n, np.True_, I32, I32_DIVISOR),
    ],
    "convert_element_type": [
        c(lambda x: lax.convert_element_type(x, np.int32), np.array([2.7, -2.7, NAN, INF, -INF, 3e9, -3e9, 0.5])),
        c(lambda x: lax.convert_element_type(x, np.uint8), np.array([2.7, -2.7, NAN, 300.0, 255.9])),
        c(lambda x: lax.convert_element_type(x, np.int64), np.array([1e19, -1e19, 9.2e18, -0.9])),
        c(lambda x: lax.convert_element_type(x, np.int32), np.array([3e9, 2.1e9, -5.5], np.float32)),
        c(lambda x: lax.convert_element_type(x, np.float32), F * 1.1),
        c(lambda x: lax.convert_element_type(x, np.float64), C),  # drops the imaginary part (JAX warns)
        c(lambda x: lax.convert_element_type(x, np.bool_), F),
        c(lambda x: lax.convert_element_type(x, np.bool_), I32),
        c(lambda x: lax.convert_element_type(x, np.int8), I32),
        c(lambda x: lax.convert_element_type(x, np.float64), B),
        c(lambda x: lax.convert_element_type(x, np.complex128), F),
    ],
    "copy": unary(P.copy_p.bind, F, I32),
    "broadcast_in_dim": [
        c(lambda x: lax.broadcast_in_dim(x, (3, 2, 4), (0, 2)), M[0, :, :]),
        c(lambda x: lax.broadcast_in_dim(x, (2, 0, 3), (1, 2)), EMPTY),
        c(lambda x: lax.broadcast_in_dim(x, (2, 3), ()), np.float64(1.5)),
    ],
    "reshape": [
        c(lambda x: lax.reshape(x, (4, 6)), M),
        c(lambda x: lax.reshape(x, (6, 4), (2, 0, 1)), M),
        c(lambda x: lax.reshape(x, (3, 0)), EMPTY),
    ],
    "squeeze": [c(lambda x: lax.squeeze(x, (0, 2)), M[:1, :, :1])],
    "transpose": [c(lambda x: lax.transpose(x, (2, 0, 1)), M)],
    "rev": [c(lambda x: lax.rev(x, (0, 2)), M), c(lambda x: lax.rev(x, ()), M)],
    "iota": [c(lambda: lax.broadcasted_iota(np.int32, (3, 4), 1)), c(lambda: lax.iota(np.float64, 5))],
    "slice": [c(lambda x: lax.slice(x, (0, 1, 0), (2, 3, 4), (1, 1, 3)), M), c(lambda x: lax.slice(x, (1,), (1,)), F)],
    "dynamic_slice": [
        c(lambda x, i, j: lax.dynamic_slice(x, (i, j, np.int32(1)), (1, 2, 2)), M, np.int32(5), np.int32(-3)),
        c(lambda x, i: lax.dynamic_slice(x, (i,), (3,)), F, np.int32(2)),
    ],
    "dynamic_update_slice": [
        c(lambda x, u, i: lax.dynamic_update_slice(x, u, (i, i, i)), M, -M[:1, :2, :2], np.int32(7)),
        c(lambda x, u, i: lax.dynamic_update_slice(x, u, (i,)), F, POS[:2], np.int32(-1)),
    ],
    "concatenate": [
        c(lambda x, y: lax.concatenate([x, y, x], 1), M, M[:, :1]),
        c(lambda x: lax.concatenate([x, x], 0), EMPTY),
    ],
    "pad": [
        c(lambda x: lax.pad(x, np.float64(-9.0), ((1, 2, 0), (-1, 1, 2), (0, -2, 1))), M),
        c(lambda x: lax.pad(x, np.int32(7), ((2, -1, 3),)), I32),
        c(lambda x: lax.pad(x, 0.0, ((1, 1, 1), (0, 0, 0))), EMPTY),
    ],
    "reduce_sum": [
        c(lambda x: jnp.sum(x, (0, 2)), M),
        c(lambda x: jnp.sum(x, 0), EMPTY),
        c(lambda x: jnp.sum(x, dtype=np.int8), I32.astype(np.int8)),
        c(lambda x: jnp.sum(x, 0), C),
    ],
    "reduce_prod": [
        c(lambda x: jnp.prod(x, (1,)), M),
        c(lambda x: jnp.prod(x, 0), EMPTY),
        c(lambda x: jnp.prod(x), U8),
    ],
    "reduce_max": [
        c(lambda x: jnp.max(x, (0, 1)), M),
        c(jnp.max, F),
        c(lambda x: lax.reduce_max_p.bind(x, axes=(0,)), EMPTY),
        c(jnp.max, I32),
        c(jnp.max, B),
    ],
    "reduce_min": [
        c(lambda x: jnp.min(x, 2), M),
        c(jnp.min, F),
        c(lambda x: lax.reduce_min_p.bind(x, axes=(0,)), EMPTY),
        c(jnp.min, U8),
    ],
    "reduce_and": [
        c(lambda x: jnp.all(x), B),
        c(lambda x: lax.reduce_and_p.bind(x, axes=(0,)), I32),
        c(lambda x: jnp.all(x, 0), EMPTY > 0),
    ],
    "reduce_or": [
        c(lambda x: jnp.any(x), B),
        c(lambda x: lax.reduce_or_p.bind(x, axes=(0,)), U8),
        c(lambda x: jnp.any(x, 0), EMPTY > 0),
    ],
    "reduce_xor": [
        c(lambda x: lax.reduce_xor_p.bind(x, axes=(0,)), B),
        c(lambda x: lax.reduce_xor_p.bind(x, axes=(0,)), I32),
    ],
    "argmax": [
        c(lambda x: jnp.argmax(x, 1), M),
        c(jnp.argmax, F),
        c(jnp.argmax, I32),
        c(lambda x: lax.argmax(x, 0, np.int32), np.array([1.0, NAN, 3.0, NAN])),
    ],
    "argmin": [c(lambda x: jnp.argmin(x, 2), M), c(jnp.argmin, F), c(jnp.argmin, U8)],
    "cumsum": [c(lambda x: lax.cumsum(x, 1), M), c(lambda x: lax.cumsum(x, 0, reverse=True), I32), c(lax.cumsum, C)],
    "cumprod": [c(lambda x: lax.cumprod(x, 2, reverse=True), M), c(lax.cumprod, I32)],
    "cummax": [c(lambda x: lax.cummax(x, 0), F), c(lambda x: lax.cummax(x, 1, reverse=True), M), c(lax.cummax, I32)],
    "cummin": [c(lambda x: lax.cummin(x, 0, reverse=True), F), c(lax.cummin, U8)],
    "cumlogsumexp": [c(lambda x: lax.cumlogsumexp(x, 2), M), c(lambda x: lax.cumlogsumexp(x, 0, reverse=True), POS)],
    "sort": [
        c(lambda x: lax.sort(x), F),
        c(lambda x: lax.sort(x, dimension=1), M[:, ::-1]),
        c(lambda k, v: lax.sort((k, v), num_keys=1), np.array([2, 1, 2, 1, 0], np.int32), POS[:5]),
        c(
            lambda k1, k2, v: lax.sort((k1, k2, v), num_keys=2),
            np.array([1.0, 0.0, 1.0, -0.0, 0.0]),
            np.array([3, 1, 2, 9, 1], np.int32),
            UNIT,
        ),
        c(jnp.argsort, np.array([0.0, -0.0, 1.0, -0.0, 0.0, NAN, -1.0])),
    ],
    "dot_general": [
        c(jnp.matmul, M, M.transpose(0, 2, 1)),
        c(jnp.dot, M[0], M[1].T),
        c(lambda a, b: lax.dot_general(a, b, (((1, 2), (0, 2)), ((), ()))), M, M.transpose(1, 0, 2)),
        c(lambda a, b: lax.dot_general(a, b, (((0,), (0,)), ((2,), (2,)))), M, M),
        c(jnp.matmul, I32[:6].reshape(2, 3), I32[:6].reshape(3, 2)),
        c(jnp.matmul, EMPTY.T, EMPTY),
        c(jnp.matmul, C[:4].reshape(2, 2), C2[:4].reshape(2, 2)),
    ],
}


def _names_in(jaxpr):
    """The primitives of a jaxpr and of its sub-jaxprs."""
    names = set()
    for e in jaxpr.eqns:
        names.add(e.primitive.name)
        for value in e.params.values():
            for sub in value if isinstance(value, tuple) else (value,):
                sub = getattr(sub, "jaxpr", sub)
                if hasattr(sub, "eqns"):
                    names |= _names_in(sub)
    return names


def _assert_agrees(got, want):
    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, got.shape, want.dtype, want.shape)
    if got.dtype.kind in "fc":
        rtol = 1e-12 if got.dtype in (np.float64, np.complex128) else 1e-5
        np.testing.assert_allclose(got, want, rtol=rtol, atol=0, equal_nan=True)
        # Infinities and NaNs in the same places (-0.0 and 0.0 may differ: XLA's output is not defined there).
        np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    else:
        np.testing.assert_array_equal(got, want)


def test_every_primitive_in_the_table_has_cases():
    assert {p.name for p in TABLE} <= set(CASES)


# The primitives with sub-jaxprs that the tests at the end of this module evaluate.
SUBJAXPR_TESTED = {"jit", "pjit", "cond", "while", "scan", "remat2", "custom_jvp_call", "custom_vjp_call",
                   "custom_vjp_call_jaxpr", "closed_call", "call", "vjpkit_tie", "vjpkit_linear_call"}


def test_every_primitive_evaluated_through_its_sub_jaxprs_is_tested():
    assert {p.name for p in _SUBJAXPR_RULES} <= SUBJAXPR_TESTED


@pytest.fixture(scope="module")
def jax_results():
    """Every case's outputs from JAX, in one program compiled as gradcheck compiles its own (one compile
    keeps this module fast)."""
    cases = [(name, i) for name in sorted(CASES) for i in range(len(CASES[name]))]

    def all_cases(args):
        return [CASES[name][i][0](*a) for (name, i), a in zip(cases, args, strict=True)]

    with enable_x64(True), warnings.catch_warnings():
        warnings.simplefilter("ignore", np.exceptions.ComplexWarning)
        args = [CASES[name][i][1] for name, i in cases]
        out = _compile_lowered(jax.jit(all_cases).lower(args))(args)
    return {case: jax.tree_util.tree_leaves(o) for case, o in zip(cases, out, strict=True)}


@pytest.mark.parametrize("name", sorted(CASES))
def test_numpy_evaluation_agrees_with_jax(name, jax_results):
    if name not in {p.name for p in TABLE}:
        pytest.skip(f"this JAX lacks the primitive {name}")
    with enable_x64(True), warnings.catch_warnings():
        warnings.simplefilter("ignore", np.exceptions.ComplexWarning)
        for i, (f, args) in enumerate(CASES[name]):
            closed = jax.make_jaxpr(f)(*args)
            assert name in _names_in(closed.jaxpr), closed
            run = numpy_evaluator(closed)
            got = run(list(args))
            assert name not in run.fallbacks
            want = jax_results[name, i]
            assert len(got) == len(want)
            for g, w in zip(got, want, strict=True):
                _assert_agrees(g, w)


def evaluated(f, *args):
    """``f(*args)`` by the evaluator, its reference by ``jax.jit``, and the primitives that fell back."""
    with enable_x64(True):
        run = numpy_evaluator(jax.make_jaxpr(f)(*args))
        got = run(list(args))
        want = jax.tree_util.tree_leaves(jax.jit(f)(*args))
    for g, w in zip(got, want, strict=True):
        _assert_agrees(g, w)
    return got, run.fallbacks


def test_a_primitive_outside_the_table_falls_back_to_jax():
    _, fallbacks = evaluated(lambda x, i: x[i] * 2.0, M, np.array([1, 0, 1]))
    assert "gather" in fallbacks


def test_a_host_callback_falls_back_and_runs():
    calls = []

    def host(x):
        calls.append(x)
        return np.sin(x)

    def f(x):
        return jax.pure_callback(host, jax.ShapeDtypeStruct(x.shape, x.dtype), x) + 1.0

    (got,), fallbacks = evaluated(f, F[:4])
    assert "pure_callback" in fallbacks and len(calls) == 2  # evaluated once, compiled once
    np.testing.assert_allclose(got, np.sin(F[:4]) + 1.0)


def test_jit_cond_while_and_scan_are_evaluated_through_their_bodies():
    def f(x, i):
        y = jax.jit(jnp.sin)(x)
        y = lax.switch(i, [jnp.sin, jnp.cos, jnp.tan], y) + lax.cond(i > 5, jnp.sin, jnp.cos, y)
        n, y = lax.while_loop(lambda c: c[0] < 4, lambda c: (c[0] + 1, c[1] * 1.5), (0, y))
        carry, ys = lax.scan(lambda c, a: (c + a, c * a), y[0], y)
        back, ys2 = lax.scan(lambda c, a: (c * 0.5 + a, c), 1.0, y, reverse=True)
        empty, ys3 = lax.scan(lambda c, a: (c, a), 0.0, y[:0])
        return y, n, carry, ys, back, ys2, ys3

    for i in (-1, 1, 7):  # the branch index is clamped
        _, fallbacks = evaluated(f, POS, np.int32(i))
        assert not fallbacks


def test_a_vmapped_while_loop_stops_each_member_at_its_own_step():
    def newton_sqrt(x):
        def step(c):
            return c[0] + 1, 0.5 * (c[1] + x / c[1])

        return lax.while_loop(lambda c: jnp.abs(c[1] * c[1] - x) > 1e-12, step, (0, jnp.maximum(x, 1.0)))

    (steps, roots), fallbacks = evaluated(jax.vmap(newton_sqrt), np.array([1.0, 2.0, 100.0, 1e6]))
    assert not fallbacks
    assert len(set(steps.tolist())) > 1  # members stopped at different steps
    np.testing.assert_allclose(roots, np.sqrt([1.0, 2.0, 100.0, 1e6]), rtol=1e-12)


def test_custom_derivatives_and_remat_are_evaluated_through_their_primal_functions():
    @jax.custom_jvp
    def cj(x):
        return jnp.sin(x)

    cj.defjvp(lambda p, t: (cj(p[0]), jnp.cos(p[0]) * t[0]))

    @jax.custom_vjp
    def cv(x):
        return jnp.exp(x)

    cv.defvjp(lambda x: (jnp.exp(x), x), lambda r, g: (g * jnp.exp(r),))

    _, fallbacks = evaluated(lambda x: jax.checkpoint(lambda v: cj(v) * cv(v))(x), POS)
    assert not fallbacks


def test_constants_and_literal_outputs_are_evaluated():
    table = jnp.asarray(POS)
    _, fallbacks = evaluated(lambda x: (x + table, 2.0, x), POS)
    assert not fallbacks


@pytest.mark.parametrize("call", ["closed_call", "call"])
def test_call_primitives_are_evaluated_through_their_jaxprs(call):
    # No public API emits these any more: a jit equation is turned into one.
    with enable_x64(True):
        closed = jax.make_jaxpr(lambda x: jax.jit(lambda v: jnp.sin(v) * v)(x) + 1.0)(POS)
        (eqn,) = [e for e in closed.jaxpr.eqns if e.primitive.name in ("jit", "pjit")]
        inner = eqn.params["jaxpr"]
        primitive = P.closed_call_p if call == "closed_call" else P.call_p
        params = {"call_jaxpr": inner if call == "closed_call" else inner.jaxpr}
        eqns = [e.replace(primitive=primitive, params=params) if e is eqn else e for e in closed.jaxpr.eqns]
        changed = jax.extend.core.ClosedJaxpr(closed.jaxpr.replace(eqns=eqns), closed.consts)
        run = numpy_evaluator(changed)
        (got,) = run([POS])
    assert not run.fallbacks
    np.testing.assert_allclose(got, np.sin(POS) * POS + 1.0, rtol=1e-15)


class Cube(vjpkit.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x**3

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return 3 * x**2 * g


def test_a_functions_tie_is_evaluated_as_the_outputs_it_passes_on():
    f = jax.value_and_grad(lambda x: Cube.apply(x).sum())
    assert "vjpkit_tie" in _names_in(jax.make_jaxpr(f)(POS).jaxpr)  # ties Cube's outputs to its own rules
    (value, grad), fallbacks = evaluated(f, POS)
    assert not fallbacks
    np.testing.assert_allclose(value, np.sum(POS**3), rtol=1e-14)
    np.testing.assert_allclose(grad, 3 * POS**2, rtol=1e-14)
