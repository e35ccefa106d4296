"""One comparison of a port's results with its PyTorch reference's.

``assert_matches_torch`` and ``assert_port_matches_original`` both compare
pairs of results, what the port got and what the reference expected: the
outputs, the first-order gradients and the second-order products of the
loss ``sin_loss``. This module is the one rule they share:

- ``within_tolerance``: elementwise ``|got - expected| <= atol + rtol * |expected|``;
- ``largest_difference``: the largest ``|got - expected|`` over two pytrees;
- ``Mismatches``: the report listing every mismatching pair with its worst
  element.

Everywhere a NaN agrees with a NaN (both sides undefined at the same point),
and a NaN on one side only is a difference.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import numpy as np

from .report import format_element


def sin_loss(xp: Any, outputs: Sequence[Any], cotangents: Sequence[Any] | None = None) -> Any:
    """``sum(real(conj(c) * sin(y)))`` over the outputs ``y`` and their cotangents ``c`` (default 1).

    The scalar both checkers differentiate: through ``sin``, so that no
    output's gradient is constant and the second derivative sees the
    outputs' own. ``xp`` is the outputs' array library, ``jax.numpy`` or
    ``torch``, so that both sides differentiate the same expression.
    """
    weights: Sequence[Any] = [None] * len(outputs) if cotangents is None else cotangents
    terms = [xp.sin(y) if c is None else xp.conj(c) * xp.sin(y) for y, c in zip(outputs, weights, strict=True)]
    return sum((xp.sum(xp.real(t)) for t in terms), xp.zeros(()))


def within_tolerance(got: Any, expected: Any, atol: float, rtol: float) -> np.ndarray:
    """Elementwise ``|got - expected| <= atol + rtol * |expected|``, a NaN agreeing with a NaN."""
    got, expected = _wide(got), _wide(expected)
    both_nan = np.isnan(got) & np.isnan(expected)
    return both_nan | (np.abs(got - expected) <= atol + rtol * np.abs(expected))


def absolute_difference(got: Any, expected: Any) -> np.ndarray:
    """Elementwise ``|got - expected|`` in float64; 0 where both are NaN, NaN where one is."""
    got, expected = _wide(got), _wide(expected)
    return np.where(np.isnan(got) & np.isnan(expected), 0.0, np.abs(got - expected))


def largest_difference(got: Any, expected: Any) -> float:
    """The largest ``absolute_difference`` over every element of two pytrees of arrays.

    Infinite when their numbers of leaves or a pair of shapes differ: no
    elementwise difference measures that.
    """
    got_leaves, expected_leaves = jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(expected)
    if len(got_leaves) != len(expected_leaves):
        return float("inf")
    pairs = [(np.asarray(g), np.asarray(e)) for g, e in zip(got_leaves, expected_leaves, strict=True)]
    if any(g.shape != e.shape for g, e in pairs):
        return float("inf")
    return float(np.max([np.max(absolute_difference(g, e), initial=0.0) for g, e in pairs], initial=0.0))


class Mismatches:
    """Collects every mismatch between vjpkit's results and torch's; one ``AssertionError`` lists them."""

    def __init__(self, atol: float, rtol: float):
        self.atol, self.rtol = atol, rtol
        self.found: list[str] = []

    def compare(self, what: str, expected: np.ndarray, got: np.ndarray) -> bool:
        """Records how ``got`` (vjpkit's) differs from ``expected`` (torch's); whether it does."""
        problem = mismatch(what, expected, got, self.atol, self.rtol)
        if problem is not None:
            self.found.append(problem)
        return problem is not None

    def note(self, text: str) -> None:
        """Adds a line that is no mismatch of its own (a diagnosis of the ones found)."""
        self.found.append(text)

    def raise_if_any(self, headline: str) -> None:
        """``AssertionError``: the headline, then a line per mismatch, when any was found."""
        __tracebackhide__ = True
        if self.found:
            raise AssertionError(
                f"{headline} in {len(self.found)} place(s):\n" + "\n".join(f"- {p}" for p in self.found)
            )


def mismatch(what: str, expected: np.ndarray, got: np.ndarray, atol: float, rtol: float) -> str | None:
    """What differs between ``got`` (vjpkit's) and ``expected`` (torch's), or ``None`` when they agree.

    Shapes and kinds first; arrays that are neither floating nor complex
    must be equal; floating and complex ones agree ``within_tolerance``.
    """
    if expected.shape != got.shape:
        return f"{what}: shape {got.shape} from vjpkit, {expected.shape} from torch."
    if expected.dtype.kind not in "fc" or got.dtype.kind not in "fc":
        return _unequal(what, expected, got)
    if (expected.dtype.kind == "c") != (got.dtype.kind == "c"):
        return f"{what}: {_kind(got)} from vjpkit, {_kind(expected)} from torch."
    return _beyond_tolerance(what, expected, got, atol, rtol)


def _unequal(what: str, expected: np.ndarray, got: np.ndarray) -> str | None:
    """How two arrays that are neither floating nor complex differ: none may."""
    if np.array_equal(expected, got):
        return None
    bad = np.argwhere(expected != got)
    return (
        f"{what}: {len(bad)} of {expected.size} elements differ "
        f"(first at {tuple(int(i) for i in bad[0])}: torch {expected[tuple(bad[0])]!r}, "
        f"vjpkit {got[tuple(bad[0])]!r})."
    )


def _beyond_tolerance(what: str, expected: np.ndarray, got: np.ndarray, atol: float, rtol: float) -> str | None:
    """How many elements differ beyond the tolerance, and the worst of them."""
    agree = within_tolerance(got, expected, atol, rtol)
    if agree.all():
        return None
    worst = _worst_element(got, expected)
    e, g = expected[worst].item(), _wide(got)[worst].item()
    rel = abs(g - e) / abs(e) if e != 0 else float("inf")
    return (
        f"{what}: {int((~agree).sum())} of {expected.size} elements differ by more than "
        f"atol + rtol * |torch| (atol={atol:g}, rtol={rtol:g}).\n"
        f"  worst: element {format_element(worst)}\n"
        f"    torch:  {e!r}\n"
        f"    vjpkit: {g!r}\n"
        f"    abs diff: {abs(g - e):.6g}    rel diff: {rel:.6g}"
    )


def _worst_element(got: np.ndarray, expected: np.ndarray) -> tuple:
    """The index of the largest ``absolute_difference``, a NaN on one side counting as the largest."""
    difference = absolute_difference(got, expected)
    score = np.where(np.isnan(difference), np.inf, difference)
    return np.unravel_index(int(np.argmax(score)), expected.shape) if expected.shape else ()


def _kind(a: np.ndarray) -> str:
    return "complex" if a.dtype.kind == "c" else "real"


def _wide(a: Any) -> np.ndarray:
    """complex128 for complex arrays, else float64: the precision every difference is taken in."""
    a = np.asarray(a)
    return a.astype(np.complex128 if a.dtype.kind == "c" else np.float64)
