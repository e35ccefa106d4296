"""A deep equilibrium layer: forward iteration to a fixed point, implicit backward.

Original: the implicit-layers tutorial of Kolter, Duvenaud and Johnson
(implicit-layers-tutorial.org, chapter 4, "Deep Equilibrium Models";
locuslab), ``DEQFixedPoint`` with its ``forward_iteration`` solver. It is
an ``nn.Module`` whose backward is a hook on the output, the DEQ pattern
that later projects wrap in ``torch.autograd.Function``s. Patterns: a loop
that stops on ``.item()`` with ``break``; autograd inside backward
(``autograd.grad(f0, z0, y, retain_graph=True)``, called once per solver
iteration); parameters reached through the module ``f``.

The port follows the cookbook's recipe: ``jax.lax.while_loop`` in forward,
the implicit function theorem in backward (``u = (I - J^T)^{-1} g`` with
``gmres``, whose implicit derivative makes backward differentiable), the
weight an explicit input.
"""

import jax
import jax.numpy as jnp
import numpy as np
import torch
import torch.autograd as autograd
import torch.nn as nn

import vjpkit
from vjpkit.testing import assert_gradcheck

RNG = np.random.default_rng(30)
N = 4
W = RNG.standard_normal((N, N)) * 0.3 / np.sqrt(N)  # a contraction: the fixed point exists and is unique
X = RNG.standard_normal((3, N))
TOL, MAX_ITER = 1e-12, 300


# --- the tutorial's layer -------------------------------------------------------


def forward_iteration(f, x0, max_iter=50, tol=1e-2):
    f0 = f(x0)
    res = []
    for k in range(max_iter):  # noqa: B007 - as published
        x = f0
        f0 = f(x)
        res.append((f0 - x).norm().item() / (1e-5 + f0.norm().item()))
        if (res[-1] < tol):
            break
    return f0, res


class TorchDEQFixedPoint(nn.Module):
    def __init__(self, f, solver, **kwargs):
        super().__init__()
        self.f = f
        self.solver = solver
        self.kwargs = kwargs

    def forward(self, x):
        # compute forward pass and re-engage autograd tape
        with torch.no_grad():
            z, self.forward_res = self.solver(lambda z: self.f(z, x), torch.zeros_like(x), **self.kwargs)
        z = self.f(z, x)

        # set up Jacobian vector product (without additional forward calls)
        z0 = z.clone().detach().requires_grad_()
        f0 = self.f(z0, x)

        def backward_hook(grad):
            g, self.backward_res = self.solver(lambda y: autograd.grad(f0, z0, y, retain_graph=True)[0] + grad,
                                               grad, **self.kwargs)
            return g

        z.register_hook(backward_hook)
        return z


class TorchTanhLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(N, N, bias=False).double()
        with torch.no_grad():
            self.linear.weight.copy_(torch.tensor(W))

    def forward(self, z, x):
        return torch.tanh(self.linear(z) + x)


# --- the port -------------------------------------------------------------------


def tanh_layer(W, x, z):
    return jnp.tanh(z @ W.T + x)


class FixedPoint(vjpkit.Function):
    @staticmethod
    def forward(ctx, f, W, x, tol, max_iter):
        def not_converged(state):
            k, z, residual = state
            return (residual > tol) & (k < max_iter)  # `if res[-1] < tol: break`, traced

        def step(state):
            k, z, _ = state
            z_next = f(W, x, z)
            return k + 1, z_next, jnp.linalg.norm(z_next - z) / (1e-5 + jnp.linalg.norm(z_next))

        _, z, _ = jax.lax.while_loop(not_converged, step, (0, jnp.zeros_like(x), jnp.asarray(jnp.inf, x.dtype)))
        ctx.save_for_backward(W, x, z)
        ctx.f = f
        return z

    @staticmethod
    def backward(ctx, g):
        W, x, z = ctx.saved_tensors
        _, pullback_z = jax.vjp(lambda z: ctx.f(W, x, z), z)  # the tutorial's autograd.grad(f0, z0, y)
        u, _ = jax.scipy.sparse.linalg.gmres(lambda u: u - pullback_z(u)[0], g, tol=1e-12)
        _, pullback_inputs = jax.vjp(lambda W, x: ctx.f(W, x, z), W, x)
        gW, gx = pullback_inputs(u)
        return None, gW, gx, None, None


