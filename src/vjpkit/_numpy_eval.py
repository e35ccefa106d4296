"""Evaluating a jaxpr with NumPy, op by op on the host: no lowering, no compile.

Usage::

    closed = jax.make_jaxpr(f)(x)
    run = numpy_evaluator(closed)          # plans once
    outputs = run([np.asarray(x)])         # a list of NumPy arrays, one per output

Why: gradcheck's checking program runs once in the common case, and XLA's
CPU compiler spends about a millisecond per kernel on it, so compiling costs
seconds where evaluating the same equations with NumPy costs milliseconds.

The key differences to ``jax.core.eval_jaxpr``:

- Each primitive in ``TABLE`` is evaluated by NumPy with lax's semantics
  (strict dtypes, truncating integer division, saturating float-to-int
  conversion, NaN-propagating max, ``sort``'s order of -0.0 and NaN, ...), so
  no JAX dispatch and no per-primitive compile happens.
- Call-like primitives (``jit``, ``closed_call``, ``remat``, custom
  derivative calls, ``cond``, ``while``, ``scan``) are evaluated through
  their sub-jaxprs, with Python control flow. vjpkit's tie, which every
  Function call under a derivative leaves in the jaxpr, selects operands.
- Every other primitive (gather, scatter, linear algebra, callbacks,
  random bits, vjpkit's ``linear_call``, anything unknown) falls back to
  ``primitive.bind`` on the same values: JAX's own eager dispatch. Always
  correct, only slower. So are equations whose values have dtypes NumPy
  does not compute with as XLA does (bfloat16, float8, PRNG keys), and
  params NumPy cannot honour (a transcendental's ``accuracy``).

Results agree with the compiled program up to rounding in the last bits
(libm against XLA's own approximations of ``exp``, summation order), and
XLA's CPU flushing subnormals to zero.
"""

from __future__ import annotations

import functools
import inspect
import math
from typing import Any, Callable, Sequence

import numpy as np
from jax import lax
from jax.extend import core as jex_core
from jax.extend.core import primitives as P

from . import _jax_internals
from ._linear_call import LINEAR_CALL_PRIMITIVE, refuse_forward_mode
from ._tie import TIE_PRIMITIVE

# Dtypes NumPy computes with as XLA's CPU backend does (to rounding).
_NATIVE = frozenset(
    np.dtype(t)
    for t in (np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64,
              np.float16, np.float32, np.float64, np.complex64, np.complex128)
)


# ---------------------------------------------------------------------------
# Elementwise primitives. lax is strictly typed: the caller casts every result to
# its equation's output dtype, so NumPy's own promotion never leaks through.


def _is_int(x: np.ndarray) -> bool:
    return x.dtype.kind in "iu"


