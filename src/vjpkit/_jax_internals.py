"""The only module that reaches into ``jax._src``.

Checked against JAX 0.10.2 (``pyproject.toml`` pins ``jax>=0.10.2,<0.11``).
Each function says which private name it relies on, so that a JAX upgrade
that moves one fails here, loudly, rather than somewhere in a trace.
"""

from __future__ import annotations

import sys
from typing import Any, Callable, Sequence

import jax
from jax._src import config as _config
from jax._src.array import ArrayImpl
from jax._src import core as _core
from jax._src.interpreters import ad as _ad
from jax._src.interpreters import batching as _batching
from jax._src.interpreters import mlir as _mlir
from jax._src.interpreters import partial_eval as _pe

__all__ = ["ArrayImpl", "current_trace", "EvalTrace", "is_staging", "called_from_forward_mode", "linear_call", "symbolic_zero_like", "varying_axes"]

_DynamicJaxprTrace = _pe.DynamicJaxprTrace
_JVP_CUSTOM_VJP_CODE = _ad.JVPTrace.process_custom_vjp_call.__code__


# apply's fast path reads the current trace without a function call (~50 ns):
# ``type(current_trace.value) is EvalTrace`` means no transformation is
# tracing, so an all-concrete call may run the compiled program; under a
# trace (even with closed-over concrete arrays) it must inline instead.
# Relies on ``core.trace_state_strong_ref`` and ``core.EvalTrace``.
current_trace = _core.trace_state_strong_ref
EvalTrace = _core.EvalTrace


def is_staging() -> bool:
    """Whether a staging trace (``jit``, ``scan``, ``checkpoint``, ...) is active.

    Why: calling an inner ``jax.jit`` while an outer one traces leaves a
    nested call in the program (extra HLO instructions); under a staging
    trace vjpkit calls its ``custom_vjp`` directly so it inlines instead.
    Relies on ``core.trace_ctx.trace`` and each trace's ``parent_trace``.
    """
    trace = _core.trace_ctx.trace
    while trace is not None:
        if isinstance(trace, _DynamicJaxprTrace):
            return True
        trace = getattr(trace, "parent_trace", None)
    return False


def called_from_forward_mode(max_depth: int = 32) -> bool:
    """Whether a ``custom_vjp`` forward rule is being run by forward-mode AD.

    Why: JAX runs a ``custom_vjp``'s ``fwd`` both for reverse mode (through
    ``LinearizeTrace``) and for forward mode (through ``JVPTrace``); forward
    mode then fails later with "can't apply forward-mode autodiff (jvp) to a
    custom_vjp function", which cannot name the user's class. Looking for
    ``JVPTrace.process_custom_vjp_call`` among the callers lets vjpkit raise
    its own error while tracing. Only meaningful with
    ``jax_use_direct_linearize`` on (the default), where reverse mode goes
    through ``JVPTrace`` only to linearize a primitive that has no linearize
    rule (``jax.checkpoint``'s ``remat_p``): ``ad.fallback_linearize_rule``
    runs its JVP through ``ad.linearize_from_jvp``, which is not forward
    mode, so that frame further up the stack means reverse mode.
    """
    if not _config.use_direct_linearize.value:
        return False
    frame = sys._getframe(1)
    for _ in range(max_depth):
        if frame is None:
            return False
        if frame.f_code is _JVP_CUSTOM_VJP_CODE:
            return not _linearizing_by_jvp(frame)
        frame = frame.f_back
    return False


_LINEARIZE_FROM_JVP_CODE = _ad.linearize_from_jvp.__code__


def _linearizing_by_jvp(frame: Any) -> bool:
    """Whether ``ad.linearize_from_jvp`` is among ``frame``'s callers."""
    while frame is not None:
        if frame.f_code is _LINEARIZE_FROM_JVP_CODE:
            return True
        frame = frame.f_back
    return False


def varying_axes(x: Any) -> frozenset:
    """The ``jax.shard_map`` mesh axes along which ``x`` differs between devices.

    Why: inside ``shard_map`` the type of an array says whether it varies
    across devices, and a ``custom_vjp`` gradient must have its input's type.
    Relies on the aval's ``mat.varying`` (called ``vma`` before JAX 0.10).
    """
    return jax.typeof(x).mat.varying


def symbolic_zero_like(x: Any) -> Any:
    """A ``SymbolicZero`` tangent for primal ``x`` (float0 for integer ``x``)."""
    from jax.custom_derivatives import SymbolicZero

    return SymbolicZero(_core.typeof(x).strip_weak_type().to_tangent_aval())


