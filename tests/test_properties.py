"""Property-based: random programs built from vjpkit Functions agree with JAX
autodiff of the same math written in plain ``jnp``, under random stacks of
transformations, shapes and dtypes.

Each generated example is a *program*: a chain of 1 to 4 stages, each a
vjpkit Function with a known derivative (elementwise ops saving their input,
their output or a ctx attribute; elementwise ops computing their output
under ``stop_gradient``, whose higher orders must follow their own rules;
a broadcasting product; matrix-vector; a reduction with a static axis; a static scalar passed by keyword or
position; an optional argument; a pytree argument; an integer index
argument; forward-mode Functions with ``jvp``), applied to inputs of a random
shape (scalars, zero-size, broadcastable partners) and dtype (float32 with
loose tolerances, float64 with tight ones), then one transformation stack
(``grad``, ``value_and_grad``, ``vmap`` of ``grad``, ``jacrev``,
``hessian``, ``lax.scan``, ``checkpoint``, ``jvp``/``jacfwd`` when every
stage has a ``jvp``), with or without an outer ``jit``. The same program is
also written with ``jnp`` only; both must give the same numbers.

Profiles (``tests/conftest.py``): 50 examples of the main property in a plain
``pytest``, 150 in CI (``CI=true``), and at least 10,000 with
``VJPKIT_HYPOTHESIS_PROFILE=thorough``. The Function classes are
module-level and shapes come from a small set, so compiled programs are reused across examples (JAX compile time
dominates the cost of an example).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from typing import Any, Callable

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from functions import (  # sin, exp (also under stop_gradient), a broadcasting product, a static scale
    Exp,
    Mul,
    MulWithJvp,
    Scale,
    Sin,
    SinWithJvp,
    StoppedExp,
    StoppedExpWithJvp,
)
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import vjpkit

# jax.enable_x64 or its older home. Not the x64 fixture:
# A scope per generated example (its dtype): a fixture cannot vary within a hypothesis test.
from vjpkit._jax_internals import enable_x64

# ---------------------------------------------------------------------------
# The Functions, each with a known derivative.


class Square(vjpkit.Function):
    """Carries its input as a ctx attribute, not through save_for_backward."""

    @staticmethod
    def forward(ctx, x):
        ctx.x = x
        return x * x

    @staticmethod
    def backward(ctx, g):
        return 2 * ctx.x * g


class Affine(vjpkit.Function):
    """An optional argument: ``b`` may be None."""

    @staticmethod
    def forward(ctx, x, w, b=None):
        ctx.save_for_backward(x, w)
        ctx.has_b = b is not None
        y = x * w
        return y if b is None else y + b

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        gx = g * w if ctx.needs_input_grad[0] else None
        gw = g * x if ctx.needs_input_grad[1] else None
        return gx, gw, (g if ctx.has_b else None)


class Tree(vjpkit.Function):
    """A pytree argument: a dict of arrays, and its gradient of the same structure."""

    @staticmethod
    def forward(ctx, params, x):
        y = jnp.tanh(params["w"] * x + params["b"])
        ctx.save_for_backward(params["w"], x, y)
        return y

    @staticmethod
    def backward(ctx, g):
        w, x, y = ctx.saved_tensors
        d = g * (1 - y * y)
        return {"w": d * x, "b": d}, d * w


class Take(vjpkit.Function):
    """An integer index argument: not differentiated, its gradient slot is None."""

    @staticmethod
    def forward(ctx, x, idx):
        ctx.save_for_backward(idx)
        ctx.shape = x.shape
        return x.reshape(-1)[idx]

    @staticmethod
    def backward(ctx, g):
        (idx,) = ctx.saved_tensors
        flat = jnp.zeros(int(np.prod(ctx.shape)), g.dtype).at[idx].add(g)
        return flat.reshape(ctx.shape), None


class MatVec(vjpkit.Function):
    @staticmethod
    def forward(ctx, a, v):
        ctx.save_for_backward(a, v)
        return a @ v

    @staticmethod
    def backward(ctx, g):
        a, v = ctx.saved_tensors
        return jnp.outer(g, v), a.T @ g


class Sum(vjpkit.Function):
    """A reduction over a static axis (None: all axes)."""

    @staticmethod
    def forward(ctx, x, *, axis=None):
        ctx.shape, ctx.axis = x.shape, axis
        return jnp.sum(x, axis=axis)

    @staticmethod
    def backward(ctx, g):
        if ctx.axis is not None:
            g = jnp.expand_dims(g, ctx.axis)
        return jnp.broadcast_to(g, ctx.shape), None


class CubeJ(vjpkit.Function):
    """Only jvp: reverse mode transposes it."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_forward(x)
        return x * x * x

    @staticmethod
    def jvp(ctx, t):
        (x,) = ctx.saved_tensors
        return 3 * x * x * t


