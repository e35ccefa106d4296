"""vjpkit Functions in a multi-process JAX run: 2 processes x 2 CPU devices.

Run by `test_multiprocess.py`: first once as a single process with 4 devices
(`--single`, it exports the sharded train step), then as the processes of one
distributed run (`--process-id`, `--num-processes`, `--coordinator`). Each
writes one JSON file into `--out`: for each case, null when it passed,
{"skip": reason} when this JAX lacks the feature, otherwise the error text;
and the figures it measured.

    XLA_FLAGS=--xla_force_host_platform_device_count=4 python tests/scripts/multiprocess_script.py --single --out DIR
"""

import argparse
import inspect
import json
import os
import pathlib
import re
import sys
import traceback

EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples"
sys.path[:0] = [str(EXAMPLES), str(pathlib.Path(__file__).resolve().parents[1])]  # and tests/, for functions

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from functions import Log  # noqa: E402
from jax import export  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
from train_mlp import init_params, loss_fn  # noqa: E402
from train_multiprocess import fit, global_array, initialize, make_mesh, one_device_loss  # noqa: E402

import vjpkit  # noqa: E402

EPOCHS = 1
ROWS_PER_DEVICE = 16
TOLERANCE = 1e-5  # relative, on the last epoch's mean loss

# Host-side calls of HostTanh's NumPy code in this process (run time, not trace time).
HOST_CALLS = {"forward": 0, "backward": 0}


@vjpkit.function(host=True)
class HostTanh:
    @staticmethod
    def forward(ctx, x):
        HOST_CALLS["forward"] += 1
        y = np.tanh(x)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, g):
        HOST_CALLS["backward"] += 1
        (y,) = ctx.saved_tensors
        return g * (1 - y**2)


def rows_of_this_process(global_rows):
    """This process's contiguous share of a global batch."""
    n = len(global_rows) // jax.process_count()
    return global_rows[jax.process_index() * n : (jax.process_index() + 1) * n]


def batch_array(mesh, global_rows):
    """A batch-sharded global array, each process giving its own rows."""
    sharding = NamedSharding(mesh, P("batch"))
    return jax.make_array_from_process_local_data(sharding, rows_of_this_process(global_rows), global_rows.shape)


# ---------------------------------------------------------------------------
# The cases.


def data_parallel(mesh, figures):
    loss, step = fit(mesh, EPOCHS, False, ROWS_PER_DEVICE, log=lambda line: None)
    figures["data_parallel"] = {"loss": loss, "step_s": step}
    check_against_one_device(loss, figures)


def fsdp(mesh, figures):
    loss, step = fit(mesh, EPOCHS, True, ROWS_PER_DEVICE, log=lambda line: None)
    figures["fsdp"] = {"loss": loss, "step_s": step}
    check_against_one_device(loss, figures)


def check_against_one_device(loss, figures):
    if jax.process_index() != 0:
        return
    if "one_device" not in figures:
        figures["one_device"] = one_device_loss(EPOCHS, jax.device_count() * ROWS_PER_DEVICE)
    single = figures["one_device"]
    assert abs(loss - single) <= TOLERANCE * abs(single), (loss, single)


def host_function_in_jitted_step(mesh, figures):
    rng = np.random.default_rng(1)
    x = rng.normal(size=(8, 3)).astype(np.float32)
    w = rng.normal(size=(5, 3)).astype(np.float32)

    def loss(w, x, f):
        return (f(x @ w.T) ** 2).mean()

    expected = jax.jit(jax.value_and_grad(loss), static_argnums=2)(w, x, jnp.tanh)
    xs = batch_array(mesh, x)
    ws = global_array(w, NamedSharding(mesh, P()))
    value, grad = jax.jit(jax.value_and_grad(loss), static_argnums=2)(ws, xs, HostTanh.apply)
    np.testing.assert_allclose(float(value), float(expected[0]), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(grad), np.asarray(expected[1]), rtol=1e-5, atol=1e-6)
    figures["host_calls"] = dict(HOST_CALLS)


class Skip(Exception):
    pass


def detect_anomaly_raises(mesh, figures):
    if "partitioned" not in inspect.signature(jax.debug.callback).parameters:
        raise Skip("this JAX lacks debug callbacks on every device (jax.debug.callback's partitioned=True): "
                   "only process 0 can see a NaN")
    # Row 5 belongs to process 1 (rows 4-7 of 8): log of a negative number.
    x = np.ones((8, 2), np.float32)
    x[5, 1] = -1.0
    xs = batch_array(mesh, x)
    step = jax.jit(jax.value_and_grad(lambda x: Log.apply(x).sum()))
    try:
        with vjpkit.detect_anomaly():
            jax.block_until_ready(step(xs))
    except FloatingPointError as e:
        figures["anomaly"] = str(e)
    else:
        raise AssertionError("detect_anomaly did not raise in this process")


