# requires: optax, sklearn
"""The digits classifier of train_mlp.py, trained across several processes.

    python examples/train_multiprocess.py                  # 2 local processes x 2 CPU devices
    python examples/train_multiprocess.py --fsdp           # weights and Adam state sharded too
    python examples/train_multiprocess.py --processes 4 --devices-per-process 2

Run so, the script is a launcher: it starts N worker processes of itself on
127.0.0.1 (a free port, each worker with its own host devices), waits for
them within a timeout, and stops them if one fails. On real hosts, start one
worker per host yourself, the same script with the worker flags:

    python examples/train_multiprocess.py --process-id 0 --num-processes 2 --coordinator 10.0.0.1:1234
    python examples/train_multiprocess.py --process-id 1 --num-processes 2 --coordinator 10.0.0.1:1234

Each worker joins JAX's distributed runtime (``jax.distributed.initialize``;
CPU collectives over gloo), builds one mesh over every process's devices and
feeds only its own rows of each batch (``jax.make_array_from_process_local_data``).
Data-parallel by default: parameters and optimizer state replicated; with
``--fsdp`` they are sharded over all devices too. The train step is one
``jax.jit`` with shardings, and the layers are the vjpkit Functions of
``layers.py``: nothing in them knows about processes. Process 0 prints the
per-epoch loss and test accuracy, then trains the same model on one device
with the same batches and checks that both end at the same loss.
"""

import argparse
import inspect
import os
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from train_mlp import accuracy, batches, init_params, load_data, loss_fn, make_train_step

# The final losses differ only by float rounding (gradients are summed
# across devices and processes in another order).
RTOL = 1e-3


# ---------------------------------------------------------------------------
# Launcher: N local workers.


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(args, worker_args):
    """Starts the local workers; returns process 0's exit status (0 when all succeeded)."""
    coordinator = f"127.0.0.1:{free_port()}"
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={args.devices_per_process}"
    workers = []
    for i in range(args.processes):
        command = [
            sys.executable, os.path.abspath(__file__), *worker_args,
            "--process-id", str(i), "--num-processes", str(args.processes), "--coordinator", coordinator,
        ]
        # Process 0 prints to this terminal; the others' output is shown if they fail.
        output = None if i == 0 else subprocess.PIPE
        workers.append(subprocess.Popen(command, env=env, stdout=output, stderr=subprocess.STDOUT, text=True))
    deadline = time.monotonic() + args.timeout
    try:
        for i, worker in enumerate(workers):
            out, _ = worker.communicate(timeout=max(1.0, deadline - time.monotonic()))
            if worker.returncode != 0:
                if out:
                    print(f"--- process {i} ---\n{out}", file=sys.stderr)
                raise SystemExit(f"process {i} exited with status {worker.returncode}")
    except subprocess.TimeoutExpired:
        raise SystemExit(f"the workers did not finish within {args.timeout:g} s") from None
    finally:
        for worker in workers:  # only our own children
            if worker.poll() is None:
                worker.kill()
                worker.wait()


# ---------------------------------------------------------------------------
# Worker: one process of the distributed run.


def initialize(args):
    """Joins the distributed runtime; the coordinator (in process 0) listens on its own address only."""
    # CPU devices of different processes talk through gloo (TCP).
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    options = dict(coordinator_address=args.coordinator, num_processes=args.num_processes, process_id=args.process_id)
    # Without it the coordinator listens on every interface of its host.
    if "coordinator_bind_address" in inspect.signature(jax.distributed.initialize).parameters:
        options["coordinator_bind_address"] = args.bind or args.coordinator
    jax.distributed.initialize(**options)


def make_mesh():
    """One axis over every device of every process (Auto axes where JAX has axis types)."""
    axis_type = getattr(jax.sharding, "AxisType", None)
    if axis_type is None:
        return jax.make_mesh((jax.device_count(),), ("batch",))
    return jax.make_mesh((jax.device_count(),), ("batch",), axis_types=(axis_type.Auto,))


def fsdp_spec(shape, n):
    """Shards an array's first axis that the device count divides; replicates it if none."""
    for axis, size in enumerate(shape):
        if size % n == 0:
            return P(*([None] * axis), "batch")
    return P()


def global_array(value, sharding):
    """The same value in every process, as one array with ``sharding`` (each process fills its shards)."""
    value = np.asarray(value)
    return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])


