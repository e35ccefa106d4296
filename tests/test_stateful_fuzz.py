"""Stateful differential fuzz: sequences of calls on the same Functions agree with plain JAX.

Each hypothesis example builds a fresh zoo of Functions (so every cache
starts cold) and makes 4 to 10 calls on them. Each call draws a Function,
the inputs it differentiates, the outputs its loss uses, the
transformation (eager ``grad``, ``jit(grad)``, ``value_and_grad``, ``vjp``,
``vmap(grad)``, ``hessian``, ``jvp``/``jacfwd``/``linearize`` where a
``jvp`` exists, ``vmap`` with an unbatched argument), new values and
shapes, and new static arguments. Every result must equal the same
transformation of the plain-JAX function of the same math. A cache that
answers a call with what an earlier, different call traced (a backward
told the wrong ``needs_input_grad``, a program traced for ``1`` reused for
``True``) shows up as a mismatch; hypothesis prints the sequence of calls.

``VJPKIT_HYPOTHESIS_PROFILE=thorough`` runs 500 sequences, CI's profile 10,
a plain ``pytest`` 4. The sequences that outside testing found are below as
plain regression tests.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import os
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from functions import ZerosNoRules
from hypothesis import Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, rule

import vjpkit

THOROUGH = os.environ.get("VJPKIT_HYPOTHESIS_PROFILE", "default") == "thorough"


# Tight tolerances need float64 (the conftest's x64 fixture keeps it to each test).
pytestmark = pytest.mark.usefixtures("x64")


def close(got: Any, expected: Any, what: str = "") -> None:
    got_leaves, got_tree = jax.tree_util.tree_flatten(got)
    expected_leaves, expected_tree = jax.tree_util.tree_flatten(expected)
    assert got_tree == expected_tree, f"{what}: structure {got_tree} != {expected_tree}"
    for g, e in zip(got_leaves, expected_leaves, strict=True):
        assert np.shape(g) == np.shape(e), f"{what}: shape {np.shape(g)} != {np.shape(e)}"
        np.testing.assert_allclose(np.asarray(g), np.asarray(e), rtol=1e-9, atol=1e-9, err_msg=what)


# ---------------------------------------------------------------------------
# The zoo: each case makes a fresh Function class and gives the plain-JAX math.


def _two_outputs(x, w):
    return jnp.tanh(x * w) * w, jnp.tanh(x * w)


def make_two_outputs():
    """Two outputs, saves its inputs; backward by jax.vjp of the same math; no jvp."""

    class TwoOutputs(vjpkit.Function):
        @staticmethod
        def forward(ctx, x, w):
            ctx.save_for_backward(x, w)
            return _two_outputs(x, w)

        @staticmethod
        def backward(ctx, g0, g1):
            x, w = ctx.saved_tensors
            return jax.vjp(_two_outputs, x, w)[1]((g0, g1))

    return TwoOutputs


def make_unmaterialized():
    """Materialization off: backward gets None for outputs the loss does not use."""

    class Unmaterialized(vjpkit.Function):
        @staticmethod
        def forward(ctx, x, w):
            ctx.set_materialize_grads(False)
            ctx.save_for_backward(x, w)
            return _two_outputs(x, w)

        @staticmethod
        def backward(ctx, g0, g1):
            x, w = ctx.saved_tensors
            zeros = jnp.zeros_like(x)
            return jax.vjp(_two_outputs, x, w)[1]((zeros if g0 is None else g0, zeros if g1 is None else g1))

    return Unmaterialized


def _skips(x, w):
    return x * w, jnp.sin(x) * w


def make_skips():
    """Backward returns None where needs_input_grad is False; saves only what each gradient needs."""

    class Skips(vjpkit.Function):
        @staticmethod
        def forward(ctx, x, w):
            need_x, need_w = ctx.needs_input_grad
            # PyTorch style: save only what the requested gradients read.
            ctx.save_for_backward(x if (need_x or need_w) else None, w if need_x else None)
            return _skips(x, w)

        @staticmethod
        def backward(ctx, g0, g1):
            x, w = ctx.saved_tensors
            gx = g0 * w + g1 * jnp.cos(x) * w if ctx.needs_input_grad[0] else None
            gw = g0 * x + g1 * jnp.sin(x) if ctx.needs_input_grad[1] else None
            return gx, gw

    return Skips


def _scaled_power(x, scale=2.0, *, power=2):
    return scale * x**power


def make_scaled_power():
    """Static scale and keyword-only power with defaults; saves an intermediate; ctx attributes."""

    class ScaledPower(vjpkit.Function):
        @staticmethod
        def forward(ctx, x, scale=2.0, *, power=2):
            ctx.save_for_backward(x ** (power - 1))
            ctx.scale, ctx.power = scale, power
            return scale * x**power

        @staticmethod
        def backward(ctx, g):
            (x_pm1,) = ctx.saved_tensors
            return g * ctx.scale * ctx.power * x_pm1, None, None

    return ScaledPower


def _with_mask(x, w):
    return jnp.exp(x) * w, jax.lax.stop_gradient((x > 0).astype(x.dtype))


def make_with_mask():
    """A second output marked non-differentiable; saves an output."""

    class WithMask(vjpkit.Function):
        @staticmethod
        def forward(ctx, x, w):
            e = jnp.exp(x)
            y = e * w
            mask = (x > 0).astype(x.dtype)
            ctx.mark_non_differentiable(mask)
            ctx.save_for_backward(y, e, w)
            return y, mask

        @staticmethod
        def backward(ctx, g, g_mask):
            y, e, w = ctx.saved_tensors
            return g * y, g * e

    return WithMask


def _jvp_math(x, w):
    return x * w, jnp.sin(x)


def make_with_jvp():
    """Both backward and jvp; save_for_forward for the jvp."""

    class WithJvp(vjpkit.Function):
        @staticmethod
        def forward(ctx, x, w):
            ctx.save_for_backward(x, w)
            ctx.save_for_forward(x, w)
            return _jvp_math(x, w)

        @staticmethod
        def backward(ctx, g0, g1):
            x, w = ctx.saved_tensors
            gx = g0 * w + g1 * jnp.cos(x) if ctx.needs_input_grad[0] else None
            gw = g0 * x if ctx.needs_input_grad[1] else None
            return gx, gw

        @staticmethod
        def jvp(ctx, tx, tw):
            x, w = ctx.saved_tensors
            return tx * w + x * tw, jnp.cos(x) * tx

    return WithJvp


def _tree_math(p, x):
    return p["a"] * x + jnp.sin(p["b"][0]) * x


def make_tree():
    """A pytree input (dict holding a tuple); one output; backward returns the tree's structure."""

    class Tree(vjpkit.Function):
        @staticmethod
        def forward(ctx, p, x):
            ctx.save_for_backward(p["a"], p["b"][0], x)
            return _tree_math(p, x)

        @staticmethod
        def backward(ctx, g):
            a, b, x = ctx.saved_tensors
            gp = {"a": g * x, "b": (g * jnp.cos(b) * x,)} if ctx.needs_input_grad[0] else None
            gx = g * (a + jnp.sin(b)) if ctx.needs_input_grad[1] else None
            return gp, gx

    return Tree


