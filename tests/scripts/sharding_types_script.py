"""vjpkit Functions where arrays' types carry their sharding: shard_map and Explicit mesh axes.

Run by `test_sharding_types.py` in a subprocess with 4 host devices:

    XLA_FLAGS=--xla_force_host_platform_device_count=4 python tests/scripts/sharding_types_script.py

Arguments, if any, name cases to leave out (a slow case whose test is
deselected). Prints one JSON object: for each case, null when it passed,
{"skip": reason} when this JAX lacks the feature, otherwise the error text.
Expected values come from JAX's autodiff of the same maths in plain jax.numpy.
"""

import functools
import json
import os
import pathlib
import sys
import traceback

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "examples"))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # tests/, for functions

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from functions import Linear, LinearWithJvp, Mul, fresh  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

# Internals on purpose: which sharding API this JAX has (a version probe no public API gives).
from vjpkit import _jax_internals  # noqa: E402

AxisType = getattr(jax.sharding, "AxisType", None)
# vjpkit's Explicit-axes support needs AxisType, get_abstract_mesh, use_abstract_mesh and reshard (JAX 0.7).
EXPLICIT = AxisType is not None and _jax_internals.sharding_api().use_abstract_mesh is not None
NO_EXPLICIT = "this JAX lacks Explicit mesh axes as vjpkit uses them (AxisType, use_abstract_mesh, reshard: JAX 0.7)"
shard_map = getattr(jax, "shard_map", None)
if shard_map is None:
    # JAX before 0.6: its replication check cannot see through a custom_vjp
    # with symbolic zeros (NotImplementedError), which every Function is.
    from jax.experimental.shard_map import shard_map as _experimental_shard_map

    shard_map = functools.partial(_experimental_shard_map, check_rep=False)
set_mesh = getattr(jax.sharding, "set_mesh", None) or getattr(jax.sharding, "use_mesh", None)


class Skip(Exception):
    pass


# Elementwise ``x * w`` in NumPy; ``w`` broadcasts against ``x``.
HostMul = fresh(Mul, "HostMul", host=True)
HostLinear = fresh(Linear, "HostLinear", host=True, output_shapes=staticmethod(
    lambda x, w: jax.ShapeDtypeStruct((x.shape[0], w.shape[0]), x.dtype)))


def close(got, want):
    jax.tree_util.tree_map(
        lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6), got, want
    )


def same_types(got, inputs):
    """Each gradient has its input's type, sharding included."""
    for g, x in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(inputs), strict=True):
        assert g.sharding.is_equivalent_to(x.sharding, x.ndim), (g.sharding, x.sharding)


def make_mesh(shape, names, types):
    if not EXPLICIT:
        raise Skip(NO_EXPLICIT)
    return jax.make_mesh(shape, names, axis_types=tuple(getattr(AxisType, t) for t in types))


def data(seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(8, 3)).astype(np.float32)
    w = rng.normal(size=(5, 3)).astype(np.float32)
    return x, w


# ---------------------------------------------------------------------------
# Host Functions inside shard_map: gradients equal autodiff's.


def host_mesh():
    if AxisType is None:
        return jax.make_mesh((4,), ("d",))
    return jax.make_mesh((4,), ("d",), axis_types=(AxisType.Auto,))


def host_mul_loss(mul):
    # x varies over "d" (P("d")); w is the same on every device (P()).
    def local(x, w):
        return jax.lax.psum((mul(x, w) ** 2).sum(), "d")

    return local


# Every host case: x (8 entries) split over the 4 devices, w (2) replicated.
HOST_X, HOST_W = np.arange(8.0, dtype=np.float32), np.array([1.0, 2.0], np.float32)


def host_shard_map_gradient(argnum):
    """The gradient of the psum'd loss in shard_map with respect to x (varying, 0) or w (replicated, 1)."""
    mesh = host_mesh()

    def grad(mul):
        f = shard_map(host_mul_loss(mul), mesh=mesh, in_specs=(P("d"), P()), out_specs=P())
        return jax.jit(jax.grad(f, argnums=argnum))

    close(grad(HostMul.apply)(HOST_X, HOST_W), grad(lambda x, w: x * w)(HOST_X, HOST_W))


def host_shard_map_gradient_of_varying_input():
    host_shard_map_gradient(0)


def host_shard_map_gradient_of_replicated_input():
    host_shard_map_gradient(1)


def host_grad_inside_shard_map_sums_replicated_gradient():
    # grad inside shard_map: w's gradient must be summed over devices (out_specs=P()).
    mesh, x, w = host_mesh(), HOST_X, HOST_W

    def grads(mul):
        f = jax.grad(host_mul_loss(mul), argnums=(0, 1))
        return jax.jit(shard_map(f, mesh=mesh, in_specs=(P("d"), P()), out_specs=(P("d"), P())))

    close(grads(HostMul.apply)(x, w), grads(lambda x, w: x * w)(x, w))


def host_shard_map_forward_is_per_device():
    x, w = HOST_X, HOST_W
    f = shard_map(HostMul.apply, mesh=host_mesh(), in_specs=(P("d"), P()), out_specs=P("d"))
    close(jax.jit(f)(x, w), x * np.tile(w, 4))


# ---------------------------------------------------------------------------
# Explicit mesh axes: Functions unchanged, gradients typed as their inputs.


