"""core, partial_eval and ad: the current trace, which differentiation runs a rule, and reverse mode's
linearization of a Function; where a trace stands (vmap, eager shard_map)."""

from __future__ import annotations

import contextlib
import inspect
import sys
import types
from typing import Any, Literal, Sequence

import jax as _jax

from ._lookup import _ad, _config, _core, _missing, _pe, _require, _require_module, ad

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


def is_staging() -> bool:
    """Whether a staging trace (``jit``, ``scan``, ``checkpoint``, ...) is active.

    Why: calling an inner ``jax.jit`` while an outer one traces leaves a
    nested call in the program (extra HLO instructions); under a staging
    trace vjpkit calls its ``custom_jvp`` directly so it inlines instead.
    """
    return _enclosing_trace(_DynamicJaxprTrace) is not None


def on_primal_trace(primals: Sequence[Any]) -> Any:
    """A context in which a ``custom_jvp`` rule computes on the trace that owns its ``primals``.

    Why: direct linearization (JAX 0.7 on) runs a rule JAX meets
    (``jax.linearize``; a jaxpr's call) under partial evaluation
    (``ad.linearize_from_jvp``), which would take every operation of forward,
    all known, through its rules (each inner ``jax.jit`` partially evaluated).
    Forward touches only primals, so it runs on their trace, as a
    ``custom_vjp``'s does. Before JAX 0.7 the primals are that trace's own.
    """
    trace = _trace_ctx.trace
    if type(trace) is _JaxprTrace and not any(isinstance(x, _JaxprTracer) for x in primals):
        return _set_current_trace(trace.parent_trace)
    return contextlib.nullcontext()


# ---------------------------------------------------------------------------
# interpreters.ad: which differentiation runs a rule.
#
# JAX runs a custom_vjp's forward rule, and a custom_jvp's rule, for forward
# mode (``JVPTrace``), ``jax.linearize`` and reverse mode alike; only the
# trace whose method calls the rule says which. No public API tells, so
# ``differentiation`` reads the callers' frames (and, for ``apply``, the
# enclosing traces). It is vjpkit's only frame walk, and no other way exists:
# the rule runs under a partial-evaluation trace (reverse mode and
# ``jax.linearize``) or the ``JVPTrace``'s parent (``jax.jvp``), and neither
# links to the differentiating trace, which only the calling frame holds.

if hasattr(_config, "use_direct_linearize"):  # every supported JAX (on by default from 0.7)
    _direct_linearize: Any = _config.use_direct_linearize
else:  # a JAX that dropped the flag linearizes directly, always
    _direct_linearize = types.SimpleNamespace(value=True)

_JVPTrace = _require(_ad, "JVPTrace", "jax._src.interpreters.ad")
_LinearizeTrace = _require(_ad, "LinearizeTrace", "jax._src.interpreters.ad")


def _code(owner: Any, name: str, where: str) -> Any:
    return _require(owner, name, where).__code__


_JVP_CUSTOM_JVP = _code(_JVPTrace, "process_custom_jvp_call", "jax._src.interpreters.ad.JVPTrace")
_JVP_PRIMITIVE = _code(_JVPTrace, "process_primitive", "jax._src.interpreters.ad.JVPTrace")
_LINEARIZE_CUSTOM_JVP = _code(_LinearizeTrace, "process_custom_jvp_call", "jax._src.interpreters.ad.LinearizeTrace")
_LINEARIZE_PRIMITIVE = _code(_LinearizeTrace, "process_primitive", "jax._src.interpreters.ad.LinearizeTrace")

# ``LinearizeTrace.is_vjp`` (JAX 0.9 on) tells ``jax.linearize`` from reverse
# mode; JAX 0.7 and 0.8 cannot tell, and both count as reverse mode.
LINEARIZE_IS_TOLD_FROM_VJP = "is_vjp" in inspect.signature(_LinearizeTrace).parameters
# Without direct linearization (before JAX 0.7) ``jax.jvp`` of a jitted
# function that ``jax.grad`` already differentiated reuses reverse mode's
# record of the call (made without tracing its jvp, so without its effects).
JVP_AFTER_GRAD_KEEPS_ORDERED_EFFECTS = bool(_direct_linearize.value)


def _is_vjp(frame: Any) -> bool:
    """Whether the ``LinearizeTrace`` running in ``frame`` linearizes for reverse mode (not ``jax.linearize``)."""
    return getattr(frame.f_locals.get("self"), "is_vjp", True)


def _over_partial_eval(frame: Any) -> bool:
    """Whether the ``JVPTrace`` running in ``frame`` stages its tangents for reverse mode (before JAX 0.7)."""
    return isinstance(getattr(frame.f_locals.get("self"), "parent_trace", None), _JaxprTrace)


