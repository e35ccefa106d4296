"""Everything vjpkit needs from JAX that differs between JAX versions.

The only module that imports ``jax._src``, and the only one that knows which
JAX it runs on: vjpkit supports every JAX from 0.4.38 on, and was last tested
with ``NEWEST_TESTED_JAX``. Each name is found by looking for it (not by
comparing version strings), and each branch says which JAX versions take it
and why. A name vjpkit cannot work without is looked up here, at import: a
JAX that no longer has it fails ``import vjpkit`` with an ImportError naming
it, instead of an AttributeError deep inside a trace.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import sys
import types
from typing import Any, Callable, NamedTuple

import jax

# The newest JAX that vjpkit's whole test suite passed with (the oldest is
# pyproject.toml's floor, 0.4.38).
NEWEST_TESTED_JAX = "0.10.2"


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


# Public in every supported JAX: the primitive machinery _linear_call.py uses.
ad = _require_module("jax.interpreters.ad")
batching = _require_module("jax.interpreters.batching")
mlir = _require_module("jax.interpreters.mlir")
Primitive = _require(_require_module("jax.extend.core"), "Primitive", "jax.extend.core")
# No public name in some supported JAX.
_core = _require_module("jax._src.core")
_config = _require_module("jax._src.config")
_array = _require_module("jax._src.array")
_pe = _require_module("jax._src.interpreters.partial_eval")
_ad_internal = _require_module("jax._src.interpreters.ad")

# The concrete type of a non-traced jax.Array (apply's fast path tests it).
ArrayImpl = _require(_array, "ArrayImpl", "jax._src.array")
EvalTrace = _require(_core, "EvalTrace", "jax._src.core")
_trace_ctx = _require(_core, "trace_ctx", "jax._src.core")
_DynamicJaxprTrace = _require(_pe, "DynamicJaxprTrace", "jax._src.interpreters.partial_eval")
_JaxprTrace = _require(_pe, "JaxprTrace", "jax._src.interpreters.partial_eval")
_JVPTrace = _require(ad, "JVPTrace", "jax.interpreters.ad")
_JVP_CUSTOM_VJP_CODE = _require(_JVPTrace, "process_custom_vjp_call", "jax.interpreters.ad.JVPTrace").__code__
_LINEARIZE_FROM_JVP_CODE = _require(_ad_internal, "linearize_from_jvp", "jax._src.interpreters.ad").__code__

# Names the linear_call primitive (_linear_call.py) builds on: public in every
# supported JAX, checked here so that their loss is reported as the others'.
for _module, _where, _names in (
    (ad, "jax.interpreters.ad", ("Zero", "instantiate_zeros", "is_undefined_primal", "primitive_jvps",
                                 "primitive_transposes")),
    (batching, "jax.interpreters.batching", ("fancy_primitive_batchers", "bdim_at_front")),
    (mlir, "jax.interpreters.mlir", ("register_lowering", "lower_fun")),
    (jax.core, "jax.core", ("ShapedArray",)),
):
    for _name in _names:
        _require(_module, _name, _where)
ShapedArray = jax.core.ShapedArray

# ---------------------------------------------------------------------------
# The current trace, read by apply's fast path.
#
# apply's fast path reads the current trace without a function call:
# ``type(current_trace.value) is EvalTrace`` means no transformation is
# tracing, so an all-concrete call may run the compiled program; under a
# trace (even with closed-over concrete arrays) it must inline instead.

if hasattr(_core, "trace_state_strong_ref"):
    # JAX 0.10 and later keep the current trace in a thread-local config state
    # (``trace_ctx.trace`` is a property reading it): read it directly.
    current_trace: Any = _core.trace_state_strong_ref
else:
    # JAX 0.4.38 to 0.9 keep it as a plain attribute of the thread-local
    # ``trace_ctx``; one property lookup gives it the same ``.value`` face.
    class _CurrentTrace:
        __slots__ = ()

        @property
        def value(self) -> Any:
            return _trace_ctx.trace

    current_trace = _CurrentTrace()


def is_staging() -> bool:
    """Whether a staging trace (``jit``, ``scan``, ``checkpoint``, ...) is active.

    Why: calling an inner ``jax.jit`` while an outer one traces leaves a
    nested call in the program (extra HLO instructions); under a staging
    trace vjpkit calls its ``custom_vjp`` directly so it inlines instead.
    Every supported JAX chains traces through ``parent_trace``.
    """
    trace = _trace_ctx.trace
    while trace is not None:
        if isinstance(trace, _DynamicJaxprTrace):
            return True
        trace = getattr(trace, "parent_trace", None)
    return False


# ---------------------------------------------------------------------------
# Forward mode applied to a custom_vjp function.

if hasattr(_config, "use_direct_linearize"):
    _direct_linearize = _config.use_direct_linearize
else:
    # A JAX that dropped the flag linearizes directly, always.
    class _AlwaysOn:
        value = True

    _direct_linearize = _AlwaysOn()


def called_from_forward_mode(max_depth: int = 32) -> bool:
    """Whether a ``custom_vjp`` forward rule is being run by forward-mode AD.

    Why: JAX runs a ``custom_vjp``'s ``fwd`` both for reverse mode (through
    ``LinearizeTrace``) and for forward mode (through ``JVPTrace``); forward
    mode then fails later with "can't apply forward-mode autodiff (jvp) to a
    custom_vjp function", which cannot name the user's class. Looking for
    ``JVPTrace.process_custom_vjp_call`` among the callers lets vjpkit raise
    its own error while tracing. Only meaningful with
    ``jax_use_direct_linearize`` on (the default from JAX 0.7; before, see
    ``_forward_mode_without_direct_linearize``), where reverse mode goes
    through ``JVPTrace`` only to linearize a
    primitive that has no linearize rule (``jax.checkpoint``'s ``remat_p``):
    ``ad.fallback_linearize_rule`` runs its JVP through
    ``ad.linearize_from_jvp``, which is not forward mode, so that frame
    further up the stack means reverse mode.
    """
    if not _direct_linearize.value:
        return _forward_mode_without_direct_linearize(sys._getframe(1))
    frame: Any = sys._getframe(1)
    for _ in range(max_depth):
        if frame is None:
            return False
        if frame.f_code is _JVP_CUSTOM_VJP_CODE:
            return not _linearizing_by_jvp(frame)
        frame = frame.f_back
    return False


_JVP_PRIMITIVE_CODE = _JVPTrace.process_primitive.__code__


def _forward_mode_without_direct_linearize(frame: Any) -> bool:
    """``called_from_forward_mode`` where JAX linearizes by JVP and partial evaluation.

    JAX before 0.7 (or with ``jax_use_direct_linearize`` off) runs reverse
    mode through ``JVPTrace`` too, staging its tangents into a
    partial-evaluation ``JaxprTrace``: reverse mode has such a ``JVPTrace``
    among the callers (directly, or around the ``jit``, ``checkpoint`` or
    ``scan`` whose JVP traces the forward rule); forward mode has none.
    """
    in_jvp = False
    while frame is not None:
        code = frame.f_code
        if code is _JVP_CUSTOM_VJP_CODE or code is _JVP_PRIMITIVE_CODE:
            in_jvp = True
            if isinstance(getattr(frame.f_locals.get("self"), "parent_trace", None), _JaxprTrace):
                return False
        frame = frame.f_back
    return in_jvp


def _linearizing_by_jvp(frame: Any) -> bool:
    """Whether ``ad.linearize_from_jvp`` is among ``frame``'s callers."""
    while frame is not None:
        if frame.f_code is _LINEARIZE_FROM_JVP_CODE:
            return True
        frame = frame.f_back
    return False


# JAX's own error (its wording in every supported version) when forward mode
# reaches a custom_vjp function whose forward rule it traced for reverse mode.
_JAX_NO_FORWARD_MODE = "can't apply forward-mode autodiff (jvp) to a custom_vjp function"


def is_forward_mode_of_custom_vjp_error(e: BaseException) -> bool:
    """Whether ``e`` is JAX's "forward mode applied to a custom_vjp function" error."""
    return isinstance(e, TypeError) and str(e).startswith(_JAX_NO_FORWARD_MODE)


# ---------------------------------------------------------------------------
# shard_map's varying types.


# The abstract value (shape, dtype, weak type, ...) of an array or tracer:
# ``jax._src.core.typeof`` from JAX 0.5 (``get_aval`` is gone by 0.10),
# ``get_aval`` in JAX 0.4.38.
_aval: Callable[[Any], Any] = getattr(_core, "typeof", None) or _require(_core, "get_aval", "jax._src.core")
aval_of = _aval  # for modules reading several fields of one array's type


def varying_axes(x: Any) -> frozenset:
    """The ``shard_map`` mesh axes along which ``x`` differs between devices.

    Why: inside ``shard_map`` the type of an array says whether it varies
    across devices, and a ``custom_vjp`` gradient must have its input's type.
    JAX 0.10 calls that set ``aval.mat.varying``, JAX 0.6 to 0.9
    ``aval.vma``; older JAX has no such types (its shard_map checks
    replication itself), so nothing varies.
    """
    aval = _aval(x)
    mat = getattr(aval, "mat", None)
    if mat is not None:
        return frozenset(mat.varying)
    return frozenset(getattr(aval, "vma", ()))


def cast_to_varying(x: Any, axes: tuple) -> Any:
    """``x`` retyped as varying along ``axes`` (its values unchanged)."""
    if hasattr(jax.lax, "pcast"):  # JAX 0.8 and later
        return jax.lax.pcast(x, axes, to="varying")
    # JAX 0.6 and 0.7 (older JAX has no varying types, so never asks).
    return jax.lax.pvary(x, axes)  # type: ignore[attr-defined]


def symbolic_zero_like(x: Any) -> Any:
    """A ``SymbolicZero`` tangent for primal ``x`` (float0 for integer ``x``)."""
    from jax.custom_derivatives import SymbolicZero

    return SymbolicZero(_aval(x).strip_weak_type().to_tangent_aval())


# JAX 0.4.38 to 0.7 cache every jit that eager reverse mode transposes
# (``pjit._pjit_transpose_trace``, keyed by a module-level function, so never
# dropped) until ``jax.clear_caches()``: a program vjpkit's cache drops stays
# alive there if an eager ``jax.grad`` transposed it. JAX 0.8 removed it.
JAX_KEEPS_TRANSPOSED_JITS = hasattr(_require_module("jax._src.pjit"), "_pjit_transpose_trace")


# JAX 0.5 to 0.7 assert that every call of a custom_vjp's bwd returns the same
# pytree structure (``linear_util._get_result_paths_thunk``), yet call one bwd
# again when a cached jaxpr is transposed again (``jax.grad`` then
# ``jax.jacrev``) with other inputs differentiated: there a cotangent vjpkit
# leaves out (None) is returned as a SymbolicZero of the input's type instead.
BWD_STRUCTURE_IS_FIXED = hasattr(_require_module("jax._src.linear_util"), "_get_result_paths_thunk")


def zero_cotangent(shape: tuple, dtype: Any, varying: frozenset) -> Any:
    """A ``SymbolicZero`` cotangent for an input of this type (JAX 0.5 to 0.7)."""
    from jax.custom_derivatives import SymbolicZero

    # Varying types (``vma``) exist from JAX 0.6.
    aval = ShapedArray(shape, dtype, vma=frozenset(varying)) if varying else ShapedArray(shape, dtype)  # type: ignore[call-arg]
    return SymbolicZero(aval.to_tangent_aval())


# ---------------------------------------------------------------------------
# Public API that moved.

# ``jax.enable_x64(bool)``: a thread-local context manager; JAX before 0.8
# has it as ``jax.experimental.enable_x64`` (gone from JAX 0.10).
if hasattr(jax, "enable_x64"):
    enable_x64: Callable[[bool], Any] = jax.enable_x64
else:
    enable_x64 = _require(_require_module("jax.experimental"), "enable_x64", "jax.experimental")


# ---------------------------------------------------------------------------
# A thread-local mode that is part of JAX's compile-cache keys.


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
# jax.linearize told apart from reverse mode (``LinearizeTrace.is_vjp``: JAX 0.5
# and later; older JAX linearizes through ``JVPTrace``, where
# ``called_from_forward_mode`` sees it, and these say no).

_LINEARIZE_CUSTOM_VJP_CODE = getattr(
    getattr(getattr(_ad_internal, "LinearizeTrace", None), "process_custom_vjp_call", None), "__code__", None
)


def called_from_linearize(max_depth: int = 32) -> bool:
    """Whether a ``custom_vjp`` forward rule is being run by ``jax.linearize`` (forward mode).

    Why: ``jax.vjp`` and ``jax.linearize`` both run the forward rule through
    ``LinearizeTrace.process_custom_vjp_call``; only its ``is_vjp`` flag tells
    reverse mode from ``jax.linearize``, whose linear map then fails with
    JAX's generic "can't apply forward-mode autodiff" (no class name) when
    evaluated. Relies on ``ad.LinearizeTrace`` (JAX >= 0.5; older JAX
    linearizes through ``JVPTrace``, which ``called_from_forward_mode`` sees).
    """
    if _LINEARIZE_CUSTOM_VJP_CODE is None:
        return False
    frame: Any = sys._getframe(1)
    for _ in range(max_depth):
        if frame is None:
            return False
        if frame.f_code is _LINEARIZE_CUSTOM_VJP_CODE:
            return not getattr(frame.f_locals.get("self"), "is_vjp", True)
        frame = frame.f_back
    return False


def forward_rule_called_for_forward_mode(max_depth: int = 32) -> bool:
    """``called_from_forward_mode() or called_from_linearize()``, in one walk up the callers.

    Why: a ``custom_vjp`` forward rule asks this on every call while JAX
    traces; one walk of the same frames answers both.
    """
    if not _direct_linearize.value:
        return called_from_forward_mode(max_depth + 1) or called_from_linearize(max_depth + 1)
    jvp_frame = linearize_frame = None
    frame: Any = sys._getframe(1)
    for _ in range(max_depth):
        if frame is None:
            break
        code = frame.f_code
        if jvp_frame is None and code is _JVP_CUSTOM_VJP_CODE:
            jvp_frame = frame
        elif linearize_frame is None and code is _LINEARIZE_CUSTOM_VJP_CODE:
            linearize_frame = frame
        frame = frame.f_back
    if jvp_frame is not None and not _linearizing_by_jvp(jvp_frame):
        return True
    return linearize_frame is not None and not getattr(linearize_frame.f_locals.get("self"), "is_vjp", True)


def linearizing() -> bool:
    """Whether the innermost differentiation around the current call is ``jax.linearize``.

    Why: once a jitted program has been differentiated in reverse mode, JAX
    reuses the forward rule it traced, so ``called_from_linearize`` never
    runs; the trace ``apply`` is called under still says. Relies on
    ``core.trace_ctx.trace``, each trace's ``parent_trace`` and
    ``ad.LinearizeTrace.is_vjp``.
    """
    linearize_trace = getattr(_ad_internal, "LinearizeTrace", None)
    if linearize_trace is None:
        return False
    trace = _trace_ctx.trace
    while trace is not None:
        if isinstance(trace, linearize_trace):
            return not getattr(trace, "is_vjp", True)
        trace = getattr(trace, "parent_trace", None)
    return False


# ---------------------------------------------------------------------------
# Sharding types: Explicit mesh axes and shard_map's varying types (``_sharding.py``).


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
    JAX 0.6: ``typeof(x).vma`` and ``lax.pvary``, later
    ``typeof(x).mat.varying`` and ``lax.pcast(..., to="varying")`` (0.10).
    ``ShardingTypeError`` is only in ``jax._src.core``.
    """
    sharding = jax.sharding
    explicit = all(
        hasattr(sharding, name) for name in ("AxisType", "get_abstract_mesh", "use_abstract_mesh", "reshard")
    )
    typeof = getattr(jax, "typeof", None)
    varying_axes = mark_varying = None
    if typeof is not None:
        pcast = getattr(jax.lax, "pcast", None)
        # Looked up only without pcast: JAX 0.8 and 0.9 warn that pvary is deprecated on access.
        pvary = None if pcast is not None else getattr(jax.lax, "pvary", None)
        if pcast is not None:
            mark_varying = functools.partial(pcast, to="varying")
        elif pvary is not None:
            mark_varying = pvary

        def varying_axes(x: Any) -> frozenset:
            aval = typeof(x)
            mat = getattr(aval, "mat", None)
            return frozenset(mat.varying if mat is not None else getattr(aval, "vma", ()))

    # partitioned=True runs a debug callback on every device (so in every
    # process) with its local shard; without it, sharded programs run it on device 0.
    everywhere = {"partitioned": True} if "partitioned" in inspect.signature(jax.debug.callback).parameters else {}

    return ShardingApi(
        get_abstract_mesh=sharding.get_abstract_mesh if explicit else None,
        use_abstract_mesh=sharding.use_abstract_mesh if explicit else None,
        reshard=sharding.reshard if explicit else None,
        auto=sharding.AxisType.Auto if explicit else None,
        sharding_type_error=getattr(_core, "ShardingTypeError", None) if explicit else None,
        varying_axes=varying_axes if mark_varying is not None else None,
        mark_varying=mark_varying,
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


# The running JAX's release, for cache keys only (a library compiled against
# one JAX's FFI headers is rebuilt for another); vjpkit compares no versions.
JAX_RELEASE: str = jax.__version__


# ---------------------------------------------------------------------------
# For vjpkit's linear_call primitive (_linear_call.py): its effects, its
# output types inside shard_map, and the vmap axis it is batched along.

_effects = _require_module("jax._src.effects")
_ordered_effects = _require(_effects, "ordered_effects", "jax._src.effects")
_no_axis_name = _require(_core, "no_axis_name", "jax._src.core")
_unmapped_aval = _require(_core, "unmapped_aval", "jax._src.core")


def linearizing_for_reverse_mode() -> bool:
    """Whether JAX is recording linear equations to transpose them (reverse mode).

    Why: vjpkit's ``linear_call`` learns the effects of its rule by tracing
    it, but must not trace a Function's ``jvp`` when reverse mode only
    records the call to transpose it into ``backward`` (grad never runs jvp).
    With direct linearization (the default from JAX 0.7) a ``LinearizeTrace``
    method is among the callers; from JAX 0.9 it says whether it linearizes
    for ``vjp`` or for ``jax.linearize``, whose linear function runs the
    rule (JAX 0.7 and 0.8 cannot tell: both count as reverse mode). Before
    (JAX 0.4.38 to 0.6, or with the flag off) reverse mode runs the rule
    under a ``JVPTrace`` over partial evaluation (``JaxprTrace``): directly,
    or around the ``jit``, ``checkpoint`` or ``scan`` whose JVP traces it.
    """
    direct = _direct_linearize.value
    if not direct and isinstance(current_trace.value, _JaxprTrace):
        return True
    frame: Any = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if direct and (code is _LINEARIZE_CUSTOM_JVP_CODE or code is _LINEARIZE_PRIMITIVE_CODE):
            return getattr(frame.f_locals.get("self"), "is_vjp", True)
        if not direct and (code is _JVP_CUSTOM_JVP_CODE or code is _JVP_PRIMITIVE_CODE):
            if isinstance(getattr(frame.f_locals.get("self"), "parent_trace", None), _JaxprTrace):
                return True
        frame = frame.f_back
    return False


_LinearizeTrace = _require(_require_module("jax._src.interpreters.ad"), "LinearizeTrace", "jax._src.interpreters.ad")
# What reverse mode's record of a call, made without tracing its jvp (so
# without its effects), is shared with: ``jax.linearize`` where
# ``LinearizeTrace`` cannot say it linearizes for vjp (before JAX 0.9), and
# ``jax.jvp`` of a jitted function once ``jax.grad`` differentiated it, where
# both build the jit's JVP jaxpr once (before JAX 0.7, without direct
# linearization).
LINEARIZE_KEEPS_ORDERED_EFFECTS = "is_vjp" in _LinearizeTrace.__init__.__code__.co_varnames
JVP_AFTER_GRAD_KEEPS_ORDERED_EFFECTS = bool(_direct_linearize.value)
_JVP_CUSTOM_JVP_CODE = _require(_JVPTrace, "process_custom_jvp_call", "jax.interpreters.ad.JVPTrace").__code__
_LINEARIZE_CUSTOM_JVP_CODE = _require(
    _LinearizeTrace, "process_custom_jvp_call", "jax._src.interpreters.ad.LinearizeTrace"
).__code__
_LINEARIZE_PRIMITIVE_CODE = _require(
    _LinearizeTrace, "process_primitive", "jax._src.interpreters.ad.LinearizeTrace"
).__code__


def ordered_effects_without_tokens(ctx: Any, effects: Any) -> list:
    """The ordered members of ``effects`` that lowering context ``ctx`` has no token for.

    Every supported JAX threads one token per ordered effect that an
    equation declared (``ctx.tokens_in``), and no others.
    """
    return [e for e in effects if _ordered_effects.contains(e) and e not in ctx.tokens_in.effects()]


def tangent_aval(x: Any) -> Any:
    """The type of a tangent for primal ``x``: its shape, dtype and ``shard_map`` varying axes."""
    return _aval(x).strip_weak_type().to_tangent_aval()


def aval_varying_axes(aval: Any) -> frozenset:
    """``varying_axes`` of a type rather than of a value (the same versions, the same fields)."""
    mat = getattr(aval, "mat", None)
    if mat is not None:
        return frozenset(mat.varying)
    return frozenset(getattr(aval, "vma", ()))


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


# ``core.unmapped_aval`` is (size, axis_name, axis, aval) in JAX 0.4.38 and
# (size, axis, aval, explicit_mesh_axis) from JAX 0.5.
_UNMAPPED_AVAL_TAKES_AXIS_NAME = "axis_name" in _unmapped_aval.__code__.co_varnames[:2]


# jax.linearize told apart from jax.vjp inside a LinearizeTrace (JAX 0.9 and
# later); before, vjpkit cannot name the class when jax.linearize reaches a
# backward-only Function, and JAX's own "can't apply forward-mode" error stands.
LINEARIZE_IS_TOLD_FROM_VJP = LINEARIZE_KEEPS_ORDERED_EFFECTS


# ---------------------------------------------------------------------------
# Call primitives that jax.extend.core.primitives lacks in some supported JAX
# (_numpy_eval.py evaluates them through their sub-jaxprs).

_pjit = _require_module("jax._src.pjit")
# JAX 0.7 and later: ``jit_p`` (named "jit"); JAX 0.4.38 to 0.6: ``pjit_p`` (named "pjit").
_jit_primitive = getattr(_pjit, "jit_p", None) or _require(_pjit, "pjit_p", "jax._src.pjit")
# ``remat_p`` (named "remat2") is in jax._src.ad_checkpoint in every supported JAX, public only in newer ones.
_remat_primitive = _require(_require_module("jax._src.ad_checkpoint"), "remat_p", "jax._src.ad_checkpoint")
CALL_PRIMITIVES = (_jit_primitive, _remat_primitive)

# ---------------------------------------------------------------------------
# Equation parameters JAX's caches hold weakly (_tie.py).


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


# ---------------------------------------------------------------------------
# JAX's debug info of a function, computed once (_function.py).

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
# core-eager: whether a batching rule's bind is differentiated on the spot (_tie.py).


def differentiating_here() -> bool:
    """Whether the current trace is a ``JVPTrace`` or ``LinearizeTrace`` (it differentiates what is bound).

    Why: a batching rule runs with its ``BatchTrace``'s parent as the current
    trace (every supported JAX); the tie's outputs must be batched when that
    parent takes their derivative, which may vary along the batch. Relies on
    ``core.trace_ctx.trace``, ``ad.JVPTrace`` and ``ad.LinearizeTrace`` (JAX >= 0.5).
    """
    linearize_trace = getattr(_ad_internal, "LinearizeTrace", None)
    trace = _trace_ctx.trace
    return isinstance(trace, _JVPTrace) or (linearize_trace is not None and isinstance(trace, linearize_trace))


_batching_internal = _require_module("jax._src.interpreters.batching")
_BatchTrace = _require(_batching_internal, "BatchTrace", "jax._src.interpreters.batching")


def is_batching() -> bool:
    """Whether a ``jax.vmap`` (``BatchTrace``) is among the active traces.

    Why: a ``custom_jvp`` called directly under vmap gets its outputs' batch
    axes after its rule ran (an output whose value does not depend on the
    batch, but whose tangent does, is then batched); inside an inner
    ``jit`` they are fixed by the primal alone, and the rule's tangent no
    longer fits. Every supported JAX chains traces through ``parent_trace``.
    """
    trace = _trace_ctx.trace
    while trace is not None:
        if isinstance(trace, _BatchTrace):
            return True
        trace = getattr(trace, "parent_trace", None)
    return False


def save_rule_debug_info(fn: Callable, traced_for: str, n_args: int) -> None:
    """``save_debug_info`` for a ``custom_jvp`` rule, which JAX describes as called with (primals, tangents)."""
    if _DEBUG_INFO_CAN_BE_SAVED:
        leaves = (_Leaf(),) * n_args
        _api_util.save_wrapped_fun_debug_info(fn, _api_util.debug_info(traced_for, fn, (leaves, leaves), {}))
