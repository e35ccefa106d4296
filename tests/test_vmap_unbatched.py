"""Under ``jax.vmap`` a Function is a loop over its examples, whatever its rules, in both modes.

An output that depends on no batched input, in value and in derivative,
stays unbatched: ``vmap(F, in_axes=(0, None), out_axes=(0, None))`` of
``F(x, w) = (sin(x) * w, w ** 2)`` takes the second output out unbatched,
under every transformation around or inside the vmap, and each result
equals the same transformation of the same math in plain ``jnp`` (these
rules are forward's derivative), for a Function with backward only, with
both rules, and with jvp only.

An output whose value does not depend on the batch but whose derivative
does (the rules are not forward's derivative: a constant forward with a
straight-through rule) comes out batched, as JAX batches a ``jax.custom_jvp``:
each example's derivative is its own; a backward that is not linear in
its cotangents runs per example. Those tests take their expected values
from a Python loop over the examples and from a plain ``jax.custom_jvp``
with the same rule, never from differentiating forward, or are worked out
by hand. Where the vmap fixes such an output's batch axis before any
derivative (a jit inside the vmap, or around it and differentiated from
outside; a second derivative through reverse mode), each example still
gets its own derivative, where a plain ``jax.custom_jvp`` gets the sum
over the examples.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from functions import (
    REFERENCE,
    ScaledRules,
    StraightThroughZeroJvp,
    WeightedSin,
    WeightedSinJvpOnly,
    WeightedSinWithJvp,
    ZerosNoRules,
)
from jax import lax

import vjpkit
from vjpkit import _tie  # internals on purpose: the guard behind the tie's batching

XS = jnp.array([0.1, 0.5, -1.0, 2.0, 0.3])
W = jnp.float32(1.5)
COTANGENTS = (jnp.array([1.0, -2.0, 0.5, 3.0, 1.5]), jnp.float32(0.7))
TANGENTS = (jnp.array([0.3, 1.0, -1.0, 0.5, 2.0]), jnp.float32(-0.4))

ALL = [WeightedSin, WeightedSinWithJvp, WeightedSinJvpOnly]
WITH_JVP = [WeightedSinWithJvp, WeightedSinJvpOnly]
JIT = pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])


def close(got, expected):
    got_leaves, expected_leaves = jax.tree.leaves(got), jax.tree.leaves(expected)
    assert len(got_leaves) == len(expected_leaves)
    for a, b in zip(got_leaves, expected_leaves, strict=True):
        assert jnp.shape(a) == jnp.shape(b)
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def batched(fn):
    return jax.vmap(fn, in_axes=(0, None), out_axes=(0, None))


def both_ways(cls, make, jit):
    """``make(fn)`` of the Function's apply and of its plain-jnp math, jitted or not."""
    wrap = jax.jit if jit else (lambda f: f)
    return wrap(make(cls.apply)), make(REFERENCE[cls])


def pullback(fn):
    def run(xs, w, cotangents):
        out, vjp_fn = jax.vjp(batched(fn), xs, w)
        return out, vjp_fn(cotangents)

    return run


def descend(fn, xs, w):
    """One step along the pullback of ``COTANGENTS``: a loop body that takes jax.vjp of the vmap."""
    _, (gx, gw) = pullback(fn)(xs, w, COTANGENTS)
    return xs - 0.1 * gx, w - 0.1 * gw


@pytest.mark.parametrize("cls", ALL)
@JIT
def test_vjp_of_vmap_keeps_the_unbatched_output_unbatched(cls, jit):
    got, expected = both_ways(cls, pullback, jit)
    (_, square), _ = got(XS, W, COTANGENTS)
    assert square.shape == ()
    close(got(XS, W, COTANGENTS), expected(XS, W, COTANGENTS))


@pytest.mark.parametrize("cls", ALL)
@JIT
def test_grad_through_an_unbatched_output_counts_it_once(cls, jit):
    # jax.custom_vjp gives w the gradient of w ** 2 once per example here (5 times too large).
    def make(fn):
        return jax.grad(lambda xs, w: sum(jnp.sum(jnp.sin(o)) for o in batched(fn)(xs, w)), (0, 1))

    got, expected = both_ways(cls, make, jit)
    close(got(XS, W), expected(XS, W))


def three_descents_by_scan(fn):
    def step(carry, _):
        return descend(fn, *carry), carry[1]

    return lambda xs, w: lax.scan(step, (xs, w), None, length=3)


