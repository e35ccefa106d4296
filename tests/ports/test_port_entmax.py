"""entmax: sparsemax and 1.5-entmax by sorting, and alpha-entmax by bisection.

Original: deep-spin/entmax, entmax/activations.py (``SparsemaxFunction``,
``Entmax15Function`` and their ``_*_threshold_and_support`` helpers) and
entmax/root_finding.py (``EntmaxBisectFunction``, ``SparsemaxBisectFunction``).
Patterns: sorting and thresholding (``sort``, ``topk``, ``gather`` with a
support size, ``if torch.any(unsolved)`` recomputing some rows), classmethod
Functions and subclassing, an iterative forward (50 bisection steps) with an
implicit backward that uses the saved output, a learned ``alpha`` input.
"""

import jax
import jax.numpy as jnp
import numpy as np
import torch
from port_checks import assert_jit_grad_matches_torch, assert_vmap_matches_loop

import vjpkit
from vjpkit.testing import assert_gradcheck, assert_gradgradcheck, assert_matches_torch

RNG = np.random.default_rng(4)
X = RNG.standard_normal((3, 6))
MID = X * 0.5  # sparsemax supports of 2, 4 and 2 of 6 entries
DENSE = RNG.standard_normal((3, 5)) * 0.1  # every entry in the support: Y ** 0.5 is smooth there
ALPHA = np.array([[1.3], [1.5], [1.8]])


# ---------------------------------------------------------------------------
# The PyTorch originals.


def _torch_positions(x, dim):
    """1, 2, ..., n along ``dim``, broadcastable against ``x``."""
    shape = [1] * x.dim()
    shape[dim] = x.shape[dim]
    return torch.arange(1, x.shape[dim] + 1, device=x.device, dtype=x.dtype).view(shape)


def _torch_sparsemax_threshold(x, dim, k):
    if k is None or k >= x.shape[dim]:
        top, _ = torch.sort(x, dim=dim, descending=True)
    else:
        top, _ = torch.topk(x, k=k, dim=dim)
    cumsum = top.cumsum(dim) - 1
    support = _torch_positions(top, dim) * top > cumsum
    size = support.sum(dim=dim).unsqueeze(dim)
    tau = cumsum.gather(dim, size - 1) / size.to(x.dtype)
    if k is not None and k < x.shape[dim]:
        unsolved = (size == k).squeeze(dim)
        if torch.any(unsolved):  # the k largest were all in the support: look at 2k
            rows = x.transpose(dim, -1)[unsolved]
            tau_, size_ = _torch_sparsemax_threshold(rows, -1, 2 * k)
            tau.transpose(dim, -1)[unsolved] = tau_
            size.transpose(dim, -1)[unsolved] = size_
    return tau, size


class TorchSparsemaxFunction(torch.autograd.Function):
    @classmethod
    def forward(cls, ctx, X, dim=-1, k=None):
        ctx.dim = dim
        X = X - X.max(dim=dim, keepdim=True)[0]
        tau, size = _torch_sparsemax_threshold(X, dim, k)
        output = torch.clamp(X - tau, min=0)
        ctx.save_for_backward(size, output)
        return output

    @classmethod
    def backward(cls, ctx, grad_output):
        size, output = ctx.saved_tensors
        grad_input = grad_output.clone()
        grad_input[output == 0] = 0
        v_hat = (grad_input.sum(dim=ctx.dim) / size.to(output.dtype).squeeze(ctx.dim)).unsqueeze(ctx.dim)
        return torch.where(output != 0, grad_input - v_hat, grad_input), None, None


def _torch_entmax15_threshold(x, dim):
    top, _ = torch.sort(x, dim=dim, descending=True)
    rho = _torch_positions(top, dim)
    mean = top.cumsum(dim) / rho
    mean_sq = (top ** 2).cumsum(dim) / rho
    delta = (1 - rho * (mean_sq - mean ** 2)) / rho
    tau = mean - torch.sqrt(torch.clamp(delta, 0))
    size = (tau <= top).sum(dim).unsqueeze(dim)
    return tau.gather(dim, size - 1)


