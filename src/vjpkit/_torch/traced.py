"""``from_torch(..., mode="trace")``'s fronts: the traced Function, the traced callable and ``"auto"``'s choice.

The original's methods run on stand-ins (``trace.py``) inside ``running``,
which sets torch's grad mode, refuses random draws and says where a refused
call stands; ``TracedCtx`` is the ctx they see, kept on vjpkit's ctx.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import linecache
import os
import traceback
from typing import Any, Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
import torch
from torch.overrides import resolve_name

from .. import _caches, _jax_internals
from .._ctx import FunctionCtx, in_jvp
from .._function import Function
from .._once import once_differentiable
from .._tree import is_array, partition
from .ops import Untraceable
from .origin import UNSET, Origin, named_tuples, passed_arguments
from .standin import differentiated, is_tensor, meta_of, to_jax
from .trace import stand_in

__all__ = ["Either", "TracedCtx", "auto", "run_traced", "trace_callable", "trace_function_class", "wrap"]

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
    return jax.tree_util.tree_map(lambda x: to_jax(x) if is_tensor(x) else x, named_tuples(tree),
                                  is_leaf=is_tensor)


def to_torch_tree(tree: Any, requires_grad: Callable[[int], bool] = lambda i: False) -> Any:
    """JAX arrays in ``tree`` as stand-ins (``requires_grad(i)`` for the i-th top-level element)."""
    def one(i: int, x: Any) -> Any:
        return jax.tree_util.tree_map(lambda a: stand_in(a, meta_of(a), requires_grad(i)) if is_array(a) else a, x)

    return tuple(one(i, x) for i, x in enumerate(tree))


def _hold(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return _Held(to_jax(x), x.dtype)
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
        getattr(ctx, method)(*[None if t is None else to_jax(t) if is_tensor(t) else t for t in tensors])
        setattr(ctx, dtypes, tuple(t.dtype if is_tensor(t) else None for t in tensors))

    @property
    def saved_tensors(self) -> tuple:
        ctx = self._vjpkit_ctx
        dtypes = getattr(ctx, "_torch_saved_forward_dtypes" if in_jvp(ctx) else "_torch_saved_dtypes", ())
        return tuple(None if x is None else stand_in(x, meta_of(x, dtype))
                     for x, dtype in zip(ctx.saved_tensors, dtypes, strict=True))

    saved_variables = saved_tensors  # PyTorch's old name

    @property
    def needs_input_grad(self) -> tuple:
        return self._vjpkit_ctx.needs_input_grad

    def mark_non_differentiable(self, *outputs: Any) -> None:
        self._vjpkit_ctx.mark_non_differentiable(*[to_jax(t) for t in outputs])

    def set_materialize_grads(self, value: bool) -> None:
        self._vjpkit_ctx.set_materialize_grads(value)

    def mark_dirty(self, *tensors: Any) -> None:
        """Accepted: the in-place update already gave the stand-in its new value, which forward returns."""

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._vjpkit_ctx, name, jax.tree_util.tree_map(_hold, value, is_leaf=is_tensor))

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._vjpkit_ctx, name)
        return jax.tree_util.tree_map(_release, value, is_leaf=lambda x: isinstance(x, _Held))


_RANDOM = {"rand", "randn", "randint", "randperm", "normal", "bernoulli", "multinomial", "poisson", "rand_like",
           "randn_like", "randint_like", "uniform_", "normal_", "bernoulli_", "exponential_", "random_",
           "cauchy_", "geometric_", "log_normal_", "dropout", "alpha_dropout", "feature_alpha_dropout"}


# Factories of sparse tensors: they take no stand-in's __torch_function__ path, and a sparse layout has no
# JAX counterpart here (torch's own error would blame a "SparseMeta" backend).
_SPARSE = {"sparse_coo_tensor", "sparse_csr_tensor", "sparse_csc_tensor", "sparse_bsr_tensor", "sparse_bsc_tensor",
           "sparse_compressed_tensor", "to_sparse", "to_sparse_coo", "to_sparse_csr"}


class _NoRandomness(torch.overrides.TorchFunctionMode):
    """Refuses what a trace cannot hold: random draws (one constant in every call), sparse tensors."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        name = resolve_name(func) or getattr(func, "__name__", "")
        short = name.rsplit(".", 1)[-1]
        if short in _RANDOM:
            raise Untraceable(name, "draws random numbers, which a compiled program would draw once, at trace "
                              "time (pass a JAX key to a port instead)")
        if short in _SPARSE:
            raise Untraceable(name, "makes a sparse tensor: trace mode does not model sparse layouts (a port uses "
                              "jax.ops.segment_sum or jax.experimental.sparse; mode='auto' runs it by callbacks)")
        return func(*args, **(kwargs or {}))


