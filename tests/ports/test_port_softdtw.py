"""Soft-DTW on NumPy: a dynamic program in forward, its adjoint recursion in backward.

Original: Sleepwalking/pytorch-softdtw, soft_dtw.py (``SoftDTW`` with
``compute_softdtw`` and ``compute_softdtw_backward``, Cuturi & Blondel's
soft dynamic time warping, the CPU version that pytorch-softdtw-cuda and
DILATE copied). Patterns: NumPy inside forward and backward
(``D.detach().cpu().numpy()``), a float hyperparameter wrapped in a tensor
and saved (``gamma``), a saved array modified in place by backward.

The original compiles the two loops with ``numba.jit(nopython=True)``; the
copy runs them as plain Python (numba is not a test dependency), with the
same results. It computes in float32 (``torch.FloatTensor``) whatever D's
dtype; the port keeps D's dtype, so the comparison allows float32 error.
"""

import jax
import jax.numpy as jnp
import numpy as np
import torch
from torch.autograd import Function

import vjpkit
from vjpkit.testing import assert_gradcheck, assert_matches_torch

RNG = np.random.default_rng(28)
A, B = RNG.standard_normal((5, 2)), RNG.standard_normal((4, 2))
D = ((A[:, None, :] - B[None, :, :]) ** 2).sum(-1)  # pairwise squared distances, (5, 4)


def compute_softdtw(D, gamma):
    N = D.shape[0]
    M = D.shape[1]
    R = np.zeros((N + 2, M + 2)) + 1e8
    R[0, 0] = 0
    for j in range(1, M + 1):
        for i in range(1, N + 1):
            r0 = -R[i - 1, j - 1] / gamma
            r1 = -R[i - 1, j] / gamma
            r2 = -R[i, j - 1] / gamma
            rmax = max(max(r0, r1), r2)
            rsum = np.exp(r0 - rmax) + np.exp(r1 - rmax) + np.exp(r2 - rmax)
            softmin = - gamma * (np.log(rsum) + rmax)
            R[i, j] = D[i - 1, j - 1] + softmin
    return R


def compute_softdtw_backward(D_, R, gamma):
    N = D_.shape[0]
    M = D_.shape[1]
    D = np.zeros((N + 2, M + 2))
    E = np.zeros((N + 2, M + 2))
    D[1:N + 1, 1:M + 1] = D_
    E[-1, -1] = 1
    R[:, -1] = -1e8
    R[-1, :] = -1e8
    R[-1, -1] = R[-2, -2]
    for j in range(M, 0, -1):
        for i in range(N, 0, -1):
            a = np.exp((R[i + 1, j] - R[i, j] - D[i + 1, j]) / gamma)
            b = np.exp((R[i, j + 1] - R[i, j] - D[i, j + 1]) / gamma)
            c = np.exp((R[i + 1, j + 1] - R[i, j] - D[i + 1, j + 1]) / gamma)
            E[i, j] = E[i + 1, j] * a + E[i, j + 1] * b + E[i + 1, j + 1] * c
    return E[1:N + 1, 1:M + 1]


class TorchSoftDTW(Function):
    @staticmethod
    def forward(ctx, D, gamma=1.0):
        dev = D.device
        gamma = torch.FloatTensor([gamma]).to(dev)
        D_ = D.detach().cpu().numpy()
        g_ = gamma.item()
        R = torch.FloatTensor(compute_softdtw(D_, g_)).to(dev)
        ctx.save_for_backward(D, R, gamma)
        return R[-2, -2]

    @staticmethod
    def backward(ctx, grad_output):
        dev = grad_output.device
        D, R, gamma = ctx.saved_tensors
        D_ = D.detach().cpu().numpy()
        R_ = R.detach().cpu().numpy()
        g_ = gamma.item()
        E = torch.FloatTensor(compute_softdtw_backward(D_, R_, g_)).to(dev)
        return grad_output * E, None


@vjpkit.function(host=True)
class SoftDTW:
    @staticmethod
    def output_shapes(D, gamma=1.0):
        return jax.ShapeDtypeStruct((), D.dtype)  # a scalar, not D's shape

    @staticmethod
    def forward(ctx, D, gamma=1.0):  # D arrives as a read-only NumPy array; gamma as the Python float
        R = compute_softdtw(D, gamma)
        ctx.save_for_backward(D, R)
        ctx.gamma = gamma
        return R[-2, -2]

    @staticmethod
    def backward(ctx, grad_output):
        D, R = ctx.saved_tensors
        # compute_softdtw_backward writes into R: a copy keeps ctx's R as forward left it.
        return grad_output * compute_softdtw_backward(D, R.copy(), ctx.gamma), None


# The original computes in float32 whatever its input (as the port's own check says), so the
# comparison's tolerance is float32's over a 4x4 dynamic program of soft minima.
FROM_TORCH_CASES = [dict(original=TorchSoftDTW, port=SoftDTW, args=(D, 0.5), second_order=False, atol=1e-5)]


def test_soft_dtw_matches_pytorch_to_float32_precision():
    assert_matches_torch(TorchSoftDTW, SoftDTW, (D, 0.5), rtol=1e-5, atol=1e-6)


def alignment_paths(n, m):
    """Every monotone path from (0, 0) to (n - 1, m - 1), as lists of cells."""
    if (n, m) == (1, 1):
        return [[(0, 0)]]
    earlier = [(n - 1, m), (n, m - 1), (n - 1, m - 1)]
    return [path + [(n - 1, m - 1)] for a, b in earlier if a >= 1 and b >= 1 for path in alignment_paths(a, b)]


def test_soft_dtw_is_the_soft_minimum_over_paths_and_its_gradient_the_expected_alignment(x64):
    small, gamma = D[:3, :4], 0.5
    paths = alignment_paths(*small.shape)
    costs = np.array([sum(small[c] for c in path) for path in paths])
    weights = np.exp(-(costs - costs.min()) / gamma)
    weights /= weights.sum()
    expected_alignment = sum(w * np.isin(np.arange(small.size), [i * small.shape[1] + j for i, j in path])
                             .reshape(small.shape) for w, path in zip(weights, paths, strict=True))
    value, grad = jax.jit(jax.value_and_grad(lambda D: SoftDTW.apply(D, gamma)))(jnp.asarray(small))
    np.testing.assert_allclose(value, -gamma * np.log(np.exp(-costs / gamma).sum()), rtol=1e-12)
    np.testing.assert_allclose(grad, expected_alignment, rtol=1e-9, atol=1e-12)


def test_soft_dtw_gradcheck():
    assert_gradcheck(lambda D: SoftDTW.apply(D, 0.5), (D,))


def test_soft_dtw_per_example_gradients_under_vmap(x64):
    batch = np.stack([D, D[::-1], D * 2])
    per_example = jax.vmap(jax.grad(lambda D: SoftDTW.apply(D, 1.0)))(jnp.asarray(batch))
    for b in range(len(batch)):
        np.testing.assert_allclose(per_example[b], jax.grad(lambda D: SoftDTW.apply(D, 1.0))(batch[b]),
                                   rtol=1e-12)
