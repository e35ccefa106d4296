"""Static arguments are keyed by value: one program per distinct value, reused for an equal one.

Unhashable objects (a plain ``@dataclass`` config, a list, an
``argparse.Namespace``) are keyed by a fingerprint of their contents, so a
mutated config gets a new program and an equal new object reuses one;
floats are keyed by their bits (``-0.0`` is not ``0.0``; ``nan`` is itself).
"""

import argparse
import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import vjpkit

X = jnp.array([0.1, 0.45, -1.3])


@dataclasses.dataclass
class QuantConfig:
    num_bits: int
    offsets: list = dataclasses.field(default_factory=list)


def _quantize():
    class Quantize(vjpkit.Function):
        @staticmethod
        def forward(ctx, x, cfg):
            scale = 2.0**cfg.num_bits
            return jnp.round(x * scale) / scale + sum(cfg.offsets)

        @staticmethod
        def backward(ctx, g):
            return g, None  # straight-through

    return Quantize


def _expected(x, num_bits, offsets=()):
    scale = 2.0**num_bits
    return np.round(np.asarray(x) * scale) / scale + sum(offsets)


def test_mutated_config_gets_a_new_program():
    Quantize = _quantize()
    cfg = QuantConfig(num_bits=8)
    np.testing.assert_allclose(Quantize.apply(X, cfg), _expected(X, 8), rtol=1e-6)
    cfg.num_bits = 1  # a schedule lowers the bit-width during training
    np.testing.assert_allclose(Quantize.apply(X, cfg), _expected(X, 1), rtol=1e-6)
    cfg.offsets.append(0.25)  # a change deep inside counts too
    np.testing.assert_allclose(Quantize.apply(X, cfg), _expected(X, 1, [0.25]), rtol=1e-6)
    assert Quantize.cache_info().misses == 3


def test_equal_new_config_reuses_the_program():
    Quantize = _quantize()
    for _ in range(3):
        Quantize.apply(X, QuantConfig(num_bits=4, offsets=[0.5]))
    info = Quantize.cache_info()
    assert (info.programs, info.hits, info.misses) == (1, 2, 1)


def test_mutating_the_first_config_does_not_change_the_program_keyed_by_its_old_contents():
    Quantize = _quantize()
    first = QuantConfig(num_bits=8)
    Quantize.apply(X, first)
    first.num_bits = 1
    # Under an outer jit the program's forward runs again: it must see 8 bits, not the mutated object.
    got = jax.jit(lambda x: Quantize.apply(x, QuantConfig(num_bits=8)))(X)
    np.testing.assert_allclose(got, _expected(X, 8), rtol=1e-6)


def test_namespace_and_list_arguments_are_keyed_by_value():
    Quantize = _quantize()
    args = argparse.Namespace(num_bits=2, offsets=[0.0])
    Quantize.apply(X, args)
    Quantize.apply(X, argparse.Namespace(num_bits=2, offsets=[0.0]))
    args.num_bits = 3
    np.testing.assert_allclose(Quantize.apply(X, args), _expected(X, 3), rtol=1e-6)
    assert Quantize.cache_info().misses == 2


def test_config_holding_an_array_raises_naming_the_parameter_and_the_fix():
    Quantize = _quantize()
    cfg = QuantConfig(num_bits=2, offsets=[jnp.ones(3)])
    message = (
        "Quantize.apply: static argument 'cfg' (QuantConfig) is keyed by its contents, so that a changed object "
        "gets a new program; but cfg.offsets[0] is an array (shape (3,), dtype float32), which cannot be part "
        "of a compile-cache key. Pass the array as an argument of its own (arrays are traced), or hold Python "
        "values (floats, tuples) in the QuantConfig instead."
    )
    with pytest.raises(TypeError, match=re.escape(message)):
        Quantize.apply(X, cfg)


def test_opaque_unhashable_argument_raises_naming_the_class_and_the_fix():
    class Handle:
        __slots__ = ("n",)
        __hash__ = None  # type: ignore[assignment]

    class Takes(vjpkit.Function):
        @staticmethod
        def forward(ctx, x, options):
            return x

    message = (
        "Takes.apply: static argument 'options' (Handle) is keyed by its contents, so that a changed object "
        "gets a new program; but options['handle'] is an unhashable Handle with no fields to compare. Make "
        "Handle hashable (define __eq__ and __hash__, or use @dataclass(frozen=True)) to key it by its own equality."
    )
    with pytest.raises(TypeError, match=re.escape(message)):
        Takes.apply(X, {"handle": Handle()})


def _reciprocal():
    class Reciprocal(vjpkit.Function):
        @staticmethod
        def forward(ctx, x, c):
            return x / c

        @staticmethod
        def backward(ctx, g):
            return g, None

    return Reciprocal


def test_negative_zero_does_not_reuse_the_program_of_zero():
    Reciprocal = _reciprocal()
    ones = jnp.ones(2)
    assert (Reciprocal.apply(ones, 0.0) == jnp.inf).all()
    assert (Reciprocal.apply(ones, -0.0) == -jnp.inf).all()
    assert Reciprocal.cache_info().misses == 2


def test_nan_static_argument_hits_the_cache():
    Reciprocal = _reciprocal()
    ones = jnp.ones(2)
    for _ in range(3):
        assert jnp.isnan(Reciprocal.apply(ones, float("nan"))).all()  # a new nan object each call
    info = Reciprocal.cache_info()
    assert (info.programs, info.hits, info.misses) == (1, 2, 1)


