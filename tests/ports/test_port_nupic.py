"""nupic.torch's k-winners: keep each row's k largest boosted activations.

Original: numenta/nupic.torch, nupic/torch/functions/k_winners.py
(``KWinners``). Patterns: top-k (``topk``, ``scatter_``, ``gather``),
``x.detach()`` in forward, a tensor input that is never differentiated
(duty cycles), static options (k, boost strength).
"""

import jax
import jax.numpy as jnp
import numpy as np
import torch
from port_checks import assert_jit_grad_matches_torch, assert_vmap_matches_loop

import vjpkit
from vjpkit.testing import assert_gradcheck, assert_gradgradcheck, assert_matches_torch

RNG = np.random.default_rng(6)
X = RNG.standard_normal((4, 7))
DUTY_CYCLES = RNG.uniform(0, 0.5, (1, 7))


class TorchKWinners(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, duty_cycles, k, boost_strength):
        if boost_strength > 0.0:
            target_density = float(k) / x.size(1)
            boosted = x.detach() * torch.exp((target_density - duty_cycles) * boost_strength)
        else:
            boosted = x.detach()
        res = torch.zeros_like(x)
        _, indices = boosted.topk(k, dim=1, sorted=False)
        res.scatter_(1, indices, x.gather(1, indices))
        ctx.save_for_backward(indices)
        return res

    @staticmethod
    def backward(ctx, grad_output):
        (indices,) = ctx.saved_tensors
        grad_x = torch.zeros_like(grad_output, requires_grad=False)
        grad_x.scatter_(1, indices, grad_output.gather(1, indices))
        return grad_x, None, None, None


def _scatter_last(like, indices, values):
    """``torch.zeros_like(like).scatter_(-1, indices, values)`` for unique indices per row."""
    return jnp.put_along_axis(jnp.zeros_like(like), indices, values, axis=-1, inplace=False)


class KWinners(vjpkit.Function):
    @staticmethod
    def forward(ctx, x, duty_cycles, k, boost_strength):
        boosted = jax.lax.stop_gradient(x)  # x.detach(): not needed in forward, harmless
        if boost_strength > 0.0:  # a static Python float: an ordinary `if`
            target_density = float(k) / x.shape[-1]  # the last axis, so vmap can add leading ones
            boosted = boosted * jnp.exp((target_density - duty_cycles) * boost_strength)
        _, indices = jax.lax.top_k(boosted, k)  # topk(k, dim=-1)
        ctx.save_for_backward(indices)
        return _scatter_last(x, indices, jnp.take_along_axis(x, indices, axis=-1))

    @staticmethod
    def backward(ctx, grad_output):
        (indices,) = ctx.saved_tensors
        return _scatter_last(grad_output, indices, jnp.take_along_axis(grad_output, indices, axis=-1)), None, None, None


def test_k_winners_matches_pytorch_to_second_order():
    for boost in (0.0, 1.5):
        assert_matches_torch(TorchKWinners, KWinners, (X, DUTY_CYCLES, 3, boost),
                             differentiate=(True, False, False, False), check_second_order=True)


def test_k_winners_duty_cycles_get_no_gradient_in_both():
    assert_matches_torch(TorchKWinners, KWinners, (X, DUTY_CYCLES, 3, 1.5))


def test_k_winners_gradcheck():
    assert_gradcheck(lambda x: KWinners.apply(x, DUTY_CYCLES, 3, 1.5), (X,))
    assert_gradgradcheck(lambda x: KWinners.apply(x, DUTY_CYCLES, 3, 1.5), (X,))


def test_k_winners_under_jit_grad_and_vmap():
    assert_jit_grad_matches_torch(TorchKWinners, KWinners, (X, DUTY_CYCLES, 3, 1.5))
    assert_vmap_matches_loop(KWinners, (X[:, None, :], DUTY_CYCLES, 3, 1.5), (0, None, None, None))


# ---------------------------------------------------------------------------
# The originals run unported through vjpkit.from_torch, beside their ports
# (tests/ports/test_ports_from_torch.py collects every module's list).

FROM_TORCH_CASES = [
    dict(original=TorchKWinners, port=KWinners, args=(X, DUTY_CYCLES, 3, 1.5), argnums=(0,), second_order=True,
         vmap_args=(X[:, None, :], DUTY_CYCLES, 3, 1.5), in_axes=(0, None, None, None)),
]
