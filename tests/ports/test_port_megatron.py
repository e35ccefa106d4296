"""Megatron-LM's tensor-parallel mappings on 4 devices (``megatron_script.py``).

The device count is fixed when JAX starts and this pytest process has one
CPU device, so the script runs once in a subprocess with
``XLA_FLAGS=--xla_force_host_platform_device_count=4``; each test below
checks one of its cases.

``FROM_TORCH_CASES`` run the four mappings as Megatron writes them against a
process group (``torch.distributed.all_reduce`` in place, ``all_gather``,
the rank's slice) through ``vjpkit.from_torch`` on a one-rank gloo group,
beside the ports on a mesh of one device. (Megatron skips the collectives
on a group of one; these copies call them, so that the check runs them.)
The in-place all-reduce needs ``copy_inputs=True``. No second order: torch
does not differentiate its collectives. The script checks the ports on 4
devices against the simulated originals through ``from_torch`` too.
"""

import pathlib

import numpy as np
import pytest
import torch
import torch.distributed as dist
from jax.sharding import PartitionSpec as P
from megatron_mappings import mappings
from megatron_port import AXIS, MAPPINGS, make_mesh, shard_map
from port_checks import assert_script_check_passed

SCRIPT = pathlib.Path(__file__).with_name("megatron_script.py")
def _reduce(input_):
    """All-reduce across the group, in place."""
    dist.all_reduce(input_.contiguous())
    return input_


def _split_along_last_dim(input_):
    """This rank's slice of the last dimension."""
    world_size, rank = dist.get_world_size(), dist.get_rank()
    return torch.split(input_, input_.shape[-1] // world_size, dim=-1)[rank].contiguous()


def _gather_along_last_dim(input_):
    """Every rank's tensor, concatenated along the last dimension."""
    tensor_list = [torch.empty_like(input_) for _ in range(dist.get_world_size())]
    dist.all_gather(tensor_list, input_.contiguous())
    return torch.cat(tensor_list, dim=-1).contiguous()


# Megatron's Functions over torch.distributed: TorchDistCopyToModelParallelRegion and the other three.
ORIGINALS = mappings(torch.autograd.Function, "TorchDist", reduce=_reduce, split=_split_along_last_dim,
                     gather=_gather_along_last_dim)


def on_one_rank(port):
    """The port on a mesh of one device: the one rank of the original's process group."""
    def fn(x):
        return shard_map(port.apply, mesh=make_mesh(1), in_specs=P(AXIS), out_specs=P(AXIS))(x)
    fn.__name__ = fn.__qualname__ = port.__name__
    return fn


X = np.random.default_rng(10).standard_normal((1, 3, 8))  # the one rank's block: rank, tokens, hidden
FROM_TORCH_CASES = [
    # copy_inputs: the all-reduce writes into its input in place, past torch's version counter (which
    # from_torch checks); on a group of more than one rank it would write into JAX's buffer.
    dict(original=ORIGINALS[mapping], from_torch=dict(copy_inputs=True), port=on_one_rank(MAPPINGS[mapping]),
         args=(X,), in_axes=(1,), vmap_args=(X[:, :, None],), process_group=True)
    for mapping in MAPPINGS
]

CHECKS = ["matches_torch", "jit_grad_matches_torch", "from_torch_matches_port", "vmap_inside_shard_map_matches_loop"]


@pytest.fixture(scope="module")
def results(run_script):
    return run_script(SCRIPT, devices=4)  # SCRIPT is an absolute path: not one of tests/scripts/


def test_script_runs_every_case(results):
    assert sorted(results) == sorted(f"{m}/{c}" for m in MAPPINGS for c in CHECKS + ["matches_torch_to_second_order"])


@pytest.mark.parametrize("check", CHECKS)
@pytest.mark.parametrize("mapping", MAPPINGS)
def test_mapping(mapping, check, results):
    assert_script_check_passed(results, f"{mapping}/{check}")


@pytest.mark.parametrize("mapping", MAPPINGS)
def test_mapping_matches_torch_to_second_order(mapping, results):
    error = results[f"{mapping}/matches_torch_to_second_order"]
    assert error is None, error
