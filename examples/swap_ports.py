# requires: torch, optax
"""Port a model's custom PyTorch Functions one at a time, training all along.

    python examples/swap_ports.py

The model starts with its two PyTorch originals (a linear layer and a
swish activation, as ``torch.autograd.Function`` classes) run unchanged
through ``vjpkit.from_torch``. Then each original is swapped for its vjpkit
port, one at a time. While a port is new, every jitted training step also
runs the same loss with that layer's original in place and checks that
loss and gradients agree: the original stays the reference inside the
same program, on the values training actually produces.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import torch

import vjpkit

# ---------------------------------------------------------------------------
# The PyTorch originals, unchanged.


class TorchLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, b):
        ctx.save_for_backward(x, w)
        return x.mm(w.t()) + b

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        return g.mm(w), g.t().mm(x), g.sum(0)


class TorchSwish(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * torch.sigmoid(x)

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        s = torch.sigmoid(x)
        return g * (s * (1 + x * (1 - s)))


# ---------------------------------------------------------------------------
# Their ports.


class Linear(vjpkit.Function):
    @staticmethod
    def forward(ctx, x, w, b):
        ctx.save_for_backward(x, w)
        return x @ w.T + b

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        return g @ w, g.T @ x, g.sum(0)


class Swish(vjpkit.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * jax.nn.sigmoid(x)

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        s = jax.nn.sigmoid(x)
        return g * (s * (1 + x * (1 - s)))


ORIGINALS = {"linear": vjpkit.from_torch(TorchLinear), "swish": vjpkit.from_torch(TorchSwish)}
PORTS = {"linear": Linear, "swish": Swish}


def loss(layers, params, x, y):
    h = layers["swish"].apply(layers["linear"].apply(x, params["w1"], params["b1"]))
    return jnp.mean((layers["linear"].apply(h, params["w2"], params["b2"]) - y) ** 2)


optimizer = optax.adam(1e-2)


def make_step(layers, checking=None):
    """One jitted training step; with ``checking``, it also runs that layer's original and returns the gap."""

    @jax.jit
    def step(params, opt_state, x, y):
        value, grads = jax.value_and_grad(functools.partial(loss, layers))(params, x, y)
        gap = jnp.zeros(())
        if checking is not None:
            reference = dict(layers, **{checking: ORIGINALS[checking]})
            ref_value, ref_grads = jax.value_and_grad(functools.partial(loss, reference))(params, x, y)
            gaps = [jnp.abs(value - ref_value)] + [
                jnp.max(jnp.abs(g - r)) for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads), strict=True)
            ]
            gap = jnp.max(jnp.stack(gaps))
        updates, opt_state = optimizer.update(grads, opt_state)
        return optax.apply_updates(params, updates), opt_state, value, gap

    return step


def main():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((64, 4)), jnp.float32)
    y = jnp.sin(x.sum(1, keepdims=True))
    params = {
        "w1": jnp.asarray(rng.standard_normal((16, 4)) * 0.5, jnp.float32), "b1": jnp.zeros(16),
        "w2": jnp.asarray(rng.standard_normal((1, 16)) * 0.5, jnp.float32), "b2": jnp.zeros(1),
    }
    opt_state = optimizer.init(params)
    layers = dict(ORIGINALS)
    phases = [("all PyTorch originals", None), *((f"{name} ported", name) for name in PORTS)]
    first = None
    for title, name in phases:
        if name is not None:
            layers[name] = PORTS[name]
        step = make_step(dict(layers), checking=name)
        for _ in range(30):
            params, opt_state, value, gap = step(params, opt_state, x, y)
            first = float(value) if first is None else first
            if float(gap) > 1e-5:
                raise SystemExit(f"{name}: the port differs from its original by {float(gap):.3g}")
        print(f"{title:22s} loss {float(value):.4f}" + (f"  (port vs original: {float(gap):.1e})" if name else ""))
    if not float(value) < 0.5 * first:
        raise SystemExit(f"training did not converge: loss {first:.4f} -> {float(value):.4f}")
    print(f"loss {first:.4f} -> {float(value):.4f}, every layer ported")


if __name__ == "__main__":
    main()
