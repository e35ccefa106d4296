"""``from_torch``'s callback mode: an unported PyTorch Function (or any torch callable) run inside JAX by
callbacks (examples in ``from_torch``'s docstring).

The original runs in a callback on tensors sharing the arrays' memory by
DLPack: XLA's buffers on their device (``device.py``), or host arrays
(``jax.pure_callback``) on a JAX without ``buffer_callback``. The result
is a generated vjpkit Function whose forward calls torch, so static
arguments, keyword arguments, the compile cache and the checks are
vjpkit's own. Each derivative is again a generated Function:

- level 0 runs the original (``Cls.apply`` or the callable);
- level k+1 is the vector-Jacobian product of level k, computed by torch
  autograd (``torch.autograd.grad``, or ``.backward()`` for a ``reentrant``
  original), which calls the class's own ``backward`` with
  ``needs_input_grad``, ``mark_non_differentiable``,
  ``set_materialize_grads`` and ``once_differentiable`` as in PyTorch; what
  that backward leaves in an argument's ``.grad`` is part of its gradient.

A torch graph cannot live from one callback to the next (under ``jit`` the
forward callback may run long before the backward one, or be dropped), so
each level re-runs the levels below it: a gradient runs torch's forward
again, then its backward. Under ``jax.jit(jax.grad(...))`` XLA drops the
unused forward callback, so a gradient costs one forward and one backward.
"""

from __future__ import annotations

import functools
import inspect
import math
import warnings
from typing import Any, Callable, Sequence

import jax
import numpy as np

from .. import _caches, _sharding
from .._ctx import FunctionCtx
from .._function import Function
from .._once import call_without_derivative, once_differentiable
from .._outputs import is_differentiable_dtype
from .._site import see_catalogue
from .._tree import Partition, is_array, partition
from .device import as_output, keeps_tensors, torch_callback
from .dtypes import jax_dtype, numpy_dtype
from .origin import Origin, leaf_names, named_tuples, packing_extra_keywords
from .shapes import FIXED_SHAPES, infer_outputs

__all__ = ["wrap"]


# ---------------------------------------------------------------------------
# The front: a Function class for a class, a function for a callable.


def wrap(origin: Origin) -> Any:
    """``from_torch(original)`` in callback mode: a vjpkit Function class, or for a callable its ``apply``."""
    cls: Any = _level_zero_class(origin)
    if origin.is_class:
        return cls
    apply = cls.apply

    @functools.wraps(origin.original)
    def call(*args: Any, **kwargs: Any) -> Any:
        return apply(*args, **kwargs)

    call.__signature__ = inspect.Signature(origin.params)  # type: ignore[attr-defined]
    call._vjpkit_from_torch = True  # type: ignore[attr-defined]
    return call


# ---------------------------------------------------------------------------
# Level 0: a vjpkit Function whose forward calls the original.


