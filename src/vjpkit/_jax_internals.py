"""What vjpkit needs from JAX that no public JAX API offers, or that differs between JAX versions.

The only module that imports ``jax._src``, and the only one that knows which
JAX it runs on: vjpkit supports every JAX from 0.4.38 on, and was last tested
with ``NEWEST_TESTED_JAX``. Each name is found by looking for it (not by
comparing version strings), and each branch says which JAX versions take it.
A name vjpkit cannot work without is looked up at import: a JAX that no
longer has it fails ``import vjpkit`` with an ImportError naming it, instead
of an AttributeError deep inside a trace.

Every private name used, by JAX subsystem (versions: those that need it):

=====================================================  ==============  ==========================================
private name                                           JAX versions    public replacement
=====================================================  ==============  ==========================================
core.trace_ctx (the current trace)                     all             none
core.set_current_trace (a rule's forward on its        all             none
  primals' trace)
core.get_aval                                          0.4.38 to 0.5.2 ``jax.typeof`` (0.5.3 on)
core.ShardingTypeError                                 0.5 on          none
core.no_axis_name, core.unmapped_aval                  all             none (vmap batching rules)
batching.BatchTrace (is a vmap active)                 all             none
batching.batch_custom_jvp_subtrace (its code: a frame  all             none
  that traces a custom_jvp's rule for a vmap)
experimental.shard_map.ShardMapTrace (eager shard_map  0.4.38 to 0.5   none
  that refuses a custom_jvp with symbolic zeros)
partial_eval.DynamicJaxprTrace                         all             none
partial_eval.JaxprTrace                                0.4.38 to 0.6   none (and later JAX with
                                                                       jax_use_direct_linearize off)
partial_eval.JaxprTrace, JaxprTracer (a rule run by    0.7 on          none
  linearize_from_jvp)
ad.JVPTrace, ad.LinearizeTrace                         all             none
ad.LinearizeTracer, JVPTracer (vjpkit's linearize)     all             none
config.use_direct_linearize                            all             none (read as on where absent)
config.config_ext                                      all             none (``jax.config`` defines no states)
config.trace_context (its code is replaced)            0.4.38 to 0.7   none
config.trace_context (called: gradcheck's cache key)   all             none
ad.custom_lin_p (its rules wrapped to name a class)    all             none
effects.ordered_effects                                all             none
pjit._pjit_transpose_trace (presence only)             0.4.38 to 0.7   none
util.weakref_cache_key_types                           0.7 on          none
api_util.debug_info, save_wrapped_fun_debug_info       0.7 on          none
=====================================================  ==============  ==========================================

Public names whose home or meaning changed: ``jax.enable_x64`` (0.8 on;
``jax.experimental.enable_x64`` before), ``jax.Inline`` (``jit``'s
``inline=True`` inlines only when lowering from 0.11), ``jax.ffi`` (0.5 on;
``jax.extend.ffi`` in 0.4.38), ``jax.lax.pcast`` (0.8 on; ``pvary`` in 0.6
and 0.7), ``jax.sharding.AxisType`` and friends (0.5-0.6 on).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import re
import sys
import types
from typing import Any, Callable, Literal, NamedTuple, Sequence

import jax

# The newest JAX that vjpkit's whole test suite passed with (the oldest is
# pyproject.toml's floor, 0.4.38).
NEWEST_TESTED_JAX = "0.12.0.1"

# The running JAX's release, for cache keys only (a library compiled against
# one JAX's FFI headers is rebuilt for another); vjpkit compares no versions.
JAX_RELEASE: str = jax.__version__


def _missing(what: str) -> ImportError:
    return ImportError(
        f"vjpkit needs {what}, which JAX {jax.__version__} does not have. vjpkit was "
        f"tested with JAX 0.4.38 to {NEWEST_TESTED_JAX}: install a JAX in that range "
        f"(pip install 'jax<={NEWEST_TESTED_JAX}'), or a vjpkit release that supports this JAX."
    )


def _require(owner: Any, name: str, where: str) -> Any:
    """``owner.name``, or an ImportError that says what is missing and what was tested."""
    try:
        return getattr(owner, name)
    except AttributeError:
        raise _missing(f"{where}.{name}") from None


def _require_module(path: str) -> Any:
    try:
        return importlib.import_module(path)
    except ImportError:
        raise _missing(f"the module {path}") from None


# Public in every supported JAX: the primitive machinery _linear_call.py and
# _tie.py build on, checked here so that their loss is reported as the others'.
ad = _require_module("jax.interpreters.ad")
batching = _require_module("jax.interpreters.batching")
mlir = _require_module("jax.interpreters.mlir")
partial_eval = _require_module("jax.interpreters.partial_eval")
Primitive = _require(_require_module("jax.extend.core"), "Primitive", "jax.extend.core")
for _module, _where, _names in (
    (ad, "jax.interpreters.ad", ("Zero", "instantiate_zeros", "is_undefined_primal", "primitive_jvps",
                                 "primitive_transposes")),
    (batching, "jax.interpreters.batching", ("fancy_primitive_batchers", "bdim_at_front")),
    (mlir, "jax.interpreters.mlir", ("register_lowering", "lower_fun")),
    (partial_eval, "jax.interpreters.partial_eval", ("custom_partial_eval_rules",)),
    (jax.core, "jax.core", ("ShapedArray",)),
):
    for _name in _names:
        _require(_module, _name, _where)
ShapedArray = jax.core.ShapedArray

_core = _require_module("jax._src.core")
_config = _require_module("jax._src.config")
_pe = _require_module("jax._src.interpreters.partial_eval")
_ad = _require_module("jax._src.interpreters.ad")
_pjit = _require_module("jax._src.pjit")

# ---------------------------------------------------------------------------
# core: types of values.

# ``jax.typeof`` from JAX 0.5.3; ``core.get_aval`` before (gone by 0.10).
typeof: Callable[[Any], Any] = getattr(jax, "typeof", None) or _require(_core, "get_aval", "jax._src.core")


def tangent_aval(x: Any) -> Any:
    """The type of a tangent for primal ``x``: its shape, dtype and ``shard_map`` varying axes."""
    return typeof(x).strip_weak_type().to_tangent_aval()


def symbolic_zero_like(x: Any) -> Any:
    """A ``SymbolicZero`` tangent for primal ``x`` (float0 for integer ``x``)."""
    from jax.custom_derivatives import SymbolicZero

    return SymbolicZero(tangent_aval(x))


def varying_axes_of_type(aval: Any) -> frozenset:
    """The ``shard_map`` mesh axes along which a value of type ``aval`` differs between devices.

    Why: inside ``shard_map`` the type of an array says whether it varies
    across devices, and a ``custom_vjp`` gradient must have its input's type.
    JAX 0.10 on calls that set ``aval.mat.varying``, JAX 0.6 to 0.9
    ``aval.vma``; older JAX has no such types, so nothing varies.
    """
    mat = getattr(aval, "mat", None)
    if mat is not None:
        return frozenset(mat.varying)
    return frozenset(getattr(aval, "vma", ()))


def varying_axes(x: Any) -> frozenset:
    """``varying_axes_of_type`` of ``x``'s type."""
    return varying_axes_of_type(typeof(x))