# ---------------------------------------------------------------------------
# Programs: chains of stages, written twice (vjpkit and plain jnp).


@dataclasses.dataclass(frozen=True)
class Stage:
    """One step of a program. ``params`` are the shapes of the extra float inputs it takes."""

    op: str
    params: tuple = ()  # shapes of extra float inputs (float leaves of a pytree for "tree")
    static: Any = None  # the static scalar, axis, or "has b"
    keyword: bool = False  # pass the static scalar by keyword
    index: tuple = ()  # the integer indices of "take"


FORWARD_MODE_OPS = {"sinj", "cubej", "mulj", "stoppedexpj"}


def run_stage(stage: Stage, h: Any, extra: list, ints: list, lib: dict) -> Any:
    """The stage with vjpkit Functions (``lib``), or, with ``lib=None``, plain jnp."""
    op, plain = stage.op, lib is None
    if op in ("sin", "sinj"):
        return jnp.sin(h) if plain else lib[op].apply(h)
    if op in ("exp", "stoppedexp", "stoppedexpj"):
        return jnp.exp(h) if plain else lib[op].apply(h)
    if op == "square":
        return h * h if plain else lib[op].apply(h)
    if op == "cubej":
        return h ** 3 if plain else lib[op].apply(h)
    if op in ("mul", "mulj"):
        (w,) = extra
        return h * w if plain else lib[op].apply(h, w)
    if op == "scale":
        c = stage.static
        if plain:
            return c * h
        return lib[op].apply(h, c=c) if stage.keyword else lib[op].apply(h, c)
    if op == "affine":
        w, *b = extra
        if plain:
            return h * w + b[0] if b else h * w
        return lib[op].apply(h, w, b=b[0]) if b else lib[op].apply(h, w)
    if op == "tree":
        w, b = extra
        if plain:
            return jnp.tanh(w * h + b)
        return lib[op].apply({"w": w, "b": b}, h)
    if op == "take":
        (idx,) = ints
        return h.reshape(-1)[idx] if plain else lib[op].apply(h, idx)
    if op == "matvec":
        (a,) = extra
        v = h.reshape(-1)
        return a @ v if plain else lib[op].apply(a, v)
    if op == "sum":
        return jnp.sum(h, axis=stage.static) if plain else lib[op].apply(h, axis=stage.static)
    raise AssertionError(op)


LIBRARY = {
    "sin": Sin, "exp": Exp, "square": Square, "mul": Mul, "scale": Scale,
    "affine": Affine, "tree": Tree, "take": Take, "matvec": MatVec, "sum": Sum,
    "sinj": SinWithJvp, "cubej": CubeJ, "mulj": MulWithJvp, "stoppedexp": StoppedExp,
    "stoppedexpj": StoppedExpWithJvp,
}


