"""The original that ``from_torch`` runs, read once for both modes: what it defines, how to call it, and
what to call its arguments in errors.

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
import inspect
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
    """The original, read once for both modes: how to call it, what it defines, and how to name it in errors.

    ``Origin.of`` is the one place that reads a ``torch.autograd.Function``
    class (``forward``, ``setup_context``, ``backward``, ``jvp``, ``vmap``,
    ``once_differentiable``) or a callable; callback mode and trace mode both
    start from what it found.
    """

    def __init__(self, *, torch: Any, original: Any, is_class: bool, name: str, call: Callable, forward_name: str,
                 backward_name: str, parameters: Callable[[], list], copy_inputs: bool, reentrant: bool,
                 new_style: bool, differentiable: bool, batching_rule: bool, has_jvp: bool, once: bool,
                 grad_names: tuple = (), doc: str | None = None):
        self.torch = torch
        self.original = original  # the class or callable from_torch was given
        self.is_class = is_class
        self.name = name
        self.call = call
        self.forward_name = forward_name
        self.backward_name = backward_name
        self._parameters = parameters
        self.grad_names = grad_names  # the names of the class's backward's parameters, after ctx
        self.copy_inputs = copy_inputs
        self.reentrant = reentrant  # gradients by .backward() without inputs, not torch.autograd.grad
        self.new_style = new_style  # forward without ctx, and a setup_context
        self.differentiable = differentiable  # whether the original has a backward (a callable: torch autograd)
        self.batching_rule = batching_rule  # the class's own vmap rule (torch.func.vmap needs setup_context)
        self.has_jvp = has_jvp  # whether torch's forward AD can run the original
        self.once = once  # whether the original's backward is once_differentiable
        self.doc = doc

    @classmethod
    def of(cls, torch: Any, obj: Any, *, copy_inputs: bool = False, reentrant: bool = False) -> Origin:
        """``obj``, a ``torch.autograd.Function`` subclass or a callable of tensors, as both modes see it."""
        base = torch.autograd.Function
        if not (isinstance(obj, type) and issubclass(obj, base)):
            name = getattr(obj, "__name__", type(obj).__name__).replace("<lambda>", "lambda")
            return cls(torch=torch, original=obj, is_class=False, name=name, call=obj, forward_name=name,
                       backward_name=f"{name} (torch autograd)",
                       parameters=lambda: list(inspect.signature(obj).parameters.values()),
                       copy_inputs=copy_inputs, reentrant=reentrant, new_style=False, differentiable=True,
                       batching_rule=False, has_jvp=True,  # torch's own forward derivatives of its operations
                       once=False, doc=obj.__doc__)
        original: Any = obj  # a torch.autograd.Function subclass
        name = original.__name__
        new_style = defines(original, base, "setup_context")
        backward = original.backward if defines(original, base, "backward") else None
        return cls(
            torch=torch, original=original, is_class=True, name=name, call=original.apply,
            forward_name=f"{name}.forward", backward_name=f"{name}.backward",
            # forward(ctx, ...) unless setup_context takes the ctx
            parameters=lambda: list(inspect.signature(original.forward).parameters.values())[0 if new_style else 1:],
            copy_inputs=copy_inputs, reentrant=reentrant, new_style=new_style, differentiable=backward is not None,
            batching_rule=new_style and (defines(original, base, "vmap")
                                         or bool(getattr(original, "generate_vmap_rule", False))),
            has_jvp=defines(original, base, "jvp"),
            once=backward is not None and is_torch_once_differentiable(backward),
            grad_names=_grad_names(backward), doc=original.__doc__,
        )

    @functools.cached_property
    def params(self) -> list:
        """The original's parameters (a class's ``forward``'s, after ``ctx``)."""
        return self._parameters()

    @functools.cached_property
    def var_keyword(self) -> str | None:
        """The ``**kwargs`` parameter, which becomes one keyword-only argument holding a dict of the extra keywords."""
        return next((p.name for p in self.params if p.kind is p.VAR_KEYWORD), None)

    @functools.cached_property
    def forward_params(self) -> list:
        """The generated ``forward``'s parameters: every default ``UNSET``, ``**kwargs`` keyword-only."""
        return [
            p.replace(kind=p.KEYWORD_ONLY, default=UNSET) if p.kind is p.VAR_KEYWORD
            else p if p.default is p.empty else p.replace(default=UNSET)
            for p in self.params
        ]

    @functools.cached_property
    def keyword_only(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.forward_params if p.kind is p.KEYWORD_ONLY)

    @functools.cached_property
    def positional(self) -> tuple:
        return tuple(p for p in self.params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD))

    @functools.cached_property
    def positional_names(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.positional)

    @functools.cached_property
    def var_positional(self) -> str | None:
        return next((p.name for p in self.params if p.kind is p.VAR_POSITIONAL), None)

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


def defines(cls: type, base: type, method: str) -> bool:
    """Whether ``cls`` defines (or inherits from below ``base``) its own ``method``."""
    return getattr(cls, method, None) is not getattr(base, method, None)


def is_torch_once_differentiable(backward: Any) -> bool:
    """torch.autograd.function.once_differentiable leaves no marker but its wrapper's code."""
    code = getattr(backward, "__code__", None)
    return (code is not None and hasattr(backward, "__wrapped__")
            and code.co_filename.replace("\\", "/").endswith("torch/autograd/function.py"))


def _grad_names(backward: Any) -> tuple[str, ...]:
    """The names of ``backward``'s gradient parameters (after ctx), or none for ``*grads``."""
    if backward is None:
        return ()
    try:
        grad_params = list(inspect.signature(backward).parameters.values())[1:]  # backward(ctx, ...)
    except (TypeError, ValueError):  # pragma: no cover - a builtin without a signature
        return ()
    if any(p.kind is p.VAR_POSITIONAL for p in grad_params):
        return ()
    return tuple(p.name for p in grad_params)
