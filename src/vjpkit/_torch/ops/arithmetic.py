"""Trace mode's op table, its arithmetic part: torch functions and methods as JAX operations.

Each rule computes one torch operation with ``jax.numpy``/``lax`` on JAX
values. Shapes and dtypes are not worked out here: the tracer runs the same
torch call on ``meta`` tensors first, so torch itself decides type
promotion, broadcasting and dim defaults, and hands the rule that answer
as ``out`` (a meta tensor, or a tuple of them). A rule then only has to
compute the values: a reshape rule reshapes to ``out.shape``, an
arithmetic rule computes in ``out.dtype``, and the tracer casts every
result to torch's dtype and checks its shape.

Rules are keyed by ``torch.overrides.resolve_name`` of the function
(``"torch.sigmoid"``, ``"torch.Tensor.sigmoid"``, ``"torch.nn.functional.softplus"``);
their parameters carry torch's names, so keyword calls bind as in torch.

This part holds the elementwise, reduction and linear algebra rules; the
shape, view, indexing and sorting rules are ``shapes.py``'s, and the table
(``__init__.py``) is the two parts together.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax import lax

from ..dtypes import jax_dtype
from .base import Table, Untraceable, axes, cast, on_vector, size_tuple

__all__ = ["RULES", "VIEWS"]


TABLE = Table()
RULES, VIEWS = TABLE.rules, TABLE.views


# ---------------------------------------------------------------------------
# Elementwise: computed in torch's result dtype.


def _elementwise(names: str, fn: Callable, functional: bool = False) -> None:
    def rule(out: Any, *args: Any, **kwargs: Any) -> Any:
        return fn(*cast(out, *args), **kwargs)

    TABLE.rule(*names.split(), functional=functional)(rule)


_ARITHMETIC: dict[str, Callable[..., Any]] = {
    "exp": jnp.exp, "exp2": jnp.exp2, "expm1": jnp.expm1, "log": jnp.log, "log2": jnp.log2, "log10": jnp.log10,
    "log1p": jnp.log1p, "sqrt": jnp.sqrt, "rsqrt": lax.rsqrt, "sin": jnp.sin, "cos": jnp.cos, "tan": jnp.tan,
    "asin arcsin": jnp.arcsin, "acos arccos": jnp.arccos, "atan arctan": jnp.arctan, "sinh": jnp.sinh,
    "cosh": jnp.cosh, "tanh": jnp.tanh, "asinh arcsinh": jnp.arcsinh, "acosh arccosh": jnp.arccosh,
    "atanh arctanh": jnp.arctanh, "sigmoid": jax.nn.sigmoid, "erf": lax.erf, "erfc": lax.erfc,
    "abs absolute __abs__": lambda x: _abs(x), "neg negative __neg__": jnp.negative,
    "floor": jnp.floor, "ceil": jnp.ceil, "trunc fix": jnp.trunc, "frac": lambda x: x - jnp.trunc(x),
    "reciprocal": jnp.reciprocal, "square": jnp.square, "deg2rad": jnp.deg2rad, "rad2deg": jnp.rad2deg,
    "logical_not": jnp.logical_not, "bitwise_not __invert__": jnp.invert,
    "add __add__ __radd__": lambda x, y, alpha=1: x + (y if alpha == 1 else alpha * y),
    "sub subtract __sub__": lambda x, y, alpha=1: x - (y if alpha == 1 else alpha * y),
    "rsub __rsub__": lambda x, y, alpha=1: y - (x if alpha == 1 else alpha * x),
    "mul multiply __mul__ __rmul__": jnp.multiply,
    "true_divide __truediv__": jnp.true_divide, "__rtruediv__": lambda x, y: y / x,
    "floor_divide __floordiv__": jnp.floor_divide, "__rfloordiv__": lambda x, y: y // x,
    "remainder __mod__": jnp.remainder, "__rmod__": lambda x, y: jnp.remainder(y, x), "fmod": jnp.fmod,
    "pow __pow__ float_power": lambda x, y: _power(x, y), "__rpow__": lambda x, y: _power(y, x),
    "atan2 arctan2": jnp.arctan2,
    "maximum": jnp.maximum, "minimum": jnp.minimum, "fmax": jnp.fmax, "fmin": jnp.fmin, "hypot": jnp.hypot,
    "copysign": jnp.copysign, "xlogy": jax.scipy.special.xlogy, "logaddexp": jnp.logaddexp,
    "logical_and": jnp.logical_and, "logical_or": jnp.logical_or, "logical_xor": jnp.logical_xor,
    "bitwise_and __and__ __rand__": jnp.bitwise_and, "bitwise_or __or__ __ror__": jnp.bitwise_or,
    "bitwise_xor __xor__ __rxor__": jnp.bitwise_xor,
    "lerp": lambda x, end, weight: x + weight * (end - x),
}
for _names, _fn in _ARITHMETIC.items():
    _elementwise(_names, _fn)


def _predicate(names: str, fn: Callable) -> None:
    """``isnan`` and kin: on the input's own dtype (a cast to the bool result first would lose NaN)."""
    TABLE.rule(*names.split())(lambda out, input: fn(input))