def three_descents_by_while_loop(fn):
    def step(state):
        i, xs, w = state
        return i + 1, *descend(fn, xs, w)

    return lambda xs, w: lax.while_loop(lambda state: state[0] < 3, step, (0, xs, w))


@pytest.mark.parametrize("cls", ALL)
@pytest.mark.parametrize("loop", [three_descents_by_scan, three_descents_by_while_loop], ids=["scan", "while_loop"])
@JIT
def test_vjp_inside_a_loop_body(cls, loop, jit):
    # JAX's test_custom_vjp_closure_4521 (a scan), with values: jax.vjp of the vmap in each step of a loop.
    got, expected = both_ways(cls, loop, jit)
    close(got(XS, W), expected(XS, W))


@pytest.mark.parametrize("cls", ALL)
@pytest.mark.parametrize("w", [1.5, 0.5], ids=["square-branch", "product-branch"])
@JIT
def test_grad_through_cond(cls, w, jit):
    def make(fn):
        def loss(xs, w):
            return lax.cond(w > 1, lambda: batched(fn)(xs, w)[1], lambda: batched(fn)(xs, w)[0].sum())

        return jax.grad(loss, (0, 1))

    got, expected = both_ways(cls, make, jit)
    close(got(XS, jnp.float32(w)), expected(XS, jnp.float32(w)))


@pytest.mark.parametrize("cls", ALL)
@JIT
def test_vjp_of_a_rematerialized_vmap(cls, jit):
    def make(fn):
        def run(xs, w, cotangents):
            out, vjp_fn = jax.vjp(jax.checkpoint(batched(fn)), xs, w)
            return out, vjp_fn(cotangents)

        return run

    got, expected = both_ways(cls, make, jit)
    close(got(XS, W, COTANGENTS), expected(XS, W, COTANGENTS))


@pytest.mark.parametrize("cls", ALL)
@JIT
def test_nested_vmaps_keep_the_output_unbatched(cls, jit):
    def make(fn):
        twice = jax.vmap(batched(fn), in_axes=(0, None), out_axes=(0, None))
        return jax.grad(lambda xs, w: sum(jnp.sum(jnp.sin(o)) for o in twice(xs, w)), (0, 1))

    got, expected = both_ways(cls, make, jit)
    xs = jnp.stack([XS, 2 * XS])
    close(got(xs, W), expected(xs, W))


@pytest.mark.parametrize("cls", ALL)
@JIT
def test_second_order_through_the_unbatched_output(cls, jit):
    def make(fn):
        return jax.hessian(lambda xs, w: sum(jnp.sum(jnp.sin(o)) for o in batched(fn)(xs, w)), 1)

    got, expected = both_ways(cls, make, jit)
    close(got(XS, W), expected(XS, W))


STAGED_INSIDE = {
    "jit": jax.jit,
    "checkpoint": jax.checkpoint,
    "scan": lambda f: lambda x, w: jax.tree.map(lambda a: a[0], lax.scan(lambda c, _: (c, f(x, w)), 0, length=1)[1]),
    "cond": lambda f: lambda x, w: lax.cond(w > 0, f, f, x, w),
}


@pytest.mark.parametrize("cls", ALL)
@pytest.mark.parametrize("inside", STAGED_INSIDE)
def test_grad_of_vmap_of_a_staged_call(cls, inside):
    # The vmap batches the call as part of a jaxpr, before the gradient traces the rule (main gave w's gradient
    # once per example, silently).
    def make(fn):
        vmapped = jax.vmap(STAGED_INSIDE[inside](fn), in_axes=(0, None), out_axes=(0, None))
        return jax.grad(lambda xs, w: sum(jnp.sum(jnp.sin(o)) for o in vmapped(xs, w)), (0, 1))

    got, expected = both_ways(cls, make, False)
    close(got(XS, W), expected(XS, W))


@pytest.mark.parametrize("cls", WITH_JVP)
@JIT
def test_jvp_of_vmap_keeps_the_unbatched_output_unbatched(cls, jit):
    got, expected = both_ways(cls, lambda fn: lambda p, t: jax.jvp(batched(fn), p, t), jit)
    _, (_, square_tangent) = got((XS, W), TANGENTS)
    assert square_tangent.shape == ()
    close(got((XS, W), TANGENTS), expected((XS, W), TANGENTS))


