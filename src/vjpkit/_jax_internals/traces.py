"""core, partial_eval and ad: the current trace, which differentiation runs a rule, and a primitive's
linearization rule; where a trace stands (vmap, differentiation)."""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading
from typing import Any, Literal, Sequence

from ._lookup import _ad, _config, _core, _pe, _require, _require_module

# ---------------------------------------------------------------------------
# core and partial_eval: the current trace.

_trace_ctx = _require(_core, "trace_ctx", "jax._src.core")
_set_current_trace = _require(_core, "set_current_trace", "jax._src.core")
_DynamicJaxprTrace = _require(_pe, "DynamicJaxprTrace", "jax._src.interpreters.partial_eval")
_JaxprTrace = _require(_pe, "JaxprTrace", "jax._src.interpreters.partial_eval")
_JaxprTracer = _require(_pe, "JaxprTracer", "jax._src.interpreters.partial_eval")


def _enclosing_trace(kind: Any) -> Any:
    """The innermost active trace of type ``kind``, or None.

    It looks at the current trace, then each one it was started under (every
    supported JAX links ``parent_trace``): a plain loop, since this runs on
    every call on tracers.
    """
    trace = _trace_ctx.trace
    while trace is not None:
        if isinstance(trace, kind):
            return trace
        trace = getattr(trace, "parent_trace", None)
    return None


_EvalTrace = _require(_core, "EvalTrace", "jax._src.core")


def is_evaluating() -> bool:
    """Whether no transformation is active: JAX evaluates what is bound, on concrete arrays.

    Why: there a call runs the user's forward directly, as JAX runs a
    ``jax.custom_jvp``'s function (a ``jit = False`` class, op by op).
    """
    return type(_trace_ctx.trace) is _EvalTrace


def is_staging() -> bool:
    """Whether a staging trace (``jit``, ``scan``, ``checkpoint``, ...) is active.

    Why: calling an inner ``jax.jit`` while an outer one traces leaves a
    nested call in the program (extra HLO instructions); under a staging
    trace vjpkit binds its call directly so it inlines instead.
    """
    return _enclosing_trace(_DynamicJaxprTrace) is not None


def stages_here() -> bool:
    """Whether the current trace stages what is bound into a jaxpr (a ``DynamicJaxprTrace``: ``jit``, ``scan``, ...).

    Why: the equation of a call staged there carries its function's jaxpr;
    a transformation above it runs the call's rules instead, which bind
    again (a call that only reaches a jaxpr that way traces its function
    when JAX asks for its types).
    """
    return type(_trace_ctx.trace) is _DynamicJaxprTrace


def linearizes_by_jvp_here() -> bool:
    """Whether the current trace is a ``JVPTrace`` over partial evaluation: reverse mode (or ``jax.linearize``)
    before JAX 0.7 (and later JAX with ``jax_use_direct_linearize`` off).

    Why: a ``jax.jit`` called there is differentiated by its JVP, traced
    before JAX knows that it will be transposed, so a call inside it cannot
    tell reverse mode from forward mode (it traces ``jvp`` for its
    effects). A Function binds its call on that trace instead.
    """
    trace = _trace_ctx.trace
    return type(trace) is _JVPTrace and type(trace.parent_trace) is _JaxprTrace


def on_primal_trace(primals: Sequence[Any]) -> Any:
    """A context in which a JVP rule computes on the trace that owns its ``primals``.

    Why: JAX linearizes a JVP rule under partial evaluation (from JAX 0.7
    ``ad.linearize_from_jvp``; before, a ``JVPTrace`` over it), which would
    take every operation of forward, all known, through its rules (each
    inner ``jax.jit`` partially evaluated). Forward touches only primals, so
    it runs on their trace, as a ``custom_vjp``'s does.
    """
    trace = _trace_ctx.trace
    if type(trace) is _JaxprTrace and not any(isinstance(x, _JaxprTracer) for x in primals):
        return _set_current_trace(trace.parent_trace)
    return contextlib.nullcontext()