for _names, _fn in {"isnan": jnp.isnan, "isinf": jnp.isinf, "isfinite": jnp.isfinite,
                    "signbit": jnp.signbit, "isposinf": jnp.isposinf, "isneginf": jnp.isneginf,
                    "isreal": jnp.isreal}.items():
    _predicate(_names, _fn)


@TABLE.rule("sign", "sgn")
def _sign(out: Any, input: Any) -> Any:
    (x,) = cast(out, input)
    if x.dtype == jnp.bool_:
        return x
    if jnp.issubdtype(x.dtype, jnp.floating):
        return jnp.where(jnp.isnan(x), jnp.zeros_like(x), jnp.sign(x))  # torch: sign(nan) is 0
    return jnp.sign(x)


def _abs(x: Any) -> Any:
    """``|x|``, whose gradient at 0 is torch's 0 (jnp.abs's is 1)."""
    if jnp.issubdtype(jnp.result_type(x), jnp.floating):
        return x * _torch_sign(lax.stop_gradient(x))
    return jnp.abs(x)


def _torch_sign(x: Any) -> Any:
    return jnp.where(jnp.isnan(x), jnp.zeros_like(x), jnp.sign(x))


def _power(x: Any, y: Any) -> Any:
    """``jnp.power``; for integers, torch's negative exponents: 0, except for the bases 1 and -1."""
    result = jnp.power(x, y)
    dtype = jnp.result_type(result)
    if not jnp.issubdtype(dtype, jnp.integer) or jnp.issubdtype(dtype, jnp.unsignedinteger):
        return result
    exponent = jnp.asarray(y)
    if not jnp.issubdtype(exponent.dtype, jnp.integer):
        return result
    base = jnp.asarray(x).astype(dtype)
    safe = jnp.power(base, jnp.maximum(exponent, 0))
    odd = (exponent % 2) != 0
    negative = jnp.where(base == 1, 1, jnp.where(base == -1, jnp.where(odd, -1, 1), 0)).astype(dtype)
    return jnp.where(exponent < 0, negative, safe)