@dataclasses.dataclass(frozen=True)
class Cfg:
    k: Any


class Pair(collections.namedtuple("Pair", "k")):
    pass


def factor(k: Any) -> float:
    """A number that tells the type of ``k``, the sign of a zero float, and nan apart."""
    if isinstance(k, bool):
        return 2.0 + k
    if isinstance(k, int):
        return 5.0 + k
    if math.isnan(k):
        return 13.0
    return 7.0 + k + (0.5 if math.copysign(1.0, k) < 0 else 0.0)


def leaf_of(config: Any) -> Any:
    """The one scalar inside a container config."""
    if isinstance(config, (Cfg, Pair)):
        return config.k
    if isinstance(config, (frozenset, tuple, list)):
        (k,) = config
        return k
    if isinstance(config, dict):
        return config["k"]
    return config


def make_configured():
    """A static config (a scalar, or a scalar in a container) that forward branches on by type and sign."""

    class Configured(vjpkit.Function):
        @staticmethod
        def forward(ctx, x, config):
            ctx.c = factor(leaf_of(config))
            ctx.save_for_backward(x)
            return ctx.c * jnp.sin(x)

        @staticmethod
        def backward(ctx, g):
            (x,) = ctx.saved_tensors
            return g * ctx.c * jnp.cos(x), None

    return Configured


