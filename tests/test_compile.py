"""Compilation, and when user code runs: `apply` is jit-compiled, one program
per static signature, traced once; inside an outer `jit` it inlines;
`jit=False` runs op by op; the cache is LRU-bounded and safe to use from
several threads.
"""

import gc
import threading
import weakref

import chex
import functions
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jaxprs import equations

import vjpkit
from vjpkit._jax_internals import enable_x64  # jax.enable_x64, or its older home
from vjpkit._program import Program  # internals on purpose: counts the live programs, which no public API lists

X = jnp.array([0.5, -1.0, 2.0])


def counting_exp(calls, **options):
    """``exp(x) * c`` (ScaledExp), a class of its own; appends to ``calls`` each time forward runs."""

    class Exp(functions.ScaledExp):
        @staticmethod
        def forward(ctx, x, c=1.0):
            calls.append(x)
            return functions.ScaledExp.forward(ctx, x, c)

    return functions.fresh(Exp, **options)


def test_apply_is_jit_compiled_by_default():
    calls = []
    Exp = counting_exp(calls)
    chex.assert_trees_all_close(Exp.apply(X), jnp.exp(X))
    assert isinstance(calls[0], jax.core.Tracer)  # forward ran while JAX traced


def test_repeated_calls_never_retrace():
    calls = []
    Exp = counting_exp(calls)
    for i in range(5):
        chex.assert_trees_all_close(Exp.apply(X + i), jnp.exp(X + i))
    assert len(calls) == 1


def test_repeated_calls_with_keyword_and_static_arguments_never_retrace():
    calls = []
    Exp = counting_exp(calls)
    for i in range(5):
        Exp.apply(x=X + i, c=2.0)
    assert len(calls) == 1


def test_repeated_gradients_never_retrace():
    calls = []
    Exp = counting_exp(calls)
    grad = jax.grad(lambda x: Exp.apply(x).sum())
    chex.assert_trees_all_close(grad(X), jnp.exp(X))
    traced = len(calls)
    for i in range(3):
        chex.assert_trees_all_close(grad(X + i), jnp.exp(X + i))
    assert len(calls) == traced


def test_one_program_per_static_signature():
    calls = []
    Exp = counting_exp(calls)
    Exp.apply(X, 2.0)
    Exp.apply(X + 1, 2.0)
    Exp.apply(X, 3.0)
    Exp.apply(X, c=3.0)
    info = Exp.cache_info()
    assert (info.programs, info.hits, info.misses) == (2, 2, 2)
    assert len(calls) == 2


def test_clear_caches_drops_every_functions_programs():
    calls = []
    Exp = counting_exp(calls)
    Exp.apply(X)
    Exp.apply(X, 2.0)
    vjpkit.clear_caches()
    assert Exp.cache_info().programs == 0
    chex.assert_trees_all_close(Exp.apply(X), jnp.exp(X))  # traced and compiled anew
    assert (Exp.cache_info().programs, len(calls)) == (1, 3)


def test_new_input_shape_traces_again_within_the_same_program():
    calls = []
    Exp = counting_exp(calls)
    Exp.apply(X)
    Exp.apply(jnp.ones((2, 2)))
    Exp.apply(jnp.ones((2, 2)) * 3)
    assert Exp.cache_info().programs == 1  # JAX's jit cache handles shapes
    assert [c.shape for c in calls] == [(3,), (2, 2)]


# A Function's call in a jaxpr: an equation of vjpkit's own primitive.
FUNCTION_CALL = {"vjpkit_call"}


def test_inside_an_outer_jit_it_inlines():
    Exp = counting_exp([])

    @jax.jit
    def outer(x):
        return Exp.apply(x, 2.0) * 3

    (outer_eqn,) = jax.make_jaxpr(outer)(X).jaxpr.eqns
    assert outer_eqn.primitive.name in ("jit", "pjit")
    body = outer_eqn.params["jaxpr"].jaxpr
    names = [eqn.primitive.name for eqn in equations(body)]
    assert FUNCTION_CALL & set(names), names
    assert not {"jit", "pjit"} & set(names), names
    chex.assert_trees_all_close(outer(X), jnp.exp(X) * 6)


def test_closed_over_array_inside_an_outer_jit_inlines():
    Exp = counting_exp([])
    Exp.apply(X)  # a top-level call first, so apply's fast path is set up

    @jax.jit
    def outer(y):
        return Exp.apply(X) * y  # X is a concrete array, not a tracer

    (outer_eqn,) = jax.make_jaxpr(outer)(2.0).jaxpr.eqns
    names = [eqn.primitive.name for eqn in equations(outer_eqn.params["jaxpr"].jaxpr)]
    assert FUNCTION_CALL & set(names), names
    assert not {"jit", "pjit"} & set(names), names
    chex.assert_trees_all_close(outer(2.0), jnp.exp(X) * 2)