@pytest.mark.parametrize("cls", WITH_JVP)
@JIT
def test_jacfwd_along_the_unbatched_input(cls, jit):
    # jacfwd vmaps tangents around an unbatched w: there every tangent varies along that vmap.
    got, expected = both_ways(cls, lambda fn: jax.jacfwd(lambda w: batched(fn)(XS, w)), jit)
    close(got(W), expected(W))


# ---------------------------------------------------------------------------
# Rules that are not forward's derivative: the loop and a plain jax.custom_jvp are the references.


def loop(fn, in_axes, *args):
    """``fn`` on each example (arguments with in_axes 0 indexed, None passed whole), its results stacked."""
    size = next(len(a) for a, axis in zip(args, in_axes, strict=True) if axis == 0)
    results = [fn(*(a[b] if axis == 0 else a for a, axis in zip(args, in_axes, strict=True))) for b in range(size)]
    return jax.tree.map(lambda *r: jnp.stack(r), *results)


def with_rules(base, name, rules):
    """``base`` (forward only) with the named ``rules`` among ``jvp`` and ``backward``."""
    return type(name, (base,), {"rules": rules, **{rule: staticmethod(RULES[base][rule]) for rule in rules}})


class Passes(ZerosNoRules):
    """The issue's ``Z``: forward returns zeros, the rules pass the derivative through (a straight-through constant)."""


