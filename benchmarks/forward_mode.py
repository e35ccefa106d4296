"""Forward mode of a both-rules vjpkit Function against plain jnp autodiff.

    python benchmarks/forward_mode.py [--quick]

A two-layer tanh network written once with a vjpkit Function that defines
both ``jvp`` and ``backward`` (``TanhLinear``) and once in plain ``jnp``.
Timed, jitted: ``jax.jacfwd`` of the network (forward mode: the Function's
``jvp``) and ``jax.hessian`` of a scalar loss (forward over reverse: the
``jvp`` of the ``backward`` rule). Both candidates run in one process,
interleaved repeat by repeat; the figure is the median in µs per call.
Target: vjpkit / jnp <= 1.1.
"""

import argparse

import jax
import jax.numpy as jnp
from _timing import Candidate, median, print_table, time_interleaved

import vjpkit


class TanhLinear(vjpkit.Function):
    """y = tanh(x @ w.T): forward mode via jvp, reverse mode via backward."""

    @staticmethod
    def forward(ctx, x, w):
        y = jnp.tanh(x @ w.T)
        ctx.save_for_backward(x, w, y)
        ctx.save_for_forward(x, w, y)
        return y

    @staticmethod
    def jvp(ctx, tx, tw):
        x, w, y = ctx.saved_tensors
        return (1 - y**2) * (tx @ w.T + x @ tw.T)

    @staticmethod
    def backward(ctx, g):
        x, w, y = ctx.saved_tensors
        gz = g * (1 - y**2)
        return gz @ w, gz.T @ x


def tanh_linear(x, w):
    return jnp.tanh(x @ w.T)


def network(layer):
    def f(x, w1, w2):
        return layer(layer(x, w1), w2)

    return f


def loss(layer):
    f = network(layer)
    return lambda x, w1, w2: jnp.sum(f(x, w1, w2) ** 2)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats")
    options = parser.parse_args()
    number, repeats = (20, 5) if options.quick else (100, 21)

    key = jax.random.PRNGKey(0)
    k1, k2, k3 = jax.random.split(key, 3)
    x = jax.random.normal(k1, (16, 32))
    w1 = jax.random.normal(k2, (32, 32)) / 6
    w2 = jax.random.normal(k3, (8, 32)) / 6
    args = (x, w1, w2)

    jobs = {
        "jacfwd (w.r.t. x)": lambda layer: jax.jit(jax.jacfwd(network(layer))),
        "hessian (w.r.t. x)": lambda layer: jax.jit(jax.hessian(loss(layer))),
    }
    print(f"jax {jax.__version__}, {jax.devices()[0].platform}; x {x.shape}, w1 {w1.shape}, w2 {w2.shape}")
    rows = []
    for name, make in jobs.items():
        candidates = {"vjpkit": make(TanhLinear.apply), "jnp": make(tanh_linear)}
        reference = candidates["jnp"](*args)
        assert jnp.allclose(candidates["vjpkit"](*args), reference, rtol=1e-4, atol=1e-5), name
        samples = time_interleaved([Candidate(n, lambda fn=fn: fn(*args)) for n, fn in candidates.items()],
                                   number=number, repeat=repeats)
        ours, theirs = median(samples["vjpkit"]) * 1e6, median(samples["jnp"]) * 1e6
        rows.append((name, f"{ours:.1f}", f"{theirs:.1f}", f"{ours / theirs:.3f}"))
    print_table(None, ["transformation", "vjpkit µs", "jnp µs", "ratio"], rows)


if __name__ == "__main__":
    main()