def _configured(x, config):
    return factor(leaf_of(config)) * jnp.sin(x)


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    make: Callable[[], type]
    math: Callable
    n_arrays: int  # leading array arguments
    has_jvp: bool = False
    second_order: bool = True  # backward is differentiable
    statics: tuple = ()  # static argument choices: (args, kwargs) appended to the arrays
    tree: bool = False  # the first argument is {"a": x, "b": (x,)}


STATIC_SCALARS = (True, 1, 1.0, 0.0, -0.0, 2, 0.5, False)
CONTAINERS: tuple[Callable[[Any], Any], ...] = (
    lambda k: k, Cfg, lambda k: (k,), lambda k: [k], lambda k: {"k": k}, lambda k: frozenset([k]), Pair,
)

ZOO = (
    Case("two_outputs", make_two_outputs, _two_outputs, 2),
    Case("unmaterialized", make_unmaterialized, _two_outputs, 2),
    Case("skips", make_skips, _skips, 2),
    Case(
        "scaled_power", make_scaled_power, _scaled_power, 1,
        statics=(((), {}), ((3.0,), {}), ((), {"power": 3}), ((0.5,), {"power": 1}), ((), {"scale": 2})),
    ),
    Case("with_mask", make_with_mask, _with_mask, 2),
    Case("with_jvp", make_with_jvp, _jvp_math, 2, has_jvp=True),
    Case("tree", make_tree, _tree_math, 2, tree=True),
    Case(
        "configured", make_configured, _configured, 1,
        statics=tuple(((c(k),), {}) for c in CONTAINERS for k in STATIC_SCALARS),
    ),
)

TRANSFORMS = (
    "grad", "jit_grad", "value_and_grad", "vjp", "vmap_grad", "hessian", "vmap_unbatched", "jvp", "jacfwd",
    "linearize",
)
FORWARD_MODE = ("jvp", "jacfwd", "linearize")


def inputs(case: Case, size: int, seed: int) -> list:
    rng = np.random.default_rng(seed)
    xs = [jnp.asarray(rng.uniform(0.3, 1.2, size) * rng.choice([-1.0, 1.0], size)) for _ in range(case.n_arrays)]
    if case.tree:
        xs[0] = {"a": xs[0], "b": (jnp.asarray(rng.uniform(-1, 1, size)),)}
    return xs


