"""A transformer's custom ops as vjpkit Functions, each beside its PyTorch original.

    python examples/transformer_ops.py     # gradchecks every Function

This is why people write custom autograd Functions: to save memory and time
where autodiff keeps more than the backward pass needs.

* ``CausalAttention``: flash-style attention. Autodiff keeps the (T, T)
  probabilities of every head for the backward pass; this forward keeps q, k,
  v, the output and one log-sum-exp per row, and the backward recomputes the
  probabilities one block of keys at a time (``lax.scan``), so it never holds
  more than a (T, block) slice of them. It has a ``jvp`` too.
  ``causal_attention`` runs it on CPUs; on a GPU it runs ``FlashAttention``
  (pallas_attention.py) instead: the same contract, its forward and backward
  Pallas kernels (Triton), a GPU's scan being many small kernels.
* ``LayerNorm``: saves the mean and reciprocal standard deviation of each row
  (two floats per row) instead of the normalized activations.
* ``GELU`` (tanh approximation, as GPT-2): saves its input only; the
  derivative is rebuilt in backward, fused with the incoming gradient.
* ``SoftmaxCrossEntropy``: saves one log-sum-exp per row, not the softmax.

The PyTorch originals (``torch.autograd.Function`` classes doing the same
maths) come from ``torch_originals()``, which imports torch only when called,
so the model and its training run without torch.
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from pallas_attention import FlashAttention, computes_on_a_gpu

import vjpkit

NEG_INF = -1e30  # finite, so a fully masked block gives exp(...) == 0, never NaN


def _key_blocks(x, block):
    """(..., T, D) -> (T // block, ..., block, D): one slice per key block, for ``lax.scan``."""
    *lead, t, d = x.shape
    return jnp.moveaxis(x.reshape(*lead, t // block, block, d), -3, 0)


def _from_key_blocks(xs):
    """The inverse of ``_key_blocks``."""
    xs = jnp.moveaxis(xs, 0, -3)
    *lead, n, block, d = xs.shape
    return xs.reshape(*lead, n * block, d)


def _block_size(t, block):
    """The key-block size for length ``t``: ``block``, or ``t`` when shorter."""
    block = min(block, t)
    if t % block:
        raise ValueError(f"CausalAttention: sequence length {t} is not a multiple of block={block}; "
                         f"pass a block that divides it")
    return block


def _causal_scores(q, k_block, start, scale):
    """Scaled scores of every query against one key block, masked above the diagonal."""
    s = jnp.einsum("...qd,...kd->...qk", q, k_block) * scale
    rows = jnp.arange(q.shape[-2])[:, None]
    cols = start + jnp.arange(k_block.shape[-2])[None, :]
    return jnp.where(cols <= rows, s, NEG_INF)


class CausalAttention(vjpkit.Function):
    """``softmax(q k^T / sqrt(D) + causal mask) v`` over the last two axes (T, D).

    Leading axes (batch, heads) are batch axes. ``block`` (a Python int,
    static) is how many keys one step of the loops takes; memory for the
    probabilities is O(T * block), not O(T^2).
    """

    @staticmethod
    def forward(ctx, q, k, v, block=128):
        t, d = q.shape[-2:]
        block = _block_size(t, block)
        scale = 1.0 / math.sqrt(d)

        def add_block(carry, xs):
            # Online softmax: rescale what earlier blocks summed to the new running max.
            m, denom, acc = carry
            k_b, v_b, start = xs
            s = _causal_scores(q, k_b, start, scale)
            m_new = jnp.maximum(m, s.max(-1))
            p = jnp.exp(s - m_new[..., None])
            rescale = jnp.exp(m - m_new)
            denom = denom * rescale + p.sum(-1)
            acc = acc * rescale[..., None] + jnp.einsum("...qk,...kd->...qd", p, v_b)
            return (m_new, denom, acc), None

        lead = q.shape[:-1]
        init = (jnp.full(lead, NEG_INF, q.dtype), jnp.zeros(lead, q.dtype), jnp.zeros_like(q))
        starts = jnp.arange(0, t, block)
        (m, denom, acc), _ = lax.scan(add_block, init, (_key_blocks(k, block), _key_blocks(v, block), starts))
        out = acc / denom[..., None]
        lse = m + jnp.log(denom)
        ctx.block = block
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.save_for_forward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, g):
        q, k, v, out, lse = ctx.saved_tensors
        block, scale = ctx.block, 1.0 / math.sqrt(q.shape[-1])
        delta = (g * out).sum(-1)  # rowsum(P * dP), from the output instead of P

        def grad_block(dq, xs):
            k_b, v_b, start = xs
            p = jnp.exp(_causal_scores(q, k_b, start, scale) - lse[..., None])
            dv_b = jnp.einsum("...qk,...qd->...kd", p, g)
            ds = p * (jnp.einsum("...qd,...kd->...qk", g, v_b) - delta[..., None]) * scale
            dq = dq + jnp.einsum("...qk,...kd->...qd", ds, k_b)
            dk_b = jnp.einsum("...qk,...qd->...kd", ds, q)
            return dq, (dk_b, dv_b)

        starts = jnp.arange(0, q.shape[-2], block)
        dq, (dk, dv) = lax.scan(grad_block, jnp.zeros_like(q),
                                (_key_blocks(k, block), _key_blocks(v, block), starts))
        return dq, _from_key_blocks(dk), _from_key_blocks(dv), None

    @staticmethod
    def jvp(ctx, tq, tk, tv, _):
        q, k, v, out, lse = ctx.saved_tensors
        block, scale = ctx.block, 1.0 / math.sqrt(q.shape[-1])
        tq, tk, tv = (jnp.zeros_like(x) if t is None else t for x, t in ((q, tq), (k, tk), (v, tv)))

        # d out = sum_j P_j (dS_j V_j + dV_j) - c * out, with c = rowsum(P * dS) over all blocks.
        def tangent_block(carry, xs):
            acc, c = carry
            k_b, v_b, tk_b, tv_b, start = xs
            p = jnp.exp(_causal_scores(q, k_b, start, scale) - lse[..., None])
            ds = (jnp.einsum("...qd,...kd->...qk", tq, k_b) + jnp.einsum("...qd,...kd->...qk", q, tk_b)) * scale
            pds = p * ds
            acc = acc + jnp.einsum("...qk,...kd->...qd", pds, v_b) + jnp.einsum("...qk,...kd->...qd", p, tv_b)
            return (acc, c + pds.sum(-1)), None

        starts = jnp.arange(0, q.shape[-2], block)
        blocks = tuple(_key_blocks(x, block) for x in (k, v, tk, tv))
        (acc, c), _ = lax.scan(tangent_block, (jnp.zeros_like(q), jnp.zeros(q.shape[:-1], q.dtype)),
                               (*blocks, starts))
        return acc - c[..., None] * out


class LayerNorm(vjpkit.Function):
    """LayerNorm over the last axis with a weight and bias, saving two floats per row."""

    @staticmethod
    def forward(ctx, x, weight, bias, eps=1e-5):
        mean = x.mean(-1)
        rstd = lax.rsqrt(jnp.square(x - mean[..., None]).mean(-1) + eps)
        ctx.save_for_backward(x, weight, mean, rstd)
        return (x - mean[..., None]) * rstd[..., None] * weight + bias

    @staticmethod
    def backward(ctx, g):
        x, weight, mean, rstd = ctx.saved_tensors
        xhat = (x - mean[..., None]) * rstd[..., None]
        rows = tuple(range(x.ndim - 1))
        gxhat = g * weight
        gx = rstd[..., None] * (gxhat - gxhat.mean(-1, keepdims=True)
                                - xhat * (gxhat * xhat).mean(-1, keepdims=True))
        return gx, (g * xhat).sum(rows), g.sum(rows), None


GELU_C = math.sqrt(2.0 / math.pi)


class GELU(vjpkit.Function):
    """GELU, tanh approximation: ``x/2 (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))``."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return 0.5 * x * (1.0 + jnp.tanh(GELU_C * (x + 0.044715 * x**3)))

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        th = jnp.tanh(GELU_C * (x + 0.044715 * x**3))
        dinner = GELU_C * (1.0 + 3 * 0.044715 * x**2)
        return g * (0.5 * (1.0 + th) + 0.5 * x * (1.0 - th * th) * dinner)


class SoftmaxCrossEntropy(vjpkit.Function):
    """Mean cross-entropy of ``logits`` (N, C) against integer ``labels`` (N,); saves one log-sum-exp per row."""

    @staticmethod
    def forward(ctx, logits, labels):
        lse = jax.nn.logsumexp(logits, axis=-1)
        ctx.save_for_backward(logits, labels, lse)
        picked = jnp.take_along_axis(logits, labels[:, None], axis=-1)[:, 0]
        return jnp.mean(lse - picked)

    @staticmethod
    def backward(ctx, g):
        logits, labels, lse = ctx.saved_tensors
        probs = jnp.exp(logits - lse[:, None])
        one_hot = jax.nn.one_hot(labels, logits.shape[-1], dtype=logits.dtype)
        return (probs - one_hot) * (g / logits.shape[0]), None


def use_pallas_kernels():
    """Whether ``causal_attention`` runs the Pallas kernels: where it computes on a GPU (read when traced)."""
    return computes_on_a_gpu()


def causal_attention(q, k, v, block=128):
    """Causal attention: ``FlashAttention``'s Pallas kernels on a GPU, ``CausalAttention``'s ``lax.scan`` elsewhere.

    On a GPU ``block`` caps the kernels' tiles (their tuned sizes are at most 128).
    """
    if use_pallas_kernels():
        return FlashAttention.apply(q, k, v, block, False)  # compiled kernels (interpret=False)
    return CausalAttention.apply(q, k, v, block)


layer_norm = LayerNorm.apply
gelu = GELU.apply
softmax_cross_entropy = SoftmaxCrossEntropy.apply


# The same maths in plain jnp, for JAX's autodiff: the reference in tests and benchmarks.

def plain_causal_attention(q, k, v, block=None):
    t, d = q.shape[-2:]
    s = jnp.einsum("...qd,...kd->...qk", q, k) / math.sqrt(d)
    s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, -jnp.inf)
    return jnp.einsum("...qk,...kd->...qd", jax.nn.softmax(s, axis=-1), v)


def plain_layer_norm(x, weight, bias, eps=1e-5):
    mean = x.mean(-1, keepdims=True)
    var = jnp.square(x - mean).mean(-1, keepdims=True)
    return (x - mean) / jnp.sqrt(var + eps) * weight + bias


def plain_gelu(x):
    return 0.5 * x * (1.0 + jnp.tanh(GELU_C * (x + 0.044715 * x**3)))


def plain_softmax_cross_entropy(logits, labels):
    lse = jax.nn.logsumexp(logits, axis=-1)
    return jnp.mean(lse - jnp.take_along_axis(logits, labels[:, None], axis=-1)[:, 0])


@functools.cache
def torch_originals():
    """The PyTorch ``torch.autograd.Function`` classes these ops were ported from, by name."""
    import torch

    class TorchCausalAttention(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v, block=128):
            t, d = q.shape[-2:]
            block = min(block, t)
            scale = 1.0 / math.sqrt(d)
            rows = torch.arange(t, device=q.device)[:, None]  # on the inputs' device (CUDA on a GPU)
            m = torch.full(q.shape[:-1], NEG_INF, dtype=q.dtype, device=q.device)
            denom = torch.zeros(q.shape[:-1], dtype=q.dtype, device=q.device)
            acc = torch.zeros_like(q)
            for start in range(0, t, block):
                kb, vb = k[..., start:start + block, :], v[..., start:start + block, :]
                s = (q @ kb.transpose(-1, -2)) * scale
                s = s.masked_fill(start + torch.arange(kb.shape[-2], device=q.device)[None, :] > rows, NEG_INF)
                m_new = torch.maximum(m, s.amax(-1))
                p = torch.exp(s - m_new[..., None])
                rescale = torch.exp(m - m_new)
                denom = denom * rescale + p.sum(-1)
                acc = acc * rescale[..., None] + p @ vb
                m = m_new
            out = acc / denom[..., None]
            ctx.block = block
            ctx.save_for_backward(q, k, v, out, m + torch.log(denom))
            return out

        @staticmethod
        def backward(ctx, g):
            q, k, v, out, lse = ctx.saved_tensors
            t, d = q.shape[-2:]
            scale = 1.0 / math.sqrt(d)
            rows = torch.arange(t, device=q.device)[:, None]
            delta = (g * out).sum(-1)
            dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
            for start in range(0, t, ctx.block):
                sl = slice(start, start + ctx.block)
                kb, vb = k[..., sl, :], v[..., sl, :]
                s = (q @ kb.transpose(-1, -2)) * scale
                s = s.masked_fill(start + torch.arange(kb.shape[-2], device=q.device)[None, :] > rows, NEG_INF)
                p = torch.exp(s - lse[..., None])
                dv[..., sl, :] = p.transpose(-1, -2) @ g
                ds = p * (g @ vb.transpose(-1, -2) - delta[..., None]) * scale
                dq += ds @ kb
                dk[..., sl, :] = ds.transpose(-1, -2) @ q
            return dq, dk, dv, None

    class TorchLayerNorm(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, weight, bias, eps=1e-5):
            mean = x.mean(-1)
            rstd = torch.rsqrt((x - mean[..., None]).square().mean(-1) + eps)
            ctx.save_for_backward(x, weight, mean, rstd)
            return (x - mean[..., None]) * rstd[..., None] * weight + bias

        @staticmethod
        def backward(ctx, g):
            x, weight, mean, rstd = ctx.saved_tensors
            xhat = (x - mean[..., None]) * rstd[..., None]
            rows = tuple(range(x.dim() - 1))
            gxhat = g * weight
            gx = rstd[..., None] * (gxhat - gxhat.mean(-1, keepdim=True)
                                    - xhat * (gxhat * xhat).mean(-1, keepdim=True))
            return gx, (g * xhat).sum(rows), g.sum(rows), None

    class TorchGELU(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return 0.5 * x * (1.0 + torch.tanh(GELU_C * (x + 0.044715 * x**3)))

        @staticmethod
        def backward(ctx, g):
            (x,) = ctx.saved_tensors
            th = torch.tanh(GELU_C * (x + 0.044715 * x**3))
            dinner = GELU_C * (1.0 + 3 * 0.044715 * x**2)
            return g * (0.5 * (1.0 + th) + 0.5 * x * (1.0 - th * th) * dinner)

    class TorchSoftmaxCrossEntropy(torch.autograd.Function):
        @staticmethod
        def forward(ctx, logits, labels):
            lse = torch.logsumexp(logits, dim=-1)
            ctx.save_for_backward(logits, labels, lse)
            return (lse - logits.gather(1, labels[:, None])[:, 0]).mean()

        @staticmethod
        def backward(ctx, g):
            logits, labels, lse = ctx.saved_tensors
            grad = torch.exp(logits - lse[:, None])
            grad[torch.arange(len(labels), device=logits.device), labels] -= 1
            return grad * (g / len(labels)), None

    return {
        "CausalAttention": TorchCausalAttention,
        "LayerNorm": TorchLayerNorm,
        "GELU": TorchGELU,
        "SoftmaxCrossEntropy": TorchSoftmaxCrossEntropy,
    }


def gradcheck_ops(seed=0):
    """Checks every op's backward against finite differences, at small float64 shapes; returns their names.

    Attention runs with 2 key blocks of 4 (block=4, T=8) so the loop really loops.
    Raises ``vjpkit.GradcheckError`` naming the op, input and worst element.
    """
    rng = np.random.default_rng(seed)
    q, k, v = (rng.normal(size=(2, 8, 3)) for _ in range(3))
    checks = {
        "CausalAttention": (lambda q, k, v: CausalAttention.apply(q, k, v, 4), (q, k, v)),
        "LayerNorm": (layer_norm, (rng.normal(size=(3, 5)), rng.normal(size=5), rng.normal(size=5))),
        "GELU": (gelu, (rng.normal(size=(3, 4)),)),
        "SoftmaxCrossEntropy": (softmax_cross_entropy, (rng.normal(size=(4, 6)), np.array([0, 5, 2, 1]))),
    }
    for name, (fn, inputs) in checks.items():
        vjpkit.gradcheck(fn, inputs, check_forward_ad=name == "CausalAttention")
    return list(checks)


if __name__ == "__main__":
    for name in gradcheck_ops():
        print(f"gradcheck {name}: ok")
