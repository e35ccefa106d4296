"""``vjpkit.clear_caches()``: one switch for every cache of compiled programs vjpkit keeps."""

from __future__ import annotations

from typing import Callable

_CLEARS: list[Callable[[], None]] = []


def on_clear(clear: Callable[[], None]) -> Callable[[], None]:
    """Registers a cache's ``clear``, for ``clear_caches`` to call."""
    _CLEARS.append(clear)
    return clear


def clear_caches() -> None:
    """Drops every compiled program vjpkit holds: each Function's, and gradcheck's checkers.

    Usage::

        vjpkit.clear_caches()

    The next call of each Function (and the next gradient check) traces and
    compiles again. Functions and checked functions that are deleted free
    their programs by themselves; this is for freeing memory, or starting
    measurements from a cold cache, while they are alive.
    """
    for clear in _CLEARS:
        clear()
