"""``from_torch(..., mode="trace")``: a PyTorch original run as JAX operations, compiled by XLA.

For example:

```python
Exp = vjpkit.from_torch(TExp, mode="trace")     # TExp's forward and backward as jax.numpy
jax.make_jaxpr(jax.grad(lambda x: Exp.apply(x).sum()))(x)   # no callback in it
```

The original's methods run once per compiled signature on stand-in tensors
(``TracedTensor``, a ``torch.Tensor`` subclass over a ``meta`` tensor that
holds a JAX value). Every torch call on them reaches ``__torch_function__``,
which first runs the call on the meta tensors (so torch decides shapes,
dtypes, type promotion and defaults) and then computes the values with the
rule of the op table (``ops.RULES``). A call without a rule, or code that needs a
value (``.item()``, ``if x.any():``, ``.numpy()``), raises ``Untraceable``
naming it; ``mode="auto"`` then runs that original through host callbacks.

- A ``torch.autograd.Function`` class becomes a vjpkit Function whose
  ``forward``, ``setup_context``, ``backward`` and ``jvp`` run the
  original's on stand-ins, with a ctx (``TracedCtx``) that passes
  ``save_for_backward``, ``mark_non_differentiable``, attributes and
  ``needs_input_grad`` to vjpkit's ctx: vjpkit's contract holds as for a port.
- A callable becomes a jitted JAX function that JAX differentiates.

Torch's autograd semantics are kept: each stand-in that requires grad
carries a ``Node`` (how its value was computed), ``detach``, ``no_grad``
and kin give ``stop_gradient`` values, and ``torch.autograd.grad`` replays
the recorded nodes as a JAX function and takes its VJP.

In-place operations replace the stand-in's value (JAX values are
immutable). A view remembers the writes of its tensor when it was taken:
reading it after a later write, or writing into it, would need aliasing
and raises ``Untraceable``.

This module holds the dispatching stand-in and one torch call on it, over
what a stand-in holds (``standin.py``); the calls answered without a rule
(autograd, devices, value reads) are ``special.py``'s, and the traced
Function, callable and ``"auto"`` choice ``traced.py``'s.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import torch
from jax import lax
from torch.overrides import resolve_name

from . import special
from .dtypes import jax_dtype
from .ops import RULES, VIEWS, Untraceable, set_item
from .standin import (
    Node,
    StandIn,
    check_no_nested_function,
    differentiable,
    differentiating,
    is_tensor,
    map_tensors,
    read,
    set_requires_grad,
    to_jax,
    to_meta,
)

__all__ = ["TracedTensor", "dispatch", "make", "stand_in", "stand_ins"]

# Tensor members that read metadata only: answered by the meta tensor underneath.
METADATA = {f"torch.Tensor.{name}" for name in (
    "shape.__get__", "dtype.__get__", "ndim.__get__", "layout.__get__", "names.__get__", "is_sparse.__get__",
    "is_quantized.__get__", "is_nested.__get__", "size", "dim", "numel", "nelement", "__len__", "is_floating_point",
    "is_complex", "is_signed", "element_size", "stride", "is_contiguous", "__hash__", "ndimension",
    "itemsize.__get__", "nbytes.__get__", "is_inference", "storage_offset",
)} | {f"torch.{name}" for name in ("is_floating_point", "is_complex", "numel", "is_signed", "is_inference")}


class TracedTensor(StandIn):
    """A stand-in torch tensor: every torch call on it reaches ``dispatch``."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        return dispatch(func, args, kwargs or {})


def stand_in(value: Any, meta: torch.Tensor, requires_grad: bool = False) -> TracedTensor:
    """A fresh stand-in holding ``value`` (of ``meta``'s shape and dtype): an argument, a saved tensor.

    A leaf that requires grad where asked, or wherever JAX differentiates the method, for
    floating dtypes (torch's rule for a method's arguments).
    """
    grad = (requires_grad or differentiating()) and differentiable(meta.dtype)
    return make(value, meta, Node(None, (), value) if grad else None)


def make(value: Any, meta: torch.Tensor, node: Node | None) -> TracedTensor:
    t = torch.Tensor._make_subclass(TracedTensor, meta, node is not None)
    t._stored, t._meta, t._node, t._view_of = value, meta, node, None
    t._seen = t._writes = 0
    t._view_op = t._last_write = ""
    return t


# ---------------------------------------------------------------------------
# One torch call on stand-ins.


