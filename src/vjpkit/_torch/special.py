"""Trace mode's torch calls on stand-ins answered without a rule from the op table (``ops``).

Torch's autograd graph over stand-ins (``detach``, ``requires_grad_``,
``grad_fn``, ``torch.autograd.grad`` by replaying the recorded nodes),
devices and casts (``.cpu()``, ``.to``), ``.new``/``.new_tensor``, ``repr``,
and the calls that need a tensor's value (refused): ``calls`` is their table,
which the tracer (``trace.py``) consults first, handing it how it makes stand-ins.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import torch
from jax import lax

from .dtypes import jax_dtype
from .ops import Untraceable
from .standin import (
    Node,
    StandIn,
    constant,
    differentiable,
    differentiating,
    is_tensor,
    meta_of,
    read,
    set_requires_grad,
    to_jax,
)

__all__ = ["calls"]

# ``make(value, meta, node)``: a new stand-in (``trace.make``); ``stand_ins(name, out, compute, operands)``: one
# call's values as stand-ins shaped as torch's ``out`` (``trace.stand_ins``). The tracer hands both to ``calls``.
Make = Callable[..., StandIn]


# ---------------------------------------------------------------------------
# Autograd: detach, requires_grad_, torch.autograd.grad.


def _view(make: Make, name: str, t: StandIn, value: Any, node: Node | None) -> StandIn:
    root = t._view_of if t._view_of is not None else t
    v = make(value, t._meta, node)
    v._view_of, v._seen, v._view_op = root, root._writes, name
    return v


def _detach(make: Make, t: StandIn) -> StandIn:
    """``x.detach()``, ``x.data``: the same storage, no gradient (``stop_gradient``)."""
    value = read(t)
    return _view(make, "torch.Tensor.detach", t, lax.stop_gradient(value) if differentiable(t._meta.dtype) else value,
                 None)


def _detach_(t: StandIn) -> StandIn:
    if t._view_of is not None:
        raise Untraceable("torch.Tensor.detach_", f"detaches a view (taken by {t._view_op}) in place")
    if differentiable(t._meta.dtype):
        t._stored = lax.stop_gradient(read(t))
    if t._node is not None:
        set_requires_grad(t, None)
    return t


def _requires_grad_(t: StandIn, requires_grad: bool = True) -> StandIn:
    if requires_grad and t._node is None:
        if not differentiable(t._meta.dtype):
            raise RuntimeError("only Tensors of floating point and complex dtype can require gradients")
        set_requires_grad(t, Node(None, (), read(t), "leaf"))
    elif not requires_grad and t._node is not None:
        if t._node.fn is not None:
            raise RuntimeError("you can only change requires_grad flags of leaf variables. If you want to use a "
                               "computed variable in a subgraph that doesn't require differentiation use "
                               "var_no_grad = var.detach().")
        if differentiating():
            t._stored = lax.stop_gradient(read(t))
        set_requires_grad(t, None)
    return t


class _TracedGradFn:
    """What ``x.grad_fn`` is for a traced tensor computed with grad: the operation's name."""

    def __init__(self, name: str):
        self._name = name

    def name(self) -> str:
        return self._name

    def __repr__(self) -> str:
        return f"<traced {self._name}>"


def _grad_fn(t: StandIn) -> Any:
    return None if t._node is None or t._node.fn is None else _TracedGradFn(t._node.name)


def _sequence(x: Any) -> tuple:
    return (x,) if isinstance(x, torch.Tensor) else tuple(x)


