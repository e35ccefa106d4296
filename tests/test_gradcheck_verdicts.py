"""gradcheck's verdict is the verdict of the compiled program.

The reference verdict here is computed independently of gradcheck, from the
program a user runs: ``jax.jit(jax.jacrev(fn))`` against central differences
of ``jax.jit(fn)``, both compiled by XLA, compared with gradcheck's rule
``|analytical - numerical| <= atol + rtol * |numerical|`` (NaN fails). Where
the two could part, they are made to meet: subnormal numbers (which XLA on
the CPU flushes to zero), overflow, and arithmetic in float32, float16 and
bfloat16 inside a backward.
"""

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
from functions import SquareWithJvp
from hypothesis import given, settings
from hypothesis import strategies as st

import vjpkit
from vjpkit._checking import checkers

# jax.enable_x64 or its older home. Not the x64 fixture:
# A scope inside one check: the compiled verdict in float64 beside gradcheck run with x64 off.
from vjpkit._jax_internals import enable_x64

EPS, ATOL, RTOL = 1e-6, 1e-5, 1e-3
ON_CPU = jax.default_backend() == "cpu"


def compiled_verdict(fn, x, compile=jax.jit):
    """Whether fn's compiled derivative agrees with central differences of compiled fn, elementwise.

    ``compile=eagerly``: the same, with both run op by op, as JAX runs them outside ``jit``.
    """
    with enable_x64(True), np.errstate(invalid="ignore", over="ignore"):  # inf - inf is NaN: it fails
        x = jnp.asarray(x, jnp.float64)
        analytical = np.asarray(compile(jax.jacrev(fn))(x)).reshape(-1, x.size)
        f = compile(fn)
        scale = 1.0 / (2.0 * EPS)
        columns = []
        for i in range(x.size):
            e = np.zeros(x.size)
            e[i] = 1.0
            e = jnp.asarray(e.reshape(x.shape))
            columns.append(((np.asarray(f(x + EPS * e)) - np.asarray(f(x + -EPS * e))) * scale).reshape(-1))
        numerical = np.stack(columns, axis=1)
    return bool(np.all(np.abs(analytical - numerical) <= ATOL + RTOL * np.abs(numerical)))


def eagerly(fn):
    return fn


def gradcheck_verdict(fn, x):
    return vjpkit.gradcheck(fn, (np.asarray(x, np.float64),), eps=EPS, atol=ATOL, rtol=RTOL, raise_exception=False)


def with_backward(forward, backward):
    """``forward`` with the hand-written backward ``backward(x, g)``."""
    f = jax.custom_vjp(forward)
    f.defvjp(lambda x: (forward(x), x), lambda x, g: (backward(x, g),))
    return f


# ---------------------------------------------------------------------------
# Inputs where evaluating a program outside XLA gives other numbers than XLA.


def stable_logsumexp(x):
    m = jax.lax.stop_gradient(jnp.max(x))
    return m + jnp.log(jnp.sum(jnp.exp(x - m)))


# The backward computes softmax without subtracting the maximum: exp(-720) is subnormal, flushed to 0 by XLA.
LOGSUMEXP_NAIVE_BACKWARD = with_backward(stable_logsumexp, lambda x, g: g * jnp.exp(x) / jnp.exp(x).sum())


def test_logsumexp_whose_backward_underflows_fails_as_its_compiled_gradient_is_nan():
    x = -720.0 + np.linspace(0.0, 1.0, 4)
    with enable_x64(True):
        compiled = np.asarray(jax.jit(jax.grad(LOGSUMEXP_NAIVE_BACKWARD))(jnp.asarray(x)))
    if ON_CPU:
        assert np.isnan(compiled).all()
    assert gradcheck_verdict(LOGSUMEXP_NAIVE_BACKWARD, x) == compiled_verdict(LOGSUMEXP_NAIVE_BACKWARD, x)
    assert gradcheck_verdict(LOGSUMEXP_NAIVE_BACKWARD, x) is (not np.isnan(compiled).any())


def test_logsumexp_with_the_naive_backward_passes_where_nothing_underflows():
    x = np.linspace(-1.0, 1.0, 4)
    assert gradcheck_verdict(LOGSUMEXP_NAIVE_BACKWARD, x) is True
    assert compiled_verdict(LOGSUMEXP_NAIVE_BACKWARD, x) is True


