"""The ``ctx`` object that ``forward``, ``setup_context``, ``backward`` and ``jvp`` receive, and its life cycle.

A ctx is made for one call of the user's methods and closed when that call
returns (``closing``). What forward leaves on it (``forwarded``) travels to
backward and jvp, whose ctx is rebuilt from it (``rule_ctx``). Only this
module writes a ctx's internal slots.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any, Callable, Iterator, NamedTuple

import jax

from ._outputs import short_repr
from ._site import see_catalogue
from ._tree import is_array


class FunctionCtx:
    """Carries what ``forward`` wants ``backward`` to see.

    Mirrors ``torch.autograd.function.FunctionCtx``. Arrays saved with
    ``save_for_backward`` (and array-valued attributes such as
    ``ctx.mask = m``) travel to ``backward`` as residuals;
    every other attribute travels as static data, fixed when JAX traces.

    A ctx lives for one call of the user's method: once that call returns,
    vjpkit closes it, and a ctx kept by user code raises when used again
    (its arrays would be tracers of a finished trace).

    Attributes:
        needs_input_grad: One bool per forward input, True where JAX
            differentiates it (a tuple; in forward, backward and jvp).
        saved_tensors: What ``save_for_backward`` saved, as a tuple (in
            ``jvp``: what ``save_for_forward`` saved).

    Any other attribute set in forward (``ctx.scale = 2.0``) is the user's,
    and reads back in backward and jvp.

    Examples:
        >>> import jax
        >>> import jax.numpy as jnp
        >>> import vjpkit
        >>> class Scale(vjpkit.Function):
        ...     @staticmethod
        ...     def forward(ctx, x, factor):
        ...         ctx.factor = factor  # not an array: static data
        ...         return factor * x
        ...
        ...     @staticmethod
        ...     def backward(ctx, g):
        ...         return ctx.factor * g, None
        >>> x = jnp.array([1.0, 2.0])
        >>> jax.grad(lambda x: Scale.apply(x, 3.0).sum())(x).tolist()
        [3.0, 3.0]
    """

    # Internal state in slots; user attributes go to ``__dict__``, which is
    # exactly the set of attributes carried to backward. vjpkit writes the
    # slots with ``_set`` (``object.__setattr__``), past the user-facing check.
    __slots__ = (
        "_vjpkit_name",
        "_vjpkit_method",
        "_vjpkit_open",
        "_vjpkit_saved",
        "_vjpkit_saved_forward",
        "_vjpkit_needs",
        "_vjpkit_non_differentiable",
        "_vjpkit_dirty",
        "_vjpkit_materialize",
        "_vjpkit_inputs",
        "_vjpkit_in_jvp",
        "_vjpkit_host",
        "_vjpkit_left",
        "__dict__",
    )

    def __init__(self, name: str, needs_input_grad: tuple[bool, ...], inputs: tuple = ()):
        _set(self, "_vjpkit_name", name)
        _set(self, "_vjpkit_method", "forward")
        _set(self, "_vjpkit_open", True)
        _set(self, "_vjpkit_saved", ())
        _set(self, "_vjpkit_saved_forward", ())
        _set(self, "_vjpkit_needs", needs_input_grad)
        _set(self, "_vjpkit_non_differentiable", ())
        _set(self, "_vjpkit_dirty", ())
        _set(self, "_vjpkit_materialize", True)
        _set(self, "_vjpkit_inputs", inputs)
        _set(self, "_vjpkit_in_jvp", False)
        _set(self, "_vjpkit_host", None)  # a host Function's own residuals (see _host.py)
        _set(self, "_vjpkit_left", None)  # the user's attributes, once closed

    # -- lifetime --------------------------------------------------------

    def _check_open(self, member: str) -> None:
        if not self._vjpkit_open:
            raise RuntimeError(
                f"{self._vjpkit_name}: ctx.{member} was used after the call it "
                f"belongs to had finished (this ctx was {self._vjpkit_name}."
                f"{self._vjpkit_method}'s). A ctx is only valid inside forward, "
                "setup_context, backward or jvp; keep values on ctx for backward "
                f"instead of keeping the ctx itself. {see_catalogue('ctx-used-after-the-call')}"
            )

    def __getattr__(self, name: str) -> Any:
        # Only reached for attributes that do not exist, which includes the
        # user's attributes once the call has finished (closing moves them
        # out): one of those would be a tracer of a finished trace.
        if not self._vjpkit_open:
            self._check_open(name)
        raise AttributeError(
            f"{self._vjpkit_name}.{self._vjpkit_method}: ctx has no attribute "
            f"{name!r}; set it in forward (ctx.{name} = ...) to read it here. "
            f"{see_catalogue('missing-ctx-attribute')}"
        )

    def __setattr__(self, name: str, value: Any) -> None:
        if not name.startswith("_vjpkit_"):
            self._check_open(name)
        _set(self, name, value)

    # -- saving ----------------------------------------------------------

    def _check_saveable(self, method: str, xs: tuple) -> tuple:
        for i, x in enumerate(xs):
            if x is not None and not is_array(x):
                raise TypeError(
                    f"{self._vjpkit_name}.{self._vjpkit_method}: {method} takes "
                    f"arrays or None, but argument {i} is {type(x).__name__} "
                    f"({short_repr(x)}). Store non-array values as ctx "
                    f"attributes instead (ctx.value = ...). "
                    + (see_catalogue("save-a-non-array") if method == "save_for_backward"
                       else see_catalogue("save-for-forward-a-non-array"))
                )
        return xs

    def save_for_backward(self, *xs: Any) -> None:
        """Saves arrays (or ``None``) for ``backward``; the last call wins.

        backward reads them back as ``ctx.saved_tensors``. Arrays are
        residuals: kept from forward to backward by JAX (under ``jit``, by
        XLA).

        Examples:
            >>> import jax
            >>> import jax.numpy as jnp
            >>> import vjpkit
            >>> class Mul(vjpkit.Function):
            ...     @staticmethod
            ...     def forward(ctx, x, y, bias=None):
            ...         ctx.save_for_backward(x, y, bias)
            ...         return x * y if bias is None else x * y + bias
            ...
            ...     @staticmethod
            ...     def backward(ctx, g):
            ...         x, y, bias = ctx.saved_tensors
            ...         return g * y, g * x, None if bias is None else g
            >>> x, y = jnp.array([1.0, 2.0]), jnp.array([3.0, 4.0])
            >>> jax.grad(lambda x: Mul.apply(x, y).sum())(x).tolist()
            [3.0, 4.0]
        """
        self._check_open("save_for_backward")
        _set(self, "_vjpkit_saved", self._check_saveable("save_for_backward", xs))

    def save_for_forward(self, *xs: Any) -> None:
        """Saves arrays (or ``None``) for ``jvp``; the last call wins.

        jvp reads them back as ``ctx.saved_tensors``.

        Examples:
            >>> import jax
            >>> import jax.numpy as jnp
            >>> import vjpkit
            >>> class Cube(vjpkit.Function):
            ...     @staticmethod
            ...     def forward(ctx, x):
            ...         ctx.save_for_forward(x)
            ...         return x**3
            ...
            ...     @staticmethod
            ...     def jvp(ctx, t):
            ...         (x,) = ctx.saved_tensors
            ...         return 3 * x**2 * t
            >>> x = jnp.array([1.0, 2.0])
            >>> jax.jvp(Cube.apply, (x,), (jnp.ones(2),))[1].tolist()
            [3.0, 12.0]
        """
        self._check_open("save_for_forward")
        _set(self, "_vjpkit_saved_forward", self._check_saveable("save_for_forward", xs))

    @property
    def saved_tensors(self) -> tuple:
        """What ``save_for_backward`` saved (in ``jvp``: ``save_for_forward``), as a tuple.

        Examples:
            >>> import jax
            >>> import jax.numpy as jnp
            >>> import vjpkit
            >>> class Exp2(vjpkit.Function):
            ...     @staticmethod
            ...     def forward(ctx, x):
            ...         y = 2.0**x
            ...         ctx.save_for_backward(y)
            ...         return y
            ...
            ...     @staticmethod
            ...     def backward(ctx, g):
            ...         (y,) = ctx.saved_tensors  # a tuple, even of one array
            ...         return g * y * jnp.log(2.0)
            >>> g = jax.grad(lambda x: Exp2.apply(x).sum())(jnp.array([0.0, 1.0]))
            >>> [round(v, 4) for v in g.tolist()]
            [0.6931, 1.3863]
        """
        self._check_open("saved_tensors")
        return self._vjpkit_saved_forward if self._vjpkit_in_jvp else self._vjpkit_saved

    @property
    def saved_variables(self) -> tuple:
        """PyTorch's old name of ``saved_tensors``: accepted with PyTorch's deprecation warning."""
        warnings.warn(
            f"{self._vjpkit_name}.{self._vjpkit_method}: 'saved_variables' is deprecated; use 'saved_tensors'",
            DeprecationWarning,
            stacklevel=2,  # the user's line
        )
        return self.saved_tensors

    # -- flags -----------------------------------------------------------

    @property
    def needs_input_grad(self) -> tuple[bool, ...]:
        """One bool per forward parameter: True when JAX differentiates it.

        backward may skip the gradients nobody asked for (returning ``None``
        for them); static (non-array) inputs are always False.

        Examples:
            >>> import jax
            >>> import jax.numpy as jnp
            >>> import vjpkit
            >>> class Mul(vjpkit.Function):
            ...     @staticmethod
            ...     def forward(ctx, x, y):
            ...         ctx.save_for_backward(x, y)
            ...         return x * y
            ...
            ...     @staticmethod
            ...     def backward(ctx, g):
            ...         print("needs_input_grad:", ctx.needs_input_grad)
            ...         x, y = ctx.saved_tensors
            ...         gx = g * y if ctx.needs_input_grad[0] else None
            ...         gy = g * x if ctx.needs_input_grad[1] else None
            ...         return gx, gy
            >>> x, y = jnp.array([1.0, 2.0]), jnp.array([3.0, 4.0])
            >>> jax.grad(lambda x: Mul.apply(x, y).sum())(x).tolist()
            needs_input_grad: (True, False)
            [3.0, 4.0]
        """
        self._check_open("needs_input_grad")
        return self._vjpkit_needs

    def mark_non_differentiable(self, *outputs: Any) -> None:
        """Declares outputs (by identity) that carry no gradient.

        backward still receives a gradient for each of them (zeros), and
        their own derivative is zero.

        Examples:
            >>> import jax
            >>> import jax.numpy as jnp
            >>> import vjpkit
            >>> class ClipWithMask(vjpkit.Function):
            ...     @staticmethod
            ...     def forward(ctx, x):
            ...         mask = (jnp.abs(x) <= 1.0).astype(x.dtype)
            ...         ctx.mark_non_differentiable(mask)
            ...         ctx.save_for_backward(mask)
            ...         return jnp.clip(x, -1.0, 1.0), mask
            ...
            ...     @staticmethod
            ...     def backward(ctx, g, g_mask):
            ...         (mask,) = ctx.saved_tensors
            ...         return g * mask
            >>> x = jnp.array([-2.0, 0.5, 3.0])
            >>> clipped, mask = ClipWithMask.apply(x)
            >>> clipped.tolist(), mask.tolist()
            ([-1.0, 0.5, 1.0], [0.0, 1.0, 0.0])
            >>> jax.grad(lambda x: ClipWithMask.apply(x)[0].sum())(x).tolist()
            [0.0, 1.0, 0.0]
            >>> jax.grad(lambda x: ClipWithMask.apply(x)[1].sum())(x).tolist()
            [0.0, 0.0, 0.0]
        """
        self._check_open("mark_non_differentiable")
        for i, x in enumerate(outputs):
            if not is_array(x):
                raise TypeError(
                    f"{self._vjpkit_name}.{self._vjpkit_method}: "
                    f"mark_non_differentiable takes output arrays, but argument "
                    f"{i} is {type(x).__name__} ({short_repr(x)}). Non-array "
                    "outputs are static and carry no gradient anyway; pass "
                    "only the output arrays that should carry none. "
                    f"{see_catalogue('mark-non-differentiable-a-non-array')}"
                )
        _set(self, "_vjpkit_non_differentiable", outputs)

    def set_materialize_grads(self, value: bool) -> None:
        """False: absent output gradients reach backward as None, not zeros.

        An output's gradient is absent where the loss does not use it, or
        the output is marked non-differentiable. The default (True) gives
        backward zeros of the output's shape.

        Examples:
            >>> import jax
            >>> import jax.numpy as jnp
            >>> import vjpkit
            >>> class Split(vjpkit.Function):
            ...     @staticmethod
            ...     def forward(ctx, x):
            ...         ctx.set_materialize_grads(False)
            ...         return 2 * x, 3 * x
            ...
            ...     @staticmethod
            ...     def backward(ctx, g_double, g_triple):
            ...         print("g_triple:", g_triple)
            ...         g = 2 * g_double
            ...         return g if g_triple is None else g + 3 * g_triple
            >>> jax.grad(lambda x: Split.apply(x)[0].sum())(jnp.array([1.0, 2.0])).tolist()
            g_triple: None
            [2.0, 2.0]
        """
        self._check_open("set_materialize_grads")
        _set(self, "_vjpkit_materialize", bool(value))

    def mark_dirty(self, *inputs: Any) -> None:
        """Declares that forward returns new values of these inputs.

        JAX arrays are immutable, so this only records the intent (PyTorch's
        in-place ops become functional updates); an argument that is not
        one of forward's inputs raises.

        Examples:
            >>> import jax
            >>> import jax.numpy as jnp
            >>> import vjpkit
            >>> class AddOne(vjpkit.Function):
            ...     @staticmethod
            ...     def forward(ctx, x):
            ...         ctx.mark_dirty(x)
            ...         return x + 1  # x's new value: PyTorch's x.add_(1)
            ...
            ...     @staticmethod
            ...     def backward(ctx, g):
            ...         return g
            >>> AddOne.apply(jnp.array([1.0, 2.0])).tolist()
            [2.0, 3.0]

            Marking what is not an input raises, linking to the misuse
            catalogue:

            >>> class Bad(vjpkit.Function):
            ...     @staticmethod
            ...     def forward(ctx, x):
            ...         y = x + 1
            ...         ctx.mark_dirty(y)
            ...         return y
            >>> Bad.apply(jnp.array([1.0, 2.0]))
            Traceback (most recent call last):
            ...
            ValueError: Bad.forward: mark_dirty argument 0 (array of shape (2,) and
            dtype float32) is not an input of forward; only inputs can be marked
            dirty. Pass the input whose new value forward returns (x, not the
            result of x.at[i].set(v)); a new array needs no marking.
            See https://vjpkit.github.io/vjpkit/errors/#mark-dirty-a-non-input
        """
        self._check_open("mark_dirty")
        input_ids = {id(leaf) for leaf in jax.tree_util.tree_leaves(self._vjpkit_inputs)}
        for i, x in enumerate(inputs):
            if id(x) not in input_ids:
                raise ValueError(
                    f"{self._vjpkit_name}.{self._vjpkit_method}: mark_dirty "
                    f"argument {i} ({short_repr(x)}) is not an input of "
                    "forward; only inputs can be marked dirty. Pass the input "
                    "whose new value forward returns (x, not the result of "
                    f"x.at[i].set(v)); a new array needs no marking. {see_catalogue('mark-dirty-a-non-input')}"
                )
        _set(self, "_vjpkit_dirty", inputs)


# ---------------------------------------------------------------------------
# The life cycle: made, run, closed; what forward left carried to backward and jvp.


_set = object.__setattr__


def close(ctx: FunctionCtx) -> None:
    """Ends ``ctx``'s call: any later use raises, reading a user attribute included.

    The user's attributes move out of ``__dict__`` (``forwarded`` still
    finds them), so that reading one falls through to ``__getattr__``,
    which raises; names starting with ``_`` stay readable.
    """
    _set(ctx, "_vjpkit_open", False)
    attributes = ctx.__dict__
    left = dict(attributes)
    _set(ctx, "_vjpkit_left", left)
    if attributes:
        kept = {name: value for name, value in left.items() if name[0] == "_"}
        attributes.clear()
        attributes.update(kept)


@contextlib.contextmanager
def closing(ctx: FunctionCtx) -> Iterator[FunctionCtx]:
    """Closes ``ctx`` when the user's method returns or raises: a kept ctx then raises when used."""
    try:
        yield ctx
    finally:
        close(ctx)