# ---------------------------------------------------------------------------
# interpreters.ad: which differentiation runs a rule.
#
# vjpkit's three primitives (the call, the tie, the tangent's
# ``linear_call``) learn it where JAX calls their rules, and pass it on to
# what they bind. A JVP rule runs under a partial-evaluation trace
# (``JaxprTrace``) exactly when JAX linearizes the primitive (reverse mode,
# and ``jax.linearize``): before JAX 0.7 from a ``JVPTrace`` over partial
# evaluation, from 0.7 by JAX's generic linearization
# (``ad.linearize_from_jvp``). JAX 0.9 on tells ``jax.linearize`` from
# reverse mode (``is_vjp``) to a primitive's linearization rule only: there
# each primitive's rule tells its JVP rule, then runs JAX's generic one.
# One case tells nothing: before JAX 0.7 reverse mode differentiates a
# ``jax.jit`` by its JVP (``jvp_jaxpr``), traced before it is transposed, so
# a rule inside it hears ``"jvp"`` (its tangent's rule is then traced for its
# effects, never run; a rule that cannot be traced says so where it runs).


_JVPTrace = _require(_ad, "JVPTrace", "jax._src.interpreters.ad")
_LinearizeTrace = _require(_ad, "LinearizeTrace", "jax._src.interpreters.ad")

# ``LinearizeTrace.is_vjp`` (JAX 0.9 on) tells ``jax.linearize`` from
# reverse mode; JAX 0.7 and 0.8 cannot tell, and both count as reverse mode.
LINEARIZE_IS_TOLD_FROM_VJP = "is_vjp" in inspect.signature(_LinearizeTrace).parameters

Differentiation = Literal["jvp", "traced_jvp", "linearize", "vjp"]

# JAX 0.7 on linearizes directly by default; before, reverse mode is a JVP under partial evaluation (and a jit's
# JVP is traced before JAX knows whether it transposes it). A JAX that dropped the flag linearizes directly.
_direct_linearize: Any = getattr(_config, "use_direct_linearize", None)


def linearizes_directly() -> bool:
    """Whether JAX linearizes directly (``LinearizeTrace``), so that a JVP rule runs for forward mode only."""
    return _direct_linearize is None or bool(_direct_linearize.value)


class _Told(threading.local):
    """What a linearization rule tells the JVP rule it runs next (JAX 0.9 on); None: nothing told."""

    differentiation: str | None = None


_told = _Told()


def differentiation_running_rule() -> Differentiation:
    """Which differentiation runs the JVP rule that calls this, first thing.

    ``"jvp"`` (forward mode), ``"linearize"``, ``"vjp"`` (reverse mode), or
    ``"traced_jvp"``: a JVP traced into a jaxpr where JAX does not linearize
    directly (a ``jit``'s, before JAX 0.7), which reverse mode may yet
    transpose. Why: reverse mode only records the tangent's ``linear_call``
    to transpose it (its jvp must not be traced for effects),
    ``jax.linearize`` splits the work on the residuals off it, and a call
    that may be transposed batches its tangent where ``backward`` needs it.
    Where JAX cannot tell ``jax.linearize`` from reverse mode (before 0.9),
    it says ``"vjp"``.
    """
    told = _told.differentiation
    if told is not None:
        _told.differentiation = None
        return told  # type: ignore[return-value]
    trace = _trace_ctx.trace
    if type(trace) is _JaxprTrace:
        return "vjp"
    if type(trace) is _DynamicJaxprTrace and not linearizes_directly():
        # A JVP traced into a jaxpr (a jit's, before JAX 0.7) that reverse mode may yet transpose.
        return "traced_jvp"
    return "jvp"


def differentiation_of_apply() -> str | None:
    """``"linearize"`` where ``jax.linearize`` linearizes the call being made (JAX 0.9 on), else None.

    Why: a call on tracers of a class without jvp raises there at once (JAX
    would otherwise fail only when the linear function runs). Read from the
    enclosing traces.
    """
    trace = _enclosing_trace(_LinearizeTrace)
    return None if trace is None or getattr(trace, "is_vjp", True) else "linearize"


# Every supported JAX has them; JAX consults them where it linearizes directly (by default from JAX 0.7).
_linearizations: Any = getattr(_ad, "primitive_linearizations", None)
_fallback_linearize: Any = getattr(_ad, "fallback_linearize_rule", None)
# JAX 0.9 on passes a linearization rule whether it linearizes for reverse mode first.
_LINEARIZATION_TOLD_IS_VJP = (
    _fallback_linearize is not None and "_is_vjp" in inspect.signature(_fallback_linearize).parameters
)


# JAX 0.11 on: a linearization rule returns residuals JAX stages itself too, and the linear function takes them.
_STRUCTURED_RESIDUALS = "structured_residuals" in getattr(_LinearizeTrace, "__annotations__", {})