def _shift():
    class Shift(vjpkit.Function):
        @staticmethod
        def forward(ctx, x, mode, n, c=1.0):
            return (x + n if mode == "add" else x - n) / c

        @staticmethod
        def backward(ctx, g):
            return g, None, None, None

    return Shift


def test_several_static_string_and_int_arguments_are_keyed_by_their_values():
    Shift = _shift()
    ones = jnp.ones(2)
    outputs = [Shift.apply(ones, mode, n) for mode, n in (("add", 2), ("add", 2), ("sub", 2), ("add", 3), ("add", 2))]
    np.testing.assert_array_equal(np.stack(outputs), [[3.0, 3.0], [3.0, 3.0], [-1.0, -1.0], [4.0, 4.0], [3.0, 3.0]])
    info = Shift.cache_info()
    assert (info.programs, info.hits, info.misses) == (3, 2, 3)


def test_negative_zero_among_several_static_arguments_does_not_reuse_the_program_of_zero():
    Shift = _shift()
    ones = jnp.ones(2)
    assert (Shift.apply(ones, "add", 1, 0.0) == jnp.inf).all()
    assert (Shift.apply(ones, "add", 1, -0.0) == -jnp.inf).all()
    assert (Shift.apply(ones, "add", 1, 0.0) == jnp.inf).all()
    info = Shift.cache_info()
    assert (info.programs, info.hits, info.misses) == (2, 1, 2)


def test_complex_static_arguments_differing_in_the_sign_of_a_zero_part_are_distinct_and_each_hits():
    Reciprocal = _reciprocal()
    ones = jnp.ones(2, jnp.complex64)
    for _ in range(2):
        np.testing.assert_allclose(Reciprocal.apply(ones, complex(0.0, 2.0)), [-0.5j, -0.5j])
        np.testing.assert_allclose(Reciprocal.apply(ones, complex(-0.0, 2.0)), [-0.5j, -0.5j])
    np.testing.assert_allclose(Reciprocal.apply(ones, complex(1.0, 1.0)), [0.5 - 0.5j, 0.5 - 0.5j])
    info = Reciprocal.cache_info()
    assert (info.programs, info.hits, info.misses) == (3, 2, 3)


def _take():
    """Take: x[index] for a static index (a slice, an int, or a tuple or list of them), zero-filled gradient."""

    class Take(vjpkit.Function):
        @staticmethod
        def forward(ctx, x, index):
            index = tuple(index) if isinstance(index, list) else index
            ctx.index, ctx.shape = index, x.shape  # the slice travels to backward as static data
            return x[index]

        @staticmethod
        def backward(ctx, g):
            return jnp.zeros(ctx.shape, g.dtype).at[ctx.index].set(g), None

    return Take


M = jnp.arange(12.0).reshape(3, 4)


@pytest.mark.parametrize("index", [
    pytest.param(slice(1, 3), id="slice"),
    pytest.param(slice(None, None, -2), id="slice_with_step"),
    pytest.param((slice(0, 2), slice(1, None)), id="tuple_of_slices"),
    pytest.param((1, slice(None, 3)), id="int_and_slice"),
    pytest.param([slice(0, 2)], id="list_holding_a_slice"),
])
def test_slice_static_argument_is_keyed_by_value_eagerly_and_under_jit_and_grad(index):
    # slice is unhashable before Python 3.12: it was refused with advice ("make slice hashable") a user cannot follow.
    Take = _take()
    where = tuple(index) if isinstance(index, list) else index
    for _ in range(2):
        np.testing.assert_array_equal(Take.apply(M, index), M[where])
    np.testing.assert_array_equal(jax.jit(lambda m: Take.apply(m, index))(M), M[where])
    got = jax.grad(lambda m: (Take.apply(m, index) ** 2).sum())(M)
    np.testing.assert_array_equal(got, jax.grad(lambda m: (m[where] ** 2).sum())(M))
    info = Take.cache_info()
    assert (info.programs, info.misses) == (1, 1)  # an equal new slice (or container) reuses the program


def test_slices_of_other_bounds_or_types_of_bound_get_their_own_programs():
    Take = _take()
    x = jnp.arange(5.0)
    # slice(True, 3) == slice(1, 3) in Python 3.12 and later, yet x[True:3] is x[1:3] only by coincidence of value.
    for index, expected in ((slice(1, 3), [1.0, 2.0]), (slice(1, 4), [1.0, 2.0, 3.0]), (slice(True, 3), [1.0, 2.0]),
                            (slice(1, 3), [1.0, 2.0])):
        np.testing.assert_array_equal(Take.apply(x, index), expected)
    info = Take.cache_info()
    assert (info.programs, info.hits, info.misses) == (3, 1, 3)


def test_slice_with_an_array_bound_raises_naming_where():
    Take = _take()
    message = (
        "Take.apply: static argument 'index' (slice) is keyed by its contents, so that a changed object gets a "
        "new program; but index.stop is an array (shape (), dtype int32), which cannot be part of a compile-cache "
        "key. Pass the array as an argument of its own (arrays are traced), or hold Python values (floats, tuples) "
        "in the slice instead."
    )
    with pytest.raises(TypeError, match=re.escape(message)):
        Take.apply(jnp.arange(5.0), slice(0, jnp.asarray(3, jnp.int32)))
