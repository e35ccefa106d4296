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
rule of ``_torch_ops.RULES``. A call without a rule, or code that needs a
value (``.item()``, ``if x.any():``, ``.numpy()``), raises ``Untraceable``
naming it; ``mode="auto"`` then runs that original through host callbacks.

- A ``torch.autograd.Function`` class becomes a vjpkit Function whose
  ``forward``, ``setup_context``, ``backward`` and ``jvp`` run the
  original's on stand-ins, with a ctx (``TracedCtx``) that passes
  ``save_for_backward``, ``mark_non_differentiable``, attributes and
  ``needs_input_grad`` to vjpkit's ctx: vjpkit's contract holds as for a port.
- A callable becomes a jitted JAX function that JAX differentiates.

Torch's autograd semantics are kept: each stand-in that requires grad
carries a ``_Node`` (how its value was computed), ``detach``, ``no_grad``
and kin give ``stop_gradient`` values, and ``torch.autograd.grad`` replays
the recorded nodes as a JAX function and takes its VJP.

In-place operations replace the stand-in's value (JAX values are
immutable). A view remembers the writes of its tensor when it was taken:
reading it after a later write, or writing into it, would need aliasing
and raises ``Untraceable``.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import linecache
import os
from typing import Any, Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax import lax
from torch.overrides import resolve_name

from . import _caches, _jax_internals
from ._ctx import FunctionCtx
from ._from_torch import defines, is_torch_once_differentiable
from ._function import Function
from ._once import once_differentiable
from ._torch_ops import RULES, VIEWS, Untraceable, jax_dtype, set_item
from ._torch_original import UNSET, named_tuples
from ._tree import is_array, partition

__all__ = ["Either", "TracedTensor", "Untraceable", "auto", "trace_callable", "trace_function_class", "traced"]

# Tensor members that read metadata only: answered by the meta tensor underneath.
_METADATA = {f"torch.Tensor.{name}" for name in (
    "shape.__get__", "dtype.__get__", "ndim.__get__", "layout.__get__", "names.__get__", "is_sparse.__get__",
    "is_quantized.__get__", "is_nested.__get__", "size", "dim", "numel", "nelement", "__len__", "is_floating_point",
    "is_complex", "is_signed", "element_size", "stride", "is_contiguous", "__hash__", "ndimension",
    "itemsize.__get__", "nbytes.__get__", "is_inference", "storage_offset",
)} | {f"torch.{name}" for name in ("is_floating_point", "is_complex", "numel", "is_signed", "is_inference")}


class _Node:
    """A tensor that requires grad, as torch's autograd sees it: its value, and how to compute it again.

    ``fn`` computes the value from the ``parents``' values (``None`` for a leaf).
    ``torch.autograd.grad`` replays the nodes between its inputs and outputs as
    one JAX function and takes its VJP (``_autograd_grad``).
    """

    __slots__ = ("fn", "parents", "value", "name")

    def __init__(self, fn: Callable | None, parents: tuple, value: Any, name: str = ""):
        self.fn, self.parents, self.value, self.name = fn, parents, value, name


class TracedTensor(torch.Tensor):
    """A stand-in torch tensor: torch's metadata from a meta tensor, its value a JAX array (or tracer)."""

    _stored: Any  # the JAX value (read it with ``_read``, which checks a view is still current)
    _meta: torch.Tensor  # a plain meta tensor of the same shape and dtype, for torch's own checks
    _node: _Node | None  # torch's autograd: None where the tensor does not require grad
    _view_of: TracedTensor | None  # a view's tensor: the one whose storage it shares in torch
    _seen: int  # a view's: its base's in-place writes when the view was taken
    _writes: int  # in-place writes into this tensor
    _view_op: str  # a view's: the operation that took it
    _last_write: str  # the operation that last wrote into this tensor in place

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        return _dispatch(func, args, kwargs or {})


_state = {"grad": False}  # whether JAX differentiates the running method (backward, jvp, a callable)


def _differentiable(dtype: Any) -> bool:
    return dtype.is_floating_point or dtype.is_complex


def stand_in(value: Any, meta: torch.Tensor, requires_grad: bool = False) -> TracedTensor:
    """A fresh stand-in holding ``value`` (of ``meta``'s shape and dtype): an argument, a saved tensor.

    A leaf that requires grad where asked, or wherever JAX differentiates the method, for
    floating dtypes (torch's rule for a method's arguments).
    """
    grad = (requires_grad or _state["grad"]) and _differentiable(meta.dtype)
    return _make(value, meta, _Node(None, (), value) if grad else None)


def _make(value: Any, meta: torch.Tensor, node: _Node | None) -> TracedTensor:
    t = torch.Tensor._make_subclass(TracedTensor, meta, node is not None)
    t._stored, t._meta, t._node, t._view_of = value, meta, node, None
    t._seen = t._writes = 0
    t._view_op = t._last_write = ""
    return t


def _read(t: TracedTensor) -> Any:
    """``t``'s value. A view read after its base was written in place would show the write in torch."""
    base = t._view_of
    if base is not None and base._writes != t._seen:
        raise Untraceable(base._last_write, f"writes into a tensor that a view was taken from (by {t._view_op}), "
                          "and the view is read afterwards: in torch the two share memory, JAX values do not "
                          "(clone the view, or take it after the write)")
    return t._stored


def _set_requires_grad(t: TracedTensor, node: _Node | None) -> None:
    t._node = node
    with torch._C.DisableTorchFunctionSubclass():
        torch.Tensor.requires_grad_(t, node is not None)