# Retyping as varying: ``lax.pcast(..., to="varying")`` from JAX 0.8, ``lax.pvary``
# in 0.6 and 0.7 (0.8 and 0.9 warn on access to pvary, so it is looked up only
# without pcast); older JAX has no varying types.
_pcast = getattr(jax.lax, "pcast", None)
_pvary = None if _pcast is not None else getattr(jax.lax, "pvary", None)
HAS_VARYING_TYPES = _pcast is not None or _pvary is not None


def cast_to_varying(x: Any, axes: tuple) -> Any:
    """``x`` retyped as varying along ``axes`` (its values unchanged; only asked where ``HAS_VARYING_TYPES``)."""
    if _pcast is not None:
        return _pcast(x, axes, to="varying")
    return _pvary(x, axes)  # type: ignore[misc]


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
LINEARIZE_IS_TOLD_FROM_VJP = "is_vjp" in _LinearizeTrace.__init__.__code__.co_varnames
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
# interpreters.batching and core: vmap rules.

_no_axis_name = _require(_core, "no_axis_name", "jax._src.core")
_unmapped_aval = _require(_core, "unmapped_aval", "jax._src.core")
# ``core.unmapped_aval`` is (size, axis_name, axis, aval) in JAX 0.4.38 and
# (size, axis, aval, explicit_mesh_axis) from JAX 0.5.
_UNMAPPED_AVAL_TAKES_AXIS_NAME = "axis_name" in _unmapped_aval.__code__.co_varnames[:2]


