"""Public JAX surfaces that moved or changed between versions (sharding types, the XLA FFI, callbacks on
device buffers), and JAX's error messages that vjpkit explains."""

from __future__ import annotations

import functools
import importlib
import inspect
import re
from typing import Any, Callable, NamedTuple, Sequence

import jax

from ._lookup import _core
from .values import HAS_VARYING_TYPES, cast_to_varying, typeof, varying_axes

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
# Callbacks on device buffers (``_torch/device.py``).


@functools.cache
def buffer_callback_api() -> Callable[..., Any] | None:
    """``jax.experimental.buffer_callback.buffer_callback``, or None where this JAX lacks it.

    Why: it hands a callback XLA's own buffers (DLPack on CPU and GPU) and, on
    a GPU, XLA's stream, so ``from_torch`` runs torch where the arrays are
    without a copy. JAX 0.6 and later have it with buffers that speak DLPack;
    0.4.38 to 0.5 do not (there ``jax.pure_callback`` hands host arrays).
    """
    try:
        from jax.experimental.buffer_callback import Buffer, buffer_callback
    except ImportError:
        return None
    return buffer_callback if hasattr(Buffer, "__dlpack__") else None


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
# experimental.shard_map before JAX 0.6: its replication check (``check_rep=True``, the default) reads each
# primitive's rule from a table; a primitive without one fails the check ("No replication rule"). From JAX 0.6
# ``jax.shard_map`` checks varying types instead, which a primitive's abstract evaluation gives.


def check_replication_by_jaxpr(primitive: Any, jaxpr_of: Callable[[dict, Sequence[Any]], Any]) -> None:
    """Gives ``primitive`` replication rules for ``jax.experimental.shard_map`` before JAX 0.6 (else nothing).

    ``jaxpr_of(params, in_avals)``: the closed jaxpr an equation runs, its
    ``jaxpr`` parameter. The check reads that jaxpr's; the rewrite (which
    JAX makes before differentiating the body) rewrites it as a ``jit``'s
    and binds the primitive with it. Where an equation's parameters hold no
    jaxpr and its types are unknown (the check), its outputs count as
    replicated nowhere. Relies on ``shard_map._check_rules``,
    ``_rewrite_rules``, ``_check_rep`` and ``_replication_rewrite_nomatch``
    (JAX 0.4.38 to 0.5).
    """
    if hasattr(jax, "shard_map"):
        return
    experimental = importlib.import_module("jax.experimental.shard_map")
    names = ("_check_rules", "_rewrite_rules", "_check_rep", "_replication_rewrite_nomatch")
    if not all(hasattr(experimental, name) for name in names):
        return
    check_rep, rewrite_jaxpr = experimental._check_rep, experimental._replication_rewrite_nomatch

    def check(mesh: Any, *in_rep: Any, **params: Any) -> Any:
        jaxpr = params.get("jaxpr")
        return set() if jaxpr is None else check_rep(mesh, jaxpr.jaxpr, in_rep)

    def rewrite(mesh: Any, in_rep: Any, *args: Any, **params: Any) -> Any:
        jaxpr, out_rep = rewrite_jaxpr(mesh, jaxpr_of(params, [typeof(x) for x in args]), in_rep)
        return primitive.bind(*args, **{**params, "jaxpr": jaxpr}), out_rep

    experimental._check_rules[primitive] = check
    experimental._rewrite_rules[primitive] = rewrite
