"""``random_inputs``: seeded random arrays from a compact spec, as the command line takes them."""

from __future__ import annotations

import re

import numpy as np

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

    Returns:
        A tuple of NumPy arrays, one per item (a tuple of one for one item).

    Raises:
        ValueError: naming the malformed item.

    Examples:
        >>> from vjpkit.testing import random_inputs
        >>> x, w, n = random_inputs("f64[4,3] f32[2,3] i32[]")
        >>> x.shape, x.dtype, w.shape, w.dtype, n.shape, n.dtype
        ((4, 3), dtype('float64'), (2, 3), dtype('float32'), (), dtype('int32'))
        >>> (again,) = random_inputs("f64[4,3]")  # the same seed: the same values
        >>> bool((x == again).all())
        True
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