def _level_zero_class(origin: Origin) -> Any:
    # Per static part and (shape, dtype) of each array: torch's output kinds depend on nothing else
    # (the dtypes are JAX's canonical ones, so x64 is in them).
    computations: dict[Any, _TorchComputation] = _caches.table()

    def computation_for(values: tuple) -> tuple[_TorchComputation, list]:
        _refuse_torch_tensors(origin, values)
        layout, arrays = partition(values, is_array, by_value=True)
        kinds = tuple((tuple(a.shape), np.dtype(a.dtype)) for a in arrays)
        key = (layout, kinds)
        computation = computations.get(key)
        if computation is None:
            names = leaf_names(origin, layout)
            computation = computations[key] = _TorchComputation.original(origin, layout, kinds, names)
        return computation, arrays

    def forward(ctx: FunctionCtx, *args: Any, **kwargs: Any) -> Any:
        values = (*args, *(kwargs[k] for k in origin.keyword_only))
        computation, arrays = computation_for(values)
        owners = computation.layout.owners()
        wanted = tuple(
            bool(ctx.needs_input_grad[owners[i][0]]) and is_differentiable_dtype(dtype)
            for i, (_, dtype) in zip(computation.layout.dynamic, computation.in_kinds, strict=True)
        )
        ctx.save_for_backward(*arrays)
        ctx.save_for_forward(*arrays)
        ctx.computation = computation
        ctx.wanted = wanted
        # An unused output's gradient arrives as None, so that torch sees it absent
        # (and applies the original's own set_materialize_grads).
        ctx.set_materialize_grads(False)
        return computation.out_layout.combine(computation.call(arrays, wanted, batched=origin.batching_rule))

    def backward(ctx: FunctionCtx, *grads: Any) -> Any:
        computation: _TorchComputation = ctx.computation
        grad_leaves = computation.out_layout.treedef.flatten_up_to(
            grads[0] if computation.single_output else grads
        )
        given, cotangents = computation.cotangents([grad_leaves[i] for i in computation.out_layout.dynamic])
        gradients = computation.vjp(ctx.wanted, given).apply(*ctx.saved_tensors, *cotangents)
        per_leaf = iter(gradients)
        leaves = [next(per_leaf) if w else None for w in ctx.wanted]
        return tuple(computation.layout.combine(leaves, keep_static=False))

    def jvp(ctx: FunctionCtx, *tangents: Any) -> Any:
        computation: _TorchComputation = ctx.computation
        leaves = computation.layout.treedef.flatten_up_to(tangents)
        dynamic = [leaves[i] for i in computation.layout.dynamic]
        return computation.out_layout.combine(computation.jvp(ctx.saved_tensors, dynamic), keep_static=False)

    namespace: dict[str, Any] = {"__doc__": origin.doc, "__module__": __name__, "forward": staticmethod(forward),
                                 "_vjpkit_from_torch": True}
    forward.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
        [inspect.Parameter("ctx", inspect.Parameter.POSITIONAL_ONLY), *origin.forward_params]
    )
    forward.__name__ = forward.__qualname__ = f"{origin.name}.forward"
    if origin.differentiable:
        namespace["backward"] = staticmethod(once_differentiable(backward) if origin.once else backward)
    if origin.has_jvp:
        namespace["jvp"] = staticmethod(jvp)
    cls: Any = type(origin.name, (Function,), namespace)
    if origin.var_keyword is not None:
        cls.apply = staticmethod(packing_extra_keywords(origin.params, origin.var_keyword, cls.apply))
    return cls


def _refuse_torch_tensors(origin: Origin, values: tuple) -> None:
    """A torch tensor among the arguments would be a static one, handed as is to every run of the original."""
    for k, value in enumerate(values):
        if any(isinstance(leaf, origin.torch.Tensor) for leaf in jax.tree_util.tree_leaves(value)):
            raise TypeError(
                f"{origin.name} (vjpkit.from_torch) got a torch.Tensor in argument {k}: it takes JAX or NumPy "
                "arrays (jnp.asarray(t.numpy()), or call the original directly on torch tensors)."
            )


# ---------------------------------------------------------------------------
# A torch computation of flat tensors, and its derivatives.


