"""The ``torch.autograd.Function`` originals several test files compare ports with (importable as
``torch_functions``; it needs torch, so import it after ``pytest.importorskip("torch")``)."""

import jax
import torch

# Where from_torch hands torch the arrays: JAX's default device, in torch's words ("cuda" on a GPU). A tensor a
# test's torch code makes itself, or closes over, goes there, as device-portable PyTorch code puts it.
TORCH_DEVICE = {"gpu": "cuda"}.get(jax.devices()[0].platform, jax.devices()[0].platform)


class TorchExp(torch.autograd.Function):
    """The PyTorch tutorial's Exp, as the tutorial writes it (``functions.Exp`` is its port)."""

    @staticmethod
    def forward(ctx, i):
        result = i.exp()
        ctx.save_for_backward(result)
        return result

    @staticmethod
    def backward(ctx, grad_output):
        (result,) = ctx.saved_tensors
        return grad_output * result


class TorchAddOneInPlace(torch.autograd.Function):
    """x + 1 written into x (``mark_dirty``), as PyTorch code does in place."""

    @staticmethod
    def forward(ctx, x):
        ctx.mark_dirty(x)
        return x.add_(1)

    @staticmethod
    def backward(ctx, g):
        return g