def run(transform: str, fn: Callable, args: list, argnums: tuple, outputs: tuple, seed: int) -> Any:
    """``transform`` of the scalar loss ``sum(sin(output))`` over ``outputs`` of ``fn(*args)``."""

    def outs(*a: Any) -> list:
        out = fn(*a)
        return list(out) if isinstance(out, tuple) else [out]

    def loss(*a: Any) -> Any:
        got = outs(*a)
        return sum(jnp.sin(got[j % len(got)]).sum() for j in outputs)

    if transform == "grad":
        return jax.grad(loss, argnums)(*args)
    if transform == "jit_grad":
        return jax.jit(jax.grad(loss, argnums))(*args)
    if transform == "value_and_grad":
        return jax.value_and_grad(loss, argnums)(*args)
    if transform == "hessian":
        return jax.hessian(loss, argnums)(*args)
    if transform == "vjp":
        # Cotangents for the used outputs, explicit zeros for the others.
        diff = [args[i] for i in argnums]

        def of_diff(*d: Any) -> list:
            full = list(args)
            for i, v in zip(argnums, d, strict=True):
                full[i] = v
            return outs(*full)

        primal, pullback = jax.vjp(of_diff, *diff)
        rng = np.random.default_rng(seed + 1)
        used = {j % len(primal) for j in outputs}
        cts = [
            jnp.asarray(rng.normal(size=np.shape(p))) if j in used else jnp.zeros_like(p)
            for j, p in enumerate(primal)
        ]
        return primal, pullback(cts)
    if transform == "vmap_grad":
        # Per-example gradients: every array argument batched (3 examples).
        batched = [jax.tree_util.tree_map(lambda a: jnp.stack([a, 0.5 * a, -a]), x) for x in args]
        return jax.vmap(jax.grad(loss, argnums))(*batched)
    if transform == "vmap_unbatched":
        # Only the first argument batched; the gradient of the others sums over the batch.
        batched = jax.tree_util.tree_map(lambda a: jnp.stack([a, 0.5 * a, -a]), args[0])
        in_axes = (0, *[None] * (len(args) - 1))
        return jax.grad(lambda *a: jax.vmap(loss, in_axes)(*a).sum(), argnums)(batched, *args[1:])
    if transform == "jvp":
        rng = np.random.default_rng(seed + 2)
        tangents = [jax.tree_util.tree_map(lambda a: jnp.asarray(rng.normal(size=a.shape)), args[i]) for i in argnums]

        def of_diff(*d: Any) -> list:
            full = list(args)
            for i, v in zip(argnums, d, strict=True):
                full[i] = v
            return outs(*full)

        return jax.jvp(of_diff, [args[i] for i in argnums], tangents)
    if transform == "jacfwd":
        return jax.jacfwd(loss, argnums)(*args)
    if transform == "linearize":
        primal, lin = jax.linearize(lambda *d: loss(*d), *args)
        ones = [jax.tree_util.tree_map(jnp.ones_like, a) for a in args]
        return primal, lin(*ones)
    raise AssertionError(transform)


@dataclasses.dataclass
class Call:
    """One drawn call, as a failure reports it."""

    case: str
    transform: str
    argnums: tuple
    outputs: tuple
    size: int
    statics: Any

    def __str__(self) -> str:
        return (f"{self.case}: {self.transform}, argnums={self.argnums}, outputs={self.outputs}, "
                f"size={self.size}, statics={self.statics!r}")


def plan(case: Case, transform_index: int, argmask: int, outmask: int, size: int, static_index: int) -> Call:
    """The call the draws stand for: every draw maps to a valid call."""
    transform = TRANSFORMS[transform_index % len(TRANSFORMS)]
    if transform in FORWARD_MODE and not case.has_jvp:
        transform = "jit_grad" if transform == "linearize" else "grad"
    if transform == "hessian" and not case.second_order:
        transform = "value_and_grad"
    positions = tuple(i for i in range(case.n_arrays) if argmask >> i & 1) or (argmask % case.n_arrays,)
    outputs = tuple(j for j in range(2) if outmask >> j & 1) or (0,)
    statics = case.statics[static_index % len(case.statics)] if case.statics else ((), {})
    return Call(case.name, transform, positions, outputs, size, statics)


class CallSequence(RuleBasedStateMachine):
    """A fresh zoo per example; each step one call, compared with plain JAX."""

    @initialize(chosen=st.lists(st.integers(0, len(ZOO) - 1), min_size=1, max_size=2, unique=True))
    def fresh_classes(self, chosen: list) -> None:
        # One or two Functions per sequence, so that calls meet the same caches often.
        self.cases = [ZOO[i] for i in chosen]
        self.classes = {case.name: case.make() for case in self.cases}
        self.calls: list[str] = []

    @rule(
        case_index=st.integers(0, len(ZOO) - 1),
        transform_index=st.integers(0, len(TRANSFORMS) - 1),
        argmask=st.integers(1, 3),
        outmask=st.integers(1, 3),
        size=st.sampled_from([2, 3]),
        static_index=st.integers(0, 63),
        seed=st.integers(0, 2**16),
    )
    def call(self, case_index, transform_index, argmask, outmask, size, static_index, seed):
        case = self.cases[case_index % len(self.cases)]
        call = plan(case, transform_index, argmask, outmask, size, static_index)
        self.calls.append(str(call))
        static_args, static_kwargs = call.statics
        cls = self.classes[case.name]

        def function(*a: Any) -> Any:
            return cls.apply(*a, *static_args, **static_kwargs)

        def reference(*a: Any) -> Any:
            return case.math(*a, *static_args, **static_kwargs)

        args = inputs(case, call.size, seed)
        expected = run(call.transform, reference, args, call.argnums, call.outputs, seed)
        got = run(call.transform, function, args, call.argnums, call.outputs, seed)
        close(got, expected, "calls so far:\n  " + "\n  ".join(self.calls))


