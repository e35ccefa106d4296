"""Functions with ``jvp``: effects and vmap collectives inside their rules.

Such a Function returns its tangent through vjpkit's own primitive, which
must carry what its rules do as a hand-written ``custom_jvp``/``custom_vjp``
would: ordered and unordered callbacks in program order, and collectives
over a ``jax.vmap`` axis name. Every expected value is JAX autodiff of the
same math written in plain jnp, every expected order is written out.
"""

import chex
import jax
import jax.numpy as jnp
import pytest
from functions import SinJvpOnly, SinWithJvp

import vjpkit

# JAX-version flags (which behaviour this JAX has): no public API says it.
from vjpkit._jax_internals import LINEARIZE_IS_TOLD_FROM_VJP

X = jnp.array([0.3, -1.2, 2.0])
T = jnp.array([1.0, 0.5, -2.0])


def recording_sin(events, ordered):
    """Sin whose jvp and backward each report (a label, a value) through a debug callback."""

    def record(label):
        return lambda value: events.append((label, value.tolist()))

    class RecordingSin(SinWithJvp):  # its forward
        @staticmethod
        def jvp(ctx, t):
            (x,) = ctx.saved_tensors
            jax.debug.callback(record("jvp"), t, ordered=ordered)
            return jnp.cos(x) * t

        @staticmethod
        def backward(ctx, g):
            (x,) = ctx.saved_tensors
            jax.debug.callback(record("backward"), g, ordered=ordered)
            return jnp.cos(x) * g

    return RecordingSin, record


def program(cls, record, ordered):
    """A callback before and after the Function, each ordered like the rules' ones."""

    def f(x):
        jax.debug.callback(record("before"), x, ordered=ordered)
        y = cls.apply(x) * 2.0
        jax.debug.callback(record("after"), y, ordered=ordered)
        return y

    return f


def reference(x):
    return jnp.sin(x) * 2.0


def jvp_of(f):
    return lambda x, t: jax.jvp(f, (x,), (t,))


def grad_of(f):
    return lambda x, t: jax.grad(lambda x: jnp.vdot(f(x), t))(x)


FORWARD = {"jvp": jvp_of, "jit(jvp)": lambda f: jax.jit(jvp_of(f))}
REVERSE = {"grad": grad_of, "jit(grad)": lambda f: jax.jit(grad_of(f))}


# ---------------------------------------------------------------------------
# Ordered effects: run once each, in program order.


def run_ordered(apply_transform):
    """``apply_transform`` of the program with ordered callbacks, on (X, T): its result, and the events in order."""
    events = []
    cls, record = recording_sin(events, ordered=True)
    got = apply_transform(program(cls, record, ordered=True))(X, T)
    jax.effects_barrier()
    return got, events


@pytest.mark.parametrize("transform", FORWARD)
def test_ordered_callback_in_jvp_runs_in_program_order(transform):
    got, events = run_ordered(FORWARD[transform])
    chex.assert_trees_all_close(got, jvp_of(reference)(X, T), rtol=1e-6)
    y = (jnp.sin(X) * 2.0).tolist()
    assert [label for label, _ in events] == ["before", "jvp", "after"]
    chex.assert_trees_all_close(events[1][1], T.tolist())
    chex.assert_trees_all_close(events[2][1], y, rtol=1e-6)


@pytest.mark.parametrize("transform", REVERSE)
def test_ordered_callback_in_backward_runs_in_program_order(transform):
    got, events = run_ordered(REVERSE[transform])
    chex.assert_trees_all_close(got, grad_of(reference)(X, T), rtol=1e-6)
    # Forward pass first, then backward, which receives d(2 sin x)/d(sin x) * T.
    assert [label for label, _ in events] == ["before", "after", "backward"]
    chex.assert_trees_all_close(events[2][1], (2.0 * T).tolist())


