"""``torch.distributed.nn``'s all-gather, as a vjpkit Function in ``jax.shard_map``.

Original: pytorch/pytorch, torch/distributed/nn/functional.py (``_AllGather``,
what ``torch.distributed.nn.functional.all_gather`` runs): forward gathers
one tensor per rank; backward reduce-scatters the gradients (NCCL), or, on
backends without reduce-scatter, all-to-alls them and sums. Patterns: a
tuple output with one slot per rank, ``dist.get_rank()`` indexing a tuple of
gradients, reduce-scatter and all-to-all in backward.

PyTorch's collectives need a process group per rank; the PyTorch side here
keeps ``_AllGather``'s forward and both backward paths and simulates the R
ranks as a leading axis of every tensor (as ``megatron_script.py`` does).
The vjpkit side runs for real on R devices: ``jax.shard_map`` over the axis
``"dp"``, ``dist.get_rank()`` becoming ``jax.lax.axis_index`` and the
collectives ``lax.all_gather``, ``lax.psum_scatter`` and ``lax.all_to_all``,
as the cookbook's collectives section shows.

Each check's outcome goes to ``test_port_allgather.py`` as the JSON that
``collective_ports.report`` prints; the test runs the script in a subprocess,
because the device count is fixed when JAX starts:

    XLA_FLAGS=--xla_force_host_platform_device_count=4 python tests/ports/allgather_script.py
"""

import functools
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from allgather_port import AXIS, AllGather, OwnSlot, make_mesh, shard_map  # noqa: E402
from collective_ports import report  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

# jax.enable_x64 or its older home; a script run in a subprocess has no pytest fixture.
from vjpkit._jax_internals import enable_x64  # noqa: E402
from vjpkit.testing import assert_matches_torch, assert_port_matches_original  # noqa: E402

R = 4  # ranks in the group


# --- PyTorch, ranks simulated as the leading axis -----------------------------
# A tensor of shape (R, ...) holds every rank's value: x[r] is rank r's.


def _all_gather(tensor):
    """dist.all_gather: slot j of every rank's list holds rank j's tensor."""
    return [tensor[j].unsqueeze(0).expand_as(tensor).clone() for j in range(R)]


def _reduce_scatter(grad_outputs):
    """dist.reduce_scatter(SUM): rank r receives the sum over ranks of their slot r."""
    return torch.stack([grad_outputs[r].sum(0) for r in range(R)])


def _all_to_all(grad_outputs):
    """dist.all_to_all: rank r receives slot r of every rank, one tensor per sender."""
    return [torch.stack([grad_outputs[r][i] for r in range(R)]) for i in range(R)]


class TorchAllGather(torch.autograd.Function):
    """``_AllGather`` with the collectives simulated; ``group`` names the backend's path."""

    @staticmethod
    def forward(ctx, group, tensor):
        tensor = tensor.contiguous()
        ctx.group = group
        return tuple(_all_gather(tensor))

    @staticmethod
    def backward(ctx, *grad_outputs):
        if ctx.group == "nccl":
            gx = _reduce_scatter(grad_outputs)
        else:
            gxs = _all_to_all(grad_outputs)
            gx = torch.sum(torch.stack(gxs), dim=0)
        return (None, gx)


MESH = make_mesh(R)
X = np.random.default_rng(31).standard_normal((R, 3))  # rank, features


def on_ranks(group):
    """The port on R devices: each sees its (1, 3) block of the rank axis."""
    def fn(x):
        return shard_map(lambda x: AllGather.apply(group, x), mesh=MESH, in_specs=P(AXIS),
                         out_specs=(P(AXIS),) * R)(x)
    return fn


def matches_torch(group):
    assert_matches_torch(lambda x: TorchAllGather.apply(group, x), on_ranks(group), (X,))


def matches_torch_to_second_order(group):
    assert_matches_torch(lambda x: TorchAllGather.apply(group, x), on_ranks(group), (X,), check_second_order=True)


