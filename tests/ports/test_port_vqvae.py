"""VQ-VAE's vector quantization: nearest codebook entry, straight-through.

Original: ritheshkumar95/pytorch-vqvae, functions.py (``VectorQuantization``
and ``VectorQuantizationStraightThrough``). Patterns: an integer output
(``mark_non_differentiable``) beside a float one; a Function whose only
output is non-differentiable (its backward raises); a straight-through
estimator for the inputs and ``index_add_`` for the codebook; ``no_grad``
in forward; ``needs_input_grad``.
"""

import jax.numpy as jnp
import numpy as np
import torch
from port_checks import assert_jit_grad_matches_torch, assert_vmap_matches_loop

import vjpkit
from vjpkit.testing import assert_gradcheck, assert_matches_torch

RNG = np.random.default_rng(5)
INPUTS = RNG.standard_normal((2, 3, 4))  # (..., embedding size)
CODEBOOK = RNG.standard_normal((5, 4))  # (codes, embedding size)


class TorchVectorQuantization(torch.autograd.Function):
    @staticmethod
    def forward(ctx, inputs, codebook):
        with torch.no_grad():
            flat = inputs.view(-1, codebook.size(1))
            distances = torch.addmm(
                torch.sum(codebook ** 2, dim=1) + torch.sum(flat ** 2, dim=1, keepdim=True),
                flat, codebook.t(), alpha=-2.0, beta=1.0,
            )
            indices = torch.min(distances, dim=1)[1].view(*inputs.shape[:-1])
            ctx.mark_non_differentiable(indices)
            return indices

    @staticmethod
    def backward(ctx, grad_output):
        raise RuntimeError("VectorQuantization has no gradient; use VectorQuantizationStraightThrough")


class TorchVectorQuantizationStraightThrough(torch.autograd.Function):
    @staticmethod
    def forward(ctx, inputs, codebook):
        indices = TorchVectorQuantization.apply(inputs, codebook).view(-1)
        ctx.save_for_backward(indices, codebook)
        ctx.mark_non_differentiable(indices)
        codes = torch.index_select(codebook, dim=0, index=indices).view_as(inputs)
        return codes, indices

    @staticmethod
    def backward(ctx, grad_output, grad_indices):
        grad_inputs = grad_codebook = None
        if ctx.needs_input_grad[0]:
            grad_inputs = grad_output.clone()  # straight through
        if ctx.needs_input_grad[1]:
            indices, codebook = ctx.saved_tensors
            grad_codebook = torch.zeros_like(codebook)
            grad_codebook.index_add_(0, indices, grad_output.contiguous().view(-1, codebook.size(1)))
        return grad_inputs, grad_codebook


class VectorQuantization(vjpkit.Function):
    @staticmethod
    def forward(ctx, inputs, codebook):
        # torch.no_grad(): nothing to do, forward is never differentiated by autodiff here.
        flat = inputs.reshape(-1, codebook.shape[1])
        distances = jnp.sum(codebook ** 2, axis=1) + jnp.sum(flat ** 2, axis=1, keepdims=True) - 2 * flat @ codebook.T
        indices = jnp.argmin(distances, axis=1).reshape(inputs.shape[:-1])
        ctx.mark_non_differentiable(indices)  # integer: non-differentiable anyway
        return indices

    @staticmethod
    def backward(ctx, grad_output):
        raise RuntimeError("VectorQuantization has no gradient; use VectorQuantizationStraightThrough")


class VectorQuantizationStraightThrough(vjpkit.Function):
    @staticmethod
    def forward(ctx, inputs, codebook):
        indices = VectorQuantization.apply(inputs, codebook).reshape(-1)
        ctx.save_for_backward(indices, codebook)
        ctx.mark_non_differentiable(indices)
        return codebook[indices].reshape(inputs.shape), indices

    @staticmethod
    def backward(ctx, grad_output, grad_indices):
        grad_inputs = grad_codebook = None
        if ctx.needs_input_grad[0]:
            grad_inputs = grad_output
        if ctx.needs_input_grad[1]:
            indices, codebook = ctx.saved_tensors
            flat = grad_output.reshape(-1, codebook.shape[1])
            grad_codebook = jnp.zeros_like(codebook).at[indices].add(flat)  # index_add_
        return grad_inputs, grad_codebook


def test_straight_through_matches_pytorch_to_second_order():
    assert_matches_torch(TorchVectorQuantizationStraightThrough, VectorQuantizationStraightThrough,
                         (INPUTS, CODEBOOK), check_second_order=True)


def test_straight_through_needs_input_grad_paths_match_pytorch():
    for flags in [(True, False), (False, True)]:
        assert_matches_torch(TorchVectorQuantizationStraightThrough, VectorQuantizationStraightThrough,
                             (INPUTS, CODEBOOK), differentiate=flags)


def test_codebook_gradient_gradcheck():
    # The inputs' gradient is straight-through (forward is piecewise constant in them), so
    # gradcheck can only judge the codebook's.
    assert_gradcheck(lambda codebook: VectorQuantizationStraightThrough.apply(INPUTS, codebook)[0], (CODEBOOK,))


def test_straight_through_under_jit_grad_and_vmap():
    assert_jit_grad_matches_torch(TorchVectorQuantizationStraightThrough, VectorQuantizationStraightThrough,
                                  (INPUTS, CODEBOOK), argnums=(0, 1))
    assert_vmap_matches_loop(VectorQuantizationStraightThrough, (INPUTS, CODEBOOK), (0, None), argnums=(0, 1))


def test_vector_quantization_indices_match_pytorch(x64):
    got = VectorQuantization.apply(jnp.asarray(INPUTS), jnp.asarray(CODEBOOK))
    want = TorchVectorQuantization.apply(torch.tensor(INPUTS), torch.tensor(CODEBOOK))
    np.testing.assert_array_equal(np.asarray(got), want.numpy())


def test_vector_quantization_is_differentiated_without_calling_backward():
    assert_matches_torch(TorchVectorQuantization, VectorQuantization, (INPUTS, CODEBOOK))


# ---------------------------------------------------------------------------
# The originals run unported through vjpkit.from_torch, beside their ports
# (tests/ports/test_ports_from_torch.py collects every module's list).

FROM_TORCH_CASES = [
    dict(original=TorchVectorQuantizationStraightThrough, port=VectorQuantizationStraightThrough,
         args=(INPUTS, CODEBOOK), second_order=True, in_axes=(0, None)),
    dict(original=TorchVectorQuantization, port=VectorQuantization, args=(INPUTS, CODEBOOK), argnums=()),
]