def explicit_inputs(mesh):
    """x sharded over the batch, w replicated."""
    x, w = data()
    return jax.device_put(x, NamedSharding(mesh, P("batch"))), jax.device_put(w, NamedSharding(mesh, P()))


def explicit_batch():
    """The 4 devices as one Explicit batch axis, and the inputs on it."""
    mesh = make_mesh((4,), ("batch",), ("Explicit",))
    return (mesh, *explicit_inputs(mesh))


def linear_loss(linear):
    return lambda x, w: (jnp.tanh(linear(x, w)) ** 2).sum()


def plain_linear(x, w):
    return x @ w.T


def check_gradients(mesh, linear, x, w, transform=jax.jit):
    """``transform`` (jit, or none) of the gradients equals plain JAX's, each typed as its input."""
    with set_mesh(mesh):
        got = transform(jax.grad(linear_loss(linear), argnums=(0, 1)))(x, w)
        want = transform(jax.grad(linear_loss(plain_linear), argnums=(0, 1)))(x, w)
    close(got, want)
    same_types(got, (x, w))


def explicit_backward_contracting_sharded_batch():
    mesh, x, w = explicit_batch()
    check_gradients(mesh, Linear.apply, x, w)


def explicit_backward_without_jit():
    mesh, x, w = explicit_batch()
    check_gradients(mesh, Linear.apply, x, w, transform=lambda f: f)


def explicit_backward_of_forward_mode_function():
    mesh, x, w = explicit_batch()
    check_gradients(mesh, LinearWithJvp.apply, x, w)


def explicit_jvp():
    mesh, x, w = explicit_batch()
    with set_mesh(mesh):
        got = jax.jit(lambda x, w: jax.jvp(LinearWithJvp.apply, (x, w), (x, w)))(x, w)
        want = jax.jit(lambda x, w: jax.jvp(plain_linear, (x, w), (x, w)))(x, w)
    close(got, want)


def explicit_host_function():
    mesh, x, w = explicit_batch()
    check_gradients(mesh, HostLinear.apply, x, w)


def mixed_mesh_explicit_batch_auto_model():
    mesh = make_mesh((2, 2), ("batch", "model"), ("Explicit", "Auto"))
    x, w = explicit_inputs(mesh)
    check_gradients(mesh, Linear.apply, x, w)


def mixed_mesh_auto_batch_explicit_model():
    # The weight's output axis is sharded over the Explicit "model" axis.
    mesh = make_mesh((2, 2), ("batch", "model"), ("Auto", "Explicit"))
    x, w = data()
    x = jax.device_put(x, NamedSharding(mesh, P()))
    w = jax.device_put(np.concatenate([w, w[:3]]), NamedSharding(mesh, P("model")))  # 8 rows: divisible
    check_gradients(mesh, Linear.apply, x, w)


def explicit_forward_ambiguity_names_the_class():
    # x sharded over the batch and w's rows over the same axis: x @ w.T would
    # use "batch" twice; forward is the user's JAX code, so the user decides.
    mesh = make_mesh((4,), ("batch",), ("Explicit",))
    x, w = data()
    x = jax.device_put(x, NamedSharding(mesh, P("batch")))
    w = jax.device_put(np.concatenate([w, w[:3]]), NamedSharding(mesh, P("batch")))
    try:
        with set_mesh(mesh):
            jax.jit(Linear.apply)(x, w)
    except Exception as e:  # noqa: BLE001 - the type is checked below
        assert type(e).__name__ == "ShardingTypeError", type(e)
        message = str(e)
        assert message.startswith("Linear.forward raised ShardingTypeError under a mesh with Explicit axes"), message
        assert "jax.sharding.reshard" in message and "Linear.backward needs none of this" in message, message
    else:
        raise AssertionError("no ShardingTypeError")


def explicit_training_equals_auto():
    from train_multiprocess import fit

    losses = {}
    for axis_type in ("Auto", "Explicit"):
        mesh = make_mesh((4,), ("batch",), (axis_type,))
        with set_mesh(mesh):
            losses[axis_type], _ = fit(mesh, epochs=1, log=lambda line: None)
    assert abs(losses["Explicit"] - losses["Auto"]) <= 1e-6 * abs(losses["Auto"]), losses


CASES = [
    host_shard_map_gradient_of_varying_input,
    host_shard_map_gradient_of_replicated_input,
    host_grad_inside_shard_map_sums_replicated_gradient,
    host_shard_map_forward_is_per_device,
    explicit_backward_contracting_sharded_batch,
    explicit_backward_without_jit,
    explicit_backward_of_forward_mode_function,
    explicit_jvp,
    explicit_host_function,
    mixed_mesh_explicit_batch_auto_model,
    mixed_mesh_auto_batch_explicit_model,
    explicit_forward_ambiguity_names_the_class,
    explicit_training_equals_auto,
]


def main():
    assert len(jax.devices()) == 4, jax.devices()
    left_out = set(sys.argv[1:])  # the slow cases whose tests are deselected
    assert left_out <= {case.__name__ for case in CASES}, left_out
    results = {}
    for case in (case for case in CASES if case.__name__ not in left_out):
        try:
            case()
            results[case.__name__] = None
        except Skip as skip:
            results[case.__name__] = {"skip": str(skip)}
        except Exception:  # noqa: BLE001 - reported to the test
            results[case.__name__] = traceback.format_exc()
    json.dump(results, sys.stdout)


if __name__ == "__main__":
    main()
