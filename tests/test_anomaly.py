"""``vjpkit.detect_anomaly()``: every vjpkit Function checks its forward
outputs, backward gradients and jvp tangents for NaN/Inf, under jit too, and
the error names the class, the method and the position. Off, it costs
nothing: the compiled program is the one traced without it.
"""

import contextlib
import re
import threading

import chex
import functions
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from asynchronous import pending
from functions import Log

import vjpkit
from vjpkit import detect_anomaly

X = jnp.array([0.5, 2.0, 4.0])
NEAR_ONE = jnp.array([0.5, 1.0, 4.0])  # Exp's wrong backward gives nan at 0.5


class Exp(vjpkit.Function):
    """exp, with a backward that is wrong (nan) below 1."""

    @staticmethod
    def forward(ctx, x):
        y = jnp.exp(x)
        ctx.save_for_backward(x, y)
        return y

    @staticmethod
    def backward(ctx, g):
        x, y = ctx.saved_tensors
        return g * y * jnp.sqrt(x - 0.75) / jnp.sqrt(x - 0.75)


class Div(vjpkit.Function):
    @staticmethod
    def forward(ctx, x, y, scale=1.0):
        ctx.save_for_backward(x, y)
        return scale * x / y

    @staticmethod
    def backward(ctx, g):
        x, y = ctx.saved_tensors
        return g / y, -g * x / (y * y), None


Sqrt = functions.elementwise(
    "Sqrt", jnp.sqrt, lambda y, t: t / (2 * y), "output", functions.JVP_ONLY, doc="jvp only: the tangent is inf at 0."
)


def exp_loss(x):
    return Exp.apply(x).sum()


EXP_NAN = re.escape(
    "Exp.backward returned nan in gradient 0 (input 'x'): 1 nan of 3 elements (the first at index (0,))"
)


def test_off_by_default_nan_passes_through():
    grad = jax.grad(exp_loss)(NEAR_ONE)
    assert np.isnan(grad[0]) and np.isfinite(grad[1:]).all()


def test_nan_in_backward_names_class_method_and_input():
    with pytest.raises(FloatingPointError, match=EXP_NAN):
        with detect_anomaly():
            jax.grad(exp_loss)(NEAR_ONE)


def test_finite_results_are_unchanged():
    with detect_anomaly():
        value, grad = jax.value_and_grad(lambda x: Log.apply(x).sum())(X)
    chex.assert_trees_all_close((value, grad), (jnp.log(X).sum(), 1 / X))


def test_nan_in_backward_under_jit_reaches_the_caller():
    step = jax.jit(jax.grad(exp_loss))
    with pytest.raises(FloatingPointError, match=EXP_NAN):
        with detect_anomaly():
            step(NEAR_ONE)


def test_inside_the_block_jit_errors_carry_the_message():
    # In a compiled program JAX wraps a failed callback in JaxRuntimeError, raised where the result is
    # awaited (at the call on the CPU; later on a GPU); the message is in its text.
    # Where the program ran asynchronously (a GPU), the block also reports it as it exits (tested below).
    step = jax.jit(jax.grad(exp_loss))
    with contextlib.suppress(FloatingPointError):
        with detect_anomaly():
            with pytest.raises(jax.errors.JaxRuntimeError, match=EXP_NAN):
                step(NEAR_ONE).block_until_ready()


EXP_NAN_MESSAGE = (
    "Exp.backward returned nan in gradient 0 (input 'x'): 1 nan of 3 elements (the first at index (0,)). Found by "
    "vjpkit.detect_anomaly; look for a division by zero, a log or sqrt at 0, or an overflow in Exp.backward, or "
    "NaN/Inf in the incoming gradient. See https://vjpkit.github.io/vjpkit/errors/#nan-in-backward"
)


def test_a_check_that_fails_after_the_call_returned_raises_as_the_block_exits():
    # As on a GPU, where a jitted call returns before its program runs: here the input is still being computed.
    step = jax.jit(jax.grad(exp_loss))
    with pytest.raises(FloatingPointError) as raised:
        with detect_anomaly():
            step(X + 1)  # compiled with the checks; finite
            step(pending(NEAR_ONE))  # nothing awaits the result
    assert str(raised.value) == EXP_NAN_MESSAGE


def test_the_message_does_not_depend_on_the_runtimes_wording():
    # Each backend words the runtime's error its own way (a GPU appends where in the program it failed).
    step = jax.jit(jax.grad(exp_loss))
    with pytest.raises(FloatingPointError) as raised:
        with detect_anomaly():
            try:
                step(NEAR_ONE).block_until_ready()
            except jax.errors.JaxRuntimeError:
                raise jax.errors.JaxRuntimeError("INTERNAL: a runtime that words its errors its own way") from None
    assert type(raised.value) is FloatingPointError
    assert str(raised.value) == EXP_NAN_MESSAGE


