"""Timing and tables shared by the benchmarks.

How every benchmark times: all candidates run in one process, interleaved
repeat by repeat in a rotating order (so drift and cache effects hit all of
them alike); each repeat times ``number`` back-to-back calls of a candidate
and then waits once for the last result. Ratios are medians of per-repeat
ratios (`paired_ratio`), which stay steady when other processes load the
machine.

JAX is imported only when a candidate waits with `block_until_ready`, so that
a benchmark timing PyTorch alone in a subprocess never loads it.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable, NamedTuple, Sequence


def block_until_ready(result: Any) -> Any:
    """Waits for JAX's asynchronous dispatch to finish computing ``result``."""
    import jax

    return jax.block_until_ready(result)


def no_wait(result: Any) -> None:
    """For candidates that return only when their work is done (PyTorch on CPU, Python)."""


class Candidate(NamedTuple):
    """One timed callable: ``call()`` runs it once, ``sync(result)`` waits for its result."""

    name: str
    call: Callable[[], Any]
    sync: Callable[[Any], Any] = block_until_ready
    number: int | None = None  # calls per repeat; None: time_interleaved's ``number``


def time_interleaved(
    candidates: Sequence[Candidate], *, repeat: int, number: int = 1, warmup: int = 1,
    clock: Callable[[], float] = time.perf_counter,
) -> dict[str, list[float]]:
    """Seconds per call of each candidate, one sample per repeat.

    Each candidate first runs ``warmup`` times (compiling, filling caches; a
    candidate that checks something raises here). The order rotates every
    repeat: whoever runs first after a switch pays for cold caches.
    ``clock``: wall time, or ``time.thread_time`` for work done in this
    thread alone (tracing), which other processes' load barely changes.
    """
    samples: dict[str, list[float]] = {c.name: [] for c in candidates}
    for c in candidates:
        for _ in range(warmup):
            c.sync(c.call())
    for r in range(repeat):
        k = r % len(candidates)
        for c in [*candidates[k:], *candidates[:k]]:
            n = c.number or number
            start = clock()
            for _ in range(n):
                result = c.call()
            c.sync(result)
            samples[c.name].append((clock() - start) / n)
    return samples


def median(samples: Sequence[float]) -> float:
    return statistics.median(samples)


def paired_ratio(samples: dict[str, list[float]], name: str, baseline: str) -> float:
    """Median over repeats of name's time / baseline's time in the same repeat.

    Both ran back to back, so load that comes and goes (other processes on
    the machine) cancels out of each ratio; a ratio of two medians can be
    off by 10% on a busy machine even for two copies of the same program.
    """
    return statistics.median(a / b for a, b in zip(samples[name], samples[baseline], strict=True))


def print_table(title: str | None, header: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    """A Markdown table: the first column left-aligned, the others right-aligned.

    Cells are printed as given (format numbers before passing them).
    """
    cells = [[str(h) for h in header], *[[str(c) for c in row] for row in rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    if title:
        print(f"\n{title}")

    def line(row: list[str]) -> str:
        first, *rest = row
        aligned = [first.ljust(widths[0]), *(c.rjust(w) for c, w in zip(rest, widths[1:], strict=True))]
        return "| " + " | ".join(aligned) + " |"

    print(line(cells[0]))
    print("|" + "|".join(["-" * (widths[0] + 2), *("-" * (w + 1) + ":" for w in widths[1:])]) + "|")
    for row in cells[1:]:
        print(line(row))