def train_step_for_export(mesh):
    """The digits model's data-parallel step, and abstract arguments with shardings."""
    optimizer = optax.sgd(0.1)

    def step(params, x, y):
        value, grads = jax.value_and_grad(loss_fn)(params, x, y)
        updates, _ = optimizer.update(grads, optimizer.init(params), params)
        return optax.apply_updates(params, updates), value

    params = init_params(jax.random.key(0))
    replicated, by_batch = NamedSharding(mesh, P()), NamedSharding(mesh, P("batch"))
    batch = jax.device_count() * ROWS_PER_DEVICE
    args = (
        jax.tree_util.tree_map(lambda p: jax.ShapeDtypeStruct(p.shape, p.dtype, sharding=replicated), params),
        jax.ShapeDtypeStruct((batch, 64), jnp.float32, sharding=by_batch),
        jax.ShapeDtypeStruct((batch,), jnp.int32, sharding=by_batch),
    )
    return jax.jit(step), params, args


def export_data(batch):
    rng = np.random.default_rng(2)
    return rng.uniform(size=(batch, 64)).astype(np.float32), rng.integers(0, 10, size=batch).astype(np.int32)


def without_locations(module):
    """The StableHLO text without source locations (which say where the step was traced from)."""
    return "\n".join(re.sub(r"#loc\d+", "#loc", line) for line in module.splitlines() if not line.startswith("#loc"))


def exported_step_is_process_count_independent(mesh, figures, out):
    step, params, args = train_step_for_export(mesh)
    exported = export.export(step)(*args)
    single_dir = pathlib.Path(out)
    assert without_locations(exported.mlir_module()) == without_locations((single_dir / "single.mlir").read_text())
    from_single = export.deserialize(bytearray((single_dir / "single.bin").read_bytes()))
    x, y = export_data(args[1].shape[0])
    params = jax.tree_util.tree_map(lambda p: global_array(p, NamedSharding(mesh, P())), params)
    xs, ys = batch_array(mesh, x), batch_array(mesh, y)
    # One program at a time: two independent programs dispatched together may
    # run at once, and gloo then pairs one program's collective in this process
    # with the other's in the next (seen on JAX 0.4.38: gloo aborts on the
    # message size).
    new_params, value = jax.block_until_ready(from_single.call(params, xs, ys))
    want_params, want_value = jax.block_until_ready(step(params, xs, ys))
    assert float(value) == float(want_value), (float(value), float(want_value))
    for a, b in zip(jax.tree_util.tree_leaves(new_params), jax.tree_util.tree_leaves(want_params), strict=True):
        np.testing.assert_array_equal(np.asarray(a.addressable_data(0)), np.asarray(b.addressable_data(0)))
    figures["export_loss"] = float(value)


def single(out):
    """One process, 4 devices: exports the step for the distributed run to compare and call."""
    mesh = make_mesh()
    step, _, args = train_step_for_export(mesh)
    exported = export.export(step)(*args)
    out = pathlib.Path(out)
    (out / "single.mlir").write_text(exported.mlir_module())
    (out / "single.bin").write_bytes(exported.serialize())


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--single", action="store_true")
    parser.add_argument("--process-id", type=int)
    parser.add_argument("--num-processes", type=int)
    parser.add_argument("--coordinator")
    args = parser.parse_args()
    if args.single:
        single(args.out)
        return
    args.bind = None
    initialize(args)
    mesh = make_mesh()
    figures: dict = {}
    results = {}
    cases = [
        ("data_parallel", lambda: data_parallel(mesh, figures)),
        ("fsdp", lambda: fsdp(mesh, figures)),
        ("host_function_in_jitted_step", lambda: host_function_in_jitted_step(mesh, figures)),
        ("exported_step", lambda: exported_step_is_process_count_independent(mesh, figures, args.out)),
        # Last: a failed step may leave the processes' collectives out of step.
        ("detect_anomaly_raises", lambda: detect_anomaly_raises(mesh, figures)),
    ]
    for name, case in cases:
        try:
            case()
            results[name] = None
        except Skip as skip:
            results[name] = {"skip": str(skip)}
        except Exception:  # noqa: BLE001 - reported to the test
            results[name] = traceback.format_exc()
    path = os.path.join(args.out, f"process{args.process_id}.json")
    with open(path, "w") as f:
        json.dump({"results": results, "figures": figures}, f)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()