def test_gradient_inside_an_outer_jit_inlines():
    Exp = counting_exp([])
    grad = jax.jit(jax.grad(lambda x: Exp.apply(x).sum()))
    (outer_eqn,) = jax.make_jaxpr(grad)(X).jaxpr.eqns
    names = [eqn.primitive.name for eqn in equations(outer_eqn.params["jaxpr"].jaxpr)]
    assert not {"jit", "pjit"} & set(names), names
    chex.assert_trees_all_close(grad(X), jnp.exp(X))


def test_closed_over_concrete_array_inside_an_outer_jit_inlines_after_eager_calls():
    Exp = counting_exp([])
    c = jnp.array([0.1, 0.2, 0.3])
    Exp.apply(c)
    Exp.apply(c)  # eager calls with all-array arguments take the fast path

    outer = jax.jit(lambda y: Exp.apply(c) * y)
    (outer_eqn,) = jax.make_jaxpr(outer)(X).jaxpr.eqns
    names = [eqn.primitive.name for eqn in equations(outer_eqn.params["jaxpr"].jaxpr)]
    assert FUNCTION_CALL & set(names), names
    assert not {"jit", "pjit"} & set(names), names


class AddOnes(vjpkit.Function):
    """``x + jnp.ones(3)``: float64 under x64, whatever ``x``'s dtype; float32 without."""

    @staticmethod
    def forward(ctx, x):
        return x + jnp.ones(3)

    @staticmethod
    def backward(ctx, g):
        return g


def test_a_call_staged_in_an_outer_jit_follows_the_trace_configuration():
    # The staged call's function is traced once per operand types and configuration: under x64 forward's
    # jnp.ones is float64, and the same float32 operand must not reuse the float32 trace (nor the reverse).
    x = jnp.arange(3.0, dtype=jnp.float32)
    outer = jax.jit(lambda x: AddOnes.apply(x) * 2)
    plain = jax.jit(lambda x: (x + jnp.ones(3)) * 2)
    for x64 in (True, False, True):
        with enable_x64(x64):
            got, expected = outer(x), plain(x)
            assert got.dtype == expected.dtype == (jnp.float64 if x64 else jnp.float32)
            chex.assert_trees_all_close(got, expected)


class SplitsMatrices(vjpkit.Function):
    """A matrix gives its rows' and columns' sums, a vector its sum: the output's structure follows the shapes."""

    @staticmethod
    def forward(ctx, x):
        ctx.shape = x.shape
        return (x.sum(1), x.sum(0)) if x.ndim == 2 else x.sum()

    @staticmethod
    def backward(ctx, *gs):
        if len(ctx.shape) == 2:
            g_rows, g_cols = gs
            return g_rows[:, None] + g_cols[None, :]
        return jnp.broadcast_to(gs[0], ctx.shape)


def _splits_matrices(x):
    return (x.sum(1), x.sum(0)) if x.ndim == 2 else x.sum()


@pytest.mark.parametrize("wrap", [lambda f: f, jax.jit], ids=["eager", "jit"])
def test_an_output_structure_that_depends_on_the_input_shape_follows_each_call(wrap):
    # One program serves every shape; each call gets the structure forward gave at its own shapes.
    vector, matrix = jnp.arange(3.0), jnp.arange(6.0).reshape(2, 3)

    def loss(f):
        return lambda x: sum(jnp.sum(jnp.sin(y)) for y in jax.tree_util.tree_leaves(f(x)))

    for x in (vector, matrix, vector, matrix):
        chex.assert_trees_all_close(wrap(SplitsMatrices.apply)(x), _splits_matrices(x))
        chex.assert_trees_all_close(wrap(jax.grad(loss(SplitsMatrices.apply)))(x), jax.grad(loss(_splits_matrices))(x))
    assert SplitsMatrices.cache_info().programs == 1


def test_jit_false_option_runs_forward_on_concrete_arrays(capsys):
    seen = []

    class Debug(functions.Square):
        jit = False

        @staticmethod
        def forward(ctx, x):
            seen.append(float(x[0]))  # would fail on a tracer
            print("forward sees", np.asarray(x))
            return functions.Square.forward(ctx, x)

    chex.assert_trees_all_close(Debug.apply(X), X * X)
    Debug.apply(X + 1)
    assert seen == [0.5, 1.5]  # op by op: forward runs on every call
    assert "forward sees [ 0.5 -1.   2. ]" in capsys.readouterr().out
    chex.assert_trees_all_close(jax.grad(lambda x: Debug.apply(x).sum())(X), 2 * X)


