# requires: equinox, optax
"""A vjpkit Function inside an Equinox module, trained with optax.

    pip install equinox optax
    python examples/equinox_module.py

An Equinox module is a pytree whose fields are the parameters, so a layer
holds its arrays and calls the Function in ``__call__``; ``eqx.filter_jit``
and ``eqx.filter_value_and_grad`` differentiate through the Function's own
``backward``. The task is a small regression: fit ``sin(3x)`` on [-1, 1].
"""

import argparse

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from layers import linear, relu


class Linear(eqx.Module):
    """``torch.nn.Linear``'s parameters, applied by the vjpkit ``Linear`` Function."""

    weight: jax.Array
    bias: jax.Array

    def __init__(self, in_features, out_features, *, key):
        bound = 1.0 / in_features**0.5
        self.weight = jax.random.uniform(key, (out_features, in_features), minval=-bound, maxval=bound)
        self.bias = jnp.zeros(out_features)

    def __call__(self, x):
        return linear(x, self.weight, self.bias)


class MLP(eqx.Module):
    layers: list

    def __init__(self, sizes, *, key):
        keys = jax.random.split(key, len(sizes) - 1)
        self.layers = [Linear(i, o, key=k) for i, o, k in zip(sizes[:-1], sizes[1:], keys, strict=True)]

    def __call__(self, x):
        *hidden, last = self.layers
        for layer in hidden:
            x = relu(layer(x))
        return last(x)


def mse(model, x, y):
    return jnp.mean((model(x) - y) ** 2)


def train(steps=500, seed=0, log=print):
    """Full-batch Adam on the regression; returns the final mean squared error."""
    model_key, data_key = jax.random.split(jax.random.key(seed))
    x = jax.random.uniform(data_key, (256, 1), minval=-1.0, maxval=1.0)
    y = jnp.sin(3 * x)
    model = MLP((1, 64, 64, 1), key=model_key)
    optimizer = optax.adam(1e-2)
    opt_state = optimizer.init(eqx.filter(model, eqx.is_array))

    @eqx.filter_jit
    def train_step(model, opt_state, x, y):
        loss, grads = eqx.filter_value_and_grad(mse)(model, x, y)
        updates, opt_state = optimizer.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        return eqx.apply_updates(model, updates), opt_state, loss

    for step in range(1, steps + 1):
        model, opt_state, loss = train_step(model, opt_state, x, y)
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
