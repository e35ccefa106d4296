"""Programs: lowering with effects, ``jit``'s inlining and JAX's caches, debug info, configuration states
and the configuration a trace depends on."""

from __future__ import annotations

import functools
import threading
from typing import Any, Callable

import jax

from ._lookup import _config, _pe, _pjit, _require, _require_module

# ---------------------------------------------------------------------------
# effects and mlir: lowering a primitive with effects.

_ordered_effects = _require(_require_module("jax._src.effects"), "ordered_effects", "jax._src.effects")


def ordered_effects_without_tokens(ctx: Any, effects: Any) -> list:
    """The ordered members of ``effects`` that lowering context ``ctx`` has no token for.

    Every supported JAX threads one token per ordered effect that an
    equation declared (``ctx.tokens_in``), and no others.
    """
    return [e for e in effects if _ordered_effects.contains(e) and e not in ctx.tokens_in.effects()]


_runtime_tokens = _require(_require_module("jax._src.dispatch"), "runtime_tokens", "jax._src.dispatch")


def effects_barrier() -> None:
    """``jax.effects_barrier()``, after which a failed program's error is not raised again.

    Why: JAX keeps the runtime tokens of the last programs with callbacks
    until a barrier succeeds, so after one program failed every later
    barrier (and JAX's own at exit) would raise its error again, until
    another program with callbacks ran on that device.
    """
    try:
        jax.effects_barrier()
    except Exception:
        _runtime_tokens.output_runtime_tokens = {}
        raise


# ---------------------------------------------------------------------------
# dispatch: the kernel JAX outside ``jit`` runs a primitive by.

_dispatch = _require_module("jax._src.dispatch")
_apply_primitive = _require(_dispatch, "apply_primitive", "jax._src.dispatch")
_xla_primitive_callable = _require(_dispatch, "xla_primitive_callable", "jax._src.dispatch")


def eager_kernel(primitive: Any, params: dict) -> Any:
    """The ``jax.jit`` of one primitive by which JAX outside ``jit`` runs ``primitive`` with ``params``.

    None where eager mode does not run it as one compiled kernel: a call
    into a sub-program (a custom derivative's call, a ``jit`` with compiler
    options or shardings of its own) or a primitive with an implementation of
    its own. Every supported JAX gives a kernel's primitive the implementation
    ``partial(apply_primitive, primitive)``, which runs
    ``xla_primitive_callable(primitive, **params)`` (cached).
    """
    impl = primitive.impl
    if isinstance(impl, functools.partial) and impl.func is _apply_primitive and impl.args == (primitive,):
        return _xla_primitive_callable(primitive, **params)
    if primitive is _jit_p and not params.get("compiler_options_kvs") and all(
            type(s).__name__ == "UnspecifiedValue" for s in (*params["in_shardings"], *params["out_shardings"])):
        # Eager mode compiles a jit's program as a program of its own; here it is the one call of an
        # enclosing jit, which XLA inlines: the same operations, compiled with the same options.
        return _xla_primitive_callable(primitive, **params)
    return None


_jit_p = getattr(_pjit, "jit_p", None) or _require(_pjit, "pjit_p", "jax._src.pjit")


# ---------------------------------------------------------------------------
# source_info_util: a named scope around a user's method (its ops' names in profiles).

# ``jax.named_scope`` is a slotted context manager from JAX 0.5 on
# (``source_info_util.ExtendNameStackContextManager``). In JAX 0.4.38 it is two
# nested generator context managers, which cost a Function call about as much
# tracing as its own operations: there vjpkit does what later JAX does.
_source_info_util = _require_module("jax._src.source_info_util")
if hasattr(_source_info_util, "ExtendNameStackContextManager"):  # JAX 0.5 on
    named_scope: Callable[[str], Any] = jax.named_scope
else:  # JAX 0.4.38
    _source_info_context = _require(_source_info_util, "_source_info_context", "jax._src.source_info_util")

    class named_scope:  # type: ignore[no-redef]
        """``jax.named_scope(name)``, as JAX 0.5 and later make it."""

        __slots__ = ("name", "prev")

        def __init__(self, name: str):
            self.name = name

        def __enter__(self) -> None:
            self.prev = prev = _source_info_context.context
            _source_info_context.context = prev.replace(name_stack=prev.name_stack.extend(self.name))

        def __exit__(self, *exc_info: Any) -> None:
            _source_info_context.context = self.prev


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


