"""The Functions many test files use, each defined once (importable as ``functions``).

Each class is module-level, so its compiled programs are shared by every test
that calls it. A test that counts traces or compiles, or whose error message
names the class, needs a class of its own: ``fresh(Sin, "Sine")`` returns a
new subclass (own caches, own name) each time, and ``once(Exp, "OnceExp")``
one whose backward is ``@once_differentiable``.

The ``Stopped*`` Functions compute their output under ``stop_gradient``, so
a higher-order derivative can only come from their rules, never from
forward's code.

``elementwise`` builds the one-input Functions (``Sin``, ``Exp``, ``Tanh`` and
their variants) from their maths and slope, and ``bilinear`` the products
(``Mul``, ``Linear``); each is a named class like the others. ``DoubleNoRules``
and ``ZerosNoRules`` have no rules: a test's subclass adds the one it is about.

``REFERENCE`` maps each Function to the same math written in plain ``jnp``,
the expected value for it under any transformation.
"""

import operator

import jax
import jax.numpy as jnp

import vjpkit


def elementwise(name, f, times_slope, saves, rules=("backward",), stopped=False, *, doc):
    """A Function computing ``f(x)`` whose rules come from one saved array.

    ``saves`` says which array forward saves: ``"input"`` (x) or ``"output"`` (y = f(x)), and
    ``times_slope(saved, t)`` is f'(x) * t written from it. An elementwise derivative is its own
    transpose, so backward (t is the cotangent g) and jvp (t is the tangent) share it. ``rules``:
    ``"backward"``, ``"jvp"`` or both. ``stopped``: y is computed under stop_gradient.
    """

    def forward(ctx, x):
        y = jax.lax.stop_gradient(f(x)) if stopped else f(x)
        saved = x if saves == "input" else y
        if "backward" in rules:
            ctx.save_for_backward(saved)
        if "jvp" in rules:
            ctx.save_for_forward(saved)
        return y

    def rule(ctx, t):
        (saved,) = ctx.saved_tensors
        return times_slope(saved, t)

    namespace = {"__doc__": doc, "__module__": __name__, "forward": staticmethod(forward)}
    return type(name, (vjpkit.Function,), {**namespace, **{rule_name: staticmethod(rule) for rule_name in rules}})


BOTH, JVP_ONLY = ("backward", "jvp"), ("jvp",)


def times_cos(x, t):  # sin's slope, from its input
    return jnp.cos(x) * t


def times_output(y, t):  # exp's slope is its output
    return y * t


def times_tanh_slope(y, t):  # tanh's slope, from its output
    return t * (1 - y**2)


def times_twice(x, t):  # x * x's slope, from its input
    return 2 * x * t


Sin = elementwise("Sin", jnp.sin, times_cos, "input", doc="sin, saving its input; backward only.")
SinWithJvp = elementwise("SinWithJvp", jnp.sin, times_cos, "input", BOTH, doc="sin with both rules from its input.")
SinJvpOnly = elementwise(
    "SinJvpOnly", jnp.sin, times_cos, "input", JVP_ONLY, doc="sin, jvp only: reverse mode transposes it."
)
Exp = elementwise("Exp", jnp.exp, times_output, "output", doc="exp, backward from its output (differentiable twice).")
ExpWithJvp = elementwise("ExpWithJvp", jnp.exp, times_output, "output", BOTH, doc="exp, both rules from its output.")
StoppedExp = elementwise("StoppedExp", jnp.exp, times_output, "output", stopped=True, doc="exp under stop_gradient.")
StoppedExpWithJvp = elementwise(
    "StoppedExpWithJvp", jnp.exp, times_output, "output", BOTH, stopped=True, doc="StoppedExp with both rules."
)
Square = elementwise("Square", lambda x: x * x, times_twice, "input", doc="x * x, saving its input.")
SquareWithJvp = elementwise("SquareWithJvp", lambda x: x * x, times_twice, "input", BOTH, doc="Square with a jvp too.")
Log = elementwise("Log", jnp.log, lambda x, g: g / x, "input", doc="log, saving its input.")
Tanh = elementwise("Tanh", jnp.tanh, times_tanh_slope, "output", doc="tanh, backward from its output.")
StoppedTanh = elementwise("StoppedTanh", jnp.tanh, times_tanh_slope, "output", stopped=True, doc="tanh, stopped.")
StoppedTanhJvpOnly = elementwise(
    "StoppedTanhJvpOnly", jnp.tanh, times_tanh_slope, "output", JVP_ONLY, stopped=True, doc="StoppedTanh, jvp only."
)
StoppedTanhWithJvp = elementwise(
    "StoppedTanhWithJvp", jnp.tanh, times_tanh_slope, "output", BOTH, stopped=True, doc="StoppedTanh, both rules."
)


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


