"""Gradient checks that read well in a pytest suite.

Usage::

    import chex
    from vjpkit.testing import assert_gradcheck, assert_gradgradcheck, random_inputs

    def test_linear_gradients():
        x, w = random_inputs("f64[20,20] f64[30,20]")
        assert_gradcheck(Linear.apply, (x, w), atol=1e-4)

    def test_exp_second_derivative():
        assert_gradgradcheck(Exp.apply, random_inputs("f64[5]"))

The key difference to calling ``vjpkit.gradcheck`` directly is that a
failure is an ``AssertionError`` carrying the full report (the mismatching
output and input, the worst element, both Jacobians), so pytest shows it as
a test failure with the report as its message, and the helper's own frames
are hidden from the traceback.
"""

from __future__ import annotations

import re
from typing import Any, Callable

import numpy as np

from ._gradcheck import GradcheckError, gradcheck, gradgradcheck
from ._port_check import assert_port_matches_original, port_differences
from ._torch_parity import assert_matches_torch

__all__ = ["assert_gradcheck", "assert_gradgradcheck", "assert_matches_torch", "assert_port_matches_original",
           "port_differences", "random_inputs"]


def assert_gradcheck(fn: Callable[..., Any], inputs: Any, **options: Any) -> None:
    """Asserts that ``vjpkit.gradcheck(fn, inputs, **options)`` passes.

    Args:
        fn, inputs: as for :func:`vjpkit.gradcheck`.
        **options: ``eps``, ``atol``, ``rtol``, ``fast_mode`` and the other
            keyword options of :func:`vjpkit.gradcheck` (not
            ``raise_exception``).

    Raises:
        AssertionError: with gradcheck's report as the message.
    """
    __tracebackhide__ = True  # pytest: show the caller's line, not this one
    try:
        gradcheck(fn, inputs, **options)
    except GradcheckError as e:
        raise AssertionError(f"gradcheck failed for {_name(fn)}:\n{e}") from None


def assert_gradgradcheck(fn: Callable[..., Any], inputs: Any, grad_outputs: Any = None,
                         **options: Any) -> None:
    """Asserts that ``vjpkit.gradgradcheck(fn, inputs, grad_outputs, **options)`` passes.

    Raises:
        AssertionError: with gradgradcheck's report as the message.
    """
    __tracebackhide__ = True
    try:
        gradgradcheck(fn, inputs, grad_outputs, **options)
    except GradcheckError as e:
        raise AssertionError(f"gradgradcheck failed for {_name(fn)}:\n{e}") from None


def _name(fn: Any) -> str:
    return getattr(fn, "__qualname__", None) or repr(fn)


# ---------------------------------------------------------------------------
# Seeded random inputs from a compact spec, as the command line takes them.

_DTYPES = {
    "f16": np.float16, "f32": np.float32, "f64": np.float64,
    "c64": np.complex64, "c128": np.complex128,
    "i8": np.int8, "i16": np.int16, "i32": np.int32, "i64": np.int64,
    "u8": np.uint8, "u32": np.uint32, "bool": np.bool_,
}
_ITEM = re.compile(r"([a-z]+[0-9]*)\[([0-9,\s]*)\]")


def random_inputs(spec: str, seed: int = 0) -> tuple[np.ndarray, ...]:
    """Seeded random NumPy arrays from a spec such as ``"f64[20,20] f64[30,20]"``.

    Floating arrays are standard normal, complex ones have standard normal
    real and imaginary parts, integers are uniform in ``[0, 10)`` and bools
    fair coin flips. NumPy arrays keep float64 whatever JAX's x64 setting.

    Args:
        spec: whitespace-separated ``DTYPE[d0,d1,...]`` items; ``f64[]`` is a
            scalar. DTYPE is one of f16, f32, f64, c64, c128, i8, i16, i32,
            i64, u8, u32, bool.
        seed: seed of the NumPy generator.

    Raises:
        ValueError: naming the malformed item.
    """
    rng = np.random.default_rng(seed)
    items = _split_items(spec)
    if not items:
        raise ValueError("empty input spec: expected items such as 'f64[20,20] f64[30,20]'")
    arrays = []
    for item in items:
        match = _ITEM.fullmatch(item)
        dims = match.group(2).replace(" ", "") if match else ""
        if (match is None or match.group(1) not in _DTYPES
                or (dims and not all(d.isdigit() for d in dims.split(",")))):
            raise ValueError(
                f"malformed input spec {item!r}: expected DTYPE[d0,d1,...] such as f64[20,20] "
                f"or f64[] for a scalar, with DTYPE one of {', '.join(_DTYPES)}"
            )
        dtype = np.dtype(_DTYPES[match.group(1)])
        shape = tuple(int(d) for d in dims.split(",")) if dims else ()
        arrays.append(_random_array(rng, shape, dtype))
    return tuple(arrays)


def _split_items(spec: str) -> list[str]:
    """Splits on whitespace outside brackets, so ``f64[2, 3]`` is one item."""
    items, depth, current = [], 0, ""
    for ch in spec:
        depth += ch == "["
        depth -= ch == "]"
        if ch.isspace() and depth == 0:
            if current:
                items.append(current)
            current = ""
        else:
            current += ch
    if current:
        items.append(current)
    return items


def _random_array(rng: np.random.Generator, shape: tuple, dtype: np.dtype) -> np.ndarray:
    if dtype.kind == "c":
        return (rng.standard_normal(shape) + 1j * rng.standard_normal(shape)).astype(dtype)
    if dtype.kind == "f":
        return rng.standard_normal(shape).astype(dtype)
    if dtype.kind == "b":
        return rng.integers(0, 2, shape).astype(dtype)
    return rng.integers(0, 10, shape).astype(dtype)
