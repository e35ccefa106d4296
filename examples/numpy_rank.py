# requires: numpy
"""A rank-based statistic in NumPy with a custom gradient: the trimmed mean.

    python examples/numpy_rank.py

trimmed_mean(x, trim) drops the `trim` smallest and `trim` largest values of
each row of x and averages the rest. Its gradient sends g / (n - 2 trim) to
the kept entries and 0 to the trimmed ones. forward finds the kept entries
with np.argsort and saves those indices (an integer NumPy intermediate) for
backward; vjpkit gets it there by re-running forward on the host, so its
shape never has to be declared.

The NumPy code works on the last axis, so any leading batch axes are fine:
the class declares vmap_method="expand_dims", and jax.vmap calls it once
with the whole batch instead of once per row.
"""

import jax
import jax.numpy as jnp
import numpy as np

import vjpkit


@vjpkit.function(host=True, vmap_method="expand_dims")
class TrimmedMean:
    @staticmethod
    def output_shapes(x, trim):
        return jax.ShapeDtypeStruct(x.shape[:-1], x.dtype)  # one value per row

    @staticmethod
    def forward(ctx, x, trim):
        n = x.shape[-1]
        kept = np.argsort(x, axis=-1)[..., trim : n - trim]
        ctx.save_for_backward(kept)
        ctx.shape = x.shape  # a static attribute
        return np.take_along_axis(x, kept, axis=-1).mean(axis=-1)

    @staticmethod
    def backward(ctx, g):
        (kept,) = ctx.saved_tensors
        gx = np.zeros(ctx.shape, g.dtype)
        share = g[..., None] / kept.shape[-1]
        np.put_along_axis(gx, kept, np.broadcast_to(share, kept.shape), axis=-1)
        return gx, None  # trim is a static int: no gradient


def trimmed_mean_jnp(x, trim):
    n = x.shape[-1]
    return jnp.sort(x, axis=-1)[..., trim : n - trim].mean(axis=-1)


def main():
    x = jnp.array([3.0, -10.0, 1.0, 2.0, 50.0, 0.5], dtype=jnp.float32)
    print("x                 ", x)
    print("trimmed_mean(x, 1)", TrimmedMean(x, 1))
    np.testing.assert_allclose(TrimmedMean(x, 1), trimmed_mean_jnp(x, 1), rtol=1e-6)

    grad = jax.jit(jax.grad(lambda x: TrimmedMean(x, 1)))
    print("gradient          ", grad(x))
    np.testing.assert_allclose(grad(x), jax.grad(lambda x: trimmed_mean_jnp(x, 1))(x), rtol=1e-6)

    # A batch of rows, and per-row gradients, through the vectorized path.
    rows = jnp.asarray(np.random.default_rng(0).normal(size=(5, 8)), dtype=jnp.float32)
    per_row = jax.vmap(jax.grad(lambda r: TrimmedMean(r, 2)))(rows)
    reference = jax.vmap(jax.grad(lambda r: trimmed_mean_jnp(r, 2)))(rows)
    print("per-row gradients ", per_row.shape, "nonzeros per row:", (per_row != 0).sum(axis=1))
    np.testing.assert_allclose(per_row, reference, rtol=1e-6)

    # A loss over the batch, differentiated as a whole.
    def loss(rows):
        return jnp.sum(jax.vmap(lambda r: TrimmedMean(r, 2))(rows) ** 2)

    np.testing.assert_allclose(
        jax.grad(loss)(rows),
        jax.grad(lambda rows: jnp.sum(trimmed_mean_jnp(rows, 2) ** 2))(rows),
        rtol=1e-5,
    )
    print("numpy_rank: ok")


if __name__ == "__main__":
    main()
