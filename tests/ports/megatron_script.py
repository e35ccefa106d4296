"""Megatron-LM's tensor-parallel mappings, as vjpkit Functions in ``jax.shard_map``.

Original: NVIDIA/Megatron-LM, megatron/core/tensor_parallel/mappings.py
(``_CopyToModelParallelRegion``, ``_ReduceFromModelParallelRegion``,
``_ScatterToModelParallelRegion``, ``_GatherFromModelParallelRegion``):
each is one collective in forward and its transpose in backward. Pattern:
identity forward with an all-reduce backward, and the other three pairs.

PyTorch's collectives need a process group per rank; the PyTorch side here
keeps Megatron's Functions and simulates the R ranks of the tensor-parallel
group as a leading axis of every tensor (an all-reduce sums over that axis
and gives every rank the sum). The vjpkit side runs for real on R devices:
``jax.shard_map`` over the axis ``"tp"``, whose collectives are
``lax.psum`` and ``lax.all_gather``.

``test_port_megatron.py`` runs it in a subprocess (the device count is fixed
when JAX starts) and reads the JSON that ``collective_ports.report`` prints:

    XLA_FLAGS=--xla_force_host_platform_device_count=4 python tests/ports/megatron_script.py
"""

import functools
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from collective_ports import report  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
from megatron_mappings import mappings  # noqa: E402
from megatron_port import AXIS, MAPPINGS, make_mesh, shard_map  # noqa: E402

# jax.enable_x64 or its older home; a script run in a subprocess has no pytest fixture.
from vjpkit._jax_internals import enable_x64  # noqa: E402
from vjpkit.testing import assert_matches_torch, assert_port_matches_original  # noqa: E402

R = 4  # ranks in the tensor-parallel group


# --- PyTorch, ranks simulated as the leading axis -----------------------------


def _reduce(x):
    """all_reduce(SUM) across ranks: every rank gets the sum."""
    return x.sum(0, keepdim=True).expand_as(x).clone()


def _split_along_last_dim(x):
    """Rank r keeps its 1/R of the last dimension."""
    size = x.shape[-1] // R
    return torch.stack([x[r, ..., r * size:(r + 1) * size] for r in range(R)])


def _gather_along_last_dim(x):
    """Every rank gets all ranks' pieces, concatenated along the last dimension."""
    full = torch.cat([x[r] for r in range(R)], dim=-1)
    return full.unsqueeze(0).expand(R, *full.shape).clone()


# Megatron's Functions over the simulated collectives (Megatron's copy returns its input; a clone here).
ORIGINALS = mappings(torch.autograd.Function, "Torch", reduce=_reduce, split=_split_along_last_dim,
                     gather=_gather_along_last_dim, copy=lambda input_: input_.clone())


MESH = make_mesh(R)


def on_ranks(port):
    """The port on R devices: each sees its (1, ...) block of the rank axis.

    ``check_vma=False``: Megatron's backward rules assume that the values a
    rank holds after a reduce are replicated and that the loss after them is
    too; with JAX's replication checking, JAX itself would add the transpose
    of the implicit broadcast of a ``psum`` result (another ``psum``) and
    the reduce's gradient would be counted R times.
    """
    def fn(x):
        return shard_map(port.apply, mesh=MESH, in_specs=P(AXIS), out_specs=P(AXIS))(x)
    fn.__name__ = port.__name__
    return fn


PAIRS = {name: (ORIGINALS[name], port) for name, port in MAPPINGS.items()}
X = np.random.default_rng(9).standard_normal((R, 3, 8))  # rank, tokens, hidden


def matches_torch(torch_fn, port):
    assert_matches_torch(torch_fn, on_ranks(port), (X,))


def matches_torch_to_second_order(torch_fn, port):
    assert_matches_torch(torch_fn, on_ranks(port), (X,), check_second_order=True)


def jit_grad_matches_torch(torch_fn, port):
    leaf = torch.tensor(X, requires_grad=True)
    (want,) = torch.autograd.grad(torch_fn.apply(leaf.clone()).sin().sum(), leaf)
    with enable_x64(True):
        got = jax.jit(jax.grad(lambda x: jnp.sum(jnp.sin(on_ranks(port)(x)))))(jnp.asarray(X))
    np.testing.assert_allclose(np.asarray(got), want.numpy(), rtol=1e-12)


def from_torch_matches_port(torch_fn, port):
    # The original (ranks simulated) through vjpkit.from_torch, beside the port on R devices, in one program.
    assert_port_matches_original(on_ranks(port), torch_fn, X, second_order=True, atol=1e-12)


def vmap_inside_shard_map_matches_loop(torch_fn, port):
    # A batch of independent sequences on every rank: vmap over axis 1 of each rank's block.
    def batched(x):
        return jax.vmap(port.apply, in_axes=1, out_axes=1)(x)

    with enable_x64(True):
        x = jnp.asarray(X)
        got = shard_map(batched, mesh=MESH, in_specs=P(AXIS), out_specs=P(AXIS))(x)
        for b in range(X.shape[1]):
            want = on_ranks(port)(x[:, b])
            np.testing.assert_allclose(np.asarray(got[:, b]), np.asarray(want), rtol=1e-12)


def main():
    checks = (matches_torch, matches_torch_to_second_order, jit_grad_matches_torch, from_torch_matches_port,
              vmap_inside_shard_map_matches_loop)
    report((f"{name}/{check.__name__}", functools.partial(check, torch_fn, port))
           for name, (torch_fn, port) in PAIRS.items() for check in checks)


if __name__ == "__main__":
    main()