class ScaledRules(vjpkit.Function):
    """Rules scaled apart from forward's derivative (x * w, sin x): backward gives None where an input is not
    differentiated, and saves an intermediate (cos x) for backward and jvp."""

    @staticmethod
    def forward(ctx, x, w):
        c = jnp.cos(x)
        ctx.save_for_backward(x, w, c)
        ctx.save_for_forward(x, w, c)
        return x * w, jnp.sin(x)

    @staticmethod
    def backward(ctx, g0, g1):
        x, w, c = ctx.saved_tensors
        gx = 2.0 * (g0 * w + g1 * c) if ctx.needs_input_grad[0] else None
        gw = 3.0 * g0 * x if ctx.needs_input_grad[1] else None
        return gx, gw

    @staticmethod
    def jvp(ctx, tx, tw):
        x, w, c = ctx.saved_tensors
        return 2.0 * tx * w + 3.0 * x * tw, 2.0 * c * tx


def bilinear(name, product, gradients, rules=("backward",), *, doc):
    """A Function computing ``product(x, w)``, bilinear in its two inputs, both saved.

    ``gradients(x, w, g)`` is backward's pair; the jvp, ``product(tx, w) + product(x, tw)``, follows
    from bilinearity. ``rules``: ``"backward"`` or both.
    """

    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        if "jvp" in rules:
            ctx.save_for_forward(x, w)
        return product(x, w)

    def backward(ctx, g):
        x, w = ctx.saved_tensors
        return gradients(x, w, g)

    def jvp(ctx, tx, tw):
        x, w = ctx.saved_tensors
        return product(tx, w) + product(x, tw)

    namespace = {
        "__doc__": doc,
        "__module__": __name__,
        "forward": staticmethod(forward),
        "backward": staticmethod(backward),
    }
    return type(name, (vjpkit.Function,), {**namespace, **({"jvp": staticmethod(jvp)} if "jvp" in rules else {})})


def product_gradients(x, w, g):  # of x * w: output-shaped, summed down by vjpkit where x or w broadcast
    return g * w, g * x


def matmul_gradients(x, w, g):  # of x @ w.T: ``g.T @ x`` contracts the batch axis
    return g @ w, g.T @ x


Mul = bilinear("Mul", operator.mul, product_gradients, doc="Broadcasting product x * w.")
MulWithJvp = bilinear("MulWithJvp", operator.mul, product_gradients, BOTH, doc="Mul with a jvp too.")
Linear = bilinear("Linear", lambda x, w: x @ w.T, matmul_gradients, doc="x @ w.T without bias, as ported from PyTorch.")
LinearWithJvp = bilinear("LinearWithJvp", lambda x, w: x @ w.T, matmul_gradients, BOTH, doc="Linear with a jvp too.")


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


def scalar_product_gradients(x, c, g):  # of x * c for a 0-d c: c's gradient is a sum
    return g * c, (g * x).sum()


MulByScalar = bilinear(
    "MulByScalar", operator.mul, scalar_product_gradients, doc="x times a traced scalar c (a 0-d array)."
)
MulByScalarWithJvp = bilinear(
    "MulByScalarWithJvp", operator.mul, scalar_product_gradients, BOTH, doc="MulByScalar with a jvp too."
)


class DoubleNoRules(vjpkit.Function):
    """2 * x with no rules (neither backward nor jvp): the base of a test's Function that adds one."""

    @staticmethod
    def forward(ctx, x):
        return 2 * x


class Double(DoubleNoRules):
    """2 * x, saving nothing (forward is DoubleNoRules's)."""

    @staticmethod
    def backward(ctx, g):
        return 2 * g


