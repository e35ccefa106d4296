"""``torch.distributed.nn``'s all-gather on 4 devices (``allgather_script.py``).

The device count is fixed when JAX starts and this pytest process has one
CPU device, so the script runs once in a subprocess with
``XLA_FLAGS=--xla_force_host_platform_device_count=4``; each test below
checks one of its cases. Both of the original's backward paths are
ported: reduce-scatter (NCCL) and all-to-all with a sum (other backends).

``FROM_TORCH_CASES`` run PyTorch's own ``_AllGather`` (``dist.all_gather``
forward; all-to-all and a sum backward, gloo's path) through
``vjpkit.from_torch`` on a one-rank gloo process group, beside the port on a
mesh of one device; the script checks the port on 4 devices against the
simulated original through ``from_torch`` too.
"""

import pathlib

import numpy as np
import pytest
from allgather_port import AXIS, AllGather, make_mesh, shard_map
from jax.sharding import PartitionSpec as P
from port_checks import assert_script_check_passed
from torch.distributed.nn.functional import _AllGather as TorchDistributedAllGather

SCRIPT = pathlib.Path(__file__).with_name("allgather_script.py")
PATHS = ["nccl", "gloo"]  # the original's backward: reduce-scatter, or all-to-all and a sum
CHECKS = ["matches_torch", "matches_torch_to_second_order", "jit_grad_matches_torch", "from_torch_matches_port",
          "vmap_inside_shard_map_matches_loop", "per_rank_outputs_need_no_opt_out_of_the_varying_check"]

X = np.random.default_rng(34).standard_normal((1, 3))  # the one rank's block


def on_one_rank(group, x):
    """The port on a mesh of one device: the one rank of the original's process group."""
    return shard_map(lambda x: AllGather.apply(group, x), mesh=make_mesh(1), in_specs=P(AXIS), out_specs=(P(AXIS),))(x)


# group=None: the default process group for the original, the all-to-all path for the port.
FROM_TORCH_CASES = [dict(original=TorchDistributedAllGather, port=on_one_rank, args=(None, X), second_order=True,
                         process_group=True)]


@pytest.fixture(scope="module")
def results(run_script):
    return run_script(SCRIPT, devices=4)  # SCRIPT is an absolute path: not one of tests/scripts/


def test_script_runs_every_case(results):
    want = [f"{p}/{c}" for p in PATHS for c in CHECKS] + ["own_slot_gradient_is_the_ranks_own_cotangent"]
    assert sorted(results) == sorted(want)


@pytest.mark.parametrize("check", CHECKS)
@pytest.mark.parametrize("path", PATHS)
def test_all_gather(path, check, results):
    assert_script_check_passed(results, f"{path}/{check}")


def test_the_gradient_of_a_ranks_own_slot_is_indexed_by_a_traced_rank(results):
    error = results["own_slot_gradient_is_the_ranks_own_cotangent"]
    assert error is None, error
