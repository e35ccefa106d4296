"""The leaves a check differentiates: perturbed, fixed and static inputs, and checked outputs.

Complex leaves are checked as pairs of reals: JAX's own convention for the
VJP of a complex function is the transpose of its real-linear derivative.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .._tree import Partition, is_array, partition


def _as_outputs(out: Any) -> tuple:
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


def differentiable_outputs(out: Any) -> list[tuple[tuple, jax.Array]]:
    """(key path, leaf) of fn's output leaves that are checked: floating and complex arrays.

    A tuple (or list) output is PyTorch's several outputs; anything else is output 0.
    """
    return [
        (path, jnp.asarray(leaf))
        for path, leaf in jax.tree_util.tree_flatten_with_path(_as_outputs(out))[0]
        if is_array(leaf) and is_inexact(leaf)
    ]


def is_inexact(x: Any) -> bool:
    return jnp.issubdtype(x.dtype, jnp.inexact)


class Inputs(NamedTuple):
    """The leaves of the arguments: arrays apart from static leaves, and which arrays are perturbed.

    gradcheck perturbs floating and complex arrays only. Integer and bool
    arrays are passed to the compiled program but held fixed; every other
    leaf (Python scalars, strings, callables) is closed over as static data
    and is part of the cache key, as vjpkit's own argument split does.
    """

    layout: Partition  # array leaves (dynamic) apart from static ones
    perturbed: tuple  # per array leaf: perturbed (floating or complex) or held fixed
    sites: tuple  # per array leaf: (argument index, pytree path)

    @property
    def key(self) -> tuple:
        return (self.layout.key, self.perturbed)

    def merge(self, diff: Sequence, fixed: Sequence) -> tuple:
        """The arguments, with ``diff`` and ``fixed`` in place of those leaves."""
        it_diff, it_fixed = iter(diff), iter(fixed)
        return self.layout.combine([next(it_diff) if p else next(it_fixed) for p in self.perturbed])

    def diff_sites(self) -> list[tuple[int, str]]:
        """(argument index, pytree path) of each perturbed leaf."""
        return [site for site, p in zip(self.sites, self.perturbed, strict=True) if p]


def split_inputs(args: tuple) -> tuple[Inputs, list, list]:
    layout, arrays = partition(args, is_array)
    perturbed = tuple(is_inexact(a) for a in arrays)
    paths = [path for path, _ in jax.tree_util.tree_flatten_with_path(args)[0]]
    sites = tuple(site(paths[i]) for i in layout.dynamic)
    diff = [a for a, p in zip(arrays, perturbed, strict=True) if p]
    fixed = [a for a, p in zip(arrays, perturbed, strict=True) if not p]
    return Inputs(layout, perturbed, sites), diff, fixed


def site(path: tuple) -> tuple[int, str]:
    """A key path inside a tuple as (position in the tuple, rest of the path)."""
    return path[0].idx, jax.tree_util.keystr(tuple(path[1:]))


def real_view(x: jax.Array) -> jax.Array:
    if jnp.iscomplexobj(x):
        return jnp.stack([x.real, x.imag], axis=-1).astype(jnp.float64)
    return x.astype(jnp.float64)


def from_real_view(x: jax.Array, is_complex: bool) -> jax.Array:
    return lax.complex(x[..., 0], x[..., 1]) if is_complex else x


class CheckedLeaf(NamedTuple):
    """A differentiable input or output leaf, as the report names it."""

    index: int  # type: ignore[assignment]  # the argument's position, shadowing tuple.index
    path: str
    shape: tuple  # the leaf's own shape
    dtype: Any
    is_complex: bool


def input_leaves(split: Inputs, diff: list) -> list[CheckedLeaf]:
    return [
        CheckedLeaf(index, path, tuple(np.shape(v)), v.dtype, jnp.iscomplexobj(v))
        for (index, path), v in zip(split.diff_sites(), diff, strict=True)
    ]


def signature(diff: list, fixed: list) -> tuple:
    """Shapes, dtypes and weak types of the array leaves: a weakly typed integer promotes differently."""
    return tuple((np.shape(v), np.dtype(v.dtype), bool(getattr(v, "weak_type", False))) for v in (*diff, *fixed))


def real_view_shapes(inputs: list[CheckedLeaf]) -> tuple:
    return tuple(
        jax.ShapeDtypeStruct(p.shape + ((2,) if p.is_complex else ()), jnp.float64) for p in inputs
    )
