"""``linear_call``: a function linear in some inputs, with its own transpose.

Forward mode needs the user's ``jvp`` and reverse mode the user's
``backward`` on ONE function, which neither ``custom_jvp`` nor
``custom_vjp`` allows (jax#3996). vjpkit's ``custom_jvp`` rule returns its
tangent through this primitive: evaluating it runs ``apply`` (the user's
jvp); transposing it binds the same primitive with ``apply`` and
``transpose`` swapped (so reverse mode runs the user's backward, and the
transpose of the transpose is the jvp again). Unlike JAX's own
``custom_derivatives.linear_call`` it batches (both rules, lazily, under
``jax.vmap``) and its JVP also differentiates through the residuals, so
``jax.hessian``, ``jacfwd(jacrev)`` and ``jacrev(jacfwd)`` are right.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp

from ._jax_internals import Primitive, ShapedArray, ad, batching, mlir

_linear_call_p = Primitive("vjpkit_linear_call")
_linear_call_p.multiple_results = True


def linear_call(
    residuals: Sequence[Any],
    linear_inputs: Sequence[Any],
    *,
    apply: Callable,
    transpose: Callable | None,
    out_avals: Sequence[Any],
    name: str,
) -> list:
    """``apply(residuals, linear_inputs)``, linear in ``linear_inputs``.

    ``transpose(residuals, cotangents)`` returns one cotangent per linear
    input; ``None`` means "transpose ``apply`` with ``jax.linear_transpose``".
    A ``transpose`` with the attribute ``takes_symbolic_zeros`` receives
    ``None`` for cotangents that JAX knows are zero.
    ``out_avals`` are ``apply``'s output types (no tracing to find them).
    """
    return _linear_call_p.bind(
        *residuals,
        *linear_inputs,
        num_res=len(residuals),
        apply=apply,
        transpose=transpose,
        out_avals=tuple(out_avals),
        name=name,
    )


def _split(args: Sequence[Any], num_res: int) -> tuple[tuple, tuple]:
    return tuple(args[:num_res]), tuple(args[num_res:])


def _linear_call_impl(*args, num_res, apply, transpose, out_avals, name):
    res, lin = _split(args, num_res)
    return list(apply(res, lin))


_linear_call_p.def_impl(_linear_call_impl)
_linear_call_p.def_abstract_eval(lambda *args, out_avals, **_: list(out_avals))
mlir.register_lowering(_linear_call_p, mlir.lower_fun(_linear_call_impl, multiple_results=True))


def _transpose_by_jax(apply: Callable, name: str, in_avals: Sequence[Any]) -> Callable:
    def transposed(res: tuple, cts: tuple) -> list:
        structs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in in_avals]
        try:
            linear_transpose = jax.linear_transpose(lambda *lin: list(apply(res, lin)), *structs)
            return list(linear_transpose(list(cts)))
        except Exception as e:  # JAX raises several types for non-linear code
            raise TypeError(
                f"{name} defines jvp but no backward, so reverse mode (jax.grad, "
                f"jax.vjp, jax.jacrev) transposes {name}.jvp, which must then be "
                "linear in the tangents and written in transposable JAX "
                f"operations; transposing it failed: {_transpose_failure(e)}. Define "
                f"{name}.backward(ctx, *grad_outputs) instead."
            ) from e

    return transposed


def _transpose_failure(e: Exception) -> str:
    """What JAX's failed transpose says, or what it means where JAX says nothing useful.

    Why: a product of two tangents, or a comparison of one, fails an internal
    assertion of JAX's transpose, whose text is empty or a tuple of JAX's
    accumulator objects.
    """
    text = str(e).strip()
    if isinstance(e, AssertionError) or not text:
        return (
            "JAX met an operation that is not linear in the tangents (such as a product of "
            "two tangents, or a comparison or branch on one)"
        )
    return text


def _linear_call_transpose(cts, *args, num_res, apply, transpose, out_avals, name):
    res, lin = _split(args, num_res)
    if any(ad.is_undefined_primal(r) for r in res):
        raise TypeError(f"{name}: internal error: a residual of linear_call is linear.")
    in_avals = tuple(x.aval for x in lin)
    zero = tuple(type(ct) is ad.Zero for ct in cts)
    cts = [ad.instantiate_zeros(ct) for ct in cts]
    if transpose is None:
        transpose = _transpose_by_jax(apply, name, in_avals)
    elif any(zero) and getattr(transpose, "takes_symbolic_zeros", False):
        # The rule wants to know which cotangents JAX knows are zero (vjpkit:
        # backward sees None for them when materialization is off).
        transpose = _with_zeros_as_none(transpose, zero)
    cts_in = linear_call(res, cts, apply=transpose, transpose=apply, out_avals=in_avals, name=name)
    return [None] * num_res + list(cts_in)


def _with_zeros_as_none(rule: Callable, zero: tuple) -> Callable:
    def rule_with_zeros(res: tuple, cts: tuple) -> list:
        return rule(res, tuple(None if z else ct for z, ct in zip(zero, cts, strict=True)))

    return rule_with_zeros


def _linear_call_jvp(primals, tangents, *, num_res, apply, transpose, out_avals, name):
    params = dict(num_res=num_res, apply=apply, transpose=transpose, out_avals=out_avals, name=name)
    res, lin = _split(primals, num_res)
    d_res, d_lin = _split(tangents, num_res)
    if all(type(t) is ad.Zero for t in d_res):
        # Only the linear inputs move: the derivative is the call itself, same rules.
        out = _linear_call_p.bind(*primals, **params)
        if all(type(t) is ad.Zero for t in d_lin):
            return out, [ad.Zero(a.to_tangent_aval()) for a in out_avals]
        return out, _linear_call_p.bind(*res, *map(ad.instantiate_zeros, d_lin), **params)
    # The residuals move too: differentiate the rule's JAX code along every
    # moving input at once. (Splitting it into call(res, d_lin) + d/d_res
    # computes shared factors twice, and XLA does not merge a@w + b@w.) Inputs
    # with symbolic-zero tangents stay constants, so no work is spent on them.
    # The linearization of JAX code is transposable: reverse-over-forward works.
    moving = [i for i, t in enumerate(tangents) if type(t) is not ad.Zero]

    def along_moving(*values: Any) -> list:
        full = list(primals)
        for i, value in zip(moving, values, strict=True):
            full[i] = value
        res_, lin_ = _split(full, num_res)
        return list(apply(res_, lin_))

    out, tangent_out = jax.jvp(
        along_moving, [primals[i] for i in moving], [tangents[i] for i in moving]
    )
    return list(out), list(tangent_out)


def _linear_call_batch(axis_data, args, dims, *, num_res, apply, transpose, out_avals, name):
    if all(d is None for d in dims):
        out = linear_call(
            args[:num_res], args[num_res:], apply=apply, transpose=transpose, out_avals=out_avals, name=name
        )
        return out, [None] * len(out)
    size = axis_data.size
    res, lin = _split(args, num_res)
    res_dims, lin_dims = _split(dims, num_res)
    res = tuple(
        x if d is None else jnp.moveaxis(x, d, 0) for x, d in zip(res, res_dims, strict=True)
    )
    res_axes = tuple(None if d is None else 0 for d in res_dims)
    # Every linear input batched at 0: the transposed rule then maps cleanly.
    lin = tuple(batching.bdim_at_front(x, d, size) for x, d in zip(lin, lin_dims, strict=True))

    def vmapped(rule: Callable) -> Callable:
        def batched_rule(r: tuple, xs: tuple) -> list:
            return jax.vmap(lambda r_, xs_: list(rule(r_, xs_)), in_axes=(res_axes, 0))(r, xs)

        batched_rule.takes_symbolic_zeros = getattr(rule, "takes_symbolic_zeros", False)  # type: ignore[attr-defined]
        return batched_rule

    batched_out_avals = tuple(
        ShapedArray((size, *a.shape), a.dtype, weak_type=a.weak_type) for a in out_avals
    )
    out = linear_call(
        res,
        lin,
        apply=vmapped(apply),
        transpose=None if transpose is None else vmapped(transpose),
        out_avals=batched_out_avals,
        name=name,
    )
    return out, [0] * len(out)


ad.primitive_jvps[_linear_call_p] = _linear_call_jvp
ad.primitive_transposes[_linear_call_p] = _linear_call_transpose
batching.fancy_primitive_batchers[_linear_call_p] = _linear_call_batch