def differentiation(caller: Literal["custom_jvp rule", "apply"]) -> str | None:
    """How JAX is differentiating the call being made: ``"jvp"``, ``"linearize"``, ``"vjp"`` or None.

    ``caller`` says where the question is asked:

    - ``"custom_jvp rule"``: a primitive bound in a ``custom_jvp`` rule. Why:
      reverse mode only records vjpkit's ``linear_call`` to transpose it, and
      must not trace the Function's jvp to learn its effects.
    - ``"apply"``: a call on tracers. Why: once a jitted program has been
      differentiated in reverse mode, JAX reuses the forward rule it traced,
      so only the enclosing ``LinearizeTrace`` says ``jax.linearize``.

    None where none is found. Where ``LinearizeTrace`` cannot tell
    ``jax.linearize`` from reverse mode (JAX 0.7 and 0.8), it says ``"vjp"``.
    """
    if caller == "apply":
        trace = _enclosing_trace(_LinearizeTrace)
        return None if trace is None else "vjp" if getattr(trace, "is_vjp", True) else "linearize"
    # A primitive bound in a custom_jvp rule.
    frame: Any = sys._getframe(1)  # the callers, walked by plain loops (this runs on every such bind)
    if _direct_linearize.value:  # reverse mode and jax.linearize run the rule from a LinearizeTrace method
        while frame is not None:
            if frame.f_code is _LINEARIZE_CUSTOM_JVP or frame.f_code is _LINEARIZE_PRIMITIVE:
                return "vjp" if _is_vjp(frame) else "linearize"
            frame = frame.f_back
        return None
    # Before JAX 0.7 reverse mode runs it from a JVPTrace over partial evaluation.
    if isinstance(_trace_ctx.trace, _JaxprTrace):
        return "vjp"
    while frame is not None:
        if (frame.f_code is _JVP_CUSTOM_JVP or frame.f_code is _JVP_PRIMITIVE) and _over_partial_eval(frame):
            return "vjp"
        frame = frame.f_back
    return None


# ---------------------------------------------------------------------------
# interpreters.ad: reverse mode's linearization of a Function, made by vjpkit
# (``Program.linearize``), as JAX makes a ``custom_vjp``'s: JAX's for a
# custom_jvp partially evaluates the rule and evaluates its jaxpr again
# (JAX 0.7 on), or runs the rule and its checks under a ``JVPTrace`` over
# partial evaluation (before 0.7, where that trace is reverse mode's and
# ``jax.linearize``'s alike, as ``differentiation`` says).

_LinearizeTracer = _require(_ad, "LinearizeTracer", "jax._src.interpreters.ad")
_JVPTracer = _require(_ad, "JVPTracer", "jax._src.interpreters.ad")
on_trace = _set_current_trace  # a context in which the trace passed is the current one


def reverse_linearize_trace() -> Any:
    """The current trace if it linearizes for reverse mode: a ``LinearizeTrace`` (``is_vjp``: JAX 0.9 on;
    before, always), or a ``JVPTrace`` over partial evaluation (before JAX 0.7)."""
    trace = _trace_ctx.trace
    if type(trace) is _LinearizeTrace:
        return trace if getattr(trace, "is_vjp", True) else None
    return trace if type(trace) is _JVPTrace and type(trace.parent_trace) is _JaxprTrace else None


def linearize_inputs(trace: Any, values: Sequence[Any]) -> tuple[Any, Any, list, list]:
    """The traces for primals and for tangents, and the primal and the tangent (None: a known zero) of each value.

    Under a ``JVPTrace`` both are its partial evaluation's trace, unless every
    primal is known there: they then run on the trace that holds their values.
    """
    pairs = [trace.to_primal_tangent_pair(value) for value in values]
    primals, tangents = [p for p, _ in pairs], [None if type(t) is ad.Zero else t for _, t in pairs]
    if type(trace) is not _JVPTrace:
        return trace.parent_trace, trace.tangent_trace, primals, tangents
    partial = trace.parent_trace
    if all(type(p) is not _JaxprTracer or (p._trace is partial and p.is_known()) for p in primals):
        primals = [p.pval.get_known() if type(p) is _JaxprTracer else p for p in primals]
        return partial.parent_trace, partial, primals, tangents
    return partial, partial, primals, tangents


def linearized_output(trace: Any, primal: Any, tangent: Any) -> Any:
    """An output of ``trace`` from its primal and its tangent (None: zero, and the output is the primal)."""
    if tangent is None:
        return primal
    return (_JVPTracer if type(trace) is _JVPTrace else _LinearizeTracer)(trace, primal, tangent)