class _TorchComputation:
    """A torch computation from flat tensors to flat tensors, and how to run it in JAX.

    ``run(tensors, create_graph)`` computes the outputs (``None`` for a zero)
    with torch; ``in_kinds`` and ``out_kinds`` are the (shape, dtype) of each
    input and output, known while JAX traces.
    """

    def __init__(self, origin: Origin, method: str, run: Callable, in_kinds: tuple, out_kinds: tuple,
                 in_names: tuple):
        self.origin = origin
        self.method = method  # what errors name: "TExp.forward", "TExp.backward", ...
        self.run = run
        self.in_kinds = in_kinds
        self.out_kinds = out_kinds
        self.in_names = in_names  # what errors call each input: "its input x", "grad_output (g)", ...
        self.value_dependent = ""  # ops seen while inferring out_kinds whose output shapes depend on values
        self.differentiable_out = tuple(is_differentiable_dtype(d) for _, d in out_kinds)
        self.out_layout: Partition = partition(list(range(len(out_kinds))), lambda _: True)[0]
        self.single_output = False
        self.layout: Partition = partition(list(range(len(in_kinds))), lambda _: True)[0]
        self._vjps: dict[tuple, Any] = _caches.table()

    @classmethod
    def original(cls, origin: Origin, layout: Partition, in_kinds: tuple, in_names: tuple) -> _TorchComputation:
        """Level 0: the original, called with the static arguments in place."""
        torch = origin.torch

        def rebuild(tensors: Sequence[Any]) -> tuple[tuple, dict]:
            return origin.arguments(layout.combine(list(tensors)))

        out_info: dict[str, Any] = {}

        def run(tensors: Sequence[Any], create_graph: bool) -> list:
            if origin.copy_inputs:  # not leaves: mark_dirty's in-place update is then allowed
                tensors = [t.clone() for t in tensors]
            args, kwargs = rebuild(tensors)
            out = named_tuples(origin.call(*args, **kwargs))  # torch.return_types as namedtuples
            leaves, treedef = jax.tree_util.tree_flatten(out)
            if "treedef" not in out_info:  # the first run, for the output description
                out_info.update(treedef=treedef, leaves=leaves)
            elif treedef != out_info["treedef"]:
                raise TypeError(
                    f"{origin.forward_name} returned outputs of structure {treedef}, but it returned "
                    f"{out_info['treedef']} when vjpkit first ran it on these shapes. from_torch needs "
                    "forward's output structure and shapes to depend only on its inputs' shapes."
                )
            return [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]

        computation = cls(origin, origin.forward_name, run, in_kinds, (), in_names)
        out_leaves, out_treedef = infer_outputs(computation, run, out_info)
        tensor_at = [k for k, leaf in enumerate(out_leaves) if isinstance(leaf, torch.Tensor)]
        computation.out_kinds = tuple(_torch_kind(out_leaves[k]) for k in tensor_at)
        computation.differentiable_out = tuple(is_differentiable_dtype(d) for _, d in computation.out_kinds)
        marker = object()
        template = [marker if isinstance(leaf, torch.Tensor) else leaf for leaf in out_leaves]
        computation.out_layout = partition(jax.tree_util.tree_unflatten(out_treedef, template),
                                       lambda x: x is marker)[0]
        # A plain tuple output gives backward one gradient per element; anything else (a namedtuple too,
        # as vjpkit's Functions treat it) one gradient of its structure.
        computation.single_output = not computation.out_layout.is_tuple()
        computation.layout = layout
        return computation

    # -- JAX side -------------------------------------------------------------

    def call(self, arrays: Sequence[Any], wanted: tuple, batched: bool = False) -> list:
        """The outputs, computed by one host callback (``wanted``: which inputs torch differentiates)."""
        out_struct = [jax.ShapeDtypeStruct(s, d) for s, d in self.out_kinds]
        if not out_struct:
            return []
        host = functools.partial(self._host_forward, wanted)

        def forward_of_arrays(*xs: Any) -> Any:
            out = torch_callback(self.origin.torch, host, out_struct, *xs,
                                 vmap_method="expand_dims" if batched else "sequential")
            return _sharding.vary_like(out, list(xs))  # under shard_map: per-device values

        if not (self.origin.once and self.method == self.origin.forward_name):
            # A higher derivative differentiates the outputs through vjpkit's tie (by
            # backward), never through this callback, which JAX cannot differentiate.
            return list(forward_of_arrays(*(jax.lax.stop_gradient(a) for a in arrays)))
        # vjpkit differentiates a once_differentiable Function's forward itself for a
        # second derivative: that must raise the decorator's error, not JAX's callback one.
        message = (f"{self.origin.backward_name} is decorated with @once_differentiable, so it cannot be "
                   "differentiated (a second derivative such as jax.hessian or grad of grad was asked for). "
                   f"{see_catalogue('once-differentiable-differentiated-twice')}")
        return list(call_without_derivative(forward_of_arrays, list(arrays), message))

    def vjp(self, wanted: tuple, given: tuple) -> Any:
        """The vjpkit Function computing this computation's input gradients (for ``wanted`` inputs)."""
        cls = self._vjps.get((wanted, given))
        if cls is None:
            vjp = _TorchComputation.vjp_of(self, wanted, given)
            cls = self._vjps[wanted, given] = _flat_class(vjp, self.origin.has_jvp)
        return cls

    def cotangents(self, grad_leaves: Sequence[Any]) -> tuple[tuple, list]:
        """Which differentiable outputs JAX passed a cotangent for, and those cotangents."""
        given = tuple(g is not None for g, d in zip(grad_leaves, self.differentiable_out, strict=True) if d)
        return given, [g for g, d in zip(grad_leaves, self.differentiable_out, strict=True) if d and g is not None]

    @classmethod
    def vjp_of(cls, inner: _TorchComputation, wanted: tuple, given: tuple) -> _TorchComputation:
        """Level k+1: (inputs, given output cotangents) to the wanted inputs' gradients, by torch autograd.

        An output without a cotangent is left out of ``torch.autograd.grad``,
        so the original's backward receives None or zeros for it, as in PyTorch.
        """
        origin = inner.origin
        torch = origin.torch
        n = len(inner.in_kinds)

        def run(tensors: Sequence[Any], create_graph: bool) -> list:
            xs, cts = list(tensors[:n]), [_conj(c) for c in tensors[n:]]
            for k, w in enumerate(wanted):
                if w and not xs[k].requires_grad:
                    # In place, not on a detached copy: that would drop a forward-mode tangent.
                    xs[k] = xs[k].requires_grad_(True) if xs[k].is_leaf else xs[k].detach().requires_grad_(True)
            with torch.enable_grad():
                outs = inner.run(xs, True)
            differentiable = [o for o, d in zip(outs, inner.differentiable_out, strict=True) if d]
            with_cotangent = [o for o, g in zip(differentiable, given, strict=True) if g]
            pairs = [(o, c) for o, c in zip(with_cotangent, cts, strict=True) if o is not None and o.requires_grad]
            targets = [x for x, w in zip(xs, wanted, strict=True) if w]
            return [_conj(g) for g in _torch_gradients(torch, pairs, targets, create_graph, origin.reentrant)]

        diff_out = [k for k, d in zip(inner.out_kinds, inner.differentiable_out, strict=True) if d]
        in_kinds = (*inner.in_kinds, *(k for k, g in zip(diff_out, given, strict=True) if g))
        out_kinds = tuple(k for k, w in zip(inner.in_kinds, wanted, strict=True) if w)
        first = inner.method == origin.forward_name
        method = origin.backward_name if first else f"{inner.method} (differentiated)"
        if first:
            ct_names = origin.grad_output_names(len(inner.out_kinds))
        else:
            ct_names = tuple(f"the cotangent of {inner.method}'s output {k}" for k in range(len(inner.out_kinds)))
        diff_names = [m for m, d in zip(ct_names, inner.differentiable_out, strict=True) if d]
        in_names = (*inner.in_names, *(m for m, g in zip(diff_names, given, strict=True) if g))
        return cls(origin, method, run, in_kinds, out_kinds, in_names)

    def jvp(self, arrays: Sequence[Any], tangents: Sequence[Any]) -> list:
        """The output tangents, by torch's forward-mode AD (the class's own ``jvp``)."""
        present = tuple(t is not None and is_differentiable_dtype(k[1])
                        for t, k in zip(tangents, self.in_kinds, strict=True))
        sent = [t for t, p in zip(tangents, present, strict=True) if p]
        out_struct = [jax.ShapeDtypeStruct(s, d) for (s, d), diff in
                      zip(self.out_kinds, self.differentiable_out, strict=True) if diff]
        host = functools.partial(self._host_jvp, present)
        got = iter(torch_callback(self.origin.torch, host, out_struct, *arrays, *sent, vmap_method="sequential"))
        return [next(got) if diff else None
                for (s, _), diff in zip(self.out_kinds, self.differentiable_out, strict=True)]

    # -- host side: run when the compiled program runs ---------------------------

    def _tensors(self, xs: Sequence[Any]) -> list:
        torch = self.origin.torch
        tensors = [torch.from_dlpack(x) for x in xs]
        return [t.clone() for t in tensors] if self.origin.copy_inputs else tensors

    def _host_forward(self, wanted: tuple, *xs: Any) -> list:
        torch = self.origin.torch
        batch = self._batch(xs)
        if batch:
            return self._host_batched(xs, batch)
        views = [torch.from_dlpack(x) for x in xs]  # JAX's buffers
        versions = [t._version for t in views]
        tensors = [t.clone() for t in views] if self.origin.copy_inputs else views
        needs_grad = any(wanted)
        if needs_grad:
            tensors = [t.requires_grad_(True) if w else t for t, w in zip(tensors, wanted, strict=True)]
        with torch.enable_grad() if needs_grad else torch.no_grad():
            outs = self.guarded(self.run, tensors, False)
        self.check_unchanged(views, versions)
        return self._to_numpy(outs)

    def _host_batched(self, xs: Sequence[Any], batch: tuple) -> list:
        """Under jax.vmap: the class's own batching rule, through torch.func.vmap (one batch axis)."""
        torch = self.origin.torch
        size, k = math.prod(batch), len(batch)
        tensors: list = []
        dims: list[int | None] = []
        for x, (shape, _) in zip(self._tensors(xs), self.in_kinds, strict=True):
            if size != 1 and all(d == 1 for d in x.shape[:k]):
                tensors.append(x.reshape(shape))
                dims.append(None)
            else:
                tensors.append(x.expand(*batch, *shape).reshape(size, *shape))
                dims.append(0)

        def unbatched(*ts: Any) -> tuple:
            return tuple(self.run(list(ts), False))

        with torch.no_grad():
            outs = self.guarded(lambda ts, _: list(torch.func.vmap(unbatched, in_dims=tuple(dims))(*ts)),
                                 tensors, False)
        batched = [((size, *shape), dtype) for shape, dtype in self.out_kinds]
        return [a.reshape(batch + shape) for a, (shape, _) in
                zip(self._to_numpy(outs, batched), self.out_kinds, strict=True)]

    def _batch(self, xs: Sequence[Any]) -> tuple:
        """The leading batch axes that jax.vmap (``expand_dims``) put in front, ``()`` if none."""
        if not xs:
            return ()
        k = np.ndim(xs[0]) - len(self.in_kinds[0][0])
        return tuple(np.broadcast_shapes(*(np.shape(x)[:k] for x in xs))) if k else ()

    def _host_jvp(self, present: tuple, *xs: Any) -> list:
        torch = self.origin.torch
        fwad = torch.autograd.forward_ad
        n = len(self.in_kinds)
        primals, given = self._tensors(xs[:n]), iter(self._tensors(xs[n:]))
        with warnings.catch_warnings(), fwad.dual_level():
            # torch's first forward-AD call loads decompositions with its own deprecated torch.jit.script.
            warnings.filterwarnings("ignore", message=".*torch.jit.script.* is deprecated", category=DeprecationWarning)
            duals = [fwad.make_dual(p, next(given)) if has else p for p, has in zip(primals, present, strict=True)]
            with torch.enable_grad():
                outs = self.guarded(self.run, duals, False)
            tangents = [
                None if o is None else fwad.unpack_dual(o).tangent
                for o, d in zip(outs, self.differentiable_out, strict=True) if d
            ]
        kinds = [k for k, d in zip(self.out_kinds, self.differentiable_out, strict=True) if d]
        return self._to_numpy(tangents, kinds)

    def guarded(self, run: Callable, tensors: list, create_graph: bool) -> list:
        """``run(tensors, create_graph)``; torch's error names the method and that from_torch ran it."""
        try:
            return run(tensors, create_graph)
        except Exception as e:
            if not _reraisable(e):
                raise
            raise type(e)(f"{self.method} (PyTorch, run by vjpkit.from_torch) raised "
                          f"{type(e).__name__}: {e}{self._hint(e)}") from e

    def _hint(self, e: Exception) -> str:
        # PyTorch's reentrant checkpoint (and its copies) refuse torch.autograd.grad, naming .grad().
        if self.origin.reentrant or ".grad()" not in str(e):
            return ""
        return (f"\n{self.origin.name} needs a full .backward() (a reentrant backward, as in PyTorch's "
                f"checkpoint): pass reentrant=True to vjpkit.from_torch.")

    def check_unchanged(self, views: list, versions: list) -> None:
        """Refuses an original that wrote into its inputs in place (JAX's buffers, unless it got copies)."""
        for name, t, v in zip(self.in_names, views, versions, strict=True):
            if t._version != v:
                raise RuntimeError(
                    f"{self.method} (PyTorch, run by vjpkit.from_torch) wrote into {name} in place, "
                    "which shares its memory with a JAX array. Pass copy_inputs=True to vjpkit.from_torch "
                    "so that torch works on copies."
                )

    def _to_numpy(self, outs: Sequence[Any], kinds: Sequence[tuple] | None = None) -> list:
        kinds = self.out_kinds if kinds is None else kinds
        for k, (o, (shape, _)) in enumerate(zip(outs, kinds, strict=True)):
            if o is not None and tuple(o.shape) != shape:
                raise ValueError(self._shape_changed(k, tuple(o.shape), shape))
        if keeps_tensors():  # written into XLA's output buffers, on the device (device.py)
            return [as_output(o) for o in outs]
        return [_numpy_of(self.origin.torch, o, shape, dtype) for o, (shape, dtype) in zip(outs, kinds, strict=True)]

    def _shape_changed(self, k: int, got: tuple, want: tuple) -> str:
        message = f"{self.method} (PyTorch, run by vjpkit.from_torch) returned output {k} of shape {got}, "
        if self.method != self.origin.forward_name:
            return message + f"where JAX expects shape {want}."
        seen = f" ({self.value_dependent} ran)" if self.value_dependent else ""
        return (message + f"but of shape {want} on the values vjpkit ran it on to learn its output shapes: "
                f"its output shapes depend on its inputs' values{seen}. " + FIXED_SHAPES)