# The backward of exp computes exp(x) as exp(x - 90) / exp(-90) in float32, where exp(-90) = 8.2e-40 is subnormal.
EXP_FLOAT32_SUBNORMAL_BACKWARD = with_backward(
    jnp.exp,
    lambda x, g: g * (jnp.exp(x.astype(jnp.float32) - 90.0) / np.float32(np.exp(-90.0))).astype(g.dtype),
)


def test_a_float32_subnormal_in_the_backward_is_judged_as_compiled():
    x = np.array([0.0, 0.5])
    expected = compiled_verdict(EXP_FLOAT32_SUBNORMAL_BACKWARD, x)
    if ON_CPU:
        assert expected is False  # 0 / 0 once both are flushed to zero
    assert gradcheck_verdict(EXP_FLOAT32_SUBNORMAL_BACKWARD, x) is expected


# The backward multiplies by x / x, which is NaN at the smallest subnormal once XLA flushes it to zero.
SELF_RATIO_BACKWARD = with_backward(lambda x: x, lambda x, g: g * (x / x))


def test_the_smallest_subnormal_input_is_judged_as_compiled():
    x = np.array([5e-324, 1.0])
    expected = compiled_verdict(SELF_RATIO_BACKWARD, x)
    if ON_CPU:
        assert expected is False
    assert gradcheck_verdict(SELF_RATIO_BACKWARD, x) is expected


def float16_count(x):
    """x times (the float16 cumulative sum of 5,000 ones) / 5,000: 1 where XLA accumulates widely."""
    return x * (jnp.cumsum(jnp.ones(5000, jnp.float16))[-1].astype(x.dtype) / 5000.0)


FLOAT16_COUNT_WITH_UNIT_BACKWARD = with_backward(float16_count, lambda x, g: g)


def test_a_float16_sum_in_the_forward_is_judged_as_compiled():
    x = np.array([0.3, -1.2])
    expected = compiled_verdict(FLOAT16_COUNT_WITH_UNIT_BACKWARD, x)
    if ON_CPU:
        assert expected is True  # XLA's cumsum reaches 5000, not float16's 2048
    assert gradcheck_verdict(FLOAT16_COUNT_WITH_UNIT_BACKWARD, x) is expected


def test_a_dot_of_two_vectors_is_checked():
    w = np.array([0.5, -2.0, 1.5])
    fn = lambda x: jnp.dot(x, jnp.asarray(w)) * x  # noqa: E731
    assert gradcheck_verdict(fn, np.array([0.1, 0.2, -0.4])) is True


# ---------------------------------------------------------------------------
# Random small programs: a chain of elementwise steps, each with a hand-written
# backward that is right or wrong, computed in a chosen precision, at inputs
# that include subnormals and values that overflow.


def _step(name, dtype, wrong):
    """One step of a random program: (forward, backward), computed in ``dtype``."""
    fwd, derivative = {
        "sin": (jnp.sin, jnp.cos),
        "exp": (jnp.exp, jnp.exp),
        "tanh": (jnp.tanh, lambda t: 1.0 - jnp.tanh(t) ** 2),
        "square": (lambda t: t * t, lambda t: 2.0 * t),
        "reciprocal": (lambda t: 1.0 / t, lambda t: -1.0 / (t * t)),
        "self_ratio": (lambda t: t, lambda t: t / t),
        "exp_ratio": (lambda t: t, lambda t: jnp.exp(t) / jnp.exp(t)),
    }[name]
    factor = 1.5 if wrong else 1.0

    def forward(x):
        return fwd(x.astype(dtype)).astype(x.dtype)

    def backward(x, g):
        return g * (factor * derivative(x.astype(dtype))).astype(g.dtype)

    return with_backward(forward, backward)


# Hypothesis draws the first elements more often: the steps and inputs where evaluating
# a program in any other way than XLA does goes wrong come first.
STEPS = ("self_ratio", "exp", "reciprocal", "exp_ratio", "sin", "tanh", "square")
DTYPES = (jnp.float64, jnp.float32, jnp.float16, jnp.bfloat16)
BASES = (5e-324, -720.0, 1e-310, 1e-39, -90.0, 700.0, 80.0, -3.0, 0.0, 0.4, 2.0)


