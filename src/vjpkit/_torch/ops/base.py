"""What every part of trace mode's op table shares: its refusal, its registrar and the rules' helpers."""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp

from ..dtypes import jax_dtype

__all__ = ["Table", "Untraceable", "axes", "cast", "on_vector", "size_tuple"]


class Untraceable(NotImplementedError):
    """A torch operation with no JAX counterpart here, or one that needs values (``.item()``)."""

    def __init__(self, op: str, why: str = "has no JAX rule in vjpkit's trace mode", where: str = ""):
        super().__init__(op, why, where)
        self.op, self.why, self.where = op, why, where
        self.line = ""  # the original's source line that made the call, where known

    def __str__(self) -> str:
        line = f" (at {self.line})" if self.line else ""
        return f"{self.where + ' calls ' if self.where else ''}{self.op}, which {self.why}{line}"


class Table:
    """One part of the op table: JAX rules by torch name, and the names whose results are views.

    A view's result shares storage with an argument in torch: an in-place write
    into one of them (or into a tensor one of them was taken from) would need
    aliasing, which JAX values have not got.
    """

    def __init__(self) -> None:
        self.rules: dict[str, Callable] = {}
        self.views: set[str] = set()

    def rule(self, *names: str, view: bool = False, method: bool = True, function: bool = True,
             functional: bool = False) -> Callable:
        """Registers a rule under ``torch.NAME`` and ``torch.Tensor.NAME`` (and ``torch.nn.functional.NAME``)."""

        def register(rule: Callable) -> Callable:
            for name in names:
                keys = ([f"torch.{name}"] if function else []) + ([f"torch.Tensor.{name}"] if method else [])
                keys += [f"torch.nn.functional.{name}"] if functional else []
                for key in keys:
                    self.rules[key] = rule
                    if view:
                        self.views.add(key)
            return rule

        return register


def cast(out: Any, *xs: Any) -> list:
    """Array operands cast to torch's result dtype; Python scalars stay weakly typed, as torch's do."""
    dtype = jax_dtype(out.dtype)
    return [x.astype(dtype) if isinstance(x, jax.Array) and x.dtype != dtype else x for x in xs]


def axes(dim: Any, ndim: int) -> tuple[int, ...] | None:
    """torch's ``dim`` (an int, a sequence, or None/``()`` for every axis) as JAX axes."""
    if dim is None or (isinstance(dim, (tuple, list)) and len(dim) == 0):
        return None
    if ndim == 0:  # torch accepts dim 0 and -1 of a 0-d tensor: nothing to reduce
        return ()
    return tuple(d % ndim for d in (dim if isinstance(dim, (tuple, list)) else (dim,)))


def on_vector(fn: Callable, x: Any, dim: int, *more: Any) -> Any:
    """``fn(x, dim, *more)``; a 0-d ``x`` (and ``more``) as 1-d along dim 0, as torch treats it."""
    if jnp.ndim(x) > 0:
        return fn(x, dim, *more)
    result = fn(jnp.reshape(x, (1,)), 0, *(jnp.reshape(m, (1,)) if jnp.ndim(m) == 0 else m for m in more))
    return jax.tree_util.tree_map(lambda r: jnp.reshape(r, ()) if jnp.ndim(r) == 1 else r, result)


def size_tuple(size: tuple) -> tuple:
    """``f(2, 3)`` and ``f((2, 3))`` alike."""
    return tuple(size[0]) if len(size) == 1 and isinstance(size[0], (tuple, list)) else tuple(size)
