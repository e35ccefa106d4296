"""Megatron-LM's tensor-parallel mappings on 4 devices (``megatron_script.py``).

The device count is fixed when JAX starts and this pytest process has one
CPU device, so the script runs once in a subprocess with
``XLA_FLAGS=--xla_force_host_platform_device_count=4``; each test below
checks one of its cases.
"""

import json
import os
import pathlib
import subprocess
import sys

import pytest
from port_checks import skip_where_this_jax_lacks_it

SCRIPT = pathlib.Path(__file__).with_name("megatron_script.py")
MAPPINGS = [
    "copy_to_model_parallel_region",  # identity forward, all-reduce backward
    "reduce_from_model_parallel_region",  # all-reduce forward, identity backward
    "scatter_to_model_parallel_region",  # split forward, all-gather backward
    "gather_from_model_parallel_region",  # all-gather forward, split backward
]
CHECKS = ["matches_torch", "jit_grad_matches_torch", "vmap_inside_shard_map_matches_loop"]


@pytest.fixture(scope="module")
def results():
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
    run = subprocess.run([sys.executable, str(SCRIPT)], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, f"megatron_script.py failed:\n{run.stdout}\n{run.stderr}"
    return json.loads(run.stdout)


def test_script_runs_every_case(results):
    assert sorted(results) == sorted(f"{m}/{c}" for m in MAPPINGS for c in CHECKS + ["matches_torch_to_second_order"])


@pytest.mark.parametrize("check", CHECKS)
@pytest.mark.parametrize("mapping", MAPPINGS)
def test_mapping(mapping, check, results):
    error = results[f"{mapping}/{check}"]
    skip_where_this_jax_lacks_it(error)
    assert error is None, error


@pytest.mark.parametrize("mapping", MAPPINGS)
def test_mapping_matches_torch_to_second_order(mapping, results):
    error = results[f"{mapping}/matches_torch_to_second_order"]
    assert error is None, error