def dispatch(func: Any, args: tuple, kwargs: dict) -> Any:
    """One torch call on stand-ins: metadata from the meta tensors, a call answered without a rule, or a rule."""
    name = torch_name(func)
    if name in METADATA:
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)
    if name in SPECIAL:
        return SPECIAL[name](*args, **kwargs)
    check_no_nested_function(name, args)
    if name == "torch.Tensor.__setitem__" or (name.endswith("_") and not name.endswith("__")):
        return _in_place(name, func, args, kwargs)
    rule = RULES.get(name)
    if rule is None:
        raise Untraceable(name)
    if "out" in kwargs:
        if kwargs["out"] is not None:
            raise Untraceable(name, "writes its result into out=, which trace mode does not model (assign the result)")
        kwargs = {k: v for k, v in kwargs.items() if k != "out"}
    metas, meta_kwargs = map_tensors(to_meta, args), map_tensors(to_meta, kwargs)
    try:
        out = func(*metas, **meta_kwargs)  # torch's shapes, dtypes and errors
    except NotImplementedError as e:
        raise Untraceable(name, f"cannot run on torch's meta tensors ({e})") from e
    extra = {"_metas": metas[:2]} if getattr(rule, "wants_metas", False) else {}
    operands, template = _operands((args, kwargs))

    def compute(values: list) -> Any:
        a, k = _filled(template, values)
        return rule(out, *a, **k, **extra)

    result = stand_ins(name, out, compute, operands)
    if name in VIEWS and not (name.endswith("__getitem__") and _advanced_index(args[1])):
        root = args[0]._view_of if args[0]._view_of is not None else args[0]
        for t in jax.tree_util.tree_leaves(result, is_leaf=is_tensor):
            if isinstance(t, TracedTensor):
                t._view_of, t._seen, t._view_op = root, root._writes, name
    return result


def torch_name(func: Any) -> str:
    """``torch.overrides.resolve_name``'s name; a Python function it does not know by module and name."""
    name = resolve_name(func)
    if name is None:
        if func is torch.autograd.grad or func is torch.autograd.backward:
            return f"torch.autograd.{func.__name__}"
        return getattr(func, "__qualname__", repr(func))
    # resolve_name(torch.mm) is "torch.spmm" (one object of torch's, two names); torch.spmm is sparse.
    return "torch.mm" if name == "torch.spmm" and getattr(func, "__name__", "") == "mm" else name


def _advanced_index(index: Any) -> bool:
    """Whether a torch index copies (a tensor, a list, a bool) rather than views."""
    parts = index if isinstance(index, tuple) else (index,)
    return any(isinstance(p, (torch.Tensor, list, bool)) for p in parts)


class _Slot:
    """Where the k-th traced tensor stands among a call's arguments."""

    __slots__ = ("k",)

    def __init__(self, k: int):
        self.k = k


def _operands(tree: Any) -> tuple[list, Any]:
    """The traced tensors in ``tree``, and ``tree`` with slots in their places (torch constants as JAX)."""
    operands: list = []

    def slot(x: Any) -> Any:
        if isinstance(x, TracedTensor):
            operands.append(x)
            return _Slot(len(operands) - 1)
        return to_jax(x)

    return operands, map_tensors(slot, tree)


def _filled(template: Any, values: list) -> Any:
    return map_tensors(lambda x: values[x.k] if isinstance(x, _Slot) else x, template)


def stand_ins(name: str, out: Any, compute: Callable[[list], Any], operands: list) -> Any:
    """``compute``'s values as stand-ins shaped as torch's ``out``, each with its autograd node.

    An output requires grad, as in torch, where grad mode is on and an operand requires grad.
    Where JAX differentiates the method, an output that does not is a ``stop_gradient``
    (``detach``, ``no_grad``): torch passes no gradient through it.
    """
    values = [read(t) for t in operands]
    try:
        value = compute(values)
    except Untraceable:
        raise
    except Exception as e:  # noqa: BLE001 - a rule's own failure: a refusal naming the op, not a crash
        raise Untraceable(name, f"failed in vjpkit's rule for it ({type(e).__name__}: {str(e)[:200]}); "
                          "please report it (mode='callback' or 'auto' runs the original meanwhile)") from e
    tracked = [k for k, t in enumerate(operands) if t._node is not None] if torch.is_grad_enabled() else []

    def node_for(path: tuple, meta: torch.Tensor, value: Any) -> Node | None:
        if not tracked or not differentiable(meta.dtype):
            return None

        def fn(*parent_values: Any) -> Any:
            again = list(values)
            for k, v in zip(tracked, parent_values, strict=True):
                again[k] = v
            return _cast_checked(name, _at(compute(again), path), meta)

        return Node(fn, tuple(operands[k]._node for k in tracked), value, name)

    return _wrap_like(name, out, value, node_for)


def _at(tree: Any, path: tuple) -> Any:
    for i in path:
        tree = tree[i]
    return tree


def _cast_checked(name: str, value: Any, meta: torch.Tensor) -> Any:
    value = jnp.asarray(value)
    dtype = jax_dtype(meta.dtype)
    if value.dtype != dtype:
        value = value.astype(dtype)
    if tuple(value.shape) != tuple(meta.shape):
        raise Untraceable(name, f"computed shape {tuple(value.shape)} in vjpkit's rule where torch computes "
                          f"{tuple(meta.shape)}: a bug in the rule; please report it (mode='callback' or 'auto' "
                          "runs the original meanwhile)")
    return value