def torch_dtype(dtype: Any) -> Any:
    name = np.dtype(dtype).name
    return {"bool": torch.bool, "bfloat16": torch.bfloat16}.get(name) or getattr(torch, name)


def meta_of(value: Any, dtype: Any = None) -> torch.Tensor:
    return torch.empty(tuple(value.shape), dtype=dtype or torch_dtype(value.dtype), device="meta")


# ---------------------------------------------------------------------------
# One torch call on stand-ins.


def _dispatch(func: Any, args: tuple, kwargs: dict) -> Any:
    name = _name(func)
    if name in _METADATA:
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)
    if name in _SPECIAL:
        return _SPECIAL[name](*args, **kwargs)
    _check_no_nested_function(name, args)
    if name == "torch.Tensor.__setitem__" or (name.endswith("_") and not name.endswith("__")):
        return _in_place(name, func, args, kwargs)
    rule = RULES.get(name)
    if rule is None:
        raise Untraceable(name)
    if "out" in kwargs:
        if kwargs["out"] is not None:
            raise Untraceable(name, "writes its result into out=, which trace mode does not model (assign the result)")
        kwargs = {k: v for k, v in kwargs.items() if k != "out"}
    metas, meta_kwargs = _tree(_to_meta, args), _tree(_to_meta, kwargs)
    try:
        out = func(*metas, **meta_kwargs)  # torch's shapes, dtypes and errors
    except NotImplementedError as e:
        raise Untraceable(name, f"cannot run on torch's meta tensors ({e})") from e
    extra = {"_metas": metas[:2]} if getattr(rule, "wants_metas", False) else {}
    operands, template = _operands((args, kwargs))

    def compute(values: list) -> Any:
        a, k = _filled(template, values)
        return rule(out, *a, **k, **extra)

    result = _results(name, out, compute, operands)
    if name in VIEWS and not (name.endswith("__getitem__") and _advanced_index(args[1])):
        root = args[0]._view_of if args[0]._view_of is not None else args[0]
        for t in jax.tree_util.tree_leaves(result, is_leaf=_is_tensor):
            if isinstance(t, TracedTensor):
                t._view_of, t._seen, t._view_op = root, root._writes, name
    return result


def _name(func: Any) -> str:
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
        return _to_jax(x)

    return operands, _tree(slot, tree)


def _filled(template: Any, values: list) -> Any:
    return _tree(lambda x: values[x.k] if isinstance(x, _Slot) else x, template)


def _results(name: str, out: Any, compute: Callable[[list], Any], operands: list) -> Any:
    """``compute``'s values as stand-ins shaped as torch's ``out``, each with its autograd node.

    An output requires grad, as in torch, where grad mode is on and an operand requires grad.
    Where JAX differentiates the method, an output that does not is a ``stop_gradient``
    (``detach``, ``no_grad``): torch passes no gradient through it.
    """
    values = [_read(t) for t in operands]
    try:
        value = compute(values)
    except Untraceable:
        raise
    except Exception as e:  # noqa: BLE001 - a rule's own failure: a refusal naming the op, not a crash
        raise Untraceable(name, f"failed in vjpkit's rule for it ({type(e).__name__}: {str(e)[:200]}); "
                          "please report it (mode='callback' or 'auto' runs the original meanwhile)") from e
    tracked = [k for k, t in enumerate(operands) if t._node is not None] if torch.is_grad_enabled() else []

    def node_for(path: tuple, meta: torch.Tensor, value: Any) -> _Node | None:
        if not tracked or not _differentiable(meta.dtype):
            return None

        def fn(*parent_values: Any) -> Any:
            again = list(values)
            for k, v in zip(tracked, parent_values, strict=True):
                again[k] = v
            return _cast_checked(name, _at(compute(again), path), meta)

        return _Node(fn, tuple(operands[k]._node for k in tracked), value, name)

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
        if node is None and _state["grad"] and _differentiable(out.dtype):
            value = lax.stop_gradient(value)
        return _make(value, out, node)
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
        metas, meta_kwargs = _tree(_to_meta, args), _tree(_to_meta, kwargs)
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
    values = [_read(t) for t in operands]
    shape, dtype = tuple(meta.shape), jax_dtype(meta.dtype)

    def new_value(values: list) -> Any:
        return jnp.broadcast_to(jnp.asarray(compute(values)).astype(dtype), shape)

    try:
        value = new_value(values)
    except Untraceable:
        raise
    except Exception as e:  # noqa: BLE001 - as in _results
        raise Untraceable(name, f"failed in vjpkit's rule for it ({type(e).__name__}: {str(e)[:200]}); "
                          "please report it (mode='callback' or 'auto' runs the original meanwhile)") from e
    grad_on = torch.is_grad_enabled()
    tracked = [k for k, t in enumerate(operands) if t._node is not None] if grad_on else []
    old = target._node
    node: _Node | None = None
    if tracked and _differentiable(meta.dtype):
        def fn(*parent_values: Any) -> Any:
            again = list(values)
            for k, v in zip(tracked, parent_values, strict=True):
                again[k] = v
            return new_value(again)

        node = _Node(fn, tuple(operands[k]._node for k in tracked), value, name)
    elif old is not None:
        # Written under no_grad, it still requires grad, and gradients pass the write as the identity.
        delta = lax.stop_gradient(value - values[0])
        value = values[0] + delta
        node = _Node(None, (), value, name) if old.fn is None else _Node(lambda p: p + delta, (old,), value, name)
    elif _state["grad"] and _differentiable(meta.dtype):
        value = lax.stop_gradient(value)
    target._stored, target._meta = value, meta
    if (node is None) != (old is None):
        _set_requires_grad(target, node)
    target._node = node
    target._writes += 1
    target._last_write = name
    return target


