"""What crossing processes costs: gloo all-reduce, and the digits train step, per topology.

    python benchmarks/multiprocess.py            # about 3 min on 2 idle CPU cores
    python benchmarks/multiprocess.py --quick    # about 1 min, rougher figures

Each topology is P processes x D CPU devices: 1x1 and 1x4 as plain
single-process JAX (XLA's in-process collectives), then 1x4, 2x2 and 4x1
through ``jax.distributed`` on 127.0.0.1 as ``examples/train_multiprocess.py``
starts them (gloo collectives over TCP, for every cross-device collective
once ``jax.distributed`` is initialized, even within one process). In each
run, process 0 reports:

* all-reduce: the median time of a jitted sum over the device axis of an
  ``f32[devices, k]`` array sharded by rows (every device ends with the
  sum), for k = 1, 1024 and 262144 floats (4 B, 4 KiB, 1 MiB per device);
* train step: the median step time of the digits model of
  ``examples/train_mlp.py`` (``train_multiprocess.fit``, 16 rows per
  device), data-parallel and FSDP, after the first epoch (which compiles),
  and the relative difference of the final loss to the same batches on one
  device.

The processes share the machine's cores: on 2 cores, 4 processes time-slice,
so read the 4x1 row as an upper bound.
"""

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))

# (processes, devices per process, through jax.distributed with gloo)
TOPOLOGIES = [(1, 1, False), (1, 4, False), (1, 4, True), (2, 2, True), (4, 1, True)]
SIZES = [1, 1024, 262144]
ROWS_PER_DEVICE = 16


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_topology(processes, devices, distributed, args, timeout=600):
    """Starts the workers; returns process 0's figures."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
    coordinator = f"127.0.0.1:{free_port()}"
    with tempfile.TemporaryDirectory() as out:
        result = Path(out) / "figures.json"
        children = [
            subprocess.Popen(
                [sys.executable, __file__, "--worker", "--out", str(result), "--epochs", str(args.epochs),
                 "--calls", str(args.calls), "--process-id", str(i), "--num-processes", str(processes),
                 "--coordinator", coordinator] + ([] if distributed else ["--no-distributed"]),
                env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            )
            for i in range(processes)
        ]
        deadline = time.monotonic() + timeout
        try:
            for i, child in enumerate(children):
                output, _ = child.communicate(timeout=max(1.0, deadline - time.monotonic()))
                if child.returncode != 0:
                    raise SystemExit(f"{processes}x{devices}: process {i} failed:\n{output}")
        finally:
            for child in children:  # only our own children
                if child.poll() is None:
                    child.kill()
                    child.wait()
        return json.loads(result.read_text())


def worker(args):
    from train_multiprocess import initialize

    if args.distributed:
        args.bind = None
        initialize(args)

    import jax
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P
    from train_multiprocess import fit, make_mesh, one_device_loss

    mesh = make_mesh()
    me, n_devices = jax.process_index(), jax.device_count()
    figures = {"all_reduce_s": {}}
    total = jax.jit(lambda x: x.sum(0), out_shardings=NamedSharding(mesh, P()))
    for k in SIZES:
        local = np.ones((jax.local_device_count(), k), np.float32)
        x = jax.make_array_from_process_local_data(NamedSharding(mesh, P("batch")), local, (n_devices, k))
        jax.block_until_ready(total(x))
        times = []
        for _ in range(args.calls):
            start = time.perf_counter()
            jax.block_until_ready(total(x))
            times.append(time.perf_counter() - start)
        figures["all_reduce_s"][str(k)] = float(np.median(times))
    for name, fsdp in (("data_parallel", False), ("fsdp", True)):
        loss, step = fit(mesh, args.epochs, fsdp, ROWS_PER_DEVICE, log=lambda line: None)
        figures[name] = {"loss": loss, "step_s": step}
    if me == 0:
        figures["one_device_loss"] = one_device_loss(args.epochs, n_devices * ROWS_PER_DEVICE)
        Path(args.out).write_text(json.dumps(figures))
    if args.distributed:
        jax.distributed.shutdown()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--epochs", type=int, default=4, help=argparse.SUPPRESS)
    parser.add_argument("--calls", type=int, default=200, help=argparse.SUPPRESS)
    parser.add_argument("--process-id", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--num-processes", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--coordinator", help=argparse.SUPPRESS)
    parser.add_argument("--no-distributed", dest="distributed", action="store_false", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    if args.quick:
        args.epochs, args.calls = 2, 30

    header = (f"{'topology':>24} | {'all-reduce 4 B':>14} {'4 KiB':>9} {'1 MiB':>9} | "
              f"{'DP step':>8} {'DP loss diff':>12} | {'FSDP step':>9} {'FSDP loss diff':>14}")
    print(header)
    print("-" * len(header))
    for processes, devices, distributed in TOPOLOGIES:
        f = run_topology(processes, devices, distributed, args)
        single = f["one_device_loss"]
        reduce_us = [f["all_reduce_s"][str(k)] * 1e6 for k in SIZES]
        cells = []
        for name in ("data_parallel", "fsdp"):
            cells.append(f"{f[name]['step_s'] * 1e3:6.2f} ms")
            cells.append(f"{abs(f[name]['loss'] - single) / abs(single):.1e}")
        name = f"{processes} proc x {devices} dev" + (", gloo" if distributed else "")
        print(name.rjust(24) + " | "
              + f"{reduce_us[0]:11.0f} µs {reduce_us[1]:6.0f} µs {reduce_us[2]:6.0f} µs | "
              + f"{cells[0]:>8} {cells[1]:>12} | {cells[2]:>9} {cells[3]:>14}", flush=True)


if __name__ == "__main__":
    main()
