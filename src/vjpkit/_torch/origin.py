"""The original that ``from_torch`` runs: how to call it, and what to call its arguments in errors.

The caller's own arguments reach the original, and no others. The generated
Function's ``forward`` takes the original's parameters with every default
replaced by ``UNSET``, a static value, so a call can tell an argument left out
from one passed with the default's value: ``PScan.apply(A, X)`` calls the
original as ``PScan.apply(A, X)``, not ``PScan.apply(A, X, None)``, whose
backward would then owe torch a third gradient. A ``**kwargs`` parameter
becomes one keyword-only argument holding a dict of the extra keywords.
"""

from __future__ import annotations

import collections
import functools
from typing import Any, Callable, Sequence

import jax

from .._tree import Partition


class Unset:
    """The default of every defaulted parameter in the generated signature: not passed by the caller."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "<not passed>"


# The caller's own arguments reach the original, and no others: ``PScan.apply(A, X)``, not
# ``PScan.apply(A, X, None)``, whose backward would then owe torch one gradient more.
UNSET = Unset()


class Origin:
    """The original: how to call it, and how to name it in errors."""

    def __init__(self, *, torch: Any, name: str, call: Callable, forward_name: str, backward_name: str,
                 params: list, copy_inputs: bool, reentrant: bool, batching_rule: bool, has_jvp: bool,
                 once: bool, grad_names: tuple = ()):
        self.torch = torch
        self.name = name
        self.call = call
        self.forward_name = forward_name
        self.backward_name = backward_name
        self.params = params
        # **kwargs becomes one keyword-only argument holding a dict of the extra keywords.
        self.var_keyword = next((p.name for p in params if p.kind is p.VAR_KEYWORD), None)
        self.forward_params = [
            p.replace(kind=p.KEYWORD_ONLY, default=UNSET) if p.kind is p.VAR_KEYWORD
            else p if p.default is p.empty else p.replace(default=UNSET)
            for p in params
        ]
        self.keyword_only = tuple(p.name for p in self.forward_params if p.kind is p.KEYWORD_ONLY)
        self.positional = tuple(p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD))
        self.positional_names = tuple(p.name for p in self.positional)
        self.var_positional = next((p.name for p in params if p.kind is p.VAR_POSITIONAL), None)
        self.grad_names = grad_names  # the names of the class's backward's parameters, after ctx
        self.copy_inputs = copy_inputs
        self.reentrant = reentrant  # gradients by .backward() without inputs, not torch.autograd.grad
        self.batching_rule = batching_rule
        self.has_jvp = has_jvp  # whether torch's forward AD can run the original
        self.once = once  # whether the original's backward is once_differentiable

    def arguments(self, values: Sequence[Any]) -> tuple[tuple, dict]:
        """The original's call for the bound values: what the caller passed, as it passed it."""
        return passed_arguments(self.positional_names, self.keyword_only, values, self.var_keyword)

    def value_names(self, n_values: int) -> tuple[str, ...]:
        """The parameter name of each bound value (``args[0]``, ... for ``*args``)."""
        n_extra = n_values - len(self.positional) - len(self.keyword_only)
        extra = tuple(f"{self.var_positional}[{i}]" for i in range(n_extra))
        return (*(p.name for p in self.positional), *extra, *self.keyword_only)

    def grad_output_names(self, n_outputs: int) -> tuple[str, ...]:
        """What each output's cotangent is called where the original's backward receives it."""
        names = tuple(f"grad_output {k}" if n_outputs > 1 else "grad_output" for k in range(n_outputs))
        if len(self.grad_names) == n_outputs:
            names = tuple(f"{n} ({g})" for n, g in zip(names, self.grad_names, strict=True))
        return names


def passed_arguments(positional: Sequence[str], keyword_only: Sequence[str], values: Sequence[Any],
                     var_keyword: str | None = None) -> tuple[tuple, dict]:
    """The call of an original for bound ``values`` (positional parameters, ``*args``, then keyword-only).

    What the caller passed, as it passed it: positional values up to the first
    one not passed (``UNSET``) go by position, later ones by name; an unpassed
    one is left to the original's own default. ``var_keyword``: the name of the
    keyword-only value holding a ``**kwargs`` dict, spread into the call.
    """
    n = len(values) - len(keyword_only)
    args: list = []
    kwargs: dict = {}
    gap = False
    for name, value in zip(positional, values, strict=False):
        if value is UNSET:
            gap = True
        elif gap:
            kwargs[name] = value
        else:
            args.append(value)
    args.extend(values[len(positional):n])  # *args: every positional parameter was passed
    for name, value in zip(keyword_only, values[n:], strict=True):
        if value is UNSET:
            continue
        if name == var_keyword:
            kwargs.update(value)
        else:
            kwargs[name] = value
    return tuple(args), kwargs


def packing_extra_keywords(params: list, var_keyword: str, apply: Callable) -> Callable:
    """``apply`` for an original taking ``**kwargs``: the keywords it does not name travel as one dict."""
    named = frozenset(p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))

    def packing_apply(*args: Any, **kwargs: Any) -> Any:
        extra = {k: kwargs.pop(k) for k in list(kwargs) if k not in named}
        if extra:
            kwargs[var_keyword] = extra
        return apply(*args, **kwargs)

    return packing_apply


def leaf_names(origin: Origin, layout: Partition) -> tuple[str, ...]:
    """The name of each array argument, as the caller wrote it: ``x``, ``args[1]``, ``kwargs['w']``."""
    values = jax.tree_util.tree_unflatten(layout.treedef, range(layout.treedef.num_leaves))
    names = origin.value_names(len(values))
    paths = [path for path, _ in jax.tree_util.tree_flatten_with_path(values)[0]]
    if len(paths) != layout.treedef.num_leaves:  # pragma: no cover - a pytree node that flattens differently
        return tuple(f"its input {k}" for k in range(len(layout.dynamic)))
    return tuple(f"its input {names[paths[i][0].idx]}{jax.tree_util.keystr(paths[i][1:])}" for i in layout.dynamic)


def named_tuples(tree: Any) -> Any:
    """``tree`` with each ``torch.return_types`` result (``torch.max(x, 1)``, ``sort``) a namedtuple.

    Those results are C struct sequences that JAX's pytrees do not see into;
    a namedtuple of the same name and fields keeps their values and names.
    """
    if isinstance(tree, tuple) and hasattr(type(tree), "n_fields") and hasattr(type(tree), "__match_args__"):
        return _namedtuple_of(type(tree))(*(named_tuples(x) for x in tree))
    if type(tree) in (tuple, list):
        return type(tree)(named_tuples(x) for x in tree)
    if type(tree) is dict:
        return {k: named_tuples(v) for k, v in tree.items()}
    return tree


@functools.lru_cache(maxsize=None)
def _namedtuple_of(cls: type) -> type:
    return collections.namedtuple(cls.__name__, cls.__match_args__)  # type: ignore[attr-defined]