@dataclasses.dataclass(frozen=True)
class Program:
    shape: tuple
    stages: tuple

    @property
    def forward_mode(self) -> bool:
        return all(s.op in FORWARD_MODE_OPS for s in self.stages)

    def float_shapes(self) -> list[tuple]:
        return [self.shape] + [p for s in self.stages for p in s.params]

    def int_values(self) -> list[np.ndarray]:
        return [np.asarray(s.index, np.int32) for s in self.stages if s.op == "take"]

    def output(self, floats: list, ints: list, lib: dict | None) -> Any:
        """The program's array output, from its float inputs (x first) and integer inputs."""
        h, rest, ints = floats[0], list(floats[1:]), list(ints)
        for s in self.stages:
            extra = [rest.pop(0) for _ in s.params]
            idx = [ints.pop(0)] if s.op == "take" else []
            h = run_stage(s, h, extra, idx, lib)
        return h

    def loss(self, floats: list, ints: list, lib: dict | None) -> Any:
        """A scalar with non-trivial second derivatives."""
        return jnp.sum(jnp.sin(self.output(floats, ints, lib)))


# ---------------------------------------------------------------------------
# Transformation stacks.

TRANSFORMS = ("value", "grad", "value_and_grad", "vmap_grad", "jacrev", "hessian", "scan", "checkpoint")
FORWARD_TRANSFORMS = ("jvp", "jacfwd", "hessian_jvp")


def transformed(program: Program, transform: str, jit: bool, lib: dict | None) -> Callable:
    """``(floats, ints) -> result`` for one transformation stack, cached per stack."""
    return _transformed(program, transform, jit, None if lib is None else tuple(sorted(lib.items())))


@functools.lru_cache(maxsize=256)
def _transformed(program: Program, transform: str, jit: bool, lib_items: tuple | None) -> Callable:
    lib = None if lib_items is None else dict(lib_items)
    out = functools.partial(program.output, lib=lib)
    loss = functools.partial(program.loss, lib=lib)

    if transform == "value":
        fn = out
    elif transform == "grad":
        fn = jax.grad(loss)
    elif transform == "value_and_grad":
        fn = jax.value_and_grad(loss)
    elif transform == "vmap_grad":
        # Per-example gradients with respect to x, over a batch of two x's.
        def fn(floats, ints):
            per_x = jax.grad(lambda x, rest: loss([x, *rest], ints))
            xs = jnp.stack([floats[0], 0.5 * floats[0]])
            return jax.vmap(per_x, in_axes=(0, None))(xs, floats[1:])
    elif transform == "jacrev":
        fn = jax.jacrev(out)
    elif transform in ("hessian", "hessian_jvp"):
        def fn(floats, ints):
            return jax.hessian(lambda x: loss([x, *floats[1:]], ints))(floats[0])
    elif transform == "scan":
        # A scan body calling the program; value and gradient of the total.
        def fn(floats, ints):
            def total(fs):
                def body(carry, s):
                    return carry + loss([fs[0] * s, *fs[1:]], ints), None

                scales = jnp.array([1.0, -0.5], fs[0].dtype)
                return jax.lax.scan(body, jnp.zeros((), fs[0].dtype), scales)[0]

            return jax.value_and_grad(total)(floats)
    elif transform == "checkpoint":
        fn = jax.grad(jax.checkpoint(loss))
    elif transform == "jvp":
        def fn(floats, ints):
            tangents = [jnp.cos(3.0 * f) for f in floats]
            return jax.jvp(lambda fs: out(fs, ints), (floats,), (tangents,))
    elif transform == "jacfwd":
        fn = jax.jacfwd(out)
    else:
        raise AssertionError(transform)
    return jax.jit(fn) if jit else fn


# ---------------------------------------------------------------------------
# Strategies.

SHAPES = [(), (1,), (3,), (2, 3), (0,), (2, 0)]


def broadcast_partner(shape: tuple, draw: Callable) -> tuple:
    """A shape that broadcasts with ``shape``: a suffix with some 1s, maybe one new leading axis."""
    keep = draw(st.integers(0, len(shape)))
    suffix = tuple(1 if draw(st.booleans()) else d for d in shape[len(shape) - keep:])
    lead = (2,) if keep == len(shape) < 2 and draw(st.booleans()) else ()
    return lead + suffix


