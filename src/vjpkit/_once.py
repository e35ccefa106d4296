"""``once_differentiable``: a backward that may not be differentiated itself."""

from __future__ import annotations

import functools
from typing import Any, Callable, Sequence, TypeVar

import jax

F = TypeVar("F", bound=Callable[..., Any])


def once_differentiable(backward: F) -> F:
    """Marks a ``backward`` as first-order only, like PyTorch's decorator.

    ``jax.grad`` works as usual; differentiating the backward itself
    (``jax.hessian``, grad of grad) raises an error naming the class instead
    of silently differentiating code that was never meant to be (PyTorch
    returns wrong second derivatives there).

    Examples:
        >>> import jax
        >>> import jax.numpy as jnp
        >>> import vjpkit
        >>> class Square(vjpkit.Function):
        ...     @staticmethod
        ...     def forward(ctx, x):
        ...         ctx.save_for_backward(x)
        ...         return x**2
        ...
        ...     @staticmethod
        ...     @vjpkit.once_differentiable
        ...     def backward(ctx, g):
        ...         (x,) = ctx.saved_tensors
        ...         return 2 * x * g
        >>> x = jnp.array([1.0, 2.0])
        >>> jax.grad(lambda x: Square.apply(x).sum())(x).tolist()
        [2.0, 4.0]
        >>> jax.hessian(lambda x: Square.apply(x).sum())(x)
        Traceback (most recent call last):
        ...
        RuntimeError: Square.backward is decorated with @once_differentiable, so
        it cannot be differentiated (a second derivative such as jax.hessian or
        grad of grad was asked for). Remove the decorator if backward is written
        in differentiable JAX operations. See
        https://vjpkit.github.io/vjpkit/errors/#once-differentiable-differentiated-twice
    """
    if isinstance(backward, staticmethod):
        return staticmethod(once_differentiable(backward.__func__))  # type: ignore[return-value]

    @functools.wraps(backward)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return backward(*args, **kwargs)

    wrapper._vjpkit_once_differentiable = True  # type: ignore[attr-defined]
    return wrapper  # type: ignore[return-value]


def is_once_differentiable(fn: Any) -> bool:
    return getattr(fn, "_vjpkit_once_differentiable", False)


def call_without_derivative(fn: Callable, arrays: Sequence[Any], message: str) -> Any:
    """``fn(*arrays)``, with any derivative of it raising ``message``.

    A ``custom_jvp`` whose rule raises: JAX only calls the rule when some
    input carries a non-zero tangent, i.e. when the backward is really being
    differentiated. The arrays must be passed explicitly (not closed over),
    or JAX would differentiate through the closure instead of asking.
    """

    @jax.custom_jvp
    def no_derivative(*xs: Any) -> Any:
        return fn(*xs)

    @no_derivative.defjvp
    def _raise(primals: Any, tangents: Any) -> Any:
        raise RuntimeError(message)

    return no_derivative(*arrays)
