"""``from_torch(..., mode="trace")``: a PyTorch original run as JAX operations, compiled by XLA.

Usage::

    Exp = vjpkit.from_torch(TExp, mode="trace")     # TExp's forward and backward as jax.numpy
    jax.make_jaxpr(jax.grad(lambda x: Exp.apply(x).sum()))(x)   # no callback in it

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

In-place operations replace the stand-in's value (JAX values are
immutable); one on a view, or on a tensor a view was taken from, would
need aliasing and raises ``Untraceable``.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from typing import Any, Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
import torch
from torch.overrides import resolve_name

from . import _caches, _jax_internals
from ._ctx import FunctionCtx
from ._from_torch import defines, is_torch_once_differentiable
from ._function import Function
from ._once import once_differentiable
from ._torch_ops import RULES, VIEWS, Untraceable, jax_dtype, set_item
from ._tree import is_array, partition

__all__ = ["Either", "TracedTensor", "Untraceable", "auto", "trace_callable", "trace_function_class", "traced"]

# Tensor members that read metadata only: answered by the meta tensor underneath.
_METADATA = {f"torch.Tensor.{name}" for name in (
    "shape.__get__", "dtype.__get__", "ndim.__get__", "requires_grad.__get__", "is_leaf.__get__",
    "grad_fn.__get__", "layout.__get__", "names.__get__", "is_sparse.__get__", "is_quantized.__get__",
    "is_nested.__get__", "size", "dim", "numel", "nelement", "__len__", "is_floating_point", "is_complex",
    "is_signed", "element_size", "stride", "is_contiguous", "__hash__", "ndimension",
)}


class TracedTensor(torch.Tensor):
    """A stand-in torch tensor: torch's metadata from a meta tensor, its value a JAX array (or tracer)."""

    _value: Any  # the JAX value
    _meta: torch.Tensor  # a plain meta tensor of the same shape and dtype, for torch's own checks
    _aliased: bool  # a view, or a tensor a view was taken from: no in-place writes

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        return _dispatch(func, args, kwargs or {})


_state = {"grad": False}  # whether new stand-ins require grad (in backward, and in a callable)


def stand_in(value: Any, meta: torch.Tensor, requires_grad: bool = False) -> TracedTensor:
    """A ``TracedTensor`` holding ``value`` (already of ``meta``'s shape and dtype)."""
    grad = (requires_grad or _state["grad"]) and (meta.dtype.is_floating_point or meta.dtype.is_complex)
    t = torch.Tensor._make_subclass(TracedTensor, meta, grad)
    t._value, t._meta, t._aliased = value, meta, False
    return t


def torch_dtype(dtype: Any) -> Any:
    name = np.dtype(dtype).name
    return {"bool": torch.bool, "bfloat16": torch.bfloat16}.get(name) or getattr(torch, name)


def meta_of(value: Any, dtype: Any = None) -> torch.Tensor:
    return torch.empty(tuple(value.shape), dtype=dtype or torch_dtype(value.dtype), device="meta")


# ---------------------------------------------------------------------------
# One torch call on stand-ins.


def _dispatch(func: Any, args: tuple, kwargs: dict) -> Any:
    name = resolve_name(func) or getattr(func, "__qualname__", repr(func))
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
    metas, meta_kwargs = _tree(_to_meta, args), _tree(_to_meta, kwargs)
    try:
        out = func(*metas, **meta_kwargs)  # torch's shapes, dtypes and errors
    except NotImplementedError as e:
        raise Untraceable(name, f"cannot run on torch's meta tensors ({e})") from e
    extra = {"_metas": metas[:2]} if getattr(rule, "wants_metas", False) else {}
    value = rule(out, *_tree(_to_jax, args), **_tree(_to_jax, kwargs), **extra)
    result = _wrap_like(name, out, value)
    if name in VIEWS:
        for t in (args[0], *jax.tree_util.tree_leaves(result, is_leaf=_is_tensor)):
            if isinstance(t, TracedTensor):
                t._aliased = True
    return result


