"""Under ``jax.vmap``, an output that does not depend on a batched input stays unbatched, differentiated too.

``vmap(F, in_axes=(0, None), out_axes=(0, None))`` of ``F(x, w) = (sin(x) * w, w ** 2)``:
the second output depends on ``w`` alone, so ``out_axes=None`` may take it
out unbatched, under every transformation around or inside the vmap. Each
result equals the same transformation of the same math in plain ``jnp``,
for a Function with backward only, with both rules, and with jvp only.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from functions import REFERENCE, WeightedSin, WeightedSinJvpOnly, WeightedSinWithJvp, ZerosNoRules
from jax import lax

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


def test_rules_that_move_an_output_constant_along_the_batch_give_the_mean_derivative():
    # forward ignores x, backward passes the gradient through (a straight-through estimator of a constant): the
    # output is unbatched, and its derivative is the mean of the per-example ones (jax.custom_vjp gives each
    # example the sum of the cotangents, 6.0 here; per example it would be each one's own weight).
    class Constant(ZerosNoRules):
        @staticmethod
        def backward(ctx, g):
            return g

    weights = jnp.array([1.0, 2.0, 3.0])
    grad = jax.grad(lambda x: jnp.sum(weights * jax.vmap(Constant.apply)(x)))
    close(grad(jnp.arange(3.0)), jnp.full(3, 2.0))
    close(jax.jit(grad)(jnp.arange(3.0)), jnp.full(3, 2.0))