class MovesWithX(vjpkit.Function):
    """``F(x, w) = (x * w, 2 * w)`` whose rules say the second output moves with ``x`` at slope 1."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        ctx.save_for_forward(x, w)
        return x * w, 2 * w


class Slope7(vjpkit.Function):
    """Forward ``11 * x``, rules of slope 7: a tangent that does not depend on the batch when ``t`` does not."""

    @staticmethod
    def forward(ctx, x):
        return 11 * x


def _moves_with_x_jvp(ctx, tx, tw):
    x, w = ctx.saved_tensors
    return w * tx + x * tw, tx + 2 * tw


def _moves_with_x_backward(ctx, g_product, g_twice):
    x, w = ctx.saved_tensors
    return g_product * w + g_twice, g_product * x + 2 * g_twice


RULES = {
    Passes: {"jvp": lambda ctx, t: t, "backward": lambda ctx, g: g},
    MovesWithX: {"jvp": _moves_with_x_jvp, "backward": _moves_with_x_backward},
    Slope7: {"jvp": lambda ctx, t: 7 * t, "backward": lambda ctx, g: 7 * g},
}
RULE_SETS = {"backward": ("backward",), "both": ("jvp", "backward"), "jvp": ("jvp",)}


def functions(base, rule_sets=tuple(RULE_SETS)):
    return pytest.mark.parametrize(
        "fn", [with_rules(base, f"{base.__name__}_{k}", RULE_SETS[k]) for k in rule_sets], ids=list(rule_sets)
    )


# The same rules as plain jax.custom_jvp's (a backward's transpose is the jvp written here).
passes_reference = jax.custom_jvp(lambda x: jnp.zeros_like(x))
passes_reference.defjvp(lambda primals, tangents: (jnp.zeros_like(primals[0]), tangents[0]))
moves_with_x_reference = jax.custom_jvp(lambda x, w: (x * w, 2 * w))
moves_with_x_reference.defjvp(
    lambda p, t: ((p[0] * p[1], 2 * p[1]), (p[1] * t[0] + p[0] * t[1], t[0] + 2 * t[1]))
)
slope_7_reference = jax.custom_jvp(lambda x: 11 * x)
slope_7_reference.defjvp(lambda p, t: (11 * p[0], 7 * t[0]))

EXAMPLES = jnp.array([0.0, 1.0, 2.0])
PER_EXAMPLE = jnp.array([1.0, 2.0, 4.0])  # the tangents
WEIGHTS = jnp.array([1.0, 10.0, 100.0])  # the c
MAYBE_JIT = pytest.mark.parametrize("wrap", [lambda f: f, jax.jit], ids=["eager", "jit"])


@functions(Passes, ("both", "jvp"))
@MAYBE_JIT
def test_jvp_under_vmap_of_a_constant_output_is_each_examples_own(fn, wrap):
    # The Z: the mean convention gave [2.33, 2.33, 2.33].
    def jvp_of(f):
        return lambda x, t: jax.jvp(f, (x,), (t,))

    expected = loop(jvp_of(passes_reference), (0, 0), EXAMPLES, PER_EXAMPLE)
    close(expected[1], PER_EXAMPLE)
    close(jax.vmap(jvp_of(passes_reference))(EXAMPLES, PER_EXAMPLE), expected)
    close(wrap(jax.vmap(jvp_of(fn.apply)))(EXAMPLES, PER_EXAMPLE), expected)
    # Around the vmap, the primal is batched with its tangent (JAX's custom_jvp does the same).
    close(wrap(jvp_of(jax.vmap(fn.apply)))(EXAMPLES, PER_EXAMPLE), expected)
    close(jax.jvp(jax.vmap(passes_reference), (EXAMPLES,), (PER_EXAMPLE,)), expected)
    linearized = jax.vmap(lambda x, t: jax.linearize(fn.apply, x)[1](t))
    close(wrap(linearized)(EXAMPLES, PER_EXAMPLE), PER_EXAMPLE)


@functions(Passes)
@MAYBE_JIT
def test_grad_through_a_constant_output_under_vmap_is_each_examples_own(fn, wrap):
    # The mean convention gave each example the mean weight (37.0).
    def loss(f):
        return lambda x: jnp.sum(WEIGHTS * jax.vmap(f)(x))

    expected = loop(jax.grad(lambda x, c: c * passes_reference(x)), (0, 0), EXAMPLES, WEIGHTS)
    close(expected, WEIGHTS)
    close(jax.grad(loss(passes_reference))(EXAMPLES), expected)
    close(wrap(jax.grad(loss(fn.apply)))(EXAMPLES), expected)
    _, pullback = jax.vjp(jax.vmap(fn.apply), EXAMPLES)
    close(wrap(pullback)(WEIGHTS), (expected,))


@functions(MovesWithX)
@MAYBE_JIT
def test_grad_through_an_output_constant_in_value_that_moves_with_the_batch(fn, wrap):
    # The F: the mean convention gave [37, 37, 37] for x, where vmap(grad), the loop and a custom_jvp
    # give each example its own weight.
    w = jnp.float32(3.0)

    def loss(f):
        return lambda xs, w: (WEIGHTS * jax.vmap(f, (0, None))(xs, w)[1]).sum()

    def one(f):
        return lambda x, c, w: c * f(x, w)[1]

    per_example = loop(jax.grad(one(moves_with_x_reference), (0, 2)), (0, 0, None), EXAMPLES, WEIGHTS, w)
    expected = (per_example[0], per_example[1].sum())  # w is shared: its gradient sums over the examples
    close(expected, (WEIGHTS, 2 * WEIGHTS.sum()))
    close(jax.grad(loss(moves_with_x_reference), (0, 1))(EXAMPLES, w), expected)
    close(wrap(jax.grad(loss(fn.apply), (0, 1)))(EXAMPLES, w), expected)
    close(wrap(jax.vmap(jax.grad(one(fn.apply)), (0, 0, None)))(EXAMPLES, WEIGHTS, w), WEIGHTS)


@functions(MovesWithX, ("both", "jvp"))
@MAYBE_JIT
def test_forward_mode_through_an_output_constant_in_value_that_moves_with_the_batch(fn, wrap):
    w, tw = jnp.float32(3.0), jnp.float32(0.5)

    def loss(f):
        return lambda xs, w: (WEIGHTS * jax.vmap(f, (0, None))(xs, w)[1]).sum()

    expected = jax.jvp(loss(moves_with_x_reference), (EXAMPLES, w), (PER_EXAMPLE, tw))
    close(expected[1], (WEIGHTS * (PER_EXAMPLE + 2 * tw)).sum())
    close(wrap(lambda p, t: jax.jvp(loss(fn.apply), p, t))((EXAMPLES, w), (PER_EXAMPLE, tw)), expected)
    close(wrap(jax.jacfwd(loss(fn.apply)))(EXAMPLES, w), WEIGHTS)


@functions(MovesWithX, ("both",))
def test_both_modes_of_a_vmap_equal_the_loop_and_each_other(fn):
    w = jnp.float32(3.0)
    tangents = (PER_EXAMPLE, jnp.float32(0.5))
    cotangents = (jnp.array([0.3, -1.0, 2.0]), WEIGHTS)
    batched_fn = jax.vmap(fn.apply, (0, None))
    _, tangents_out = jax.jvp(batched_fn, (EXAMPLES, w), tangents)
    # The loop: each example's jvp, and the sum of each example's vjp (w is shared).
    expected_tangents = loop(lambda x, t: jax.jvp(moves_with_x_reference, (x, w), (t, tangents[1]))[1], (0, 0),
                             EXAMPLES, PER_EXAMPLE)
    close(tangents_out, expected_tangents)
    _, pullback = jax.vjp(batched_fn, EXAMPLES, w)
    gx, gw = pullback(cotangents)
    per_example = loop(lambda x, c1, c2: jax.vjp(moves_with_x_reference, x, w)[1]((c1, c2)), (0, 0, 0), EXAMPLES,
                       *cotangents)
    close((gx, gw), (per_example[0], per_example[1].sum()))
    # <cotangent, J tangent> = <J^T cotangent, tangent>
    forward = sum(jnp.vdot(c, t) for c, t in zip(cotangents, tangents_out, strict=True))
    reverse = jnp.vdot(gx, tangents[0]) + gw * tangents[1]
    close(forward, reverse)


@functions(MovesWithX)
def test_an_output_constant_in_value_that_moves_with_the_batch_comes_out_batched(fn):
    # As JAX batches a custom_jvp: differentiated, its primal is batched with its tangent (out_axes=None refuses
    # it); not differentiated, it stays unbatched.
    w = jnp.float32(3.0)
    unbatched = jax.vmap(fn.apply, (0, None), out_axes=(0, None))
    close(unbatched(EXAMPLES, w), (EXAMPLES * w, 2 * w))
    batched = jax.vmap(fn.apply, (0, None))
    with pytest.raises(ValueError, match="out_axes"):
        jax.vjp(jax.vmap(moves_with_x_reference, (0, None), out_axes=(0, None)), EXAMPLES, w)
    with pytest.raises(ValueError, match="out_axes"):
        jax.vjp(unbatched, EXAMPLES, w)
    out, _ = jax.vjp(batched, EXAMPLES, w)
    close(out, (EXAMPLES * w, jnp.full(3, 2 * w)))
    if "jvp" in fn.rules:
        with pytest.raises(ValueError, match="out_axes"):
            jax.jvp(unbatched, (EXAMPLES, w), (PER_EXAMPLE, jnp.float32(0.0)))


@functions(Slope7, ("both", "jvp"))
@MAYBE_JIT
def test_a_tangent_that_does_not_depend_on_the_batch_stays_unbatched(fn, wrap):
    # Issue 29 item 4: PyTorch and jax.custom_jvp give ([0, 11, 22], 28.0); vjpkit raised "batched on axis 0".
    t = jnp.float32(4.0)

    def jvp_of(f):
        return lambda x, t: jax.jvp(f, (x,), (t,))

    expected = jax.vmap(jvp_of(slope_7_reference), in_axes=(0, None), out_axes=(0, None))(EXAMPLES, t)
    close(expected, (jnp.array([0.0, 11.0, 22.0]), jnp.float32(28.0)))
    primals, tangents = loop(jvp_of(slope_7_reference), (0, None), EXAMPLES, t)
    close((primals, tangents), (expected[0], jnp.full(3, 28.0)))
    got = wrap(jax.vmap(jvp_of(fn.apply), in_axes=(0, None), out_axes=(0, None)))(EXAMPLES, t)
    close(got, expected)


class ClippedSquare(vjpkit.Function):
    """``(x * w, w ** 2)`` whose backward clips the second output's gradient: not linear in its cotangents."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x * w, w**2

    @staticmethod
    def backward(ctx, g_product, g_square):
        x, w = ctx.saved_tensors
        return g_product * w, g_product * x + jnp.clip(2 * w * g_square, -1.0, 1.0)