def _in_place(name: str, func: Any, args: tuple, kwargs: dict) -> Any:
    """``x.add_(y)``, ``x[i] = y``: the stand-in gets the new value, as a JAX functional update."""
    target = args[0]
    if not isinstance(target, TracedTensor):
        raise Untraceable(name, "writes a traced value into a torch tensor that is not traced")
    if name in ("torch.Tensor.requires_grad_", "torch.Tensor.detach_", "torch.Tensor.retain_grad"):
        return target
    if target._aliased:
        raise Untraceable(name, "writes into a view, or a tensor a view was taken from (JAX values do not alias)")
    if name == "torch.Tensor.__setitem__":
        value = set_item(target._value, _tree(_to_jax, args[1]), _to_jax(args[2]))
    else:
        metas, meta_kwargs = _tree(_to_meta, args), _tree(_to_meta, kwargs)
        func(metas[0].clone(), *metas[1:], **meta_kwargs)  # torch's checks: broadcasting, casting
        base = name.removesuffix("_")
        if base in _FILLS:
            value = _FILLS[base](target._value, *_tree(_to_jax, args[1:]), **_tree(_to_jax, kwargs))
        else:
            rule = RULES.get(base)
            if rule is None:
                raise Untraceable(name)
            out = getattr(torch.Tensor, base.rsplit(".", 1)[1])(*metas, **meta_kwargs)
            value = rule(out, *_tree(_to_jax, args), **_tree(_to_jax, kwargs))
    target._value = jnp.broadcast_to(jnp.asarray(value).astype(target._value.dtype), target._value.shape)
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
    return stand_in(t._value.astype(jax_dtype(dtypes[0])), t._meta.to(dtypes[0]))


def _new(t: TracedTensor, *args: Any, **kwargs: Any) -> Any:
    """The legacy ``x.new(...)``: of another tensor, its values; of sizes, uninitialized (here zeros)."""
    if len(args) == 1 and _is_tensor(args[0]):
        source = args[0]
        value = _to_jax(source).astype(jax_dtype(t.dtype))
        out = stand_in(value, meta_of(value, t.dtype))
        out._aliased = True  # it shares the source's storage
        return out
    if all(isinstance(a, int) for a in args) and not kwargs:
        meta = t._meta.new_empty(args)
        return stand_in(jnp.zeros(tuple(meta.shape), jax_dtype(meta.dtype)), meta)
    raise Untraceable("torch.Tensor.new", "is traced only for a tensor or sizes")


def _repr(t: TracedTensor, *args: Any) -> str:
    return f"TracedTensor(shape={tuple(t._meta.shape)}, dtype={t._meta.dtype})"


