"""``torch.distributed.nn``'s all-gather ported: one rank's view inside ``jax.shard_map``.

The port of ``allgather_script.py`` (which runs it on 4 devices) and of
``test_port_allgather.py`` (which runs it on a mesh of one device beside the
original on a one-rank process group), on a mesh axis ``"dp"``.
"""

import collective_ports
import jax
import jax.numpy as jnp
from collective_ports import shard_map  # noqa: F401 - the ports' shard_map, re-exported

import vjpkit

AXIS = "dp"


class AllGather(vjpkit.Function):
    @staticmethod
    def forward(ctx, group, tensor):
        ctx.group = group  # the backend's path: "nccl" reduce-scatters, others all-to-all and sum
        return tuple(jax.lax.all_gather(tensor, AXIS))

    @staticmethod
    def backward(ctx, *grad_outputs):
        stacked = jnp.stack(grad_outputs)  # (R, ...): this rank's gradient for each rank's slot
        if ctx.group == "nccl":
            gx = jax.lax.psum_scatter(stacked, AXIS, scatter_dimension=0)
        else:
            gx = jax.lax.all_to_all(stacked, AXIS, 0, 0).sum(0)
        return (None, gx)


class OwnSlot(vjpkit.Function):
    """``grads[dist.get_rank()]``: the gradient of this rank's own slot, with a traced rank."""

    @staticmethod
    def forward(ctx, tensor):
        return tuple(jax.lax.all_gather(tensor, AXIS))

    @staticmethod
    def backward(ctx, *grad_outputs):
        return jnp.stack(grad_outputs)[jax.lax.axis_index(AXIS)]  # a tuple cannot take a traced index


def make_mesh(ranks):
    """A mesh of ``ranks`` devices along AXIS."""
    return collective_ports.make_mesh(ranks, AXIS)
