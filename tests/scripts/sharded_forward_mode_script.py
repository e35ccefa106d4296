"""Functions with ``jvp`` inside ``jax.shard_map`` on 4 (host) devices.

Run by `test_forward_mode_sharded.py` in a subprocess, because the device
count is fixed when JAX starts:

    XLA_FLAGS=--xla_force_host_platform_device_count=4 python tests/scripts/sharded_forward_mode_script.py

shard_map checks its types (the default ``check_vma=True``): the input
varies across devices, a parameter is replicated. Prints one JSON object:
for each case, null when vjpkit matched autodiff of the same math in plain
jnp, otherwise the error text.
"""

import functools
import json
import os
import sys
import traceback

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import vjpkit  # noqa: E402


class ScaledSinJvpOnly(vjpkit.Function):
    """sin(x) * w with jvp only: reverse mode transposes the jvp."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_forward(x, w)
        return jnp.sin(x) * w

    @staticmethod
    def jvp(ctx, tx, tw):
        x, w = ctx.saved_tensors
        return jnp.cos(x) * w * tx + jnp.sin(x) * tw


class ScaledSin(ScaledSinJvpOnly):
    """The same with both rules: its jvp, and a backward."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return ScaledSinJvpOnly.forward(ctx, x, w)

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        # w is replicated: this device's share of its gradient, summed by vjpkit.
        return jnp.cos(x) * w * g, jnp.sum(jnp.sin(x) * g)


def scaled_sin(x, w):
    return jnp.sin(x) * w


def close(a, b):
    jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), a, b)


def main():
    assert len(jax.devices()) == 4, jax.devices()
    mesh = jax.make_mesh((4,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    x = jnp.linspace(-2.0, 2.0, 8)
    w = jnp.asarray(1.5)
    tx = jnp.cos(jnp.arange(8.0))
    tw = jnp.asarray(-0.5)

    def sharded(f):
        # x split over the devices (varying), w replicated; check_vma is on by default.
        return jax.shard_map(f, mesh=mesh, in_specs=(P("data"), P()), out_specs=P("data"))

    def loss(f):
        return lambda x, w: jnp.sum(sharded(f)(x, w) ** 2)

    def local_grad(f):
        # grad inside shard_map: the loss is psum'd, the replicated w's gradient too.
        def per_device(x, w):
            return jax.grad(lambda x, w: jax.lax.psum(jnp.sum(f(x, w) ** 2), "data"), argnums=(0, 1))(x, w)

        return jax.shard_map(per_device, mesh=mesh, in_specs=(P("data"), P()), out_specs=(P("data"), P()))

    def local_jvp(f):
        def per_device(x, w, tx, tw):
            return jax.jvp(f, (x, w), (tx, tw))

        return jax.shard_map(
            per_device, mesh=mesh, in_specs=(P("data"), P(), P("data"), P()), out_specs=(P("data"), P("data"))
        )

    transforms = {
        "jvp_of_shard_map": lambda f: jax.jvp(sharded(f), (x, w), (tx, tw)),
        "jit_jvp_of_shard_map": lambda f: jax.jit(lambda *a: jax.jvp(sharded(f), a[:2], a[2:]))(x, w, tx, tw),
        "jvp_inside_shard_map": lambda f: jax.jit(local_jvp(f))(x, w, tx, tw),
        "grad_of_shard_map": lambda f: jax.grad(loss(f), argnums=(0, 1))(x, w),
        "jit_grad_of_shard_map": lambda f: jax.jit(jax.grad(loss(f), argnums=(0, 1)))(x, w),
        "grad_inside_shard_map": lambda f: jax.jit(local_grad(f))(x, w),
        "jacfwd_of_shard_map": lambda f: jax.jacfwd(sharded(f), argnums=(0, 1))(x, w),
    }
    # Plain jnp's result, once per transformation for both classes, under jit:
    # the eager cases would compile each of its ops again (the vjpkit side stays eager).
    expected = functools.cache(lambda name: jax.jit(lambda: transforms[name](scaled_sin))())
    results = {}
    for cls in (ScaledSin, ScaledSinJvpOnly):
        for name, transform in transforms.items():
            case = f"{cls.__name__}:{name}"
            try:
                close(transform(cls.apply), expected(name))
                results[case] = None
            except Exception:  # noqa: BLE001 - reported to the test
                results[case] = traceback.format_exc()
    json.dump(results, sys.stdout)


if __name__ == "__main__":
    main()
