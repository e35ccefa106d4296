"""RevTorch's reversible sequence: backward reconstructs the inputs from the outputs.

Original: RobinBruegger/RevTorch, revtorch/revtorch.py (``ReversibleBlock``
with its ``backward_pass``, and ``_ReversibleModuleFunction``), the RevNet
block of Gomez et al. that Reformer and xFormers adapted. Patterns: autograd
inside backward (``torch.enable_grad()``, ``gy1.backward(dy2)``, then
``y1.grad``), parameter gradients delivered by side effect (the f and g
blocks' parameters get ``.grad`` inside backward and are no inputs of the
Function), only the output saved (``ctx.y``), per-block random seeds.

The port follows the cookbook's recipe: each ``.backward(dy)`` + ``.grad``
becomes one ``jax.vjp`` pullback, which returns the input's gradient and
the parameters' together; the parameters are an explicit pytree input
whose gradient backward returns. Inputs are reconstructed from the output
(``x2 = y2 - G(y1)``, ``x1 = y1 - F(x2)``), so no activations are saved.

The copy of ``ReversibleBlock`` sets ``fix_random_seed`` and ``random_seeds``
in ``__init__``, as later RevTorch versions do (the stored version reads
them in ``set_random_seed`` without setting them).
"""

import random

import jax
import jax.numpy as jnp
import numpy as np
import torch
import torch.nn as nn

import vjpkit
from vjpkit.testing import assert_gradcheck

MAXINT = 2147483647
RNG = np.random.default_rng(27)
C = 3  # channels of each half
X = RNG.standard_normal((4, 2 * C))
LAYERS = [{name: {"w": RNG.standard_normal((C, C)) * 0.5, "b": RNG.standard_normal(C) * 0.1} for name in "fg"}
          for _ in range(2)]


# --- RevTorch, as published ---------------------------------------------------


class TorchReversibleBlock(nn.Module):
    def __init__(self, f_block, g_block, split_along_dim=1, fix_random_seed=False):
        super(TorchReversibleBlock, self).__init__()
        self.f_block = f_block
        self.g_block = g_block
        self.split_along_dim = split_along_dim
        self.fix_random_seed = fix_random_seed
        self.random_seeds = {}

    def set_random_seed(self, namespace, new=False):
        if not self.fix_random_seed:
            return
        if new:
            self.random_seeds[namespace] = random.randint(0, MAXINT)
        torch.manual_seed(self.random_seeds[namespace])

    def forward(self, x):
        x1, x2 = torch.chunk(x, 2, dim=self.split_along_dim)
        y1, y2 = None, None
        with torch.no_grad():
            self.set_random_seed('f', new=True)
            y1 = x1 + self.f_block(x2)
            self.set_random_seed('g', new=True)
            y2 = x2 + self.g_block(y1)

        return torch.cat([y1, y2], dim=self.split_along_dim)

    def backward_pass(self, y, dy):
        y1, y2 = torch.chunk(y, 2, dim=self.split_along_dim)
        del y
        assert (not y1.requires_grad), "y1 must already be detached"
        assert (not y2.requires_grad), "y2 must already be detached"
        dy1, dy2 = torch.chunk(dy, 2, dim=self.split_along_dim)
        del dy
        assert (not dy1.requires_grad), "dy1 must not require grad"
        assert (not dy2.requires_grad), "dy2 must not require grad"

        y1.requires_grad = True
        y2.requires_grad = True

        with torch.enable_grad():
            self.set_random_seed('g')
            gy1 = self.g_block(y1)
            gy1.backward(dy2)

        with torch.no_grad():
            x2 = y2 - gy1  # Restore first input of forward()
            del y2, gy1
            dx1 = dy1 + y1.grad
            del dy1
            y1.grad = None

        with torch.enable_grad():
            x2.requires_grad = True
            self.set_random_seed('f')
            fx2 = self.f_block(x2)
            fx2.backward(dx1)

        with torch.no_grad():
            x1 = y1 - fx2  # Restore second input of forward()
            del y1, fx2
            dx2 = dy2 + x2.grad
            del dy2
            x2.grad = None

            x = torch.cat([x1, x2.detach()], dim=self.split_along_dim)
            dx = torch.cat([dx1, dx2], dim=self.split_along_dim)

        return x, dx