_SPECIAL: dict[str, Callable] = {
    "torch.Tensor.device.__get__": lambda t: torch.device("cpu"),
    "torch.Tensor.is_cuda.__get__": lambda t: False,
    "torch.Tensor.is_meta.__get__": lambda t: False,
    "torch.Tensor.is_cpu.__get__": lambda t: True,
    "torch.Tensor.__repr__": _repr,
    "torch.Tensor.__str__": _repr,
    "torch.Tensor.__format__": _repr,
    "torch.Tensor.cpu": _moved,
    "torch.Tensor.cuda": _moved,
    "torch.Tensor.to": _moved,
    "torch.Tensor.new": _new,
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
        return x._value
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


def _wrap_like(name: str, out: Any, value: Any) -> Any:
    """The rule's values as stand-ins, cast to torch's dtypes and checked against torch's shapes."""
    if isinstance(out, torch.Tensor):
        value = jnp.asarray(value)
        dtype = jax_dtype(out.dtype)
        if value.dtype != dtype:
            value = value.astype(dtype)
        if tuple(value.shape) != tuple(out.shape):
            raise RuntimeError(
                f"vjpkit's trace of {name} computed shape {tuple(value.shape)} where torch computes "
                f"{tuple(out.shape)}: a bug in vjpkit's rule for it; please report it (mode='callback' runs "
                "the original meanwhile)."
            )
        return stand_in(value, out)
    if isinstance(out, (tuple, list)):
        items = [_wrap_like(name, o, v) for o, v in zip(out, value, strict=True)]
        return type(out)(items) if hasattr(out, "n_fields") or isinstance(out, list) else tuple(items)
    return out


# ---------------------------------------------------------------------------
# Running the original's methods on stand-ins.


class _Held:
    """A traced tensor kept on vjpkit's ctx (an attribute): the JAX value a residual, torch's dtype static."""

    def __init__(self, value: Any, dtype: Any):
        self.value, self.dtype = value, dtype


jax.tree_util.register_pytree_node(_Held, lambda h: ((h.value,), h.dtype), lambda dtype, v: _Held(v[0], dtype))


def to_jax_tree(tree: Any) -> Any:
    """The original's outputs (or gradients) for JAX: tensors become their JAX values."""
    return jax.tree_util.tree_map(lambda x: _to_jax(x) if _is_tensor(x) else x, tree, is_leaf=_is_tensor)


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
        raise
    except (RuntimeError, NotImplementedError, TypeError) as e:
        if "meta" not in str(e):
            raise
        raise Untraceable("a tensor's value (.item(), bool(), float(), .tolist(), .numpy())",
                          "is known only when the program runs (torch said: " + str(e).splitlines()[0] + ")",
                          where=where) from e
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
            return callbacks()
        raise Untraceable(f"{obj.__name__}.vmap", "is torch's batching rule; trace mode batches the traced "
                          "operations and would ignore it (use mode='callback' or 'auto')")
    params = list(inspect.signature(obj.forward).parameters.values())[0 if new_style else 1:]
    backward = obj.backward if defines(obj, base, "backward") else None
    cls = trace_function_class(
        obj, params, new_style=new_style, has_backward=backward is not None, has_jvp=defines(obj, base, "jvp"),
        once=backward is not None and is_torch_once_differentiable(backward))
    if mode == "trace":
        return cls
    return Either(obj.__name__, auto(cls.apply, callbacks().apply, obj.__name__))


def trace_function_class(cls: Any, params: list, *, new_style: bool, has_backward: bool, has_jvp: bool,
                         once: bool) -> Any:
    """A vjpkit Function class running ``cls``'s methods as JAX operations."""
    name = cls.__name__
    keyword_only = [p.name for p in params if p.kind is p.KEYWORD_ONLY]

    def forward(ctx: FunctionCtx, *args: Any, **kwargs: Any) -> Any:
        tctx = TracedCtx(ctx)
        needs = ctx.needs_input_grad
        inputs = to_torch_tree((*args, *(kwargs[k] for k in keyword_only)), lambda i: bool(needs[i]))
        positional, named = inputs[:len(args)], dict(zip(keyword_only, inputs[len(args):], strict=True))
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
            return to_jax_tree(cls.backward(TracedCtx(ctx), *to_torch_tree(grads)))

    def jvp(ctx: FunctionCtx, *tangents: Any) -> Any:
        with running(f"{name}.jvp", grad=True):
            return to_jax_tree(cls.jvp(TracedCtx(ctx), *to_torch_tree(tangents)))

    forward.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
        [inspect.Parameter("ctx", inspect.Parameter.POSITIONAL_ONLY), *params])
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
            with running(name, grad=True):
                out = to_jax_tree(fn(*to_torch_tree(args), **dict(zip(kwargs, to_torch_tree(kwargs.values()),
                                                                       strict=True))))
            out_layout, leaves = partition(out, is_array)
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
    shapes only (``jax.eval_shape``).
    """
    chosen: dict[Any, Callable] = _caches.table()

    def call(*args: Any, **kwargs: Any) -> Any:
        layout, arrays = partition((args, kwargs), is_array, by_value=True)
        key = signature(layout, arrays)
        fn = chosen.get(key)
        if fn is None:
            fn = chosen[key] = traced if _traces(traced, layout, arrays) else callback
        return fn(*args, **kwargs)

    call.__name__ = call.__qualname__ = name
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
    except Untraceable:
        return False
    try:
        jax.eval_shape(gradient, *shapes)
    except Untraceable:
        return False
    except Exception:  # noqa: BLE001 - the original's own error; a real gradient raises it again, as callbacks would
        pass
    return True


class Either:
    """``from_torch(cls, mode="auto")``: ``.apply`` (and calling it) runs the traced Function or the callbacks."""

    _vjpkit_from_torch = True

    def __init__(self, name: str, apply: Callable):
        self.__name__ = name
        self.apply = apply

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.apply(*args, **kwargs)

    def __repr__(self) -> str:
        return f"<vjpkit.from_torch({self.__name__}, mode='auto')>"