_FILLS: dict[str, Callable] = {
    "torch.Tensor.zero": lambda x: jnp.zeros_like(x),
    "torch.Tensor.fill": lambda x, value: jnp.full_like(x, value),
    "torch.Tensor.copy": lambda x, src, non_blocking=False: jnp.broadcast_to(src, x.shape),
}


def _check_no_nested_function(name: str, args: tuple) -> None:
    """A ``torch.autograd.Function``'s ``apply`` inside a traced method runs in torch's C++, out of reach.

    Under grad mode (backward, a callable) its outputs carry its autograd node,
    and JAX would differentiate its forward's operations instead of running
    its backward; outputs that are plain meta tensors have no value. Both
    name the Function. (In a traced forward, which runs without grad as in
    torch, a nested Function's forward runs inline: its backward is never used.)
    """
    if not _state["grad"]:
        return
    for arg in jax.tree_util.tree_leaves(args, is_leaf=_is_tensor):
        if not isinstance(arg, torch.Tensor):
            continue
        with torch._C.DisableTorchFunctionSubclass():
            node = arg.grad_fn
        if node is not None or (arg.is_meta and not isinstance(arg, TracedTensor)):
            inner = getattr(type(node), "_forward_cls", None)
            what = f"{inner.__name__}.apply" if inner is not None else "a tensor with no traced value"
            raise Untraceable(what, "(a torch.autograd.Function called inside the original) runs in torch's "
                              f"C++ autograd, out of the trace's reach; its output reached {name}")


# ---------------------------------------------------------------------------
# Autograd: detach, requires_grad_, torch.autograd.grad.


def _view(name: str, t: TracedTensor, value: Any, node: _Node | None) -> TracedTensor:
    root = t._view_of if t._view_of is not None else t
    v = _make(value, t._meta, node)
    v._view_of, v._seen, v._view_op = root, root._writes, name
    return v


def _detach(t: TracedTensor) -> TracedTensor:
    """``x.detach()``, ``x.data``: the same storage, no gradient (``stop_gradient``)."""
    value = _read(t)
    return _view("torch.Tensor.detach", t, lax.stop_gradient(value) if _differentiable(t._meta.dtype) else value,
                 None)


def _detach_(t: TracedTensor) -> TracedTensor:
    if t._view_of is not None:
        raise Untraceable("torch.Tensor.detach_", f"detaches a view (taken by {t._view_op}) in place")
    if _differentiable(t._meta.dtype):
        t._stored = lax.stop_gradient(_read(t))
    if t._node is not None:
        _set_requires_grad(t, None)
    return t


def _requires_grad_(t: TracedTensor, requires_grad: bool = True) -> TracedTensor:
    if requires_grad and t._node is None:
        if not _differentiable(t._meta.dtype):
            raise RuntimeError("only Tensors of floating point and complex dtype can require gradients")
        _set_requires_grad(t, _Node(None, (), _read(t), "leaf"))
    elif not requires_grad and t._node is not None:
        if t._node.fn is not None:
            raise RuntimeError("you can only change requires_grad flags of leaf variables. If you want to use a "
                               "computed variable in a subgraph that doesn't require differentiation use "
                               "var_no_grad = var.detach().")
        if _state["grad"]:
            t._stored = lax.stop_gradient(_read(t))
        _set_requires_grad(t, None)
    return t


class _TracedGradFn:
    """What ``x.grad_fn`` is for a traced tensor computed with grad: the operation's name."""

    def __init__(self, name: str):
        self._name = name

    def name(self) -> str:
        return self._name

    def __repr__(self) -> str:
        return f"<traced {self._name}>"


def _grad_fn(t: TracedTensor) -> Any:
    return None if t._node is None or t._node.fn is None else _TracedGradFn(t._node.name)


def _sequence(x: Any) -> tuple:
    return (x,) if isinstance(x, torch.Tensor) else tuple(x)