def test_ordered_callback_in_jvp_of_a_jvp_only_function_runs_in_reverse_mode_through_its_transpose():
    events = []

    class RecordingSinJvpOnly(SinJvpOnly):  # its forward
        @staticmethod
        def jvp(ctx, t):
            (x,) = ctx.saved_tensors
            jax.debug.callback(lambda: events.append("jvp"), ordered=True)
            return jnp.cos(x) * t

    got = jax.jit(jax.jvp, static_argnums=0)(RecordingSinJvpOnly.apply, (X,), (T,))
    jax.effects_barrier()
    chex.assert_trees_all_close(got, jax.jvp(jnp.sin, (X,), (T,)), rtol=1e-6)
    assert events == ["jvp"]


def test_ordered_debug_print_in_jvp_and_backward_prints_in_program_order(capsys):
    class PrintingSin(SinWithJvp):  # its forward
        @staticmethod
        def jvp(ctx, t):
            (x,) = ctx.saved_tensors
            jax.debug.print("jvp sees {t}", t=t, ordered=True)
            return jnp.cos(x) * t

        @staticmethod
        def backward(ctx, g):
            (x,) = ctx.saved_tensors
            jax.debug.print("backward sees {g}", g=g, ordered=True)
            return jnp.cos(x) * g

    def f(x):
        jax.debug.print("start", ordered=True)
        return PrintingSin.apply(x).sum()

    x = jnp.array([0.0, 1.0])
    tangent = jax.jit(jvp_of(f))(x, jnp.array([3.0, 4.0]))[1]
    gradient = jax.jit(jax.grad(f))(x)
    jax.effects_barrier()
    chex.assert_trees_all_close(tangent, jax.jvp(lambda x: jnp.sin(x).sum(), (x,), (jnp.array([3.0, 4.0]),))[1])
    chex.assert_trees_all_close(gradient, jnp.cos(x))
    lines = capsys.readouterr().out.splitlines()
    assert lines == ["start", "jvp sees [3. 4.]", "start", "backward sees [1. 1.]"]


# Reverse mode records a call to jvp without tracing it (grad never runs
# jvp), so without its effects. Where JAX reuses that record to run the jvp
# (jax.linearize before JAX 0.9, which a rule cannot tell from reverse mode),
# vjpkit raises its error instead of JAX's KeyError; from JAX 0.9 the call
# runs in order.
OLD_JAX_ERROR = (
    r"RecordingSin\.jvp uses ordered effects .*reverse mode recorded.* Pass ordered=False in RecordingSin\.jvp"
)


def test_ordered_callback_in_jvp_runs_under_linearize_or_raises_naming_the_class():
    events = []
    cls, record = recording_sin(events, ordered=True)
    _, f_jvp = jax.linearize(cls.apply, X)
    if not LINEARIZE_IS_TOLD_FROM_VJP:
        with pytest.raises(TypeError, match=OLD_JAX_ERROR):
            jax.jit(f_jvp)(T)
        return
    got = jax.jit(f_jvp)(T)
    jax.effects_barrier()
    chex.assert_trees_all_close(got, jax.linearize(jnp.sin, X)[1](T), rtol=1e-6)
    assert [label for label, _ in events] == ["jvp"]


def test_ordered_callback_in_jvp_runs_in_jvp_after_grad():
    # jax.grad's record of the call is its own: jax.jvp after it traces the jvp, with its effects.
    events = []
    cls, record = recording_sin(events, ordered=True)
    jax.grad(lambda x: cls.apply(x).sum())(X)
    got = jax.jvp(cls.apply, (X,), (T,))
    jax.effects_barrier()
    chex.assert_trees_all_close(got, jax.jvp(jnp.sin, (X,), (T,)), rtol=1e-6)
    assert [label for label, _ in events] == ["backward", "jvp"]


def test_ordered_callback_in_jvp_runs_in_jvp_of_a_jit_after_its_grad():
    events = []
    cls, record = recording_sin(events, ordered=True)
    jitted = jax.jit(cls.apply)
    jax.grad(lambda x: jitted(x).sum())(X)
    got = jax.jvp(jitted, (X,), (T,))
    jax.effects_barrier()
    chex.assert_trees_all_close(got, jax.jvp(jnp.sin, (X,), (T,)), rtol=1e-6)
    assert [label for label, _ in events] == ["backward", "jvp"]


# ---------------------------------------------------------------------------
# Unordered effects keep working.


