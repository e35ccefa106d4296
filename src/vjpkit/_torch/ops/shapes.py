"""Trace mode's op table, its shapes part: rules for shapes, views, indexing and sorting.

Reshapes, broadcasts, casts and ``*_like`` fills, transposes and other
views (also listed in ``VIEWS``), concatenation and splitting, indexing
(``__getitem__``, ``set_item`` for in-place writes), gather and scatter,
``topk`` and sorting. torch's meta run gives each result's shape.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ..dtypes import jax_dtype
from .base import Table, Untraceable, axes, cast, on_vector, size_tuple

__all__ = ["RULES", "VIEWS", "index_of", "set_item"]

TABLE = Table()
RULES, VIEWS = TABLE.rules, TABLE.views

# ---------------------------------------------------------------------------
# Shapes: torch's meta run gives the result shape.


def _reshape(out: Any, input: Any, *args: Any, **kwargs: Any) -> Any:
    return jnp.reshape(input, tuple(out.shape))


for _name in ("view", "view_as", "reshape", "reshape_as", "flatten", "unflatten", "squeeze", "unsqueeze",
              "ravel"):
    TABLE.rule(_name, view=True)(_reshape)


def _broadcast(out: Any, input: Any, *args: Any, **kwargs: Any) -> Any:
    return jnp.broadcast_to(input, tuple(out.shape))


for _name in ("expand", "expand_as", "broadcast_to"):
    TABLE.rule(_name, view=True)(_broadcast)


def _same(out: Any, input: Any, *args: Any, **kwargs: Any) -> Any:
    """Casts (``to``, ``float``...), copies and detaching: the value; the tracer casts to ``out.dtype``."""
    return input


for _name in ("type", "type_as", "float", "double", "half", "bfloat16", "long", "int", "short", "bool",
              "byte", "char", "clone", "contiguous", "positive", "__pos__", "resolve_conj", "resolve_neg"):
    TABLE.rule(_name, view=_name == "contiguous")(_same)


def _filled(value: Any) -> Callable:
    def rule(out: Any, *args: Any, **kwargs: Any) -> Any:
        return jnp.full(tuple(out.shape), value, jax_dtype(out.dtype))

    return rule


for _name, _value in (("zeros_like", 0), ("ones_like", 1), ("empty_like", 0), ("new_zeros", 0), ("new_ones", 1),
                      ("new_empty", 0)):
    TABLE.rule(_name)(_filled(_value))


@TABLE.rule("full_like")
def _full_like(out: Any, input: Any, fill_value: Any, **kwargs: Any) -> Any:
    return jnp.full(tuple(out.shape), fill_value, jax_dtype(out.dtype))


@TABLE.rule("new_full")
def _new_full(out: Any, input: Any, size: Any, fill_value: Any, **kwargs: Any) -> Any:
    return jnp.full(tuple(out.shape), fill_value, jax_dtype(out.dtype))


@TABLE.rule("transpose", "swapaxes", "swapdims", view=True)
def _transpose(out: Any, input: Any, dim0: int, dim1: int) -> Any:
    return jnp.swapaxes(input, dim0, dim1) if input.ndim else input


@TABLE.rule("permute", view=True)
def _permute(out: Any, input: Any, *dims: Any) -> Any:
    return jnp.transpose(input, size_tuple(dims))


@TABLE.rule("t", view=True)
def _t(out: Any, input: Any) -> Any:
    return input.T


RULES["torch.Tensor.T.__get__"] = lambda out, input: jnp.transpose(input)
RULES["torch.Tensor.mT.__get__"] = lambda out, input: jnp.swapaxes(input, -2, -1)
VIEWS.update({"torch.Tensor.T.__get__", "torch.Tensor.mT.__get__"})


@TABLE.rule("movedim", "moveaxis", view=True)
def _movedim(out: Any, input: Any, source: Any, destination: Any) -> Any:
    return jnp.moveaxis(input, source, destination)


@TABLE.rule("flip")
def _flip(out: Any, input: Any, *dims: Any, **kwargs: Any) -> Any:
    return jnp.flip(input, axes(size_tuple(dims) if dims else kwargs["dims"], input.ndim) or ())


@TABLE.rule("roll")
def _roll(out: Any, input: Any, shifts: Any, dims: Any = None) -> Any:
    return jnp.roll(input, shifts, dims)


@TABLE.rule("repeat", function=False)
def _repeat(out: Any, input: Any, *sizes: Any) -> Any:
    return jnp.tile(input, size_tuple(sizes))


@TABLE.rule("tile")
def _tile(out: Any, input: Any, dims: Any) -> Any:
    return jnp.tile(input, tuple(dims))


@TABLE.rule("narrow", view=True)
def _narrow(out: Any, input: Any, dim: int, start: int, length: int) -> Any:
    return lax.slice_in_dim(input, start % input.shape[dim], start % input.shape[dim] + length, axis=dim)


@TABLE.rule("select", view=True)
def _select(out: Any, input: Any, dim: int, index: int) -> Any:
    return jnp.take(input, index, axis=dim)


def _pieces(out: Any, input: Any, *args: Any, dim: int = 0, **kwargs: Any) -> tuple:
    """``split``, ``chunk`` and ``unbind``: the pieces torch's meta run made, cut along ``dim``."""
    if "dim" not in kwargs and args and isinstance(args[-1], int) and len(args) > 1:
        dim = args[-1]
    dim = kwargs.get("dim", dim) % input.ndim
    sizes = [m.shape[dim] if m.ndim == input.ndim else 1 for m in out]
    starts = np.cumsum([0, *sizes])
    cut = [lax.slice_in_dim(input, int(a), int(b), axis=dim) for a, b in zip(starts[:-1], starts[1:], strict=True)]
    return tuple(c.reshape(tuple(m.shape)) for c, m in zip(cut, out, strict=True))