class TorchReversibleModuleFunction(torch.autograd.function.Function):
    @staticmethod
    def forward(ctx, x, reversible_blocks):
        assert (isinstance(reversible_blocks, nn.ModuleList))
        for block in reversible_blocks:
            assert (isinstance(block, TorchReversibleBlock))
            x = block(x)
        ctx.y = x.detach()
        ctx.reversible_blocks = reversible_blocks
        return x

    @staticmethod
    def backward(ctx, dy):
        y = ctx.y
        del ctx.y
        for i in range(len(ctx.reversible_blocks) - 1, -1, -1):
            y, dy = ctx.reversible_blocks[i].backward_pass(y, dy)
        del ctx.reversible_blocks
        return dy, None


# --- the port -----------------------------------------------------------------


def dense_tanh(params, x):
    """f and g: tanh(x W^T + b), nn.Sequential(nn.Linear(C, C), nn.Tanh()) in PyTorch."""
    return jnp.tanh(x @ params["w"].T + params["b"])


def block_forward(f, g, params, x):
    x1, x2 = jnp.split(x, 2, axis=-1)  # torch.chunk(x, 2, dim=1), from the end so vmap can add axes
    y1 = x1 + f(params["f"], x2)
    y2 = x2 + g(params["g"], y1)
    return jnp.concatenate([y1, y2], axis=-1)


def block_backward_pass(f, g, params, y, dy):
    """The block's input, its gradient and the parameters' gradients, from its output."""
    y1, y2 = jnp.split(y, 2, axis=-1)
    dy1, dy2 = jnp.split(dy, 2, axis=-1)
    gy1, g_pullback = jax.vjp(g, params["g"], y1)  # enable_grad + g_block(y1) + gy1.backward(dy2)
    dg, y1_grad = g_pullback(dy2)
    x2 = y2 - gy1
    dx1 = dy1 + y1_grad
    fx2, f_pullback = jax.vjp(f, params["f"], x2)
    df, x2_grad = f_pullback(dx1)
    x1 = y1 - fx2
    dx2 = dy2 + x2_grad
    return jnp.concatenate([x1, x2], axis=-1), jnp.concatenate([dx1, dx2], axis=-1), {"f": df, "g": dg}


class ReversibleModuleFunction(vjpkit.Function):
    @staticmethod
    def forward(ctx, x, reversible_blocks, params):
        # reversible_blocks: a tuple of (f, g) functions (static); params: one {"f", "g"} pytree per block.
        for (f, g), p in zip(reversible_blocks, params, strict=True):
            x = block_forward(f, g, p, x)
        ctx.y = x  # the output alone: every activation is rebuilt in backward
        ctx.reversible_blocks = reversible_blocks
        ctx.params = params
        return x

    @staticmethod
    def backward(ctx, dy):
        y, param_grads = ctx.y, []
        for (f, g), p in reversed(list(zip(ctx.reversible_blocks, ctx.params, strict=True))):
            y, dy, grads = block_backward_pass(f, g, p, y, dy)
            param_grads.insert(0, grads)
        return dy, None, param_grads


BLOCKS = ((dense_tanh, dense_tanh),) * len(LAYERS)

WEIGHTS = np.stack([[layer[name]["w"] for name in "fg"] for layer in LAYERS])  # (block, f or g, C, C)
BIASES = np.stack([[layer[name]["b"] for name in "fg"] for layer in LAYERS])  # (block, f or g, C)


def torch_reversible_sequence(x, weights, biases):
    """The original on (x, parameters): each nn.Linear holds slices of the arguments, so the gradients
    RevTorch's backward delivers into the layers' ``.grad`` reach the arguments' ``.grad``."""
    def linear_tanh(w, b):
        layer = nn.Linear(C, C)
        del layer.weight, layer.bias  # plain tensors in the Parameters' place, as torch.func's functional_call does
        layer.weight, layer.bias = w, b
        return nn.Sequential(layer, nn.Tanh())

    blocks = nn.ModuleList([TorchReversibleBlock(linear_tanh(w[0], b[0]), linear_tanh(w[1], b[1]))
                            for w, b in zip(weights, biases, strict=True)])
    return TorchReversibleModuleFunction.apply(x, blocks)


def reversible_sequence(x, weights, biases):
    params = [{"f": {"w": w[0], "b": b[0]}, "g": {"w": w[1], "b": b[1]}} for w, b in zip(weights, biases, strict=True)]
    return ReversibleModuleFunction.apply(x, BLOCKS, params)