@st.composite
def stages(draw, shape: tuple, forward_mode: bool) -> tuple[Stage, tuple]:
    """One stage for an input of ``shape``, and its output shape."""
    size = int(np.prod(shape))
    if forward_mode:
        ops = ["sinj", "cubej", "mulj", "stoppedexpj"]
    else:
        ops = ["sin", "exp", "stoppedexp", "square", "mul", "scale", "affine", "tree", "matvec", "sum"]
        if size:
            ops.append("take")
    op = draw(st.sampled_from(ops))
    if op in ("sin", "sinj", "exp", "stoppedexp", "stoppedexpj", "square", "cubej"):
        return Stage(op), shape
    if op in ("mul", "mulj"):
        w = broadcast_partner(shape, draw)
        return Stage(op, (w,)), np.broadcast_shapes(shape, w)
    if op == "scale":
        c = draw(st.sampled_from([0.5, -1.5, 3.0]))
        return Stage(op, static=c, keyword=draw(st.booleans())), shape
    if op == "affine":
        has_b = draw(st.booleans())
        return Stage(op, (shape, shape) if has_b else (shape,), static=has_b), shape
    if op == "tree":
        return Stage(op, (shape, shape)), shape
    if op == "take":
        k = draw(st.integers(1, 3))
        index = tuple(draw(st.lists(st.integers(0, size - 1), min_size=k, max_size=k)))
        return Stage(op, index=index), (k,)
    if op == "matvec":
        m = draw(st.sampled_from([1, 2]))
        return Stage(op, ((m, size),)), (m,)
    if op == "sum":
        axis = draw(st.sampled_from([None, *range(len(shape))]))
        out = () if axis is None else shape[:axis] + shape[axis + 1:]
        return Stage(op, static=axis), out
    raise AssertionError(op)


@st.composite
def programs(draw, forward_mode: bool | None = None) -> Program:
    if forward_mode is None:
        forward_mode = draw(st.integers(0, 3)) == 0  # a quarter of programs: all-jvp stages
    shape = draw(st.sampled_from(SHAPES))
    n = draw(st.integers(1, 3 if forward_mode else 4))
    out, chain = shape, []
    for _ in range(n):
        stage, out = draw(stages(out, forward_mode))
        chain.append(stage)
    return Program(shape, tuple(chain))


@st.composite
def cases(draw):
    program = draw(programs())
    options = TRANSFORMS + (FORWARD_TRANSFORMS if program.forward_mode else ())
    transform = draw(st.sampled_from(options))
    # Mostly under an outer jit: op-by-op transformations compile many small
    # programs, the largest cost of an example (both paths are covered).
    jit = draw(st.sampled_from([True, True, True, False]))
    dtype = draw(st.sampled_from(["float32", "float64"]))
    seed = draw(st.integers(0, 2**16))
    return program, transform, jit, dtype, seed


# ---------------------------------------------------------------------------
# The check.

TOLERANCES = {"float32": dict(rtol=2e-4, atol=2e-5), "float64": dict(rtol=1e-10, atol=1e-12)}


def inputs(program: Program, dtype: str, seed: int) -> tuple[list, list]:
    rng = np.random.default_rng(seed)
    floats = [jnp.asarray(rng.uniform(-1.0, 1.0, s).astype(dtype)) for s in program.float_shapes()]
    ints = [jnp.asarray(i) for i in program.int_values()]
    return floats, ints


_EXAMPLES = itertools.count(1)


def check(program: Program, transform: str, jit: bool, dtype: str, seed: int, lib: dict = LIBRARY,
          tolerances: dict | None = None) -> None:
    """vjpkit's result equals plain jnp's, both under the same transformation stack."""
    __tracebackhide__ = True
    if next(_EXAMPLES) % 1000 == 0:
        # JAX keeps every program it compiles (about 1.4 MB per example here);
        # long runs (the thorough profile) would grow without bound.
        _transformed.cache_clear()
        jax.clear_caches()
    with enable_x64(dtype == "float64"):
        floats, ints = inputs(program, dtype, seed)
        got = transformed(program, transform, jit, lib)(floats, ints)
        expected = transformed(program, transform, jit, None)(floats, ints)
        chex.assert_trees_all_equal_shapes_and_dtypes(got, expected)
        chex.assert_trees_all_close(got, expected, **(tolerances or TOLERANCES[dtype]))


