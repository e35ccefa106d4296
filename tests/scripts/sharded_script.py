"""Sharded runs of vjpkit Functions on 8 (host) devices, against one device.

Run by `test_sharded.py` in a subprocess, because the device count is fixed
when JAX starts:

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python tests/scripts/sharded_script.py

Prints one JSON object: for each case, null when the sharded result matched
the single-device one, otherwise the error text.
"""

import functools
import json
import os
import pathlib
import sys
import traceback

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # tests/, for functions

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from functions import LinearFunction, Tanh  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P

import vjpkit  # noqa: E402

REPLICATION_CHECKED = hasattr(jax, "shard_map")
if REPLICATION_CHECKED:
    shard_map = jax.shard_map
else:
    # JAX before 0.6: jax.experimental.shard_map, whose replication check has
    # no rule for the primitives a Function's derivative binds, so it is off.
    from jax.experimental.shard_map import shard_map as _experimental_shard_map  # noqa: E402

    shard_map = functools.partial(_experimental_shard_map, check_rep=False)


def model(params, x):
    return Tanh.apply(LinearFunction.apply(x, params["w"], params["b"]))


def loss(params, x, y):
    return ((model(params, x) - y) ** 2).mean()


def plain_loss(params, x, y):
    return ((jnp.tanh(x @ params["w"].T + params["b"]) - y) ** 2).mean()


def close(a, b):
    jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), a, b)


def main():
    assert len(jax.devices()) == 8, jax.devices()
    rng = np.random.default_rng(0)
    params = {
        "w": jnp.asarray(rng.normal(size=(4, 3)), jnp.float32),
        "b": jnp.asarray(rng.normal(size=(4,)), jnp.float32),
    }
    x = jnp.asarray(rng.normal(size=(16, 3)), jnp.float32)
    y = jnp.asarray(rng.normal(size=(16, 4)), jnp.float32)

    mesh = Mesh(np.array(jax.devices()[:8]), ("data",))  # Auto axes: Mesh's default
    batch = NamedSharding(mesh, P("data"))
    replicated = NamedSharding(mesh, P())
    xs, ys = jax.device_put(x, batch), jax.device_put(y, batch)
    ps = jax.device_put(params, replicated)

    # Single-device references: vjpkit itself, and the plain math (jitted:
    # op by op, each of its operations would compile a program of its own).
    single_out = jax.jit(model)(params, x)
    single_grad = jax.jit(jax.grad(loss))(params, x, y)
    plain_grads = jax.jit(jax.grad(plain_loss, argnums=(0, 1)))(params, x, y)
    close(single_grad, plain_grads[0])

    def sharded_jit_forward():
        out = jax.jit(model)(ps, xs)
        close(out, single_out)
        assert out.sharding.is_equivalent_to(batch, out.ndim), out.sharding

    def sharded_jit_grad():
        grads = jax.jit(jax.grad(loss))(ps, xs, ys)
        close(grads, single_grad)

    def sharded_jit_train_step():
        @jax.jit
        def step(params, x, y):
            value, grads = jax.value_and_grad(loss)(params, x, y)
            return value, jax.tree_util.tree_map(lambda p, g: p - 0.1 * g, params, grads)

        close(step(ps, xs, ys), step(params, x, y))

    def sharded_eager_apply():
        # Top-level apply (vjpkit's own jit) on sharded inputs.
        out = Tanh.apply(xs)
        close(out, jnp.tanh(x))
        assert out.sharding.is_equivalent_to(batch, out.ndim), out.sharding

    def per_example_grads_sharded():
        per_example = jax.vmap(jax.grad(loss), in_axes=(None, 0, 0))
        got = jax.jit(per_example)(ps, xs[:, None], ys[:, None])
        close(got, jax.jit(per_example)(params, x[:, None], y[:, None]))

    def shard_map_forward():
        f = shard_map(model, mesh=mesh, in_specs=(P(), P("data")), out_specs=P("data"))
        close(jax.jit(f)(ps, xs), single_out)

    def shard_map_forward_with_replication_checked():
        # Not differentiated, a Function passes shard_map's check of replication (JAX before 0.6: check_rep) or
        # of varying types (0.6 on: check_vma), eagerly and under jit.
        if REPLICATION_CHECKED:
            checked = functools.partial(jax.shard_map, check_vma=True)
        else:
            from jax.experimental.shard_map import shard_map as experimental_shard_map

            checked = functools.partial(experimental_shard_map, check_rep=True)
        f = checked(model, mesh=mesh, in_specs=(P(), P("data")), out_specs=P("data"))
        close(f(ps, xs), single_out)
        close(jax.jit(f)(ps, xs), single_out)

    def shard_map_grad():
        def local_loss(params, x, y):
            # Each device holds 2 of the 16 rows: sum, then mean over all.
            return jax.lax.psum(((model(params, x) - y) ** 2).sum(), "data") / y.size / 8

        def plain_local_loss(params, x, y):
            return jax.lax.psum(((jnp.tanh(x @ params["w"].T + params["b"]) - y) ** 2).sum(), "data") / y.size / 8

        def sharded(loss):
            specs = dict(mesh=mesh, in_specs=(P(), P("data"), P("data")), out_specs=P())
            return jax.jit(shard_map(jax.grad(loss), **specs))

        # Gradients are per-device partial sums over the local rows.
        g = sharded(local_loss)(ps, xs, ys)
        close(g, sharded(plain_local_loss)(ps, xs, ys))  # as JAX's own autodiff
        if REPLICATION_CHECKED:  # without the check JAX leaves them per device
            close(g, single_grad)

    def grad_of_shard_map():
        def sharded_loss(params, x, y):
            f = shard_map(model, mesh=mesh, in_specs=(P(), P("data")), out_specs=P("data"))
            return ((f(params, x) - y) ** 2).mean()

        close(jax.jit(jax.grad(sharded_loss))(ps, xs, ys), single_grad)

    def shard_map_grad_of_sharded_input():
        def sharded_loss(params, x, y):
            f = shard_map(model, mesh=mesh, in_specs=(P(), P("data")), out_specs=P("data"))
            return ((f(params, x) - y) ** 2).mean()

        got = jax.jit(jax.grad(sharded_loss, argnums=(0, 1)))(ps, xs, ys)
        close(got, plain_grads)

    def shard_map_invariant_gradient_for_sharded_input():
        class Shift(vjpkit.Function):
            @staticmethod
            def forward(ctx, x, b):
                return x + b

            @staticmethod
            def backward(ctx, g):
                # Gradient of sum(x + b) w.r.t. x, from no per-device value.
                return jnp.ones(g.shape, g.dtype), None

        def local_loss(x, b):
            return jax.lax.psum(Shift.apply(x, b).sum(), "data")

        f = shard_map(
            jax.grad(local_loss), mesh=mesh, in_specs=(P("data"), P()), out_specs=P("data")
        )
        close(jax.jit(f)(xs, ps["b"][:3]), jnp.ones_like(x))

    cases = [
        sharded_jit_forward,
        sharded_jit_grad,
        sharded_jit_train_step,
        sharded_eager_apply,
        per_example_grads_sharded,
        shard_map_forward,
        shard_map_forward_with_replication_checked,
        shard_map_grad,
        grad_of_shard_map,
        shard_map_grad_of_sharded_input,
        shard_map_invariant_gradient_for_sharded_input,
    ]
    results = {}
    for case in cases:
        try:
            case()
            results[case.__name__] = None
        except Exception:  # noqa: BLE001 - reported to the test
            results[case.__name__] = traceback.format_exc()
    json.dump(results, sys.stdout)


if __name__ == "__main__":
    main()
