"""Layer norm whose forward and backward are Pallas kernels, inside a vjpkit Function.

    python examples/pallas_layernorm.py

The PyTorch pattern this replaces: a `torch.autograd.Function` whose
forward and backward launch hand-written CUDA or Triton kernels (apex's
and Triton's tutorial fused layer norm). Here both kernels are
`pallas_call`s. On CPU they run in Pallas's interpret mode (the kernel body
is evaluated as ordinary JAX code, one grid step at a time), so this file
runs and is tested anywhere; on a GPU the same code compiles the kernels
(Pallas lowers through Triton there, which wants power-of-two block sizes:
keep the feature size a power of two).

Forward saves the input and the per-row mean and reciprocal standard
deviation, as the CUDA kernels do. Backward computes the input gradient in
one kernel, which also writes one partial sum of the weight and bias
gradients per block of rows; a `jnp.sum` adds the partial sums up (a grid
step cannot add into another step's output without atomics).

Gradients, `jit`, `vmap` and per-example gradients work. Second
derivatives do not: they would differentiate the kernels themselves
(backward's, and forward's, which computed the saved mean and rstd), and a
`pallas_call` has no transpose rule. Backward is marked
`@vjpkit.once_differentiable` to say so.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

import vjpkit

EPS = 1e-5
MAX_BLOCK_ROWS = 16


def interpret_on_cpu():
    # Pallas compiles kernels for GPUs and TPUs only; on CPU it interprets them. Where JAX computes: the
    # default backend, unless jax.default_device pins another device (the CPU, say, on a GPU machine).
    pinned = jax.config.jax_default_device  # a Device, a platform name, or None
    return (getattr(pinned, "platform", pinned) or jax.default_backend()) == "cpu"


def block_rows_for(rows):
    # The largest power of two (at most MAX_BLOCK_ROWS) that divides the row
    # count, so the grid covers every row without padding.
    return math.gcd(rows, MAX_BLOCK_ROWS)


def layer_norm_forward_kernel(x_ref, w_ref, b_ref, y_ref, mean_ref, rstd_ref):
    x = x_ref[...]
    mean = jnp.mean(x, axis=1, keepdims=True)
    centred = x - mean
    rstd = jax.lax.rsqrt(jnp.mean(centred * centred, axis=1, keepdims=True) + EPS)
    y_ref[...] = centred * rstd * w_ref[...] + b_ref[...]
    mean_ref[...] = mean
    rstd_ref[...] = rstd


def layer_norm_backward_kernel(x_ref, w_ref, mean_ref, rstd_ref, g_ref, dx_ref, dw_part_ref, db_part_ref):
    rstd = rstd_ref[...]
    x_hat = (x_ref[...] - mean_ref[...]) * rstd
    g = g_ref[...]
    g_w = g * w_ref[...]
    # d/dx of (x - mean) * rstd, applied to g * w, row by row.
    mean_g_w = jnp.mean(g_w, axis=1, keepdims=True)
    mean_g_w_x_hat = jnp.mean(g_w * x_hat, axis=1, keepdims=True)
    dx_ref[...] = (g_w - mean_g_w - x_hat * mean_g_w_x_hat) * rstd
    dw_part_ref[...] = jnp.sum(g * x_hat, axis=0, keepdims=True)
    db_part_ref[...] = jnp.sum(g, axis=0, keepdims=True)


def row_block(block_rows, features):
    return pl.BlockSpec((block_rows, features), lambda i: (i, 0))


def whole_row_vector(features):
    # The (1, features) weight or bias: every grid step reads the same block.
    return pl.BlockSpec((1, features), lambda i: (0, 0))


def layer_norm_forward(x, w, b):
    """x: (rows, features); w, b: (features,). Returns y, mean (rows, 1), rstd (rows, 1)."""
    rows, features = x.shape
    block_rows = block_rows_for(rows)
    per_row = pl.BlockSpec((block_rows, 1), lambda i: (i, 0))
    return pl.pallas_call(
        layer_norm_forward_kernel,
        out_shape=(
            jax.ShapeDtypeStruct(x.shape, x.dtype),
            jax.ShapeDtypeStruct((rows, 1), x.dtype),
            jax.ShapeDtypeStruct((rows, 1), x.dtype),
        ),
        grid=(rows // block_rows,),
        in_specs=[row_block(block_rows, features), whole_row_vector(features), whole_row_vector(features)],
        out_specs=(row_block(block_rows, features), per_row, per_row),
        interpret=interpret_on_cpu(),
    )(x, w.reshape(1, features), b.reshape(1, features))


def layer_norm_backward(x, w, mean, rstd, g):
    """Returns dx (rows, features) and dw, db (features,)."""
    rows, features = x.shape
    block_rows = block_rows_for(rows)
    blocks = rows // block_rows
    per_row = pl.BlockSpec((block_rows, 1), lambda i: (i, 0))
    per_block = pl.BlockSpec((1, features), lambda i: (i, 0))
    dx, dw_parts, db_parts = pl.pallas_call(
        layer_norm_backward_kernel,
        out_shape=(
            jax.ShapeDtypeStruct(x.shape, x.dtype),
            jax.ShapeDtypeStruct((blocks, features), x.dtype),
            jax.ShapeDtypeStruct((blocks, features), x.dtype),
        ),
        grid=(blocks,),
        in_specs=[
            row_block(block_rows, features),
            whole_row_vector(features),
            per_row,
            per_row,
            row_block(block_rows, features),
        ],
        out_specs=(row_block(block_rows, features), per_block, per_block),
        interpret=interpret_on_cpu(),
    )(x, w.reshape(1, features), mean, rstd, g)
    return dx, dw_parts.sum(axis=0), db_parts.sum(axis=0)


class LayerNorm(vjpkit.Function):
    """Layer norm over the last axis of ``x`` (any leading shape), with weight and bias."""

    @staticmethod
    def forward(ctx, x, w, b):
        rows = x.reshape(-1, x.shape[-1])
        y, mean, rstd = layer_norm_forward(rows, w, b)
        ctx.save_for_backward(rows, w, mean, rstd)
        return y.reshape(x.shape)

    @staticmethod
    @vjpkit.once_differentiable
    def backward(ctx, g):
        rows, w, mean, rstd = ctx.saved_tensors
        dx, dw, db = layer_norm_backward(rows, w, mean, rstd, g.reshape(rows.shape))
        return dx.reshape(g.shape), dw, db


layer_norm = LayerNorm.apply


def layer_norm_reference(x, w, b):
    """The same maths in plain jnp, differentiated by JAX."""
    mean = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean((x - mean) ** 2, axis=-1, keepdims=True)
    return (x - mean) / jnp.sqrt(var + EPS) * w + b


def loss(norm, x, w, b):
    # A nonlinear loss, so every element's gradient differs.
    return jnp.sum(jnp.sin(norm(x, w, b)))


def main():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(32, 64)), jnp.float32)
    w = jnp.asarray(rng.normal(size=64), jnp.float32)
    b = jnp.asarray(rng.normal(size=64), jnp.float32)
    print(f"backend {jax.default_backend()}, Pallas interpret mode: {interpret_on_cpu()}")

    np.testing.assert_allclose(layer_norm(x, w, b), layer_norm_reference(x, w, b), rtol=1e-5, atol=1e-5)
    print("forward matches plain jnp")

    grad = jax.jit(jax.grad(loss, argnums=(1, 2, 3)), static_argnums=0)
    for got, want, name in zip(
        grad(layer_norm, x, w, b), grad(layer_norm_reference, x, w, b), ("x", "w", "b"), strict=True
    ):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4, err_msg=f"gradient of {name}")
    print("jit(grad) matches jax.grad of plain jnp for x, w, b")

    # Per-example gradients: vmap over a batch of (8, 64) inputs.
    xs = x.reshape(4, 8, 64)
    per_example = jax.vmap(jax.grad(loss, argnums=(1, 2)), in_axes=(None, 0, None, None))
    for got, want in zip(
        per_example(layer_norm, xs, w, b), per_example(layer_norm_reference, xs, w, b), strict=True
    ):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    print("vmap(grad) per-example gradients match")

    # Finite differences, in float64 (gradcheck switches x64 on for its own calls).
    small = (rng.normal(size=(4, 8)), rng.normal(size=8), rng.normal(size=8))
    vjpkit.gradcheck(layer_norm, small)
    print("gradcheck: ok")
    print("pallas_layernorm: ok")


if __name__ == "__main__":
    main()