def vmap_axis_names(axis_data: Any) -> dict:
    """``jax.vmap`` keyword arguments naming the axis that ``axis_data`` describes.

    Why: a rule batched by re-running it under ``jax.vmap`` must keep the
    axis name, so that collectives over it (``lax.pmean(x, "batch")``) work.
    Every supported JAX gives a batching rule ``AxisData`` with ``name``
    (``core.no_axis_name`` when the vmap has none) and ``spmd_name``.
    """
    name = axis_data.name
    return dict(axis_name=None if name is _no_axis_name else name, spmd_axis_name=axis_data.spmd_name)


def batched_aval(aval: Any, size: int, axis_data: Any) -> Any:
    """``aval`` with a leading batch axis of ``size`` (keeping its sharding and varying axes)."""
    if _UNMAPPED_AVAL_TAKES_AXIS_NAME:
        return _unmapped_aval(size, axis_data.name, 0, aval)
    return _unmapped_aval(size, 0, aval, getattr(axis_data, "explicit_mesh_axis", None))


# ---------------------------------------------------------------------------
# effects and mlir: lowering a primitive with effects.

_ordered_effects = _require(_require_module("jax._src.effects"), "ordered_effects", "jax._src.effects")


def ordered_effects_without_tokens(ctx: Any, effects: Any) -> list:
    """The ordered members of ``effects`` that lowering context ``ctx`` has no token for.

    Every supported JAX threads one token per ordered effect that an
    equation declared (``ctx.tokens_in``), and no others.
    """
    return [e for e in effects if _ordered_effects.contains(e) and e not in ctx.tokens_in.effects()]


# ---------------------------------------------------------------------------
# jit (pjit) and JAX's caches.

# ``jax.jit(..., inline=...)`` that inlines into the caller's jaxpr while an
# outer trace stages it: ``inline=True`` in JAX 0.4.38 to 0.10; from JAX 0.11
# (``jax.Inline``) ``True`` means ``Inline.JAX_LATE`` (a ``jit`` equation, inlined
# only when lowered) and ``Inline.JAX_EARLY`` inlines while tracing.
_inline = getattr(jax, "Inline", None)
INLINE_INTO_CALLER: Any = _inline.JAX_EARLY if _inline is not None else True

# JAX 0.4.38 to 0.7 cache every jit that eager reverse mode transposes
# (``pjit._pjit_transpose_trace``, keyed by a module-level function, so never
# dropped) until ``jax.clear_caches()``: a program vjpkit's cache drops stays
# alive there if an eager ``jax.grad`` transposed it. JAX 0.8 removed it.
JAX_KEEPS_TRANSPOSED_JITS = hasattr(_pjit, "_pjit_transpose_trace")


def hold_weakly_in_caches(cls: type) -> None:
    """Makes JAX's caches keyed by equation parameters hold instances of ``cls`` weakly.

    Why: JAX 0.7 and later cache abstract evaluation by parameters, holding
    other parameters strongly until evicted; a parameter that refers to a
    program would keep it alive after vjpkit's cache (and every jaxpr) let
    it go. Older JAX has no such cache, so there is nothing to register.
    """
    weak_types = getattr(_require_module("jax._src.util"), "weakref_cache_key_types", None)
    if weak_types is not None:
        weak_types.add(cls)


