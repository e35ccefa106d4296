"""Exceptions raised in vjpkit's host callbacks, carried beside the runtime's error.

A callback (a host Function's NumPy method, a ``from_torch`` original, an
anomaly check) runs on XLA's threads when the compiled program runs, and
the exception it raises reaches the caller only as the runtime's error:
``jax.errors.JaxRuntimeError``, its text wrapped differently by each backend
(the CPU quotes the traceback; a GPU appends where in the program it
failed), and raised at the call on the CPU but when the result is awaited
where programs run asynchronously (a GPU). So the callback hands vjpkit the
exception object itself (``carry``), and code that translates the runtime's
error asks for the exceptions carried since it started (``mark``,
``carried_since``) instead of reading the runtime's text.

Process-wide, as the callbacks' threads are XLA's; a short history is enough.
"""

from __future__ import annotations

import collections
import itertools
import threading

_LOCK = threading.Lock()
_COUNT = itertools.count(1)
# (number, source, exception, thread), oldest first: the numbers only grow.
_CARRIED: collections.deque = collections.deque(maxlen=64)
_LAST = [0]  # the number of the newest exception carried


def carry(e: BaseException, source: str) -> None:
    """Records ``e``, raised in a callback of ``source`` (``"host"``, ``"anomaly"``, ...) on its way to XLA."""
    with _LOCK:
        _LAST[0] = number = next(_COUNT)
        _CARRIED.append((number, source, e, threading.get_ident()))


def mark() -> int:
    """A point in the history: ``carried_since(mark(), ...)`` sees only exceptions carried after it."""
    return _LAST[0]


def carried_since(start: int, source: str, off_thread: int | None = None) -> list[BaseException]:
    """The exceptions ``source``'s callbacks carried after ``start``, oldest (the first failure) first.

    ``off_thread``: only those raised on another thread than this one (a
    thread id): by a program that ran asynchronously, so that they reached
    that thread only where it awaited the program's results, if at all.
    """
    with _LOCK:
        return [e for number, s, e, t in _CARRIED if number > start and s == source and t != off_thread]


def is_carried(e: BaseException, source: str) -> bool:
    """Whether ``e`` itself was raised in a callback of ``source`` (and carried)."""
    with _LOCK:
        return any(c is e and s == source for _, s, c, _ in _CARRIED)
