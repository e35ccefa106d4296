"""A checking program run op by op runs the kernels JAX's eager mode runs, and gives their very bits.

`OpByOp` compiles the distinct kernels of a traced program up front, on
threads, and calls them directly; ``jaxpr_as_fun`` (JAX's own evaluation of
a jaxpr, eager mode's dispatch equation by equation) is the reference here.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.extend.core import jaxpr_as_fun

from vjpkit._checking import op_by_op
from vjpkit._jax_internals import enable_x64


def program(x, h):
    """Kernels of many kinds: jit calls (clip, where), add_any from a gradient, slices, literals of weak
    type, several results (sort), a custom_jvp (relu), a loop (while), half precision, a callback."""
    y = jnp.clip(x, -1.0, 1.0) * 0.5 + jnp.where(x > 0, x, 2.0 * x)
    g = jax.grad(lambda v: jnp.sum(jnp.sin(v) * v + jnp.tanh(v) * v))(x)
    keys, values = lax.sort((x[:3], y[:3]), num_keys=1)
    loop = lax.fori_loop(0, 3, lambda i, c: c * 0.5 + jnp.exp(-c), x)
    halves = (h * h).astype(jnp.float16).sum()
    calls = jax.pure_callback(lambda v: np.asarray(v) * 3.0, jax.ShapeDtypeStruct(x.shape, x.dtype), x)
    return y, g, keys, values, jax.nn.relu(x - 0.1), loop, halves, calls


def bits(a):
    a = np.asarray(a)
    return a.view(np.dtype(f"u{a.dtype.itemsize}")) if a.dtype.kind in "fc" else a


def arguments():
    x = np.array([-2.0, -0.3, 5e-324, 0.0, 0.7, 1.5, np.nan])  # a subnormal, which XLA's kernels flush
    return x, np.array([300.0, 1e-3, -7.0], np.float32)


def test_op_by_op_gives_the_bits_of_eager_modes_kernels():
    with enable_x64(True):
        x, h = arguments()
        closed = jax.make_jaxpr(program)(x, h)
        expected = jaxpr_as_fun(closed)(x, h)
        run = op_by_op.OpByOp(closed)
        for _ in range(2):  # the first run compiles the kernels, the second calls them
            got = run(x, h)
            assert len(got) == len(expected)
            for a, b in zip(got, expected, strict=True):
                assert a.dtype == b.dtype and a.shape == b.shape
                np.testing.assert_array_equal(bits(a), bits(b))


def test_each_distinct_kernel_compiles_once_and_later_runs_compile_nothing(monkeypatch):
    def loop(x):
        for _ in range(20):
            x = jnp.sin(x) * 0.5 + x
        return x

    with enable_x64(True):
        x = np.array([0.3, -0.8])
        closed = jax.make_jaxpr(loop)(x)
        compiled = []
        submit = op_by_op._submit_compiles

        def counting(jaxpr, pool):
            futures = submit(jaxpr, pool)
            compiled.extend({id(f): f for f in futures if f is not None}.values())
            return futures

        monkeypatch.setattr(op_by_op, "_submit_compiles", counting)
        run = op_by_op.OpByOp(closed)
        first = run(x)
        assert len(compiled) == 3  # sin, mul, add: each compiled once for 60 equations
        assert all(kernel is not None for kernel in run.kernels)

        def no_compiles(*args):
            raise AssertionError("a later run compiled a kernel")

        monkeypatch.setattr(op_by_op, "_submit_compiles", no_compiles)
        np.testing.assert_array_equal(run(x)[0], first[0])
        np.testing.assert_array_equal(first[0], jaxpr_as_fun(closed)(x)[0])


def test_an_equation_that_fails_raises_when_the_run_reaches_it():
    def fails_late(x):
        y = jnp.sin(x)
        return y, jax.pure_callback(lambda v: 1 / 0, jax.ShapeDtypeStruct(x.shape, x.dtype), y)

    with enable_x64(True):
        closed = jax.make_jaxpr(fails_late)(np.array([0.5]))
        with pytest.raises(Exception, match="division by zero"):
            jax.block_until_ready(op_by_op.OpByOp(closed)(np.array([0.5])))
