"""Megatron-LM's tensor-parallel mappings ported: one rank's view inside ``jax.shard_map``.

The port of ``megatron_script.py`` (which runs it on 4 devices) and of
``test_port_megatron.py`` (which runs it on a mesh of one device beside
originals calling ``torch.distributed`` on a one-rank process group), on a
mesh axis ``"tp"``.
"""

import collective_ports
import jax
from collective_ports import shard_map  # noqa: F401 - the ports' shard_map, re-exported
from megatron_mappings import mappings

import vjpkit

AXIS = "tp"


def split_along_last_dim(x):
    size = x.shape[-1] // jax.lax.psum(1, AXIS)
    return jax.lax.dynamic_slice_in_dim(x, jax.lax.axis_index(AXIS) * size, size, axis=-1)


def gather_along_last_dim(x):
    return jax.lax.all_gather(x, AXIS, axis=x.ndim - 1, tiled=True)


def all_reduce(x):
    return jax.lax.psum(x, AXIS)


# Keyed by Megatron's function names ("copy_to_model_parallel_region", ...): CopyToModelParallelRegion and
# the other three, as vjpkit Functions over JAX's collectives.
MAPPINGS = mappings(vjpkit.Function, "", reduce=all_reduce, split=split_along_last_dim, gather=gather_along_last_dim)


def make_mesh(ranks):
    """A mesh of ``ranks`` devices along AXIS."""
    return collective_ports.make_mesh(ranks, AXIS)
