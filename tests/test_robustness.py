"""Robustness: many threads calling at once, a compile cache that stays
bounded (in programs and in memory), and a ctx or array leaked out of a call
failing clearly when used.
"""

import gc
import itertools
import threading
import time
import tracemalloc

import functions
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import vjpkit

# Internals on purpose: the live programs (no public API lists them) and a JAX-version flag.
from vjpkit._jax_internals import JAX_KEEPS_TRANSPOSED_JITS
from vjpkit._program import Program

# ---------------------------------------------------------------------------
# Threads


def _functions():
    """Fresh classes, so that the threads also race to trace and compile."""
    return functions.fresh(functions.ScaledExp, "Exp"), functions.fresh(functions.Mul)


def _jobs(Exp, Mul):
    """Mixed calls: shapes, static arguments, keywords, the fast path, jitted and eager gradients."""
    shapes = [(), (3,), (2, 3)]
    xs = {s: jnp.linspace(-1.0, 1.0, int(np.prod(s))).reshape(s) for s in shapes}
    jitted_grad = {
        c: jax.jit(jax.grad(lambda x, c=c: (Exp.apply(x, c) * Mul.apply(x, x)).sum())) for c in (1.0, 2.0)
    }
    jobs = []
    for x in xs.values():
        jobs.append(lambda x=x: Exp.apply(x))  # apply's fast path (arrays only)
        jobs.append(lambda x=x: Mul.apply(x, x + 1))
        for c in (1.0, 2.0):
            jobs.append(lambda x=x, c=c: Exp.apply(x, c))  # static argument
            jobs.append(lambda x=x, c=c: Exp.apply(x=x, c=c))  # keywords
            jobs.append(lambda x=x, c=c: jitted_grad[c](x))
        jobs.append(lambda x=x: jax.grad(lambda v: Mul.apply(v, v).sum())(x))  # eager
    return jobs


# Races happen when threads trace and compile the same program at once (the
# first calls, released together by a barrier); later calls only repeat them.
THREADS, CALLS = 8, 200