class TorchEntmax15Function(torch.autograd.Function):
    @classmethod
    def forward(cls, ctx, X, dim=0):
        ctx.dim = dim
        X = (X - X.max(dim=dim, keepdim=True)[0]) / 2
        Y = torch.clamp(X - _torch_entmax15_threshold(X, dim), min=0) ** 2
        ctx.save_for_backward(Y)
        return Y

    @classmethod
    def backward(cls, ctx, dY):
        (Y,) = ctx.saved_tensors
        gppr = Y.sqrt()
        dX = dY * gppr
        q = (dX.sum(ctx.dim) / gppr.sum(ctx.dim)).unsqueeze(ctx.dim)
        dX -= q * gppr
        return dX, None


class TorchEntmaxBisectFunction(torch.autograd.Function):
    @classmethod
    def _gp(cls, x, alpha):
        return x ** (alpha - 1)

    @classmethod
    def _gp_inv(cls, y, alpha):
        return y ** (1 / (alpha - 1))

    @classmethod
    def _p(cls, X, alpha):
        return cls._gp_inv(torch.clamp(X, min=0), alpha)

    @classmethod
    def forward(cls, ctx, X, alpha=1.5, dim=-1, n_iter=50, ensure_sum_one=True):
        if not isinstance(alpha, torch.Tensor):
            alpha = torch.tensor(alpha, dtype=X.dtype, device=X.device)
        shape = list(X.shape)
        shape[dim] = 1
        alpha = alpha.expand(*shape)
        ctx.alpha, ctx.dim = alpha, dim
        d = X.shape[dim]
        X = X * (alpha - 1)
        max_val = X.max(dim=dim, keepdim=True)[0]
        tau_lo = max_val - cls._gp(1, alpha)
        tau_hi = max_val - cls._gp(1 / d, alpha)
        f_lo = cls._p(X - tau_lo, alpha).sum(dim) - 1
        dm = tau_hi - tau_lo
        for _ in range(n_iter):
            dm /= 2
            tau_m = tau_lo + dm
            p_m = cls._p(X - tau_m, alpha)
            f_m = p_m.sum(dim) - 1
            tau_lo = torch.where((f_m * f_lo >= 0).unsqueeze(dim), tau_m, tau_lo)
        if ensure_sum_one:
            p_m /= p_m.sum(dim=dim).unsqueeze(dim=dim)
        ctx.save_for_backward(p_m)
        return p_m

    @classmethod
    def backward(cls, ctx, dY):
        (Y,) = ctx.saved_tensors
        gppr = torch.where(Y > 0, Y ** (2 - ctx.alpha), Y.new_zeros(1))
        dX = dY * gppr
        q = (dX.sum(ctx.dim) / gppr.sum(ctx.dim)).unsqueeze(ctx.dim)
        dX -= q * gppr
        d_alpha = None
        if ctx.needs_input_grad[1]:
            S = torch.where(Y > 0, Y * torch.log(Y), Y.new_zeros(1))
            ent = S.sum(ctx.dim).unsqueeze(ctx.dim)
            Y_skewed = gppr / gppr.sum(ctx.dim).unsqueeze(ctx.dim)
            d_alpha = dY * (Y - Y_skewed) / ((ctx.alpha - 1) ** 2)
            d_alpha -= dY * (S - Y_skewed * ent) / (ctx.alpha - 1)
            d_alpha = d_alpha.sum(ctx.dim).unsqueeze(ctx.dim)
        return dX, d_alpha, None, None, None


class TorchSparsemaxBisectFunction(TorchEntmaxBisectFunction):
    @classmethod
    def _gp(cls, x, alpha):
        return x

    @classmethod
    def _gp_inv(cls, y, alpha):
        return y

    @classmethod
    def _p(cls, x, alpha):
        return torch.clamp(x, min=0)

    @classmethod
    def forward(cls, ctx, X, dim=-1, n_iter=50, ensure_sum_one=True):
        return super().forward(ctx, X, alpha=2, dim=dim, n_iter=n_iter, ensure_sum_one=ensure_sum_one)

    @classmethod
    def backward(cls, ctx, dY):
        (Y,) = ctx.saved_tensors
        gppr = (Y > 0).to(dtype=dY.dtype)
        dX = dY * gppr
        q = (dX.sum(ctx.dim) / gppr.sum(ctx.dim)).unsqueeze(ctx.dim)
        dX -= q * gppr
        return dX, None, None, None


