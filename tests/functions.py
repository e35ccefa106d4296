"""The Functions many test files use, each defined once (importable as ``functions``).

Each class is module-level, so its compiled programs are shared by every test
that calls it. A test that counts traces or compiles, or whose error message
names the class, needs a class of its own: ``fresh(Sin, "Sine")`` returns a
new subclass (own caches, own name) each time, and ``once(Exp, "OnceExp")``
one whose backward is ``@once_differentiable``.

The ``Stopped*`` Functions compute their output under ``stop_gradient``, so
a higher-order derivative can only come from their rules, never from
forward's code.

``REFERENCE`` maps each Function to the same math written in plain ``jnp``,
the expected value for it under any transformation.
"""

import jax
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


class ScaledExp(vjpkit.Function):
    """exp(x) * c with c a static scalar (default 1.0), saving its output."""

    @staticmethod
    def forward(ctx, x, c=1.0):
        y = jnp.exp(x) * c
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, g):
        (y,) = ctx.saved_tensors
        return g * y, None


class StoppedExp(Exp):
    """exp under stop_gradient, saving its output (backward is Exp's)."""

    @staticmethod
    def forward(ctx, x):
        y = jax.lax.stop_gradient(jnp.exp(x))
        ctx.save_for_backward(y)
        return y


class StoppedExpWithJvp(ExpWithJvp):
    """exp under stop_gradient with both rules from the saved output (ExpWithJvp's)."""

    @staticmethod
    def forward(ctx, x):
        y = jax.lax.stop_gradient(jnp.exp(x))
        ctx.save_for_backward(y)
        ctx.save_for_forward(y)
        return y


