"""Every JAX transformation, alone and composed, against autodiff of the same
math written in plain `jnp`.

The Functions under test save intermediates in forward and use them in
backward, the case PyTorch gets wrong at second order (pytorch#58509: the
saved tanh(x) is treated as a constant, so the second derivative is zero).
"""

import chex
import jax
import jax.numpy as jnp
from functions import LinearFunction as Linear
from functions import (
    SinCos,  # two outputs; backward uses both saved intermediates
    Tanh,  # saves its output for backward
)
from jax import export  # a submodule JAX before 0.5 does not import by itself

X = jnp.array([0.5, -1.0, 2.0])
BATCH = jnp.array([[0.5, -1.0, 2.0], [0.1, 0.2, -0.3], [1.5, -0.5, 0.0], [2.0, 1.0, -2.0]])


def loss(x):
    s, c = SinCos.apply(Tanh.apply(x) * 2)
    return (s * c**2).sum()


def plain_loss(x):
    s, c = jnp.sin(jnp.tanh(x) * 2), jnp.cos(jnp.tanh(x) * 2)
    return (s * c**2).sum()


W = jnp.array([[0.2, -0.4, 0.6], [1.0, 0.5, -0.5]])
B = jnp.array([0.1, -0.3])


def mlp(x, w, b):
    return Tanh.apply(Linear.apply(x, w, b))


def plain_mlp(x, w, b):
    return jnp.tanh(x @ w.T + b)


def close(a, b, **kw):
    chex.assert_trees_all_close(a, b, rtol=kw.get("rtol", 1e-5), atol=kw.get("atol", 1e-6))


# ---------------------------------------------------------------------------
# Each transformation alone


def test_values_match_plain_jnp():
    close(loss(X), plain_loss(X))
    close(mlp(BATCH, W, B), plain_mlp(BATCH, W, B))


def test_jit():
    close(jax.jit(loss)(X), plain_loss(X))


def test_grad():
    close(jax.grad(loss)(X), jax.grad(plain_loss)(X))


def test_grad_with_respect_to_several_inputs():
    argnums = (0, 1, 2)
    got = jax.grad(lambda *a: mlp(*a).sum(), argnums)(BATCH, W, B)
    close(got, jax.grad(lambda *a: plain_mlp(*a).sum(), argnums)(BATCH, W, B))


def test_value_and_grad():
    close(jax.value_and_grad(loss)(X), jax.value_and_grad(plain_loss)(X))


def test_vjp():
    out, vjp = jax.vjp(mlp, BATCH, W, B)
    plain_out, plain_vjp = jax.vjp(plain_mlp, BATCH, W, B)
    ct = jnp.arange(8.0).reshape(4, 2) / 8
    close(out, plain_out)
    close(vjp(ct), plain_vjp(ct))


def test_vjp_of_a_tuple_output_with_one_cotangent_zero():
    (s, c), vjp = jax.vjp(SinCos.apply, X)
    (plain_s, plain_c), plain_vjp = jax.vjp(lambda x: (jnp.sin(x), jnp.cos(x)), X)
    cts = (jnp.zeros(3), jnp.ones(3))
    close((s, c), (plain_s, plain_c))
    close(vjp(cts), plain_vjp(cts))


def test_vmap():
    close(jax.vmap(loss)(BATCH), jax.vmap(plain_loss)(BATCH))


def test_vmap_over_one_argument_only():
    got = jax.vmap(mlp, in_axes=(0, None, None))(BATCH, W, B)
    close(got, plain_mlp(BATCH, W, B))


def test_per_example_gradients_with_vmap_of_grad():
    def example_loss(w, x):
        return (mlp(x[None], w, B) ** 2).sum()

    def plain_example_loss(w, x):
        return (plain_mlp(x[None], w, B) ** 2).sum()

    got = jax.vmap(jax.grad(example_loss), in_axes=(None, 0))(W, BATCH)
    assert got.shape == (4, 2, 3)
    close(got, jax.vmap(jax.grad(plain_example_loss), in_axes=(None, 0))(W, BATCH))


def test_jacrev():
    close(jax.jacrev(Tanh.apply)(X), jax.jacrev(jnp.tanh)(X))
    close(jax.jacrev(mlp, argnums=1)(BATCH, W, B), jax.jacrev(plain_mlp, argnums=1)(BATCH, W, B))


def test_hessian_through_a_backward_that_uses_a_saved_intermediate():
    hessian = jax.hessian(lambda x: Tanh.apply(x).sum())(X)
    expected = jax.hessian(lambda x: jnp.tanh(x).sum())(X)
    # d2/dx2 tanh = -2 tanh (1 - tanh^2); PyTorch gives 0 here (pytorch#58509).
    close(jnp.diag(hessian), -2 * jnp.tanh(X) * (1 - jnp.tanh(X) ** 2))
    close(hessian, expected)