class SinCos(vjpkit.Function):
    """(sin(x), cos(x)), both saved: backward takes one gradient per output and uses both."""

    @staticmethod
    def forward(ctx, x):
        sin, cos = jnp.sin(x), jnp.cos(x)
        ctx.save_for_backward(sin, cos)
        return sin, cos

    @staticmethod
    def backward(ctx, g_sin, g_cos):
        sin, cos = ctx.saved_tensors
        return g_sin * cos - g_cos * sin


class SinCosWithJvp(SinCos):
    """SinCos with a jvp too, returning one tangent per output (backward is SinCos's)."""

    @staticmethod
    def forward(ctx, x):
        sin, cos = SinCos.forward(ctx, x)
        ctx.save_for_forward(sin, cos)
        return sin, cos

    @staticmethod
    def jvp(ctx, t):
        sin, cos = ctx.saved_tensors
        return cos * t, -sin * t


class AddBias(vjpkit.Function):
    """x + b, backward returning g for both: b's gradient has the broadcast shape, summed down by vjpkit."""

    @staticmethod
    def forward(ctx, x, b):
        return x + b

    @staticmethod
    def backward(ctx, g):
        return g, g


class ZerosNoRules(vjpkit.Function):
    """Zeros like x with no rules: the base of a test's Function whose rule passes the gradient through anyway."""

    @staticmethod
    def forward(ctx, x):
        return jnp.zeros(x.shape, x.dtype)


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
        return jnp.sin(x) * w, w**2

    @staticmethod
    def backward(ctx, g_product, g_square):
        x, w = ctx.saved_tensors
        return g_product * jnp.cos(x) * w, g_product * jnp.sin(x) + 2 * w * g_square


class WeightedSinWithJvp(WeightedSin):
    """WeightedSin with both rules (backward is WeightedSin's)."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_forward(x, w)
        return WeightedSin.forward(ctx, x, w)

    @staticmethod
    def jvp(ctx, tx, tw):
        x, w = ctx.saved_tensors
        return jnp.cos(x) * w * tx + jnp.sin(x) * tw, 2 * w * tw


class WeightedSinJvpOnly(vjpkit.Function):
    """WeightedSin with jvp only: reverse mode transposes the jvp."""

    forward = staticmethod(WeightedSinWithJvp.forward)
    jvp = staticmethod(WeightedSinWithJvp.jvp)


class MulConstantAsWritten:
    """PyTorch's tutorial MulConstant, setup_context style, as a plain class: ``vjpkit.function`` of it (with any
    options) is a Function, and its code runs unchanged on PyTorch tensors too. The constant is static."""

    @staticmethod
    def forward(tensor, constant):
        return tensor * constant

    @staticmethod
    def setup_context(ctx, inputs, output):
        _, constant = inputs
        ctx.constant = constant

    @staticmethod
    def backward(ctx, grad_output):
        return grad_output * ctx.constant, None


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
    DoubleNoRules: lambda x: 2 * x,
    Double: lambda x: 2 * x,
    SinCos: lambda x: (jnp.sin(x), jnp.cos(x)),
    SinCosWithJvp: lambda x: (jnp.sin(x), jnp.cos(x)),
    AddBias: lambda x, b: x + b,
    ZerosNoRules: jnp.zeros_like,
    Gather: lambda x, idx: x[idx],
    Identity: lambda x: x,
    Scale: lambda x, c=2.0: c * x,
    WeightedSin: _weighted_sin,
    WeightedSinWithJvp: _weighted_sin,
    WeightedSinJvpOnly: _weighted_sin,
}


class StraightThroughZeroJvp(vjpkit.Function):
    """``x * w`` with rules that differ on purpose: backward passes the gradient straight through, jvp gives zeros.

    Only the Function's own rules give its answers (forward's code differentiates to neither): reverse mode
    must run backward, forward mode jvp.
    """

    @staticmethod
    def forward(ctx, x, w):
        return x * w

    @staticmethod
    def backward(ctx, g):
        return g, g

    @staticmethod
    def jvp(ctx, tx, tw):
        return jnp.zeros_like(tx)