def _autograd_grad(make: Make, outputs: Any, inputs: Any, grad_outputs: Any = None, retain_graph: Any = None,
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
        if not isinstance(o, StandIn) or o._node is None:
            raise RuntimeError(f"element {i} of tensors does not require grad and does not have a grad_fn")
    for x in inputs:
        if not isinstance(x, StandIn) or x._node is None:
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

    ct_values = [read(c) if isinstance(c, StandIn) else to_jax(c) for c in cotangents]
    found = gradients([read(x) for x in inputs], ct_values, {})
    nodes: list = [None] * len(inputs)
    if create_graph:
        ct_nodes = [c._node if isinstance(c, StandIn) else None for c in cotangents]
        leaves = _leaves([*out_nodes, *in_nodes, *(n for n in ct_nodes if n is not None)])

        def again(*leaf_values: Any) -> list:
            subst = {id(n): v for n, v in zip(leaves, leaf_values, strict=True)}
            cts = [v if n is None else _replay([n], subst)[0] for v, n in zip(ct_values, ct_nodes, strict=True)]
            return gradients(_replay(in_nodes, subst), cts, subst)

        nodes = [Node(lambda *lv, i=i: again(*lv)[i], tuple(leaves), g, "torch.autograd.grad") if u else None
                 for i, (g, u) in enumerate(zip(found, used, strict=True))]
    results: list[Any] = []
    for x, g, u, node in zip(inputs, found, used, nodes, strict=True):
        if not u and not materialize_grads:
            results.append(None)
            continue
        value = g if node is not None else lax.stop_gradient(g)
        results.append(make(value, x._meta, node))
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


def _moved(stand_ins: Callable, t: StandIn, *args: Any, **kwargs: Any) -> Any:
    """``.cpu()``, ``.to(device, dtype)``: devices are XLA's business; a dtype is a cast."""
    dtypes = [a.dtype if is_tensor(a) else a for a in (*args, kwargs.get("dtype"))
              if isinstance(a, torch.dtype) or is_tensor(a)]
    if not dtypes or dtypes[0] == t.dtype:
        return t
    out = t._meta.to(dtypes[0])
    return stand_ins("torch.Tensor.to", out, lambda values: values[0], [t])


def _new(make: Make, t: StandIn, *args: Any, **kwargs: Any) -> Any:
    """The legacy ``x.new(...)``: of another tensor, its values; of sizes, uninitialized (here zeros)."""
    if len(args) == 1 and is_tensor(args[0]) and not kwargs:
        source = args[0]
        if source.dtype != t.dtype:
            raise TypeError(f"expected {t.dtype} (got {source.dtype})")
        value = read(source) if isinstance(source, StandIn) else to_jax(source)
        out = make(value, meta_of(value, t.dtype), None)
        if isinstance(source, StandIn):  # it shares the source's storage
            root = source._view_of if source._view_of is not None else source
            out._view_of, out._seen, out._view_op = root, root._writes, "torch.Tensor.new"
        return out
    if all(isinstance(a, int) for a in args) and not kwargs:
        meta = t._meta.new_empty(args)
        return make(jnp.zeros(tuple(meta.shape), jax_dtype(meta.dtype)), meta, None)
    raise Untraceable("torch.Tensor.new", "is traced only for a tensor or sizes")


def _new_tensor(make: Make, t: StandIn, data: Any, dtype: Any = None, device: Any = None, requires_grad: bool = False,
                layout: Any = None, pin_memory: bool = False) -> StandIn:
    """``x.new_tensor(data)``: a new leaf holding ``data`` (a copy, detached), of ``x``'s dtype by default."""
    dtype = dtype or t.dtype
    if is_tensor(data):
        meta = torch.empty(tuple(data.shape), dtype=dtype, device="meta")
        value = to_jax(data).astype(jax_dtype(dtype))
        value = lax.stop_gradient(value) if differentiable(dtype) else value
    else:
        made = torch.tensor(data, dtype=dtype)
        meta, value = made.to("meta"), constant(made)
    return make(value, meta, Node(None, (), value, "leaf") if requires_grad else None)


def _repr(t: StandIn, *args: Any, **kwargs: Any) -> str:
    return f"TracedTensor(shape={tuple(t._meta.shape)}, dtype={t._meta.dtype})"


def calls(make: Make, stand_ins: Callable) -> dict[str, Callable]:
    """The calls answered without a rule, by torch name, given the tracer's ``make`` and ``stand_ins``."""
    detach = functools.partial(_detach, make)
    return {
        "torch.Tensor.device.__get__": lambda t: torch.device("cpu"),
        "torch.Tensor.is_cuda.__get__": lambda t: False,
        "torch.Tensor.is_meta.__get__": lambda t: False,
        "torch.Tensor.is_cpu.__get__": lambda t: True,
        "torch.Tensor.requires_grad.__get__": lambda t: t._node is not None,
        "torch.Tensor.is_leaf.__get__": lambda t: t._node is None or t._node.fn is None,
        "torch.Tensor.grad_fn.__get__": _grad_fn,
        "torch.Tensor.detach": detach,
        "torch.detach": detach,
        "torch.Tensor.data.__get__": detach,
        "torch.Tensor.detach_": _detach_,
        "torch.detach_": _detach_,
        "torch.Tensor.requires_grad_": _requires_grad_,
        "torch.Tensor.retain_grad": lambda t: None,
        "torch.autograd.grad": functools.partial(_autograd_grad, make),
        "torch.autograd.backward": _refuse_backward,
        "torch.Tensor.backward": _refuse_backward,
        "torch.Tensor.__repr__": _repr,
        "torch.Tensor.__str__": _repr,
        "torch.Tensor.__format__": _repr,
        "torch.Tensor.cpu": functools.partial(_moved, stand_ins),
        "torch.Tensor.cuda": functools.partial(_moved, stand_ins),
        "torch.Tensor.to": functools.partial(_moved, stand_ins),
        "torch.Tensor.new": functools.partial(_new, make),
        "torch.Tensor.new_tensor": functools.partial(_new_tensor, make),
        **{f"torch.Tensor.{name}": _reads_value(f"torch.Tensor.{name}") for name in (
            "__bool__", "__float__", "__int__", "__index__", "__complex__", "item", "tolist", "numpy", "__array__",
            "data_ptr", "nonzero", "unique", "masked_select", "argwhere")},
        **{f"torch.{name}": _reads_value(f"torch.{name}") for name in (
            "nonzero", "unique", "masked_select", "argwhere", "is_nonzero", "equal")},
    }