def fit(mesh, epochs=4, fsdp=False, rows_per_device=16, seed=0, log=print):
    """Trains on every device of ``mesh``, this process feeding its own rows.

    Returns the last epoch's mean loss and the median step time in seconds
    (after the first epoch, which compiles). Every process calls it.
    """
    n_devices, n_processes, me = mesh.size, jax.process_count(), jax.process_index()
    batch_size = n_devices * rows_per_device
    rows = batch_size // n_processes  # this process's share of every batch
    by_batch = NamedSharding(mesh, P("batch"))
    replicated = NamedSharding(mesh, P())

    def sharding_of(leaf):
        return NamedSharding(mesh, fsdp_spec(np.shape(leaf), n_devices) if fsdp else P())

    x_train, x_test, y_train, y_test = load_data(seed)
    optimizer = optax.adam(1e-3)
    params = init_params(jax.random.key(seed))
    param_shardings = jax.tree_util.tree_map(sharding_of, params)
    opt_shardings = jax.tree_util.tree_map(sharding_of, jax.eval_shape(optimizer.init, params))
    params = jax.tree_util.tree_map(global_array, params, param_shardings)
    opt_state = jax.jit(optimizer.init, out_shardings=opt_shardings)(params)

    def step(params, opt_state, x, y):
        value, grads = jax.value_and_grad(loss_fn)(params, x, y)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    step = jax.jit(
        step,
        in_shardings=(param_shardings, opt_shardings, by_batch, by_batch),
        out_shardings=(param_shardings, opt_shardings, replicated),
    )
    test_x = global_array(x_test, replicated)
    test_y = global_array(y_test, replicated)

    log(f"{n_processes} process{'es' if n_processes > 1 else ''} x {n_devices // n_processes} devices, "
        f"{'FSDP' if fsdp else 'data-parallel'}, batch {batch_size} = {n_processes} x {rows} rows, "
        f"first weight {params[0][0].sharding.spec}")
    rng = np.random.default_rng(seed)
    step_times = []
    for epoch in range(1, epochs + 1):
        start = time.perf_counter()
        losses = []
        for xb, yb in batches(x_train, y_train, batch_size, rng):
            mine = slice(me * rows, (me + 1) * rows)
            x = jax.make_array_from_process_local_data(by_batch, xb[mine], xb.shape)
            y = jax.make_array_from_process_local_data(by_batch, yb[mine], yb.shape)
            t = time.perf_counter()
            params, opt_state, loss = step(params, opt_state, x, y)
            losses.append(loss)
            if epoch > 1:
                jax.block_until_ready(loss)
                step_times.append(time.perf_counter() - t)
        epoch_loss = float(np.mean([float(v) for v in losses]))
        test_acc = float(accuracy(params, test_x, test_y))
        log(f"epoch {epoch:3d}  loss {epoch_loss:.6f}  test accuracy {test_acc:6.2%}  "
            f"time {(time.perf_counter() - start) * 1e3:5.0f} ms")
    step_time = float(np.median(step_times)) if step_times else float("nan")
    if step_times:
        log(f"step time {step_time * 1e3:.2f} ms (median, epochs 2-{epochs})")
    return epoch_loss, step_time


def worker(args):
    initialize(args)
    me = jax.process_index()

    def log(line):
        if me == 0:
            print(line, flush=True)

    try:
        loss, _ = fit(make_mesh(), args.epochs, args.fsdp, args.rows_per_device, args.seed, log)
        if me == 0 and args.check:
            # The same batches on one local device: a plain single-device program.
            single = one_device_loss(args.epochs, jax.device_count() * args.rows_per_device, args.seed)
            diff = abs(loss - single) / abs(single)
            log(f"final loss: {jax.process_count()} processes {loss:.6f}, one device {single:.6f}, "
                f"relative difference {diff:.1e}")
            if diff > RTOL:
                raise SystemExit(f"the distributed and one-device losses differ by more than {RTOL}")
    finally:
        # Every process leaves the runtime together (without it JAX may abort at exit).
        jax.distributed.shutdown()


def one_device_loss(epochs, batch_size, seed=0):
    """The last epoch's mean loss of the same training on this process's first device."""
    device = jax.local_devices()[0]
    x_train, _, y_train, _ = load_data(seed)
    optimizer = optax.adam(1e-3)
    params = jax.device_put(init_params(jax.random.key(seed)), device)
    opt_state = jax.device_put(optimizer.init(params), device)
    train_step = make_train_step(optimizer)
    rng = np.random.default_rng(seed)
    for _ in range(epochs):
        losses = []
        for xb, yb in batches(x_train, y_train, batch_size, rng):
            params, opt_state, loss = train_step(params, opt_state, *jax.device_put((xb, yb), device))
            losses.append(loss)
    return float(np.mean(jax.device_get(losses)))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--fsdp", action="store_true", help="shard weights and optimizer state over all devices")
    parser.add_argument("--rows-per-device", type=int, default=16, help="batch rows per device")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-check", dest="check", action="store_false", help="skip the one-device comparison")
    launcher = parser.add_argument_group("launcher (local processes)")
    launcher.add_argument("--processes", type=int, default=2)
    launcher.add_argument("--devices-per-process", type=int, default=2)
    launcher.add_argument("--timeout", type=float, default=600, help="seconds before the workers are stopped")
    one = parser.add_argument_group("worker (one process; on real hosts, one per host)")
    one.add_argument("--process-id", type=int)
    one.add_argument("--num-processes", type=int)
    one.add_argument("--coordinator", help="HOST:PORT of process 0's coordinator")
    one.add_argument("--bind", help="address the coordinator listens on (default: --coordinator)")
    args = parser.parse_args()

    if args.process_id is None:
        worker_args = [f"--epochs={args.epochs}", f"--rows-per-device={args.rows_per_device}", f"--seed={args.seed}"]
        worker_args += ["--fsdp"] * args.fsdp + ["--no-check"] * (not args.check)
        launch(args, worker_args)
    else:
        if args.num_processes is None or args.coordinator is None:
            parser.error("--process-id needs --num-processes and --coordinator")
        worker(args)


if __name__ == "__main__":
    main()
