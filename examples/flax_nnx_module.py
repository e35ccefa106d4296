# requires: flax, optax
"""A vjpkit Function inside a Flax NNX module, trained with optax.

    pip install flax optax
    python examples/flax_nnx_module.py

An NNX module keeps its parameters in ``nnx.Param`` variables; ``__call__``
reads their arrays (``self.weight[...]``) and passes them to the Function.
``nnx.jit`` and ``nnx.value_and_grad`` differentiate through the Function's
own ``backward``, and ``nnx.Optimizer`` applies the optax update. The task is
the same small regression as equinox_module.py: fit ``sin(3x)`` on [-1, 1].
"""

import argparse
import inspect

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from layers import linear, relu


class Linear(nnx.Module):
    """``torch.nn.Linear``'s parameters, applied by the vjpkit ``Linear`` Function."""

    def __init__(self, in_features, out_features, *, rngs):
        bound = 1.0 / in_features**0.5
        init = jax.random.uniform(rngs.params(), (out_features, in_features), minval=-bound, maxval=bound)
        self.weight = nnx.Param(init)
        self.bias = nnx.Param(jnp.zeros(out_features))

    def __call__(self, x):
        return linear(x, self.weight[...], self.bias[...])


class MLP(nnx.Module):
    def __init__(self, sizes, *, rngs):
        # nnx.List (Flax 0.12 and later) marks a list of submodules; older Flax takes a plain list.
        layer_list = getattr(nnx, "List", list)
        self.layers = layer_list(Linear(i, o, rngs=rngs) for i, o in zip(sizes[:-1], sizes[1:], strict=True))

    def __call__(self, x):
        *hidden, last = self.layers
        for layer in hidden:
            x = relu(layer(x))
        return last(x)


def mse(model, x, y):
    return jnp.mean((model(x) - y) ** 2)


@nnx.jit
def train_step(model, optimizer, x, y):
    loss, grads = nnx.value_and_grad(mse)(model, x, y)
    if "model" in inspect.signature(optimizer.update).parameters:
        optimizer.update(model, grads)  # Flax 0.11 and later
    else:
        optimizer.update(grads)  # Flax 0.10, the newest that accepts JAX 0.4.38
    return loss


def train(steps=500, seed=0, log=print):
    """Full-batch Adam on the regression; returns the final mean squared error."""
    x = jax.random.uniform(jax.random.key(seed + 1), (256, 1), minval=-1.0, maxval=1.0)
    y = jnp.sin(3 * x)
    model = MLP((1, 64, 64, 1), rngs=nnx.Rngs(seed))
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    for step in range(1, steps + 1):
        loss = train_step(model, optimizer, x, y)
        if step % 100 == 0:
            log(f"step {step:4d}  mse {float(loss):.5f}")
    return float(mse(model, x, y))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=500)
    args = parser.parse_args()
    print(f"final mse: {train(args.steps):.5f}")


if __name__ == "__main__":
    main()
