"""What the collective ports (``allgather_port.py``, ``megatron_port.py``) share: shard_map and a mesh.

And their 4-device scripts' report: ``report``.
"""

import json
import traceback

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


def report(checks):
    """Runs each ``(name, check)`` and prints one JSON object: for each name, null when it passed, else the error."""
    results = {}
    for name, check in checks:
        try:
            check()
            results[name] = None
        except Exception:  # noqa: BLE001 - reported to the test
            results[name] = traceback.format_exc()
    print(json.dumps(results))
