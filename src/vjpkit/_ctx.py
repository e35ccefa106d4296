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
                "instead of keeping the ctx itself."
            )

    def __getattr__(self, name: str) -> Any:
        # Only reached for attributes that do not exist, which includes the
        # user's attributes once the call has finished (closing moves them
        # out): one of those would be a tracer of a finished trace.
        if not self._vjpkit_open:
            self._check_open(name)
        raise AttributeError(
            f"{self._vjpkit_name}.{self._vjpkit_method}: ctx has no attribute "
            f"{name!r}; set it in forward (ctx.{name} = ...) to read it here."
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
                    f"attributes instead (ctx.value = ...)."
                )
        return xs

    def save_for_backward(self, *xs: Any) -> None:
        """Saves arrays (or ``None``) for ``backward``; the last call wins."""
        self._check_open("save_for_backward")
        _set(self, "_vjpkit_saved", self._check_saveable("save_for_backward", xs))

    def save_for_forward(self, *xs: Any) -> None:
        """Saves arrays (or ``None``) for ``jvp``; the last call wins."""
        self._check_open("save_for_forward")
        _set(self, "_vjpkit_saved_forward", self._check_saveable("save_for_forward", xs))

    @property
    def saved_tensors(self) -> tuple:
        """What ``save_for_backward`` saved (in ``jvp``: ``save_for_forward``)."""
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
        """One bool per forward parameter: True when JAX differentiates it."""
        self._check_open("needs_input_grad")
        return self._vjpkit_needs

    def mark_non_differentiable(self, *outputs: Any) -> None:
        """Declares outputs (by identity) that carry no gradient."""
        self._check_open("mark_non_differentiable")
        for i, x in enumerate(outputs):
            if not is_array(x):
                raise TypeError(
                    f"{self._vjpkit_name}.{self._vjpkit_method}: "
                    f"mark_non_differentiable takes output arrays, but argument "
                    f"{i} is {type(x).__name__} ({short_repr(x)}). Non-array "
                    "outputs are static and carry no gradient anyway; pass "
                    "only the output arrays that should carry none."
                )
        _set(self, "_vjpkit_non_differentiable", outputs)

    def set_materialize_grads(self, value: bool) -> None:
        """False: absent output gradients reach backward as None, not zeros."""
        self._check_open("set_materialize_grads")
        _set(self, "_vjpkit_materialize", bool(value))

    def mark_dirty(self, *inputs: Any) -> None:
        """Declares that forward returns new values of these inputs.

        JAX arrays are immutable, so this only records the intent (PyTorch's
        in-place ops become functional updates); an argument that is not
        one of forward's inputs raises.
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
                    "x.at[i].set(v)); a new array needs no marking."
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
