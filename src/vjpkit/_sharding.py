"""Sharding types: Functions that run unchanged under Explicit mesh axes and inside ``shard_map``.

JAX types arrays by how they are spread over devices, in two ways that a
ported ``torch.autograd.Function`` knows nothing of:

- Under a mesh whose axes are ``Explicit`` (``jax.make_mesh``'s default on
  recent JAX), every array's type carries its sharding, and an operation
  whose result sharding is ambiguous raises ``ShardingTypeError``; the
  usual backward ``g.T @ x`` over a batch-sharded ``x`` is one (it contracts
  the sharded axis). JAX's own transpose rules give each gradient its
  input's sharding. vjpkit does the same for ``backward``: it runs it with
  the mesh's Explicit axes switched to Auto (as ``jax.sharding.auto_axes``
  does), so XLA picks the shardings inside, and gives each gradient its
  input's sharding. ``forward`` and ``jvp`` run as any JAX code does under
  the caller's mesh: their outputs get the shardings JAX's type rules give,
  and an ambiguous operation there raises an error naming the class and
  the fix.
- Inside ``jax.shard_map`` an array's type says which mesh axes it varies
  along. A host Function's callback result is typed as varying along
  nothing; it is computed from this device's inputs, so ``vary_like``
  types it as varying along every axis its inputs vary along.

Everything that differs between JAX versions is looked up in one place,
``_jax_internals.sharding_api``; on a JAX without these types (0.4.38) every function
here returns its input unchanged.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax

from . import _jax_internals


def debug_callback_everywhere() -> dict:
    """Keywords for ``jax.debug.callback`` to run it on every device, in every process.

    Why: in a sharded program JAX runs a debug callback once, on device 0,
    so only process 0 would see what it reports. Empty on a JAX whose
    debug callbacks cannot run on every device (0.4.38).
    """
    return dict(_jax_internals.sharding_api().debug_callback_everywhere)


# ---------------------------------------------------------------------------
# shard_map: host callbacks vary like their inputs.


def vary_like(outputs: Any, inputs: Sequence[Any]) -> Any:
    """``outputs`` typed as varying along every ``shard_map`` axis that some input varies along.

    Why: ``jax.pure_callback`` types its result as the same on every device,
    but a host Function's callback runs on each device's own inputs. Typed
    so, JAX's ``shard_map`` autodiff and vjpkit's gradient fitting sum a
    replicated input's per-device gradients, as for any JAX operation.
    """
    api = _jax_internals.sharding_api()
    if api.mark_varying is None:
        return outputs
    varying = frozenset().union(*(api.varying_axes(x) for x in inputs))
    if not varying:
        return outputs

    def mark(x: Any) -> Any:
        missing = varying - api.varying_axes(x)
        return api.mark_varying(x, tuple(sorted(missing, key=str))) if missing else x

    return jax.tree_util.tree_map(mark, outputs)


# ---------------------------------------------------------------------------
# Explicit axes: backward runs with them switched to Auto.


def _explicit_axes(mesh: Any) -> tuple:
    return () if mesh is None or mesh.empty else tuple(mesh.explicit_axes)


def explicit_sharding(x: Any) -> Any:
    """The sharding in ``x``'s type if it names a mesh with Explicit axes, else ``None``.

    vjpkit keeps it from forward to backward (it is hashable, static data),
    to give ``x``'s gradient the same type.
    """
    if _jax_internals.sharding_api().get_abstract_mesh is None:
        return None
    return explicit_sharding_of_type(jax.typeof(x))


def explicit_sharding_of_type(aval: Any) -> Any:
    """``explicit_sharding`` of an array of type ``aval`` (``None`` on a JAX without Explicit axes)."""
    if _jax_internals.sharding_api().get_abstract_mesh is None:
        return None
    sharding = getattr(aval, "sharding", None)
    if sharding is None or not _explicit_axes(getattr(sharding, "mesh", None)):
        return None
    return sharding


def gradient_shardings(in_kinds: Sequence[Any]) -> list:
    """One target sharding (or ``None``) per array input leaf, from the inputs' kinds.

    ``in_kinds`` has, per leaf of the bound arguments, ``None`` (static) or
    ``(shape, dtype, varying_axes, explicit_sharding)``.
    """
    return [kind[3] if len(kind) > 3 else None for kind in in_kinds if kind is not None]


def call_with_auto_axes(fn: Callable, args: tuple, out_shardings: Sequence[Any]) -> Any:
    """``fn(*args)`` with the mesh's Explicit axes switched to Auto; results given ``out_shardings``.

    Why: a backward ported from PyTorch computes ``g.T @ x`` over a sharded
    batch, which Explicit axes reject as ambiguous. With them switched to
    Auto, as ``jax.sharding.auto_axes`` does, XLA chooses how intermediates
    are sharded, and each result is then resharded to its target type
    (its input's type, as JAX's own transpose rules give).

    ``fn`` returns a sequence with one entry per ``out_shardings`` entry;
    ``None`` entries stay ``None``, as do results whose target is ``None``.
    Array leaves of ``args`` are retyped for the Auto mesh (no data moves);
    ``fn`` must reach every array through ``args``, since an array typed
    for the Explicit mesh cannot meet one typed for the Auto mesh.
    Without Explicit axes this is ``fn(*args)``.
    """
    api = _jax_internals.sharding_api()
    if api.get_abstract_mesh is None:
        return fn(*args)
    mesh = _mesh_of(api, args)
    explicit = _explicit_axes(mesh)
    if not explicit:
        return fn(*args)
    auto_mesh = mesh.update_axis_types({axis: api.auto for axis in explicit})

    def to_auto(x: Any) -> Any:
        sharding = explicit_sharding(x) if isinstance(x, jax.Array) else None
        if sharding is None:
            return x
        return api.reshard(x, _without_axes(sharding.spec, explicit))

    with api.use_abstract_mesh(auto_mesh):
        out = fn(*jax.tree_util.tree_map(to_auto, args))
    if len(out) != len(out_shardings):
        raise AssertionError(f"vjpkit: {len(out)} results for {len(out_shardings)} shardings")
    return type(out)(
        x if x is None or sharding is None else api.reshard(x, sharding)
        for x, sharding in zip(out, out_shardings, strict=True)
    )


def _mesh_of(api: _jax_internals.ShardingApi, args: Any) -> Any:
    """The context mesh, else (under ``jit`` with no ``jax.set_mesh``) the mesh in an input's type."""
    mesh = api.get_abstract_mesh()
    if not mesh.empty:
        return mesh
    for x in jax.tree_util.tree_leaves(args):
        if isinstance(x, jax.Array):
            # explicit_sharding(x), inlined: this runs for every leaf of every backward.
            leaf_mesh = getattr(getattr(jax.typeof(x), "sharding", None), "mesh", None)
            if _explicit_axes(leaf_mesh):
                return leaf_mesh
    return None