def test_a_failure_of_an_asynchronous_program_caught_inside_is_raised_once_as_the_block_exits():
    # Asynchronously (as on a GPU) the block cannot tell whether code inside awaited the result: it reports.
    step = jax.jit(jax.grad(exp_loss))
    with pytest.raises(FloatingPointError, match=EXP_NAN):
        with detect_anomaly():
            step(X + 1)
            with pytest.raises(jax.errors.JaxRuntimeError, match=EXP_NAN):
                step(pending(NEAR_ONE)).block_until_ready()
    with detect_anomaly():  # reported: not again
        chex.assert_trees_all_close(step(X + 1), jnp.exp(X + 1))


def test_a_program_failure_the_barrier_reports_is_raised_as_the_block_exits_whichever_thread_ran_the_check(
    monkeypatch,
):
    # A GPU may run a program's callbacks on the calling thread and report the failure only where the result is
    # awaited, or at the block's barrier. Here the CPU runs the check on this very thread; the barrier is made to
    # report a failed program, as a GPU's would with the result never awaited.
    def failed_barrier():
        raise jax.errors.JaxRuntimeError("INTERNAL: a program with callbacks failed")

    step = jax.jit(jax.grad(exp_loss))
    with pytest.raises(FloatingPointError) as raised:
        with detect_anomaly():
            with contextlib.suppress(jax.errors.JaxRuntimeError):
                step(NEAR_ONE).block_until_ready()
            monkeypatch.setattr(vjpkit._jax_internals, "effects_barrier", failed_barrier)
    assert str(raised.value) == EXP_NAN_MESSAGE


def test_a_failure_raised_on_this_thread_is_not_raised_again_where_no_program_failed():
    # The CPU ran the check on this thread and raised at the call; the barrier finds no failed program.
    step = jax.jit(jax.grad(exp_loss))
    with detect_anomaly():
        with pytest.raises(jax.errors.JaxRuntimeError, match=EXP_NAN):
            step(NEAR_ONE).block_until_ready()


def test_an_error_of_another_kind_caught_inside_is_not_raised_again():
    @vjpkit.function(host=True)
    class Bad:
        @staticmethod
        def forward(ctx, x):
            return x > 0  # bool where float is inferred

    with detect_anomaly():
        with pytest.raises(jax.errors.JaxRuntimeError, match="Bad.forward returned output"):
            jax.jit(Bad.apply)(X).block_until_ready()


def test_a_failure_reported_once_is_not_raised_again_by_a_later_block():
    step = jax.jit(jax.grad(exp_loss))
    with pytest.raises(FloatingPointError, match=EXP_NAN):
        with detect_anomaly():
            step(X + 1)
            step(pending(NEAR_ONE))
    with detect_anomaly():
        chex.assert_trees_all_close(jax.grad(exp_loss)(X + 1), jnp.exp(X + 1))


def _failing_program():
    """A jitted program whose host callback fails: an error that is no check's."""
    def refuse(x):
        raise ValueError("not a check")

    return jax.jit(lambda x: jax.pure_callback(refuse, jax.ShapeDtypeStruct(x.shape, x.dtype), x))


def test_an_op_by_op_failure_caught_inside_is_not_raised_again_after_another_program_failed():
    EagerLog = functions.fresh(Log, "EagerLog", jit=False)
    with detect_anomaly():
        with pytest.raises(FloatingPointError, match=r"EagerLog\.forward returned nan in output 0"):
            EagerLog.apply(jnp.array([1.0, -1.0]))  # raised op by op, to this very call
        with pytest.raises(jax.errors.JaxRuntimeError, match="not a check"):
            _failing_program()(X).block_until_ready()
    # The block exits quietly: the only failed check was raised, and the failed program's error is the program's.


def test_another_programs_error_is_not_replaced_by_an_op_by_op_failure_caught_before_it():
    EagerLog = functions.fresh(Log, "EagerLog", jit=False)
    with pytest.raises(jax.errors.JaxRuntimeError, match="not a check"):
        with detect_anomaly():
            with pytest.raises(FloatingPointError, match=r"EagerLog\.forward returned nan in output 0"):
                EagerLog.apply(jnp.array([1.0, -1.0]))
            _failing_program()(X).block_until_ready()


def test_nan_in_the_backward_of_an_eager_grad_is_raised_by_the_grad_call():
    with detect_anomaly():
        with pytest.raises(FloatingPointError, match=EXP_NAN):
            jax.grad(exp_loss)(NEAR_ONE)
        # caught inside the block, which goes on checking
        chex.assert_trees_all_close(jax.grad(exp_loss)(X + 1), jnp.exp(X + 1))


