"""``gradgradcheck``: gradcheck of the VJP, as a function of (inputs, cotangents)."""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from .. import _jax_internals
from .._function import reject_torch_function
from .._tree import is_array
from .api import run_check
from .checkers import CACHE, DerivedFunction
from .jacobian import Notes, on_real_views
from .leaves import (
    CheckedLeaf,
    differentiable_outputs,
    input_leaves,
    is_inexact,
    real_view_shapes,
    signature,
    split_inputs,
)
from .options import Naming, Options, Tolerances, as_args


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

    The checked function maps ``(*inputs, *grad_outputs)`` to the
    gradients of ``fn``'s differentiable inputs, ``jax.vjp(fn, *inputs)``
    pulled back along ``grad_outputs``; it is differentiated with respect
    to both. This exercises differentiating through ``backward`` (which
    ``once_differentiable`` forbids). The keyword options (``eps``,
    ``atol``, ``rtol``, ``raise_exception``, ``fast_mode``, ``nondet_tol``,
    ``check_undefined_grad``, ``check_batched_grad``, ``check_forward_ad``,
    ``check_backward_ad``) are `gradcheck`'s, applied to the VJP
    function (``check_forward_ad`` checks forward-over-reverse).

    Args:
        fn: as for `gradcheck`.
        inputs: as for `gradcheck`.
        grad_outputs: one cotangent per differentiable output leaf of ``fn``
            (in ``jax.tree_util.tree_leaves`` order), as a tuple or a single
            array. Default: seeded uniform(-1, 1) float64 values.

    Returns:
        True when the check passes; False on failure when
        ``raise_exception=False``.

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
        >>> vjpkit.gradgradcheck(Cube.apply, (np.array([1.0, -2.0, 0.5]),))
        True
    """
    reject_torch_function(fn, "vjpkit.gradgradcheck")
    options = Options(
        fast_mode=bool(fast_mode),
        check_undefined_grad=bool(check_undefined_grad),
        check_batched_grad=bool(check_batched_grad),
        check_forward_ad=bool(check_forward_ad),
        check_backward_ad=bool(check_backward_ad),
    )
    tolerances = Tolerances(float(eps), float(atol), float(rtol), float(nondet_tol))
    args = as_args(inputs)
    with _jax_internals.enable_x64(True):
        outputs = output_leaves(fn, args)
    if grad_outputs is None:
        rng = np.random.default_rng(0)
        cotangents = tuple(
            rng.uniform(-1.0, 1.0, p.shape) + 1j * rng.uniform(-1.0, 1.0, p.shape)
            if p.is_complex
            else rng.uniform(-1.0, 1.0, p.shape)
            for p in outputs
        )
    else:
        cotangents = as_args(grad_outputs)
        check_grad_outputs(cotangents, outputs)
    vjp_fn = VJPOf(fn, len(args))
    naming = Naming(n_args=len(args))
    return run_check(vjp_fn, args + cotangents, options, tolerances, naming, raise_exception)


class VJPOf(DerivedFunction):
    """``(*args, *cotangents) -> gradients of args`` for ``fn`` (its checkers are cached with ``fn``'s)."""

    def __init__(self, fn: Callable, n_args: int):
        self.fn, self.n_args = fn, n_args

    def cache_part(self) -> Any:
        return ("vjp", self.n_args)

    def __call__(self, *all_args: Any) -> tuple:
        args, cotangents = all_args[: self.n_args], all_args[self.n_args :]
        split, diff, fixed = split_inputs(args)

        def outputs(d: list) -> list:
            return [y for _, y in differentiable_outputs(self.fn(*split.merge(d, fixed)))]

        ys, pullback = jax.vjp(outputs, list(diff))
        cts = [jnp.asarray(c).astype(y.dtype) for c, y in zip(jax.tree_util.tree_leaves(cotangents), ys, strict=True)]
        (grads,) = pullback(cts)
        given = iter(grads)
        return split.layout.combine([next(given) if p else None for p in split.perturbed], keep_static=False)


def output_leaves(fn: Callable, args: tuple) -> list[CheckedLeaf]:
    """fn's differentiable output leaves at these arguments (traced once, cached)."""
    split, diff, fixed = split_inputs(args)
    key = ("outputs", split.key, signature(diff, fixed), _jax_internals.trace_configuration())

    def trace() -> list[CheckedLeaf]:
        notes, inputs = Notes(), input_leaves(split, diff)
        jax.eval_shape(on_real_views(fn, split, inputs, notes), real_view_shapes(inputs), tuple(fixed))
        return notes.outputs

    return CACHE.get(fn, key, trace)


def check_grad_outputs(cotangents: tuple, outputs: list[CheckedLeaf]) -> None:
    leaves = jax.tree_util.tree_leaves(cotangents)
    want = [p.shape for p in outputs]
    if [tuple(np.shape(c)) for c in leaves] != want or not all(is_array(c) and is_inexact(c) for c in leaves):
        raise ValueError(
            f"gradgradcheck: grad_outputs must hold one floating-point array per "
            f"differentiable output of fn, with shapes {want}; got "
            f"{[f'{type(c).__name__}{tuple(np.shape(c))}' for c in leaves]}."
        )