@st.composite
def programs(draw):
    steps = draw(st.lists(
        st.tuples(st.sampled_from(STEPS), st.sampled_from(DTYPES), st.booleans()), min_size=1, max_size=3))
    reduce = draw(st.sampled_from(("logsumexp_naive", "none", "sum")))
    base = draw(st.sampled_from(BASES))
    spread = draw(st.sampled_from((0.0, 1e-3, 1.0)))
    n = draw(st.integers(1, 3))
    return steps, reduce, base + spread * np.linspace(0.0, 1.0, n)


def build(steps, reduce):
    chain = [_step(*s) for s in steps]

    def fn(x):
        for step in chain:
            x = step(x)
        if reduce == "logsumexp_naive":
            return LOGSUMEXP_NAIVE_BACKWARD(x)
        return x.sum() if reduce == "sum" else x

    return fn


@settings(max_examples=max(15, settings.default.max_examples // 50))
@given(programs())
def test_gradcheck_verdict_is_the_compiled_programs_verdict(program):
    steps, reduce, x = program
    fn = build(steps, reduce)
    assert gradcheck_verdict(fn, x) is compiled_verdict(fn, x)


@contextlib.contextmanager
def checks_run_op_by_op():
    """Every checking program made inside runs op by op, never compiled whole."""
    repeats, seconds = checkers._REPEATS_FOR_OP_BY_OP, checkers._compile_seconds
    checkers._REPEATS_FOR_OP_BY_OP, checkers._compile_seconds = 0, lambda equations: float("inf")
    vjpkit.clear_caches()
    try:
        yield
    finally:
        checkers._REPEATS_FOR_OP_BY_OP, checkers._compile_seconds = repeats, seconds
        vjpkit.clear_caches()


@settings(max_examples=max(15, settings.default.max_examples // 50))
@given(programs())
def test_gradcheck_verdict_op_by_op_is_the_eager_programs_verdict(program):
    steps, reduce, x = program
    fn = build(steps, reduce)
    with checks_run_op_by_op():
        assert gradcheck_verdict(fn, x) is compiled_verdict(fn, x, eagerly)


def test_a_float16_sum_judged_op_by_op_is_judged_as_run_eagerly():
    x = np.array([0.3, -1.2])
    with checks_run_op_by_op():
        assert gradcheck_verdict(FLOAT16_COUNT_WITH_UNIT_BACKWARD, x) is compiled_verdict(
            FLOAT16_COUNT_WITH_UNIT_BACKWARD, x, eagerly)


def test_a_subnormal_judged_op_by_op_is_judged_as_run_eagerly():
    x = np.array([5e-324, 1.0])
    expected = compiled_verdict(SELF_RATIO_BACKWARD, x, eagerly)
    if ON_CPU:
        assert expected is False  # each kernel flushes subnormals too
    with checks_run_op_by_op():
        assert gradcheck_verdict(SELF_RATIO_BACKWARD, x) is expected


def test_a_softmax_xla_may_simplify_is_judged_as_each_way_runs_it():
    # A one-element softmax exp(x) / sum(exp(x)) at -720 with a naive backward: op by op, exp(-720) is
    # subnormal, flushed to 0, and 0 / 0 is NaN; compiled, some XLA versions simplify it to 1 (JAX
    # 0.10's does, 0.12's does not). Each way of running the check judges the program it runs.
    fn, x = build([("self_ratio", jnp.float64, False)], "logsumexp_naive"), np.array([-720.0])
    if ON_CPU:
        assert compiled_verdict(fn, x, eagerly) is False
    assert gradcheck_verdict(fn, x) is compiled_verdict(fn, x)
    with checks_run_op_by_op():
        assert gradcheck_verdict(fn, x) is compiled_verdict(fn, x, eagerly)


# ---------------------------------------------------------------------------
# Which way a check runs: a Python loop in fn repeats its kernels, and its first
# check runs them op by op; a check of few kernels is compiled at once.


def tanh_loop(x):
    """30 steps of the same kernels: an unrolled Python loop, as in a bisection."""
    for _ in range(30):
        x = jnp.tanh(x) + 0.5 * x
    return x


def checking_programs():
    return [program for entries in checkers.CACHE.by_owner.values() for checker in entries.values()
            for program, _ in checker._variants.values()]


def test_the_first_check_of_a_python_loop_runs_op_by_op():
    vjpkit.clear_caches()
    x = np.array([0.3, -0.8, 1.1])
    assert gradcheck_verdict(tanh_loop, x) is compiled_verdict(tanh_loop, x) is True
    (program,) = checking_programs()
    assert program.compiled is None


def test_a_check_of_few_kernels_is_compiled_at_once():
    vjpkit.clear_caches()
    assert gradcheck_verdict(jnp.sin, np.array([0.3, -0.8])) is True
    (program,) = checking_programs()
    assert program.compiled is not None


def test_a_check_run_op_by_op_is_compiled_once_its_runs_cost_the_compile(monkeypatch):
    vjpkit.clear_caches()
    monkeypatch.setattr(checkers, "_compile_seconds", lambda equations: 0.0)
    x = np.array([0.3, -0.8, 1.1])
    verdicts = [gradcheck_verdict(tanh_loop, x) for _ in range(3)]
    (program,) = checking_programs()
    # The first run compiles each kernel; the second is op by op's cost, over a zero budget; the third compiles.
    assert verdicts == [True, True, True]
    assert program.compiled is not None


# ---------------------------------------------------------------------------
# The checker cache never changes a verdict: the same functions are checked
# in every order, with inputs and options whose checking programs differ, and
# each verdict must be the one written out for that call alone.


def times_int8_successor(x, n):
    """``x * (n + int8(1))``: for n = 127, 128 when n is a strong int32, -128 when weakly typed (int8 wraps)."""
    return x * (n + jnp.int8(1)).astype(x.dtype)


# Right only where n + int8(1) is 128: for a strongly typed n.
TIMES_128_BACKWARD = jax.custom_vjp(times_int8_successor)
TIMES_128_BACKWARD.defvjp(lambda x, n: (times_int8_successor(x, n), None), lambda _, g: (g * 128.0, None))


class ScaleByStatic(vjpkit.Function):
    """x * s for a static s; the backward is right only for s = 2 (an int: 2.0 is another key)."""

    @staticmethod
    def forward(ctx, x, s):
        ctx.s = s
        return x * (s if isinstance(s, int) else s + 1.0)

    @staticmethod
    def backward(ctx, g):
        return g * 2.0, None


class SquareWithWrongJvp(SquareWithJvp):
    """x * x with a right backward and a wrong jvp: only check_forward_ad sees it."""

    @staticmethod
    def jvp(ctx, t):
        (x,) = ctx.saved_tensors
        return 3.0 * t * x


def first_leaf_doubled_if_a_dict(p):
    leaf = jax.tree_util.tree_leaves(p)[0]
    return leaf * (2.0 if isinstance(p, dict) else 3.0)


# Right only for a dict argument.
DOUBLED_BACKWARD = jax.custom_vjp(first_leaf_doubled_if_a_dict)
DOUBLED_BACKWARD.defvjp(
    lambda p: (first_leaf_doubled_if_a_dict(p), p),
    lambda p, g: (jax.tree_util.tree_map(lambda _: 2.0 * g, p),),
)

X = np.array([0.7, -1.3, 0.4])
# (function, inputs, options, the verdict of that check alone)
CALLS = [
    (TIMES_128_BACKWARD, (X, jnp.asarray(127, dtype=jnp.int32)), {}, True),
    (TIMES_128_BACKWARD, (X, jnp.asarray(127)), {}, False),
    (ScaleByStatic.apply, (X, 2), {}, True),
    (ScaleByStatic.apply, (X, 2.0), {}, False),
    (ScaleByStatic.apply, (X, 1.0), {}, True),
    (SquareWithWrongJvp.apply, (X,), {}, True),
    (SquareWithWrongJvp.apply, (X,), {"check_forward_ad": True}, False),
    (SquareWithWrongJvp.apply, (X[:2],), {"check_forward_ad": True, "fast_mode": True}, False),
    (DOUBLED_BACKWARD, ({"a": X},), {}, True),
    (DOUBLED_BACKWARD, ([X],), {}, False),
]


def test_each_cached_check_has_the_verdict_written_out_for_it_alone():
    for fn, inputs, options, verdict in CALLS:
        vjpkit.clear_caches()
        assert vjpkit.gradcheck(fn, inputs, raise_exception=False, **options) is verdict


@settings(max_examples=max(10, settings.default.max_examples // 15))
@given(st.lists(st.sampled_from(range(len(CALLS))), min_size=2, max_size=8))
def test_the_checker_cache_keeps_every_verdict_in_any_order_of_checks(order):
    for i in order:
        fn, inputs, options, verdict = CALLS[i]
        assert vjpkit.gradcheck(fn, inputs, raise_exception=False, **options) is verdict, CALLS[i]