_ACTIVATIONS: dict[str, Callable[..., Any]] = {  # also in torch.nn.functional
    "relu": lambda x, inplace=False: jax.nn.relu(x), "relu6": lambda x, inplace=False: jax.nn.relu6(x),
    "silu": lambda x, inplace=False: jax.nn.silu(x), "selu": lambda x, inplace=False: jax.nn.selu(x),
    "logsigmoid": jax.nn.log_sigmoid, "hardsigmoid": lambda x, inplace=False: jnp.clip(x / 6 + 0.5, 0, 1),
    "hardswish": lambda x, inplace=False: x * jnp.clip(x / 6 + 0.5, 0, 1),
    "mish": lambda x, inplace=False: x * jnp.tanh(jax.nn.softplus(x)),
    "softplus": lambda x, beta=1.0, threshold=20.0: _softplus(x, beta, threshold),
    "elu": lambda x, alpha=1.0, inplace=False: jax.nn.elu(x, alpha),
    "leaky_relu": lambda x, negative_slope=0.01, inplace=False: jax.nn.leaky_relu(x, negative_slope),
    "gelu": lambda x, approximate="none": jax.nn.gelu(x, approximate=approximate == "tanh"),
    "hardtanh": lambda x, min_val=-1.0, max_val=1.0, inplace=False: _clamp_values(x, min_val, max_val),
}
for _names, _fn in _ACTIVATIONS.items():
    _elementwise(_names, _fn, functional=True)


def _softplus(x: Any, beta: Any, threshold: Any) -> Any:
    linear = x * beta > threshold
    # exp of the linear region's inputs would overflow, and its NaN gradient would leak through the where.
    return jnp.where(linear, x, jnp.log1p(jnp.exp(jnp.where(linear, 0, beta * x))) / beta)


def _clamp_values(x: Any, low: Any, high: Any) -> Any:
    # torch's clamp passes the gradient on its bounds (min <= x <= max); jnp.clip halves it there.
    # A NaN bound gives NaN, as in torch.
    if not jnp.issubdtype(jnp.result_type(x), jnp.inexact):
        if low is not None:
            x = jnp.where(x < low, low, x)
        if high is not None:
            x = jnp.where(x > high, high, x)
        return x
    bounded = lax.stop_gradient(x)
    inside = jnp.ones(jnp.shape(x), bool)  # torch's gradient mask: min <= x <= max (False at NaN)
    if low is not None:
        bounded = jnp.where((bounded < low) | jnp.isnan(low), low, bounded)
        inside = inside & (x >= low)
    if high is not None:
        bounded = jnp.where((bounded > high) | jnp.isnan(high), high, bounded)
        inside = inside & (x <= high)
    return jnp.where(inside, x, bounded)


@TABLE.rule("clamp", "clip")
def _clamp(out: Any, input: Any, min: Any = None, max: Any = None) -> Any:
    x, low, high = cast(out, input, min, max)
    return _clamp_values(x, low, high)


@TABLE.rule("clamp_min")
def _clamp_min(out: Any, input: Any, min: Any) -> Any:
    return _clamp(out, input, min=min)


@TABLE.rule("clamp_max")
def _clamp_max(out: Any, input: Any, max: Any) -> Any:
    return _clamp(out, input, max=max)


@TABLE.rule("round")
def _round(out: Any, input: Any, *, decimals: int = 0) -> Any:
    return jnp.round(input, decimals)  # half to even, as torch


@TABLE.rule("div", "divide")
def _div(out: Any, input: Any, other: Any, *, rounding_mode: str | None = None) -> Any:
    x, y = cast(out, input, other)
    if rounding_mode is None:
        return jnp.true_divide(x, y)
    if rounding_mode == "floor":
        return jnp.floor_divide(x, y)
    if jnp.issubdtype(jnp.result_type(x, y), jnp.integer):  # in integers: through floats, it would round
        dtype = jax_dtype(out.dtype)
        return lax.div(jnp.asarray(x, dtype), jnp.broadcast_to(jnp.asarray(y, dtype), jnp.shape(x)))
    return jnp.trunc(jnp.true_divide(x, y))


@TABLE.rule("where", method=False)
def _where(out: Any, condition: Any, input: Any = None, other: Any = None) -> Any:
    if input is None:
        raise Untraceable("torch.where(condition)", "has a data-dependent shape")
    x, y = cast(out, input, other)
    return jnp.where(condition, x, y)


@TABLE.rule("where", function=False)
def _where_method(out: Any, input: Any, condition: Any, other: Any) -> Any:
    return _where(out, condition, input, other)