_api_util = _require_module("jax._src.api_util")
# JAX 0.7 and later compute a function's debug info (its name, source line
# and argument names, read by error messages) on every call of a custom_vjp,
# with ``inspect.signature`` and a flattening of the arguments, unless the
# function carries it precomputed; older JAX has no such attribute.
_DEBUG_INFO_CAN_BE_SAVED = (
    hasattr(_api_util, "save_wrapped_fun_debug_info")
    and "__fun_debug_info__" in _api_util.debug_info.__code__.co_consts
)


class _Leaf:
    """An argument that is one leaf (an array's stand-in)."""


def save_debug_info(fn: Callable, traced_for: str, n_args: int) -> None:
    """Gives ``fn`` (always called with ``n_args`` arrays) the debug info JAX would compute on each call."""
    if _DEBUG_INFO_CAN_BE_SAVED:
        leaf = _Leaf()
        _api_util.save_wrapped_fun_debug_info(fn, _api_util.debug_info(traced_for, fn, (leaf,) * n_args, {}))


# ---------------------------------------------------------------------------
# config: states.

# ``jax.enable_x64(bool)``: a thread-local context manager; JAX before 0.8
# has it as ``jax.experimental.enable_x64`` (gone from JAX 0.10).
if hasattr(jax, "enable_x64"):
    enable_x64: Callable[[bool], Any] = jax.enable_x64
else:
    enable_x64 = _require(_require_module("jax.experimental"), "enable_x64", "jax.experimental")


def thread_local_flag(name: str) -> Any:
    """A boolean JAX configuration state: ``.value``, ``.swap_local(v)``, ``.set_local(prev)``.

    Why: ``vjpkit.detect_anomaly`` changes what vjpkit traces, so a program
    that ``jax.jit`` traced without it must not be reused with it (nor the
    reverse). JAX puts such states in its dispatch and trace cache keys, and
    keeps their local values per thread. Relies on ``jaxlib``'s
    ``config_ext.Config``, as ``jax._src.config`` builds its own.
    """
    config_ext = _require(_config, "config_ext", "jax._src.config")
    try:
        # JAX 0.8 and later: the state names itself and joins both keys.
        return config_ext.Config(name, False, include_in_jit_key=True, include_in_trace_context=True)
    except TypeError:
        pass
    # JAX 0.4.38 to 0.7: ``Config(default, include_in_jit_key)`` joins the
    # dispatch key only. The trace caches key on ``config.trace_context()``, a
    # fixed tuple, and hold that function itself (not its module attribute), so
    # its code is swapped for code that also returns vjpkit's states (looked up
    # in that module's namespace, where the original code is kept too).
    state = config_ext.Config(False, True)
    trace_context = _config.trace_context
    namespace = trace_context.__globals__
    if "_vjpkit_trace_states" not in namespace:
        namespace["_vjpkit_trace_states"] = []
        namespace["_vjpkit_trace_context"] = types.FunctionType(trace_context.__code__, namespace)
        trace_context.__code__ = _trace_context_with_vjpkit_states.__code__
    namespace["_vjpkit_trace_states"].append(state)
    return state


def _trace_context_with_vjpkit_states() -> tuple:
    """The code ``thread_local_flag`` gives ``config.trace_context`` in JAX 0.4.38 to 0.7."""
    return (*_vjpkit_trace_context(), *[s.value for s in _vjpkit_trace_states])  # type: ignore[name-defined]  # noqa: F821


# ---------------------------------------------------------------------------
# sharding: Explicit mesh axes and shard_map's varying types (``_sharding.py``).