def _autograd_grad(outputs: Any, inputs: Any, grad_outputs: Any = None, retain_graph: Any = None,
                   create_graph: bool = False, only_inputs: bool = True, allow_unused: Any = None,
                   is_grads_batched: bool = False, materialize_grads: bool = False) -> tuple:
    """``torch.autograd.grad`` on traced tensors: the VJP of the replayed nodes from ``inputs`` to ``outputs``.

    With ``create_graph`` the gradients are nodes too (of the leaves they depend on), so a
    second ``torch.autograd.grad`` differentiates them; without, they are constants, as in torch.
    """
    outputs, inputs = _sequence(outputs), _sequence(inputs)
    if is_grads_batched:
        raise Untraceable("torch.autograd.grad(is_grads_batched=True)", "has no traced form (use jax.vmap outside)")
    if materialize_grads and allow_unused is False:
        raise ValueError("Expected allow_unused to be True or not passed when materialize_grads=True, "
                         "but got: allow_unused=False.")
    allow_unused = materialize_grads if allow_unused is None else allow_unused
    grad_outputs = (None,) * len(outputs) if grad_outputs is None else _sequence(grad_outputs)
    for i, o in enumerate(outputs):
        if not isinstance(o, TracedTensor) or o._node is None:
            raise RuntimeError(f"element {i} of tensors does not require grad and does not have a grad_fn")
    for x in inputs:
        if not isinstance(x, TracedTensor) or x._node is None:
            raise RuntimeError("One of the differentiated Tensors does not require grad")
    cotangents: list = []
    for o, g in zip(outputs, grad_outputs, strict=True):
        if g is None:
            if o._meta.numel() != 1:
                raise RuntimeError("grad can be implicitly created only for scalar outputs")
            cotangents.append(jnp.ones(tuple(o._meta.shape), jax_dtype(o._meta.dtype)))
        else:
            cotangents.append(g)
    out_nodes, in_nodes = [o._node for o in outputs], [x._node for x in inputs]
    reached = _ancestors(out_nodes)
    used = [id(n) in reached for n in in_nodes]
    if not all(used) and not allow_unused:
        raise RuntimeError("One of the differentiated Tensors appears to not have been used in the graph. "
                           "Set allow_unused=True if this is the desired behavior.")
    dtypes = [jax_dtype(o._meta.dtype) for o in outputs]

    def gradients(input_values: list, ct_values: list, subst: dict) -> list:
        def of(*xs: Any) -> list:
            return _replay(out_nodes, {**subst, **{id(n): x for n, x in zip(in_nodes, xs, strict=True)}})

        _, pullback = jax.vjp(of, *input_values)
        return list(pullback([jnp.asarray(c).astype(d) for c, d in zip(ct_values, dtypes, strict=True)]))

    ct_values = [_read(c) if isinstance(c, TracedTensor) else _to_jax(c) for c in cotangents]
    found = gradients([_read(x) for x in inputs], ct_values, {})
    nodes: list = [None] * len(inputs)
    if create_graph:
        ct_nodes = [c._node if isinstance(c, TracedTensor) else None for c in cotangents]
        leaves = _leaves([*out_nodes, *in_nodes, *(n for n in ct_nodes if n is not None)])

        def again(*leaf_values: Any) -> list:
            subst = {id(n): v for n, v in zip(leaves, leaf_values, strict=True)}
            cts = [v if n is None else _replay([n], subst)[0] for v, n in zip(ct_values, ct_nodes, strict=True)]
            return gradients(_replay(in_nodes, subst), cts, subst)

        nodes = [_Node(lambda *lv, i=i: again(*lv)[i], tuple(leaves), g, "torch.autograd.grad") if u else None
                 for i, (g, u) in enumerate(zip(found, used, strict=True))]
    results: list[Any] = []
    for x, g, u, node in zip(inputs, found, used, nodes, strict=True):
        if not u and not materialize_grads:
            results.append(None)
            continue
        value = g if node is not None else lax.stop_gradient(g)
        results.append(_make(value, x._meta, node))
    return tuple(results)


def _ancestors(nodes: list) -> set:
    seen: set = set()
    stack = list(nodes)
    while stack:
        n = stack.pop()
        if id(n) not in seen:
            seen.add(id(n))
            stack.extend(n.parents)
    return seen


def _leaves(nodes: list) -> list:
    found, seen, stack = [], set(), list(nodes)
    while stack:
        n = stack.pop()
        if id(n) in seen:
            continue
        seen.add(id(n))
        if n.fn is None:
            found.append(n)
        stack.extend(n.parents)
    return found


def _replay(targets: list, subst: dict) -> list:
    """The targets' values computed again from the substituted nodes' (by id); the rest as recorded."""
    memo: dict = dict(subst)
    moved: set = set(subst)  # nodes whose value depends on a substitution
    for target in targets:
        stack = [target]
        while stack:
            n = stack[-1]
            if id(n) in memo:
                stack.pop()
                continue
            pending = [p for p in n.parents if id(p) not in memo]
            if pending:
                stack.extend(pending)
                continue
            stack.pop()
            if n.fn is not None and any(id(p) in moved for p in n.parents):
                memo[id(n)] = n.fn(*[memo[id(p)] for p in n.parents])
                moved.add(id(n))
            else:
                memo[id(n)] = n.value
    return [memo[id(t)] for t in targets]


def _refuse_backward(*args: Any, **kwargs: Any) -> Any:
    raise Untraceable("torch.Tensor.backward", "accumulates gradients into .grad, which trace mode does not model "
                      "(torch.autograd.grad traces)")


# ---------------------------------------------------------------------------
# Calls answered without a rule.


def _reads_value(name: str) -> Callable:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise Untraceable(name, "needs the tensor's value, known only when the program runs (data-dependent "
                          "Python control flow, .item(), NumPy)")

    return refuse


def _moved(t: TracedTensor, *args: Any, **kwargs: Any) -> Any:
    """``.cpu()``, ``.to(device, dtype)``: devices are XLA's business; a dtype is a cast."""
    dtypes = [a.dtype if _is_tensor(a) else a for a in (*args, kwargs.get("dtype"))
              if isinstance(a, torch.dtype) or _is_tensor(a)]
    if not dtypes or dtypes[0] == t.dtype:
        return t
    out = t._meta.to(dtypes[0])
    return _results("torch.Tensor.to", out, lambda values: values[0], [t])


def _new(t: TracedTensor, *args: Any, **kwargs: Any) -> Any:
    """The legacy ``x.new(...)``: of another tensor, its values; of sizes, uninitialized (here zeros)."""
    if len(args) == 1 and _is_tensor(args[0]) and not kwargs:
        source = args[0]
        if source.dtype != t.dtype:
            raise TypeError(f"expected {t.dtype} (got {source.dtype})")
        value = _read(source) if isinstance(source, TracedTensor) else _to_jax(source)
        out = _make(value, meta_of(value, t.dtype), None)
        if isinstance(source, TracedTensor):  # it shares the source's storage
            root = source._view_of if source._view_of is not None else source
            out._view_of, out._seen, out._view_op = root, root._writes, "torch.Tensor.new"
        return out
    if all(isinstance(a, int) for a in args) and not kwargs:
        meta = t._meta.new_empty(args)
        return _make(jnp.zeros(tuple(meta.shape), jax_dtype(meta.dtype)), meta, None)
    raise Untraceable("torch.Tensor.new", "is traced only for a tensor or sizes")