@TABLE.rule("masked_fill")
def _masked_fill(out: Any, input: Any, mask: Any, value: Any) -> Any:
    return jnp.where(mask, *cast(out, value, input))


def _comparison(names: str, fn: Callable) -> None:
    import torch

    def rule(out: Any, input: Any, other: Any, _metas: tuple = ()) -> Any:
        dtype = jax_dtype(torch.result_type(*_metas)) if _metas else None
        values = [v.astype(dtype) if dtype is not None and isinstance(v, jax.Array) else v for v in (input, other)]
        return fn(*values)

    rule.wants_metas = True  # type: ignore[attr-defined]
    TABLE.rule(*names.split())(rule)


# ---------------------------------------------------------------------------
# Reductions: torch's dim/keepdim; dim=None (or ()) reduces everything.


def _reduction(names: str, fn: Callable) -> None:
    def rule(out: Any, input: Any, dim: Any = None, keepdim: bool = False, *, dtype: Any = None) -> Any:
        (x,) = cast(out, input)
        return fn(x, axis=axes(dim, x.ndim), keepdims=keepdim)

    TABLE.rule(*names.split())(rule)


_REDUCTIONS: dict[str, Callable[..., Any]] = {
    "sum": jnp.sum, "mean": jnp.mean, "prod": jnp.prod, "amax": jnp.max, "amin": jnp.min, "nansum": jnp.nansum,
    "nanmean": jnp.nanmean, "logsumexp": jax.scipy.special.logsumexp, "any": jnp.any, "all": jnp.all,
}
for _names, _fn in _REDUCTIONS.items():
    _reduction(_names, _fn)


def _extremum(which: str) -> Callable:
    values, index, pairwise = {"max": (jnp.max, jnp.argmax, jnp.maximum),
                               "min": (jnp.min, jnp.argmin, jnp.minimum)}[which]

    def rule(out: Any, input: Any, dim: Any = None, keepdim: bool = False) -> Any:
        if isinstance(dim, jax.Array):  # torch.max(a, b): elementwise
            return pairwise(*cast(out, input, dim))
        if dim is None:
            return values(input)
        return on_vector(lambda x, d: (values(x, axis=d, keepdims=keepdim), index(x, axis=d, keepdims=keepdim)),
                          input, dim)

    return rule


for _which in ("max", "min"):
    TABLE.rule(_which)(_extremum(_which))


for _which, _fn in (("argmax", jnp.argmax), ("argmin", jnp.argmin)):
    RULES[f"torch.{_which}"] = RULES[f"torch.Tensor.{_which}"] = (
        lambda out, input, dim=None, keepdim=False, _fn=_fn:
        on_vector(lambda x, d: _fn(x, axis=d, keepdims=keepdim), input, dim) if dim is not None
        else _fn(input.reshape(-1)).reshape(out.shape))


for _which, _fn in (("var", jnp.var), ("std", jnp.std)):
    def _spread(out: Any, input: Any, dim: Any = None, unbiased: Any = None, keepdim: bool = False, *,
                correction: Any = None, _fn: Callable = _fn) -> Any:
        if isinstance(dim, bool):  # var(x, unbiased)
            dim, unbiased = None, dim
        ddof = correction if correction is not None else (0 if unbiased is False else 1)
        return _fn(input, axis=axes(dim, input.ndim), ddof=ddof, keepdims=keepdim)

    RULES[f"torch.{_which}"] = RULES[f"torch.Tensor.{_which}"] = _spread


RULES["torch.cumsum"] = RULES["torch.Tensor.cumsum"] = (
    lambda out, input, dim, *, dtype=None: on_vector(lambda x, d: jnp.cumsum(x, axis=d), cast(out, input)[0], dim))
RULES["torch.cumprod"] = RULES["torch.Tensor.cumprod"] = (
    lambda out, input, dim, *, dtype=None: on_vector(lambda x, d: jnp.cumprod(x, axis=d), cast(out, input)[0], dim))