def deq(W, x):
    return FixedPoint.apply(tanh_layer, W, x, TOL, MAX_ITER)


def unrolled(W, x):
    """The reference: plain iterations, far past convergence, differentiated by JAX through the loop."""
    return jax.lax.fori_loop(0, 100, lambda _, z: tanh_layer(W, x, z), jnp.zeros_like(x))


def torch_deq(W, x):
    """The tutorial's layer, its backward hook and all, as a function of (weight, x): the nn.Linear holds W.

    The layer registers its hook on an output that must require gradients, as it does in PyTorch, where
    the weight is a Parameter and gradients are on: so W requires them here too, and they are on.
    """
    f = TorchTanhLayer()
    del f.linear.weight  # a plain tensor in the Parameter's place, as torch.func's functional_call does
    f.linear.weight = W if W.requires_grad else W.detach().requires_grad_()
    with torch.enable_grad():
        return TorchDEQFixedPoint(f, forward_iteration, tol=TOL, max_iter=MAX_ITER)(x)


# An nn.Module with a backward hook, not a Function: from_torch takes any callable of tensors.
FROM_TORCH_CASES = [dict(original=torch_deq, port=deq, args=(W, X), atol=1e-9, in_axes=(None, 0),
                         vmap_args=(W, X[:, None, :]))]


def test_deq_matches_the_tutorials_layer_with_the_weight_gradient(x64):
    f = TorchTanhLayer()
    x = torch.tensor(X, requires_grad=True)
    z = TorchDEQFixedPoint(f, forward_iteration, tol=TOL, max_iter=MAX_ITER)(x)
    torch.sin(z).sum().backward()
    got_z = deq(jnp.asarray(W), jnp.asarray(X))
    grad = jax.jit(jax.grad(lambda W, x: jnp.sin(deq(W, x)).sum(), argnums=(0, 1)))
    gW, gx = grad(jnp.asarray(W), jnp.asarray(X))
    np.testing.assert_allclose(got_z, z.detach().numpy(), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(gx, x.grad.numpy(), rtol=1e-8, atol=1e-10)
    np.testing.assert_allclose(gW, f.linear.weight.grad.numpy(), rtol=1e-8, atol=1e-10)


def test_deq_second_derivative_matches_the_unrolled_iteration(x64):
    v = RNG.standard_normal(X.shape)
    def hvp(layer, W, x):
        loss = lambda W, x: jnp.sin(layer(W, x)).sum()  # noqa: E731
        return jax.grad(lambda W, x: jnp.vdot(jax.grad(loss, argnums=1)(W, x), v), argnums=(0, 1))(W, x)

    got = jax.jit(lambda W, x: hvp(deq, W, x))(jnp.asarray(W), jnp.asarray(X))
    want = jax.jit(lambda W, x: hvp(unrolled, W, x))(jnp.asarray(W), jnp.asarray(X))
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-8, atol=1e-10)


def test_deq_gradcheck():
    assert_gradcheck(deq, (W, X[0]))


def test_deq_per_example_gradients_under_vmap(x64):
    per_example = jax.vmap(jax.grad(lambda x: jnp.sin(deq(jnp.asarray(W), x)).sum()))(jnp.asarray(X))
    want = jax.vmap(jax.grad(lambda x: jnp.sin(unrolled(jnp.asarray(W), x)).sum()))(jnp.asarray(X))
    np.testing.assert_allclose(per_example, want, rtol=1e-8, atol=1e-10)