def _new_tensor(t: TracedTensor, data: Any, dtype: Any = None, device: Any = None, requires_grad: bool = False,
                layout: Any = None, pin_memory: bool = False) -> TracedTensor:
    """``x.new_tensor(data)``: a new leaf holding ``data`` (a copy, detached), of ``x``'s dtype by default."""
    dtype = dtype or t.dtype
    if _is_tensor(data):
        meta = torch.empty(tuple(data.shape), dtype=dtype, device="meta")
        value = _to_jax(data).astype(jax_dtype(dtype))
        value = lax.stop_gradient(value) if _differentiable(dtype) else value
    else:
        constant = torch.tensor(data, dtype=dtype)
        meta, value = constant.to("meta"), _constant(constant)
    return _make(value, meta, _Node(None, (), value, "leaf") if requires_grad else None)


def _repr(t: TracedTensor, *args: Any, **kwargs: Any) -> str:
    return f"TracedTensor(shape={tuple(t._meta.shape)}, dtype={t._meta.dtype})"


_SPECIAL: dict[str, Callable] = {
    "torch.Tensor.device.__get__": lambda t: torch.device("cpu"),
    "torch.Tensor.is_cuda.__get__": lambda t: False,
    "torch.Tensor.is_meta.__get__": lambda t: False,
    "torch.Tensor.is_cpu.__get__": lambda t: True,
    "torch.Tensor.requires_grad.__get__": lambda t: t._node is not None,
    "torch.Tensor.is_leaf.__get__": lambda t: t._node is None or t._node.fn is None,
    "torch.Tensor.grad_fn.__get__": _grad_fn,
    "torch.Tensor.detach": _detach,
    "torch.detach": _detach,
    "torch.Tensor.data.__get__": _detach,
    "torch.Tensor.detach_": _detach_,
    "torch.detach_": _detach_,
    "torch.Tensor.requires_grad_": _requires_grad_,
    "torch.Tensor.retain_grad": lambda t: None,
    "torch.autograd.grad": _autograd_grad,
    "torch.autograd.backward": _refuse_backward,
    "torch.Tensor.backward": _refuse_backward,
    "torch.Tensor.__repr__": _repr,
    "torch.Tensor.__str__": _repr,
    "torch.Tensor.__format__": _repr,
    "torch.Tensor.cpu": _moved,
    "torch.Tensor.cuda": _moved,
    "torch.Tensor.to": _moved,
    "torch.Tensor.new": _new,
    "torch.Tensor.new_tensor": _new_tensor,
    **{f"torch.Tensor.{name}": _reads_value(f"torch.Tensor.{name}") for name in (
        "__bool__", "__float__", "__int__", "__index__", "__complex__", "item", "tolist", "numpy", "__array__",
        "data_ptr", "nonzero", "unique", "masked_select", "argwhere")},
    **{f"torch.{name}": _reads_value(f"torch.{name}") for name in (
        "nonzero", "unique", "masked_select", "argwhere", "is_nonzero", "equal")},
}


def _is_tensor(x: Any) -> bool:
    return isinstance(x, torch.Tensor)


def _tree(fn: Callable, tree: Any) -> Any:
    """``fn`` on every tensor in nested tuples, lists and dicts (``torch.cat([a, b])``, index tuples)."""
    if isinstance(tree, (tuple, list)) and not hasattr(tree, "_fields"):
        return type(tree)(_tree(fn, x) for x in tree) if type(tree) in (tuple, list) else tuple(
            _tree(fn, x) for x in tree)
    if isinstance(tree, dict):
        return {k: _tree(fn, v) for k, v in tree.items()}
    if isinstance(tree, slice):
        return slice(*(_tree(fn, x) for x in (tree.start, tree.stop, tree.step)))
    return fn(tree)


def _to_meta(x: Any) -> Any:
    if isinstance(x, TracedTensor):
        return x._meta
    if isinstance(x, torch.Tensor):
        return x.detach().to("meta")
    return x


def _to_jax(x: Any) -> Any:
    if isinstance(x, TracedTensor):
        _check_no_nested_function("the original's result", (x,))
        return _read(x)
    if isinstance(x, torch.Tensor):  # a constant made by torch while tracing (torch.arange, torch.tensor)
        return _constant(x)
    return x


def _constant(t: torch.Tensor) -> Any:
    if t.is_meta:
        _check_no_nested_function("the original's result", (t,))
        raise Untraceable("a meta tensor", "has no value")
    t = t.detach().cpu()
    if t.dtype == torch.bfloat16:
        return jnp.asarray(t.float().numpy(), jnp.bfloat16)
    return jnp.asarray(t.numpy(), jax_dtype(t.dtype))


# ---------------------------------------------------------------------------
# Running the original's methods on stand-ins.


class _Held:
    """A traced tensor kept on vjpkit's ctx (an attribute): the JAX value a residual, torch's dtype static."""

    def __init__(self, value: Any, dtype: Any):
        self.value, self.dtype = value, dtype


jax.tree_util.register_pytree_node(_Held, lambda h: ((h.value,), h.dtype), lambda dtype, v: _Held(v[0], dtype))