# ---------------------------------------------------------------------------
# The ports.


def _positions(x, axis):
    shape = [1] * x.ndim
    shape[axis] = x.shape[axis]
    return jnp.arange(1, x.shape[axis] + 1, dtype=x.dtype).reshape(shape)


def _largest(x, axis, k):
    """torch.sort(descending=True) (k=None) or torch.topk(k) along ``axis``."""
    if k is None or k >= x.shape[axis]:
        return -jnp.sort(-x, axis=axis)
    top, _ = jax.lax.top_k(jnp.moveaxis(x, axis, -1), k)  # top_k works on the last axis
    return jnp.moveaxis(top, -1, axis)


def _sparsemax_threshold(x, axis, k):
    top = _largest(x, axis, k)
    cumsum = jnp.cumsum(top, axis) - 1
    support = _positions(top, axis) * top > cumsum
    size = support.sum(axis, keepdims=True)
    tau = jnp.take_along_axis(cumsum, size - 1, axis) / size.astype(x.dtype)
    if k is not None and k < x.shape[axis]:
        # torch recomputes the unsolved rows only (`if torch.any(...)`, boolean indexing): a
        # value-dependent shape. Computing every row with 2k and selecting keeps shapes static.
        tau_2k, size_2k = _sparsemax_threshold(x, axis, 2 * k)
        unsolved = size == k
        tau, size = jnp.where(unsolved, tau_2k, tau), jnp.where(unsolved, size_2k, size)
    return tau, size


class SparsemaxFunction(vjpkit.Function):
    @classmethod
    def forward(cls, ctx, X, dim=-1, k=None):
        ctx.dim = dim
        X = X - X.max(axis=dim, keepdims=True)
        tau, size = _sparsemax_threshold(X, dim, k)
        output = jnp.clip(X - tau, min=0)
        ctx.save_for_backward(size, output)
        return output

    @classmethod
    def backward(cls, ctx, grad_output):
        size, output = ctx.saved_tensors
        grad_input = jnp.where(output == 0, 0, grad_output)
        v_hat = grad_input.sum(axis=ctx.dim, keepdims=True) / size.astype(output.dtype)
        return jnp.where(output != 0, grad_input - v_hat, grad_input), None, None


class Entmax15Function(vjpkit.Function):
    @classmethod
    def forward(cls, ctx, X, dim=0):
        ctx.dim = dim
        X = (X - X.max(axis=dim, keepdims=True)) / 2
        top = _largest(X, dim, None)
        rho = _positions(top, dim)
        mean = jnp.cumsum(top, dim) / rho
        mean_sq = jnp.cumsum(top ** 2, dim) / rho
        delta = (1 - rho * (mean_sq - mean ** 2)) / rho
        tau = mean - jnp.sqrt(jnp.clip(delta, min=0))
        size = (tau <= top).sum(dim, keepdims=True)
        Y = jnp.clip(X - jnp.take_along_axis(tau, size - 1, dim), min=0) ** 2
        ctx.save_for_backward(Y)
        return Y

    @classmethod
    def backward(cls, ctx, dY):
        (Y,) = ctx.saved_tensors
        gppr = jnp.sqrt(Y)
        dX = dY * gppr
        q = dX.sum(ctx.dim, keepdims=True) / gppr.sum(ctx.dim, keepdims=True)
        return dX - q * gppr, None


