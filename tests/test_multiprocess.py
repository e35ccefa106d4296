"""vjpkit Functions across processes: 2 local processes x 2 CPU devices, JAX's own runtime.

`scripts/multiprocess_script.py` runs once as a single process with 4 devices (it
exports the sharded train step), then as the 2 processes of one
`jax.distributed` run on 127.0.0.1 (gloo collectives); each process writes
its results to a JSON file. The processes are this test's own children,
killed if they outlive the timeout.
"""

import json
import os
import pathlib
import socket
import subprocess
import sys
import time

import pytest

SCRIPT = pathlib.Path(__file__).parent / "scripts" / "multiprocess_script.py"
PROCESSES = 2
DEVICES_PER_PROCESS = 2
TIMEOUT_S = 300

pytestmark = pytest.mark.slow  # three JAX processes and a distributed run: left out of a plain `pytest`, run in CI


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def environment(devices):
    return dict(
        os.environ,
        JAX_PLATFORMS="cpu",
        XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
    )


def run_all(commands, env, timeout):
    """Runs the commands at once; returns their (status, output), killing any still running at the end."""
    children = [
        subprocess.Popen(c, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for c in commands
    ]
    deadline = time.monotonic() + timeout
    results = []
    try:
        for child in children:
            try:
                out, _ = child.communicate(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.kill()
                out, _ = child.communicate()
                out += f"\n(killed after {timeout} s)"
            results.append((child.returncode, out))
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
                child.wait()
    return results


@pytest.fixture(scope="module")
def processes(tmp_path_factory):
    """Per process: {"results": {case: None or error}, "figures": {...}}."""
    out = tmp_path_factory.mktemp("multiprocess")
    start = time.monotonic()
    [(status, output)] = run_all(
        [[sys.executable, str(SCRIPT), "--single", "--out", str(out)]],
        environment(PROCESSES * DEVICES_PER_PROCESS),
        TIMEOUT_S,
    )
    assert status == 0, f"the single-process export failed:\n{output}"
    coordinator = f"127.0.0.1:{free_port()}"
    commands = [
        [sys.executable, str(SCRIPT), "--out", str(out), "--process-id", str(i),
         "--num-processes", str(PROCESSES), "--coordinator", coordinator]
        for i in range(PROCESSES)
    ]
    runs = run_all(commands, environment(DEVICES_PER_PROCESS), TIMEOUT_S - (time.monotonic() - start))
    for i, (status, output) in enumerate(runs):
        assert status == 0, f"process {i} exited with {status}:\n{output}"
    return [json.loads((out / f"process{i}.json").read_text()) for i in range(PROCESSES)]


def check_case(processes, case):
    for i, process in enumerate(processes):
        result = process["results"][case]
        if isinstance(result, dict):
            pytest.skip(result["skip"])
        assert result is None, f"process {i}, {case}:\n{result}"


def test_data_parallel_two_processes_equal_one_process(processes):
    check_case(processes, "data_parallel")


def test_fsdp_two_processes_equal_one_process(processes):
    check_case(processes, "fsdp")


def test_host_function_in_jitted_multiprocess_step_matches_autodiff(processes):
    check_case(processes, "host_function_in_jitted_step")


def test_host_function_in_jitted_step_runs_its_numpy_code_in_process_0(processes):
    # The callback runs once, on device 0, with the whole (gathered) batch.
    calls = [p["figures"]["host_calls"] for p in processes]
    assert calls[0]["forward"] >= 1 and calls[0]["backward"] >= 1, calls
    assert calls[1] == {"forward": 0, "backward": 0}, calls


def test_detect_anomaly_raises_the_same_error_in_every_process(processes):
    check_case(processes, "detect_anomaly_raises")
    messages = [p["figures"]["anomaly"] for p in processes]
    assert messages[0] == messages[1], messages
    # Row 5 is process 1's: the index is the global one.
    expected = "Log.forward returned nan in output 0: 1 nan of 16 elements (the first at index (5, 1))"
    assert messages[0].startswith(expected), messages[0]


def test_exported_sharded_step_is_process_count_independent(processes):
    # The same module exported by 1 process x 4 devices and by 2 x 2; the
    # one-process export, called in the 2-process run, equals the jitted step.
    check_case(processes, "exported_step")