class ShardingApi(NamedTuple):
    """What this JAX offers for sharding types; ``None`` fields where it offers nothing."""

    get_abstract_mesh: Any  # a callable, or None where this JAX lacks it; () -> the context's AbstractMesh
    use_abstract_mesh: Any  # None where this JAX lacks it; a context manager: trace under another mesh
    reshard: Any  # a callable, or None where this JAX lacks it; (x, PartitionSpec | NamedSharding) -> x with that type
    auto: Any  # AxisType.Auto
    sharding_type_error: type | None  # raised by an ambiguous operation under Explicit axes
    varying_axes: Any  # a callable, or None where this JAX lacks it; x -> frozenset of shard_map axes x varies along
    mark_varying: Any  # None where this JAX lacks it; (x, axes) -> x typed as varying along axes
    debug_callback_everywhere: dict  # jax.debug.callback's keywords to run on every device


@functools.cache
def sharding_api() -> ShardingApi:
    """This JAX's explicit-sharding and shard_map-varying API.

    Explicit axes (``jax.sharding.AxisType``, ``use_abstract_mesh``,
    ``reshard``) came in JAX 0.5-0.6; 0.4.38 has none. Varying types came in
    JAX 0.6 (``cast_to_varying``). ``ShardingTypeError`` is only in
    ``jax._src.core``.
    """
    sharding = jax.sharding
    explicit = all(
        hasattr(sharding, name) for name in ("AxisType", "get_abstract_mesh", "use_abstract_mesh", "reshard")
    )
    # partitioned=True runs a debug callback on every device (so in every
    # process) with its local shard; without it, sharded programs run it on device 0.
    everywhere = {"partitioned": True} if "partitioned" in inspect.signature(jax.debug.callback).parameters else {}
    return ShardingApi(
        get_abstract_mesh=sharding.get_abstract_mesh if explicit else None,
        use_abstract_mesh=sharding.use_abstract_mesh if explicit else None,
        reshard=sharding.reshard if explicit else None,
        auto=sharding.AxisType.Auto if explicit else None,
        sharding_type_error=getattr(_core, "ShardingTypeError", None) if explicit else None,
        varying_axes=varying_axes if HAS_VARYING_TYPES else None,
        mark_varying=cast_to_varying if HAS_VARYING_TYPES else None,
        debug_callback_everywhere=everywhere,
    )


# ---------------------------------------------------------------------------
# The XLA FFI (``cpp_extension.py``).


class FfiApi(NamedTuple):
    include_dir: Callable[[], str]
    pycapsule: Callable[[Any], Any]
    register_ffi_target: Callable[..., None]
    ffi_call: Callable[[str, Any, str], Callable[..., Any]]


@functools.cache
def ffi_api() -> FfiApi:
    """JAX's FFI functions, wherever this JAX version keeps them.

    Why: the FFI moved from ``jax.extend.ffi`` (JAX 0.4.38) to ``jax.ffi``
    (JAX 0.5 onwards). Both versions take ``vmap_method=`` (``vectorized=``
    is older than the supported range), with the three methods
    ``load_inline`` accepts.
    """
    try:
        from jax import ffi
    except ImportError:
        from jax.extend import ffi  # type: ignore[attr-defined, no-redef]

    def ffi_call(target_name: str, result_shape_dtypes: Any, vmap_method: str) -> Callable[..., Any]:
        return ffi.ffi_call(target_name, result_shape_dtypes, vmap_method=vmap_method)

    return FfiApi(ffi.include_dir, ffi.pycapsule, ffi.register_ffi_target, ffi_call)


# ---------------------------------------------------------------------------
# The configuration a trace depends on (_checking/runner.py keys its checkers by it).


# ``jax._src.config.trace_context`` in every supported JAX (0.4.38 on); no public name.
_trace_context = _require(_config, "trace_context", "jax._src.config")