def test_jit_false_class_attribute_runs_op_by_op():
    seen = []

    class Debug(functions.Double):
        jit = False

        @staticmethod
        def forward(ctx, x):
            seen.append(isinstance(x, jax.core.Tracer))
            return functions.Double.forward(ctx, x)

    Debug.apply(X)
    Debug.apply(X)
    assert seen == [False, False]


def test_cache_keeps_at_most_cache_size_programs():
    calls = []
    Exp = counting_exp(calls, cache_size=2)
    for c in (1.0, 2.0, 3.0):
        Exp.apply(X, c)
    info = Exp.cache_info()
    assert (info.programs, info.maxsize) == (2, 2)


def test_cache_drops_the_least_recently_used_program():
    calls = []
    Exp = counting_exp(calls, cache_size=2)
    Exp.apply(X, 1.0)
    Exp.apply(X, 2.0)
    Exp.apply(X, 1.0)  # 1.0 is now the most recently used
    Exp.apply(X, 3.0)  # drops 2.0
    assert len(calls) == 3
    Exp.apply(X, 1.0)  # still cached
    assert len(calls) == 3
    Exp.apply(X, 2.0)  # was dropped: traced again
    assert len(calls) == 4


def _alive_programs_of(cls) -> int:
    """Programs of ``cls`` still alive (held by anything: the cache, a remembered call, JAX's caches)."""
    gc.collect()
    return sum(1 for o in gc.get_objects() if type(o) is Program and o.spec.forward is cls.forward)


def _scale(calls, **options):
    """``c * x`` (Scale) with ``c`` an array (traced) or a Python float (static); appends to ``calls`` per trace."""

    class Scale(functions.Scale):
        @staticmethod
        def forward(ctx, x, c):
            calls.append(c)
            return functions.Scale.forward(ctx, x, c)

    return functions.fresh(Scale, **options)


def test_dropped_programs_are_freed_whatever_way_they_were_called():
    calls = []
    Scale = _scale(calls, cache_size=2)
    Scale.apply(X, jnp.float32(2.0))  # all arrays
    Scale.apply(X, jnp.float32(2.0))
    alive = weakref.WeakSet(o for o in gc.get_objects() if type(o) is Program and o.spec.forward is Scale.forward)
    Scale.apply(X, 2.0)
    Scale.apply(X, 3.0)  # drops the program of an array c
    assert Scale.cache_info().programs == 2
    gc.collect()
    assert len(alive) == 0
    assert _alive_programs_of(Scale) == 2
    chex.assert_trees_all_close(Scale.apply(X, jnp.float32(2.0)), 2.0 * X)  # traced again
    assert len(calls) == 4


def test_every_call_that_reuses_a_program_counts_as_a_hit():
    calls = []
    Scale = _scale(calls)
    for _ in range(3):
        Scale.apply(X, jnp.float32(2.0))
    Scale.apply(x=X, c=jnp.float32(3.0))
    Scale.apply(np.asarray(X), np.float32(2.0))
    info = Scale.cache_info()
    assert (info.programs, info.hits, info.misses) == (1, 4, 1)


def test_cache_size_class_attribute_bounds_the_cache():
    Scale = functions.fresh(functions.Scale, cache_size=1)  # c: a static scalar
    for c in (1.0, 2.0, 3.0):
        Scale.apply(X, c)
    assert Scale.cache_info().programs == 1


def test_a_pytree_call_shape_whose_program_was_dropped_runs_the_program_made_for_it_again():
    class Affine(vjpkit.Function):
        cache_size = 1  # each new static scale drops the other's program, and the routes to it

        @staticmethod
        def forward(ctx, params, x):
            return params["scale"] * x + params["shift"]

    x, shift = jnp.arange(3.0), jnp.ones(3)
    for scale in (2.0, 3.0, 3.0, 2.0, 2.0, 3.0):  # a Python float leaf is static: one program per value
        got = Affine.apply({"scale": scale, "shift": shift}, x)
        np.testing.assert_allclose(got, [1.0, 1.0 + scale, 1.0 + 2 * scale])
    info = Affine.cache_info()
    assert (info.programs, info.hits, info.misses) == (1, 2, 4)


def test_concurrent_calls_from_eight_threads_match_serial_results():
    calls = []
    Exp = counting_exp(calls)
    jobs = [(jnp.linspace(-1.0, 1.0, 2 + i % 4), float(1 + i % 3)) for i in range(8)]

    def run(x, c):
        value = Exp.apply(x, c)
        grad = jax.grad(lambda x: Exp.apply(x, c).sum())(x)
        return value, grad

    results = [None] * 8
    errors = []
    barrier = threading.Barrier(8)

    def worker(i):
        try:
            barrier.wait()
            results[i] = run(*jobs[i])
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors

    for (x, c), (value, grad) in zip(jobs, results, strict=True):
        chex.assert_trees_all_close(value, jnp.exp(x) * c)
        chex.assert_trees_all_close(grad, jnp.exp(x) * c)
        chex.assert_trees_all_close((value, grad), run(x, c))
    assert Exp.cache_info().programs == 3  # one per distinct c


