"""Pytrees split into dynamic leaves and a hashable static rest, and put back together.

The one mechanism behind every split vjpkit makes: ``apply``'s arguments
(arrays are traced, the rest is part of the compile-cache key), forward's
outputs (arrays leave the program, the rest rides in the pytree's static
data), the residuals that ctx carries to backward, the host callbacks'
arguments and gradcheck's inputs. As Equinox's ``partition``/``combine``,
but the static part is kept as positions and values, with a key that
tells ``1``, ``1.0`` and ``True`` apart.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax


class _ById:
    """Hashes an unhashable static value by identity (a cache then keys on the object)."""

    __slots__ = ("value",)

    def __init__(self, value: Any):
        self.value = value

    def __hash__(self) -> int:
        return id(self.value)

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, _ById) and other.value is self.value


def static_key(value: Any) -> Any:
    """A hashable key for a static value that tells ``1``, ``1.0`` and ``True`` apart."""
    try:
        hash(value)
    except TypeError:
        return _ById(value)
    return (type(value), value)


class Partition:
    """Where each leaf of a pytree goes: the static part of a split.

    ``treedef`` is the pytree's structure; ``static`` maps leaf positions to
    the static leaves; ``dynamic`` lists the positions of the dynamic leaves,
    in the order ``partition`` returned them. Equal (and equally hashed)
    when ``key`` is: the structure and the static leaves by ``static_key``.
    """

    __slots__ = ("treedef", "static", "dynamic", "key")

    def __init__(self, treedef: Any, static: tuple, dynamic: tuple, key: tuple):
        self.treedef = treedef
        self.static = static  # ((leaf position, value), ...)
        self.dynamic = dynamic  # (leaf position, ...)
        self.key = key

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, Partition) and self.key == other.key

    def __hash__(self) -> int:
        return hash(self.key)

    def leaves(self, dynamic_values: Sequence[Any], keep_static: bool = True) -> list:
        """All leaves, ``dynamic_values`` in the dynamic positions; None for static ones unless kept."""
        leaves: list = [None] * self.treedef.num_leaves
        if keep_static:
            for i, value in self.static:
                leaves[i] = value
        for i, value in zip(self.dynamic, dynamic_values, strict=True):
            leaves[i] = value
        return leaves

    def combine(self, dynamic_values: Sequence[Any], keep_static: bool = True) -> Any:
        """The pytree, with ``dynamic_values`` in place of its dynamic leaves (static ones None unless kept)."""
        return jax.tree_util.tree_unflatten(self.treedef, self.leaves(dynamic_values, keep_static))

    def is_tuple(self) -> bool:
        """Whether the pytree is a plain tuple (not a namedtuple, list or leaf)."""
        return self.treedef == jax.tree_util.treedef_tuple(self.treedef.children())

    def owners(self) -> tuple[tuple[int, int], ...]:
        """For the partition of a tuple: per leaf, (element holding it, its position in that element)."""
        return tuple(
            (i, j) for i, child in enumerate(self.treedef.children()) for j in range(child.num_leaves)
        )


def partition(tree: Any, is_dynamic: Callable[[Any], bool]) -> tuple[Partition, list]:
    """Splits ``tree`` into its static part and the list of its dynamic leaves."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    static, dynamic, values, key = [], [], [], [treedef]
    for i, leaf in enumerate(leaves):
        if is_dynamic(leaf):
            dynamic.append(i)
            values.append(leaf)
        else:
            static.append((i, leaf))
            key.append((i, static_key(leaf)))
    return Partition(treedef, tuple(static), tuple(dynamic), tuple(key)), values