def tell_jvp_rule_which_differentiation(primitive: Any) -> None:
    """Gives ``primitive`` a linearization rule that tells its JVP rule ``jax.linearize`` from reverse mode.

    JAX 0.9 on (``fallback_linearize_rule`` takes ``_is_vjp``): JAX's generic
    rule, the JVP rule partially evaluated, told first
    (``linearize_by_jvp_rule``). Older JAX tells nothing: nothing to register.
    """
    if _LINEARIZATION_TOLD_IS_VJP:
        register_linearization(primitive, functools.partial(linearize_by_jvp_rule, primitive))


def register_linearization(primitive: Any, rule: Any) -> bool:
    """Gives ``primitive`` a linearization rule: JAX then makes its linearized tracers.

    JAX consults it where it linearizes directly (by default from JAX 0.7).

    ``rule(is_vjp, nonzeros, primals, params)`` runs on the primals' trace
    and returns ``(primals_out, nonzeros_out, residuals, linearized)``;
    ``linearized(residuals, tangents)`` runs on the tangents' trace, and
    returns one tangent per output (``ad.Zero`` where ``nonzeros_out`` is
    False). JAX before 0.9 does not say whether reverse mode linearizes
    (``is_vjp`` is then True); JAX 0.11 adds structured residuals (none
    here). Returns False where a JAX has no such rules.
    """
    if _linearizations is None or _fallback_linearize is None:
        return False

    def linearize(*args: Any, **params: Any) -> Any:
        if _LINEARIZATION_TOLD_IS_VJP:
            is_vjp, nonzeros, primals = args[0], args[1], args[2:]
        else:
            is_vjp, nonzeros, primals = True, args[0], args[1:]
        outs, nonzeros_out, residuals, linearized = rule(is_vjp, nonzeros, primals, params)
        if _STRUCTURED_RESIDUALS:
            return outs, nonzeros_out, residuals, None, lambda res, _structured, *ts: linearized(res, ts)
        return outs, nonzeros_out, residuals, lambda res, *ts: linearized(res, ts)

    _linearizations[primitive] = linearize
    return True


def linearize_by_jvp_rule(primitive: Any, is_vjp: bool, nonzeros: Any, primals: Any, params: dict) -> Any:
    """JAX's generic linearization of ``primitive`` (its JVP rule under partial evaluation), told ``is_vjp``.

    For a linearization rule (``register_linearization``) that leaves a case
    to JAX; returns what that rule returns.
    """
    before = _told.differentiation
    _told.differentiation = "vjp" if is_vjp else "linearize"
    try:
        args = (is_vjp, nonzeros, *primals) if _LINEARIZATION_TOLD_IS_VJP else (nonzeros, *primals)
        result = _fallback_linearize(primitive, *args, **params)
    finally:
        _told.differentiation = before
    if _STRUCTURED_RESIDUALS:
        outs, nonzeros_out, residuals, _structured, linearized = result
        return outs, nonzeros_out, residuals, lambda res, ts: linearized(res, None, *ts)
    outs, nonzeros_out, residuals, linearized = result
    return outs, nonzeros_out, residuals, lambda res, ts: linearized(res, *ts)


# ---------------------------------------------------------------------------
# Where a trace stands: whether a batching rule's bind is differentiated on the spot, and
# whether a vmap is active (_tie.py, _call.py, _dispatch.py).


def differentiating_here() -> bool:
    """Whether the current trace is a ``JVPTrace`` or ``LinearizeTrace`` (it differentiates what is bound).

    Why: a batching rule runs with its ``BatchTrace``'s parent as the current
    trace (every supported JAX); the tie's outputs must be batched when that
    parent takes their derivative, which may vary along the batch. Relies on
    ``core.trace_ctx.trace``, ``ad.JVPTrace`` and ``ad.LinearizeTrace`` (every supported JAX).
    """
    return isinstance(_trace_ctx.trace, (_JVPTrace, _LinearizeTrace))


_batching_internal = _require_module("jax._src.interpreters.batching")
_BatchTrace = _require(_batching_internal, "BatchTrace", "jax._src.interpreters.batching")


def is_batching() -> bool:
    """Whether a ``jax.vmap`` (``BatchTrace``) is among the active traces.

    Why: under vmap ``apply`` binds its call directly (no jit of its own),
    which the call's batching rule batches. Every supported JAX chains
    traces through ``parent_trace``.
    """
    return _enclosing_trace(_BatchTrace) is not None
