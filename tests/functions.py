"""The Functions many test files use, each defined once (importable as ``functions``).

Each class is module-level, so its compiled programs are shared by every test
that calls it. A test that counts traces, keeps records from inside the
rules or sets class attributes needs a class of its own: it calls a
``make_*`` factory, which returns a fresh class each time.

``REFERENCE`` maps each Function to the same math written in plain ``jnp``,
the expected value for it under any transformation.
"""

import jax.numpy as jnp

import vjpkit


class Sin(vjpkit.Function):
    """sin, saving its input; backward only."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return jnp.sin(x)

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g * jnp.cos(x)


class SinWithJvp(Sin):
    """sin with both rules, each from the saved input (backward is Sin's)."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        ctx.save_for_forward(x)
        return jnp.sin(x)

    @staticmethod
    def jvp(ctx, t):
        (x,) = ctx.saved_tensors
        return jnp.cos(x) * t


class SinJvpOnly(vjpkit.Function):
    """sin with jvp only: reverse mode transposes the jvp."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_forward(x)
        return jnp.sin(x)

    @staticmethod
    def jvp(ctx, t):
        (x,) = ctx.saved_tensors
        return jnp.cos(x) * t


class Exp(vjpkit.Function):
    """exp, whose backward reuses the saved output (differentiable twice)."""

    @staticmethod
    def forward(ctx, x):
        y = jnp.exp(x)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, g):
        (y,) = ctx.saved_tensors
        return g * y


class ExpWithJvp(Exp):
    """exp with both rules, each from the saved output (backward is Exp's)."""

    @staticmethod
    def forward(ctx, x):
        y = jnp.exp(x)
        ctx.save_for_backward(y)
        ctx.save_for_forward(y)
        return y

    @staticmethod
    def jvp(ctx, t):
        (y,) = ctx.saved_tensors
        return y * t


def make_mul():
    """A fresh ``Mul`` class, for tests that count its traces or race to compile it."""

    class Mul(vjpkit.Function):
        """Broadcasting product: backward returns output-shaped gradients, summed down by vjpkit."""

        @staticmethod
        def forward(ctx, x, w):
            ctx.save_for_backward(x, w)
            return x * w

        @staticmethod
        def backward(ctx, g):
            x, w = ctx.saved_tensors
            return g * w, g * x

    return Mul


Mul = make_mul()


class Scale(vjpkit.Function):
    """A static scalar (keyword or positional), part of the compile-cache key."""

    @staticmethod
    def forward(ctx, x, c=2.0):
        ctx.c = c
        return c * x

    @staticmethod
    def backward(ctx, g):
        return ctx.c * g, None


def _weighted_sin(x, w):
    return jnp.sin(x) * w, w**2


class WeightedSin(vjpkit.Function):
    """``(sin(x) * w, w ** 2)``, backward only: a vmap over x leaves the second output unbatched."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return _weighted_sin(x, w)

    @staticmethod
    def backward(ctx, g_product, g_square):
        x, w = ctx.saved_tensors
        return g_product * jnp.cos(x) * w, g_product * jnp.sin(x) + 2 * w * g_square


class WeightedSinWithJvp(WeightedSin):
    """WeightedSin with both rules (backward is WeightedSin's)."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        ctx.save_for_forward(x, w)
        return _weighted_sin(x, w)

    @staticmethod
    def jvp(ctx, tx, tw):
        x, w = ctx.saved_tensors
        return jnp.cos(x) * w * tx + jnp.sin(x) * tw, 2 * w * tw


class WeightedSinJvpOnly(vjpkit.Function):
    """WeightedSin with jvp only: reverse mode transposes the jvp."""

    forward = staticmethod(WeightedSinWithJvp.forward)
    jvp = staticmethod(WeightedSinWithJvp.jvp)


REFERENCE = {
    Sin: jnp.sin,
    SinWithJvp: jnp.sin,
    SinJvpOnly: jnp.sin,
    Exp: jnp.exp,
    ExpWithJvp: jnp.exp,
    Mul: lambda x, w: x * w,
    Scale: lambda x, c=2.0: c * x,
    WeightedSin: _weighted_sin,
    WeightedSinWithJvp: _weighted_sin,
    WeightedSinJvpOnly: _weighted_sin,
}