def call_forward(ctx: FunctionCtx, signature: Any, forward: Callable, setup_context: Callable | None,
                 values: tuple, setup: bool = True) -> Any:
    """The user's forward on ``values``: ``forward(ctx, ...)``, or ``forward(...)`` then ``setup_context``.

    ``signature`` (an ``_args.Signature``) passes keyword-only values by
    name; ``setup=False`` skips ``setup_context`` where nothing reads ctx.
    """
    if setup_context is None:
        return signature.call(forward, (ctx,), values)
    out = signature.call(forward, (), values)
    if setup:
        _set(ctx, "_vjpkit_method", "setup_context")
        setup_context(ctx, values, out)
    return out


def method_of(ctx: FunctionCtx) -> str:
    """The user's method the ctx belongs to (``forward``, ``setup_context``, ...)."""
    return ctx._vjpkit_method


class Carried(NamedTuple):
    """What a ctx carries from forward to backward and jvp: arrays as residuals, the rest as static data."""

    saved: tuple  # save_for_backward
    saved_forward: tuple  # save_for_forward (jvp only)
    attributes: dict  # the user's ctx attributes
    host: Any  # a host Function's own residuals


class Forwarded(NamedTuple):
    """What forward (and setup_context) left on a ctx."""

    carried: Carried
    non_differentiable: tuple
    dirty: tuple
    materialize: bool