for _name in ("split", "chunk", "tensor_split"):
    TABLE.rule(_name, view=True)(_pieces)


@TABLE.rule("unbind", view=True)
def _unbind(out: Any, input: Any, dim: int = 0) -> tuple:
    return tuple(jnp.moveaxis(input, dim, 0))


@TABLE.rule("cat", "concat", "concatenate", method=False)
def _cat(out: Any, tensors: Any, dim: int = 0) -> Any:
    return jnp.concatenate(cast(out, *tensors), axis=dim)


@TABLE.rule("stack", method=False)
def _stack(out: Any, tensors: Any, dim: int = 0) -> Any:
    return jnp.stack(cast(out, *tensors), axis=dim)


# ---------------------------------------------------------------------------
# Indexing, gathering and scattering.


def index_of(index: Any) -> Any:
    """A torch index as a JAX one; boolean masks select a data-dependent number of elements."""
    parts = index if isinstance(index, tuple) else (index,)
    for part in parts:
        if isinstance(part, jax.Array) and part.dtype == jnp.bool_:
            raise Untraceable("indexing with a boolean mask", "has a data-dependent shape")
    if isinstance(index, list):  # x[[1, 0]]: torch reads a list as an index array
        return jnp.asarray(index)
    if isinstance(index, tuple):
        return tuple(jnp.asarray(p) if isinstance(p, list) else p for p in index)
    return index


@TABLE.rule("__getitem__", function=False, view=True)
def _getitem(out: Any, input: Any, index: Any) -> Any:
    return input[index_of(index)]


def set_item(input: Any, index: Any, value: Any) -> Any:
    """``input[index] = value`` as a new value: a boolean mask as ``where``, anything else as ``.at[].set``."""
    value = jnp.asarray(value).astype(input.dtype)
    if isinstance(index, jax.Array) and index.dtype == jnp.bool_:
        mask = index.reshape(index.shape + (1,) * (input.ndim - index.ndim))
        if value.ndim > 0:
            raise Untraceable("assigning an array through a boolean mask", "has a data-dependent shape")
        return jnp.where(mask, value, input)
    return input.at[index].set(value)


def _along(index: Any, dim: int) -> tuple:
    """The full index tuple that reads ``index`` along ``dim`` and position elsewhere (gather/scatter)."""
    grids = list(jnp.meshgrid(*[jnp.arange(n) for n in index.shape], indexing="ij", sparse=True))
    grids[dim] = index
    return tuple(grids)


@TABLE.rule("gather")
def _gather(out: Any, input: Any, dim: int, index: Any, *, sparse_grad: bool = False) -> Any:
    return on_vector(lambda x, d, i: x[_along(i, d % x.ndim)], input, dim, index)


@TABLE.rule("take_along_dim")
def _take_along_dim(out: Any, input: Any, indices: Any, dim: int | None = None) -> Any:
    if dim is None:
        return jnp.take(input.reshape(-1), indices.reshape(-1))
    return jnp.take_along_axis(input, indices, axis=dim)