def _softmax_dim(ndim: int) -> int:
    """torch's implicit softmax dim (deprecated): 0 for 0-, 1- and 3-d inputs, else 1."""
    return 0 if ndim in (0, 1, 3) else 1


for _which, _fn in (("softmax", jax.nn.softmax), ("log_softmax", jax.nn.log_softmax)):
    for _key in (f"torch.{_which}", f"torch.Tensor.{_which}", f"torch.nn.functional.{_which}"):
        RULES[_key] = (lambda out, input, dim=None, _stacklevel=3, dtype=None, _fn=_fn:
                       on_vector(lambda x, d: _fn(x, axis=d), cast(out, input)[0],
                                  _softmax_dim(jnp.ndim(input)) if dim is None else dim))


# ---------------------------------------------------------------------------
# Linear algebra.


@TABLE.rule("matmul", "__matmul__", "mm", "bmm")
def _matmul(out: Any, input: Any, other: Any) -> Any:
    return jnp.matmul(*cast(out, input, other))


@TABLE.rule("__rmatmul__", function=False)
def _rmatmul(out: Any, input: Any, other: Any) -> Any:
    return jnp.matmul(*cast(out, other, input))


@TABLE.rule("addmm")
def _addmm(out: Any, input: Any, mat1: Any, mat2: Any, *, beta: Any = 1, alpha: Any = 1) -> Any:
    x, a, b = cast(out, input, mat1, mat2)
    product = alpha * (a @ b) if alpha != 1 else a @ b
    return product if beta == 0 else beta * x + product if beta != 1 else x + product


@TABLE.rule("linear", functional=True, method=False, function=False)
def _linear(out: Any, input: Any, weight: Any, bias: Any = None) -> Any:
    x, w, b = cast(out, input, weight, bias)
    return x @ w.T if b is None else x @ w.T + b


@TABLE.rule("einsum", method=False)
def _einsum(out: Any, equation: str, *operands: Any) -> Any:
    return jnp.einsum(equation, *cast(out, *size_tuple(operands)))


@TABLE.rule("outer", "ger")
def _outer(out: Any, input: Any, vec2: Any) -> Any:
    return jnp.outer(*cast(out, input, vec2))


@TABLE.rule("dot", "inner")
def _dot(out: Any, input: Any, other: Any) -> Any:
    return jnp.inner(*cast(out, input, other))


@TABLE.rule("norm")
def _norm(result: Any, input: Any, p: Any = "fro", dim: Any = None, keepdim: bool = False, out: Any = None,
          dtype: Any = None) -> Any:
    if p is None:
        p = "fro"
    if isinstance(p, str) and p != "fro" or out is not None:
        raise Untraceable("torch.norm", f"is traced for p='fro' and numbers (got p={p!r}) without out=")
    (x,) = cast(result, input)
    return _vector_norm(x, 2 if p == "fro" else p, axes(dim, x.ndim), keepdim)


def _vector_norm(x: Any, p: Any, axis: Any, keepdim: bool) -> Any:
    a = jnp.abs(x)
    if p == math.inf:
        return jnp.max(a, axis=axis, keepdims=keepdim)
    if p == -math.inf:
        return jnp.min(a, axis=axis, keepdims=keepdim)
    if p == 0:
        return jnp.sum((a != 0).astype(a.dtype), axis=axis, keepdims=keepdim)
    if p == 1:
        return jnp.sum(a, axis=axis, keepdims=keepdim)
    if p == 2:
        # torch's gradient of the 2-norm at 0 is 0 (a subgradient); sqrt's would be NaN.
        squares = jnp.sum(jnp.real(x * jnp.conj(x)), axis=axis, keepdims=keepdim)
        zero = squares == 0
        return jnp.where(zero, 0, jnp.sqrt(jnp.where(zero, 1, squares)))
    return jnp.sum(a ** p, axis=axis, keepdims=keepdim) ** (1.0 / p)


