"""``gradcheck``: the public entry point, and the course of one check."""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from .. import _jax_internals
from .._function import reject_torch_function
from .checkers import checker_for
from .leaves import split_inputs
from .options import DEFAULT_NAMING, Options, Tolerances, as_args, validate
from .report import (
    JACOBIANS,
    GradcheckError,
    JacobianMismatch,
    fast_mode_problems,
    jacobian_report,
    other_problems,
    reentrancy_problems,
    summary_rows,
    trace_warnings,
    warn,
)


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
        atol: absolute tolerance, as in ``numpy.allclose(analytical, numerical)``.
        rtol: relative tolerance, as in ``numpy.allclose(analytical, numerical)``.
        raise_exception: raise `GradcheckError` on failure (default),
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

    Examples:
        >>> import numpy as np
        >>> import vjpkit
        >>> class Cube(vjpkit.Function):
        ...     @staticmethod
        ...     def forward(ctx, x):
        ...         ctx.save_for_backward(x)
        ...         return x**3
        ...
        ...     @staticmethod
        ...     def backward(ctx, g):
        ...         (x,) = ctx.saved_tensors
        ...         return 3 * x**2 * g
        >>> x = np.array([1.0, -2.0, 0.5])  # float64: the check computes in float64
        >>> vjpkit.gradcheck(Cube.apply, (x,))
        True

        A wrong backward fails: `GradcheckError`, whose message is the
        report, or False:

        >>> class WrongCube(vjpkit.Function):
        ...     @staticmethod
        ...     def forward(ctx, x):
        ...         ctx.save_for_backward(x)
        ...         return x**3
        ...
        ...     @staticmethod
        ...     def backward(ctx, g):
        ...         (x,) = ctx.saved_tensors
        ...         return 2 * x**2 * g
        >>> vjpkit.gradcheck(WrongCube.apply, (x,), raise_exception=False)
        False
    """
    reject_torch_function(fn, "vjpkit.gradcheck")
    options = Options(
        fast_mode=bool(fast_mode),
        check_undefined_grad=bool(check_undefined_grad),
        check_batched_grad=bool(check_batched_grad),
        check_forward_ad=bool(check_forward_ad),
        check_backward_ad=bool(check_backward_ad),
    )
    tolerances = Tolerances(float(eps), float(atol), float(rtol), float(nondet_tol))
    return run_check(fn, as_args(inputs), options, tolerances, DEFAULT_NAMING, raise_exception)


def run_check(fn, args, options, tol, naming, raise_exception) -> bool:
    """One check, in float64 whatever the process-wide x64 setting (gradgradcheck's too)."""
    validate(options, tol)
    try:
        with _jax_internals.enable_x64(True):
            _check(fn, args, options, tol, naming)
    except GradcheckError:
        if raise_exception:
            raise
        return False
    return True


def _check(fn, args, options, tol, naming) -> None:
    """Runs the compiled checking program; a failure's report may need a second, reporting program."""
    split, diff, fixed = split_inputs(args)
    if not diff:
        raise ValueError(
            "gradcheck: no floating-point or complex array among the inputs, so there is "
            "nothing to differentiate. Integer arrays and non-array inputs (Python scalars, "
            "strings) are held fixed; pass jnp.asarray(c, dtype=float) to check a scalar."
        )
    for (index, path), v in zip(split.diff_sites(), diff, strict=True):
        if np.dtype(v.dtype) not in (np.float64, np.complex128):
            warn(
                f"{naming.input(index, path)} has dtype {np.dtype(v.dtype).name}; gradcheck casts it "
                "to double precision and checks fn there, since finite differences in single "
                "precision are too inaccurate to compare with. Pass float64 inputs to silence this warning."
            )
    checker = checker_for(fn, split, diff, fixed, options)
    out, notes = checker.run(fn, diff, fixed, tol)
    summary = summary_rows(out)
    for message in trace_warnings(checker, notes, naming):
        warn(message)
    problems: list[str] = []
    mismatches: list[JacobianMismatch] = []
    if options.fast_mode:
        fast_problems = fast_mode_problems(checker, out, tol, naming)
        if fast_problems:
            problems.append("\n".join(fast_problems))
            slow = checker_for(fn, split, diff, fixed, options._replace(fast_mode=False))
            slow_problems, mismatches = jacobian_report(fn, slow, diff, fixed, tol, naming)
            problems.append(
                "The full Jacobians (slow mode), for the complete picture:\n\n" + "\n\n".join(slow_problems)
                if slow_problems else
                "The full Jacobians (slow mode) agree element by element within atol and rtol: fast "
                "mode failed only through its projected tolerance. Use fast_mode=False for this function."
            )
    elif any(s[0] > 0 for (check, _, _), s in zip(notes.rows, summary, strict=True) if check in JACOBIANS):
        problems, mismatches = jacobian_report(fn, checker, diff, fixed, tol, naming, (out, notes))
    problems += other_problems(checker, notes, summary, naming)
    if not problems and checker.rerun and options.check_backward_ad:
        again, _ = checker.run(fn, diff, fixed, tol)
        problems += reentrancy_problems(checker, out.analytical, again.analytical, tol, naming)
    if checker.forward_unavailable is not None:
        reason = f"{type(checker.forward_unavailable).__name__}: {checker.forward_unavailable}"
        if not options.check_backward_ad:
            problems.append(
                "Nothing was checked: check_backward_ad=False and fn has no forward mode for "
                f"check_forward_ad ({reason})"
            )
        else:
            warn(f"skipped check_forward_ad because fn has no forward mode ({reason})")
    if problems:
        raise GradcheckError("\n\n".join(problems), mismatches)