def test_eight_threads_of_mixed_calls_match_a_serial_run():
    Exp, Mul = _functions()
    jobs = _jobs(Exp, Mul)
    plans = [np.random.default_rng(t).integers(0, len(jobs), CALLS) for t in range(THREADS)]
    results = [None] * THREADS
    errors = []
    barrier = threading.Barrier(THREADS)

    def worker(t):
        try:
            barrier.wait()
            results[t] = [jobs[j]() for j in plans[t]]
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    start = time.perf_counter()
    threads = [threading.Thread(target=worker, args=(t,)) for t in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - start
    assert not errors, errors

    serial = [np.asarray(job()) for job in jobs]  # after the threads: same programs
    for t in range(THREADS):
        for j, got in zip(plans[t], results[t], strict=True):
            np.testing.assert_array_equal(np.asarray(got), serial[j])
    # One program per static signature, even when 8 threads asked at once.
    assert Exp.cache_info().programs == 2  # c=1.0 (default or given) and c=2.0
    print(f"\n{THREADS} threads x {CALLS} calls: {elapsed:.2f} s")


# ---------------------------------------------------------------------------
# The compile cache: bounded in programs, and so in memory.


def _scale(**options):
    # A name of its own: live programs are counted by name and forward, and other tests' Scale
    # classes (which share forward) may have programs alive in this process.
    return functions.fresh(functions.Scale, f"Scale{next(_SCALES)}", **options)


_SCALES = itertools.count()


def _alive_programs(cls) -> int:
    gc.collect()
    name = cls.__name__
    return sum(
        1 for o in gc.get_objects() if type(o) is Program and o.spec.name == name and o.spec.forward is cls.forward
    )


def _traced_memory_by_quarter(Scale, n: int, grads: bool) -> list[float]:
    """Python memory (MB) after each quarter of ``n`` calls with distinct static floats."""
    x = jnp.ones(3)
    tracemalloc.start()
    try:
        sizes = []
        for i in range(n):
            c = 1.0 + i / n
            Scale.apply(x, c)
            if grads and i % 4 == 0:
                jax.grad(lambda x, c=c: Scale.apply(x, c).sum())(x)
            if (i + 1) % (n // 4) == 0:
                gc.collect()
                sizes.append(tracemalloc.get_traced_memory()[0] / 2**20)
        return sizes
    finally:
        tracemalloc.stop()


def test_the_default_cache_keeps_256_programs():
    assert _scale().cache_info().maxsize == 256


@pytest.mark.slow  # seconds of compiles to watch memory: CI runs it
def test_four_times_cache_size_distinct_static_floats_keep_at_most_cache_size_programs():
    # jit=False: 128 programs without 128 XLA compilations (CI time); the next
    # test covers compiled programs.
    Scale = _scale(jit=False, cache_size=32)
    sizes = _traced_memory_by_quarter(Scale, 128, grads=False)
    info = Scale.cache_info()
    assert (info.programs, info.maxsize, info.hits, info.misses) == (32, 32, 0, 128)
    assert _alive_programs(Scale) == 32
    # Memory plateaus once the cache is full: the last 64 calls add far less
    # than the first 32 did (robust to noise: a ratio, not a byte count).
    assert sizes[3] - sizes[1] < 0.25 * sizes[0], sizes


@pytest.mark.slow  # seconds of compiles to watch memory: CI runs it
def test_programs_dropped_from_the_cache_free_their_compiled_code():
    # JAX's own caches keep jaxprs that refer to a program's rules; a dropped
    # program must not keep its jit (and executables) alive through them.
    Scale = _scale(cache_size=4)
    sizes = _traced_memory_by_quarter(Scale, 24, grads=True)
    assert Scale.cache_info().programs == 4
    if JAX_KEEPS_TRANSPOSED_JITS:
        # JAX 0.4.38 to 0.7 keep every jit that eager reverse mode transposed
        # (vjpkit's programs as any other) until jax.clear_caches().
        jax.clear_caches()
    else:
        assert sizes[3] - sizes[1] < 0.25 * sizes[0], sizes
    assert _alive_programs(Scale) == 4


@pytest.mark.thorough  # 1,000 XLA compilations
def test_a_thousand_distinct_static_floats_compiled_do_not_grow_memory():
    Scale = _scale()
    sizes = _traced_memory_by_quarter(Scale, 1000, grads=False)
    assert Scale.cache_info().programs == 256
    assert _alive_programs(Scale) == 256
    assert sizes[3] - sizes[1] < 0.25 * sizes[0], sizes


# ---------------------------------------------------------------------------
# Leaks out of a call


def test_a_kept_ctx_raises_on_every_use_after_the_call():
    kept = []

    class Keep(vjpkit.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.mask = x > 0
            ctx.k = 2.0
            ctx.save_for_backward(x)
            kept.append(ctx)
            return x * x

        @staticmethod
        def backward(ctx, g):
            (x,) = ctx.saved_tensors
            kept.append(ctx)
            return 2 * x * g * ctx.mask

    jax.grad(lambda x: Keep.apply(x).sum())(jnp.array([1.0, -1.0]))
    forward_ctx, backward_ctx = kept[-2], kept[-1]
    uses = {
        "saved_tensors": lambda c: c.saved_tensors,
        "needs_input_grad": lambda c: c.needs_input_grad,
        "mask": lambda c: c.mask,  # an attribute set in forward: a tracer of a finished trace
        "k": lambda c: c.k,
        "save_for_backward": lambda c: c.save_for_backward(jnp.ones(2)),
        "mark_non_differentiable": lambda c: c.mark_non_differentiable(jnp.ones(2)),
        "set_materialize_grads": lambda c: c.set_materialize_grads(False),
        "new": lambda c: setattr(c, "new", 1),
    }
    for ctx, method in ((forward_ctx, "forward"), (backward_ctx, "backward")):
        for member, use in uses.items():
            with pytest.raises(RuntimeError, match=rf"Keep: ctx\.{member} was used after the call it belongs to had "
                                                   rf"finished \(this ctx was Keep\.{method}'s\)"):
                use(ctx)


def test_a_kept_ctx_keeps_its_underscore_attributes_readable():
    # Only the user's public attributes (possibly tracers of the finished trace) are guarded.
    kept = []

    class Keep(vjpkit.Function):
        @staticmethod
        def forward(ctx, x):
            ctx._note = "kept"
            ctx.k = 2.0
            kept.append(ctx)
            return x * ctx.k

        @staticmethod
        def backward(ctx, g):
            return g * ctx.k

    Keep.apply(jnp.ones(2))
    (ctx,) = kept
    assert ctx._note == "kept"
    with pytest.raises(RuntimeError, match=r"Keep: ctx\.k was used after the call"):
        ctx.k  # noqa: B018
    with pytest.raises(RuntimeError, match=r"Keep: ctx\.missing was used after the call"):
        ctx.missing  # noqa: B018


def _keeping_exp():
    """An exp that leaks the array it computes into ``kept``, and that list."""
    kept = []

    class Keep(functions.Exp):
        @staticmethod
        def forward(ctx, x):
            y = jnp.exp(x)  # made here: JAX's leak report names this forward
            ctx.save_for_backward(y)
            kept.append(y)
            return y

    return Keep, kept


def test_an_array_kept_from_forward_fails_with_vjpkits_explanation_when_passed_back():
    Keep, kept = _keeping_exp()
    Keep.apply(jnp.ones(3))
    with pytest.raises(jax.errors.UnexpectedTracerError, match=r"Keep: an array that leaked out of an earlier trace "
                                                               r"was used here .*Return it from forward as an extra "
                                                               r"output") as info:
        Keep.apply(kept[0])
    # JAX's report follows, naming the line in forward that created the array.
    assert "JAX's report:" in str(info.value) and "Keep.forward)" in str(info.value)


def test_an_array_kept_from_forward_used_in_plain_jax_names_the_forward():
    Keep, kept = _keeping_exp()
    Keep.apply(jnp.ones(3))
    # Outside vjpkit, the error is JAX's alone; it names where the value was made.
    with pytest.raises(jax.errors.UnexpectedTracerError, match=r"created on line .*Keep\.forward\)"):
        kept[0] + 1