def _install_comparisons() -> None:
    for names, fn in {"eq __eq__": jnp.equal, "ne not_equal __ne__": jnp.not_equal, "lt less __lt__": jnp.less,
                      "le less_equal __le__": jnp.less_equal, "gt greater __gt__": jnp.greater,
                      "ge greater_equal __ge__": jnp.greater_equal}.items():
        _comparison(names, fn)


_install_comparisons()

# torch.einsum and torch.norm are Python functions of torch/functional.py: resolve_name says so.
for _name in ("einsum", "norm"):
    RULES[f"torch.functional.{_name}"] = RULES[f"torch.{_name}"]


# ---------------------------------------------------------------------------
# Norms, padding, diagonals and broadcasting.


def _norm_dims(dim: Any, ndim: int) -> Any:
    return None if dim is None else axes(dim, ndim)


@TABLE.rule("linalg.vector_norm", method=False)
def _linalg_vector_norm(out: Any, x: Any, ord: Any = 2, dim: Any = None, keepdim: bool = False, *,
                        dtype: Any = None) -> Any:
    (x,) = cast(out, x) if dtype is not None else (x,)
    return _vector_norm(x, ord, _norm_dims(dim, x.ndim), keepdim)


@TABLE.rule("linalg.norm", method=False)
def _linalg_norm(out: Any, A: Any, ord: Any = None, dim: Any = None, keepdim: bool = False, *,
                 dtype: Any = None) -> Any:
    (x,) = cast(out, A) if dtype is not None else (A,)
    axis = _norm_dims(dim, x.ndim)
    if ord is None or ord == "fro" and (axis is None and x.ndim == 2 or axis is not None and len(axis) == 2):
        return _vector_norm(x, 2, axis, keepdim)
    if not isinstance(ord, str) and (axis is not None and len(axis) == 1 or axis is None and x.ndim == 1):
        return _vector_norm(x, ord, axis, keepdim)
    raise Untraceable("torch.linalg.norm", f"is traced for vector norms and 'fro' (got ord={ord!r})")


@TABLE.rule("diag_embed")
def _diag_embed(out: Any, input: Any, offset: int = 0, dim1: int = -2, dim2: int = -1) -> Any:
    n = input.shape[-1]
    m = n + abs(offset)
    rows, cols = jnp.arange(n) + max(-offset, 0), jnp.arange(n) + max(offset, 0)
    square = jnp.zeros((*input.shape[:-1], m, m), input.dtype).at[..., rows, cols].set(input)
    return jnp.moveaxis(square, (-2, -1), (dim1 % out.ndim, dim2 % out.ndim))


_PAD_MODES = {"reflect": "reflect", "replicate": "edge", "circular": "wrap"}


@TABLE.rule("pad", functional=True, method=False, function=False)
def _pad(out: Any, input: Any, pad: Any, mode: str = "constant", value: Any = None) -> Any:
    pairs = [(0, 0)] * (input.ndim - len(pad) // 2) + [(pad[2 * i], pad[2 * i + 1]) for i in range(len(pad) // 2)][::-1]
    if mode == "constant":
        fill = jnp.asarray(0 if value is None else value, input.dtype)
        return lax.pad(input, fill, [(lo, hi, 0) for lo, hi in pairs])  # negative pads crop, as in torch
    if mode not in _PAD_MODES or any(lo < 0 or hi < 0 for lo, hi in pairs):
        raise Untraceable("torch.nn.functional.pad", f"is traced for mode {mode!r} with positive pads only")
    return jnp.pad(input, pairs, mode=_PAD_MODES[mode])


def _broadcast_tensors(out: Any, *tensors: Any) -> tuple:
    return tuple(jnp.broadcast_to(t, tuple(o.shape)) for t, o in zip(tensors, out, strict=True))


RULES["torch.broadcast_tensors"] = RULES["torch.functional.broadcast_tensors"] = _broadcast_tensors
VIEWS.update({"torch.broadcast_tensors", "torch.functional.broadcast_tensors"})