# ---------------------------------------------------------------------------
# Properties.


@given(cases())
def test_random_program_matches_jax_autodiff(case):
    check(*case)


def _fraction(n: int) -> settings:
    """A smaller share of the profile's examples, for the focused properties."""
    return settings(max_examples=max(5, settings.default.max_examples // n))


@_fraction(4)
@given(
    programs(forward_mode=True),
    st.sampled_from(FORWARD_TRANSFORMS + ("grad", "jacrev")),
    st.booleans(),
    st.integers(0, 2**16),
)
def test_forward_mode_programs_match_in_float64(program, transform, jit, seed):
    check(program, transform, jit, "float64", seed)


@_fraction(4)
@given(programs(forward_mode=False), st.sampled_from(["grad", "vmap_grad", "hessian"]), st.integers(0, 2**16))
def test_float64_gradients_match_tightly_under_jit(program, transform, seed):
    check(program, transform, True, "float64", seed)


# ---------------------------------------------------------------------------
# Mutation check: a backward off by a relative 1e-6 is caught.


class SinOff(Sin):
    """Sin with a backward off by a relative 1e-6: the kind of bug that still trains."""

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g * jnp.cos(x) * (1 + 1e-6)


MUTATED = {**LIBRARY, "sin": SinOff}
SIN_CHAIN = Program((3,), (Stage("sin"), Stage("mul", ((3,),))))


@pytest.mark.parametrize("transform", ["grad", "vmap_grad", "jacrev", "scan", "checkpoint", "hessian"])
def test_a_backward_off_by_one_part_in_a_million_is_caught_in_float64(transform):
    check(SIN_CHAIN, transform, False, "float64", 0)  # the real one passes
    with pytest.raises(AssertionError):
        check(SIN_CHAIN, transform, False, "float64", 0, lib=MUTATED)


def test_the_same_mutation_hides_in_float32_tolerances():
    # Why float64 examples exist: float32's tolerance cannot see 1e-6.
    check(SIN_CHAIN, "grad", False, "float32", 0, lib=MUTATED)


def test_the_mutation_is_caught_by_gradcheck_with_tight_tolerances():
    x = np.linspace(-1.0, 1.0, 5)
    assert vjpkit.gradcheck(Sin.apply, (x,), atol=1e-9, rtol=1e-8)
    with pytest.raises(vjpkit.GradcheckError, match="SinOff|Jacobian"):
        vjpkit.gradcheck(SinOff.apply, (x,), atol=1e-9, rtol=1e-8)


@pytest.mark.thorough  # the deterministic mutation tests above make the point in the default run
@_fraction(6)
@given(programs(forward_mode=False), st.integers(0, 2**16))
def test_random_programs_using_the_mutated_sin_are_caught(program, seed):
    # Any program whose gradient passes through sin at all must fail. With a
    # purely relative tolerance: a gradient below atol / 1e-6 in size (e.g.
    # sin(x)**8 near 0) hides a 1e-6 relative error inside atol.
    assume(np.prod(program.shape) > 0)
    program = Program(program.shape, (Stage("sin"), *program.stages))
    check(program, "grad", True, "float64", seed)
    with enable_x64(True):  # a chain of exps can overflow to inf, where any error hides
        gradient = transformed(program, "grad", True, None)(*inputs(program, "float64", seed))
    assume(all(np.all(np.isfinite(g)) for g in jax.tree_util.tree_leaves(gradient)))
    with pytest.raises(AssertionError):
        check(program, "grad", True, "float64", seed, lib=MUTATED, tolerances=dict(rtol=1e-10, atol=0.0))