@pytest.mark.parametrize("transform", {**FORWARD, **REVERSE})
def test_unordered_callback_in_the_rule_runs_once(transform):
    events = []
    cls, record = recording_sin(events, ordered=False)
    apply_transform = {**FORWARD, **REVERSE}[transform]
    got = apply_transform(program(cls, record, ordered=False))(X, T)
    jax.effects_barrier()
    chex.assert_trees_all_close(got, apply_transform(reference)(X, T), rtol=1e-6)
    rule = "jvp" if transform in FORWARD else "backward"
    assert sorted(label for label, _ in events) == sorted(["before", rule, "after"])


def test_grad_still_never_runs_jvp_with_effects_in_both_rules():
    events = []
    cls, record = recording_sin(events, ordered=True)
    jax.jit(grad_of(cls.apply))(X, T)
    jax.grad(lambda x: cls.apply(x).sum())(X)
    jax.effects_barrier()
    assert [label for label, _ in events] == ["backward", "backward"]


# ---------------------------------------------------------------------------
# Collectives over a vmap axis name inside the rules.


class MeanSin(vjpkit.Function):
    """pmean(sin(x)) over the vmap axis "batch"; its rules use the same collective."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        ctx.save_for_forward(x)
        return jax.lax.pmean(jnp.sin(x), "batch")

    @staticmethod
    def jvp(ctx, t):
        (x,) = ctx.saved_tensors
        return jax.lax.pmean(jnp.cos(x) * t, "batch")

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return jnp.cos(x) * jax.lax.pmean(g, "batch")


class MeanSinJvpOnly(vjpkit.Function):
    """The same with jvp only (MeanSin's forward and jvp): reverse mode transposes the jvp, collective included."""

    forward = staticmethod(MeanSin.forward)
    jvp = staticmethod(MeanSin.jvp)


def mean_sin(x):
    return jax.lax.pmean(jnp.sin(x), "batch")


XS = jnp.array([[0.3, -1.2, 2.0], [1.1, 0.4, -0.7]])
TS = jnp.array([[1.0, 0.5, -2.0], [0.2, -1.0, 3.0]])
WEIGHTS = jnp.array([1.0, 2.0, 3.0])

# name -> (f, x, t) -> result, with a collective over "batch" in f and in its rules
PER_EXAMPLE = {
    "vmap(jvp)": lambda f: jax.vmap(jvp_of(f), axis_name="batch")(XS, TS),
    "vmap(grad)": lambda f: jax.vmap(grad_of(f), axis_name="batch")(XS, TS),
    "jit(vmap(grad))": lambda f: jax.jit(jax.vmap(grad_of(f), axis_name="batch"))(XS, TS),
    "vmap(jacfwd)": lambda f: jax.vmap(jax.jacfwd(f), axis_name="batch")(XS),
    "vmap(jacrev)": lambda f: jax.vmap(jax.jacrev(f), axis_name="batch")(XS),
    # The Function's input is the same for every example: its rules still
    # run under the named axis (the gradient is weighted per example).
    "vmap(grad) of an unbatched input": lambda f: jax.vmap(
        lambda w: jax.grad(lambda x: jnp.vdot(f(x), w))(XS[0]), axis_name="batch"
    )(jnp.stack([WEIGHTS, -WEIGHTS])),
    "vmap(grad) of unbatched values": lambda f: jax.vmap(
        lambda s: jax.grad(lambda x: f(x).sum())(XS[0]) * s, axis_name="batch"
    )(jnp.array([1.0, 3.0])),
    "vmap(jvp) of an unbatched input": lambda f: jax.vmap(
        lambda s: jax.jvp(f, (XS[0],), (TS[0] * s,)), axis_name="batch"
    )(jnp.array([1.0, 3.0])),
}


@pytest.mark.parametrize("transform", PER_EXAMPLE)
@pytest.mark.parametrize("cls", [MeanSin, MeanSinJvpOnly], ids=["both rules", "jvp only"])
def test_vmap_axis_collective_in_the_rules_matches_autodiff(cls, transform):
    apply_transform = PER_EXAMPLE[transform]
    chex.assert_trees_all_close(apply_transform(cls.apply), apply_transform(mean_sin), rtol=1e-6, atol=1e-7)