def _torch_gradients(torch: Any, pairs: list, targets: list, create_graph: bool, reentrant: bool) -> list:
    """The targets' gradients: what torch's backward computes, plus what the original's own
    backward put into their ``.grad`` (``None`` for a zero).

    The targets are leaves that from_torch made. Torch computes their gradients by
    ``torch.autograd.grad``, or, for a ``reentrant`` original, by ``.backward()`` without
    ``inputs``, the one call PyTorch's reentrant checkpoint accepts. Either way ``.grad`` is read
    afterwards: a backward that runs a backward of its own (RevTorch's reversible block, a
    checkpoint) delivers gradients by side effect, into the leaves the caller passed in.
    """
    outputs, cotangents = [o for o, _ in pairs], [c for _, c in pairs]
    found: list = [None] * len(targets)
    if pairs and reentrant:
        # .grad keeps a forward-mode tangent (forward over reverse) only when the graph is kept.
        dual = any(torch.autograd.forward_ad.unpack_dual(o).tangent is not None for o in outputs)
        with warnings.catch_warnings():  # create_graph with .backward(): a reference cycle, undone below
            warnings.filterwarnings("ignore", message="Using backward\\(\\) with create_graph=True")
            torch.autograd.backward(outputs, cotangents, create_graph=create_graph or dual)
    elif pairs:
        found = list(torch.autograd.grad(outputs, targets, cotangents, create_graph=create_graph,
                                         allow_unused=True))
    for k, t in enumerate(targets):
        if t.grad is not None:  # taken off the leaf: a higher order reuses it as an input
            found[k] = t.grad if found[k] is None else found[k] + t.grad
            t.grad = None
    return found


