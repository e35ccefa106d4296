"""Reporting a check: GradcheckError, JacobianMismatch, and the text of each kind of failure."""

from __future__ import annotations

import dataclasses
import os
import traceback
import warnings
from typing import Sequence

import jax
import numpy as np

from .checkers import Checker
from .jacobian import BATCHED_GRAD_SAMPLES, Notes, Output
from .leaves import CheckedLeaf
from .options import Naming, Tolerances


class GradcheckError(RuntimeError):
    """A gradient check failed. The message is the full report.

    Attributes:
        mismatches: One `JacobianMismatch` per (output, input) pair whose
            Jacobians disagree, for programmatic use (empty when the failure
            is of another kind, e.g. a backward that is not reentrant).

    Examples:
        >>> import numpy as np
        >>> import vjpkit
        >>> class WrongCube(vjpkit.Function):
        ...     @staticmethod
        ...     def forward(ctx, x):
        ...         ctx.save_for_backward(x)
        ...         return x**3
        ...
        ...     @staticmethod
        ...     def backward(ctx, g):
        ...         (x,) = ctx.saved_tensors
        ...         return 2 * x**2 * g  # should be 3 * x**2 * g
        >>> try:
        ...     vjpkit.gradcheck(WrongCube.apply, (np.array([1.0, -2.0, 0.5]),))
        ... except vjpkit.GradcheckError as e:
        ...     error = e
        >>> print(str(error).splitlines()[0])
        Jacobian mismatch for output 0 with respect to input 0:
        >>> worst = error.mismatches[0]
        >>> worst.input_element, round(worst.numerical_value, 6), worst.analytical_value
        ((1,), 12.0, 8.0)
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

    Attributes:
        mode: ``"backward"`` (the Jacobian from the VJP) or ``"forward"``
            (from the JVP).
        output: The output's name, e.g. ``"output 0"`` or
            ``"output 1 ['mask']"``.
        input: The input's name, e.g. ``"input 1"`` or ``"input 0 ['w']"``.
        output_index: The output's position in ``fn``'s output tuple (0 for
            an output that is not a tuple).
        input_index: The input's position in the inputs tuple.
        output_path: The pytree path inside that output (``""`` for an
            array).
        input_path: The pytree path inside that input.
        output_element: The index of the worst element in the output leaf.
        input_element: The index of the worst element in the input leaf.
        numerical_value: The finite-difference derivative at the worst
            element.
        analytical_value: The derivative ``fn``'s rules give there.
        abs_diff: ``|analytical_value - numerical_value|``.
        rel_diff: ``abs_diff / |numerical_value|``.
        mismatched: How many elements of the block are out of tolerance.
        numerical: The finite-difference Jacobian block, of shape (input
            elements, output elements).
        analytical: The Jacobian block from ``fn``'s rules, in the same
            layout.

    Examples:
        Any JAX function can be checked, here a ``jax.custom_vjp`` whose
        rule is off by a factor of 2:

        >>> import jax
        >>> import numpy as np
        >>> import vjpkit
        >>> @jax.custom_vjp
        ... def double(x):
        ...     return 2 * x
        >>> double.defvjp(lambda x: (2 * x, None), lambda _, g: (4 * g,))
        >>> try:
        ...     vjpkit.gradcheck(double, (np.array([1.0, 2.0]),))
        ... except vjpkit.GradcheckError as e:
        ...     (block,) = e.mismatches
        >>> block.mode, block.output, block.input, block.mismatched
        ('backward', 'output 0', 'input 0', 2)
        >>> block.numerical.round(6).tolist(), block.analytical.tolist()
        ([[2.0, 0.0], [0.0, 2.0]], [[4.0, 0.0], [0.0, 4.0]])
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


JACOBIANS = ("backward", "forward")


def summary_rows(out: Output) -> list[np.ndarray]:
    """The summary rows on the host, each as [failed, max |a - n|, elements failing]."""
    rows = jax.device_get(out.summary)
    return [np.asarray(r, dtype=np.float64).reshape(-1).tolist() + [np.nan] * (3 - np.size(r)) for r in rows]


def warn(message: str) -> None:
    warnings.warn(f"gradcheck: {message}", stacklevel=_outside_vjpkit())


# vjpkit itself (this package's parent): warnings name the first frame outside it.
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def _outside_vjpkit() -> int:
    """The ``stacklevel`` of the nearest caller outside vjpkit, so that a warning names the user's line.

    A fixed level would name a line inside vjpkit when gradcheck is called
    through ``vjpkit.testing`` or the command line.
    """
    stack = traceback.extract_stack()[:-1]  # warn's caller first, from the innermost: stacklevel 1 is warn's frame
    level = 1
    for entry in reversed(stack):
        if not entry.filename.startswith(_PACKAGE_DIR):
            break
        level += 1
    return level


def trace_warnings(checker: Checker, notes: Notes, naming: Naming) -> list[str]:
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


def _pair(checker: Checker, j: int, k: int, naming: Naming) -> str:
    out, inp = checker.outputs[j], checker.inputs[k]
    return f"{naming.output(out.index, out.path)} with respect to {naming.input(inp.index, inp.path)}"


def fast_mode_problems(checker: Checker, out: Output, tol: Tolerances, naming: Naming) -> list[str]:
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


def jacobian_report(fn, checker, diff, fixed, tol, naming, first=None) -> tuple[list[str], list[JacobianMismatch]]:
    """Describes every mismatching block, from the first run's Jacobians or from the report variant's."""
    out, notes = first if first is not None and "numerical" in first[0].blocks else (None, None)
    if out is None:
        out, notes = checker.run(fn, diff, fixed, tol, report=True)
    assert notes is not None  # every run returns its record of rows
    summary = summary_rows(out)
    problems, mismatches = [], []
    for (check, j, k), s in zip(notes.rows, summary, strict=True):
        if check in JACOBIANS and s[0] > 0:
            m = _mismatch(check, checker.outputs[j], checker.inputs[k],
                          np.asarray(out.blocks["numerical"][k][j]),
                          np.asarray(out.blocks[check][k][j]), tol, naming)
            mismatches.append(m)
            problems.append(_describe(m, tol))
    return problems, mismatches


def _element(port: CheckedLeaf, flat: int) -> tuple:
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


def format_element(index: tuple) -> str:
    return "(" + ", ".join(str(i) for i in index) + ("," if len(index) == 1 else "") + ")"


def _describe(m: JacobianMismatch, tol: Tolerances) -> str:
    mode = " computed with forward mode" if m.mode == "forward" else ""
    return (
        f"Jacobian{mode} mismatch for {m.output} with respect to {m.input}:\n"
        f"  {m.mismatched} of {m.numerical.size} elements differ by more than "
        f"atol + rtol * |numerical| (atol={tol.atol:g}, rtol={tol.rtol:g}).\n"
        f"  worst: {m.output} element {format_element(m.output_element)} "
        f"with respect to {m.input} element {format_element(m.input_element)}\n"
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


def other_problems(checker: Checker, notes: Notes, summary: list, naming: Naming) -> list[str]:
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
        if failed <= 0 or check in JACOBIANS:
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
                f"{BATCHED_GRAD_SAMPLES} output gradients differs from a loop over them, {how_much}."
            )
    return problems


def reentrancy_problems(checker, first, second, tol, naming) -> list[str]:
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