class EntmaxBisectFunction(vjpkit.Function):
    @classmethod
    def _gp(cls, x, alpha):
        return x ** (alpha - 1)

    @classmethod
    def _gp_inv(cls, y, alpha):
        return y ** (1 / (alpha - 1))

    @classmethod
    def _p(cls, X, alpha):
        return cls._gp_inv(jnp.clip(X, min=0), alpha)

    @classmethod
    def forward(cls, ctx, X, alpha=1.5, dim=-1, n_iter=50, ensure_sum_one=True):
        shape = list(X.shape)
        shape[dim] = 1
        alpha = jnp.broadcast_to(jnp.asarray(alpha, X.dtype), shape)
        ctx.alpha, ctx.dim = alpha, dim
        d = X.shape[dim]
        X = X * (alpha - 1)
        max_val = X.max(axis=dim, keepdims=True)
        tau_lo = max_val - cls._gp(1, alpha)
        tau_hi = max_val - cls._gp(1 / d, alpha)
        f_lo = cls._p(X - tau_lo, alpha).sum(dim) - 1

        def step(_, carry):  # a fori_loop compiles once; a Python loop would unroll n_iter steps
            tau_lo, dm, _ = carry
            dm = dm / 2
            tau_m = tau_lo + dm
            p_m = cls._p(X - tau_m, alpha)
            f_m = p_m.sum(dim) - 1
            return jnp.where(jnp.expand_dims(f_m * f_lo >= 0, dim), tau_m, tau_lo), dm, p_m

        _, _, p_m = jax.lax.fori_loop(0, n_iter, step, (tau_lo, tau_hi - tau_lo, jnp.zeros_like(X)))
        if ensure_sum_one:
            p_m = p_m / p_m.sum(axis=dim, keepdims=True)
        ctx.save_for_backward(p_m)
        return p_m

    @classmethod
    def backward(cls, ctx, dY):
        (Y,) = ctx.saved_tensors
        dim, alpha = ctx.dim, ctx.alpha
        gppr = jnp.where(Y > 0, Y ** (2 - alpha), 0)
        dX = dY * gppr
        q = dX.sum(dim, keepdims=True) / gppr.sum(dim, keepdims=True)
        dX = dX - q * gppr
        d_alpha = None
        if ctx.needs_input_grad[1]:
            S = jnp.where(Y > 0, Y * jnp.log(jnp.where(Y > 0, Y, 1)), 0)
            ent = S.sum(dim, keepdims=True)
            Y_skewed = gppr / gppr.sum(dim, keepdims=True)
            d_alpha = dY * (Y - Y_skewed) / ((alpha - 1) ** 2) - dY * (S - Y_skewed * ent) / (alpha - 1)
            d_alpha = d_alpha.sum(dim, keepdims=True)  # vjpkit sums it down to alpha's shape, as torch does
        return dX, d_alpha, None, None, None


class SparsemaxBisectFunction(EntmaxBisectFunction):
    @classmethod
    def _gp(cls, x, alpha):
        return x

    @classmethod
    def _gp_inv(cls, y, alpha):
        return y

    @classmethod
    def _p(cls, x, alpha):
        return jnp.clip(x, min=0)

    @classmethod
    def forward(cls, ctx, X, dim=-1, n_iter=50, ensure_sum_one=True):
        return super().forward(ctx, X, alpha=2.0, dim=dim, n_iter=n_iter, ensure_sum_one=ensure_sum_one)

    @classmethod
    def backward(cls, ctx, dY):
        (Y,) = ctx.saved_tensors
        gppr = (Y > 0).astype(dY.dtype)
        dX = dY * gppr
        q = dX.sum(ctx.dim, keepdims=True) / gppr.sum(ctx.dim, keepdims=True)
        return dX - q * gppr, None, None, None


# ---------------------------------------------------------------------------
# Sorting: sparsemax and 1.5-entmax.


def test_sparsemax_matches_pytorch_to_second_order():
    assert_matches_torch(TorchSparsemaxFunction, SparsemaxFunction, (MID, -1), check_second_order=True)
    assert_matches_torch(TorchSparsemaxFunction, SparsemaxFunction, (MID.T.copy(), 0))


def test_sparsemax_with_top_k_matches_pytorch_including_unsolved_rows():
    rows = np.stack([X[0] * 0.01, X[1] * 10, X[2]])  # a dense row needs the 2k retry; a sparse one does not
    for k in (2, 3):
        assert_matches_torch(TorchSparsemaxFunction, SparsemaxFunction, (rows, -1, k))


def test_sparsemax_gradcheck():
    assert_gradcheck(SparsemaxFunction.apply, (MID,))
    assert_gradgradcheck(SparsemaxFunction.apply, (MID,))


def test_entmax15_matches_pytorch_to_second_order():
    assert_matches_torch(TorchEntmax15Function, Entmax15Function, (X, -1))
    assert_matches_torch(TorchEntmax15Function, Entmax15Function, (DENSE, 0), check_second_order=True)


