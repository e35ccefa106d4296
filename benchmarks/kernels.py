"""Kernel-backed Functions on CPU against the same maths in plain jnp: compile time and run time.

    python benchmarks/kernels.py [--quick]

Two pairs, each a jitted gradient of ``sum(sin(f(x)))``:

- log-softmax over rows: ``examples/ffi_kernel.py`` (C++ kernels through
  XLA's FFI) against ``jax.nn.log_softmax``;
- layer norm: ``examples/pallas_layernorm.py`` (Pallas kernels, which on
  CPU run in interpret mode, a loop over the grid of ordinary XLA ops)
  against the same maths in jnp.

"compile" is the first call of a fresh ``jax.jit`` (tracing, lowering and
XLA compilation; the C++ library is already built and cached). "run" is
the median over repeats of back-to-back calls, candidates interleaved in a
rotating order; the ratio is the median of per-repeat ratios.
"""

import argparse
import pathlib
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "examples"))

import ffi_kernel  # noqa: E402
import pallas_layernorm  # noqa: E402


def first_call_seconds(fn, *args):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    return time.perf_counter() - start


def per_call_seconds(fn, args, calls):
    start = time.perf_counter()
    for _ in range(calls):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / calls


def compare(title, candidates, args, repeats, calls):
    """candidates: {name: function}; the first is the baseline of the ratios."""
    jitted = {name: jax.jit(fn) for name, fn in candidates.items()}
    compile_s = {name: first_call_seconds(fn, *args) for name, fn in jitted.items()}
    times = {name: [] for name in jitted}
    names = list(jitted)
    for r in range(repeats):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            times[name].append(per_call_seconds(jitted[name], args, calls))
    baseline = names[0]
    print(f"\n{title}")
    print(f"{'':28} {'compile ms':>11} {'run µs (median)':>16} {'run ratio':>10}")
    for name in names:
        ratio = statistics.median(t / b for t, b in zip(times[name], times[baseline], strict=True))
        print(f"{name:28} {compile_s[name] * 1e3:11.0f} {statistics.median(times[name]) * 1e6:16.1f} {ratio:10.2f}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run: few repeats")
    options = parser.parse_args()
    repeats, calls = (3, 3) if options.quick else (21, 20)
    rng = np.random.default_rng(0)
    print(f"JAX {jax.__version__}, backend {jax.default_backend()}")

    x = jnp.asarray(rng.normal(size=(256, 1024)), jnp.float32)
    compare(
        "log-softmax (256, 1024) float32, grad of sum(sin(.))",
        {
            "jax.nn.log_softmax": jax.grad(lambda x: ffi_kernel.loss(jax.nn.log_softmax, x)),
            "C++ FFI kernels (Function)": jax.grad(lambda x: ffi_kernel.loss(ffi_kernel.log_softmax, x)),
        },
        (x,),
        repeats,
        calls,
    )

    x = jnp.asarray(rng.normal(size=(256, 512)), jnp.float32)
    w, b = jnp.ones(512, jnp.float32), jnp.zeros(512, jnp.float32)
    ln = pallas_layernorm
    compare(
        "layer norm (256, 512) float32, grad of sum(sin(.)) w.r.t. x, w, b",
        {
            "plain jnp": jax.grad(lambda *a: ln.loss(ln.layer_norm_reference, *a), (0, 1, 2)),
            "Pallas kernels (Function)": jax.grad(lambda *a: ln.loss(ln.layer_norm, *a), (0, 1, 2)),
        },
        (x, w, b),
        repeats,
        calls,
    )


if __name__ == "__main__":
    main()