# Whether JAX's caches can hold an equation's parameters weakly (``util.weakref_cache_key_types``, JAX 0.7 on).
# Before, a cache of JAX 0.4.38's keeps the parameters of the equations of a function that jit traced, so an
# equation in the program's own jit referring to its program keeps that program alive after vjpkit dropped it.
PARAMETERS_HELD_WEAKLY = hasattr(_require_module("jax._src.util"), "weakref_cache_key_types")


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
    # fixed tuple of JAX's own states; among them is the XLA metadata of the
    # public ``jax.experimental.xla_metadata.set_xla_metadata``.
    from jax.experimental.xla_metadata import set_xla_metadata

    return _FlagMarkedInMetadata(name, config_ext.Config(False, True), set_xla_metadata)


class _EnteredContexts(threading.local):
    """One thread's metadata contexts, innermost last."""

    def __init__(self) -> None:
        self.contexts: list = []


class _FlagMarkedInMetadata:
    """A thread-local flag in the dispatch key, marked in the trace caches' key by XLA metadata (JAX 0.4.38 to 0.7).

    While it is on, ``set_xla_metadata(name=True)`` is entered on its thread:
    the metadata is part of ``config.trace_context()`` (so a program traced
    without the flag is never reused with it, nor the reverse), and each
    operation traced meanwhile carries it to XLA as a frontend attribute,
    which no compiler pass reads.
    """

    __slots__ = ("_name", "_state", "_set_xla_metadata", "_entered")

    def __init__(self, name: str, state: Any, set_xla_metadata: Callable):
        self._name = name
        self._state = state
        self._set_xla_metadata = set_xla_metadata
        self._entered = _EnteredContexts()

    @property
    def value(self) -> Any:
        return self._state.value

    def swap_local(self, value: Any) -> Any:
        """Sets the flag on this thread (``set_local(previous)`` undoes it) and returns its previous value."""
        context = self._set_xla_metadata(**{self._name: value})
        context.__enter__()
        self._entered.contexts.append(context)
        return self._state.swap_local(value)

    def set_local(self, previous: Any) -> None:
        """Undoes the innermost ``swap_local`` of this thread, the flag back at ``previous``."""
        self._state.set_local(previous)
        self._entered.contexts.pop().__exit__(None, None, None)


# ---------------------------------------------------------------------------
# The configuration a trace depends on (_checking/checkers.py keys its checkers by it).


# ``jax._src.config.trace_context`` in every supported JAX (0.4.38 on); no public name.
_trace_context = _require(_config, "trace_context", "jax._src.config")


def trace_configuration() -> tuple:
    """JAX's trace-time configuration (x64, matmul precision, default device, ...), hashable.

    Why: ``jax.jit`` keys its own caches on it, and a cache of traced
    programs outside ``jax.jit`` must too. vjpkit's own states
    (``detect_anomaly``) are part of it: from JAX 0.8 as states of their
    own, before as XLA metadata (see ``thread_local_flag``).
    """
    return _trace_context()



# ---------------------------------------------------------------------------
# partial_eval: a jaxpr split by what is known.

_partial_eval_jaxpr_nounits = _require(_pe, "partial_eval_jaxpr_nounits", "jax._src.interpreters.partial_eval")


def split_known(jaxpr: Any, unknowns: list) -> tuple[Any, Any]:
    """``jaxpr`` split into what its known inputs alone compute, and the rest.

    Returns (known, unknown): ``known`` maps the known inputs to residuals;
    ``unknown`` maps the residuals, then the unknown inputs, to every output.
    Why: partial evaluation sees into no primitive's rule, so a rule's work
    on known values is split off by hand (``partial_eval_jaxpr_nounits``,
    every supported JAX; not public from JAX 0.10).
    """
    known, unknown, _, _ = _partial_eval_jaxpr_nounits(jaxpr, unknowns, instantiate=True)
    return known, unknown