def test_entmax15_gradcheck():
    assert_gradcheck(Entmax15Function.apply, (X, -1))
    assert_gradgradcheck(Entmax15Function.apply, (DENSE, -1))


def test_sorting_entmax_under_jit_grad_and_vmap():
    assert_jit_grad_matches_torch(TorchSparsemaxFunction, SparsemaxFunction, (MID, -1))
    assert_vmap_matches_loop(SparsemaxFunction, (MID, -1), (0, None))
    assert_jit_grad_matches_torch(TorchEntmax15Function, Entmax15Function, (X, -1))
    assert_vmap_matches_loop(Entmax15Function, (X, -1), (0, None))


# ---------------------------------------------------------------------------
# Bisection: an iterative forward, an implicit backward using the saved output.


def test_entmax_bisect_matches_pytorch():
    assert_matches_torch(TorchEntmaxBisectFunction, EntmaxBisectFunction, (X, 1.5, -1), atol=1e-7)


def test_entmax_bisect_learned_alpha_matches_pytorch():
    assert_matches_torch(TorchEntmaxBisectFunction, EntmaxBisectFunction, (X, ALPHA, -1), atol=1e-7)
    assert_matches_torch(TorchEntmaxBisectFunction, EntmaxBisectFunction, (X, ALPHA, -1), atol=1e-7,
                         differentiate=(True, False, False))
    assert_matches_torch(TorchEntmaxBisectFunction, EntmaxBisectFunction, (X, ALPHA, -1), atol=1e-7,
                         differentiate=(False, True, False))


def test_entmax_bisect_matches_pytorch_to_second_order():
    assert_matches_torch(TorchEntmaxBisectFunction, EntmaxBisectFunction, (DENSE, 1.5, -1), atol=1e-7,
                         rtol=1e-5, check_second_order=True)


def test_entmax_bisect_gradgradcheck():
    assert_gradgradcheck(lambda x: EntmaxBisectFunction.apply(x, 1.5), (DENSE,))


def test_entmax_bisect_gradcheck():
    assert_gradcheck(lambda x: EntmaxBisectFunction.apply(x, 1.5), (X,))


def test_sparsemax_bisect_matches_pytorch_and_sorting_sparsemax():
    assert_matches_torch(TorchSparsemaxBisectFunction, SparsemaxBisectFunction, (MID,), atol=1e-7)
    assert_matches_torch(TorchSparsemaxFunction, SparsemaxBisectFunction, (MID,), atol=1e-7)


def test_sparsemax_bisect_matches_pytorch_to_second_order():
    assert_matches_torch(TorchSparsemaxBisectFunction, SparsemaxBisectFunction, (MID,), atol=1e-7, rtol=1e-5,
                         check_second_order=True)


def test_bisect_under_jit_grad_and_vmap():
    assert_jit_grad_matches_torch(TorchEntmaxBisectFunction, EntmaxBisectFunction, (X, ALPHA, -1),
                                  argnums=(0, 1), atol=1e-7, rtol=1e-6)
    assert_vmap_matches_loop(EntmaxBisectFunction, (X, ALPHA, -1), (0, 0, None), argnums=(0, 1))


# ---------------------------------------------------------------------------
# The originals run unported through vjpkit.from_torch, beside their ports
# (tests/ports/test_ports_from_torch.py collects every module's list).

FROM_TORCH_CASES = [
    dict(original=TorchSparsemaxFunction, port=SparsemaxFunction, args=(MID, -1), second_order=True,
         in_axes=(0, None)),
    dict(original=TorchSparsemaxFunction, port=SparsemaxFunction, args=(X, -1, 2)),  # top-k with unsolved rows
    dict(original=TorchEntmax15Function, port=Entmax15Function, args=(DENSE, 0), second_order=True),
    dict(original=TorchEntmax15Function, port=Entmax15Function, args=(X, -1), in_axes=(0, None)),
    dict(original=TorchEntmaxBisectFunction, port=EntmaxBisectFunction, args=(X, ALPHA, -1), in_axes=(0, 0, None)),
    dict(original=TorchEntmaxBisectFunction, port=EntmaxBisectFunction, args=(DENSE, 1.5, -1), second_order=True),
    dict(original=TorchSparsemaxBisectFunction, port=SparsemaxBisectFunction, args=(MID,), second_order=True),
]
