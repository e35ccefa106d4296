# requires: optax, sklearn
"""The digits classifier of train_mlp.py, trained data-parallel over all devices.

    python examples/train_sharded.py

Each batch is split along its first axis over every device with a
``NamedSharding``; parameters and optimizer state are replicated. The train
step is the same ``jax.jit`` function as in train_mlp.py: vjpkit Functions
inline into the outer ``jit``, and XLA inserts the cross-device sums that
their ``backward`` rules need (``g.T @ x`` over a sharded batch). Nothing here
is specific to vjpkit; it is JAX's own sharding.

On a CPU-only machine this file asks XLA for 8 host devices (it sets
``XLA_FLAGS=--xla_force_host_platform_device_count=8`` unless XLA_FLAGS
already sets a count). It then trains the same model on one device with the
same batches and checks that both runs end at the same loss.
"""

import os

# Must happen before jax is imported: XLA reads the flag when it starts.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

import argparse
import time

import jax
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from train_mlp import batches, init_params, load_data, make_train_step

# The final losses of the two runs differ only by float rounding (the
# sharded run sums gradients across devices in another order).
RTOL = 1e-3


def fit(epochs, batch_size, mesh=None, seed=0, log=print):
    """Trains with Adam; shards batches over ``mesh`` when given. Returns the last epoch's mean loss."""
    x_train, _, y_train, _ = load_data(seed)
    optimizer = optax.adam(1e-3)
    train_step = make_train_step(optimizer)
    params = init_params(jax.random.key(seed))
    opt_state = optimizer.init(params)
    if mesh is not None:
        replicated = NamedSharding(mesh, P())
        by_batch = NamedSharding(mesh, P("batch"))
        params, opt_state = jax.device_put((params, opt_state), replicated)

    rng = np.random.default_rng(seed)
    for epoch in range(1, epochs + 1):
        start = time.perf_counter()
        losses = []
        for xb, yb in batches(x_train, y_train, batch_size, rng):
            if mesh is not None:
                xb, yb = jax.device_put((xb, yb), by_batch)
            params, opt_state, loss = train_step(params, opt_state, xb, yb)
            losses.append(loss)
        epoch_loss = float(np.mean(jax.device_get(losses)))
        log(f"epoch {epoch:3d}  loss {epoch_loss:.6f}  time {(time.perf_counter() - start) * 1e3:4.0f} ms")
    return epoch_loss


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=10)
    args = parser.parse_args()

    devices = jax.devices()
    # Auto axes (Mesh's default): XLA decides how intermediates are sharded, as
    # in plain jit code (Explicit axes would ask the user's backward for out_sharding).
    mesh = Mesh(np.array(devices), ("batch",))
    # A multiple of the device count near 64, so every device gets equal rows.
    batch_size = len(devices) * max(1, 64 // len(devices))
    print(f"{len(devices)} devices ({devices[0].platform}), batch {batch_size} "
          f"= {len(devices)} x {batch_size // len(devices)} rows")

    print("data-parallel:")
    sharded = fit(args.epochs, batch_size, mesh)
    print("one device:")
    single = fit(args.epochs, batch_size, log=lambda line: None)

    diff = abs(sharded - single) / abs(single)
    print(f"final loss: sharded {sharded:.6f}, one device {single:.6f}, relative difference {diff:.1e}")
    if diff > RTOL:
        raise SystemExit(f"sharded and single-device losses differ by more than {RTOL}")


if __name__ == "__main__":
    main()
