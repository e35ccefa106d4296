"""PyTorch's own reentrant activation checkpoint: recompute forward inside backward.

Original: pytorch/pytorch, torch/utils/checkpoint.py (``CheckpointFunction``,
what ``torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=True)``
runs), imported from the installed PyTorch rather than copied. Patterns:
autograd inside backward (``torch.enable_grad()``, then
``torch.autograd.backward(outputs, grads)``), parameter gradients delivered
by side effect (the checkpointed module's ``.grad``), RNG state replayed for
the recompute.

The port follows the cookbook's recipe: one ``jax.vjp`` of ``run_function``
in backward does the recompute and the backward pass; the module's
parameters become an explicit pytree input whose gradient backward returns;
``preserve_rng_state`` has nothing to do, because JAX randomness is a key
argument that the recompute sees again. (In JAX itself this Function is
``jax.checkpoint``; the port shows the pattern.)

PyTorch's ``CheckpointFunction`` refuses ``torch.autograd.grad`` (it needs
``.backward()``), so the PyTorch reference here calls ``.backward()`` and
reads ``.grad``, and ``vjpkit.from_torch`` runs it with ``reentrant=True``
(its second derivative is zero in PyTorch: the recompute runs without
``create_graph``).
"""

import jax
import jax.numpy as jnp
import numpy as np
import torch
from torch.utils.checkpoint import CheckpointFunction as TorchCheckpointFunction

import vjpkit
from vjpkit.testing import assert_gradcheck

RNG = np.random.default_rng(26)
X = RNG.standard_normal((4, 3))
PARAMS = {"w1": RNG.standard_normal((3, 5)) * 0.5, "w2": RNG.standard_normal((5, 3)) * 0.5}


class TorchBlock(torch.nn.Module):
    """A residual MLP block whose parameters checkpointing reaches only through ``.grad``."""

    def __init__(self):
        super().__init__()
        self.w1 = torch.nn.Parameter(torch.tensor(PARAMS["w1"]))
        self.w2 = torch.nn.Parameter(torch.tensor(PARAMS["w2"]))

    def forward(self, x):
        return x + torch.tanh(x @ self.w1) @ self.w2


def block(params, x):
    return x + jnp.tanh(x @ params["w1"]) @ params["w2"]


class CheckpointFunction(vjpkit.Function):
    @staticmethod
    def forward(ctx, run_function, preserve_rng_state, *args):
        # preserve_rng_state: no global RNG in JAX; a key among args is seen again by the recompute.
        ctx.run_function = run_function
        ctx.inputs = args  # arrays and pytrees of them travel as residuals: only the inputs are kept
        return run_function(*args)

    @staticmethod
    def backward(ctx, *grads):
        # torch.enable_grad() + run_function + autograd.backward(outputs, grads): one jax.vjp.
        outputs, pullback = jax.vjp(ctx.run_function, *ctx.inputs)
        return (None, None) + pullback(grads if isinstance(outputs, tuple) else grads[0])


def torch_checkpointed_block(x, w1, w2):
    """The original on (x, parameters): PyTorch's CheckpointFunction around a TorchBlock holding w1 and w2,
    so that the gradients its reentrant backward accumulates in the parameters' ``.grad`` are theirs."""
    module = TorchBlock()
    del module.w1, module.w2  # plain tensors in the Parameters' place, as torch.func's functional_call does
    module.w1, module.w2 = w1, w2
    return TorchCheckpointFunction.apply(module, True, x)


def checkpointed_block(x, w1, w2):
    return CheckpointFunction.apply(block, True, {"w1": w1, "w2": w2}, x)


# reentrant=True: PyTorch's CheckpointFunction refuses torch.autograd.grad (it needs .backward()).
FROM_TORCH_CASES = [dict(original=torch_checkpointed_block, from_torch=dict(reentrant=True), port=checkpointed_block,
                         args=(X, PARAMS["w1"], PARAMS["w2"]), in_axes=(0, None, None),
                         vmap_args=(X[:, None, :], PARAMS["w1"], PARAMS["w2"]))]


def torch_checkpoint_grads(module, x):
    """Gradients of sum(sin(checkpoint(module, x))) by ``.backward()``, as PyTorch code gets them."""
    x = torch.tensor(x, requires_grad=True)
    torch.sin(TorchCheckpointFunction.apply(module, True, x)).sum().backward()
    return x.grad.numpy(), {name: p.grad.numpy() for name, p in module.named_parameters()}


def test_checkpoint_returns_the_parameter_gradients_pytorch_accumulates_in_grad(x64):
    torch_gx, torch_gparams = torch_checkpoint_grads(TorchBlock().double(), X)
    loss = lambda params, x: jnp.sin(CheckpointFunction.apply(block, True, params, x)).sum()  # noqa: E731
    gparams, gx = jax.jit(jax.grad(loss, argnums=(0, 1)))(jax.tree.map(jnp.asarray, PARAMS), jnp.asarray(X))
    np.testing.assert_allclose(gx, torch_gx, rtol=1e-10)
    for name in PARAMS:
        np.testing.assert_allclose(gparams[name], torch_gparams[name], rtol=1e-10)


def test_checkpoint_saves_only_the_inputs():
    params, x = jax.tree.map(jnp.asarray, PARAMS), jnp.asarray(X)
    _, pullback = jax.vjp(lambda p, x: CheckpointFunction.apply(block, True, p, x), params, x)
    shapes = sorted(leaf.shape for leaf in jax.tree.leaves(pullback))  # the pullback's residuals
    assert (4, 5) not in shapes  # the hidden activation tanh(x @ w1) is recomputed, not kept


def test_checkpoint_of_a_two_output_function_matches_autodiff():
    def two(x):
        return jnp.sin(x), x * x

    def loss(x, checkpointed):
        a, b = CheckpointFunction.apply(two, False, x) if checkpointed else two(x)
        return (a * b).sum()

    x = jnp.asarray(X[0])
    np.testing.assert_allclose(jax.grad(loss)(x, True), jax.grad(loss)(x, False), rtol=1e-6)


def test_checkpoint_gradcheck_and_vmap():
    params = jax.tree.map(jnp.asarray, PARAMS)
    assert_gradcheck(lambda x: CheckpointFunction.apply(block, False, params, x), (X,))
    per_row = jax.vmap(jax.grad(lambda x: CheckpointFunction.apply(block, False, params, x).sum()))(X[:, None, :])
    loop = [jax.grad(lambda x: block(params, x).sum())(X[b:b + 1]) for b in range(len(X))]
    np.testing.assert_allclose(per_row, np.stack(loop), rtol=1e-5)


def test_checkpoint_second_derivative_matches_plain_autodiff(x64):
    v = RNG.standard_normal(X.shape)

    def hvp(run):
        loss = lambda params, x: jnp.sin(run(params, x)).sum()  # noqa: E731
        return jax.jit(jax.grad(lambda params, x: jnp.vdot(jax.grad(loss, argnums=1)(params, x), v), argnums=(0, 1)))

    params, x = jax.tree.map(jnp.asarray, PARAMS), jnp.asarray(X)
    got = hvp(lambda params, x: CheckpointFunction.apply(block, False, params, x))(params, x)
    want = hvp(block)(params, x)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-12)