def test_a_backward_not_linear_in_its_cotangents_runs_per_example():
    # Each example's backward sees its own cotangent, as in the loop: clip(6 c) summed over the examples,
    # not clip of a share of their sum.
    w, weights = jnp.float32(3.0), jnp.array([0.01, 0.1, 1.0])
    grad = jax.grad(lambda xs, w: (weights * jax.vmap(ClippedSquare.apply, (0, None))(xs, w)[1]).sum(), 1)
    per_example = loop(jax.grad(lambda x, c, w: c * ClippedSquare.apply(x, w)[1], 2), (0, 0, None), EXAMPLES,
                       weights, w)
    close(per_example, jnp.clip(6 * weights, -1.0, 1.0))
    close(grad(EXAMPLES, w), per_example.sum())
    close(jax.jit(grad)(EXAMPLES, w), per_example.sum())


@functions(MovesWithX)
@pytest.mark.parametrize("inside", STAGED_INSIDE)
def test_a_vmap_that_batches_a_staged_call_gives_each_example_its_own_derivative(fn, inside):
    # A vmap of a jaxpr fixes the batch axes of a call's outputs before any derivative runs the rule. JAX's own
    # custom_jvp then gives each example the sum of the examples' derivatives here (3x the loop's); the second
    # output (2 * w for every example, moving with x by the rules) is batched there by its derivative.
    w, tw = jnp.float32(3.0), jnp.float32(0.5)

    def loss(f):
        return lambda xs, w: (WEIGHTS * jax.vmap(STAGED_INSIDE[inside](f), (0, None))(xs, w)[1]).sum()

    def loop_loss(xs, w):
        return sum(WEIGHTS[b] * STAGED_INSIDE[inside](fn.apply)(xs[b], w)[1] for b in range(len(xs)))

    # By hand: the second output's tangent is tx + 2 tw.
    by_hand = (WEIGHTS, 2 * WEIGHTS.sum())
    if "backward" in fn.rules:
        close(jax.grad(loss(fn.apply), (0, 1))(EXAMPLES, w), by_hand)
        close(jax.grad(loop_loss, (0, 1))(EXAMPLES, w), by_hand)
    if "jvp" in fn.rules:
        tangent = (WEIGHTS * PER_EXAMPLE).sum() + 2 * tw * WEIGHTS.sum()
        close(jax.jvp(loss(fn.apply), (EXAMPLES, w), (PER_EXAMPLE, tw))[1], tangent)
        close(jax.jvp(loop_loss, (EXAMPLES, w), (PER_EXAMPLE, tw))[1], tangent)


