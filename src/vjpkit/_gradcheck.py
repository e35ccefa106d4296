"""Full-Jacobian gradient checks: ``gradcheck``, ``gradgradcheck``, ``GradcheckError``.

Usage::

    import numpy as np
    import vjpkit

    x = np.random.randn(20, 20)          # float64 inputs (NumPy, or JAX with x64)
    w = np.random.randn(30, 20)
    assert vjpkit.gradcheck(Linear.apply, (x, w), eps=1e-6, atol=1e-4)
    assert vjpkit.gradgradcheck(Linear.apply, (x, w))

``fn`` is any JAX function of arrays: a vjpkit Function's ``apply``, a
hand-written ``jax.custom_vjp``, or plain JAX code calling several of them.
``inputs`` is a tuple (or list) of positional arguments, or one argument;
arguments and outputs may be pytrees.

The key differences to ``torch.autograd.gradcheck`` are in speed and in the
report, not in what is checked:

- All one-hot output cotangents go through one ``vmap`` of the VJP, and all
  central-difference perturbations through one ``vmap`` of ``fn``, inside a
  single traced program that also compares the two Jacobians. The program
  is cached per (function, input signature, options), so a second check of
  the same function runs only that program.
- The first runs of that program are evaluated on the host, op by op with
  NumPy, without compiling it: XLA's CPU compiler spends about a
  millisecond per kernel, so a ``fn`` with a Python loop (which unrolls into
  thousands of equations) would take seconds to compile for a check that
  takes milliseconds to evaluate. Once the evaluations have cost as much
  as compiling is estimated to, the program is compiled and runs compiled
  from then on, so a check run thousands of times (hypothesis) pays the
  compile once. On an accelerator, and when ``fn`` calls back to the host,
  the program is compiled at once.
- The work runs in float64 with ``jax_enable_x64`` switched on for
  gradcheck's own calls only (JAX's thread-local context), whatever the
  process-wide setting. Float32 inputs are cast, with a warning.
- A failure names every mismatching (output, input) pair, with pytree paths,
  and the worst element of each.

The key difference to ``jax.test_util.check_grads`` is that the whole
Jacobian is compared, not one random direction, and that functions without
a forward mode (``jax.custom_vjp``) need no ``modes=("rev",)``.

Tips:

- Finite differences need smooth functions: keep inputs away from kinks
  (``relu`` at 0, ``abs`` at 0) by more than ``eps``.
- Integer arrays and non-array inputs (Python scalars, strings) are held
  fixed; pass ``jnp.asarray(c)`` to check the derivative with respect to a
  scalar.
- ``fast_mode=True`` compares random projections ``v^T J u`` only (cheap for
  large inputs); on failure it reruns the full check for the report.
- Complex leaves are checked as pairs of reals (``"real"``/``"imag"`` in
  reports), which tests JAX's convention for complex VJPs, not PyTorch's
  conjugate one.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import sys
import threading
import time
import types
import warnings
import weakref
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.core import jaxpr_as_fun

from . import _jax_internals
from ._caches import on_clear
from ._ctx import is_array
from ._numpy_eval import numpy_evaluator
from ._tree import Partition, partition, static_key

# Largest batch of perturbed inputs (or one-hot cotangents) vmapped at once,
# in bytes of float64 inputs plus outputs. Beyond it the batch is split into
# a lax.map of vmapped chunks, to bound memory. (Smaller, cache-sized chunks
# were no faster here, and a loop costs compile time.)
_BATCH_BYTES = 1 << 27
_CACHE_SIZE = 64
# Jacobians up to this many elements in all come back from the first program,
# ready for a report: a failed check then compiles no second program.
_REPORT_ELEMENTS = 1 << 16
# A checking program is compiled only once it has run often (see _Program), so
# its run time counts: without XLA's fusion emitters it compiles 1.3x faster and
# runs as fast (tutorial LinearFunction: 0.11 s, 4.4 ms a run, against 0.15 s,
# 4.8 ms by default); LLVM -O0 as well would compile 2.7x faster but run 3x slower
# (0.04 s, 13.4 ms).
_CPU_COMPILE_OPTIONS = {"xla_cpu_use_fusion_emitters": False}
_BATCHED_GRAD_SAMPLES = 3


class GradcheckError(RuntimeError):
    """A gradient check failed. The message is the full report.

    ``mismatches`` holds one :class:`JacobianMismatch` per (output, input)
    pair whose Jacobians disagree, for programmatic use (empty when the
    failure is of another kind, e.g. a backward that is not reentrant).
    """

    def __init__(self, message: str, mismatches: Sequence[JacobianMismatch] = ()):
        super().__init__(message)
        self.mismatches = tuple(mismatches)


@dataclasses.dataclass(frozen=True, eq=False)
class JacobianMismatch:
    """One (output, input) block of the Jacobian where the check failed.

    The Jacobians have PyTorch's layout: one row per element of the input,
    one column per element of the output (complex leaves count as pairs of
    real numbers, with a trailing ``"real"``/``"imag"`` index).
    """

    mode: str  # "backward" (the VJP) or "forward" (the JVP)
    output: str  # e.g. "output 0", or "output 1 ['mask']"
    input: str  # e.g. "input 1", or "input 0 ['w']"
    output_index: int  # position in fn's output tuple (0 for a non-tuple output)
    input_index: int  # position in the inputs tuple
    output_path: str  # pytree path inside that output ("" for an array)
    input_path: str
    output_element: tuple  # index of the worst element in the output leaf
    input_element: tuple  # index of the worst element in the input leaf
    numerical_value: float
    analytical_value: float
    abs_diff: float
    rel_diff: float
    mismatched: int  # how many elements of the block are out of tolerance
    numerical: np.ndarray  # (input elements, output elements)
    analytical: np.ndarray


# ---------------------------------------------------------------------------
# Public entry points.


def gradcheck(
    fn: Callable[..., Any],
    inputs: Any,
    *,
    eps: float = 1e-6,
    atol: float = 1e-5,
    rtol: float = 1e-3,
    raise_exception: bool = True,
    fast_mode: bool = False,
    nondet_tol: float = 0.0,
    check_undefined_grad: bool = True,
    check_batched_grad: bool = False,
    check_forward_ad: bool = False,
    check_backward_ad: bool = True,
) -> bool:
    """Compares ``fn``'s derivatives with central finite differences.

    Usage::

        x, w = np.random.randn(20, 20), np.random.randn(30, 20)
        vjpkit.gradcheck(Linear.apply, (x, w), eps=1e-6, atol=1e-4)

    For every (differentiable output, differentiable input) pair, the
    analytical Jacobian (from ``jax.vjp``, and from ``jax.jvp`` with
    ``check_forward_ad``) must satisfy, element by element,
    ``|analytical - numerical| <= atol + rtol * |numerical|`` where
    ``numerical = (fn(x + eps) - fn(x - eps)) / (2 * eps)``.

    Args:
        fn: a function of arrays returning an array, a tuple of arrays or any
            pytree. Integer/bool outputs and non-array outputs are not checked.
        inputs: a tuple (or list) of positional arguments for ``fn``, or a
            single argument. Floating and complex array leaves are perturbed;
            other leaves are held fixed.
        eps: finite-difference step.
        atol, rtol: tolerances, as in ``numpy.allclose(analytical, numerical)``.
        raise_exception: raise :class:`GradcheckError` on failure (default),
            or return False.
        fast_mode: compare ``v^T J u`` for random ``u, v`` instead of the
            whole Jacobian (PyTorch's fast mode); a failure reruns the full
            check to report the mismatching elements.
        nondet_tol: how far two runs of the backward may differ. The
            backward is rerun only when it could differ at all: when the
            program calls back to the host, or runs on an accelerator (XLA's
            CPU programs are deterministic).
        check_undefined_grad: check that the backward copes with absent
            output gradients: each output is used alone, so the others'
            gradients are undefined (``None`` in a vjpkit Function with
            ``ctx.set_materialize_grads(False)``) and must act as zeros.
        check_batched_grad: check that ``vmap`` of the VJP over output
            gradients equals a Python loop of VJPs.
        check_forward_ad: also compare the Jacobian from ``jax.jvp``. Skipped,
            with a warning, when ``fn`` has no forward mode (a ``custom_vjp``
            or a vjpkit Function without ``jvp``).
        check_backward_ad: compare the Jacobian from ``jax.vjp``.

    Returns:
        True when every check passes; False on failure when
        ``raise_exception=False``.

    Raises:
        GradcheckError: a check failed (with ``raise_exception=True``).
        ValueError: contradictory options, or no floating-point input.
    """
    options = _Options(
        fast_mode=bool(fast_mode),
        check_undefined_grad=bool(check_undefined_grad),
        check_batched_grad=bool(check_batched_grad),
        check_forward_ad=bool(check_forward_ad),
        check_backward_ad=bool(check_backward_ad),
    )
    tolerances = _Tolerances(float(eps), float(atol), float(rtol), float(nondet_tol))
    return _run(fn, _as_args(inputs), options, tolerances, _NAMING, raise_exception)


def gradgradcheck(
    fn: Callable[..., Any],
    inputs: Any,
    grad_outputs: Any = None,
    *,
    eps: float = 1e-6,
    atol: float = 1e-5,
    rtol: float = 1e-3,
    raise_exception: bool = True,
    fast_mode: bool = False,
    nondet_tol: float = 0.0,
    check_undefined_grad: bool = True,
    check_batched_grad: bool = False,
    check_forward_ad: bool = False,
    check_backward_ad: bool = True,
) -> bool:
    """Checks second derivatives: ``gradcheck`` of ``fn``'s VJP.

    Usage::

        vjpkit.gradgradcheck(Exp.apply, (np.random.randn(5),))

    The checked function maps ``(*inputs, *grad_outputs)`` to the
    gradients of ``fn``'s differentiable inputs, ``jax.vjp(fn, *inputs)``
    pulled back along ``grad_outputs``; it is differentiated with respect
    to both. This exercises differentiating through ``backward`` (which
    ``once_differentiable`` forbids).

    Args:
        fn, inputs: as for :func:`gradcheck`.
        grad_outputs: one cotangent per differentiable output leaf of ``fn``
            (in ``jax.tree_util.tree_leaves`` order), as a tuple or a single
            array. Default: seeded uniform(-1, 1) float64 values.
        eps, atol, rtol, raise_exception, fast_mode, nondet_tol,
        check_undefined_grad, check_batched_grad, check_forward_ad,
        check_backward_ad: as for :func:`gradcheck`, applied to the VJP
            function (``check_forward_ad`` checks forward-over-reverse).

    Returns:
        True when the check passes; False on failure when
        ``raise_exception=False``.
    """
    options = _Options(
        fast_mode=bool(fast_mode),
        check_undefined_grad=bool(check_undefined_grad),
        check_batched_grad=bool(check_batched_grad),
        check_forward_ad=bool(check_forward_ad),
        check_backward_ad=bool(check_backward_ad),
    )
    tolerances = _Tolerances(float(eps), float(atol), float(rtol), float(nondet_tol))
    args = _as_args(inputs)
    with _jax_internals.enable_x64(True):
        outputs = _output_ports(fn, args)
    if grad_outputs is None:
        rng = np.random.default_rng(0)
        cotangents = tuple(
            rng.uniform(-1.0, 1.0, p.shape) + 1j * rng.uniform(-1.0, 1.0, p.shape)
            if p.is_complex
            else rng.uniform(-1.0, 1.0, p.shape)
            for p in outputs
        )
    else:
        cotangents = _as_args(grad_outputs)
        _check_grad_outputs(cotangents, outputs)
    vjp_fn = _VJPOf(fn, len(args))
    naming = _Naming(n_args=len(args))
    return _run(vjp_fn, args + cotangents, options, tolerances, naming, raise_exception)


# ---------------------------------------------------------------------------
# Options and names.


class _Options(NamedTuple):
    """What to check. Part of the compile-cache key (each changes the program)."""

    fast_mode: bool
    check_undefined_grad: bool
    check_batched_grad: bool
    check_forward_ad: bool
    check_backward_ad: bool


class _Tolerances(NamedTuple):
    """Numbers the compiled program takes as arguments (no recompile when they change)."""

    eps: float
    atol: float
    rtol: float
    nondet_tol: float


class _Naming(NamedTuple):
    """How reports name inputs and outputs: gradgradcheck renames both."""

    n_args: int | None = None  # set by gradgradcheck: inputs past it are grad_outputs

    def input(self, index: int, path: str) -> str:
        if self.n_args is not None and index >= self.n_args:
            return _join(f"grad_outputs[{index - self.n_args}]", path)
        return _join(f"input {index}", path)

    def output(self, index: int, path: str) -> str:
        if self.n_args is not None:
            return _join(f"the gradient of input {index}", path)
        return _join(f"output {index}", path)


_NAMING = _Naming()


def _join(name: str, path: str) -> str:
    return f"{name} {path}" if path else name


def _validate(options: _Options, tolerances: _Tolerances) -> None:
    if not (options.check_forward_ad or options.check_backward_ad):
        raise ValueError(
            "gradcheck: expected at least one of check_forward_ad or check_backward_ad "
            "to be True; with both False there is nothing to check."
        )
    if options.check_batched_grad and not options.check_backward_ad:
        raise ValueError(
            "gradcheck: check_batched_grad=True checks vmap of the VJP, so it requires "
            "check_backward_ad=True."
        )
    if not tolerances.eps > 0:
        raise ValueError(f"gradcheck: eps must be positive, got {tolerances.eps}.")
    for name in ("atol", "rtol", "nondet_tol"):
        value = getattr(tolerances, name)
        if not value >= 0:
            raise ValueError(f"gradcheck: {name} must be non-negative, got {value}.")


def _as_args(inputs: Any) -> tuple:
    """PyTorch's rule: a tuple or list is the positional arguments, anything else one argument."""
    if isinstance(inputs, tuple):
        return inputs
    if isinstance(inputs, list):
        return tuple(inputs)
    return (inputs,)


def _as_outputs(out: Any) -> tuple:
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


def _differentiable_outputs(out: Any) -> list[tuple[tuple, jax.Array]]:
    """(key path, leaf) of fn's output leaves that are checked: floating and complex arrays.

    A tuple (or list) output is PyTorch's several outputs; anything else is output 0.
    """
    return [
        (path, jnp.asarray(leaf))
        for path, leaf in jax.tree_util.tree_flatten_with_path(_as_outputs(out))[0]
        if is_array(leaf) and _is_inexact(leaf)
    ]


# ---------------------------------------------------------------------------
# The inputs: perturbed, fixed and static leaves (the split of _tree.py).


def _is_inexact(x: Any) -> bool:
    return jnp.issubdtype(x.dtype, jnp.inexact)


class _Inputs(NamedTuple):
    """The leaves of the arguments: arrays apart from static leaves, and which arrays are perturbed.

    gradcheck perturbs floating and complex arrays only. Integer and bool
    arrays are passed to the compiled program but held fixed; every other
    leaf (Python scalars, strings, callables) is closed over as static data
    and is part of the cache key, as vjpkit's own argument split does.
    """

    layout: Partition  # array leaves (dynamic) apart from static ones
    perturbed: tuple  # per array leaf: perturbed (floating or complex) or held fixed
    sites: tuple  # per array leaf: (argument index, pytree path)

    @property
    def key(self) -> tuple:
        return (self.layout.key, self.perturbed)

    def merge(self, diff: Sequence, fixed: Sequence) -> tuple:
        """The arguments, with ``diff`` and ``fixed`` in place of those leaves."""
        it_diff, it_fixed = iter(diff), iter(fixed)
        return self.layout.combine([next(it_diff) if p else next(it_fixed) for p in self.perturbed])

    def diff_sites(self) -> list[tuple[int, str]]:
        """(argument index, pytree path) of each perturbed leaf."""
        return [site for site, p in zip(self.sites, self.perturbed, strict=True) if p]


def _split(args: tuple) -> tuple[_Inputs, list, list]:
    layout, arrays = partition(args, is_array)
    perturbed = tuple(_is_inexact(a) for a in arrays)
    paths = [path for path, _ in jax.tree_util.tree_flatten_with_path(args)[0]]
    sites = tuple(_site(paths[i]) for i in layout.dynamic)
    diff = [a for a, p in zip(arrays, perturbed, strict=True) if p]
    fixed = [a for a, p in zip(arrays, perturbed, strict=True) if not p]
    return _Inputs(layout, perturbed, sites), diff, fixed


def _site(path: tuple) -> tuple[int, str]:
    """A key path inside a tuple as (position in the tuple, rest of the path)."""
    return path[0].idx, jax.tree_util.keystr(tuple(path[1:]))


# ---------------------------------------------------------------------------
# Complex leaves are checked as pairs of reals: JAX's own convention for the
# VJP of a complex function is the transpose of its real-linear derivative.


def _real_view(x: jax.Array) -> jax.Array:
    if jnp.iscomplexobj(x):
        return jnp.stack([x.real, x.imag], axis=-1).astype(jnp.float64)
    return x.astype(jnp.float64)


def _from_real_view(x: jax.Array, is_complex: bool) -> jax.Array:
    return lax.complex(x[..., 0], x[..., 1]) if is_complex else x


class _Port(NamedTuple):
    """A differentiable input or output leaf, as the report names it."""

    index: int  # type: ignore[assignment]  # the argument's position, shadowing tuple.index
    path: str
    shape: tuple  # the leaf's own shape
    dtype: Any
    is_complex: bool


# ---------------------------------------------------------------------------
# Building blocks of the checking program (all run while it is traced).


def _size(a: Any) -> int:
    return int(np.prod(a.shape, dtype=np.int64))


def _rows(a: jax.Array) -> jax.Array:
    """A batch of arrays as a matrix, one row per batch member (zero-size safe)."""
    return a.reshape(a.shape[0], int(np.prod(a.shape[1:], dtype=np.int64)))


def _replace(x: tuple, k: int, value: Any) -> tuple:
    return x[:k] + (value,) + x[k + 1 :]


def _one_hot(i: jax.Array, shape: tuple) -> jax.Array:
    return (jnp.arange(int(np.prod(shape, dtype=np.int64))) == i).astype(jnp.float64).reshape(shape)


def _probe(shape: tuple, salt: int) -> jax.Array:
    """Deterministic dense values in [-1, 1): a Weyl sequence, so no PRNG ops to compile."""
    i = jnp.arange(1, int(np.prod(shape, dtype=np.int64)) + 1, dtype=jnp.float64)
    return (2.0 * ((i * 0.6180339887498949 + salt * 0.7548776662466927) % 1.0) - 1.0).reshape(shape)


class _Notes:
    """What tracing the program learned; read when interpreting its results."""

    def __init__(self) -> None:
        self.outputs: list[_Port] = []
        self.reset()

    def reset(self) -> None:
        """Called as each trace starts: what the trace records is per trace."""
        self.rows: list[tuple[str, int, int]] = []  # (check, output, input) per summary row
        self.undefined_errors: dict[tuple[str, int], BaseException] = {}
        self.batched_errors: dict[int, BaseException] = {}
        self.sequential: list[tuple[str, BaseException]] = []

    def detach(self) -> None:
        """Drops the tracebacks of the recorded errors: the cache must not keep the user's frames."""
        for e in (*self.undefined_errors.values(), *self.batched_errors.values(), *(e for _, e in self.sequential)):
            _detached(e)


def _batched(f: Callable, xs: Any, n: int, per_item: int, notes: _Notes, where: str) -> Any:
    """``vmap(f)(xs)``, chunked when large, a sequential loop when ``f`` cannot be vmapped."""
    batch = max(1, _BATCH_BYTES // (8 * max(1, per_item)))
    try:
        return jax.vmap(f)(xs) if n <= batch else lax.map(f, xs, batch_size=batch)
    except Exception as vmap_error:  # e.g. a pure_callback without vmap_method
        try:
            out = lax.map(f, xs)
        except Exception as loop_error:
            raise loop_error from vmap_error
        notes.sequential.append((where, vmap_error))
        return out


def _evaluator(fn: Callable, split: _Inputs, inputs: list[_Port], notes: _Notes) -> Callable:
    """``fn`` as a function of the real views of the perturbed leaves.

    Returns the real views (float64) of fn's differentiable output leaves,
    and records which leaves those are in ``notes.outputs``.
    """

    def evaluate(x: tuple, fixed: tuple) -> tuple:
        diff = [_from_real_view(v, p.is_complex) for v, p in zip(x, inputs, strict=True)]
        outputs = _differentiable_outputs(fn(*split.merge(diff, fixed)))
        notes.outputs = [
            _Port(*_site(path), tuple(y.shape), y.dtype, jnp.iscomplexobj(y)) for path, y in outputs
        ]
        return tuple(_real_view(y) for _, y in outputs)

    return evaluate


def _central_differences(t: _Trace, k: int, index: jax.Array) -> list:
    """Numerical Jacobian columns ``index`` of input ``k``: one (len(index), m_j) block per output j.

    All ``2 len(index)`` perturbed inputs go through one (nested) ``vmap`` of
    ``f``: over the columns, and over the two signs of each column's step.
    """
    xk = t.x[k]

    def column(i: jax.Array) -> tuple:
        e = _one_hot(i, xk.shape)
        ys = _batched(lambda h: t.f(_replace(t.x, k, xk + h * e)), t.steps, 2, t.per_item, t.notes, "fn")
        return tuple(((y[0] - y[1]) * t.scale).reshape(-1) for y in ys)

    return list(_batched(column, index, index.shape[0], 2 * t.per_item, t.notes, "fn"))


def _compare_columns(t: _Trace, k: int, references: list[tuple[int, jax.Array]]) -> list[jax.Array]:
    """Central differences for input ``k``, compared with analytical Jacobian blocks.

    ``references`` holds ``(j, block)`` pairs, ``block`` being an (n_k, m_j)
    Jacobian to compare with output j's numerical one. The numerical
    Jacobian is never stored: the comparison fuses with the differences.
    Inputs too large for one ``vmap`` (``_BATCH_BYTES``) are done in chunks of
    columns. Returns one ``_failure`` per reference.
    """
    n = _size(t.x[k])
    if n == 0 or not references:
        return [jnp.bool_(False)] * len(references)
    b = max(1, min(n, _BATCH_BYTES // (2 * 8 * max(1, t.per_item))))
    if b == n:
        numerical = _central_differences(t, k, jnp.arange(n))
        return [_failure(block, numerical[j], t.atol, t.rtol) for j, block in references]
    n_chunks = -(-n // b)
    # The last chunk is padded with repeats of the last column: checked twice, harmlessly.
    chunks = jnp.minimum(jnp.arange(n_chunks * b), n - 1).reshape(n_chunks, b)

    def failures(index: jax.Array) -> jax.Array:
        numerical = _central_differences(t, k, index)
        return jnp.stack([_failure(block[index], numerical[j], t.atol, t.rtol) for j, block in references])

    return list(jnp.any(lax.map(failures, chunks), axis=0))


def _vjp_rows(t: _Trace, j: int) -> tuple:
    """Analytical Jacobian rows for output ``j``: one (m_j, n_k) block per input k.

    All ``m_j`` one-hot cotangents go through one ``vmap`` of the VJP; the
    other outputs' cotangents are explicit zeros (unbatched, so free).
    """
    m = _size(t.ys[j])
    zeros = tuple(jnp.zeros_like(y) for y in t.ys)

    def row(i: jax.Array) -> tuple:
        (g,) = t.pullback(_replace(zeros, j, _one_hot(i, t.ys[j].shape)))
        return tuple(gk.reshape(-1) for gk in g)

    return _batched(row, jnp.arange(m), m, t.per_item, t.notes, "the VJP")


def _jvp_columns(t: _Trace, k: int) -> list:
    """Forward-mode Jacobian columns for input ``k``: one (n_k, m_j) block per output j."""
    n = _size(t.x[k])
    zeros = tuple(jnp.zeros_like(v) for v in t.x)

    def column(i: jax.Array) -> tuple:
        return jax.jvp(t.f, (t.x,), (_replace(zeros, k, _one_hot(i, t.x[k].shape)),))[1]

    return [_rows(c) for c in _batched(column, jnp.arange(n), n, t.per_item, t.notes, "the JVP")]


def _failure(a: jax.Array, n: jax.Array, atol: Any, rtol: Any) -> jax.Array:
    """Whether ``allclose(a, n, rtol, atol)`` fails (NaN fails too).

    A boolean reduction, which XLA fuses with the comparison (and with the
    differences that produce ``n``): no Jacobian-sized array is stored.
    """
    return jnp.any(~(jnp.abs(a - n) <= atol + rtol * jnp.abs(n)))


def _mismatch_row(a: jax.Array, n: jax.Array, atol: Any, rtol: Any) -> jax.Array:
    """One summary row for a small comparison: [failed, max |a - n|, elements failing]."""
    diff = jnp.abs(a - n)
    failing = ~(diff <= atol + rtol * jnp.abs(n))
    worst = jnp.max(jnp.where(jnp.isnan(diff), jnp.inf, diff), initial=0.0)
    return jnp.stack([jnp.any(failing), worst, jnp.sum(failing)]).astype(jnp.float64)


class _Numbers(NamedTuple):
    """The checking program's numeric arguments: changing them does not recompile.

    The finite-difference steps and their scale come in ready-made, so the
    program computes no scalars of its own (each would be a kernel to compile).
    """

    steps: np.ndarray  # [eps, -eps]
    scale: float  # 1 / (2 eps)
    atol: float
    rtol: float

    @classmethod
    def of(cls, tol: _Tolerances) -> _Numbers:
        return cls(np.array([tol.eps, -tol.eps]), 1.0 / (2.0 * tol.eps), tol.atol, tol.rtol)


class _Trace:
    """What the pieces of one trace of the checking program share."""

    def __init__(self, f, x, options, notes, numbers, directions, report):
        self.f, self.x, self.options, self.notes = f, x, options, notes
        self.steps, self.scale, self.atol, self.rtol = numbers
        self.directions, self.report = directions, report
        self.pullback: Any  # None without check_backward_ad
        if options.check_backward_ad:
            self.ys, self.pullback = jax.vjp(f, x)
        else:
            self.ys, self.pullback = f(x), None
        # Elements of one batch member of a vmap (its inputs and outputs), to size chunks.
        self.per_item = sum(_size(v) for v in x) + sum(_size(y) for y in self.ys)
        self.rows: list = []

    def add(self, check: str, j: int, k: int, row: jax.Array) -> None:
        """Adds a summary row: [failed, max |a - n|, elements failing], or just ``failed``."""
        self.notes.rows.append((check, j, k))
        self.rows.append(row)

    def compare(self, check: str, j: int, k: int, a: jax.Array, n: jax.Array) -> None:
        self.add(check, j, k, _mismatch_row(a, n, self.atol, self.rtol))


def _undefined_backward(t: _Trace) -> None:
    """Each output used alone: the others' cotangents are symbolic zeros (undefined)."""
    zeros = tuple(jnp.zeros_like(y) for y in t.ys)
    for j, y in enumerate(t.ys):
        c = _probe(y.shape, salt=7 + j)
        try:
            (got,) = jax.vjp(lambda xs, j=j: t.f(xs)[j], t.x)[1](c)
        except Exception as e:  # e.g. backward computing None * g
            t.notes.undefined_errors[("backward", j)] = e
            continue
        (expected,) = t.pullback(_replace(zeros, j, c))
        for k in range(len(t.x)):
            t.compare("undefined_backward", j, k, got[k], expected[k])


def _undefined_forward(t: _Trace, failing_alone: frozenset) -> None:
    """Each input differentiated alone: the others' tangents are symbolic zeros (undefined)."""
    zeros = tuple(jnp.zeros_like(v) for v in t.x)
    for k, xk in enumerate(t.x):
        if k in failing_alone:
            continue
        tangent = _probe(xk.shape, salt=13 + k)
        _, got = jax.jvp(lambda v, k=k: t.f(_replace(t.x, k, v)), (xk,), (tangent,))
        _, expected = jax.jvp(t.f, (t.x,), (_replace(zeros, k, tangent),))
        for j in range(len(got)):
            t.compare("undefined_forward", j, k, got[j], expected[j])


def _batched_backward(t: _Trace) -> None:
    """vmap of the VJP over a few output cotangents, against a Python loop over them."""
    zeros = tuple(jnp.zeros_like(y) for y in t.ys)
    for j, y in enumerate(t.ys):
        cs = jnp.stack([_probe(y.shape, salt=31 + 3 * j + b) for b in range(_BATCHED_GRAD_SAMPLES)])
        vjp_j = lambda c, j=j: t.pullback(_replace(zeros, j, c))[0]  # noqa: E731
        try:
            batched = jax.vmap(vjp_j)(cs)
        except Exception as e:
            t.notes.batched_errors[j] = e
            continue
        looped = [vjp_j(c) for c in cs]
        for k in range(len(batched)):
            t.compare("batched", j, k, batched[k], jnp.stack([g[k] for g in looped]))


# ---------------------------------------------------------------------------
# The checking program: one jitted XLA program per checker (plus, on failure,
# a report variant). Few, small programs keep the first call fast.


class _Output(NamedTuple):
    """What one run of a checking program returns (device arrays)."""

    summary: list  # one row per notes.rows entry: [failed, max |a - n|, elements failing], or failed
    analytical: Any  # what a rerun must reproduce exactly (the nondet_tol check)
    blocks: dict  # slow report: full Jacobians; fast mode: directional derivatives


def _build_program(evaluate: Callable, options: _Options, notes: _Notes, report: bool,
                   failing_alone: frozenset = frozenset()) -> Any:
    """The jitted check of ``evaluate``: derivatives, comparisons and the extra checks, in one program.

    Tolerances and ``eps`` are arguments, so changing them does not recompile.
    ``report`` selects the variant that also returns the full Jacobians.
    ``failing_alone``: inputs along which, alone, forward mode is known to
    raise (left out of the undefined-tangent check; reported from the probe).
    """
    body = _fast_body if options.fast_mode else _slow_body

    def program(x_in: tuple, fixed: tuple, numbers: _Numbers, directions: tuple) -> _Output:
        notes.reset()
        x = tuple(_real_view(jnp.asarray(v)) for v in x_in)
        t = _Trace(lambda xs: evaluate(xs, fixed), x, options, notes, numbers, directions, report)
        analytical, blocks = body(t)
        if t.pullback is not None and options.check_undefined_grad and len(t.ys) > 1:
            _undefined_backward(t)
        if t.pullback is not None and options.check_batched_grad:
            _batched_backward(t)
        if options.check_forward_ad and options.check_undefined_grad and len(x) > 1:
            _undefined_forward(t, failing_alone)
        return _Output(t.rows, analytical, blocks)

    return jax.jit(program)


def _slow_body(t: _Trace) -> tuple:
    """Full Jacobians: VJP rows and JVP columns, each compared with central differences."""
    n_in, n_out = len(t.x), len(t.ys)
    analytical = [_vjp_rows(t, j) for j in range(n_out)] if t.pullback is not None else []
    forward = [_jvp_columns(t, k) for k in range(n_in)] if t.options.check_forward_ad else []
    # Each check's Jacobian blocks [k][j] in PyTorch's (input, output) layout.
    jacobians = ([("backward", [[a[k].T for a in analytical] for k in range(n_in)])] if analytical else []) + (
        [("forward", forward)] if forward else [])
    n_elements = sum(_size(v) for v in t.x) * sum(_size(y) for y in t.ys) * len(jacobians)
    if not t.report and n_elements > _REPORT_ELEMENTS:
        for k in range(n_in):
            references = [(j, jac[k][j]) for _, jac in jacobians for j in range(n_out)]
            failures = iter(_compare_columns(t, k, references))
            for check, _ in jacobians:
                for j in range(n_out):
                    t.add(check, j, k, next(failures))
        return analytical, {}
    # The report variant returns the full Jacobians; so does the first program when they are small,
    # which saves compiling a second program to report a failure.
    blocks = {"numerical": [_central_differences(t, k, jnp.arange(_size(v))) for k, v in enumerate(t.x)]}
    for check, jac in jacobians:
        blocks[check] = jac
        for k in range(n_in):
            for j in range(n_out):
                t.add(check, j, k, _failure(jac[k][j], blocks["numerical"][k][j], t.atol, t.rtol))
    return analytical, blocks


def _fast_body(t: _Trace) -> tuple:
    """PyTorch's fast mode: J u numerically (and by JVP), v^T J by VJP, for random u, v.

    Only those vectors leave the program; the projections v^T J u and their
    comparison are a few dot products on the host. That keeps reductions,
    and so kernels to compile, out of the program.
    """
    us, vs = t.directions
    numerical = []  # [k][j]: J_jk u_k by central differences
    for k, (xk, u) in enumerate(zip(t.x, us, strict=True)):
        def shifted(h: jax.Array, k: int = k, xk: jax.Array = xk, u: np.ndarray = u) -> tuple:
            return t.f(_replace(t.x, k, xk + h * u))

        out = _batched(shifted, t.steps, 2, t.per_item, t.notes, "fn")
        numerical.append([((y[0] - y[1]) * t.scale).reshape(-1) for y in out])
    blocks: dict = {"numerical": numerical}
    analytical = []  # [j][k]: v_j^T J_jk
    if t.pullback is not None:
        zeros = tuple(jnp.zeros_like(y) for y in t.ys)
        analytical = [tuple(g.reshape(-1) for g in t.pullback(_replace(zeros, j, v))[0])
                      for j, v in enumerate(vs)]
        blocks["backward"] = analytical
    if t.options.check_forward_ad:
        zeros = tuple(jnp.zeros_like(v) for v in t.x)
        blocks["forward"] = [[c.reshape(-1) for c in jax.jvp(t.f, (t.x,), (_replace(zeros, k, u),))[1]]
                             for k, u in enumerate(us)]
    return analytical, blocks


def _random_directions(evaluate: Callable, inputs: list[_Port], fixed: list) -> tuple:
    """Fast mode's u (one per input) and v (one per output): uniform [0, 1), unit norm, as PyTorch's."""
    ys = jax.eval_shape(evaluate, _real_view_shapes(inputs), tuple(fixed))
    rng = np.random.default_rng(0)

    def unit(shape: tuple) -> np.ndarray:
        u = rng.random(shape)
        return u / np.linalg.norm(u) if u.size else u

    return tuple(unit(p.shape) for p in _real_view_shapes(inputs)), tuple(unit(y.shape) for y in ys)


def _real_view_shapes(inputs: list[_Port]) -> tuple:
    return tuple(
        jax.ShapeDtypeStruct(p.shape + ((2,) if p.is_complex else ()), jnp.float64) for p in inputs
    )


def _forward_mode_errors(evaluate: Callable, inputs: list[_Port], fixed: list,
                         each_input: bool) -> tuple[BaseException | None, dict[int, BaseException]]:
    """What ``jax.jvp`` of ``fn`` raises: when fn has no forward mode, and, with
    ``each_input``, when differentiated along one input alone (the other
    inputs' tangents undefined: ``None`` in a vjpkit Function's ``jvp``).

    These are found by lowering probes (no compilation) before forward mode
    goes into the checking program: a vjpkit Function without ``jvp`` raises
    while tracing, but a plain ``jax.custom_vjp`` only when the JVP is
    lowered, and a vjpkit Function's ``jvp`` itself runs at lowering.
    """
    x = _real_view_shapes(inputs)

    def lower(jvp: Callable) -> None:
        jax.jit(jvp).lower(x, tuple(fixed))

    try:
        lower(lambda x, fixed: jax.jvp(lambda xs: evaluate(xs, fixed), (x,), (x,)))
    except TypeError as e:
        # JAX: "can't apply forward-mode autodiff (jvp) to a custom_vjp function";
        # vjpkit: "<Name> has no forward-mode derivative ...: it defines backward but no jvp".
        if "forward-mode" not in str(e):
            raise
        return e, {}
    undefined: dict[int, BaseException] = {}
    for k in range(len(x)) if each_input else ():
        try:
            lower(lambda x, fixed, k=k: jax.jvp(lambda v: evaluate(_replace(x, k, v), fixed), (x[k],), (x[k],)))
        except Exception as e:  # e.g. a jvp computing None * x
            undefined[k] = e
    return None, undefined


def _has_host_calls(jaxpr: Any) -> bool:
    """Whether a jaxpr calls back to the host (the only source of nondeterminism on CPU)."""
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if "callback" in name or name == "ffi_call":
            return True
        if any(_has_host_calls(sub) for sub in _sub_jaxprs(eqn)):
            return True
    return False


# ---------------------------------------------------------------------------
# Checkers: a compiled program per (function, input signature, options), cached.


class _Checker:
    """One function checked at one input signature with one set of options.

    It holds no reference to the function (``run`` is given it), so that
    the cache, keyed weakly on the function, lets the function go.
    """

    def __init__(self, split: _Inputs, diff: list, options: _Options):
        self.options = options
        self.split = split
        self.inputs = _input_ports(split, diff)
        self.outputs: list[_Port] = []  # fn's differentiable outputs (known after the first trace)
        # report variant or not -> (program, what its trace recorded): the
        # variants record their summary rows in different orders.
        self._variants: dict[bool, tuple[_Program, _Notes]] = {}
        self.forward_unavailable: BaseException | None = None  # why fn has no forward mode
        self.forward_undefined_errors: dict[int, BaseException] = {}  # input alone -> jvp's error
        self.directions: tuple = ()  # fast mode's (us, vs)
        self.rerun = False  # whether to run twice for nondet_tol (decided at the first trace)

    def run(self, fn: Callable, diff: list, fixed: list, tol: _Tolerances,
            report: bool = False) -> tuple[_Output, _Notes]:
        """Runs the program (the report variant: with full Jacobians); its output and its trace's notes."""
        args = (tuple(diff), tuple(fixed), _Numbers.of(tol))
        variant = self._variants.get(report)
        if variant is None:
            variant = self._variants[report] = self._trace(fn, args, report)
        program, notes = variant
        return program(*args, self.directions), notes

    def _trace(self, fn: Callable, args: tuple, report: bool) -> tuple[_Program, _Notes]:
        if not self._variants:  # the first program: learn what fn supports
            fixed = args[1]
            probe = _evaluator(fn, self.split, self.inputs, _Notes())
            if self.options.check_forward_ad:
                each_input = self.options.check_undefined_grad and len(self.inputs) > 1
                unavailable, undefined = _forward_mode_errors(probe, self.inputs, fixed, each_input)
                self.forward_unavailable = None if unavailable is None else _detached(unavailable)
                self.forward_undefined_errors = {k: _detached(e) for k, e in undefined.items()}
            if self.options.fast_mode:
                self.directions = _random_directions(probe, self.inputs, fixed)
        options = self.options
        if self.forward_unavailable is not None:
            options = options._replace(check_forward_ad=False)
        notes = _Notes()
        evaluate = _evaluator(fn, self.split, self.inputs, notes)
        program = _build_program(evaluate, options, notes, report, frozenset(self.forward_undefined_errors))
        traced = program.trace(*args, self.directions)
        host_calls = _has_host_calls(traced.jaxpr.jaxpr)
        if not report:
            self.rerun = jax.default_backend() != "cpu" or host_calls
        self.outputs = notes.outputs
        notes.detach()
        # Evaluated on the host only where that is the same computation as the compiled program's,
        # run for run: on the CPU, and without callbacks or effects, which a rerun must see take
        # the same path (two runs compared under nondet_tol must not differ by rounding alone).
        evaluable = jax.default_backend() == "cpu" and not host_calls and not traced.jaxpr.effects
        return _Program(traced, evaluable), notes


class _Program:
    """A traced checking program, run by the cheaper of evaluating it and compiling it.

    The first runs evaluate the jaxpr op by op with NumPy (``_numpy_eval``):
    no lowering, no compile, where XLA's CPU compiler costs about a
    millisecond per kernel. Once the time spent evaluating exceeds what
    compiling is estimated to cost, the program is compiled and runs
    compiled from then on (the ski-rental rule: the total stays within about
    twice the best choice in hindsight, whether a check runs once or
    thousands of times).
    """

    def __init__(self, traced: Any, evaluable: bool):
        self.compiled: Callable | None = None
        self.jaxpr: Any = None  # the program, kept only until compiled (it holds fn's constants)
        self.evaluate: Callable | None = None
        self.spent = 0.0  # seconds spent evaluating
        self.budget = 0.0
        self.out_tree = jax.tree_util.tree_structure(traced.out_info, is_leaf=lambda x: hasattr(x, "shape"))
        if evaluable:
            self.jaxpr = traced.jaxpr
            self.budget = _compile_estimate(traced.jaxpr.jaxpr)
        else:
            self.compiled = _compile_lowered(traced.lower())

    def __call__(self, *args: Any) -> _Output:
        if self.compiled is None and self.spent >= self.budget:
            self.compiled = self._compile(jax.tree_util.tree_leaves(args))
        if self.compiled is not None:
            return self.compiled(*args)
        start = time.perf_counter()
        flat = jax.tree_util.tree_leaves(args)
        try:
            if self.evaluate is None:
                self.evaluate = numpy_evaluator(self.jaxpr)
            out = self.evaluate(flat)
        except Exception:  # whatever the host cannot evaluate, XLA runs (and raises fn's own errors)
            self.compiled = self._compile(flat)
            return self.compiled(*args)
        self.spent += time.perf_counter() - start
        return jax.tree_util.tree_unflatten(self.out_tree, out)

    def _compile(self, flat: list) -> Callable:
        """Compiles the jaxpr (not the Traced, whose lowering may hold on to fn), and lets it go."""
        compiled = _compile_lowered(jax.jit(jaxpr_as_fun(self.jaxpr)).lower(*flat))
        self.jaxpr = self.evaluate = None
        out_tree = self.out_tree
        return lambda *args: jax.tree_util.tree_unflatten(out_tree, compiled(*jax.tree_util.tree_leaves(args)))


# What lowering and compiling a checking program costs on the CPU, in seconds: a fixed part plus
# a part per jaxpr equation (sub-jaxprs' included). Fitted to programs measured on the 2-core
# development machine (JAX 0.10.2, _CPU_COMPILE_OPTIONS): sin 43 equations 0.05 s, the tutorial's
# LinearFunction 89 equations 0.11 s, entmax's bisection (benchmarks/gradcheck.py) at 5, 10, 20
# and 50 steps 369, 624, 1134 and 2664 equations 0.21, 0.38, 0.77 and 3.2 s. The estimate is
# within 2x of each; the ski-rental bound only needs it within a factor.
_COMPILE_FIXED_S = 0.05
_COMPILE_PER_EQUATION_S = 0.0009


def _compile_estimate(jaxpr: Any) -> float:
    return _COMPILE_FIXED_S + _COMPILE_PER_EQUATION_S * _count_equations(jaxpr)


def _count_equations(jaxpr: Any) -> int:
    count = 0
    for eqn in jaxpr.eqns:
        count += 1
        for sub in _sub_jaxprs(eqn):
            count += _count_equations(sub)
    return count


def _sub_jaxprs(eqn: Any) -> list:
    found = []
    for value in eqn.params.values():
        for sub in value if isinstance(value, (tuple, list)) else (value,):
            sub = getattr(sub, "jaxpr", sub)
            if hasattr(sub, "eqns"):
                found.append(sub)
    return found


def _compile_lowered(lowered: Any) -> Callable:
    """Compiles a checking program, with options that cut XLA's CPU compile time where they exist."""
    if jax.default_backend() == "cpu":
        try:
            return lowered.compile(compiler_options=_CPU_COMPILE_OPTIONS)
        except Exception as e:  # an XLA without one of the options: compile as usual
            if "compile option" not in str(e):
                raise
    return lowered.compile()


def _input_ports(split: _Inputs, diff: list) -> list[_Port]:
    return [
        _Port(index, path, tuple(np.shape(v)), v.dtype, jnp.iscomplexobj(v))
        for (index, path), v in zip(split.diff_sites(), diff, strict=True)
    ]


def _signature(diff: list, fixed: list) -> tuple:
    return tuple((np.shape(v), np.dtype(v.dtype)) for v in (*diff, *fixed))


def _detached(e: BaseException) -> BaseException:
    """``e`` without its traceback (and its causes'), which would keep the user's frames alive."""
    seen = set()
    error: BaseException | None = e
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        error.__traceback__ = None
        error = error.__cause__ or error.__context__
    return e


class _Cache:
    """Checkers (and output structures), per function, dropped with the function.

    Keyed weakly on the function, as Equinox's compile cache is: the values
    never refer to it, so deleting a function frees it and what its closure
    holds. A bound method is keyed on its object; a ``gradgradcheck`` VJP on
    the function it differentiates. Callables that cannot be weakly
    referenced are kept, least recently used dropped first.
    """

    def __init__(self) -> None:
        self.by_owner: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self.strong: collections.OrderedDict = collections.OrderedDict()
        self.lock = threading.Lock()

    def get(self, fn: Callable, key: Any, make: Callable[[], Any]) -> Any:
        owner, part = _owner(fn)
        key = (part, key)
        with self.lock:
            try:
                entries = self.by_owner.get(owner)
                if entries is None:
                    entries = self.by_owner[owner] = collections.OrderedDict()
            except TypeError:  # not weakly referenceable, or unhashable
                entries, key = self.strong, (static_key(owner), key)
            if key in entries:
                entries.move_to_end(key)
                return entries[key]
        value = make()
        with self.lock:
            entries[key] = value
            while len(entries) > _CACHE_SIZE:
                entries.popitem(last=False)
        return value

    def clear(self) -> None:
        with self.lock:
            self.by_owner.clear()
            self.strong.clear()


def _owner(fn: Callable) -> tuple[Any, Any]:
    """The object whose life a cache entry for ``fn`` follows, and what else tells ``fn`` apart."""
    if isinstance(fn, _VJPOf):
        owner, part = _owner(fn.fn)
        return owner, ("vjp", fn.n_args, part)
    if isinstance(fn, types.MethodType):  # a new object at each attribute access
        return fn.__self__, ("method", static_key(fn.__func__))
    return fn, None


_cache = _Cache()
on_clear(_cache.clear)


def _checker(fn: Callable, split: _Inputs, diff: list, fixed: list, options: _Options) -> _Checker:
    key = ("checker", split.key, _signature(diff, fixed), options)
    return _cache.get(fn, key, lambda: _Checker(split, diff, options))


# ---------------------------------------------------------------------------
# Running a check and reporting.


def _run(fn, args, options, tol, naming, raise_exception) -> bool:
    _validate(options, tol)
    try:
        with _jax_internals.enable_x64(True):
            _check(fn, args, options, tol, naming)
    except GradcheckError:
        if raise_exception:
            raise
        return False
    return True


def _check(fn, args, options, tol, naming) -> None:
    split, diff, fixed = _split(args)
    if not diff:
        raise ValueError(
            "gradcheck: no floating-point or complex array among the inputs, so there is "
            "nothing to differentiate. Integer arrays and non-array inputs (Python scalars, "
            "strings) are held fixed; pass jnp.asarray(c, dtype=float) to check a scalar."
        )
    for (index, path), v in zip(split.diff_sites(), diff, strict=True):
        if np.dtype(v.dtype) not in (np.float64, np.complex128):
            _warn(
                f"{naming.input(index, path)} has dtype {np.dtype(v.dtype).name}; gradcheck casts it "
                "to double precision and checks fn there, since finite differences in single "
                "precision are too inaccurate to compare with. Pass float64 inputs to silence this warning."
            )
    checker = _checker(fn, split, diff, fixed, options)
    out, notes = checker.run(fn, diff, fixed, tol)
    summary = _summary(out)
    for message in _trace_warnings(checker, notes, naming):
        _warn(message)
    problems: list[str] = []
    mismatches: list[JacobianMismatch] = []
    if options.fast_mode:
        fast_problems = _fast_mode_problems(checker, out, tol, naming)
        if fast_problems:
            problems.append("\n".join(fast_problems))
            slow = _checker(fn, split, diff, fixed, options._replace(fast_mode=False))
            slow_problems, mismatches = _jacobian_report(fn, slow, diff, fixed, tol, naming)
            problems.append(
                "The full Jacobians (slow mode), for the complete picture:\n\n" + "\n\n".join(slow_problems)
                if slow_problems else
                "The full Jacobians (slow mode) agree element by element within atol and rtol: fast "
                "mode failed only through its projected tolerance. Use fast_mode=False for this function."
            )
    elif any(s[0] > 0 for (check, _, _), s in zip(notes.rows, summary, strict=True) if check in _JACOBIANS):
        problems, mismatches = _jacobian_report(fn, checker, diff, fixed, tol, naming, (out, notes))
    problems += _other_problems(checker, notes, summary, naming)
    if not problems and checker.rerun and options.check_backward_ad:
        again, _ = checker.run(fn, diff, fixed, tol)
        problems += _reentrancy_problems(checker, out.analytical, again.analytical, tol, naming)
    if checker.forward_unavailable is not None:
        reason = f"{type(checker.forward_unavailable).__name__}: {checker.forward_unavailable}"
        if not options.check_backward_ad:
            problems.append(
                "Nothing was checked: check_backward_ad=False and fn has no forward mode for "
                f"check_forward_ad ({reason})"
            )
        else:
            _warn(f"skipped check_forward_ad because fn has no forward mode ({reason})")
    if problems:
        raise GradcheckError("\n\n".join(problems), mismatches)


_JACOBIANS = ("backward", "forward")


def _summary(out: _Output) -> list[np.ndarray]:
    """The summary rows on the host, each as [failed, max |a - n|, elements failing]."""
    rows = jax.device_get(out.summary)
    return [np.asarray(r, dtype=np.float64).reshape(-1).tolist() + [np.nan] * (3 - np.size(r)) for r in rows]


def _warn(message: str) -> None:
    warnings.warn(f"gradcheck: {message}", stacklevel=_outside_vjpkit())


_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


def _outside_vjpkit() -> int:
    """The ``stacklevel`` of the nearest caller outside vjpkit, so that a warning names the user's line.

    A fixed level would name a line inside vjpkit when gradcheck is called
    through ``vjpkit.testing`` or the command line.
    """
    frame: types.FrameType | None = sys._getframe(1)  # _warn's frame: stacklevel 1
    level = 1
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE_DIR):
        frame = frame.f_back
        level += 1
    return level


def _trace_warnings(checker: _Checker, notes: _Notes, naming: _Naming) -> list[str]:
    """What tracing fn showed that the user should know: precision lost, vmap missing."""
    messages = []
    for port in checker.outputs:
        if np.dtype(port.dtype) not in (np.float64, np.complex128):
            messages.append(
                f"{naming.output(port.index, port.path)} has dtype {np.dtype(port.dtype).name} although "
                "fn ran on float64 inputs; finite differences through a single-precision computation "
                "are inaccurate."
            )
    for where, e in notes.sequential:
        messages.append(
            f"{where} does not support vmap, so gradcheck evaluated it in a sequential loop "
            f"(slower). vmap raised {type(e).__name__}: {e}"
        )
    return messages


def _pair(checker: _Checker, j: int, k: int, naming: _Naming) -> str:
    out, inp = checker.outputs[j], checker.inputs[k]
    return f"{naming.output(out.index, out.path)} with respect to {naming.input(inp.index, inp.path)}"


def _fast_mode_problems(checker: _Checker, out: _Output, tol: _Tolerances, naming: _Naming) -> list[str]:
    """Compares v^T (J u) numerically with (v^T J) u by VJP, and J u by JVP, on the host.

    atol is scaled by sum(u) * sum(v) (sum(u) for J u): the projection of a
    matrix whose every entry is atol (PyTorch's ``_adjusted_atol``).
    """
    us, vs = checker.directions
    blocks = jax.device_get(out.blocks)
    problems = []
    for k, u in enumerate(us):
        for j, v in enumerate(vs):
            ju = blocks["numerical"][k][j]
            if "backward" in blocks:
                n = float(np.dot(v.reshape(-1), ju))
                a = float(np.dot(blocks["backward"][j][k], u.reshape(-1)))
                if not abs(a - n) <= tol.atol * u.sum() * v.sum() + tol.rtol * abs(n):
                    problems.append(
                        f"Fast-mode Jacobian mismatch for {_pair(checker, j, k, naming)}: v^T J u = "
                        f"{n!r} numerically, {a!r} analytically (random u, v)."
                    )
            if "forward" in blocks:
                diff = np.abs(blocks["forward"][k][j] - ju)
                if not np.all(diff <= tol.atol * u.sum() + tol.rtol * np.abs(ju)):
                    problems.append(
                        f"Fast-mode Jacobian computed with forward mode mismatch for "
                        f"{_pair(checker, j, k, naming)}: J u differs from the numerical J u by up to "
                        f"{np.max(diff):.6g} (random u)."
                    )
    return problems


def _jacobian_report(fn, checker, diff, fixed, tol, naming, first=None) -> tuple[list[str], list[JacobianMismatch]]:
    """Describes every mismatching block, from the first run's Jacobians or from the report variant's."""
    out, notes = first if first is not None and "numerical" in first[0].blocks else (None, None)
    if out is None:
        out, notes = checker.run(fn, diff, fixed, tol, report=True)
    assert notes is not None  # every run returns its record of rows
    summary = _summary(out)
    problems, mismatches = [], []
    for (check, j, k), s in zip(notes.rows, summary, strict=True):
        if check in _JACOBIANS and s[0] > 0:
            m = _mismatch(check, checker.outputs[j], checker.inputs[k],
                          np.asarray(out.blocks["numerical"][k][j]),
                          np.asarray(out.blocks[check][k][j]), tol, naming)
            mismatches.append(m)
            problems.append(_describe(m, tol))
    return problems, mismatches


def _element(port: _Port, flat: int) -> tuple:
    shape = port.shape + ((2,) if port.is_complex else ())
    index: tuple = tuple(int(i) for i in np.unravel_index(flat, shape)) if shape else ()
    if port.is_complex:
        index = index[:-1] + (("real", "imag")[index[-1]],)
    return index


def _mismatch(mode, out, inp, numerical, analytical, tol, naming) -> JacobianMismatch:
    diff = np.abs(analytical - numerical)
    ok = diff <= tol.atol + tol.rtol * np.abs(numerical)
    excess = np.where(ok, 0.0, np.where(np.isnan(diff), np.inf, diff / (tol.atol + tol.rtol * np.abs(numerical))))
    r, c = np.unravel_index(int(np.argmax(excess)), excess.shape)
    n, a = float(numerical[r, c]), float(analytical[r, c])
    return JacobianMismatch(
        mode=mode,
        output=naming.output(out.index, out.path),
        input=naming.input(inp.index, inp.path),
        output_index=out.index,
        input_index=inp.index,
        output_path=out.path,
        input_path=inp.path,
        output_element=_element(out, int(c)),
        input_element=_element(inp, int(r)),
        numerical_value=n,
        analytical_value=a,
        abs_diff=abs(a - n),
        rel_diff=abs(a - n) / abs(n) if n != 0 else float("inf"),
        mismatched=int(np.sum(~ok)),
        numerical=numerical,
        analytical=analytical,
    )


def _format_matrix(m: np.ndarray) -> str:
    with np.printoptions(threshold=64, edgeitems=3, precision=6, linewidth=100):
        return np.array2string(m, prefix="    ")


def _format_element(index: tuple) -> str:
    return "(" + ", ".join(str(i) for i in index) + ("," if len(index) == 1 else "") + ")"


def _describe(m: JacobianMismatch, tol: _Tolerances) -> str:
    mode = " computed with forward mode" if m.mode == "forward" else ""
    return (
        f"Jacobian{mode} mismatch for {m.output} with respect to {m.input}:\n"
        f"  {m.mismatched} of {m.numerical.size} elements differ by more than "
        f"atol + rtol * |numerical| (atol={tol.atol:g}, rtol={tol.rtol:g}).\n"
        f"  worst: {m.output} element {_format_element(m.output_element)} "
        f"with respect to {m.input} element {_format_element(m.input_element)}\n"
        f"    numerical:  {m.numerical_value!r}\n"
        f"    analytical: {m.analytical_value!r}\n"
        f"    abs diff:   {m.abs_diff:.6g}    rel diff: {m.rel_diff:.6g}\n"
        f"  numerical Jacobian (rows: elements of {m.input}, columns: elements of "
        f"{m.output}), shape {m.numerical.shape}:\n"
        f"    {_format_matrix(m.numerical)}\n"
        f"  analytical Jacobian{mode}, same layout:\n"
        f"    {_format_matrix(m.analytical)}"
        + (_ZERO_HINT.format(output=m.output) if not np.any(m.analytical) else "")
    )


# PyTorch's gradcheck skips outputs that do not require grad; in JAX an output
# carries no such flag, so one marked non-differentiable is compared like any other.
_ZERO_HINT = (
    "\n  The analytical Jacobian is zero. If {output} is not meant to be differentiated "
    "(ctx.mark_non_differentiable, stop_gradient), leave it out of the outputs of the "
    "function you check, e.g. lambda *a: f(*a)[0]."
)


def _other_problems(checker: _Checker, notes: _Notes, summary: list, naming: _Naming) -> list[str]:
    """Reports of check_undefined_grad and check_batched_grad."""
    problems = []
    forward_errors = {("forward", k): e for k, e in checker.forward_undefined_errors.items()}
    for (mode, index), e in {**notes.undefined_errors, **forward_errors}.items():
        if mode == "backward":
            out = checker.outputs[index]
            problems.append(
                f"Backward failed with undefined output gradients: using only "
                f"{naming.output(out.index, out.path)} leaves the gradients of the other outputs "
                f"undefined (None in a vjpkit Function with ctx.set_materialize_grads(False)), and "
                f"the backward raised {type(e).__name__}: {e}\nTreat an undefined gradient as zero, "
                "or pass check_undefined_grad=False."
            )
        else:
            inp = checker.inputs[index]
            problems.append(
                f"Forward mode failed with undefined input tangents: differentiating with respect "
                f"to {naming.input(inp.index, inp.path)} alone leaves the tangents of the other "
                f"inputs undefined (None in a vjpkit Function's jvp), and it raised "
                f"{type(e).__name__}: {e}\nTreat an undefined tangent as zero, or pass "
                "check_undefined_grad=False."
            )
    for j, e in notes.batched_errors.items():
        out = checker.outputs[j]
        problems.append(
            f"Batched gradient check failed: vmap of the VJP over gradients of "
            f"{naming.output(out.index, out.path)} raised {type(e).__name__}: {e}"
        )
    for (check, j, k), (failed, worst, count) in zip(notes.rows, summary, strict=True):
        if failed <= 0 or check in _JACOBIANS:
            continue
        pair = _pair(checker, j, k, naming)
        how_much = f"by up to {worst:.6g} ({int(count)} elements)"
        if check == "undefined_backward":
            problems.append(
                f"Backward mishandles undefined output gradients: for {pair}, the gradient with the "
                f"other outputs' gradients undefined (None in a vjpkit Function with "
                f"ctx.set_materialize_grads(False)) differs from the gradient with explicit zeros, "
                f"{how_much}. An undefined gradient must act as zero."
            )
        elif check == "undefined_forward":
            problems.append(
                f"Forward mode mishandles undefined input tangents: for {pair}, the tangent with the "
                f"other inputs' tangents undefined differs from the one with explicit zeros, "
                f"{how_much}. An undefined tangent must act as zero."
            )
        else:
            problems.append(
                f"Batched gradient mismatch for {pair}: vmap of the VJP over "
                f"{_BATCHED_GRAD_SAMPLES} output gradients differs from a loop over them, {how_much}."
            )
    return problems


def _reentrancy_problems(checker, first, second, tol, naming) -> list[str]:
    problems = []
    for j, (rows1, rows2) in enumerate(zip(first, second, strict=True)):
        for k, (a1, a2) in enumerate(zip(rows1, rows2, strict=True)):
            worst = float(np.max(np.abs(np.asarray(a1) - np.asarray(a2)), initial=0.0))
            if not worst <= tol.nondet_tol:
                problems.append(
                    f"Backward is not reentrant: running it twice with the same inputs and output "
                    f"gradients gave values differing by up to {worst:.6g} for "
                    f"{_pair(checker, j, k, naming)}, although the analytical gradient matches the "
                    f"numerical one. The tolerance for nondeterminism was nondet_tol={tol.nondet_tol:g}."
                )
    return problems


# ---------------------------------------------------------------------------
# gradgradcheck: the VJP as a function of (inputs, cotangents).


class _VJPOf:
    """``(*args, *cotangents) -> gradients of args`` for ``fn`` (cached as ``fn``'s, see ``_owner``)."""

    def __init__(self, fn: Callable, n_args: int):
        self.fn, self.n_args = fn, n_args

    def __call__(self, *all_args: Any) -> tuple:
        args, cotangents = all_args[: self.n_args], all_args[self.n_args :]
        split, diff, fixed = _split(args)

        def outputs(d: list) -> list:
            return [y for _, y in _differentiable_outputs(self.fn(*split.merge(d, fixed)))]

        ys, pullback = jax.vjp(outputs, list(diff))
        cts = [jnp.asarray(c).astype(y.dtype) for c, y in zip(jax.tree_util.tree_leaves(cotangents), ys, strict=True)]
        (grads,) = pullback(cts)
        given = iter(grads)
        return split.layout.combine([next(given) if p else None for p in split.perturbed], keep_static=False)


def _output_ports(fn: Callable, args: tuple) -> list[_Port]:
    """fn's differentiable output leaves at these arguments (traced once, cached)."""
    split, diff, fixed = _split(args)
    key = ("outputs", split.key, _signature(diff, fixed))

    def trace() -> list[_Port]:
        notes, inputs = _Notes(), _input_ports(split, diff)
        jax.eval_shape(_evaluator(fn, split, inputs, notes), _real_view_shapes(inputs), tuple(fixed))
        return notes.outputs

    return _cache.get(fn, key, trace)


def _check_grad_outputs(cotangents: tuple, outputs: list[_Port]) -> None:
    leaves = jax.tree_util.tree_leaves(cotangents)
    want = [p.shape for p in outputs]
    if [tuple(np.shape(c)) for c in leaves] != want or not all(is_array(c) and _is_inexact(c) for c in leaves):
        raise ValueError(
            f"gradgradcheck: grad_outputs must hold one floating-point array per "
            f"differentiable output of fn, with shapes {want}; got "
            f"{[f'{type(c).__name__}{tuple(np.shape(c))}' for c in leaves]}."
        )