def to_jax_tree(tree: Any) -> Any:
    """The original's outputs (or gradients) for JAX: tensors become their JAX values.

    A ``torch.return_types`` result (``torch.max(x, 1)``, ``sort``) is a C struct
    sequence that JAX does not see into: it becomes a namedtuple of the same name and fields.
    """
    return jax.tree_util.tree_map(lambda x: _to_jax(x) if _is_tensor(x) else x, named_tuples(tree),
                                  is_leaf=_is_tensor)


def to_torch_tree(tree: Any, requires_grad: Callable[[int], bool] = lambda i: False) -> Any:
    """JAX arrays in ``tree`` as stand-ins (``requires_grad(i)`` for the i-th top-level element)."""
    def one(i: int, x: Any) -> Any:
        return jax.tree_util.tree_map(lambda a: stand_in(a, meta_of(a), requires_grad(i)) if is_array(a) else a, x)

    return tuple(one(i, x) for i, x in enumerate(tree))


def _hold(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return _Held(_to_jax(x), x.dtype)
    return x


def _release(x: Any) -> Any:
    if isinstance(x, _Held):
        return stand_in(x.value, meta_of(x.value, x.dtype))
    return x


class TracedCtx:
    """The ctx the original's methods see: torch's ``FunctionCtx`` members, kept on vjpkit's ctx.

    Tensors cross as their JAX values, so vjpkit's contract (residuals,
    ``mark_non_differentiable`` by identity, static attributes) applies as is.
    """

    def __init__(self, ctx: FunctionCtx):
        object.__setattr__(self, "_vjpkit_ctx", ctx)

    def save_for_backward(self, *tensors: Any) -> None:
        self._save("save_for_backward", "_torch_saved_dtypes", tensors)

    def save_for_forward(self, *tensors: Any) -> None:
        self._save("save_for_forward", "_torch_saved_forward_dtypes", tensors)

    def _save(self, method: str, dtypes: str, tensors: tuple) -> None:
        ctx = self._vjpkit_ctx
        getattr(ctx, method)(*[None if t is None else _to_jax(t) if _is_tensor(t) else t for t in tensors])
        setattr(ctx, dtypes, tuple(t.dtype if _is_tensor(t) else None for t in tensors))

    @property
    def saved_tensors(self) -> tuple:
        ctx = self._vjpkit_ctx
        in_jvp = ctx._vjpkit_in_jvp
        dtypes = getattr(ctx, "_torch_saved_forward_dtypes" if in_jvp else "_torch_saved_dtypes", ())
        return tuple(None if x is None else stand_in(x, meta_of(x, dtype))
                     for x, dtype in zip(ctx.saved_tensors, dtypes, strict=True))

    saved_variables = saved_tensors  # PyTorch's old name

    @property
    def needs_input_grad(self) -> tuple:
        return self._vjpkit_ctx.needs_input_grad

    def mark_non_differentiable(self, *outputs: Any) -> None:
        self._vjpkit_ctx.mark_non_differentiable(*[_to_jax(t) for t in outputs])

    def set_materialize_grads(self, value: bool) -> None:
        self._vjpkit_ctx.set_materialize_grads(value)

    def mark_dirty(self, *tensors: Any) -> None:
        """Accepted: the in-place update already gave the stand-in its new value, which forward returns."""

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._vjpkit_ctx, name, jax.tree_util.tree_map(_hold, value, is_leaf=_is_tensor))

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._vjpkit_ctx, name)
        return jax.tree_util.tree_map(_release, value, is_leaf=lambda x: isinstance(x, _Held))


_RANDOM = {"rand", "randn", "randint", "randperm", "normal", "bernoulli", "multinomial", "poisson", "rand_like",
           "randn_like", "randint_like", "uniform_", "normal_", "bernoulli_", "exponential_", "random_",
           "cauchy_", "geometric_", "log_normal_", "dropout", "alpha_dropout", "feature_alpha_dropout"}


class _NoRandomness(torch.overrides.TorchFunctionMode):
    """Refuses random draws while tracing: a draw made at trace time would be one constant in every call."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        name = resolve_name(func) or getattr(func, "__name__", "")
        if name.rsplit(".", 1)[-1] in _RANDOM:
            raise Untraceable(name, "draws random numbers, which a compiled program would draw once, at trace "
                              "time (pass a JAX key to a port instead)")
        return func(*args, **(kwargs or {}))


_LIBRARIES = tuple(os.path.dirname(str(m.__file__)) + os.sep for m in (torch, jax, contextlib))
_HERE = os.path.dirname(__file__) + os.sep


def _user_line(tb: Any) -> str:
    """``file:line: source`` of the original's deepest frame in a traceback (where the refused call is)."""
    found = ""
    while tb is not None:
        filename = tb.tb_frame.f_code.co_filename
        if not filename.startswith((_HERE, *_LIBRARIES)) and not filename.startswith("<"):
            source = linecache.getline(filename, tb.tb_lineno).strip()
            found = f"{filename}:{tb.tb_lineno}" + (f": {source}" if source else "")
        tb = tb.tb_next
    return found


@contextlib.contextmanager
def running(where: str, grad: bool) -> Iterator[None]:
    """Runs one of the original's methods: ``Untraceable`` says where; a value read on a meta tensor is one."""
    before = _state["grad"]
    _state["grad"] = grad
    try:
        with torch.set_grad_enabled(grad), _NoRandomness():
            yield
    except Untraceable as e:
        e.where = e.where or where
        e.line = e.line or _user_line(e.__traceback__)
        raise
    except (RuntimeError, NotImplementedError, TypeError) as e:
        if "meta" not in str(e):
            raise
        refusal = Untraceable("a tensor's value (.item(), bool(), float(), .tolist(), .numpy())",
                              "is known only when the program runs (torch said: " + str(e).splitlines()[0] + ")",
                              where=where)
        refusal.line = _user_line(e.__traceback__)
        raise refusal from e
    finally:
        _state["grad"] = before


