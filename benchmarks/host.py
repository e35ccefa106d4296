"""Cost of a host (NumPy) Function: jitted gradients against the same math in jax.numpy.

    python benchmarks/host.py [--quick]

A host Function runs its NumPy forward and backward through jax.pure_callback,
so every call leaves XLA for Python and back. This measures what that costs:

1. `cube(x) = x**3` on 3 float32 elements: no work at all, so the time is
   the callback machinery. Candidates: the jnp math under jax.grad; a
   hand-written jax.custom_vjp whose fwd/bwd call jax.pure_callback (what
   a user would write without vjpkit); the vjpkit host Function.
2. `x = solve(A, b)` for a 256 x 256 float32 A: real work, NumPy's LAPACK
   against XLA's.

Every candidate is `jax.jit(jax.grad(loss))`. All run in one process,
interleaved repeat by repeat; each repeat times `number` back-to-back calls
and blocks once at the end; the figure is the median over repeats, in µs
per call. "callback cost" is host minus jnp.

NumPy's BLAS gets one thread (OPENBLAS_NUM_THREADS=1 unless set): on a
small machine its default thread count oversubscribes the cores XLA's own
pool already uses, and a 256 x 256 solve inside a callback then takes
~100x longer. Set the variable yourself to measure another setting.
"""

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # before NumPy loads its BLAS

import argparse
import platform
import sys

import jax
import jax.numpy as jnp
import numpy as np
from _timing import Candidate, median, print_table, time_interleaved

import vjpkit

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
from numpy_solve import Solve  # noqa: E402  (the example's host Function)


@vjpkit.function(host=True)
class Cube:
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x**3

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return 3 * x**2 * g


# The same, by hand: custom_vjp around pure_callback.
@jax.custom_vjp
def cube_by_hand(x):
    return jax.pure_callback(lambda x: np.asarray(x) ** 3, jax.ShapeDtypeStruct(x.shape, x.dtype), x,
                             vmap_method="sequential")


def cube_by_hand_fwd(x):
    return cube_by_hand(x), x


def cube_by_hand_bwd(x, g):
    shape = jax.ShapeDtypeStruct(x.shape, x.dtype)
    return (jax.pure_callback(lambda x, g: 3 * np.asarray(x) ** 2 * np.asarray(g), shape, x, g,
                              vmap_method="sequential"),)


cube_by_hand.defvjp(cube_by_hand_fwd, cube_by_hand_bwd)


def table(title, samples, baseline):
    """Median µs per call, and each candidate's median over the baseline's."""
    medians = {name: median(s) * 1e6 for name, s in samples.items()}
    print_table(title, ["candidate", "median µs/call", "vs jnp"],
                [(name, f"{us:.1f}", f"{us / medians[baseline]:.2f}") for name, us in medians.items()])
    return medians


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats, for a smoke run")
    args = parser.parse_args()
    quick = args.quick
    print(f"jax {jax.__version__} on {jax.devices()[0].platform}, numpy {np.__version__}, "
          f"python {platform.python_version()}, {os.cpu_count()} CPUs, "
          f"OPENBLAS_NUM_THREADS={os.environ['OPENBLAS_NUM_THREADS']}")

    # --- 1. no work: the callback machinery -----------------------------------
    x = jnp.array([0.5, 1.0, 2.0], dtype=jnp.float32)

    def loss(cube):
        return lambda x: (cube(x) * x).sum()

    grads = {
        "jnp: jit(grad) of x**3": jax.jit(jax.grad(loss(lambda x: x**3))),
        "hand-written custom_vjp + pure_callback": jax.jit(jax.grad(loss(cube_by_hand))),
        "vjpkit host Function": jax.jit(jax.grad(loss(Cube.apply))),
    }
    for g in grads.values():
        np.testing.assert_allclose(g(x), grads["jnp: jit(grad) of x**3"](x), rtol=1e-6)
    number, repeat = (100, 7) if quick else (1000, 31)
    samples = time_interleaved([Candidate(n, lambda g=g: g(x)) for n, g in grads.items()],
                               number=number, repeat=repeat, warmup=max(5, number // 10))
    cube = table("1. jit(grad(sum(cube(x) * x))), 3-element float32", samples, "jnp: jit(grad) of x**3")

    # --- 2. real work: a 256 x 256 solve -------------------------------------
    rng = np.random.default_rng(0)
    n = 256
    A = jnp.asarray(rng.normal(size=(n, n)) + n**0.5 * np.eye(n), dtype=jnp.float32)
    b = jnp.asarray(rng.normal(size=n), dtype=jnp.float32)

    def loss2(solve):
        return lambda A, b: jnp.sum(solve(A, b) ** 2)

    grads2 = {
        "jnp: jit(grad) of jnp.linalg.solve": jax.jit(jax.grad(loss2(jnp.linalg.solve), argnums=(0, 1))),
        "vjpkit host Solve": jax.jit(jax.grad(loss2(Solve.apply), argnums=(0, 1))),
    }
    ref = grads2["jnp: jit(grad) of jnp.linalg.solve"](A, b)
    for g in grads2.values():
        for got, want in zip(g(A, b), ref, strict=True):
            np.testing.assert_allclose(got, want, rtol=2e-3, atol=1e-5)
    number, repeat = (10, 5) if quick else (50, 21)
    samples = time_interleaved([Candidate(name, lambda g=g: g(A, b)) for name, g in grads2.items()],
                               number=number, repeat=repeat, warmup=max(5, number // 10))
    solve = table(f"2. jit(grad(sum(solve(A, b)**2))), {n} x {n} float32", samples,
                  "jnp: jit(grad) of jnp.linalg.solve")

    base, by_hand, host = (cube[k] for k in grads)
    print(f"\ncallback cost per jitted grad call (host - jnp, no work): {host - base:.1f} µs "
          f"(hand-written pure_callback: {by_hand - base:.1f} µs); vjpkit / hand-written: {host / by_hand:.2f}")
    print(f"solve {n}: host / jnp = {solve['vjpkit host Solve'] / solve['jnp: jit(grad) of jnp.linalg.solve']:.2f}")


if __name__ == "__main__":
    main()
