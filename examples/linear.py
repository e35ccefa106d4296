"""A linear layer with an optional bias: PyTorch's tutorial `LinearFunction`.

    python examples/linear.py

`ctx.needs_input_grad` is real: it is True only for inputs JAX is
differentiating with respect to, so backward skips the matmuls nobody asked
for (the gradient for a parameter JAX is not differentiating is never
computed, not merely thrown away).
"""

import jax
import jax.numpy as jnp
import numpy as np

import vjpkit

# backward runs while JAX traces, once per compiled signature (not once per
# call); we log the flags it saw so the script can show them.
flags_seen_in_backward = []


class LinearFunction(vjpkit.Function):
    @staticmethod
    def forward(ctx, x, weight, bias=None):
        ctx.save_for_backward(x, weight, bias)
        y = x @ weight.T
        return y if bias is None else y + bias

    @staticmethod
    def backward(ctx, g):
        x, weight, bias = ctx.saved_tensors
        flags_seen_in_backward.append(tuple(ctx.needs_input_grad))
        gx = gw = gb = None
        if ctx.needs_input_grad[0]:
            gx = g @ weight
        if ctx.needs_input_grad[1]:
            gw = g.T @ x
        if bias is not None and ctx.needs_input_grad[2]:
            gb = g.sum(0)
        return gx, gw, gb


linear = LinearFunction.apply


def linear_reference(x, weight, bias=None):
    y = x @ weight.T
    return y if bias is None else y + bias


def main():
    np.set_printoptions(precision=4, suppress=True)
    kx, kw, kb = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(kx, (4, 3))
    w = jax.random.normal(kw, (2, 3))
    b = jax.random.normal(kb, (2,))

    def loss(fn, *args):
        return jnp.tanh(fn(*args)).sum()

    print("linear(x, w, b) =\n", np.asarray(linear(x, w, b)))
    np.testing.assert_allclose(linear(x, w, b), linear_reference(x, w, b), rtol=1e-6)

    # All three gradients.
    got = jax.grad(lambda *a: loss(linear, *a), argnums=(0, 1, 2))(x, w, b)
    expected = jax.grad(lambda *a: loss(linear_reference, *a), argnums=(0, 1, 2))(x, w, b)
    for name, g, e in zip(("x", "weight", "bias"), got, expected, strict=True):
        print(f"d loss / d {name}:\n", np.asarray(g))
        np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-6)

    # Only the weight: backward sees needs_input_grad == (False, True, False).
    flags_seen_in_backward.clear()
    gw = jax.jit(jax.grad(lambda w: loss(linear, x, w, b)))(w)
    print("needs_input_grad when differentiating w only:", flags_seen_in_backward[-1])
    assert flags_seen_in_backward[-1] == (False, True, False), flags_seen_in_backward
    np.testing.assert_allclose(gw, expected[1], rtol=1e-5, atol=1e-6)

    # No bias: the default None is a static input, so its gradient slot is None.
    gx, gw = jax.grad(lambda x, w: loss(linear, x, w), argnums=(0, 1))(x, w)
    ex, ew = jax.grad(lambda x, w: loss(linear_reference, x, w), argnums=(0, 1))(x, w)
    np.testing.assert_allclose(gx, ex, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(gw, ew, rtol=1e-5, atol=1e-6)
    print("without bias: gradients match")

    # Per-example weight gradients: vmap over single rows of x.
    per_example = jax.vmap(jax.grad(lambda w, xi: loss(linear, xi[None], w, b)), in_axes=(None, 0))(w, x)
    expected = jax.vmap(jax.grad(lambda w, xi: loss(linear_reference, xi[None], w, b)), in_axes=(None, 0))(w, x)
    print("per-example weight gradients:", per_example.shape)
    np.testing.assert_allclose(per_example, expected, rtol=1e-5, atol=1e-6)
    print("linear: ok")


if __name__ == "__main__":
    main()