# ---------------------------------------------------------------------------
# Where a trace stands: whether a batching rule's bind is differentiated on the spot, and
# whether a vmap is active (_tie.py, _dispatch.py, _program.py); debug info for a custom_jvp's rule.


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

    Why: under vmap ``apply`` calls its ``custom_jvp`` directly, which JAX
    batches as a plain one, and a tangent's ``linear_call`` carries its
    primals' batch axes (``_program.py``). Every supported JAX chains traces
    through ``parent_trace``.
    """
    return _enclosing_trace(_BatchTrace) is not None


def _code_in(wrapper: Any, name: str, where: str) -> Any:
    """The code of function ``name``, which JAX wraps (a ``functools.partial`` of it, in every supported JAX)."""
    for candidate in (wrapper, *getattr(wrapper, "args", ())):
        code = getattr(candidate, "__code__", None)
        if code is not None and code.co_name == name:
            return code
    raise _missing(f"{where}.{name}")


_BATCH_CUSTOM_JVP = _code_in(
    _require(_batching_internal, "batch_custom_jvp_subtrace", "jax._src.interpreters.batching"),
    "batch_custom_jvp_subtrace", "jax._src.interpreters.batching",
)


def vmap_batches_here() -> bool:
    """Whether a ``jax.vmap`` batches what is bound now: under an active vmap, or traced for one to batch.

    Why: a tangent's ``linear_call`` must then carry its outputs' batch
    axes (``_linear_call.py``). The second case: a ``custom_jvp`` called in a
    jaxpr (``jit``, ``scan``, ``cond``, ``checkpoint`` inside the vmap),
    differentiated later, has its rule traced to a jaxpr of its own and
    evaluated under the vmap, by ``batching.batch_custom_jvp_subtrace``
    (every supported JAX), found among the callers' frames.
    """
    if is_batching():
        return True
    frame = sys._getframe(1) if is_staging() else None
    while frame is not None and frame.f_code is not _BATCH_CUSTOM_JVP:
        frame = frame.f_back
    return frame is not None


_BATCH_CUSTOM_JVP_CALL = _code(_BatchTrace, "process_custom_jvp_call", "jax._src.interpreters.batching.BatchTrace")


def custom_jvp_rule_batching() -> Literal["with its function", "after its function"] | None:
    """How a vmap batches the ``custom_jvp`` rule running now: None where it batches none.

    ``"with its function"``: the vmap processes the call, batching function
    and rule together, so that an output is batched where its value or its
    tangent is (``BatchTrace.process_custom_jvp_call``, around
    ``batching.batch_custom_jvp_subtrace``). ``"after its function"``: a vmap
    that batched the call inside a jaxpr (``jit``, ``checkpoint``, ``scan``,
    ``cond`` inside the vmap, or a vmap inside a ``jit`` differentiated from
    outside it) fixed the batch axes of its outputs by the function alone,
    and batches the rule only now that a differentiation runs it; JAX then
    broadcasts an output whose tangent is batched against the axes it fixed
    (a wrong derivative, or an error inside JAX). None: no vmap batches a
    ``custom_jvp`` rule (it runs inside the vmap, on batched values). Found
    among the callers' frames, by the code of those two functions (every
    supported JAX).
    """
    frame: Any = sys._getframe(1)
    while frame is not None and frame.f_code is not _BATCH_CUSTOM_JVP:
        frame = frame.f_back
    if frame is None:
        return None
    while frame is not None and frame.f_code is not _BATCH_CUSTOM_JVP_CALL:
        frame = frame.f_back
    return "after its function" if frame is None else "with its function"


# The eager trace of ``jax.experimental.shard_map`` (a shard_map called outside jit) runs a custom_jvp's function
# and drops its rule: it is the bottom trace, and no differentiation below it can need the rule. Before JAX 0.6 it
# first refuses a custom_jvp with symbolic zeros (every Function is one); JAX 0.6's jax.shard_map (whose trace
# jax.experimental.shard_map shares from then on) drops the rule either way: told by that public name.
_SHARD_MAP_REFUSES_SYMBOLIC_ZEROS = not hasattr(_jax, "shard_map")


def reaches_eager_shard_map_refusing_symbolic_zeros() -> bool:
    """Whether a ``custom_jvp`` bound now reaches, through vmaps only, an eager shard_map that refuses symbolic zeros.

    Why: there JAX runs the function and drops the rule, so a Function
    calls its primal directly, as later JAX does for it. JAX 0.4.38 to 0.5,
    in a program that imported ``jax.experimental.shard_map`` (one that
    never did has no such trace).
    """
    if not _SHARD_MAP_REFUSES_SYMBOLIC_ZEROS:
        return False
    trace_type = getattr(sys.modules.get("jax.experimental.shard_map"), "ShardMapTrace", None)
    if trace_type is None:
        return False
    trace = _trace_ctx.trace
    while isinstance(trace, _BatchTrace):
        trace = trace.parent_trace
    return isinstance(trace, trace_type)