_LIBRARIES = tuple(os.path.dirname(str(m.__file__)) + os.sep for m in (torch, jax, contextlib))
_HERE = os.path.dirname(os.path.dirname(__file__)) + os.sep  # vjpkit's own files


def _user_line(tb: Any) -> str:
    """``file:line: source`` of the original's deepest frame in a traceback (where the refused call is)."""
    found = ""
    for entry in traceback.extract_tb(tb):
        filename, line = entry.filename, entry.lineno or 0
        if not filename.startswith((_HERE, *_LIBRARIES)) and not filename.startswith("<"):
            source = linecache.getline(filename, line).strip()
            found = f"{filename}:{line}" + (f": {source}" if source else "")
    return found


@contextlib.contextmanager
def running(where: str, grad: bool) -> Iterator[None]:
    """Runs one of the original's methods: ``Untraceable`` says where; a value read on a meta tensor is one."""
    try:
        with differentiated(grad), torch.set_grad_enabled(grad), _NoRandomness():
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


# ---------------------------------------------------------------------------
# The fronts.


def wrap(origin: Origin, mode: str, callbacks: Callable[[], Any]) -> Any:
    """``from_torch(original, mode="trace")``, or ``"auto"`` (``callbacks()``: the original by host callbacks)."""
    name = origin.name
    if not origin.is_class:
        fn = trace_callable(origin.call, name)
        if mode == "auto":
            fn = auto(fn, callbacks(), name)
        fn = functools.wraps(origin.original)(fn)
        fn._vjpkit_from_torch = True  # type: ignore[attr-defined]
        return fn
    if origin.batching_rule:
        if mode == "auto":
            return Either(name, always(callbacks().apply, "callback"))
        raise Untraceable(f"{name}.vmap", "is torch's batching rule; trace mode batches the traced "
                          "operations and would ignore it (use mode='callback' or 'auto')")
    try:
        cls = trace_function_class(origin)
    except Exception:
        if mode == "trace":
            raise
        return Either(name, always(callbacks().apply, "callback"))
    if mode == "trace":
        return cls
    return Either(name, auto(cls.apply, callbacks().apply, name))


def trace_function_class(origin: Origin) -> Any:
    """A vjpkit Function class running the original class's methods as JAX operations."""
    cls, name, params, once = origin.original, origin.name, origin.params, origin.once
    keyword_only = [p.name for p in params if p.kind is p.KEYWORD_ONLY]
    positional_names = origin.positional_names
    n_params = len(params)

    def forward(ctx: FunctionCtx, *args: Any, **kwargs: Any) -> Any:
        tctx = TracedCtx(ctx)
        needs = ctx.needs_input_grad
        inputs = to_torch_tree((*args, *(kwargs[k] for k in keyword_only)), lambda i: bool(needs[i]))
        # Only the caller's own arguments reach the original, as in callback mode: torch's backward
        # owes one gradient per argument passed, so a defaulted one left out is left out here too.
        positional, named = passed_arguments(positional_names, keyword_only, inputs)
        ctx.torch_inputs_passed = len(positional)  # torch's backward returns one gradient per positional input
        with torch.no_grad(), running(f"{name}.forward", grad=False):  # torch runs forward without grad
            if origin.new_style:
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
    namespace: dict[str, Any] = {"__doc__": origin.doc, "__module__": __name__, "forward": staticmethod(forward),
                                 "_vjpkit_from_torch": True}
    if origin.differentiable:
        namespace["backward"] = staticmethod(once_differentiable(backward) if once else backward)
    if origin.has_jvp:
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