def test_nan_in_an_eager_forward_is_raised_by_the_call():
    with detect_anomaly():
        with pytest.raises(FloatingPointError, match=r"Log\.forward returned nan in output 0"):
            Log.apply(jnp.array([1.0, -1.0]))
        with pytest.raises(FloatingPointError, match=r"Log\.forward returned nan in output 0"):
            jax.grad(lambda x: Log.apply(x).sum())(jnp.array([1.0, -1.0]))


def test_nan_in_a_vjp_pullback_is_raised_by_the_pullback():
    with detect_anomaly():
        y, pullback = jax.vjp(exp_loss, NEAR_ONE)  # forward is finite
        with pytest.raises(FloatingPointError, match=EXP_NAN):
            pullback(jnp.ones_like(y))


def test_nan_in_eager_vmap_and_checkpoint_is_raised_by_the_call():
    with detect_anomaly():
        with pytest.raises(FloatingPointError, match=r"Exp\.backward returned nan in gradient 0 \(input 'x'\)"):
            jax.vmap(jax.grad(exp_loss))(jnp.stack([X, NEAR_ONE]))
        with pytest.raises(FloatingPointError, match=EXP_NAN):
            jax.grad(jax.checkpoint(exp_loss))(NEAR_ONE)


def test_inf_in_forward_names_the_output():
    with pytest.raises(FloatingPointError, match=re.escape("Log.forward returned inf in output 0: 1 inf of 3 elements "
                                                           "(the first at index (1,))")):
        with detect_anomaly():
            Log.apply(jnp.array([1.0, 0.0, 2.0]))