def test_a_call_of_a_remembered_shape_makes_its_program_the_most_recently_used():
    calls = []
    Exp = counting_exp(calls, cache_size=2)
    Exp.apply(X, 1.0)  # miss
    Exp.apply(X, 2.0)  # miss
    Exp.apply(x=X, c=1.0)  # a new call shape of a cached program: hit
    Exp.apply(x=X, c=1.0)  # the remembered call shape: hit, 1.0 is the most recently used
    Exp.apply(X, 3.0)  # miss: drops 2.0, the least recently used
    Exp.apply(X, 1.0)  # hit
    assert len(calls) == 3
    Exp.apply(X, 2.0)  # miss: traced again, drops 3.0
    assert len(calls) == 4
    info = Exp.cache_info()
    assert (info.programs, info.hits, info.misses) == (2, 3, 4)


def test_keyword_argument_passed_as_an_array_then_as_a_float_is_static_the_second_time():
    calls = []
    Scale = _scale(calls)
    chex.assert_trees_all_close(Scale.apply(X, c=jnp.float32(2.0)), 2.0 * X)
    chex.assert_trees_all_close(Scale.apply(X, c=3.0), 3.0 * X)
    assert isinstance(calls[0], jax.core.Tracer)
    assert calls[1:] == [3.0]  # the float reached forward as itself: static, not traced
    assert Scale.cache_info().programs == 2


def test_keyword_argument_passed_as_an_array_then_as_a_tuple_binds_the_tuple():
    @vjpkit.function
    class AddAll:
        @staticmethod
        def forward(ctx, x, c):
            return x + sum(jax.tree_util.tree_leaves(c))

        @staticmethod
        def backward(ctx, g):
            return g, None

    chex.assert_trees_all_close(AddAll.apply(X, c=jnp.float32(1.0)), X + 1.0)
    chex.assert_trees_all_close(AddAll.apply(X, c=(jnp.float32(1.0), jnp.float32(2.0))), X + 3.0)
    assert AddAll.cache_info().programs == 2


def test_call_on_closed_over_arrays_inside_linearize_needs_no_jvp_as_inside_jvp():
    Exp = counting_exp([])  # backward only
    Exp.apply(X)  # the call shape of concrete arrays is remembered
    out, tangent_fn = jax.linearize(lambda y: Exp.apply(X) * y, 2.0)  # Exp.apply(X) does not depend on y
    chex.assert_trees_all_close((out, tangent_fn(1.0)), (2.0 * jnp.exp(X), jnp.exp(X)), rtol=1e-6)
    primal, tangent = jax.jvp(lambda y: Exp.apply(X) * y, (2.0,), (1.0,))
    chex.assert_trees_all_close((primal, tangent), (2.0 * jnp.exp(X), jnp.exp(X)), rtol=1e-6)


def test_program_dropped_from_the_cache_is_freed_with_the_jitted_gradient_that_traced_it():
    # The gradient's jaxpr holds the program (its rules); JAX's caches keyed by
    # that jaxpr's equations must not hold it once the jaxpr is gone.
    Scale = _scale([], cache_size=1)
    gradient = jax.jit(jax.grad(lambda x: Scale.apply(x, 2.0).sum()))
    chex.assert_trees_all_close(gradient(X), jnp.full_like(X, 2.0))
    del gradient
    Scale.apply(X, 3.0)  # drops the program of 2.0
    assert _alive_programs_of(Scale) == 1


@jax.custom_vjp
def _hand_written_linear(x, w):
    return x @ w.T


def _hand_written_linear_fwd(x, w):
    return x @ w.T, (x, w)


def _hand_written_linear_bwd(res, g):
    x, w = res
    return g @ w, g.T @ x


_hand_written_linear.defvjp(_hand_written_linear_fwd, _hand_written_linear_bwd)


def test_a_traced_gradient_has_the_hand_written_custom_vjps_equations_and_one_tie():
    # The tie (outputs differentiate by the Function's own rules at higher order) is the one extra
    # equation per call; it lowers to nothing.
    x, w = jnp.ones((4, 3)), jnp.ones((2, 3))

    def equations(linear):
        return jax.make_jaxpr(jax.value_and_grad(lambda x, w: linear(x, w).sum(), (0, 1)))(x, w).jaxpr.eqns

    ours, theirs = equations(functions.LinearFunction.apply), equations(_hand_written_linear)
    assert [e.primitive.name for e in ours if e.primitive.name != "vjpkit_tie"] == [e.primitive.name for e in theirs]
    assert len(ours) == len(theirs) + 1