@functions(Passes)
def test_grad_of_a_jit_around_the_vmap_gives_each_example_its_own_derivative_of_a_constant_output(fn):
    # jax.grad(jax.jit(f)) traces f (and its vmap) before differentiating: the vmap fixes the output's batch
    # axis first, as above. Passes' rules carry each example's cotangent through unchanged.
    loss = jax.jit(lambda x: jnp.sum(WEIGHTS * jax.vmap(fn.apply)(x)))
    close(jax.grad(loss)(EXAMPLES), WEIGHTS)


@functions(Passes)
def test_inside_a_staged_call_a_constant_output_with_a_moving_derivative_comes_out_batched(fn):
    # Where a vmap batches a jaxpr, the output's batch axis is fixed before any derivative: it takes the one its
    # derivative needs, so out_axes=None refuses it there (outside jit it stays unbatched until differentiated).
    assert jax.vmap(fn.apply, out_axes=None)(EXAMPLES).shape == ()
    with pytest.raises(ValueError, match="got axis spec None but output was batched on axis 0"):
        jax.vmap(jax.jit(fn.apply), out_axes=None)(EXAMPLES)
    close(jax.vmap(jax.jit(fn.apply))(EXAMPLES), jnp.zeros(3))


@functions(MovesWithX)
def test_a_second_derivative_through_reverse_mode_of_a_constant_output_is_each_examples_own(fn):
    # Reverse mode records the vmapped call before the outer derivative reaches the second output, whose value
    # is 2 * w for every example but whose rules move it with x: each example gets its own second derivative.
    def loss(xs, w):
        return (WEIGHTS * jnp.sin(jax.vmap(fn.apply, (0, None))(xs, w)[1])).sum()

    def loop_loss(xs, w):
        return sum(WEIGHTS[b] * jnp.sin(fn.apply(xs[b], w)[1]) for b in range(len(xs)))

    w = jnp.asarray(0.7)
    # By hand: the second output's tangent is tx + 2 tw, so d2/dx_b2 = -W_b sin(2w), d2/dx_b dw = -2 W_b sin(2w)
    # and d2/dw2 = -4 sum_b W_b sin(2w).
    s = -WEIGHTS * jnp.sin(2 * w)
    by_hand = ((jnp.diag(s), 2 * s), (2 * s, 4 * s.sum()))
    def second(f):  # jax.hessian's forward over reverse (the rule oracles' thorough run draws hessian itself)
        return jax.jacfwd(jax.grad(f, (0, 1)), (0, 1))

    close(second(loss)(EXAMPLES, w), by_hand)
    close(second(loop_loss)(EXAMPLES, w), by_hand)