class Square(vjpkit.Function):
    """x * x, saving its input."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return 2 * x * g


class SquareWithJvp(Square):
    """Square with a jvp too, from the same saved input (backward is Square's)."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        ctx.save_for_forward(x)
        return x * x

    @staticmethod
    def jvp(ctx, t):
        (x,) = ctx.saved_tensors
        return 2 * x * t


class Log(vjpkit.Function):
    """log, saving its input."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return jnp.log(x)

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g / x


class Tanh(vjpkit.Function):
    """tanh, whose backward reuses the saved output."""

    @staticmethod
    def forward(ctx, x):
        y = jnp.tanh(x)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, g):
        (y,) = ctx.saved_tensors
        return g * (1 - y**2)


class TanhSavingAStoppedSlope(vjpkit.Function):
    """tanh saving its slope computed under stop_gradient: the slope stays constant at second order."""

    @staticmethod
    def forward(ctx, x):
        y = jnp.tanh(x)
        ctx.save_for_backward(jax.lax.stop_gradient(1 - y**2))
        return y

    @staticmethod
    def backward(ctx, g):
        (slope,) = ctx.saved_tensors
        return g * slope


class StoppedTanh(Tanh):
    """tanh under stop_gradient, backward from the saved output (Tanh's)."""

    @staticmethod
    def forward(ctx, x):
        y = jax.lax.stop_gradient(jnp.tanh(x))
        ctx.save_for_backward(y)
        return y


class StoppedTanhJvpOnly(vjpkit.Function):
    """tanh under stop_gradient with jvp only: reverse mode transposes the jvp."""

    @staticmethod
    def forward(ctx, x):
        y = jax.lax.stop_gradient(jnp.tanh(x))
        ctx.save_for_forward(y)
        return y

    @staticmethod
    def jvp(ctx, t):
        (y,) = ctx.saved_tensors
        return t * (1 - y**2)


class StoppedTanhWithJvp(StoppedTanhJvpOnly):
    """tanh under stop_gradient with both rules from the saved output (jvp is StoppedTanhJvpOnly's)."""

    @staticmethod
    def forward(ctx, x):
        y = jax.lax.stop_gradient(jnp.tanh(x))
        ctx.save_for_backward(y)
        ctx.save_for_forward(y)
        return y

    backward = staticmethod(Tanh.backward)


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


class MulWithJvp(Mul):
    """Mul with a jvp too (backward is Mul's)."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        ctx.save_for_forward(x, w)
        return x * w

    @staticmethod
    def jvp(ctx, tx, tw):
        x, w = ctx.saved_tensors
        return tx * w + x * tw


class Linear(vjpkit.Function):
    """x @ w.T without bias, as ported from PyTorch: backward's ``g.T @ x`` contracts the batch axis."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x @ w.T

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        return g @ w, g.T @ x


class LinearFunction(vjpkit.Function):
    """y = x @ w.T + b, PyTorch's LinearFunction as the README ports it (bias defaults to None)."""

    @staticmethod
    def forward(ctx, x, w, b=None):
        ctx.save_for_backward(x, w, b)
        y = x @ w.T
        return y if b is None else y + b

    @staticmethod
    def backward(ctx, g):
        x, w, b = ctx.saved_tensors
        gx = g @ w if ctx.needs_input_grad[0] else None
        gw = g.T @ x if ctx.needs_input_grad[1] else None
        gb = g.sum(0) if b is not None and ctx.needs_input_grad[2] else None
        return gx, gw, gb


class LinearWithJvp(Linear):
    """Linear with a jvp too (backward is Linear's)."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        ctx.save_for_forward(x, w)
        return x @ w.T

    @staticmethod
    def jvp(ctx, tx, tw):
        x, w = ctx.saved_tensors
        return tx @ w.T + x @ tw.T


class MulByScalar(vjpkit.Function):
    """x times a traced scalar c (a 0-d array): c's gradient is a sum."""

    @staticmethod
    def forward(ctx, x, c):
        ctx.save_for_backward(x, c)
        ctx.save_for_forward(x, c)
        return x * c

    @staticmethod
    def backward(ctx, g):
        x, c = ctx.saved_tensors
        return g * c, (g * x).sum()


class MulByScalarWithJvp(MulByScalar):
    """MulByScalar with a jvp too (forward and backward are MulByScalar's)."""

    @staticmethod
    def jvp(ctx, tx, tc):
        x, c = ctx.saved_tensors
        return tx * c + x * tc


class Double(vjpkit.Function):
    """2 * x, saving nothing."""

    @staticmethod
    def forward(ctx, x):
        return 2 * x

    @staticmethod
    def backward(ctx, g):
        return 2 * g


class Gather(vjpkit.Function):
    """x[idx] for a 1-d x and an integer idx (not differentiated: its gradient slot is None)."""

    @staticmethod
    def forward(ctx, x, idx):
        ctx.save_for_backward(idx)
        ctx.n = x.shape[0]
        return x[idx]

    @staticmethod
    def backward(ctx, g):
        (idx,) = ctx.saved_tensors
        return jnp.zeros(ctx.n, g.dtype).at[idx].add(g), None


class Identity(vjpkit.Function):
    """Returns its input; the gradient passes through."""

    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, g):
        return g


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


def fresh(cls, name=None, **attributes):
    """A new subclass of ``cls``: its own caches and trace counts, ``name`` (default: cls's) in messages.

    ``attributes`` are class attributes, such as the options ``jit``, ``host`` or ``cache_size``.
    """
    return type(name or cls.__name__, (cls,), {"__module__": cls.__module__, **attributes})


def once(cls, name):
    """A new subclass of ``cls`` named ``name`` whose backward is ``@once_differentiable``."""
    backward = staticmethod(vjpkit.once_differentiable(cls.backward))
    return type(name, (cls,), {"__module__": cls.__module__, "backward": backward})


REFERENCE = {
    Sin: jnp.sin,
    SinWithJvp: jnp.sin,
    SinJvpOnly: jnp.sin,
    Exp: jnp.exp,
    ExpWithJvp: jnp.exp,
    ScaledExp: lambda x, c=1.0: jnp.exp(x) * c,
    StoppedExp: jnp.exp,
    StoppedExpWithJvp: jnp.exp,
    Square: jnp.square,
    SquareWithJvp: jnp.square,
    Log: jnp.log,
    Tanh: jnp.tanh,
    TanhSavingAStoppedSlope: jnp.tanh,  # to first order; its second order treats the slope as constant
    StoppedTanh: jnp.tanh,
    StoppedTanhWithJvp: jnp.tanh,
    StoppedTanhJvpOnly: jnp.tanh,
    Mul: lambda x, w: x * w,
    MulWithJvp: lambda x, w: x * w,
    Linear: lambda x, w: x @ w.T,
    LinearWithJvp: lambda x, w: x @ w.T,
    MulByScalar: lambda x, c: x * c,
    MulByScalarWithJvp: lambda x, c: x * c,
    Double: lambda x: 2 * x,
    Gather: lambda x, idx: x[idx],
    Identity: lambda x: x,
    Scale: lambda x, c=2.0: c * x,
    WeightedSin: _weighted_sin,
    WeightedSinWithJvp: _weighted_sin,
    WeightedSinJvpOnly: _weighted_sin,
}