# ---------------------------------------------------------------------------
# The fronts.


def traced(obj: Any, mode: str, callbacks: Callable[[], Any]) -> Any:
    """``from_torch(obj, mode="trace")``, or ``"auto"`` (``callbacks()``: ``obj`` by host callbacks)."""
    if not (isinstance(obj, type) and issubclass(obj, torch.autograd.Function)):
        name = getattr(obj, "__name__", type(obj).__name__).replace("<lambda>", "lambda")
        fn = trace_callable(obj, name)
        if mode == "auto":
            fn = auto(fn, callbacks(), name)
        fn = functools.wraps(obj)(fn)
        fn._vjpkit_from_torch = True  # type: ignore[attr-defined]
        return fn
    base = torch.autograd.Function
    new_style = defines(obj, base, "setup_context")
    if new_style and (defines(obj, base, "vmap") or getattr(obj, "generate_vmap_rule", False)):
        if mode == "auto":
            return Either(obj.__name__, always(callbacks().apply, "callback"))
        raise Untraceable(f"{obj.__name__}.vmap", "is torch's batching rule; trace mode batches the traced "
                          "operations and would ignore it (use mode='callback' or 'auto')")
    params = list(inspect.signature(obj.forward).parameters.values())[0 if new_style else 1:]
    backward = obj.backward if defines(obj, base, "backward") else None
    try:
        cls = trace_function_class(
            obj, params, new_style=new_style, has_backward=backward is not None, has_jvp=defines(obj, base, "jvp"),
            once=backward is not None and is_torch_once_differentiable(backward))
    except Exception:
        if mode == "trace":
            raise
        return Either(obj.__name__, always(callbacks().apply, "callback"))
    if mode == "trace":
        return cls
    return Either(obj.__name__, auto(cls.apply, callbacks().apply, obj.__name__))


def trace_function_class(cls: Any, params: list, *, new_style: bool, has_backward: bool, has_jvp: bool,
                         once: bool) -> Any:
    """A vjpkit Function class running ``cls``'s methods as JAX operations."""
    name = cls.__name__
    keyword_only = [p.name for p in params if p.kind is p.KEYWORD_ONLY]
    positional_names = [p.name for p in params if p.kind is not p.KEYWORD_ONLY]
    n_params = len(params)

    def forward(ctx: FunctionCtx, *args: Any, **kwargs: Any) -> Any:
        tctx = TracedCtx(ctx)
        needs = ctx.needs_input_grad
        inputs = to_torch_tree((*args, *(kwargs[k] for k in keyword_only)), lambda i: bool(needs[i]))
        # Only the caller's own arguments reach the original, as in callback mode: torch's backward
        # owes one gradient per argument passed, so a defaulted one left out is left out here too.
        passed = [v is not UNSET for v in inputs[:len(args)]]
        n_leading = passed.index(False) if False in passed else len(passed)
        positional = inputs[:n_leading]
        named = {k: v for k, v, p in zip(positional_names[n_leading:], inputs[n_leading:len(args)],
                                          passed[n_leading:], strict=True) if p}
        named.update({k: v for k, v in zip(keyword_only, inputs[len(args):], strict=True) if v is not UNSET})
        ctx.torch_inputs_passed = n_leading  # torch's backward returns one gradient per positional input
        with torch.no_grad(), running(f"{name}.forward", grad=False):  # torch runs forward without grad
            if new_style:
                out = cls.forward(*positional, **named)
                cls.setup_context(tctx, inputs, out)
            else:
                out = cls.forward(tctx, *positional, **named)
            return to_jax_tree(out)

    def backward(ctx: FunctionCtx, *grads: Any) -> Any:
        # Torch runs backward with grad enabled when differentiating it (create_graph); @once_differentiable
        # runs it without.
        with running(f"{name}.backward", grad=not once):
            result = to_jax_tree(cls.backward(TracedCtx(ctx), *to_torch_tree(grads)))
        if isinstance(result, tuple) and len(result) == ctx.torch_inputs_passed < n_params:
            result = (*result, *(None,) * (n_params - len(result)))  # the arguments the caller left out
        return result

    def jvp(ctx: FunctionCtx, *tangents: Any) -> Any:
        with running(f"{name}.jvp", grad=True):
            return to_jax_tree(cls.jvp(TracedCtx(ctx), *to_torch_tree(tangents)))

    forward.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
        [inspect.Parameter("ctx", inspect.Parameter.POSITIONAL_ONLY),
         *(p if p.default is p.empty else p.replace(default=UNSET) for p in params)])
    namespace: dict[str, Any] = {"__doc__": cls.__doc__, "__module__": __name__, "forward": staticmethod(forward),
                                 "_vjpkit_from_torch": True}
    if has_backward:
        namespace["backward"] = staticmethod(once_differentiable(backward) if once else backward)
    if has_jvp:
        namespace["jvp"] = staticmethod(jvp)
    return type(name, (Function,), namespace)


def signature(layout: Any, arrays: list) -> tuple:
    """What a trace of the original on a call depends on: the static part (its values by type and bits),
    each array's shape, dtype and weak type, and JAX's trace configuration (x64, matmul precision, ...)."""
    kinds = tuple((tuple(np.shape(a)), np.dtype(a.dtype), bool(getattr(getattr(a, "aval", None), "weak_type", False)))
                  for a in arrays)
    return layout, kinds, _jax_internals.trace_configuration()