def _reraisable(e: Exception) -> bool:
    """Whether ``type(e)(message)`` rebuilds the exception (most of torch's and Python's do)."""
    try:
        type(e)("")
    except Exception:
        return False
    return True


def _numpy_of(torch: Any, t: Any, shape: tuple, dtype: np.dtype) -> np.ndarray:
    if t is None:
        return np.zeros(shape, dtype)
    if t.requires_grad:
        t = t.detach()
    if t.is_conj() or t.is_neg():  # lazy conjugation: DLPack needs the values written out
        t = t.resolve_conj().resolve_neg()
    if t.device.type != "cpu":
        t = t.cpu()
    if t.dtype == torch.bfloat16:  # NumPy's DLPack has no bfloat16: cross as its bits
        a = np.from_dlpack(t.contiguous().view(torch.int16)).view(numpy_dtype(t.dtype))
    else:
        a = np.from_dlpack(t)
    return a if a.dtype == dtype else a.astype(dtype)


def _torch_kind(t: Any) -> tuple:
    return tuple(t.shape), jax_dtype(t.dtype)


def _conj(t: Any) -> Any:
    """Torch's complex gradient convention to JAX's, and back: ``vjp_jax(ct) = conj(vjp_torch(conj(ct)))``."""
    return t.conj() if t is not None and t.is_complex() else t