def _scatter_rule(add: bool) -> Callable:
    def rule(out: Any, input: Any, dim: int, index: Any, src: Any = None, value: Any = None, *,
             reduce: str | None = None) -> Any:
        if src is None:
            src = value
        if not isinstance(src, jax.Array) or src.ndim == 0:
            src = jnp.broadcast_to(jnp.asarray(src, input.dtype), index.shape)
        src = src[tuple(slice(0, n) for n in index.shape)].astype(input.dtype)

        def scatter(x: Any, d: int, i: Any, s: Any) -> Any:
            at = x.at[_along(i, d % x.ndim)]
            if add or reduce == "add":
                return at.add(s) if x.dtype != jnp.bool_ else at.max(s)  # bool: or
            if reduce == "multiply":
                return at.multiply(s) if x.dtype != jnp.bool_ else at.min(s)  # bool: and
            return at.set(s)

        return on_vector(scatter, input, dim, index, src)

    return rule


RULES["torch.scatter"] = RULES["torch.Tensor.scatter"] = _scatter_rule(False)
RULES["torch.scatter_add"] = RULES["torch.Tensor.scatter_add"] = _scatter_rule(True)


@TABLE.rule("one_hot", functional=True, method=False, function=False)
def _one_hot(out: Any, tensor: Any, num_classes: int = -1) -> Any:
    return jax.nn.one_hot(tensor, out.shape[-1], dtype=jax_dtype(out.dtype))  # torch's meta run knows the width


@TABLE.rule("index_select")
def _index_select(out: Any, input: Any, dim: int, index: Any) -> Any:
    return on_vector(lambda x, d, i: jnp.take(x, i.reshape(-1), axis=d), input, dim, index)


@TABLE.rule("index_add")
def _index_add(out: Any, input: Any, dim: int, index: Any, source: Any, *, alpha: Any = 1) -> Any:
    def add(x: Any, d: int, i: Any, s: Any) -> Any:
        where = (slice(None),) * (d % x.ndim) + (i.reshape(-1),)
        s = s.astype(x.dtype)
        return x.at[where].add(s if alpha == 1 else alpha * s) if x.dtype != jnp.bool_ else x.at[where].max(s)

    return on_vector(add, input, dim, index, source)


@TABLE.rule("index_fill")
def _index_fill(out: Any, input: Any, dim: int, index: Any, value: Any) -> Any:
    return on_vector(lambda x, d, i: x.at[(slice(None),) * (d % x.ndim) + (i.reshape(-1),)].set(
        jnp.asarray(value, x.dtype)), input, dim, index)


@TABLE.rule("topk")
def _topk(out: Any, input: Any, k: int, dim: int = -1, largest: bool = True, sorted: bool = True) -> tuple:
    # Sorted (torch's unsorted order is unspecified); NaN counts as the largest, as in torch.
    values, indices = _sort(out, input, dim, descending=largest)
    return (on_vector(lambda v, d: lax.slice_in_dim(v, 0, k, axis=d), values, dim),
            on_vector(lambda i, d: lax.slice_in_dim(i, 0, k, axis=d), indices, dim))


def _descending_key(x: Any) -> list:
    """Sort keys that order ``x`` from largest to smallest, NaN first (torch's order), without overflow."""
    if jnp.issubdtype(x.dtype, jnp.floating):
        return [~jnp.isnan(x), -x]
    return [~x if x.dtype != jnp.bool_ else jnp.logical_not(x)]


@TABLE.rule("sort")
def _sort(out: Any, input: Any, dim: int = -1, descending: bool = False, stable: bool = False) -> tuple:
    def sort(x: Any, d: int) -> tuple:
        iota = lax.broadcasted_iota(jax.dtypes.canonicalize_dtype(jnp.int64), x.shape, d % x.ndim)
        keys = _descending_key(x) if descending else [x]
        *_, values, order = lax.sort((*keys, x, iota), dimension=d % x.ndim, is_stable=True, num_keys=len(keys))
        return values, order

    return on_vector(sort, input, dim)


@TABLE.rule("argsort")
def _argsort(out: Any, input: Any, dim: int = -1, descending: bool = False, stable: bool = False) -> Any:
    return _sort(out, input, dim, descending)[1]


# torch.split is a Python function of torch/functional.py: resolve_name says so.
RULES["torch.functional.split"] = RULES["torch.split"]
VIEWS.add("torch.functional.split")