CallSequence.TestCase.settings = settings(
    max_examples=500 if THOROUGH else max(4, settings.default.max_examples // 15),
    stateful_step_count=10,
    deadline=None,
    derandomize=not THOROUGH,
    # The failing sequence is printed in full; shrinking it costs minutes of compiles.
    phases=[Phase.explicit, Phase.reuse, Phase.generate],
    suppress_health_check=list(settings.default.suppress_health_check),
)
TestCallSequence = CallSequence.TestCase


# ---------------------------------------------------------------------------
# The sequences outside testing found, as plain regression tests.

X = np.array([0.5, -1.0])  # NumPy: float64 once the fixture turns x64 on
W = np.array([1.5, 0.3])


def sin_sum(*outputs: Any) -> Any:
    return sum(jnp.sin(o).sum() for o in outputs)


def test_eager_gradient_after_a_gradient_of_fewer_inputs_differentiates_every_input():
    F = make_two_outputs()
    both = lambda x, w: sin_sum(*F.apply(x, w))  # noqa: E731
    plain = lambda x, w: sin_sum(*_two_outputs(x, w))  # noqa: E731
    close(jax.grad(lambda x, w: sin_sum(F.apply(x, w)[0]), (0, 1))(X, W),
          jax.grad(lambda x, w: sin_sum(_two_outputs(x, w)[0]), (0, 1))(X, W))
    close(jax.grad(both, 0)(X, W), jax.grad(plain, 0)(X, W))
    close(jax.grad(both, (0, 1))(X, W), jax.grad(plain, (0, 1))(X, W))


def test_eager_gradient_of_one_output_after_gradients_of_others_is_not_zero():
    F = make_two_outputs()
    for output, argnums in ((1, 0), (0, 1), (0, 0)):
        got = jax.grad(lambda x, w, output=output: sin_sum(F.apply(x, w)[output]), argnums)(X, W)
        expected = jax.grad(lambda x, w, output=output: sin_sum(_two_outputs(x, w)[output]), argnums)(X, W)
        close(got, expected, f"output {output}, argnums {argnums}")


def test_eager_gradient_with_none_for_inputs_not_needed_after_other_patterns():
    F = make_skips()
    for output, argnums in ((1, (0, 1)), (1, 0), (0, (0, 1))):
        got = jax.grad(lambda x, w, output=output: sin_sum(F.apply(x, w)[output]), argnums)(X, W)
        expected = jax.grad(lambda x, w, output=output: sin_sum(_skips(x, w)[output]), argnums)(X, W)
        close(got, expected, f"output {output}, argnums {argnums}")


def test_jitted_apply_differentiated_by_several_argnums_eagerly():
    F = make_skips()
    applied = jax.jit(F.apply)
    for argnums in ((0, 1), 0, 1, (0, 1)):
        got = jax.grad(lambda x, w: sin_sum(*applied(x, w)), argnums)(X, W)
        expected = jax.grad(lambda x, w: sin_sum(*_skips(x, w)), argnums)(X, W)
        close(got, expected, f"argnums {argnums}")


@pytest.mark.parametrize("container", [
    pytest.param(Cfg, id="frozen_dataclass"),
    pytest.param(lambda k: frozenset([k]), id="frozenset"),
    pytest.param(lambda k: (k,), id="tuple"),
    pytest.param(lambda k: [k], id="list"),
    pytest.param(lambda k: {"k": k}, id="dict"),
    pytest.param(Pair, id="namedtuple"),
])
def test_statics_equal_in_python_but_of_other_types_or_bits_get_their_own_program_in_a_container(container):
    F = make_configured()
    values = (True, 1, 1.0, 0.0, -0.0)
    got = [float(F.apply(jnp.asarray(math.pi / 2), container(k))) for k in values]
    np.testing.assert_allclose(got, [factor(k) for k in values], rtol=1e-12)
    assert [factor(k) for k in values] == [3.0, 6.0, 8.0, 7.0, 7.5]


def test_dict_keys_are_keyed_by_type():
    class ByKey(vjpkit.Function):
        @staticmethod
        def forward(ctx, x, table):
            (key,) = table
            return x * factor(key)

        @staticmethod
        def backward(ctx, g):
            return g, None

    got = [float(ByKey.apply(jnp.asarray(1.0), {k: "v"})) for k in (True, 1, 1.0)]
    np.testing.assert_allclose(got, [3.0, 6.0, 8.0])


def _zeros_with_jvp():
    class Zeros(ZerosNoRules):
        @staticmethod
        def jvp(ctx, t):
            return t

    @jax.custom_jvp
    def zeros(x):
        return jnp.zeros(x.shape, x.dtype)

    zeros.defjvp(lambda primals, tangents: (zeros(*primals), tangents[0]))
    return Zeros, zeros


def test_output_not_depending_on_the_batch_is_differentiated_once_per_example():
    Zeros, zeros = _zeros_with_jvp()
    x = jnp.arange(3.0)
    expected = jax.grad(lambda x: jax.vmap(zeros)(x).sum())(x)
    close(jax.grad(lambda x: jax.vmap(Zeros.apply)(x).sum())(x), expected)
    close(expected, jnp.ones(3))


def test_jvp_of_vmap_of_an_output_not_depending_on_the_batch_keeps_its_shape():
    Zeros, zeros = _zeros_with_jvp()
    x, t = jnp.arange(3.0), jnp.ones(3)
    close(jax.jvp(jax.vmap(Zeros.apply), (x,), (t,)), jax.jvp(jax.vmap(zeros), (x,), (t,)))


def _twice_y():
    class TwiceY(vjpkit.Function):
        @staticmethod
        def forward(ctx, x, y):
            return 2.0 * y

        @staticmethod
        def backward(ctx, g):
            return None, 2.0 * g

    @jax.custom_vjp
    def twice_y(x, y):
        return 2.0 * y

    twice_y.defvjp(lambda x, y: (2.0 * y, None), lambda _, g: (jnp.zeros_like(g), 2.0 * g))
    return TwiceY, twice_y


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_unbatched_output_of_vmap_with_out_axes_none_differentiates_like_custom_vjp(jit):
    TwiceY, twice_y = _twice_y()
    xs, y = jnp.arange(5.0).reshape(5, 1), jnp.ones(1)

    def loss(f):
        g = lambda y: jax.vmap(f, (0, None), out_axes=None)(xs, y).sum()  # noqa: E731
        return jax.jit(jax.grad(g)) if jit else jax.grad(g)

    close(loss(TwiceY.apply)(y), loss(twice_y)(y))
    close(loss(twice_y)(y), jnp.array([2.0]))


def test_vjp_of_vmap_with_out_axes_none_keeps_the_unbatched_primal():
    TwiceY, twice_y = _twice_y()
    xs, y = jnp.arange(5.0).reshape(5, 1), jnp.ones(1)
    primal, pullback = jax.vjp(lambda y: jax.vmap(TwiceY.apply, (0, None), out_axes=None)(xs, y), y)
    expected, expected_pullback = jax.vjp(lambda y: jax.vmap(twice_y, (0, None), out_axes=None)(xs, y), y)
    close(primal, expected)
    close(pullback(jnp.ones(1)), expected_pullback(jnp.ones(1)))