# ---------------------------------------------------------------------------
# Levels >= 1: flat vjpkit Functions of (inputs, cotangents).


def _flat_class(computation: _TorchComputation, has_jvp: bool) -> Any:
    """A vjpkit Function of flat arrays running ``computation``; its backward is the next level."""

    def forward(ctx: FunctionCtx, *arrays: Any) -> Any:
        wanted = tuple(bool(n) and is_differentiable_dtype(d)
                       for n, (_, d) in zip(ctx.needs_input_grad, computation.in_kinds, strict=True))
        ctx.save_for_backward(*arrays)
        ctx.save_for_forward(*arrays)
        ctx.wanted = wanted
        return tuple(computation.call(arrays, wanted))

    def backward(ctx: FunctionCtx, *grads: Any) -> Any:
        given, cotangents = computation.cotangents(grads)
        gradients = iter(computation.vjp(ctx.wanted, given).apply(*ctx.saved_tensors, *cotangents))
        return tuple(next(gradients) if w else None for w in ctx.wanted)

    def jvp(ctx: FunctionCtx, *tangents: Any) -> Any:
        return tuple(computation.jvp(ctx.saved_tensors, tangents))

    forward.__name__ = forward.__qualname__ = f"{computation.method}.forward"
    namespace = {"__module__": __name__, "forward": staticmethod(forward), "backward": staticmethod(backward)}
    if has_jvp:  # forward over reverse: torch's forward AD through the backward's operations
        namespace["jvp"] = staticmethod(jvp)
    return type(computation.method, (Function,), namespace)