def run_traced(fn: Callable, name: str, args: tuple, kwargs: dict) -> Any:
    """``fn`` run once on stand-ins for JAX values (arrays or tracers): its outputs as JAX values.

    Under ``jax.jit`` (``trace_callable``) this is the trace; called on arrays it evaluates
    op by op, which the OpInfo oracle uses to check the table without compiling.
    """
    with running(name, grad=True):
        return to_jax_tree(fn(*to_torch_tree(args), **dict(zip(kwargs, to_torch_tree(kwargs.values()), strict=True))))


def trace_callable(fn: Callable, name: str) -> Callable:
    """A jitted JAX function running ``fn`` on stand-ins; JAX differentiates its operations.

    One ``jax.jit`` per ``signature``: the output's structure and static leaves, found while tracing,
    belong to that trace alone.
    """
    compiled: dict[Any, tuple[Callable, dict]] = _caches.table()

    def program(layout: Any) -> tuple[Callable, dict]:
        outputs: dict[str, Any] = {}  # the output's structure and static leaves, found while tracing

        def run(*arrays: Any) -> list:
            args, kwargs = layout.combine(list(arrays))
            out_layout, leaves = partition(run_traced(fn, name, args, kwargs), is_array)
            outputs["layout"] = out_layout
            return leaves

        return jax.jit(run), outputs

    def call(*args: Any, **kwargs: Any) -> Any:
        layout, arrays = partition((args, kwargs), is_array, by_value=True)
        key = signature(layout, arrays)
        entry = compiled.get(key)
        if entry is None:
            entry = compiled[key] = program(layout.snapshot())
        run, outputs = entry
        leaves = run(*arrays)
        return outputs["layout"].combine(leaves)

    return call


def auto(traced: Callable, callback: Callable, name: str) -> Callable:
    """``traced`` where the original traces on a call's signature (forward and backward), else ``callback``.

    Decided once per signature by tracing the original's forward and a
    vector-Jacobian product with respect to every floating input, on
    shapes only (``jax.eval_shape``); any failure there (a refusal, or an
    error in vjpkit's rules or in the original) chooses callbacks.
    ``call.mode`` is the choice of the latest call, ``call.mode_for(*args)``
    the choice for those arguments.
    """
    chosen: dict[Any, str] = _caches.table()

    def mode_for(*args: Any, **kwargs: Any) -> str:
        layout, arrays = partition((args, kwargs), is_array, by_value=True)
        key = signature(layout, arrays)
        mode = chosen.get(key)
        if mode is None:
            mode = chosen[key] = "trace" if _traces(traced, layout, arrays) else "callback"
        return mode

    def call(*args: Any, **kwargs: Any) -> Any:
        mode = mode_for(*args, **kwargs)
        call.mode = mode  # type: ignore[attr-defined]
        return (traced if mode == "trace" else callback)(*args, **kwargs)

    call.__name__ = call.__qualname__ = name
    call.mode = None  # type: ignore[attr-defined]
    call.mode_for = mode_for  # type: ignore[attr-defined]
    return call


def always(fn: Callable, mode: str) -> Callable:
    """``fn``, with ``auto``'s ``mode`` and ``mode_for`` saying ``mode`` (an original that never traces)."""
    def call(*args: Any, **kwargs: Any) -> Any:
        call.mode = mode  # type: ignore[attr-defined]
        return fn(*args, **kwargs)

    call.mode = None  # type: ignore[attr-defined]
    call.mode_for = lambda *args, **kwargs: mode  # type: ignore[attr-defined]
    return call


def _traces(fn: Callable, layout: Any, arrays: list) -> bool:
    shapes = [jax.ShapeDtypeStruct(np.shape(a), jnp.result_type(a)) for a in arrays]

    def forward(*xs: Any) -> Any:
        args, kwargs = layout.combine(list(xs))
        return [leaf for leaf in jax.tree_util.tree_leaves(fn(*args, **kwargs)) if is_array(leaf)]

    def gradient(*xs: Any) -> Any:
        at = [i for i, x in enumerate(xs) if jnp.issubdtype(x.dtype, jnp.inexact)]

        def of(*diff: Any) -> Any:
            full = list(xs)
            for i, d in zip(at, diff, strict=True):
                full[i] = d
            return forward(*full)

        out, pullback = jax.vjp(of, *[xs[i] for i in at])
        return pullback([jnp.zeros(o.shape, o.dtype) if jnp.issubdtype(o.dtype, jnp.inexact)
                         else np.zeros(o.shape, jax.dtypes.float0) for o in out])

    try:
        jax.eval_shape(forward, *shapes)
        jax.eval_shape(gradient, *shapes)
    except Exception:  # noqa: BLE001 - a refusal, a rule's failure or the original's own error: callbacks run it
        return False
    return True


class Either:
    """``from_torch(cls, mode="auto")``: ``.apply`` (and calling it) runs the traced Function or the callbacks."""

    _vjpkit_from_torch = True

    def __init__(self, name: str, apply: Callable):
        self.__name__ = name
        self.apply = apply

    @property
    def mode(self) -> str | None:
        """``"trace"`` or ``"callback"``: what the latest call ran (None before the first)."""
        return self.apply.mode  # type: ignore[attr-defined]

    def mode_for(self, *args: Any, **kwargs: Any) -> str:
        """``"trace"`` or ``"callback"``: what a call with these arguments runs (decided once per signature)."""
        return self.apply.mode_for(*args, **kwargs)  # type: ignore[attr-defined]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.apply(*args, **kwargs)

    def __repr__(self) -> str:
        return f"<vjpkit.from_torch({self.__name__}, mode='auto')>"