def jit_grad_matches_torch(group):
    leaf = torch.tensor(X, requires_grad=True)
    outs = TorchAllGather.apply(group, leaf.clone())
    (want,) = torch.autograd.grad(sum((k + 1.0) * o.sin().sum() for k, o in enumerate(outs)), leaf)
    with enable_x64(True):
        loss = lambda x: sum((k + 1.0) * jnp.sin(o).sum() for k, o in enumerate(on_ranks(group)(x)))  # noqa: E731
        got = jax.jit(jax.grad(loss))(jnp.asarray(X))
    np.testing.assert_allclose(np.asarray(got), want.numpy(), rtol=1e-12)


def from_torch_matches_port(group):
    # The original (ranks simulated) through vjpkit.from_torch, beside the port on R devices, in one program.
    assert_port_matches_original(lambda group, x: on_ranks(group)(x), TorchAllGather, group, X, second_order=True,
                                 atol=1e-12)


def vmap_inside_shard_map_matches_loop(group):
    x = np.random.default_rng(32).standard_normal((R, 2, 3))  # rank, batch, features

    def batched(x):
        return jax.vmap(lambda x: AllGather.apply(group, x), in_axes=1, out_axes=1)(x)

    with enable_x64(True):
        got = shard_map(batched, mesh=MESH, in_specs=P(AXIS), out_specs=(P(AXIS),) * R)(jnp.asarray(x))
        for b in range(x.shape[1]):
            want = on_ranks(group)(jnp.asarray(x[:, b]))
            for g, w in zip(got, want, strict=True):
                np.testing.assert_allclose(np.asarray(g[:, b]), np.asarray(w), rtol=1e-12)


def per_rank_outputs_need_no_opt_out_of_the_varying_check(group):
    if hasattr(jax, "shard_map"):
        checked = jax.shard_map(lambda x: AllGather.apply(group, x), mesh=MESH, in_specs=P(AXIS),
                                out_specs=(P(AXIS),) * R, check_vma=True)
    else:  # JAX before 0.6: the experimental shard_map's replication check
        from jax.experimental.shard_map import shard_map as experimental_shard_map
        checked = experimental_shard_map(lambda x: AllGather.apply(group, x), mesh=MESH, in_specs=P(AXIS),
                                         out_specs=(P(AXIS),) * R, check_rep=True)

    def loss(gather):
        return lambda x: sum((k + 1.0) * jnp.sin(o).sum() for k, o in enumerate(gather(x)))

    with enable_x64(True):
        x = jnp.asarray(X)
        np.testing.assert_allclose(jax.grad(loss(checked))(x), jax.grad(loss(on_ranks(group)))(x), rtol=1e-12)


def own_slot_gradient_is_the_ranks_own_cotangent():
    cts = np.random.default_rng(33).standard_normal((R, R, 3))  # slot j, rank r

    def pull(x, cts):
        _, pullback = jax.vjp(lambda x: OwnSlot.apply(x), x)
        return pullback(tuple(cts))

    with enable_x64(True):
        (gx,) = shard_map(lambda x, c: pull(x, c[:, 0][:, None]), mesh=MESH, in_specs=(P(AXIS), P(None, AXIS)),
                          out_specs=(P(AXIS),))(jnp.asarray(X), jnp.asarray(cts))
    np.testing.assert_allclose(np.asarray(gx), np.stack([cts[r, r] for r in range(R)]), rtol=1e-12)


def main():
    checks = (matches_torch, matches_torch_to_second_order, jit_grad_matches_torch, from_torch_matches_port,
              vmap_inside_shard_map_matches_loop, per_rank_outputs_need_no_opt_out_of_the_varying_check)
    report([("own_slot_gradient_is_the_ranks_own_cotangent", own_slot_gradient_is_the_ranks_own_cotangent)]
           + [(f"{group}/{check.__name__}", functools.partial(check, group))
              for group in ("nccl", "gloo") for check in checks])


if __name__ == "__main__":
    main()