def _wrap_like(name: str, out: Any, value: Any, node_for: Callable, path: tuple = ()) -> Any:
    """The rule's values as stand-ins, cast to torch's dtypes and checked against torch's shapes."""
    if isinstance(out, torch.Tensor):
        value = _cast_checked(name, value, out)
        node = node_for(path, out, value)
        if node is None and differentiating() and differentiable(out.dtype):
            value = lax.stop_gradient(value)
        return make(value, out, node)
    if isinstance(out, (tuple, list)):
        items = [_wrap_like(name, o, v, node_for, (*path, i))
                 for i, (o, v) in enumerate(zip(out, value, strict=True))]
        return type(out)(items) if hasattr(out, "n_fields") or isinstance(out, list) else tuple(items)
    return out


def _in_place(name: str, func: Any, args: tuple, kwargs: dict) -> Any:
    """``x.add_(y)``, ``x[i] = y``: the stand-in gets the new value, as a JAX functional update."""
    target = args[0]
    if not isinstance(target, TracedTensor):
        raise Untraceable(name, "writes a traced value into a torch tensor that is not traced")
    if target._view_of is not None:
        raise Untraceable(name, f"writes into a view (taken by {target._view_op}), which in torch writes into the "
                          "tensor it views too; JAX values do not alias (write into that tensor, by index)")
    meta = target._meta  # the tensor's metadata after the write
    if name == "torch.Tensor.__setitem__":
        def compute(values: list) -> Any:
            (_, index, value), _ = _filled(template, values)
            return set_item(values[0], index, value)
    else:
        base = name.removesuffix("_")
        if base not in _FILLS and base not in RULES:
            raise Untraceable(name)
        metas, meta_kwargs = map_tensors(to_meta, args), map_tensors(to_meta, kwargs)
        func(metas[0].clone(), *metas[1:], **meta_kwargs)  # torch's checks: broadcasting, casting
        if base in _FILLS:
            def compute(values: list) -> Any:
                a, k = _filled(template, values)
                return _FILLS[base](*a, **k)
        else:
            rule = RULES.get(base)
            if rule is None:
                raise Untraceable(name)
            out = getattr(torch.Tensor, base.rsplit(".", 1)[1])(*metas, **meta_kwargs)
            if not isinstance(out, torch.Tensor):
                raise Untraceable(name, "has no traced in-place form")
            if tuple(out.shape) != tuple(target._meta.shape):  # squeeze_, unsqueeze_, t_, transpose_
                if target._node is not None and not torch.is_grad_enabled():
                    raise Untraceable(name, "changes the shape of a tensor that requires grad under no_grad")
                with torch._C.DisableTorchFunctionSubclass(), torch.no_grad():
                    func(target, *metas[1:], **meta_kwargs)  # the stand-in's own sizes and strides
                meta = out.to(target._meta.dtype)
            rule_out = out

            def compute(values: list) -> Any:
                a, k = _filled(template, values)
                return rule(rule_out, *a, **k)
    operands, template = _operands((args, kwargs))
    values = [read(t) for t in operands]
    shape, dtype = tuple(meta.shape), jax_dtype(meta.dtype)

    def new_value(values: list) -> Any:
        return jnp.broadcast_to(jnp.asarray(compute(values)).astype(dtype), shape)

    try:
        value = new_value(values)
    except Untraceable:
        raise
    except Exception as e:  # noqa: BLE001 - as in stand_ins
        raise Untraceable(name, f"failed in vjpkit's rule for it ({type(e).__name__}: {str(e)[:200]}); "
                          "please report it (mode='callback' or 'auto' runs the original meanwhile)") from e
    grad_on = torch.is_grad_enabled()
    tracked = [k for k, t in enumerate(operands) if t._node is not None] if grad_on else []
    old = target._node
    node: Node | None = None
    if tracked and differentiable(meta.dtype):
        def fn(*parent_values: Any) -> Any:
            again = list(values)
            for k, v in zip(tracked, parent_values, strict=True):
                again[k] = v
            return new_value(again)

        node = Node(fn, tuple(operands[k]._node for k in tracked), value, name)
    elif old is not None:
        # Written under no_grad, it still requires grad, and gradients pass the write as the identity.
        delta = lax.stop_gradient(value - values[0])
        value = values[0] + delta
        node = Node(None, (), value, name) if old.fn is None else Node(lambda p: p + delta, (old,), value, name)
    elif differentiating() and differentiable(meta.dtype):
        value = lax.stop_gradient(value)
    target._stored, target._meta = value, meta
    if (node is None) != (old is None):
        set_requires_grad(target, node)
    target._node = node
    target._writes += 1
    target._last_write = name
    return target


_FILLS: dict[str, Callable] = {
    "torch.Tensor.zero": lambda x: jnp.zeros_like(x),
    "torch.Tensor.fill": lambda x, value: jnp.full_like(x, value),
    "torch.Tensor.copy": lambda x, src, non_blocking=False: jnp.broadcast_to(src, x.shape),
}


# The calls answered without a rule (autograd, devices, casts, value reads): ``special``'s, given how this
# module makes a stand-in and one call's stand-in results.
SPECIAL: dict[str, Callable] = special.calls(make, stand_ins)