def _div(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Integers: truncation toward zero; x / 0 is -1 (all bits set), INT_MIN / -1 is INT_MIN (XLA)."""
    if not _is_int(x):
        return np.true_divide(x, y)
    zero = y == 0
    safe = np.where(zero, 1, y)
    if x.dtype.kind == "i":  # INT_MIN / -1 overflows: divided by 1 instead, it is INT_MIN
        safe = np.where((x == np.iinfo(x.dtype).min) & (safe == -1), 1, safe)
    q = (x - np.fmod(x, safe)) // safe  # exact: x - fmod(x, y) is a multiple of y
    return np.where(zero, np.array(-1).astype(x.dtype), q)


def _rem(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """C's fmod: the sign of x. Integers: x % 0 is x, INT_MIN % -1 is 0 (XLA)."""
    if not _is_int(x):
        return np.fmod(x, y)
    zero = y == 0
    r = np.fmod(x, np.where(zero, 1, y))
    return np.where(zero, x, r)


def _integer_pow(x: np.ndarray, *, y: int) -> np.ndarray:
    """Binary exponentiation, multiplication for multiplication as lax lowers it (a reciprocal last for y < 0)."""
    if y == 0:
        return np.ones_like(x)
    reciprocal, y = y < 0, abs(y)
    acc = None
    while y > 0:
        if y & 1:
            acc = x if acc is None else acc * x
        y >>= 1
        if y > 0:
            x = x * x
    assert acc is not None
    return np.ones_like(acc) / acc if reciprocal else acc


def _round(x: np.ndarray, *, rounding_method: Any) -> np.ndarray:
    if int(rounding_method) == int(lax.RoundingMethod.TO_NEAREST_EVEN):
        return np.round(x)
    t = np.trunc(x)  # away from zero; x - t is exact, unlike x + 0.5
    return np.where(np.abs(x - t) >= 0.5, t + np.sign(x), t)


def _sign(x: np.ndarray) -> np.ndarray:
    if x.dtype.kind == "c":
        a = np.abs(x)
        return np.where(a == 0, 0, x / np.where(a == 0, 1, a))
    return np.sign(x)


def _logistic(x: np.ndarray) -> np.ndarray:
    return 1 / (1 + np.exp(-x))


def _complex(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """x + i y, built part by part (x + 1j * y would turn an infinite y into NaN)."""
    shape = np.broadcast_shapes(x.shape, y.shape)
    out = np.empty(shape, np.complex128 if x.dtype == np.float64 else np.complex64)
    out.real, out.imag = x, y
    return out


def _shift(x: np.ndarray, y: np.ndarray, kind: str) -> np.ndarray:
    """XLA's shifts of the bits: an amount outside [0, bits) shifts every bit out.

    An arithmetic right shift takes the bits as signed, a logical one as
    unsigned, whatever the dtype.
    """
    bits = x.dtype.itemsize * 8
    unsigned, signed = np.dtype(f"u{x.dtype.itemsize}"), np.dtype(f"i{x.dtype.itemsize}")
    amount = y.astype(unsigned)
    valid = amount < bits
    amount = np.where(valid, amount, 0)
    if kind == "left":
        out = np.where(valid, x.astype(unsigned) << amount, 0)
    elif kind == "logical":
        out = np.where(valid, x.astype(unsigned) >> amount, 0)
    else:
        v = x.astype(signed)
        out = np.where(valid, v >> amount.astype(signed), np.where(v < 0, -1, 0))
    return out.astype(signed).astype(x.dtype)


def _convert_element_type(x: np.ndarray, *, new_dtype: Any) -> np.ndarray:
    new = np.dtype(new_dtype)
    if x.dtype.kind == "c" and new.kind != "c":
        x = np.real(x)  # lax drops the imaginary part
    if new.kind == "b":
        return x != 0
    if new.kind in "iu" and x.dtype.kind == "f":
        # XLA saturates out-of-range values and maps NaN to 0.
        info = np.iinfo(new)
        t = np.trunc(x)
        inside = t.astype(new)
        out = np.where(t >= info.max, info.max, np.where(t <= info.min, info.min, inside))
        return np.where(np.isnan(x), 0, out).astype(new)
    return x.astype(new)


# ---------------------------------------------------------------------------
# Structural primitives.


def _broadcast_in_dim(x: np.ndarray, *, shape: tuple, broadcast_dimensions: tuple) -> np.ndarray:
    expanded = [1] * len(shape)
    for i, d in enumerate(broadcast_dimensions):
        expanded[d] = x.shape[i]
    return np.broadcast_to(x.reshape(expanded), shape)


def _reshape(x: np.ndarray, *, new_sizes: tuple, dimensions: tuple | None = None) -> np.ndarray:
    if dimensions is not None:
        x = np.transpose(x, dimensions)
    return x.reshape(new_sizes)


def _iota(*, dtype: Any, shape: tuple, dimension: int) -> np.ndarray:
    axis = [1] * len(shape)
    axis[dimension] = shape[dimension]
    return np.broadcast_to(np.arange(shape[dimension], dtype=dtype).reshape(axis), shape)


def _slice(x: np.ndarray, *, start_indices: tuple, limit_indices: tuple, strides: tuple | None) -> np.ndarray:
    steps = strides or (1,) * x.ndim
    return x[tuple(slice(a, b, s) for a, b, s in zip(start_indices, limit_indices, steps, strict=True))]


def _clamped_starts(shape: tuple, sizes: tuple, indices: Sequence) -> list[int]:
    """lax clamps start indices so that the window fits inside the operand."""
    return [min(max(int(i), 0), n - s) for i, n, s in zip(indices, shape, sizes, strict=True)]


def _dynamic_slice(x: np.ndarray, *indices: np.ndarray, slice_sizes: tuple) -> np.ndarray:
    starts = _clamped_starts(x.shape, slice_sizes, indices)
    return x[tuple(slice(a, a + s) for a, s in zip(starts, slice_sizes, strict=True))]


def _dynamic_update_slice(x: np.ndarray, update: np.ndarray, *indices: np.ndarray) -> np.ndarray:
    starts = _clamped_starts(x.shape, update.shape, indices)
    out = np.array(x)
    out[tuple(slice(a, a + s) for a, s in zip(starts, update.shape, strict=True))] = update
    return out


def _pad(x: np.ndarray, value: np.ndarray, *, padding_config: Sequence) -> np.ndarray:
    """Interior padding first, then low/high edges, which may be negative (cropping)."""
    shape, place, crop = [], [], []
    for n, (lo, hi, interior) in zip(x.shape, padding_config, strict=True):
        lo, hi, interior = int(lo), int(hi), int(interior)
        spread = n + max(n - 1, 0) * interior
        shape.append(max(lo, 0) + spread + max(hi, 0))
        place.append(slice(max(lo, 0), max(lo, 0) + spread, interior + 1))
        crop.append(slice(max(-lo, 0), shape[-1] - max(-hi, 0)))
    out = np.full(shape, value, dtype=x.dtype)
    out[tuple(place)] = x
    return out[tuple(crop)]


def _select_n(which: np.ndarray, *cases: np.ndarray) -> np.ndarray:
    if which.dtype == np.bool_:
        return np.where(which, cases[1], cases[0]) if len(cases) == 2 else cases[0]
    out = cases[0]
    for i, case in enumerate(cases[1:], start=1):
        out = np.where(which == i, case, out)
    return out


def _clamp(lo: np.ndarray, x: np.ndarray, hi: np.ndarray) -> np.ndarray:
    return np.minimum(np.maximum(x, lo), hi)


def _dot_general(lhs: np.ndarray, rhs: np.ndarray, *, dimension_numbers: Any, preferred_element_type: Any = None,
                 result_dtype: Any) -> np.ndarray:
    """Batch dimensions, then lhs's free ones, then rhs's: a batched matmul of (B, M, K) by (B, K, N)."""
    (lc, rc), (lb, rb) = dimension_numbers
    lf = [d for d in range(lhs.ndim) if d not in lc and d not in lb]
    rf = [d for d in range(rhs.ndim) if d not in rc and d not in rb]

    def sizes(x: np.ndarray, dims: Sequence) -> list[int]:
        return [x.shape[d] for d in dims]

    batch, b, k = sizes(lhs, lb), math.prod(sizes(lhs, lb)), math.prod(sizes(lhs, lc))
    free_l, free_r = sizes(lhs, lf), sizes(rhs, rf)
    a = np.transpose(lhs, [*lb, *lf, *lc]).astype(result_dtype, copy=False).reshape(b, math.prod(free_l), k)
    c = np.transpose(rhs, [*rb, *rc, *rf]).astype(result_dtype, copy=False).reshape(b, k, math.prod(free_r))
    return np.matmul(a, c).reshape(*batch, *free_l, *free_r)


def _reduction(ufunc: np.ufunc, identity: Callable[[np.dtype], Any]) -> Callable:
    def reduce(x: np.ndarray, *, axes: tuple) -> np.ndarray:
        return ufunc.reduce(x, axis=tuple(axes), dtype=x.dtype, initial=identity(x.dtype))

    return reduce


def _lowest(dtype: np.dtype) -> Any:
    return -np.inf if dtype.kind == "f" else (False if dtype.kind == "b" else np.iinfo(dtype).min)


def _highest(dtype: np.dtype) -> Any:
    return np.inf if dtype.kind == "f" else (True if dtype.kind == "b" else np.iinfo(dtype).max)


def _all_ones(dtype: np.dtype) -> Any:
    return True if dtype.kind == "b" else np.array(-1).astype(dtype)


def _arg_reduction(pick: Callable) -> Callable:
    def reduce(x: np.ndarray, *, axes: tuple, index_dtype: Any) -> np.ndarray:
        return pick(x, axis=axes[0]).astype(index_dtype)

    return reduce


def _cumulative(accumulate: Callable) -> Callable:
    def cumulative(x: np.ndarray, *, axis: int, reverse: bool) -> np.ndarray:
        if reverse:
            return np.flip(accumulate(np.flip(x, axis), axis), axis)
        return accumulate(x, axis)

    return cumulative


def _sort(*operands: np.ndarray, dimension: int, is_stable: bool, num_keys: int) -> list[np.ndarray]:
    """Lexicographic on the first ``num_keys`` operands, stable (unstable sorts fall back).

    lax's comparator takes -0.0 as 0.0 and every NaN as the greatest value:
    NumPy's order of floats, so its keys need no transformation.
    """
    keys = [np.moveaxis(k, dimension, -1) for k in operands[:num_keys]]
    order = np.lexsort(keys[::-1], axis=-1)  # np.lexsort: the last key is the primary one
    return [np.moveaxis(np.take_along_axis(np.moveaxis(x, dimension, -1), order, -1), -1, dimension)
            for x in operands]


# ---------------------------------------------------------------------------
# The table: primitive -> NumPy function of the operands (params as keywords), and
# which dtypes it takes (NumPy's kinds: "f" float, "c" complex, "i"/"u" signed/unsigned integer, "b" bool).


def _elementwise(f: Callable) -> Callable:
    """A NumPy function of the operands only (taking no params)."""
    return lambda *xs: f(*xs)


_ANY, _NUMBERS, _INEXACT, _REAL, _FLOAT, _INTEGER = "fciub", "fciu", "fc", "fiub", "f", "iub"

_BY_NAME: dict[str, tuple[Callable, str]] = {
    # Arithmetic.
    "neg": (_elementwise(np.negative), _NUMBERS),
    "sign": (_elementwise(_sign), _NUMBERS),
    "floor": (_elementwise(np.floor), _FLOAT),
    "ceil": (_elementwise(np.ceil), _FLOAT),
    "round": (_round, _FLOAT),
    "is_finite": (_elementwise(np.isfinite), _FLOAT),
    "exp": (_elementwise(np.exp), _INEXACT),
    "exp2": (_elementwise(np.exp2), _INEXACT),
    "log": (_elementwise(np.log), _INEXACT),
    "log1p": (_elementwise(np.log1p), _INEXACT),
    "expm1": (_elementwise(np.expm1), _INEXACT),
    "tanh": (_elementwise(np.tanh), _INEXACT),
    "logistic": (_elementwise(_logistic), _INEXACT),
    "sin": (_elementwise(np.sin), _INEXACT),
    "cos": (_elementwise(np.cos), _INEXACT),
    "tan": (_elementwise(np.tan), _INEXACT),
    "asin": (_elementwise(np.arcsin), _INEXACT),
    "acos": (_elementwise(np.arccos), _INEXACT),
    "atan": (_elementwise(np.arctan), _INEXACT),
    "sinh": (_elementwise(np.sinh), _INEXACT),
    "cosh": (_elementwise(np.cosh), _INEXACT),
    "asinh": (_elementwise(np.arcsinh), _INEXACT),
    "acosh": (_elementwise(np.arccosh), _INEXACT),
    "atanh": (_elementwise(np.arctanh), _INEXACT),
    "sqrt": (_elementwise(np.sqrt), _INEXACT),
    "rsqrt": (_elementwise(lambda x: 1 / np.sqrt(x)), _INEXACT),
    "cbrt": (_elementwise(np.cbrt), _FLOAT),
    "abs": (_elementwise(np.abs), _NUMBERS),
    "square": (_elementwise(np.square), _NUMBERS),
    "integer_pow": (_integer_pow, _NUMBERS),
    "real": (_elementwise(np.real), "c"),
    "imag": (_elementwise(np.imag), "c"),
    "conj": (_elementwise(np.conjugate), _INEXACT),
    "complex": (_elementwise(_complex), _FLOAT),
    "add": (_elementwise(np.add), _NUMBERS),
    "add_any": (_elementwise(np.add), _NUMBERS),
    "sub": (_elementwise(np.subtract), _NUMBERS),
    "mul": (_elementwise(np.multiply), _NUMBERS),
    "div": (_elementwise(_div), _NUMBERS),
    "rem": (_elementwise(_rem), "fiu"),
    "pow": (_elementwise(np.power), _FLOAT),  # complex: XLA's special cases (1 ** inf) differ
    "max": (_elementwise(np.maximum), _REAL),  # complex max/min order lexicographically: fallback
    "min": (_elementwise(np.minimum), _REAL),
    "atan2": (_elementwise(np.arctan2), _FLOAT),
    "nextafter": (_elementwise(np.nextafter), _FLOAT),
    "clamp": (_elementwise(_clamp), _REAL),
    # Bits and logic.
    "not": (_elementwise(np.invert), _INTEGER),
    "and": (_elementwise(np.bitwise_and), _INTEGER),
    "or": (_elementwise(np.bitwise_or), _INTEGER),
    "xor": (_elementwise(np.bitwise_xor), _INTEGER),
    "shift_left": (_elementwise(functools.partial(_shift, kind="left")), "iu"),
    "shift_right_logical": (_elementwise(functools.partial(_shift, kind="logical")), "iu"),
    "shift_right_arithmetic": (_elementwise(functools.partial(_shift, kind="arithmetic")), "iu"),
    # Comparisons (ordering complex numbers is lexicographic in lax: fallback).
    "eq": (_elementwise(np.equal), _ANY),
    "ne": (_elementwise(np.not_equal), _ANY),
    "lt": (_elementwise(np.less), _REAL),
    "le": (_elementwise(np.less_equal), _REAL),
    "gt": (_elementwise(np.greater), _REAL),
    "ge": (_elementwise(np.greater_equal), _REAL),
    "select_n": (_elementwise(_select_n), _ANY),
    # Types and copies.
    "convert_element_type": (_convert_element_type, _ANY),
    "copy": (_elementwise(np.array), _ANY),
    # Shapes.
    "broadcast_in_dim": (_broadcast_in_dim, _ANY),
    "reshape": (_reshape, _ANY),
    "squeeze": (lambda x, *, dimensions: np.squeeze(x, tuple(dimensions)), _ANY),
    "transpose": (lambda x, *, permutation: np.transpose(x, permutation), _ANY),
    "rev": (lambda x, *, dimensions: np.flip(x, tuple(dimensions)), _ANY),
    "iota": (_iota, _ANY),
    "slice": (_slice, _ANY),
    "dynamic_slice": (_dynamic_slice, _ANY),
    "dynamic_update_slice": (_elementwise(_dynamic_update_slice), _ANY),
    "concatenate": (lambda *xs, dimension: np.concatenate(xs, axis=dimension), _ANY),
    "pad": (_pad, _ANY),
    # Reductions and scans.
    "reduce_sum": (_reduction(np.add, lambda d: 0), _NUMBERS),
    "reduce_prod": (_reduction(np.multiply, lambda d: 1), _NUMBERS),
    "reduce_max": (_reduction(np.maximum, _lowest), _REAL),
    "reduce_min": (_reduction(np.minimum, _highest), _REAL),
    "reduce_and": (_reduction(np.bitwise_and, _all_ones), _INTEGER),
    "reduce_or": (_reduction(np.bitwise_or, lambda d: False if d.kind == "b" else 0), _INTEGER),
    "reduce_xor": (_reduction(np.bitwise_xor, lambda d: False if d.kind == "b" else 0), _INTEGER),
    "argmax": (_arg_reduction(np.argmax), _REAL),
    "argmin": (_arg_reduction(np.argmin), _REAL),
    "cumsum": (_cumulative(lambda x, axis: np.cumsum(x, axis, dtype=x.dtype)), _NUMBERS),
    "cumprod": (_cumulative(lambda x, axis: np.cumprod(x, axis, dtype=x.dtype)), _NUMBERS),
    "cummax": (_cumulative(lambda x, axis: np.maximum.accumulate(x, axis)), _REAL),
    "cummin": (_cumulative(lambda x, axis: np.minimum.accumulate(x, axis)), _REAL),
    "cumlogsumexp": (_cumulative(lambda x, axis: np.logaddexp.accumulate(x, axis)), _FLOAT),
    "sort": (_sort, _REAL),
    "dot_general": (_dot_general, _NUMBERS),
}


def _primitives() -> dict[str, Any]:
    """The primitive objects of this JAX, by name (names the running JAX lacks are absent)."""
    found = {p.name: p for p in vars(P).values() if isinstance(p, jex_core.Primitive)}
    for p in _jax_internals.CALL_PRIMITIVES:
        found.setdefault(p.name, p)
    return found


_PRIMITIVES = _primitives()
# primitive -> (NumPy function, dtype kinds it takes).
TABLE: dict[Any, tuple[Callable, str]] = {
    _PRIMITIVES[name]: rule for name, rule in _BY_NAME.items() if name in _PRIMITIVES
}


# Params that say nothing about the values (placement, the CPU's ignored precision, typing
# annotations): ignored. Any other param a rule does not take must be None (the default, such
# as a transcendental's ``accuracy`` or ``mul``'s ``out_dtype``), else the equation falls back.
_VALUE_FREE_PARAMS = frozenset({"sharding", "out_sharding", "precision", "weak_type", "input_dtype"})


def _keywords(f: Callable) -> frozenset:
    return frozenset(name for name, p in inspect.signature(f).parameters.items() if p.kind is p.KEYWORD_ONLY)


_TAKES: dict[Callable, frozenset] = {f: _keywords(f) for f, _ in _BY_NAME.values()}


def _numpy_can_evaluate(eqn: Any) -> bool:
    """Whether NumPy computes what XLA does for this equation (else it falls back)."""
    rule = TABLE.get(eqn.primitive)
    if rule is None or not all(_native(v.aval) for v in (*eqn.invars, *eqn.outvars)):
        return False
    if eqn.invars and eqn.invars[0].aval.dtype.kind not in rule[1]:
        return False
    takes = _TAKES[rule[0]]
    if any(v is not None for k, v in eqn.params.items() if k not in takes and k not in _VALUE_FREE_PARAMS):
        return False
    return eqn.primitive.name != "sort" or eqn.params["is_stable"]  # XLA orders ties its own way


# ---------------------------------------------------------------------------
# Planning: each equation becomes a step (a function of its operands' values) once,
# so that running the plan again costs only the steps themselves.


class _Plan:
    """A jaxpr turned into steps; call it with the input values."""

    def __init__(self, jaxpr: Any, consts: Sequence, planner: _Planner):
        self.invars = list(jaxpr.invars)
        env: dict = {v: _host(c) for v, c in zip(jaxpr.constvars, consts, strict=True)}
        self.steps: list[tuple[Callable, list, list, list]] = []
        last_use: dict = {}
        for i, eqn in enumerate(jaxpr.eqns):
            for v in eqn.invars:
                if not isinstance(v, jex_core.Literal):
                    last_use[v] = i
        outvars = set(v for v in jaxpr.outvars if not isinstance(v, jex_core.Literal))
        for i, eqn in enumerate(jaxpr.eqns):
            ins = []
            for v in eqn.invars:
                if isinstance(v, jex_core.Literal):
                    key = object()  # a literal's value, put in the environment once
                    env[key] = _literal_value(v)
                    ins.append(key)
                else:
                    ins.append(v)
            # Values no later equation reads are dropped, to bound memory as XLA does.
            dead = [v for v in dict.fromkeys(ins) if last_use.get(v) == i and v not in outvars]
            self.steps.append((planner.step(eqn), ins, list(eqn.outvars), dead))
        self.constants = env
        self.outvars = [
            ("literal", _literal_value(v)) if isinstance(v, jex_core.Literal) else ("var", v)
            for v in jaxpr.outvars
        ]

    def __call__(self, args: Sequence) -> list:
        env = dict(self.constants)
        env.update(zip(self.invars, args, strict=True))
        for step, ins, outs, dead in self.steps:
            results = step([env[v] for v in ins])
            for v, r in zip(outs, results, strict=True):
                env[v] = r
            for v in dead:
                del env[v]
        return [env[v] if kind == "var" else v for kind, v in self.outvars]


def _literal_value(literal: Any) -> Any:
    aval = literal.aval
    return np.asarray(literal.val, dtype=aval.dtype) if _native(aval) else literal.val


def _native(aval: Any) -> bool:
    return getattr(aval, "dtype", None) in _NATIVE and hasattr(aval, "shape")


def _host(x: Any) -> Any:
    """A value as the plan holds it: a NumPy array where its dtype is native, else as it is (a JAX array)."""
    dtype = getattr(x, "dtype", None)
    return np.asarray(x) if dtype is not None and np.dtype(dtype) in _NATIVE else x


class _Planner:
    """Turns equations into steps; plans each sub-jaxpr once, however many equations call it."""

    def __init__(self) -> None:
        self.plans: dict[int, tuple[Any, _Plan]] = {}
        self.fallbacks: set[str] = set()  # names of the primitives that fell back (for tests)

    def plan(self, jaxpr: Any, consts: Sequence = ()) -> _Plan:
        """A plan of a Jaxpr or a ClosedJaxpr."""
        key = id(jaxpr)  # a ClosedJaxpr's own id: two may share a Jaxpr with different constants
        if key not in self.plans:  # the jaxpr is kept alongside, so its id stays its own
            inner, consts = (jaxpr.jaxpr, jaxpr.consts) if hasattr(jaxpr, "consts") else (jaxpr, consts)
            self.plans[key] = (jaxpr, _Plan(inner, consts, self))
        return self.plans[key][1]

    def step(self, eqn: Any) -> Callable[[list], Sequence]:
        primitive, params = eqn.primitive, eqn.params
        if primitive is LINEAR_CALL_PRIMITIVE:  # its rule's jaxpr is traced for the operands' types
            params = {**params, "in_avals": [v.aval for v in eqn.invars]}
        rule = _SUBJAXPR_RULES.get(primitive)
        if rule is not None:
            try:
                return rule(self, params)
            except KeyError:  # params of a JAX this evaluator does not know: JAX evaluates it
                pass
        if _numpy_can_evaluate(eqn):
            return _numpy_step(TABLE[primitive][0], params, eqn)
        self.fallbacks.add(primitive.name)
        return _fallback_step(primitive, params)


def _numpy_step(f: Callable, params: dict, eqn: Any) -> Callable[[list], Sequence]:
    dtypes = [np.dtype(v.aval.dtype) for v in eqn.outvars]
    params = {k: v for k, v in params.items() if k in _TAKES[f]}
    if eqn.primitive.name == "dot_general":
        params = {**params, "result_dtype": dtypes[0]}
    if eqn.primitive.multiple_results:
        return lambda args: [np.asarray(r, dtype=d) for r, d in zip(f(*args, **params), dtypes, strict=True)]
    (dtype,) = dtypes
    return lambda args: (np.asarray(f(*args, **params), dtype=dtype),)


def _fallback_step(primitive: Any, params: dict) -> Callable[[list], Sequence]:
    """JAX's own eager dispatch of the primitive, on the same values."""

    def bind(args: list) -> Sequence:
        out = primitive.bind(*args, **params)
        return [_host(r) for r in out] if primitive.multiple_results else (_host(out),)

    return bind


# ---------------------------------------------------------------------------
# Primitives with sub-jaxprs, evaluated through them.


def _call_rule(key: str) -> Callable:
    """``jit``, ``closed_call``, ``call``, ``remat``: the sub-jaxpr on the operands."""

    def rule(planner: _Planner, params: dict) -> Callable:
        return planner.plan(params[key])

    return rule


def _custom_call_rule(planner: _Planner, params: dict) -> Callable:
    """custom_jvp_call and custom_vjp_call: the primal function (custom rules only matter to AD)."""
    # custom_vjp_call_jaxpr (JAX before 0.6) names it fun_jaxpr; a KeyError makes the equation fall back.
    return planner.plan(params["call_jaxpr"] if "call_jaxpr" in params else params["fun_jaxpr"])


def _cond_rule(planner: _Planner, params: dict) -> Callable:
    branches = [planner.plan(b) for b in params["branches"]]

    def cond(args: list) -> list:
        index = min(max(int(args[0]), 0), len(branches) - 1)  # lax clamps the index
        return branches[index](args[1:])

    return cond


def _while_rule(planner: _Planner, params: dict) -> Callable:
    cond, body = planner.plan(params["cond_jaxpr"]), planner.plan(params["body_jaxpr"])
    nc, nb = params["cond_nconsts"], params["body_nconsts"]

    def loop(args: list) -> list:
        cond_consts, body_consts, carry = args[:nc], args[nc : nc + nb], list(args[nc + nb :])
        while True:
            (going,) = cond([*cond_consts, *carry])
            if not np.any(going):
                return carry
            new = body([*body_consts, *carry])
            if np.ndim(going) == 0:
                carry = new
            else:
                # A batched predicate (vmap of a loop): the loop runs while any member goes on, and
                # the members that stopped keep their carry (as lax lowers it: leading dims).
                carry = [np.where(np.reshape(going, np.shape(going) + (1,) * (np.ndim(n) - np.ndim(going))), n, c)
                         for n, c in zip(new, carry, strict=True)]

    return loop


def _scan_rule(planner: _Planner, params: dict) -> Callable:
    jaxpr = params["jaxpr"]
    body = planner.plan(jaxpr)
    n_consts, n_carry, length, reverse = params["num_consts"], params["num_carry"], params["length"], params["reverse"]
    y_avals = [v.aval for v in jaxpr.jaxpr.outvars[n_carry:]]

    def scan(args: list) -> list:
        consts, carry, xs = args[:n_consts], list(args[n_consts : n_consts + n_carry]), args[n_consts + n_carry :]
        ys: list[list] = [[] for _ in y_avals]
        for i in reversed(range(length)) if reverse else range(length):
            out = body([*consts, *carry, *(x[i] for x in xs)])
            carry = out[:n_carry]
            for collected, y in zip(ys, out[n_carry:], strict=True):
                collected.append(y)
        stacked = [
            np.stack(y[::-1] if reverse else y) if y else np.zeros((0, *a.shape), a.dtype)
            for y, a in zip(ys, y_avals, strict=True)
        ]
        return [*carry, *stacked]

    return scan


def _tie_rule(planner: _Planner, params: dict) -> Callable:
    """vjpkit's tie (``_tie.py``): its outputs are some of its operands (its rules only matter to AD)."""
    outputs_at = params["tie"].outputs_at
    return lambda args: [args[at] for at in outputs_at]


def _linear_call_rule(planner: _Planner, params: dict) -> Callable:
    """vjpkit's linear_call (``_linear_call.py``): the rule it runs, as it lowers."""
    refuse_forward_mode(params["apply"])
    return planner.plan(params["traced"].jaxpr(params["in_avals"]))


def _subjaxpr_rules() -> dict[Any, Callable]:
    by_name = {
        "jit": _call_rule("jaxpr"),
        "pjit": _call_rule("jaxpr"),  # the jit primitive's name in older JAX
        "closed_call": _call_rule("call_jaxpr"),
        "call": _call_rule("call_jaxpr"),  # core.call_p
        "remat2": _call_rule("jaxpr"),
        "custom_jvp_call": _custom_call_rule,
        "custom_vjp_call": _custom_call_rule,
        "custom_vjp_call_jaxpr": _custom_call_rule,
        "cond": _cond_rule,
        "while": _while_rule,
        "scan": _scan_rule,
    }
    rules = {_PRIMITIVES[name]: rule for name, rule in by_name.items() if name in _PRIMITIVES}
    rules[TIE_PRIMITIVE] = _tie_rule
    rules[LINEAR_CALL_PRIMITIVE] = _linear_call_rule
    return rules


_SUBJAXPR_RULES = _subjaxpr_rules()


def numpy_evaluator(closed_jaxpr: Any) -> Callable[[Sequence], list]:
    """A function of the jaxpr's input values returning its output values, evaluated with NumPy.

    Planning (choosing each equation's rule) happens here, once. The
    returned function takes and returns flat lists; inputs may be NumPy or
    JAX arrays; floating-point warnings (a division by zero in fn) are
    silenced, as the compiled program raises none.
    """
    planner = _Planner()
    plan = planner.plan(closed_jaxpr)
    avals = [v.aval for v in closed_jaxpr.jaxpr.invars]

    def run(args: Sequence) -> list:
        values = [np.asarray(x, dtype=a.dtype) if _native(a) else x for x, a in zip(args, avals, strict=True)]
        with np.errstate(all="ignore"):
            return plan(values)

    run.fallbacks = planner.fallbacks  # type: ignore[attr-defined]
    return run