def test_hessian_of_a_composition():
    close(jax.hessian(loss)(X), jax.hessian(plain_loss)(X))


def test_grad_of_grad():
    def second(f):
        return jax.grad(lambda x: jax.grad(lambda x: f(x).sum())(x).sum())

    close(second(Tanh.apply)(X), second(jnp.tanh)(X))


def test_third_derivative():
    def third(f):
        d = lambda f: lambda x: jax.grad(lambda x: f(x).sum())(x)  # noqa: E731
        return d(d(d(f)))

    close(third(Tanh.apply)(X), third(jnp.tanh)(X))


def test_scan_body():
    def step(f):
        def body(h, x):
            h = f(h * 0.5 + x)
            return h, h.sum()

        return body

    def run(f, xs):
        h, ys = jax.lax.scan(step(f), jnp.zeros(3), xs)
        return h.sum() + ys.sum()

    close(run(Tanh.apply, BATCH), run(jnp.tanh, BATCH))
    close(jax.grad(lambda xs: run(Tanh.apply, xs))(BATCH), jax.grad(lambda xs: run(jnp.tanh, xs))(BATCH))


def test_checkpoint():
    got = jax.grad(jax.checkpoint(loss))(X)
    close(got, jax.grad(plain_loss)(X))


def test_checkpoint_with_a_policy_inside_jit():
    policy = jax.checkpoint_policies.nothing_saveable
    got = jax.jit(jax.grad(jax.checkpoint(loss, policy=policy)))(X)
    close(got, jax.grad(plain_loss)(X))


def test_export_with_vjp_order_one():
    exported = export.export(jax.jit(loss))(X)
    blob = exported.serialize(vjp_order=1)
    restored = export.deserialize(blob)
    close(restored.call(X), plain_loss(X))
    close(jax.grad(restored.call)(X), jax.grad(plain_loss)(X))


# ---------------------------------------------------------------------------
# Compositions


def test_jit_of_grad():
    close(jax.jit(jax.grad(loss))(X), jax.grad(plain_loss)(X))


def test_grad_of_jit():
    close(jax.grad(jax.jit(loss))(X), jax.grad(plain_loss)(X))


def test_jit_of_vmap_of_grad():
    got = jax.jit(jax.vmap(jax.grad(loss)))(BATCH)
    close(got, jax.vmap(jax.grad(plain_loss))(BATCH))


def test_vmap_of_hessian():
    close(jax.vmap(jax.hessian(loss))(BATCH[:2]), jax.vmap(jax.hessian(plain_loss))(BATCH[:2]))


def test_jit_of_hessian():
    close(jax.jit(jax.hessian(loss))(X), jax.hessian(plain_loss)(X))


def test_grad_of_vmap():
    got = jax.grad(lambda xs: jax.vmap(loss)(xs).sum())(BATCH)
    close(got, jax.grad(lambda xs: jax.vmap(plain_loss)(xs).sum())(BATCH))


def test_jacrev_of_vmap():
    got = jax.jacrev(jax.vmap(Tanh.apply))(BATCH[:2])
    close(got, jax.jacrev(jax.vmap(jnp.tanh))(BATCH[:2]))


def test_grad_of_scan_inside_jit_with_checkpointed_body():
    def run(f, xs):
        body = jax.checkpoint(lambda h, x: (f(h + x), None))
        h, _ = jax.lax.scan(body, jnp.zeros(3), xs)
        return (h**2).sum()

    got = jax.jit(jax.grad(lambda xs: run(Tanh.apply, xs)))(BATCH)
    close(got, jax.grad(lambda xs: run(jnp.tanh, xs))(BATCH))


def test_hessian_of_scan():
    def run(f, x):
        h, _ = jax.lax.scan(lambda h, _: (f(h) * 1.5, None), x, None, length=3)
        return h.sum()

    close(jax.hessian(lambda x: run(Tanh.apply, x))(X), jax.hessian(lambda x: run(jnp.tanh, x))(X))


def test_training_step_value_and_grad_under_jit():
    def step(f, params, x):
        def objective(params):
            w, b = params
            return (f(x, w, b) ** 2).mean()

        value, (gw, gb) = jax.value_and_grad(objective)(params)
        return value, (params[0] - 0.1 * gw, params[1] - 0.1 * gb)

    got = jax.jit(lambda p, x: step(mlp, p, x))((W, B), BATCH)
    close(got, step(plain_mlp, (W, B), BATCH))
