"""Arrays not ready yet: a program given one runs asynchronously, on the CPU as on a GPU.

On the CPU, XLA runs a program with host callbacks on the calling thread
once its inputs are ready, so an error raised in a callback reaches the
call itself. On a GPU the call returns first, and the error reaches
whoever awaits the result (``block_until_ready``, reading a value) or
``jax.effects_barrier``. Given an input that is still being computed, the
CPU too returns first: ``f(pending(x))`` holds on the CPU what ``f(x)``
does on a GPU, provided ``f`` is compiled already (call it once before).
"""

import jax
import jax.numpy as jnp
import pytest


@jax.jit
def _busy(x, m):
    # A matrix product (XLA's CPU runtime runs it asynchronously), then x unchanged: 0 * a finite number is 0.
    return x + (0 * (m @ m)[0, 0]).astype(x.dtype)


def pending(x, size=1024):
    """``x``, as an array still being computed (for a tenth of a second or so) when this returns.

    Skips the test where the runtime finished every program before its
    call returned (seen on JAX 0.7 after a program whose callback failed).
    """
    x = jnp.asarray(x)
    while size <= 4096:
        m = jnp.full((size, size), 1e-3, jnp.float32)
        _busy(x, m).block_until_ready()  # compiled before the clock matters
        y = _busy(x, m)
        if not y.is_ready():
            return y
        size *= 2  # a fast machine finished first: more work
    pytest.skip("this JAX lacks asynchronous dispatch here: each CPU program finished before its call returned")
