"""Forward's outputs going out, and backward's gradients coming back, checked.

``pack_outputs`` turns whatever forward returned into a pytree whose leaves
are arrays only (non-array leaves ride in the tree's static data), which is
what the call's primitive and ``jit`` accept. ``output_cotangents`` turns JAX's
cotangents back into the arguments backward expects (PyTorch style), and
``check_backward_outputs`` validates and normalizes what backward returns.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_derivatives import SymbolicZero

from . import _jax_internals
from ._args import as_jax_leaf
from ._site import see_catalogue
from ._tree import Partition, is_array, is_differentiable_dtype, partition


def short_repr(x: Any) -> str:
    """``x`` in an error message: an array by its shape and dtype, anything else by a short repr."""
    if is_array(x):
        return f"array of shape {tuple(x.shape)} and dtype {x.dtype}"
    text = repr(x)
    return text if len(text) <= 60 else text[:57] + "..."


class Packed:
    """Forward's output as a pytree of arrays; ``unpack`` gives the user's value.

    ``layout`` (the output's structure and non-array leaves) is static data,
    which is how the call and ``jit`` let non-array outputs through.
    """

    __slots__ = ("arrays", "layout")

    def __init__(self, arrays: tuple, layout: Partition):
        self.arrays = arrays
        self.layout = layout

    def unpack(self) -> Any:
        return self.layout.combine(self.arrays)


jax.tree_util.register_dataclass(Packed, data_fields=["arrays"], meta_fields=["layout"])


class ResidualMeta(NamedTuple):
    """Static data carried from forward to backward inside the residual treedef."""

    layout: Partition  # where saved arrays and ctx attributes go
    needs: tuple
    differentiable: tuple  # per array output: whether it carries a gradient
    out_avals: tuple
    materialize: bool
    in_kinds: tuple


class Residuals:
    """What forward leaves backward (and jvp): residual arrays, and the static ``meta``."""

    __slots__ = ("arrays", "meta")

    def __init__(self, arrays: tuple, meta: ResidualMeta):
        self.arrays = arrays
        self.meta = meta


jax.tree_util.register_dataclass(Residuals, data_fields=["arrays"], meta_fields=["meta"])


# The layout of a single array output, the common case: built once.
_ONE_ARRAY = partition(0, lambda leaf: True)[0]


def pack_outputs(owner: str, out: Any) -> Packed:
    if is_array(out):
        return Packed((as_jax_leaf(out),), _ONE_ARRAY)
    if out is None:
        raise TypeError(
            f"{owner}.forward returned None: a Function must return at least one array. "
            f"Did forward forget its return statement? {see_catalogue('forward-returns-none')}"
        )
    layout, arrays = partition(out, is_array)
    if not arrays and layout.static:
        raise TypeError(
            f"{owner}.forward returned no array ({short_repr(out)}); a Function "
            f"must return at least one array. {see_catalogue('forward-returns-no-array')}"
        )
    return Packed(tuple(map(as_jax_leaf, arrays)), layout)


def differentiable_outputs(out: Any, non_differentiable: Sequence[Any]) -> tuple[bool, ...]:
    """Per array leaf of forward's output: inexact and not marked non-differentiable."""
    if not non_differentiable and is_array(out):
        return (is_differentiable_dtype(out.dtype),)
    marked = {id(x) for x in non_differentiable}
    return tuple(
        id(leaf) not in marked and is_differentiable_dtype(leaf.dtype)
        for leaf in jax.tree_util.tree_leaves(out)
        if is_array(leaf)
    )


def output_cotangents(
    layout: Partition,
    cotangents: Sequence[Any],
    avals: Sequence[tuple],
    differentiable: Sequence[bool],
    materialize: bool,
) -> tuple:
    """backward's positional arguments: one per tuple element, else one.

    Absent gradients (outputs JAX found unused, non-differentiable outputs)
    become zeros, or ``None`` when materialization is off; PyTorch's rule.
    """
    grads = []
    for ct, (shape, dtype), diff in zip(cotangents, avals, differentiable, strict=True):
        if diff and not isinstance(ct, SymbolicZero):
            grads.append(ct)
        else:
            grads.append(jnp.zeros(shape, dtype) if materialize else None)
    if layout is _ONE_ARRAY:
        return (grads[0],)
    structured = layout.combine(grads, keep_static=False)
    return tuple(structured) if layout.is_tuple() else (structured,)


def _count_message(owner: str, got: int, names: tuple, was_list: bool) -> str:
    expected = len(names)
    if was_list:
        hint = f" A list counts as one value: return a tuple of gradients. {see_catalogue('list-of-gradients')}"
    elif got > expected:
        hint = (" Values after the last input's gradient are allowed only if they are None. "
                f"{see_catalogue('too-many-gradients')}")
    else:
        hint = f" Return None for inputs that need no gradient. {see_catalogue('too-few-gradients')}"
    return (
        f"{owner}.backward returned {got} gradient{'s' if got != 1 else ''}, "
        f"expected {expected} (one per forward input: {', '.join(names)}).{hint}"
    )


_STATIC_HINT = (
    " To differentiate with respect to a scalar, pass it as an array "
    f"(jnp.asarray(c)); otherwise return None in its place. {see_catalogue('gradient-for-a-static-input')}"
)


def _matches_structure(treedef: Any, value: Any) -> bool:
    """Whether ``value`` has ``treedef``'s structure down to its leaves.

    ``flatten_up_to`` alone accepts any value at a leaf position (a tuple
    "matches" a single array), so each part must also be a leaf or None.
    """
    try:
        parts = treedef.flatten_up_to(value)
    except (ValueError, TypeError):
        return False
    return all(
        p is None or jax.tree_util.treedef_is_leaf(jax.tree_util.tree_structure(p)) for p in parts
    )


def check_backward_outputs(
    owner: str,
    result: Any,
    param_treedefs: Sequence[Any],
    names: tuple,
    leaf_kinds: Sequence[Any],
    needs: Sequence[bool],
    method: str = "backward",
) -> list:
    """Validates backward's result; returns one cotangent (or None) per array input leaf.

    ``leaf_kinds`` has, for every leaf of the bound arguments (in flattening
    order), either ``None`` for a static leaf or the ``(shape, dtype)`` of an
    array leaf, optionally followed by its ``shard_map`` varying axes.
    """
    n = len(param_treedefs)
    was_list = isinstance(result, list)
    if not isinstance(result, tuple):
        result = (result,)
    elif n == 1 and _matches_structure(param_treedefs[0], result):
        # One parameter whose value is itself a tuple: this is its gradient.
        result = (result,)
    if len(result) > n and all(g is None for g in result[n:]):
        result = result[:n]
    if len(result) != n:
        raise TypeError(_count_message(owner, len(result), names, was_list))

    cotangents: list = []
    leaf = 0
    for i, (treedef, grad) in enumerate(zip(param_treedefs, result, strict=True)):
        n_leaves = treedef.num_leaves
        kinds = leaf_kinds[leaf : leaf + n_leaves]
        where = _InputName(i, names[i])  # formatted only in an error message
        if grad is None:
            grad_leaves = [None] * n_leaves
        else:
            try:
                grad_leaves = treedef.flatten_up_to(grad)
            except (ValueError, TypeError):
                if all(kind is None for kind in kinds):
                    raise TypeError(
                        f"{owner}.{method} returned a gradient for {where}, which is "
                        f"static (not an array, so not differentiated): expected None, "
                        f"got {short_repr(grad)}.{_STATIC_HINT}"
                    ) from None
                got = jax.tree_util.tree_structure(grad, is_leaf=lambda x: x is None)
                raise TypeError(
                    f"{owner}.{method} returned a gradient for {where} with structure "
                    f"{got}, expected the input's structure {treedef} (None is "
                    f"allowed for any part). {see_catalogue('wrong-structure')}"
                ) from None
        for j, (kind, g) in enumerate(zip(kinds, grad_leaves, strict=True)):
            at = where if n_leaves == 1 else _InputName(i, names[i], j)
            if kind is None:
                if g is not None:
                    raise TypeError(
                        f"{owner}.{method} returned a gradient for {at}, which is "
                        f"static (not an array, so not differentiated): expected "
                        f"None, got {short_repr(g)}.{_STATIC_HINT}"
                    )
                continue
            shape, dtype, *varying = kind
            if g is None or not is_differentiable_dtype(dtype):
                cotangents.append(None)
                continue
            if isinstance(g, SymbolicZero):
                cotangents.append(None)
                continue
            if not is_array(g):
                raise TypeError(
                    f"{owner}.{method} returned {short_repr(g)} "
                    f"({type(g).__name__}) as the gradient for {at}: expected an "
                    f"array of shape {shape} and dtype {dtype}, or None. {see_catalogue('non-array-gradient')}"
                )
            g = _fit_shape(owner, method, at, g, shape)
            g = _fit_dtype(owner, method, at, g, dtype)
            if varying:
                g = _fit_varying(g, varying[0])
            cotangents.append(g if needs[i] else None)
        leaf += n_leaves
    return cotangents


class _InputName:
    """``input i ('name')`` (``at leaf j``), as error messages name a gradient's place."""

    __slots__ = ("i", "name", "leaf")

    def __init__(self, i: int, name: str, leaf: int | None = None):
        self.i, self.name, self.leaf = i, name, leaf

    def __str__(self) -> str:
        where = f"input {self.i} ({self.name!r})"
        return where if self.leaf is None else f"{where} at leaf {self.leaf}"


def _fit_shape(owner: str, method: str, at: object, g: Any, shape: tuple) -> Any:
    """Sums a broadcast gradient down to the input's shape (PyTorch's rule)."""
    g_shape = tuple(g.shape)
    if g_shape == shape:
        return g
    try:
        broadcast = np.broadcast_shapes(shape, g_shape)
    except ValueError:
        broadcast = None
    if broadcast != g_shape:
        raise ValueError(
            f"{owner}.{method} returned a gradient of shape {g_shape} for {at}: "
            f"expected shape {shape} (or a shape that {shape} broadcasts to, "
            f"which is summed down). {see_catalogue('wrong-shape')}"
        )
    lead = len(g_shape) - len(shape)
    axes = tuple(range(lead)) + tuple(
        lead + k for k, d in enumerate(shape) if d == 1 and g_shape[lead + k] != 1
    )
    return jnp.sum(g, axis=axes).reshape(shape)


def _fit_varying(g: Any, varying: frozenset) -> Any:
    """Gives a gradient its input's ``shard_map`` type (the axes it varies along).

    Why: an input that is the same on every device (``in_specs=P()``) but
    meets per-device data in forward is implicitly broadcast across devices
    (``pvary``); the adjoint of that broadcast is a sum over them (``psum``),
    as in JAX's own autodiff. backward computes this device's share, so it
    is summed: the same rule as a broadcast shape summed down. A gradient
    that does not vary for an input that does is only retyped (``pcast``).
    """
    g_varying = _jax_internals.varying_axes(g)
    extra = g_varying - varying
    if extra:
        g = jax.lax.psum(g, tuple(sorted(extra, key=str)))
    missing = varying - g_varying
    if missing:
        g = _jax_internals.cast_to_varying(g, tuple(sorted(missing, key=str)))
    return g


def _fit_dtype(owner: str, method: str, at: object, g: Any, dtype: Any, what: str = "gradient") -> Any:
    """Casts a gradient (or a jvp's tangent) to its primal's dtype; complex for a real primal raises."""
    if g.dtype == dtype:
        return g
    if jnp.issubdtype(g.dtype, jnp.complexfloating) and not jnp.issubdtype(dtype, jnp.complexfloating):
        raise TypeError(
            f"{owner}.{method} returned a complex {what} ({g.dtype}) for {at}, "
            f"which is real ({dtype}): expected dtype {dtype}. Take the real part "
            "explicitly if that is what you mean. "
            + (see_catalogue("jvp-complex-tangent-for-a-real-output") if what == "tangent"
               else see_catalogue("complex-gradient-for-a-real-input"))
        )
    return jnp.asarray(g).astype(dtype)


def check_jvp_outputs(name: str, result: Any, layout: Partition, differentiable: tuple, out_avals: tuple) -> list:
    """jvp's tangents, one per differentiable output: checked (count, structure, shape) and cast to its dtype."""
    spread = layout.is_tuple()  # a tuple output: one tangent per element
    n_outputs = len(layout.treedef.children()) if spread else 1
    if spread:
        if not isinstance(result, tuple):
            result = (result,)
        if len(result) != n_outputs:
            raise TypeError(
                f"{name}.jvp returned {len(result)} tangent{'s' if len(result) != 1 else ''}, "
                f"expected {n_outputs} (one per output of forward). {see_catalogue('jvp-wrong-count')}"
            )
        structured = result
    else:
        # A single array matches any structure, so a tuple is never its tangent.
        single = jax.tree_util.treedef_is_leaf(layout.treedef)
        if isinstance(result, tuple) and (single or not _same_structure(layout.treedef, result)):
            if len(result) != 1:
                raise TypeError(
                    f"{name}.jvp returned {len(result)} tangents, expected 1 (one per "
                    f"output of forward, which returns a single "
                    f"{'array' if single else 'pytree'}, not a tuple). Return the "
                    f"tangent itself. {see_catalogue('jvp-wrong-count')}"
                )
            result = result[0]
        structured = result
    try:
        leaves = layout.treedef.flatten_up_to(structured)
    except (ValueError, TypeError):
        got = jax.tree_util.tree_structure(structured, is_leaf=lambda x: x is None)
        raise TypeError(
            f"{name}.jvp returned tangents with structure {got}, expected the "
            f"output's structure {layout.treedef} (None is allowed for any part)."
        ) from None
    by_position = dict(zip(layout.dynamic, range(len(layout.dynamic)), strict=True))
    tangents = []
    for position, t in enumerate(leaves):
        j = by_position.get(position)
        if j is None or not differentiable[j]:
            continue
        shape, dtype = out_avals[j]
        if t is None:
            tangents.append(jnp.zeros(shape, dtype))
            continue
        if not is_array(t):
            raise TypeError(
                f"{name}.jvp returned {short_repr(t)} as the tangent of output {j}: "
                f"expected an array of shape {shape} and dtype {dtype}, or None. "
                f"{see_catalogue('jvp-non-array-tangent')}"
            )
        if tuple(t.shape) != shape:
            raise ValueError(
                f"{name}.jvp returned a tangent of shape {tuple(t.shape)} for "
                f"output {j}: expected shape {shape}. {see_catalogue('jvp-wrong-shape')}"
            )
        tangents.append(_fit_dtype(name, "jvp", f"output {j}", t, dtype, what="tangent"))
    return tangents


def _same_structure(treedef: Any, value: Any) -> bool:
    try:
        treedef.flatten_up_to(value)
    except (ValueError, TypeError):
        return False
    return True
