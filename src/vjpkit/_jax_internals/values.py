"""core and batching: the types of values (tangents, ``shard_map``'s varying axes) and vmap's batched types."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax

from ._lookup import _core, _require, _require_module

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


_mapped_aval = _require(_core, "mapped_aval", "jax._src.core")
_batch_jaxpr = _require(_require_module("jax._src.interpreters.batching"), "batch_jaxpr",
                        "jax._src.interpreters.batching")


def example_aval(aval: Any, size: int, axis: int = 0) -> Any:
    """The type of one example of a value of type ``aval`` batched along its ``axis`` (leading: 0) of ``size``."""
    return _mapped_aval(size, axis, aval)


def batch_example(jaxpr: Any, axis_data: Any, in_batched: Sequence[bool]) -> tuple[Any, list[bool]]:
    """``jaxpr`` (a closed jaxpr of one example) batched along the vmap that ``axis_data`` describes.

    Inputs and outputs batched along their leading axis; returns the
    batched jaxpr and which of its outputs vary along the batch. Why: under
    ``jax.vmap`` a rule's output is batched where it depends on a batched
    input, which only JAX's batching of its operations tells
    (``batching.batch_jaxpr``, every supported JAX: a collective over the
    vmap's axis name makes its output unbatched).
    """
    batched, out_batched = _batch_jaxpr(jaxpr, axis_data, tuple(in_batched), False)
    return batched, list(out_batched)


def batched_aval(aval: Any, size: int, axis_data: Any) -> Any:
    """``aval`` with a leading batch axis of ``size`` (keeping its sharding and varying axes)."""
    if _UNMAPPED_AVAL_TAKES_AXIS_NAME:
        return _unmapped_aval(size, axis_data.name, 0, aval)
    return _unmapped_aval(size, 0, aval, getattr(axis_data, "explicit_mesh_axis", None))