def trace_configuration() -> tuple:
    """JAX's trace-time configuration (x64, matmul precision, default device, ...), hashable.

    Why: ``jax.jit`` keys its own caches on it, and a cache of traced
    programs outside ``jax.jit`` must too. In JAX 0.4.38 to 0.7,
    ``thread_local_flag`` replaces the code of this same function object, so
    vjpkit's own states (``detect_anomaly``) are part of it there too.
    """
    return _trace_context()


#


# ---------------------------------------------------------------------------
# JAX's errors about closures over traced values (_dispatch.py explains them naming the class).

# JAX's error for a custom_vjp whose function closes over a value being differentiated: the same words in every
# JAX from 0.4.38 (its type, CustomVJPException, is not public).
_JAX_CLOSED_OVER_DIFFERENTIATED = (
    "Detected differentiation of a custom_vjp function with respect to a closed-over value"
)


def is_closed_over_differentiated_error(e: BaseException) -> bool:
    """Whether ``e`` is JAX's "differentiation with respect to a closed-over value" error."""
    return str(e).startswith(_JAX_CLOSED_OVER_DIFFERENTIATED)


# JAX's lowering meets a tracer of an enclosing transformation as a constant (a rule closing over it):
# "No constant handler for type: <class '...BatchTracer'>" in every JAX from 0.4.38.
_NO_CONSTANT_HANDLER = re.compile(r"No constant handler for type: <class '[\w.]*\.(\w*Tracer)'>")


def closed_over_tracer_type(e: BaseException) -> str | None:
    """The tracer's type name (``JVPTracer``, ``BatchTracer``, ...) if ``e`` is that error, else None."""
    match = _NO_CONSTANT_HANDLER.match(str(e)) if isinstance(e, TypeError) else None
    return None if match is None else match.group(1)

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

    Why: a tangent's ``linear_call`` must then carry its primals' batch
    axes (``_program.py``). The second case: a ``custom_jvp`` called in a
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


# The eager trace of ``jax.experimental.shard_map`` (a shard_map called outside jit) runs a custom_jvp's function
# and drops its rule: it is the bottom trace, and no differentiation below it can need the rule. Before JAX 0.6 it
# first refuses a custom_jvp with symbolic zeros (every Function is one), with this message; JAX 0.6's
# jax.shard_map (whose trace jax.experimental.shard_map shares from then on) drops the rule either way.
_SHARD_MAP_REFUSES_SYMBOLIC_ZEROS = "custom_jvp symbolic_zeros support with shard_map is not implemented"


def reaches_eager_shard_map_refusing_symbolic_zeros() -> bool:
    """Whether a ``custom_jvp`` bound now reaches, through vmaps only, an eager shard_map that refuses symbolic zeros.

    Why: there JAX runs the function and drops the rule, so a Function
    calls its primal directly, as later JAX does for it. Found by feature:
    the message in the code of ``ShardMapTrace.process_custom_jvp_call``
    of an imported ``jax.experimental.shard_map`` (JAX 0.4.38 to 0.5); a
    program that never imported it has no such trace.
    """
    trace_type = getattr(sys.modules.get("jax.experimental.shard_map"), "ShardMapTrace", None)
    method = getattr(trace_type, "process_custom_jvp_call", None)
    constants = getattr(getattr(method, "__code__", None), "co_consts", ())
    if not any(isinstance(c, str) and _SHARD_MAP_REFUSES_SYMBOLIC_ZEROS in c for c in constants):
        return False
    trace = _trace_ctx.trace
    while isinstance(trace, _BatchTrace):
        trace = trace.parent_trace
    return isinstance(trace, trace_type)  # type: ignore[arg-type]  # a type: its method was found above


def save_rule_debug_info(fn: Callable, traced_for: str, n_args: int) -> None:
    """``save_debug_info`` for a ``custom_jvp`` rule, which JAX describes as called with (primals, tangents)."""
    if _DEBUG_INFO_CAN_BE_SAVED:
        leaves = (_Leaf(),) * n_args
        _api_util.save_wrapped_fun_debug_info(fn, _api_util.debug_info(traced_for, fn, (leaves, leaves), {}))
