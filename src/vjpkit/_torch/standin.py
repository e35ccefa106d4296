"""Trace mode's stand-in tensor, below the calls on it: what it holds and how its value is read.

A stand-in (``trace.TracedTensor``, a ``StandIn``) is a ``torch.Tensor``
subclass over a ``meta`` tensor: torch sees the meta tensor's shape and dtype,
and the stand-in holds the JAX value (an array or a tracer). Torch's autograd
over stand-ins is a graph of ``Node``s (how each value was computed, for
``torch.autograd.grad`` to replay). Whether JAX differentiates the running
method is each thread's own (``differentiating``, set by ``differentiated``
around every method trace mode runs), so two threads may trace at once.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Callable, Iterator

import jax
import jax.numpy as jnp
import torch

from .dtypes import jax_dtype, torch_dtype
from .ops import Untraceable

__all__ = ["Node", "StandIn", "check_no_nested_function", "constant", "differentiable", "differentiated",
           "differentiating", "is_tensor", "map_tensors", "meta_of", "read", "set_requires_grad", "to_jax", "to_meta"]


class StandIn(torch.Tensor):
    """What every stand-in holds (``trace.TracedTensor`` adds torch's dispatch to JAX rules).

    Torch's metadata from a meta tensor, its value a JAX array (or tracer).
    """

    _stored: Any  # the JAX value (read it with ``read``, which checks a view is still current)
    _meta: torch.Tensor  # a plain meta tensor of the same shape and dtype, for torch's own checks
    _node: Node | None  # torch's autograd: None where the tensor does not require grad
    _view_of: StandIn | None  # a view's tensor: the one whose storage it shares in torch
    _seen: int  # a view's: its base's in-place writes when the view was taken
    _writes: int  # in-place writes into this tensor
    _view_op: str  # a view's: the operation that took it
    _last_write: str  # the operation that last wrote into this tensor in place


# Whether JAX differentiates the running method (backward, jvp, a callable): a context variable, so that
# each thread (and each asyncio task) tracing at once sees its own.
_DIFFERENTIATING: contextvars.ContextVar[bool] = contextvars.ContextVar("vjpkit_torch_differentiating", default=False)


def differentiating() -> bool:
    """Whether JAX differentiates the method running in this thread (then a stand-in argument requires grad)."""
    return _DIFFERENTIATING.get()


@contextlib.contextmanager
def differentiated(on: bool) -> Iterator[None]:
    """Within: ``differentiating()`` is ``on`` in this thread, as it was before afterwards."""
    token = _DIFFERENTIATING.set(on)
    try:
        yield
    finally:
        _DIFFERENTIATING.reset(token)


class Node:
    """A tensor that requires grad, as torch's autograd sees it: its value, and how to compute it again.

    ``fn`` computes the value from the ``parents``' values (``None`` for a leaf).
    ``torch.autograd.grad`` replays the nodes between its inputs and outputs as
    one JAX function and takes its VJP (``special.py``).
    """

    __slots__ = ("fn", "parents", "value", "name")

    def __init__(self, fn: Callable | None, parents: tuple, value: Any, name: str = ""):
        self.fn, self.parents, self.value, self.name = fn, parents, value, name


def differentiable(dtype: Any) -> bool:
    return dtype.is_floating_point or dtype.is_complex


def read(t: StandIn) -> Any:
    """``t``'s value. A view read after its base was written in place would show the write in torch."""
    base = t._view_of
    if base is not None and base._writes != t._seen:
        raise Untraceable(base._last_write, f"writes into a tensor that a view was taken from (by {t._view_op}), "
                          "and the view is read afterwards: in torch the two share memory, JAX values do not "
                          "(clone the view, or take it after the write)")
    return t._stored


def set_requires_grad(t: StandIn, node: Node | None) -> None:
    t._node = node
    with torch._C.DisableTorchFunctionSubclass():
        torch.Tensor.requires_grad_(t, node is not None)


def meta_of(value: Any, dtype: Any = None) -> torch.Tensor:
    return torch.empty(tuple(value.shape), dtype=dtype or torch_dtype(value.dtype), device="meta")


def check_no_nested_function(name: str, args: tuple) -> None:
    """A ``torch.autograd.Function``'s ``apply`` inside a traced method runs in torch's C++, out of reach.

    Under grad mode (backward, a callable) its outputs carry its autograd node,
    and JAX would differentiate its forward's operations instead of running
    its backward; outputs that are plain meta tensors have no value. Both
    name the Function. (In a traced forward, which runs without grad as in
    torch, a nested Function's forward runs inline: its backward is never used.)
    """
    if not differentiating():
        return
    for arg in jax.tree_util.tree_leaves(args, is_leaf=is_tensor):
        if not isinstance(arg, torch.Tensor):
            continue
        with torch._C.DisableTorchFunctionSubclass():
            node = arg.grad_fn
        if node is not None or (arg.is_meta and not isinstance(arg, StandIn)):
            inner = getattr(type(node), "_forward_cls", None)
            what = f"{inner.__name__}.apply" if inner is not None else "a tensor with no traced value"
            raise Untraceable(what, "(a torch.autograd.Function called inside the original) runs in torch's "
                              f"C++ autograd, out of the trace's reach; its output reached {name}")


def is_tensor(x: Any) -> bool:
    return isinstance(x, torch.Tensor)


def map_tensors(fn: Callable, tree: Any) -> Any:
    """``fn`` on every tensor in nested tuples, lists and dicts (``torch.cat([a, b])``, index tuples)."""
    if isinstance(tree, (tuple, list)) and not hasattr(tree, "_fields"):
        return type(tree)(map_tensors(fn, x) for x in tree) if type(tree) in (tuple, list) else tuple(
            map_tensors(fn, x) for x in tree)
    if isinstance(tree, dict):
        return {k: map_tensors(fn, v) for k, v in tree.items()}
    if isinstance(tree, slice):
        return slice(*(map_tensors(fn, x) for x in (tree.start, tree.stop, tree.step)))
    return fn(tree)


def to_meta(x: Any) -> Any:
    if isinstance(x, StandIn):
        return x._meta
    if isinstance(x, torch.Tensor):
        return x.detach().to("meta")
    return x


def to_jax(x: Any) -> Any:
    if isinstance(x, StandIn):
        check_no_nested_function("the original's result", (x,))
        return read(x)
    if isinstance(x, torch.Tensor):  # a constant made by torch while tracing (torch.arange, torch.tensor)
        return constant(x)
    return x


def constant(t: torch.Tensor) -> Any:
    if t.is_meta:
        check_no_nested_function("the original's result", (t,))
        raise Untraceable("a meta tensor", "has no value")
    t = t.detach().cpu()
    if t.dtype == torch.bfloat16:
        return jnp.asarray(t.float().numpy(), jnp.bfloat16)
    return jnp.asarray(t.numpy(), jax_dtype(t.dtype))