def _without_axes(spec: Any, axes: tuple) -> Any:
    """``spec`` with the mesh axes ``axes`` removed (they are Auto inside: untyped)."""
    removed = set(axes)
    parts = []
    for part in spec:
        if isinstance(part, tuple):
            kept = tuple(a for a in part if a not in removed)
            parts.append(kept or None)
        else:
            parts.append(None if part in removed else part)
    return jax.sharding.PartitionSpec(*parts)


# ---------------------------------------------------------------------------
# forward and jvp: an ambiguous operation gets an error naming the class.


def sharding_type_errors() -> tuple:
    """The exception types of an ambiguous sharding (empty on a JAX without Explicit axes)."""
    error = _jax_internals.sharding_api().sharding_type_error
    return () if error is None else (error,)


def forward_sharding_error(owner: str, method: str, error: Exception) -> Exception:
    """``error`` (a ``ShardingTypeError`` raised in ``owner.method``), saying what to do."""
    return type(error)(
        f"{owner}.{method} raised ShardingTypeError under a mesh with Explicit axes: {error}\n"
        f"{owner}.{method} runs as any JAX code does under the caller's mesh, so an "
        "operation whose result sharding is ambiguous needs one: give it out_sharding= "
        "(e.g. jnp.matmul(a, b, out_sharding=P('batch'))), reshard an input first "
        "(jax.sharding.reshard(w, P()) gathers a sharded weight), or wrap that part in "
        "jax.sharding.auto_axes, or make the mesh's axes Auto (axis_types=(AxisType.Auto, ...)). "
        f"{owner}.backward needs none of this: vjpkit runs it with Explicit axes switched "
        "to Auto and gives each gradient its input's sharding."
    )
