"""``vjpkit.clear_caches()``: one switch for every cache of compiled programs vjpkit keeps."""

from __future__ import annotations

import weakref
from typing import Callable

_CLEARS: list[Callable[[], None]] = []


def on_clear(clear: Callable[[], None]) -> Callable[[], None]:
    """Registers a cache's ``clear``, for ``clear_caches`` to call."""
    _CLEARS.append(clear)
    return clear


def clear_caches() -> None:
    """Drops every compiled program vjpkit holds: each Function's, and gradcheck's checkers.

    The next call of each Function (and the next gradient check) traces and
    compiles again. Functions and checked functions that are deleted free
    their programs by themselves; this is for freeing memory, or starting
    measurements from a cold cache, while they are alive.

    Examples:
        >>> import jax.numpy as jnp
        >>> import vjpkit
        >>> class Double(vjpkit.Function):
        ...     @staticmethod
        ...     def forward(ctx, x):
        ...         return 2 * x
        ...
        ...     @staticmethod
        ...     def backward(ctx, g):
        ...         return 2 * g
        >>> Double.apply(jnp.ones(2)).tolist()
        [2.0, 2.0]
        >>> Double.cache_info().programs
        1
        >>> vjpkit.clear_caches()
        >>> Double.cache_info().programs
        0
    """
    for clear in _CLEARS:
        clear()


class Table(dict):
    """A dict cache that ``clear_caches`` empties, for as long as its owner keeps it (``table()``)."""

    # By identity (a dict compares by contents): two empty tables are two entries of the weak set.
    __eq__ = object.__eq__
    __hash__ = object.__hash__  # type: ignore[assignment]


_TABLES: weakref.WeakSet[Table] = weakref.WeakSet()


def table() -> Table:
    """A new dict cache, registered with ``clear_caches`` (held weakly: it lives as long as its owner)."""
    new = Table()
    _TABLES.add(new)
    return new


@on_clear
def _clear_tables() -> None:
    for cache in list(_TABLES):
        cache.clear()