def test_nan_in_forward_of_a_tuple_output_names_its_position():
    class Pair(vjpkit.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2, jnp.log(x)

        @staticmethod
        def backward(ctx, g1, g2):
            return 2 * g1

    with pytest.raises(FloatingPointError, match=r"Pair\.forward returned nan in output 1: 1 nan of 3 elements"):
        with detect_anomaly():
            Pair.apply(jnp.array([1.0, -1.0, 2.0]))


def test_inf_in_the_second_gradient_names_that_input():
    x, y = jnp.array([1.0, 2.0]), jnp.array([1.0, 1e-30])  # y * y underflows to 0 in float32
    loss = lambda y: Div.apply(x, y, 3.0).sum()  # noqa: E731
    with pytest.raises(FloatingPointError, match=re.escape("Div.backward returned inf in gradient 1 (input 'y'): 1 inf "
                                                           "of 2 elements (the first at index (1,))")):
        with detect_anomaly():
            jax.grad(loss)(y)


def test_nan_in_a_pytree_input_names_the_leaf():
    class Scale(vjpkit.Function):
        @staticmethod
        def forward(ctx, params, x):
            ctx.save_for_backward(params["a"], params["b"], x)
            return params["a"] * x + params["b"]

        @staticmethod
        def backward(ctx, g):
            a, b, x = ctx.saved_tensors
            return {"a": g * x, "b": g * jnp.log(b)}, g * a

    params = {"a": jnp.ones(2), "b": jnp.array([1.0, -1.0])}
    with pytest.raises(FloatingPointError, match=re.escape("Scale.backward returned nan in gradient 0 (input 'params' "
                                                           "at leaf 1)")):
        with detect_anomaly():
            jax.grad(lambda p: Scale.apply(p, X[:2]).sum())(params)


def test_inf_in_jvp_names_the_tangent():
    with pytest.raises(FloatingPointError, match=re.escape("Sqrt.jvp returned inf in the tangent of output 0: 1 inf of "
                                                           "2 elements (the first at index (0,))")):
        with detect_anomaly():
            jax.jvp(Sqrt.apply, (jnp.array([0.0, 4.0]),), (jnp.ones(2),))


def test_jvp_only_function_still_transposes_for_reverse_mode():
    with detect_anomaly():
        grad = jax.grad(lambda x: Sqrt.apply(x).sum())(X)
    chex.assert_trees_all_close(grad, 0.5 / jnp.sqrt(X))


def test_checks_run_under_vmap_of_grad():
    per_example = jax.vmap(jax.grad(exp_loss))
    with detect_anomaly():
        chex.assert_trees_all_close(per_example(X[None] + 1), jnp.exp(X[None] + 1), rtol=1e-6)
    with pytest.raises(FloatingPointError, match=r"Exp\.backward returned nan in gradient 0 \(input 'x'\)"):
        with detect_anomaly():
            per_example(jnp.stack([X, NEAR_ONE]))


def test_checks_run_inside_a_scan_body():
    def body(carry, x):
        return carry + Log.apply(x), None

    f = jax.jit(lambda xs: jax.lax.scan(body, 0.0, xs)[0])
    with pytest.raises(FloatingPointError, match=r"Log\.forward returned nan in output 0"):
        with detect_anomaly():
            f(jnp.array([1.0, 2.0, -1.0]))


def test_once_differentiable_backward_is_checked():
    class Clip(functions.Identity):
        @staticmethod
        @vjpkit.once_differentiable
        def backward(ctx, g):
            return g * jnp.inf

    with pytest.raises(FloatingPointError, match=r"Clip\.backward returned inf in gradient 0 \(input 'x'\)"):
        with detect_anomaly():
            jax.grad(lambda x: Clip.apply(x).sum())(X)


def test_a_jit_compiled_before_the_block_is_traced_again_inside_it():
    traces = []

    def loss(x):
        traces.append(None)
        return exp_loss(x)

    step = jax.jit(jax.grad(loss))
    assert np.isnan(step(NEAR_ONE)[0])  # compiled without checks
    with pytest.raises(FloatingPointError, match=EXP_NAN):
        with detect_anomaly():
            step(NEAR_ONE)
    assert len(traces) == 2
    assert np.isnan(step(NEAR_ONE)[0])  # the program compiled outside is reused
    assert len(traces) == 2


def test_the_fast_path_does_not_skip_the_checks():
    bad = jnp.array([1.0, -1.0])
    for _ in range(3):
        Log.apply(bad)  # plain arrays, no kwargs: apply's fast path is filled
    with pytest.raises(FloatingPointError, match=r"Log\.forward returned nan in output 0"):
        with detect_anomaly():
            Log.apply(bad)


def test_checked_and_unchecked_programs_are_cached_apart():
    Square = functions.fresh(functions.Square)  # a class of its own: the test counts its programs
    Square.apply(X)
    with detect_anomaly():
        Square.apply(X)
        Square.apply(X)
    Square.apply(X)
    info = Square.cache_info()
    assert (info.programs, info.misses) == (2, 2)


def test_the_mode_is_thread_local():
    results = []

    def other_thread():
        results.append(jax.grad(exp_loss)(NEAR_ONE))  # no checks here

    with pytest.raises(FloatingPointError):
        with detect_anomaly():
            t = threading.Thread(target=other_thread)
            t.start()
            t.join()
            jax.grad(exp_loss)(NEAR_ONE)
    assert np.isnan(results[0][0])


def test_usable_as_a_decorator():
    @detect_anomaly()
    def step(x):
        return jax.grad(exp_loss)(x)

    with pytest.raises(FloatingPointError, match=EXP_NAN):
        step(NEAR_ONE)


def test_other_errors_pass_through_unchanged():
    with pytest.raises(ZeroDivisionError):
        with detect_anomaly():
            1 / 0  # noqa: B018


# ---------------------------------------------------------------------------
# Zero cost when off


def _loss_text(loss, *args):
    return jax.jit(jax.grad(loss)).lower(*args).as_text()


def test_off_the_compiled_program_is_unchanged():
    def loss(x):
        return Log.apply(Exp.apply(x)).sum()

    Fresh = functions.fresh(functions.Exp, "Fresh")  # never seen anomaly mode before this test

    def fresh_loss(x):
        return Fresh.apply(x).sum()

    fresh_before = _loss_text(fresh_loss, X)
    before = _loss_text(loss, X)
    with detect_anomaly():
        during = _loss_text(loss, X)
        fresh_during = _loss_text(fresh_loss, X)
    assert "callback" in during and "callback" in fresh_during
    assert "callback" not in before
    assert _loss_text(loss, X) == before
    assert _loss_text(fresh_loss, X) == fresh_before


def test_off_the_optimized_program_matches_a_hand_written_custom_vjp():
    @jax.custom_vjp
    def exp_by_hand(x):
        return jnp.exp(x)

    exp_by_hand.defvjp(lambda x: (jnp.exp(x), jnp.exp(x)), lambda y, g: (g * y,))

    Exp2 = functions.fresh(functions.Exp)  # the correct exp, never seen anomaly mode before this test

    def ops(f):
        hlo = jax.jit(jax.grad(lambda x: f(x).sum())).lower(X).compile().as_text()
        # opcodes only: names and metadata differ between the two
        return sorted(re.findall(r"= \S+ (\w+)\(", hlo))

    with detect_anomaly():
        jax.grad(lambda x: Exp2.apply(x).sum())(X)
    assert ops(Exp2.apply) == ops(exp_by_hand)


def test_jit_false_functions_are_checked_op_by_op():
    EagerLog = functions.fresh(Log, "EagerLog", jit=False)
    with pytest.raises(FloatingPointError, match=r"EagerLog\.forward returned nan in output 0"):
        with detect_anomaly():
            EagerLog.apply(jnp.array([1.0, -1.0]))