@functions(Passes)
def test_where_the_fixed_batch_axes_disagree_with_the_rule_vjpkit_raises_rather_than_broadcast(fn, monkeypatch):
    # A guard: should the staged call's outputs ever be batched apart from what the rule needs (here forced by
    # reading no derivative when the call is batched), JAX would broadcast each example's tangent; vjpkit raises.
    monkeypatch.setattr(_tie, "_derivative_batched", lambda *args: set())
    loss = jax.jit(lambda x: jnp.sum(WEIGHTS * jax.vmap(fn.apply)(x)))
    with pytest.raises(ValueError, match=rf"{fn.__name__} has an output that does not vary along a jax\.vmap but "
                                         r"whose derivative does .* fixed the output's batch axis by its value alone"):
        jax.grad(loss)(EXAMPLES)



@pytest.mark.parametrize("staged", ["jit(vmap)", "vmap(jit)"])
def test_forward_over_reverse_of_a_staged_vmapped_call_batches_its_record_as_backward_does(staged):
    # Reverse mode records the staged, vmapped call; forward mode over it then evaluates that record. Its
    # second output's tangent, 2 cos(x) tx, is zero for x, not differentiated, but a batched zero where the
    # jvp computes it: it raised "got axis spec None but output was batched" (found by the rule oracles).
    xs = jnp.asarray([[0.4, -0.9, 1.1], [0.7, 0.5, -0.6]])
    ws = jnp.asarray([[1.2, -0.5, 0.8], [-0.3, 0.9, 0.6]])
    t1 = jnp.asarray([[0.5, -1.0, 0.8], [1.1, 0.3, -0.7]])
    t2 = jnp.asarray([[0.2, 0.9, -0.4], [-0.8, 0.6, 1.0]])
    apply = jax.jit(jax.vmap(ScaledRules.apply)) if staged == "jit(vmap)" else jax.vmap(jax.jit(ScaledRules.apply))

    def loss(x, w, f):
        y0, y1 = f(x, w)
        return (t1 * jnp.sin(y0)).sum() + (t2 * jnp.sin(y1)).sum()

    def loop_apply(x, w):
        return loop(ScaledRules.apply, (0, 0), x, w)

    second = jax.jacfwd(jax.grad(loss, 1), 1)
    # By hand: the gradient in w is 3 t1 cos(x w) x (backward); its derivative in w, with x w's tangent
    # 3 x tw (jvp), is -9 x^2 t1 sin(x w) on the diagonal.
    by_hand = jnp.diag((-9.0 * xs**2 * t1 * jnp.sin(xs * ws)).ravel()).reshape(2, 3, 2, 3)
    close(second(xs, ws, apply), by_hand)
    close(second(xs, ws, loop_apply), by_hand)


@pytest.mark.parametrize("staged", ["jit_of_vmap", "vmap_of_jit", "vmap"])
def test_reverse_mode_of_a_staged_vmap_runs_backward_per_example_where_the_rules_differ(staged):
    # Before JAX 0.7 reverse mode differentiates a jit by its JVP, traced before JAX knows it transposes it; the
    # tangent's batch axes must then follow backward too: jvp's zeros do not vary, backward's gradient does (it
    # gave every example the mean of the examples' gradients).
    x, w = jnp.arange(6.0).reshape(2, 3), jnp.array([1.0, 2.0, 3.0])
    weights = jnp.array([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    batched = {"jit_of_vmap": jax.jit(jax.vmap(StraightThroughZeroJvp.apply, (0, None))),
               "vmap_of_jit": jax.vmap(jax.jit(StraightThroughZeroJvp.apply), (0, None)),
               "vmap": jax.vmap(StraightThroughZeroJvp.apply, (0, None))}[staged]
    def one(x, weight):
        return (weight * StraightThroughZeroJvp.apply(x, w)).sum()

    per_example = jnp.stack([jax.grad(one)(x[i], weights[i]) for i in range(2)])
    close(per_example, weights)
    close(jax.grad(lambda x: (weights * batched(x, w)).sum())(x), per_example)