# The original's backward returns no parameter gradient: from_torch reads what it put into the arguments' .grad.
FROM_TORCH_CASES = [dict(original=torch_reversible_sequence, port=reversible_sequence, args=(X, WEIGHTS, BIASES),
                         in_axes=(0, None, None), vmap_args=(X[:, None, :], WEIGHTS, BIASES))]


def torch_sequence():
    def linear_tanh(p):
        layer = nn.Linear(C, C).double()
        with torch.no_grad():
            layer.weight.copy_(torch.tensor(p["w"]))
            layer.bias.copy_(torch.tensor(p["b"]))
        return nn.Sequential(layer, nn.Tanh())
    return nn.ModuleList([TorchReversibleBlock(linear_tanh(p["f"]), linear_tanh(p["g"])) for p in LAYERS])


def test_reversible_sequence_matches_pytorch_with_parameter_gradients(x64):
    blocks = torch_sequence()
    x = torch.tensor(X, requires_grad=True)
    y = TorchReversibleModuleFunction.apply(x, blocks)
    torch.sin(y).sum().backward()
    params = jax.tree.map(jnp.asarray, LAYERS)
    loss = lambda x, p: jnp.sin(ReversibleModuleFunction.apply(x, BLOCKS, p)).sum()  # noqa: E731
    got_y = ReversibleModuleFunction.apply(jnp.asarray(X), BLOCKS, params)
    gx, gparams = jax.jit(jax.grad(loss, argnums=(0, 1)))(jnp.asarray(X), params)
    np.testing.assert_allclose(got_y, y.detach().numpy(), rtol=1e-12)
    np.testing.assert_allclose(gx, x.grad.numpy(), rtol=1e-10)
    for k, block in enumerate(blocks):
        for name, sub in (("f", block.f_block[0]), ("g", block.g_block[0])):
            np.testing.assert_allclose(gparams[k][name]["w"], sub.weight.grad.numpy(), rtol=1e-10)
            np.testing.assert_allclose(gparams[k][name]["b"], sub.bias.grad.numpy(), rtol=1e-10)


def test_reversible_sequence_gradcheck_with_respect_to_input_and_parameters():
    assert_gradcheck(lambda x, p: ReversibleModuleFunction.apply(x, BLOCKS, p), (X, LAYERS))


def test_reversible_sequence_keeps_no_activation():
    params = jax.tree.map(jnp.asarray, LAYERS)
    _, pullback = jax.vjp(lambda x: ReversibleModuleFunction.apply(x, BLOCKS, params), jnp.asarray(X))
    batch_sized = [leaf for leaf in jax.tree.leaves(pullback) if leaf.shape[:1] == (len(X),)]
    assert [leaf.shape for leaf in batch_sized] == [X.shape]  # the output y, nothing per layer


def test_reversible_sequence_under_vmap():
    params = jax.tree.map(jnp.asarray, LAYERS)

    def grad_one(x):
        return jax.grad(lambda x: jnp.sin(ReversibleModuleFunction.apply(x, BLOCKS, params)).sum())(x)

    def grad_plain(x):
        def plain(x):
            for p in LAYERS:
                x = block_forward(dense_tanh, dense_tanh, jax.tree.map(jnp.asarray, p), x)
            return jnp.sin(x).sum()
        return jax.grad(plain)(x)

    np.testing.assert_allclose(jax.vmap(grad_one)(jnp.asarray(X)), jax.vmap(grad_plain)(jnp.asarray(X)),
                               rtol=1e-5, atol=1e-6)


def test_reversible_sequence_second_derivative_matches_plain_autodiff(x64):
    # backward's pullbacks are JAX code: a Hessian-vector product differentiates them (create_graph for free).
    v = RNG.standard_normal(X.shape)

    def plain(x, params):
        for p in params:
            x = block_forward(dense_tanh, dense_tanh, p, x)
        return x

    def hvp(layer):
        loss = lambda x, p: jnp.sin(layer(x, p)).sum()  # noqa: E731
        return jax.jit(jax.grad(lambda x, p: jnp.vdot(jax.grad(loss)(x, p), v), argnums=(0, 1)))

    params, x = jax.tree.map(jnp.asarray, LAYERS), jnp.asarray(X)
    got = hvp(lambda x, p: ReversibleModuleFunction.apply(x, BLOCKS, p))(x, params)
    want = hvp(plain)(x, params)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-12)