# ---------------------------------------------------------------------------
# ``linear_call``: a function linear in some inputs, with its own transpose.
#
# Forward mode needs the user's ``jvp`` and reverse mode the user's
# ``backward`` on ONE function, which neither ``custom_jvp`` nor
# ``custom_vjp`` allows (jax#3996). vjpkit's ``custom_jvp`` rule returns its
# tangent through this primitive: evaluating it runs ``apply`` (the user's
# jvp); transposing it binds the same primitive with ``apply`` and
# ``transpose`` swapped (so reverse mode runs the user's backward, and the
# transpose of the transpose is the jvp again). Unlike JAX's own
# ``custom_derivatives.linear_call`` it batches (both rules, lazily, under
# ``jax.vmap``) and its JVP also differentiates through the residuals, so
# ``jax.hessian``, ``jacfwd(jacrev)`` and ``jacrev(jacfwd)`` are right.

_linear_call_p = _core.Primitive("vjpkit_linear_call")
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
_mlir.register_lowering(_linear_call_p, _mlir.lower_fun(_linear_call_impl, multiple_results=True))


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
    accumulator objects. (harden: belongs with ``_transpose_by_jax``.)
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
    if any(_ad.is_undefined_primal(r) for r in res):
        raise TypeError(f"{name}: internal error: a residual of linear_call is linear.")
    in_avals = tuple(x.aval for x in lin)
    zero = tuple(type(ct) is _ad.Zero for ct in cts)
    cts = [_ad.instantiate_zeros(ct) for ct in cts]
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
        return rule(res, tuple(None if z else ct for z, ct in zip(zero, cts)))

    return rule_with_zeros


def _linear_call_jvp(primals, tangents, *, num_res, apply, transpose, out_avals, name):
    params = dict(num_res=num_res, apply=apply, transpose=transpose, out_avals=out_avals, name=name)
    res, lin = _split(primals, num_res)
    d_res, d_lin = _split(tangents, num_res)
    if all(type(t) is _ad.Zero for t in d_res):
        # Only the linear inputs move: the derivative is the call itself, same rules.
        out = _linear_call_p.bind(*primals, **params)
        if all(type(t) is _ad.Zero for t in d_lin):
            return out, [_ad.Zero(a.to_tangent_aval()) for a in out_avals]
        return out, _linear_call_p.bind(*res, *map(_ad.instantiate_zeros, d_lin), **params)
    # The residuals move too: differentiate the rule's JAX code along every
    # moving input at once. (Splitting it into call(res, d_lin) + d/d_res
    # computes shared factors twice, and XLA does not merge a@w + b@w.) Inputs
    # with symbolic-zero tangents stay constants, so no work is spent on them.
    # The linearization of JAX code is transposable: reverse-over-forward works.
    moving = [i for i, t in enumerate(tangents) if type(t) is not _ad.Zero]

    def along_moving(*values: Any) -> list:
        full = list(primals)
        for i, value in zip(moving, values):
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
        x if d is None else _batching.moveaxis(x, d, 0) for x, d in zip(res, res_dims)
    )
    res_axes = tuple(None if d is None else 0 for d in res_dims)
    # Every linear input batched at 0: the transposed rule then maps cleanly.
    lin = tuple(_batching.bdim_at_front(x, d, size) for x, d in zip(lin, lin_dims))

    def vmapped(rule: Callable) -> Callable:
        def batched_rule(r: tuple, xs: tuple) -> list:
            return jax.vmap(lambda r_, xs_: list(rule(r_, xs_)), in_axes=(res_axes, 0))(r, xs)

        batched_rule.takes_symbolic_zeros = getattr(rule, "takes_symbolic_zeros", False)
        return batched_rule

    batched_out_avals = tuple(
        _core.ShapedArray((size, *a.shape), a.dtype, weak_type=a.weak_type) for a in out_avals
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


_ad.primitive_jvps[_linear_call_p] = _linear_call_jvp
_ad.primitive_transposes[_linear_call_p] = _linear_call_transpose
_batching.fancy_primitive_batchers[_linear_call_p] = _linear_call_batch


# ---------------------------------------------------------------------------
# A thread-local mode that is part of JAX's compile-cache keys.


def thread_local_flag(name: str) -> Any:
    """A boolean JAX configuration state: ``.value``, ``.swap_local(v)``, ``.set_local(prev)``.

    Why: ``vjpkit.detect_anomaly`` changes what vjpkit traces, so a program
    that ``jax.jit`` traced without it must not be reused with it (nor the
    reverse). JAX puts such states in its dispatch and trace cache keys, and
    keeps their local values per thread. Relies on ``jaxlib``'s
    ``config_ext.Config`` with ``include_in_jit_key`` and
    ``include_in_trace_context``, as ``jax._src.config`` builds its own.
    """
    return _config.config_ext.Config(
        name, False, include_in_jit_key=True, include_in_trace_context=True
    )