def forwarded(ctx: FunctionCtx, forward_mode: bool = False) -> Forwarded:
    """What ``ctx``'s forward left; ``save_for_forward``'s arrays only for ``forward_mode``."""
    left = ctx._vjpkit_left
    carried = Carried(
        ctx._vjpkit_saved,
        ctx._vjpkit_saved_forward if forward_mode else (),
        dict(ctx.__dict__) if left is None else left,
        ctx._vjpkit_host,
    )
    return Forwarded(carried, ctx._vjpkit_non_differentiable, ctx._vjpkit_dirty, ctx._vjpkit_materialize)


def in_jvp(ctx: FunctionCtx) -> bool:
    """Whether ``ctx`` is a ``jvp``'s (its ``saved_tensors`` are then what ``save_for_forward`` saved)."""
    return ctx._vjpkit_in_jvp


def dirty_of(ctx: FunctionCtx) -> tuple:
    """The inputs forward marked dirty (``ctx.mark_dirty``)."""
    return ctx._vjpkit_dirty


def rule_ctx(name: str, method: str, needs: tuple[bool, ...], carried: Carried, materialize: bool) -> FunctionCtx:
    """A new ctx for ``backward`` or ``jvp`` (``method``), holding what forward left."""
    ctx = FunctionCtx(name, needs)
    _set(ctx, "_vjpkit_method", method)
    _set(ctx, "_vjpkit_in_jvp", method == "jvp")
    _set(ctx, "_vjpkit_saved", carried.saved)
    _set(ctx, "_vjpkit_saved_forward", carried.saved_forward)
    _set(ctx, "_vjpkit_materialize", materialize)
    _set(ctx, "_vjpkit_host", carried.host)
    if carried.attributes:
        ctx.__dict__.update(carried.attributes)
    return ctx


def keep_host_residuals(ctx: FunctionCtx, residuals: Any) -> None:
    """Carries a host Function's own residuals to its backward, apart from the user's attributes."""
    _set(ctx, "_vjpkit_host", residuals)


def host_residuals(ctx: FunctionCtx) -> Any:
    return ctx._vjpkit_host
