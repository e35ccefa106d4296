"""Binding ``apply``'s arguments to ``forward``'s parameters.

The bound values are then split (``_tree.partition``) into traced (array)
and static (everything else) parts: static leaves become part of the
compile-cache key and are closed over by the program, so no tracer can
ever leak through a primitive's parameters.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ._site import see_catalogue
from ._tree import Partition, is_array, partition

_MISSING = object()


class Signature:
    """``forward``'s parameters, inspected once per class.

    ``bind`` replaces ``inspect.Signature.bind`` on the per-call path: the
    result is one value per parameter, in order (positional parameters,
    then each extra ``*args`` value, then keyword-only parameters), with
    defaults filled in. That order is the order of ``needs_input_grad`` and
    of the gradients ``backward`` returns.
    """

    def __init__(self, owner: str, fn: Callable, skip_first: bool):
        self.owner = owner
        params = list(inspect.signature(fn).parameters.values())
        if skip_first:
            if not params or params[0].kind not in (
                inspect.Parameter.POSITIONAL_ONLY,
                inspect.Parameter.POSITIONAL_OR_KEYWORD,
            ):
                raise TypeError(
                    f"{owner}.forward must take ctx as its first parameter "
                    "(forward(ctx, *inputs)), or define setup_context(ctx, "
                    f"inputs, output) and take only the inputs. {see_catalogue('forward-without-ctx')}"
                )
            params = params[1:]
        positional, keyword_only = [], []
        self.var_positional: str | None = None
        for p in params:
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
                positional.append(p)
            elif p.kind is p.VAR_POSITIONAL:
                self.var_positional = p.name
            elif p.kind is p.KEYWORD_ONLY:
                keyword_only.append(p)
            else:
                raise TypeError(
                    f"{owner}.forward takes **{p.name}; vjpkit needs every input "
                    "to be a named parameter (or *args), so that backward can "
                    f"return one gradient per input. {see_catalogue('forward-with-var-keyword')}"
                )
        self.positional = tuple(p.name for p in positional)
        self.keyword_only = tuple(p.name for p in keyword_only)
        self.positional_only = frozenset(
            p.name for p in positional if p.kind is p.POSITIONAL_ONLY
        )
        self.defaults = {
            p.name: p.default for p in (*positional, *keyword_only) if p.default is not p.empty
        }
        self.index = {name: i for i, name in enumerate(self.positional)}
        self.n_positional = len(self.positional)

    def names(self, n_values: int) -> tuple[str, ...]:
        """The parameter name of each bound value (``args[0]``, ... for ``*args``)."""
        n_extra = n_values - self.n_positional - len(self.keyword_only)
        extra = tuple(f"{self.var_positional}[{i}]" for i in range(n_extra))
        return (*self.positional, *extra, *self.keyword_only)

    def bind(self, args: tuple, kwargs: dict[str, Any]) -> tuple:
        """One value per parameter, as ``forward`` would receive them."""
        n_pos = self.n_positional
        if len(args) > n_pos and self.var_positional is None:
            raise TypeError(
                f"{self.owner}.apply takes {n_pos} positional argument"
                f"{'s' if n_pos != 1 else ''} ({', '.join(self.positional)}) "
                f"but {len(args)} were given. {see_catalogue('apply-with-too-many-arguments')}"
            )
        values = list(args[:n_pos]) + [_MISSING] * (n_pos - min(len(args), n_pos))
        extra = args[n_pos:]
        keyword = dict.fromkeys(self.keyword_only, _MISSING)
        for name, value in kwargs.items():
            i = self.index.get(name)
            if i is not None and name not in self.positional_only:
                if values[i] is not _MISSING:
                    raise TypeError(f"{self.owner}.apply got multiple values for argument {name!r}")
                values[i] = value
            elif name in keyword:
                keyword[name] = value
            else:
                raise TypeError(f"{self.owner}.apply got an unexpected keyword argument {name!r}. "
                                f"{see_catalogue('apply-with-an-unexpected-keyword')}")
        names = (*self.positional, *self.keyword_only)
        bound = [*values, *keyword.values()]
        for i, (name, value) in enumerate(zip(names, bound, strict=True)):
            if value is _MISSING:
                value = self.defaults.get(name, _MISSING)
                if value is _MISSING:
                    raise TypeError(f"{self.owner}.apply missing required argument {name!r}. "
                                    f"{see_catalogue('apply-with-a-missing-argument')}")
                bound[i] = value
        return (*bound[:n_pos], *extra, *bound[n_pos:])

    def call(self, fn: Callable, prefix: tuple, values: tuple) -> Any:
        """Calls ``fn(*prefix, *values)`` with keyword-only values by name."""
        n_kw = len(self.keyword_only)
        if not n_kw:
            return fn(*prefix, *values)
        positional, keyword = values[:-n_kw], values[-n_kw:]
        return fn(*prefix, *positional, **dict(zip(self.keyword_only, keyword, strict=True)))


def split_residuals(saved: Any) -> tuple[Partition, tuple]:
    """What forward left on ctx: its arrays (the residuals) apart from static data."""
    layout, arrays = partition(saved, is_array)
    return layout, tuple(map(as_jax_leaf, arrays))


def as_jax_leaf(x: Any) -> Any:
    """NumPy values become JAX arrays at the call's boundary."""
    return jnp.asarray(x) if isinstance(x, (np.ndarray, np.generic)) else x


def as_arrays(xs: Sequence[Any]) -> tuple:
    """``xs`` as JAX arrays: the scalars JAX passes when it runs eagerly become arrays.

    Why: differentiating with respect to a Python float eagerly (``jit=False``,
    ``jax.disable_jit()``) hands the rules JAX's weakly typed scalar wrapper
    (a ``float`` subclass with a dtype), where under ``jit`` they see a tracer.
    """
    return tuple(x if isinstance(x, jax.Array) else jnp.asarray(x) for x in xs)
