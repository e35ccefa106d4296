"""The ``torch.autograd.Function`` originals several test files compare ports with (importable as
``torch_functions``; it needs torch, so import it after ``pytest.importorskip("torch")``)."""

import torch


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
