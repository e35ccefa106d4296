"""Functions that save less than autodiff: cross-entropy over a large vocabulary.

    python examples/memory.py

The output head of a language model turns hidden states ``h`` (tokens, d)
into logits over the vocabulary with a weight ``w`` (vocab, d), then takes
their softmax cross-entropy. Autodiff of that maths keeps the (tokens, vocab)
softmax alive from the forward pass to the backward pass, next to the logits.
Two vjpkit Functions do better:

* ``SoftmaxCrossEntropy`` (layers.py) saves one log-sum-exp per token and
  rebuilds the softmax inside backward, where XLA fuses it into the gradient:
  the logits stay, the softmax goes.
* ``LinearCrossEntropy`` (below) also takes the projection in: it walks the
  vocabulary in chunks, in forward to build the log-sum-exp and again in
  backward to recompute each chunk's logits, so no (tokens, vocab) array
  ever exists.

This file compiles the gradient of each and compares the temporary memory
XLA plans for it (``memory_analysis().temp_size_in_bytes``); nothing large
is executed.
"""

import argparse

import jax
import jax.numpy as jnp
import numpy as np
from layers import softmax_cross_entropy

import vjpkit


class LinearCrossEntropy(vjpkit.Function):
    """Mean cross-entropy of ``h @ w.T`` against ``labels``, ``chunk`` vocabulary rows at a time.

    ``chunk`` is a Python int, so it is static: part of the compile-cache key,
    and its gradient slot is ``None``.
    """

    @staticmethod
    def forward(ctx, h, w, labels, chunk=4096):
        vocab, d_model = w.shape
        if vocab % chunk:
            raise ValueError(f"vocabulary size {vocab} is not a multiple of chunk={chunk}")
        w_chunks = w.reshape(vocab // chunk, chunk, d_model)
        starts = jnp.arange(0, vocab, chunk)

        def add_chunk(carry, xs):
            lse, picked = carry
            start, w_chunk = xs
            logits = h @ w_chunk.T
            lse = jnp.logaddexp(lse, jax.nn.logsumexp(logits, axis=-1))
            local = labels - start
            here = (local >= 0) & (local < chunk)
            label_logit = jnp.take_along_axis(logits, jnp.clip(local, 0, chunk - 1)[:, None], axis=-1)[:, 0]
            return (lse, picked + jnp.where(here, label_logit, 0.0)), None

        tokens = h.shape[0]
        init = (jnp.full(tokens, -jnp.inf, h.dtype), jnp.zeros(tokens, h.dtype))
        (lse, picked), _ = jax.lax.scan(add_chunk, init, (starts, w_chunks))
        ctx.save_for_backward(h, w, labels, lse)
        ctx.chunk = chunk
        return jnp.mean(lse - picked)

    @staticmethod
    def backward(ctx, g):
        h, w, labels, lse = ctx.saved_tensors
        chunk = ctx.chunk
        vocab, d_model = w.shape
        scale = g / h.shape[0]

        def chunk_grads(grad_h, xs):
            start, w_chunk = xs
            probs = jnp.exp(h @ w_chunk.T - lse[:, None])
            grad_logits = (probs - jax.nn.one_hot(labels - start, chunk, dtype=h.dtype)) * scale
            return grad_h + grad_logits @ w_chunk, grad_logits.T @ h

        xs = (jnp.arange(0, vocab, chunk), w.reshape(vocab // chunk, chunk, d_model))
        grad_h, grad_w = jax.lax.scan(chunk_grads, jnp.zeros_like(h), xs)
        return grad_h, grad_w.reshape(vocab, d_model), None, None


def plain_cross_entropy(logits, labels):
    """The same maths as ``SoftmaxCrossEntropy.forward``, left to autodiff."""
    lse = jax.nn.logsumexp(logits, axis=-1)
    picked = jnp.take_along_axis(logits, labels[:, None], axis=-1)[:, 0]
    return jnp.mean(lse - picked)


def head_loss(loss_fn):
    """The output head: project hidden states to the vocabulary, then ``loss_fn``."""

    def loss(h, w, labels):
        return loss_fn(h @ w.T, labels)

    return loss


HEADS = {
    "plain autodiff": head_loss(plain_cross_entropy),
    "SoftmaxCrossEntropy": head_loss(softmax_cross_entropy),
    "LinearCrossEntropy": LinearCrossEntropy.apply,
}


def gradient_temp_bytes(loss, *args):
    """Temporary bytes XLA allocates for the jitted gradient (inputs and outputs excluded)."""
    grad = jax.jit(jax.grad(loss, argnums=(0, 1)))
    return grad.lower(*args).compile().memory_analysis().temp_size_in_bytes


def measure(tokens=2048, d_model=512, vocab=32768):
    """Temporary bytes of each head's gradient, keyed like ``HEADS``."""
    # ShapeDtypeStructs: lowering needs shapes only, so nothing is allocated.
    h = jax.ShapeDtypeStruct((tokens, d_model), jnp.float32)
    w = jax.ShapeDtypeStruct((vocab, d_model), jnp.float32)
    labels = jax.ShapeDtypeStruct((tokens,), jnp.int32)
    return {name: gradient_temp_bytes(loss, h, w, labels) for name, loss in HEADS.items()}


def check_same_gradients(seed=0):
    """All three heads give the same loss gradients, on a size small enough to run."""
    rng = np.random.default_rng(seed)
    h = jnp.asarray(rng.normal(size=(64, 16)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(8192, 16)), jnp.float32)
    labels = jnp.asarray(rng.integers(0, 8192, size=64), jnp.int32)
    expected = jax.grad(HEADS["plain autodiff"], argnums=(0, 1))(h, w, labels)
    for loss in HEADS.values():
        for got, want in zip(jax.grad(loss, argnums=(0, 1))(h, w, labels), expected, strict=True):
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=32768)
    args = parser.parse_args()

    check_same_gradients()
    temp = measure(args.tokens, args.d_model, args.vocab)
    mib = 2**20
    plain = temp["plain autodiff"]
    print(f"gradient of the output head: {args.tokens} tokens, d_model {args.d_model}, "
          f"vocabulary {args.vocab} (float32 logits: {args.tokens * args.vocab * 4 / mib:.0f} MiB)")
    print(f"  {'loss':<22}{'temporary memory':>18}{'vs autodiff':>13}")
    for name, size in temp.items():
        print(f"  {name:<22}{size / mib:>14.1f} MiB{size / plain:>13.2f}")


if __name__ == "__main__":
    main()
