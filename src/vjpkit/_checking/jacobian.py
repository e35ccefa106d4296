"""The checking program: analytical and numerical Jacobians, compared, in one traced function.

All one-hot output cotangents go through one ``vmap`` of the VJP, and all
central-difference perturbations through one ``vmap`` of ``fn``; the
comparison fuses with the differences, so no Jacobian-sized array is stored
unless a report needs it. The building blocks run while the program is traced.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .leaves import CheckedLeaf, Inputs, differentiable_outputs, from_real_view, real_view, real_view_shapes, site
from .options import Options, Tolerances

# Largest batch of perturbed inputs (or one-hot cotangents) vmapped at once,
# in bytes of float64 inputs plus outputs. Beyond it the batch is split into
# a lax.map of vmapped chunks, to bound memory. (Smaller, cache-sized chunks
# were no faster here, and a loop costs compile time.)
_BATCH_BYTES = 1 << 27


# Jacobians up to this many elements in all come back from the first program,
# ready for a report: a failed check then compiles no second program.
_REPORT_ELEMENTS = 1 << 16


BATCHED_GRAD_SAMPLES = 3


def _size(a: Any) -> int:
    return int(np.prod(a.shape, dtype=np.int64))


def _rows(a: jax.Array) -> jax.Array:
    """A batch of arrays as a matrix, one row per batch member (zero-size safe)."""
    return a.reshape(a.shape[0], int(np.prod(a.shape[1:], dtype=np.int64)))


def replace_at(x: tuple, k: int, value: Any) -> tuple:
    return x[:k] + (value,) + x[k + 1 :]


# The checking program's own arithmetic (one-hot vectors, perturbed inputs, differences, comparisons)
# is traced as calls of these jitted functions. Compiled whole, XLA inlines them: the same program.
# Run op by op, each call is one kernel (a program of its own, compiled once per shape) where its
# operations would be a kernel each: fewer kernels to compile, and the user's operations still each
# run alone.


@functools.partial(jax.jit, static_argnums=1)
def _one_hot(i: jax.Array, shape: tuple) -> jax.Array:
    return (jnp.arange(int(np.prod(shape, dtype=np.int64))) == i).astype(jnp.float64).reshape(shape)


def _probe(shape: tuple, salt: int) -> jax.Array:
    """Deterministic dense values in [-1, 1): a Weyl sequence, so no PRNG ops to compile."""
    i = jnp.arange(1, int(np.prod(shape, dtype=np.int64)) + 1, dtype=jnp.float64)
    return (2.0 * ((i * 0.6180339887498949 + salt * 0.7548776662466927) % 1.0) - 1.0).reshape(shape)


class Notes:
    """What tracing the program learned; read when interpreting its results."""

    def __init__(self) -> None:
        self.outputs: list[CheckedLeaf] = []
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
            detached(e)


def detached(e: BaseException) -> BaseException:
    """``e`` without its traceback (and its causes'), which would keep the user's frames alive."""
    seen = set()
    error: BaseException | None = e
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        error.__traceback__ = None
        error = error.__cause__ or error.__context__
    return e


def _batched(f: Callable, xs: Any, n: int, per_item: int, notes: Notes, where: str) -> Any:
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


def on_real_views(fn: Callable, split: Inputs, inputs: list[CheckedLeaf], notes: Notes) -> Callable:
    """``fn`` as a function of the real views of the perturbed leaves.

    Returns the real views (float64) of fn's differentiable output leaves,
    and records which leaves those are in ``notes.outputs``.
    """

    def evaluate(x: tuple, fixed: tuple) -> tuple:
        diff = [from_real_view(v, p.is_complex) for v, p in zip(x, inputs, strict=True)]
        outputs = differentiable_outputs(fn(*split.merge(diff, fixed)))
        notes.outputs = [
            CheckedLeaf(*site(path), tuple(y.shape), y.dtype, jnp.iscomplexobj(y)) for path, y in outputs
        ]
        return tuple(real_view(y) for _, y in outputs)

    return evaluate


def _central_differences(t: _Trace, k: int, index: jax.Array) -> list:
    """Numerical Jacobian columns ``index`` of input ``k``: one (len(index), m_j) block per output j.

    All ``2 len(index)`` perturbed inputs go through one (nested) ``vmap`` of
    ``f``: over the columns, and over the two signs of each column's step.
    """
    xk = t.x[k]

    def column(i: jax.Array) -> tuple:
        e = _one_hot(i, xk.shape)
        ys = _batched(lambda h: t.f(replace_at(t.x, k, _shifted(xk, h, e))), t.steps, 2, t.per_item, t.notes, "fn")
        return tuple(_difference(y, t.scale) for y in ys)

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
        (g,) = t.pullback(replace_at(zeros, j, _one_hot(i, t.ys[j].shape)))
        return tuple(gk.reshape(-1) for gk in g)

    return _batched(row, jnp.arange(m), m, t.per_item, t.notes, "the VJP")


def _jvp_columns(t: _Trace, k: int) -> list:
    """Forward-mode Jacobian columns for input ``k``: one (n_k, m_j) block per output j."""
    n = _size(t.x[k])
    zeros = tuple(jnp.zeros_like(v) for v in t.x)

    def column(i: jax.Array) -> tuple:
        return jax.jvp(t.f, (t.x,), (replace_at(zeros, k, _one_hot(i, t.x[k].shape)),))[1]

    return [_rows(c) for c in _batched(column, jnp.arange(n), n, t.per_item, t.notes, "the JVP")]


@jax.jit
def _shifted(x: jax.Array, h: jax.Array, e: jax.Array) -> jax.Array:
    """``x`` perturbed by ``h`` along ``e``."""
    return x + h * e


@jax.jit
def _difference(y: jax.Array, scale: jax.Array) -> jax.Array:
    """The central difference of the pair ``y`` (outputs at x + h e and x - h e), flat."""
    return ((y[0] - y[1]) * scale).reshape(-1)


@jax.jit
def _failure(a: jax.Array, n: jax.Array, atol: Any, rtol: Any) -> jax.Array:
    """Whether ``allclose(a, n, rtol, atol)`` fails (NaN fails too).

    A boolean reduction, which XLA fuses with the comparison (and with the
    differences that produce ``n``): no Jacobian-sized array is stored.
    """
    return jnp.any(~(jnp.abs(a - n) <= atol + rtol * jnp.abs(n)))


@jax.jit
def _mismatch_row(a: jax.Array, n: jax.Array, atol: Any, rtol: Any) -> jax.Array:
    """One summary row for a small comparison: [failed, max |a - n|, elements failing]."""
    diff = jnp.abs(a - n)
    failing = ~(diff <= atol + rtol * jnp.abs(n))
    worst = jnp.max(jnp.where(jnp.isnan(diff), jnp.inf, diff), initial=0.0)
    return jnp.stack([jnp.any(failing), worst, jnp.sum(failing)]).astype(jnp.float64)


class Numbers(NamedTuple):
    """The checking program's numeric arguments: changing them does not recompile.

    The finite-difference steps and their scale come in ready-made, so the
    program computes no scalars of its own (each would be a kernel to compile).
    """

    steps: np.ndarray  # [eps, -eps]
    scale: float  # 1 / (2 eps)
    atol: float
    rtol: float

    @classmethod
    def of(cls, tol: Tolerances) -> Numbers:
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
        (expected,) = t.pullback(replace_at(zeros, j, c))
        for k in range(len(t.x)):
            t.compare("undefined_backward", j, k, got[k], expected[k])


def _undefined_forward(t: _Trace, failing_alone: frozenset) -> None:
    """Each input differentiated alone: the others' tangents are symbolic zeros (undefined)."""
    zeros = tuple(jnp.zeros_like(v) for v in t.x)
    for k, xk in enumerate(t.x):
        if k in failing_alone:
            continue
        tangent = _probe(xk.shape, salt=13 + k)
        _, got = jax.jvp(lambda v, k=k: t.f(replace_at(t.x, k, v)), (xk,), (tangent,))
        _, expected = jax.jvp(t.f, (t.x,), (replace_at(zeros, k, tangent),))
        for j in range(len(got)):
            t.compare("undefined_forward", j, k, got[j], expected[j])


def _batched_backward(t: _Trace) -> None:
    """vmap of the VJP over a few output cotangents, against a Python loop over them."""
    zeros = tuple(jnp.zeros_like(y) for y in t.ys)
    for j, y in enumerate(t.ys):
        cs = jnp.stack([_probe(y.shape, salt=31 + 3 * j + b) for b in range(BATCHED_GRAD_SAMPLES)])
        vjp_j = lambda c, j=j: t.pullback(replace_at(zeros, j, c))[0]  # noqa: E731
        try:
            batched = jax.vmap(vjp_j)(cs)
        except Exception as e:
            t.notes.batched_errors[j] = e
            continue
        looped = [vjp_j(c) for c in cs]
        for k in range(len(batched)):
            t.compare("batched", j, k, batched[k], jnp.stack([g[k] for g in looped]))


class Output(NamedTuple):
    """What one run of a checking program returns (device arrays)."""

    summary: list  # one row per notes.rows entry: [failed, max |a - n|, elements failing], or failed
    analytical: Any  # what a rerun must reproduce exactly (the nondet_tol check)
    blocks: dict  # slow report: full Jacobians; fast mode: directional derivatives


def build_program(evaluate: Callable, options: Options, notes: Notes, report: bool,
                   failing_alone: frozenset = frozenset()) -> Any:
    """The jitted check of ``evaluate``: derivatives, comparisons and the extra checks, in one program.

    Tolerances and ``eps`` are arguments, so changing them does not recompile.
    ``report`` selects the variant that also returns the full Jacobians.
    ``failing_alone``: inputs along which, alone, forward mode is known to
    raise (left out of the undefined-tangent check; reported from the probe).
    """
    body = _fast_body if options.fast_mode else _slow_body

    def program(x_in: tuple, fixed: tuple, numbers: Numbers, directions: tuple) -> Output:
        notes.reset()
        x = tuple(real_view(jnp.asarray(v)) for v in x_in)
        t = _Trace(lambda xs: evaluate(xs, fixed), x, options, notes, numbers, directions, report)
        analytical, blocks = body(t)
        if t.pullback is not None and options.check_undefined_grad and len(t.ys) > 1:
            _undefined_backward(t)
        if t.pullback is not None and options.check_batched_grad:
            _batched_backward(t)
        if options.check_forward_ad and options.check_undefined_grad and len(x) > 1:
            _undefined_forward(t, failing_alone)
        return Output(t.rows, analytical, blocks)

    return program


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
            return t.f(replace_at(t.x, k, _shifted(xk, h, u)))

        out = _batched(shifted, t.steps, 2, t.per_item, t.notes, "fn")
        numerical.append([_difference(y, t.scale) for y in out])
    blocks: dict = {"numerical": numerical}
    analytical = []  # [j][k]: v_j^T J_jk
    if t.pullback is not None:
        zeros = tuple(jnp.zeros_like(y) for y in t.ys)
        analytical = [tuple(g.reshape(-1) for g in t.pullback(replace_at(zeros, j, v))[0])
                      for j, v in enumerate(vs)]
        blocks["backward"] = analytical
    if t.options.check_forward_ad:
        zeros = tuple(jnp.zeros_like(v) for v in t.x)
        blocks["forward"] = [[c.reshape(-1) for c in jax.jvp(t.f, (t.x,), (replace_at(zeros, k, u),))[1]]
                             for k, u in enumerate(us)]
    return analytical, blocks


def random_directions(evaluate: Callable, inputs: list[CheckedLeaf], fixed: list) -> tuple:
    """Fast mode's u (one per input) and v (one per output): uniform [0, 1), unit norm, as PyTorch's."""
    ys = jax.eval_shape(evaluate, real_view_shapes(inputs), tuple(fixed))
    rng = np.random.default_rng(0)

    def unit(shape: tuple) -> np.ndarray:
        u = rng.random(shape)
        return u / np.linalg.norm(u) if u.size else u

    return tuple(unit(p.shape) for p in real_view_shapes(inputs)), tuple(unit(y.shape) for y in ys)


def forward_mode_errors(evaluate: Callable, inputs: list[CheckedLeaf], fixed: list,
                         each_input: bool) -> tuple[BaseException | None, dict[int, BaseException]]:
    """What ``jax.jvp`` of ``fn`` raises: when fn has no forward mode, and, with
    ``each_input``, when differentiated along one input alone (the other
    inputs' tangents undefined: ``None`` in a vjpkit Function's ``jvp``).

    These are found by lowering probes (no compilation) before forward mode
    goes into the checking program: a vjpkit Function without ``jvp`` raises
    while tracing, but a plain ``jax.custom_vjp`` only when the JVP is
    lowered, and a vjpkit Function's ``jvp`` itself runs at lowering.
    """
    x = real_view_shapes(inputs)

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
            lower(lambda x, fixed, k=k: jax.jvp(lambda v: evaluate(replace_at(x, k, v), fixed), (x[k],), (x[k],)))
        except Exception as e:  # e.g. a jvp computing None * x
            undefined[k] = e
    return None, undefined
