"""What the collective ports (``allgather_port.py``, ``megatron_port.py``) share: shard_map and a mesh."""

import jax

if hasattr(jax, "shard_map"):
    def shard_map(f, **kwargs):  # PyTorch's (and Megatron's) convention: no varying-type check
        return jax.shard_map(f, check_vma=False, **kwargs)
else:  # JAX before 0.6: the experimental shard_map, its replication check off
    from jax.experimental.shard_map import shard_map as _experimental_shard_map

    def shard_map(f, **kwargs):
        return _experimental_shard_map(f, check_rep=False, **kwargs)


def make_mesh(ranks, axis):
    """A mesh of ``ranks`` devices along ``axis``."""
    axis_type = getattr(jax.sharding, "AxisType", None)  # JAX before 0.5: every mesh axis is Auto
    return jax.make_mesh((ranks,), (axis,), **({"axis_types": (axis_type.Auto,)} if axis_type else {}))
