"""Host Functions: ``forward`` and ``backward`` written in NumPy, run through ``jax.pure_callback``.

For example:

```python
@vjpkit.function(host=True)
class Solve:
    @staticmethod
    def output_shapes(A, b):          # receives jax.ShapeDtypeStructs
        return b

    @staticmethod
    def forward(ctx, A, b):           # receives NumPy arrays
        x = np.linalg.solve(A, b)
        ctx.save_for_backward(A, x)
        return x

    @staticmethod
    def backward(ctx, g):             # NumPy in, NumPy out
        A, x = ctx.saved_tensors
        lam = np.linalg.solve(A.T, g)
        return -np.outer(lam, x), lam

jax.jit(jax.grad(lambda A, b: Solve(A, b).sum()))(A, b)
```

This module turns the user's NumPy methods into JAX-traceable ``forward``
and ``backward`` methods that the core (``_runner.Runner``) runs like
any other Function's, so jit, grad, vmap and scan need no second path.

The key differences to a JAX Function are:

- output shapes and dtypes must be known while JAX traces: from a
  ``output_shapes`` staticmethod, else those of the first array input;
- forward's ctx is *not* carried across as residuals. The backward callback
  runs forward again on the same inputs (the only residuals are the
  inputs), so NumPy intermediates saved on ctx need no declared shapes.
  Under ``jax.jit(jax.grad(...))`` XLA drops the unused forward callback,
  so a gradient costs one forward and one backward on the host;
- backward cannot be differentiated (it is opaque NumPy code): a second
  derivative raises an error naming the class.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from . import _callback_errors, _jax_internals, _sharding
from ._ctx import (
    FunctionCtx,
    call_forward,
    closing,
    forwarded,
    host_residuals,
    keep_host_residuals,
    rule_ctx,
)
from ._once import call_without_derivative
from ._outputs import check_backward_outputs, short_repr
from ._site import see_catalogue
from ._tree import is_array, is_differentiable_dtype, partition

VMAP_METHODS = ("sequential", "expand_dims", "broadcast_all")


class VmapInfo(NamedTuple):
    """What a ``vmap`` staticmethod receives first (PyTorch's ``info``).

    A Function with a staticmethod ``vmap(info, in_dims, *inputs)``
    returning ``(outputs, out_dims)`` batches its forward by it under
    ``jax.vmap``, as in PyTorch; as there, its forward takes no ``ctx``,
    which ``setup_context`` fills.

    Attributes:
        batch_size: The number of examples in the batch.
        randomness: PyTorch's ``randomness`` option of ``vmap``; always
            ``"error"`` (JAX's random numbers are explicit keys).

    Examples:
        >>> import jax
        >>> import jax.numpy as jnp
        >>> import vjpkit
        >>> class Double(vjpkit.Function):
        ...     @staticmethod
        ...     def forward(x):
        ...         return 2 * x
        ...
        ...     @staticmethod
        ...     def setup_context(ctx, inputs, output):
        ...         pass
        ...
        ...     @staticmethod
        ...     def backward(ctx, g):
        ...         return 2 * g
        ...
        ...     @staticmethod
        ...     def vmap(info, in_dims, x):
        ...         print(info)
        ...         return 2 * x, in_dims[0]
        >>> jax.vmap(Double.apply)(jnp.ones((3, 2))).tolist()
        VmapInfo(batch_size=3, randomness='error')
        [[2.0, 2.0], [2.0, 2.0], [2.0, 2.0]]
    """

    batch_size: int
    randomness: str = "error"


def host_methods(spec: Any, cls: type) -> dict[str, Any]:
    """A host class's methods, replaced by callback-running ones: ``forward``, ``backward``, ``setup_context``.

    Read from ``spec``, the class as the user wrote it (its ``signature``
    binds the user's forward). The replacements take ``ctx`` first (classic
    style), whatever style the user wrote, so ``setup_context`` is ``None``.
    """
    host = _HostFunction(spec, cls)

    def forward(ctx: FunctionCtx, *args: Any, **kwargs: Any) -> Any:
        return host.forward(ctx, *args, **kwargs)

    forward.__name__ = forward.__qualname__ = f"{spec.name}.forward"
    forward.__doc__ = spec.forward.__doc__  # apply's docstring
    backward = None if spec.backward is None else host.backward
    return {"forward": forward, "backward": backward, "setup_context": None}


def _is_shape_like(x: Any) -> bool:
    return hasattr(x, "shape") and hasattr(x, "dtype")


def _is_key(x: Any) -> bool:
    return is_array(x) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def _key_data(x: Any) -> Any:
    return jax.random.key_data(x) if _is_key(x) else x


def _shape_dtype(x: Any) -> jax.ShapeDtypeStruct:
    dtype = x.dtype if _is_key(x) else jax.dtypes.canonicalize_dtype(x.dtype)  # a key's dtype is its own
    return jax.ShapeDtypeStruct(tuple(x.shape), dtype)


def _output_name(path: tuple) -> str:
    return f"output{jax.tree_util.keystr(path)}"


class _HostFunction:
    """The user's NumPy methods, and the JAX-side wrappers the core calls."""

    def __init__(self, spec: Any, cls: type):
        self.name = spec.name
        self.signature = spec.signature
        self.user_forward = spec.forward
        self.user_setup_context = spec.setup_context
        self.user_backward = spec.backward
        self.output_shapes = getattr(cls, "output_shapes", None)
        self.vmap = getattr(cls, "vmap", None)
        self.vmap_method = getattr(cls, "vmap_method", "sequential")
        if self.vmap_method not in VMAP_METHODS:
            raise ValueError(
                f"{self.name}: vmap_method={self.vmap_method!r} is not one of "
                f"{', '.join(map(repr, VMAP_METHODS))}. 'sequential' loops over the "
                "batch; the others declare that forward and backward accept a "
                "leading batch axis."
            )
        if spec.jvp is not None:
            raise TypeError(
                f"{self.name} is a host Function (host=True) and defines jvp: forward "
                "mode is not supported for NumPy code. Remove jvp (reverse mode uses "
                "backward), or write the Function in jax.numpy."
            )
        if self.output_shapes is not None and not callable(self.output_shapes):
            raise TypeError(
                f"{self.name}.output_shapes must be a staticmethod taking forward's "
                f"inputs as jax.ShapeDtypeStructs, got {short_repr(self.output_shapes)}."
            )

    # -- JAX side: run while JAX traces -----------------------------------

    def forward(self, ctx: FunctionCtx, *args: Any, **kwargs: Any) -> Any:
        # The core calls forward through Signature.call: keyword-only by name.
        values = (*args, *(kwargs[name] for name in self.signature.keyword_only))
        out_struct, source = self._output_struct(values)
        # NumPy has no key type: typed PRNG keys cross as their data (uint32).
        values = jax.tree_util.tree_map(_key_data, values)
        call = _HostCall(self, values, ctx.needs_input_grad, out_struct, source)
        vmap_method = "expand_dims" if self.vmap is not None else self.vmap_method

        def forward_of_arrays(*arrays: Any) -> Any:
            out = pure_callback(call.forward, out_struct, *arrays, vmap_method=vmap_method)
            return _sharding.vary_like(out, arrays)  # under shard_map: per-device values

        # Only a second derivative differentiates this directly (through the
        # forward rule's residuals); first order goes through the call's rules.
        out = call_without_derivative(forward_of_arrays, call.arrays, self._second_order_message())
        # What backward needs: the inputs, as residuals (forward is re-run on
        # the host, so nothing else crosses), and the outputs' static
        # description. Absent output gradients must arrive as None: only the
        # host knows the user's set_materialize_grads/mark_non_differentiable.
        out_description = (
            jax.tree_util.tree_structure(out_struct),
            tuple((s.shape, s.dtype) for s in jax.tree_util.tree_leaves(out_struct)),
            source,
        )
        keep_host_residuals(ctx, (values, out_description))
        ctx.set_materialize_grads(False)
        return out

    def backward(self, ctx: FunctionCtx, *grads: Any) -> tuple:
        values, (out_treedef, out_kinds, source) = host_residuals(ctx)
        out_struct = jax.tree_util.tree_unflatten(
            out_treedef, [jax.ShapeDtypeStruct(s, d) for s, d in out_kinds]
        )
        call = _HostCall(self, values, ctx.needs_input_grad, out_struct, source)
        grad_leaves, grad_treedef = jax.tree_util.tree_flatten(grads, is_leaf=lambda g: g is None)
        present = [g for g in grad_leaves if g is not None]
        call.grad_treedef = grad_treedef
        call.grad_present = tuple(g is not None for g in grad_leaves)
        result_struct = [
            jax.ShapeDtypeStruct(shape, dtype)
            for (shape, dtype), w in zip(call.kinds, call.wanted, strict=True) if w
        ]
        gradients: list = [None] * len(call.arrays)  # per array input leaf
        if result_struct:

            def backward_of_arrays(*xs: Any) -> list:
                grads = pure_callback(call.backward, result_struct, *xs, vmap_method=self.vmap_method)
                return _sharding.vary_like(grads, xs)  # under shard_map: per-device values

            computed = iter(call_without_derivative(
                backward_of_arrays, (*call.arrays, *present), self._second_order_message()
            ))
            for d, w in enumerate(call.wanted):
                if w:
                    gradients[d] = next(computed)
        # One gradient per forward parameter, with the parameter's structure.
        return tuple(call.layout.combine(gradients, keep_static=False))

    def _second_order_message(self) -> str:
        return (
            f"{self.name}.backward runs in NumPy (host=True), so it cannot be "
            "differentiated: a second derivative (jax.hessian, grad of grad, "
            "jacfwd of grad) was asked for, as with @once_differentiable. For "
            f"higher-order derivatives write {self.name} in jax.numpy without host=True."
        )

    def _output_struct(self, values: tuple) -> tuple[Any, str]:
        """forward's outputs as a pytree of ShapeDtypeStructs, and where that came from."""
        if self.output_shapes is None:
            names = self.signature.names(len(values))
            for name, value in zip(names, values, strict=True):
                for leaf in jax.tree_util.tree_leaves(value):
                    if is_array(leaf) and not _is_key(leaf):
                        source = (
                            f"the shape and dtype of input {name!r} (inferred: "
                            f"{self.name} defines no output_shapes)"
                        )
                        return _shape_dtype(leaf), source
            raise TypeError(
                f"{self.name} is a host Function with no array input, so its output "
                f"shape cannot be inferred: define a staticmethod output_shapes that "
                "takes forward's inputs and returns a jax.ShapeDtypeStruct per output."
            )
        abstract = jax.tree_util.tree_map(
            lambda leaf: _shape_dtype(leaf) if is_array(leaf) else leaf, values
        )
        declared = self.signature.call(self.output_shapes, (), abstract)
        path_leaves, treedef = jax.tree_util.tree_flatten_with_path(
            declared, is_leaf=lambda x: x is None or _is_shape_like(x)
        )
        if not path_leaves:
            raise TypeError(
                f"{self.name}.output_shapes returned {short_repr(declared)}: expected a "
                "jax.ShapeDtypeStruct, or a tuple (or pytree) of them, one per output."
            )
        leaves = []
        for path, leaf in path_leaves:
            if not _is_shape_like(leaf):
                raise TypeError(
                    f"{self.name}.output_shapes returned {short_repr(leaf)} for "
                    f"{_output_name(path)}: expected a jax.ShapeDtypeStruct(shape, dtype) "
                    "(or any array, or an input, with that output's shape and dtype)."
                )
            leaves.append(_shape_dtype(leaf))
        return jax.tree_util.tree_unflatten(treedef, leaves), f"{self.name}.output_shapes"


# Dtypes that JAX narrows (to 32 bits) in a thread where x64 is off.
_WIDE = frozenset(np.dtype(t) for t in (np.float64, np.int64, np.uint64, np.complex128))


def pure_callback(callback: Any, result_struct: Any, *args: Any, vmap_method: str) -> Any:
    """``jax.pure_callback``, with the x64 setting of the trace wherever the callback runs.

    Why: XLA may run the callback on a thread of its own, which does not
    see a thread-local ``jax.enable_x64()`` (gradcheck's, or the user's).
    There JAX would narrow float64 arguments to float32 on their way in,
    and results on their way out (then reject them), so 64-bit arrays cross
    as their uint32 words (the same with x64 on or off), rebuilt on the
    other side; the callback runs under the trace's x64 setting, so
    vjpkit's own jnp work there keeps its precision.
    """
    x64 = jax.dtypes.canonicalize_dtype(np.float64) == np.float64
    arg_dtypes = [np.dtype(a.dtype) for a in args]
    treedef: Any
    leaves, treedef = jax.tree_util.tree_flatten(result_struct)
    out_dtypes = [np.dtype(s.dtype) for s in leaves]
    wire = [
        jax.ShapeDtypeStruct((*s.shape, d.itemsize // 4), np.uint32) if d in _WIDE else s
        for s, d in zip(leaves, out_dtypes, strict=True)
    ]

    def run(*xs: Any) -> list:
        try:
            xs = tuple(_np_from_words(x, d) if d in _WIDE else x for x, d in zip(xs, arg_dtypes, strict=True))
            with _jax_internals.enable_x64(x64):
                results = treedef.flatten_up_to(callback(*xs))
            return [_np_to_words(r) if d in _WIDE else r for r, d in zip(results, out_dtypes, strict=True)]
        except Exception as e:
            _callback_errors.carry(e, "host")  # the runtime's error that reaches the caller words it per backend
            raise

    sent = [_jax_to_words(a) if d in _WIDE else a for a, d in zip(args, arg_dtypes, strict=True)]
    got = jax.pure_callback(run, wire, *sent, vmap_method=vmap_method)
    rebuilt = [_jax_from_words(r, d) if d in _WIDE else r for r, d in zip(got, out_dtypes, strict=True)]
    return jax.tree_util.tree_unflatten(treedef, rebuilt)


# 64-bit arrays as uint32 words, in a new last axis (2 per element; 4 for
# complex128, real part first as in memory): NumPy on the host, lax in the program.


def _np_to_words(a: Any) -> np.ndarray:
    # Not np.ascontiguousarray: it makes a 0-d array 1-d, one axis too many on the wire.
    a = np.asarray(a, order="C")
    return a.reshape((*a.shape, 1)).view(np.uint32)


def _np_from_words(words: Any, dtype: np.dtype) -> np.ndarray:
    return np.asarray(words, order="C").view(dtype)[..., 0]


def _jax_to_words(x: Any) -> Any:
    if jax.dtypes.issubdtype(x.dtype, np.complexfloating):
        parts = jnp.stack([jnp.real(x), jnp.imag(x)], axis=-1)
        return jax.lax.bitcast_convert_type(parts, np.uint32).reshape((*x.shape, 4))
    return jax.lax.bitcast_convert_type(x, np.uint32)


def _jax_from_words(words: Any, dtype: np.dtype) -> Any:
    if dtype.kind == "c":
        parts = jax.lax.bitcast_convert_type(words.reshape((*words.shape[:-1], 2, 2)), np.float64)
        return jax.lax.complex(parts[..., 0], parts[..., 1])
    return jax.lax.bitcast_convert_type(words, dtype)


_LEAF = jax.tree_util.tree_structure(0)


class _HostCall:
    """One traced call's static data, and the two callbacks that run the user's NumPy code.

    Everything that depends only on shapes is worked out here, while JAX
    traces; ``forward`` and ``backward`` run each time the program runs.
    """

    def __init__(self, host: _HostFunction, values: tuple, needs: tuple, out_struct: Any, source: str):
        self.host = host
        self.name = host.name
        self.needs = needs
        self.layout, self.arrays = partition(values, is_array)
        self.kinds = [(tuple(a.shape), np.dtype(a.dtype)) for a in self.arrays]
        self.param_treedefs = tuple(self.layout.treedef.children())
        self.names = host.signature.names(len(values))
        owners = self.layout.owners()
        self.wanted = [
            needs[owners[i][0]] and is_differentiable_dtype(dtype)
            for i, (_, dtype) in zip(self.layout.dynamic, self.kinds, strict=True)
        ]
        paths, out_treedef = jax.tree_util.tree_flatten_with_path(out_struct)
        self.out_treedef: Any = out_treedef
        self.outputs = [(_output_name(path), tuple(s.shape), np.dtype(s.dtype)) for path, s in paths]
        self.source = source
        # Set by the JAX-side backward: which output gradients JAX passes.
        self.grad_treedef: Any = None
        self.grad_present: tuple = ()

    # -- host side: run when the compiled program runs ----------------------

    def _host_arrays(self, arrays: Any) -> tuple[list, tuple]:
        """The array arguments as NumPy arrays, and the vmap batch shape (``()`` if none)."""
        arrays = [np.asarray(a) for a in arrays]  # read-only views, no copy
        batch: tuple = ()
        if arrays:
            # Under vmap with expand_dims/broadcast_all every argument gets the
            # same leading batch axes (size 1 where it is unbatched).
            k = arrays[0].ndim - len(self.kinds[0][0])
            if k:
                batch = tuple(np.broadcast_shapes(*(a.shape[:k] for a in arrays)))
        return arrays, batch

    def _run_forward(self, ctx: FunctionCtx, values: tuple, setup: bool) -> Any:
        host = self.host
        return call_forward(ctx, host.signature, host.user_forward, host.user_setup_context, values, setup)

    def forward(self, *xs: Any) -> Any:
        arrays, batch = self._host_arrays(xs)
        if batch and self.host.vmap is not None:
            out = self._run_vmap(arrays, batch)
        else:
            values = self.layout.combine(arrays)
            with closing(FunctionCtx(self.name, self.needs, values)) as ctx:
                out = self._run_forward(ctx, values, setup=False)
        return self._check_outputs(out, batch)[1]

    def _run_vmap(self, arrays: list, batch: tuple) -> Any:
        """Calls the user's PyTorch-style ``vmap(info, in_dims, *args)`` with one batch axis."""
        size = math.prod(batch)
        k = len(batch)
        batched: list = []
        dims: list[int | None] = []
        for a in arrays:
            if size != 1 and all(d == 1 for d in a.shape[:k]):
                batched.append(a.reshape(a.shape[k:]))  # not batched
                dims.append(None)
            else:
                batched.append(np.broadcast_to(a, batch + a.shape[k:]).reshape((size, *a.shape[k:])))
                dims.append(0)
        in_dims = tuple(self.layout.combine(dims, keep_static=False))
        values = self.layout.combine(batched)
        result = self.host.signature.call(self.host.vmap, (VmapInfo(size), in_dims), values)
        if not (isinstance(result, tuple) and len(result) == 2):
            raise TypeError(
                f"{self.name}.vmap returned {short_repr(result)}: expected a pair "
                "(outputs, out_dims), as torch.autograd.Function.vmap does."
            )
        out, out_dims = result
        out_treedef: Any
        out_leaves, out_treedef = jax.tree_util.tree_flatten(out)
        if out_treedef != self.out_treedef:
            raise TypeError(
                f"{self.name}.vmap returned outputs {_describe(out)}, but {self.source} gives "
                f"{self.out_treedef.num_leaves} output(s) with structure {self.out_treedef}. "
                f"Return (outputs, out_dims) with outputs structured as {self.name}.forward's."
            )
        moved = []
        for output, leaf, d in zip(self.outputs, out_leaves, self._flat_out_dims(out, out_dims), strict=True):
            leaf = np.asarray(leaf)
            self._check_vmap_output(output, leaf, d, size)
            leaf = np.broadcast_to(leaf, (size, *leaf.shape)) if d is None else np.moveaxis(leaf, d, 0)
            moved.append(leaf.reshape(batch + leaf.shape[1:]))
        return jax.tree_util.tree_unflatten(out_treedef, moved)

    def _flat_out_dims(self, out: Any, out_dims: Any) -> list:
        """vmap's ``out_dims``, one per output leaf: an int or None applies to every output under it."""
        def is_dim(d: Any) -> bool:
            return d is None or (isinstance(d, (int, np.integer)) and not isinstance(d, bool))

        try:
            per_subtree = jax.tree_util.tree_map(
                lambda d, sub: [d] * len(jax.tree_util.tree_leaves(sub)), out_dims, out, is_leaf=is_dim
            )
        except (ValueError, TypeError):
            per_subtree = None
        dims = jax.tree_util.tree_leaves(per_subtree, is_leaf=lambda x: isinstance(x, list))
        if per_subtree is None or not all(map(is_dim, (d for ds in dims for d in ds))):
            raise TypeError(
                f"{self.name}.vmap returned out_dims={short_repr(out_dims)} for outputs "
                f"{_describe(out)}: expected an int or None for every output, or a pytree "
                f"of them with the outputs' structure (as torch.autograd.Function.vmap's "
                "out_dims): the axis of each output that holds the batch, None where an "
                f"output is the same for every example. {see_catalogue('host-vmap-out-dims-structure')}"
            )
        return [d for ds in dims for d in ds]

    def _check_vmap_output(self, output: tuple, leaf: np.ndarray, d: int | None, size: int) -> None:
        """One output of vmap: its batch axis ``d`` (an axis of the batch's size) and its per-example shape."""
        name, shape, dtype = output
        batched = (size, *shape)
        if d is not None and not -leaf.ndim <= d < leaf.ndim:
            raise ValueError(
                f"{self.name}.vmap returned {name} of shape {leaf.shape} with out_dims {d}, "
                f"which is not one of its axes (expected shape {batched} with the batch of "
                f"{size} at axis 0, or {shape} with out_dims None). Give the axis that holds "
                "the batch, or None for an output that is the same for every example."
            )
        if d is not None and leaf.shape[d] != size:
            raise ValueError(
                f"{self.name}.vmap returned {name} of shape {leaf.shape} whose batch axis "
                f"(out_dims {d}) has size {leaf.shape[d]}, but the batch has {size} examples "
                "(info.batch_size). Return the output with the batch at that axis, or give "
                "out_dims None for an output that is the same for every example. "
                f"{see_catalogue('host-vmap-batch-axis')}"
            )
        example = leaf.shape if d is None else leaf.shape[:d % leaf.ndim] + leaf.shape[d % leaf.ndim + 1:]
        if example != shape or _dtype_kind(leaf.dtype) != _dtype_kind(dtype):
            raise ValueError(
                f"{self.name}.vmap returned {name} of shape {leaf.shape} and dtype {leaf.dtype} "
                f"with out_dims {d}: one example of shape {example}, but {self.source} gives "
                f"shape {shape} and dtype {dtype}. "
                f"{_kind_hint(leaf.dtype, dtype) if example == shape else ''}"
                f"Fix {self.name}.vmap to return what forward returns for each example."
            )

    def _check_outputs(self, out: Any, batch: tuple) -> tuple[list, Any]:
        """forward's outputs checked against their declared shapes and dtypes.

        Returns the user's own leaves (mark_non_differentiable works by
        identity) and the NumPy outputs for pure_callback. A dtype of the
        same kind (float64 where float32 is declared) is cast; anything
        else (an int or bool where a float is declared) raises, naming the
        output: a cast across kinds would hide a wrong result.
        """
        got_leaves, got_treedef = jax.tree_util.tree_flatten(out)
        if got_treedef != self.out_treedef:
            raise TypeError(
                f"{self.name}.forward returned {_describe(out)}, but {self.source} gives "
                f"{self.out_treedef.num_leaves} output(s) with structure {self.out_treedef}. "
                "Make output_shapes return one jax.ShapeDtypeStruct per output, in "
                "forward's return structure."
            )
        arrays = []
        for (name, shape, dtype), leaf in zip(self.outputs, got_leaves, strict=True):
            a = np.asarray(leaf)
            shape = batch + shape
            if a.shape != shape or _dtype_kind(a.dtype) != _dtype_kind(dtype):
                raise ValueError(
                    f"{self.name}.forward returned {name} with shape {a.shape} and "
                    f"dtype {a.dtype}, but {self.source} gives shape {shape} and dtype "
                    f"{dtype}. {_kind_hint(a.dtype, dtype) if a.shape == shape else ''}"
                    f"Fix forward, or define (or fix) the staticmethod "
                    f"{self.name}.output_shapes(*inputs) returning a "
                    "jax.ShapeDtypeStruct per output."
                    + (f" {see_catalogue('host-output-of-another-kind')}" if a.shape == shape else "")
                )
            arrays.append(a if a.dtype == dtype else a.astype(dtype))
        return got_leaves, jax.tree_util.tree_unflatten(self.out_treedef, arrays)

    def backward(self, *xs: Any) -> list:
        n = len(self.arrays)
        arrays, batch = self._host_arrays(xs[:n])
        values = self.layout.combine(arrays)
        # Re-run forward: it rebuilds ctx (saved arrays, attributes, flags)
        # on the host, so none of it has to cross into JAX.
        with closing(FunctionCtx(self.name, self.needs, values)) as ctx:
            out_leaves, _ = self._check_outputs(self._run_forward(ctx, values, setup=True), batch)
        left = forwarded(ctx)
        marked = {id(x) for x in left.non_differentiable}
        materialize = left.materialize
        given = iter(xs[n:])
        grads = []
        for leaf, (_, shape, dtype), present in zip(out_leaves, self.outputs, self.grad_present, strict=True):
            g = np.asarray(next(given)) if present else None
            if g is None or id(leaf) in marked:
                g = np.zeros(batch + shape, dtype) if materialize else None
            grads.append(g)
        with closing(rule_ctx(self.name, "backward", self.needs, left.carried, materialize)) as backward_ctx:
            result = self.host.user_backward(
                backward_ctx, *jax.tree_util.tree_unflatten(self.grad_treedef, grads)
            )
        return self._check_gradients(result, batch)

    def _check_gradients(self, result: Any, batch: tuple) -> list:
        """backward's result as the wanted input gradients, in NumPy.

        The common case (one array, of the input's shape, per array
        parameter) is checked and cast here in NumPy; anything else goes
        through the core's check_backward_outputs, for its summing of
        broadcast gradients and its errors.
        """
        kinds = [(batch + shape, dtype) for shape, dtype in self.kinds]
        plain = self._plain_gradients(result, kinds)
        if plain is None:
            plain = self._fit_gradients(result, batch)
        return [
            np.zeros(shape, dtype) if g is None else np.asarray(g, dtype)
            for g, (shape, dtype), w in zip(plain, kinds, self.wanted, strict=True)
            if w
        ]

    def _fit_gradients(self, result: Any, batch: tuple) -> list:
        """backward's result fitted to the inputs by the core's check (its sum-down, its errors).

        The core sums a broadcast gradient down to its input's shape by
        aligning shapes from the right. Under vmap (expand_dims or
        broadcast_all) each gradient has the batch axes in front, so they
        are moved to the back for the check: the per-example part is then
        summed down as without vmap, never across examples.
        """
        if not batch:
            return self._check_backward_outputs(result, self.kinds)
        k = len(batch)
        at_back = [(shape + batch, dtype) for shape, dtype in self.kinds]
        try:
            fitted = self._check_backward_outputs(
                jax.tree_util.tree_map(lambda g: _batch_to_back(g, batch), result), at_back
            )
        except (TypeError, ValueError) as e:
            # Report what is wrong with one example, in the shapes the user declared.
            first = jax.tree_util.tree_map(lambda g: g[(0,) * k] if _has_batch_axes(g, k) else g, result)
            self._check_backward_outputs(first, self.kinds)
            raise ValueError(
                f"{self.name}.backward returned a gradient whose leading (batch) axes "
                f"do not match the batch {batch} under jax.vmap with "
                f"vmap_method={self.host.vmap_method!r}: backward receives its arrays with "
                "the batch axes in front and must return each gradient with them in "
                "front too (size 1 where it is the same for every example). "
                f"{see_catalogue('host-gradient-without-batch-axes')}"
            ) from e
        return [None if g is None else np.moveaxis(np.asarray(g), range(-k, 0), range(k)) for g in fitted]

    def _check_backward_outputs(self, result: Any, kinds: list) -> list:
        leaf_kinds = self.layout.leaves(kinds, keep_static=False)
        return check_backward_outputs(self.name, result, self.param_treedefs, self.names, leaf_kinds, self.needs)

    def _plain_gradients(self, result: Any, kinds: list) -> list | None:
        """One gradient (or None) per array input, if backward's result needs no fitting."""
        n = len(self.param_treedefs)
        if n == 1 and not isinstance(result, tuple):
            result = (result,)
        if not isinstance(result, tuple) or len(result) != n:
            return None
        plain = []
        leaf = 0
        kind = iter(kinds)
        for param, (td, g) in enumerate(zip(self.param_treedefs, result, strict=True)):
            if td.num_leaves == 0 or leaf not in self.layout.dynamic:
                if g is not None:
                    return None  # a gradient for a static input: the check raises
            elif td != _LEAF:
                return None  # a pytree parameter
            else:
                shape, dtype = next(kind)
                if g is not None:
                    if not isinstance(g, np.ndarray) or g.shape != shape:
                        return None
                    if np.iscomplexobj(g) and not np.issubdtype(dtype, np.complexfloating):
                        return None
                    g = g if self.needs[param] else None
                plain.append(g)
            leaf += td.num_leaves
        return plain


_KINDS = ((np.bool_, "bool"), (np.integer, "integer"), (np.floating, "floating"), (np.complexfloating, "complex"))


def _dtype_kind(dtype: Any) -> str | None:
    """What a host output may be cast within: bool, integer (signed or not), floating or complex."""
    for generic, kind in _KINDS:
        if jax.dtypes.issubdtype(dtype, generic):
            return kind
    return None


def _kind_hint(got: Any, declared: Any) -> str:
    return (
        "vjpkit casts an output only within its kind of dtype (float64 to float32), not "
        f"across kinds ({_dtype_kind(got) or got} to {_dtype_kind(declared) or declared}). "
    )


def _has_batch_axes(g: Any, k: int) -> bool:
    return is_array(g) and g.ndim >= k


def _batch_to_back(g: Any, batch: tuple) -> Any:
    """A batched gradient with its ``len(batch)`` leading axes broadcast to ``batch`` and moved last."""
    k = len(batch)
    if not _has_batch_axes(g, k):
        return g  # not an array with batch axes: the check reports it
    try:
        g = np.broadcast_to(np.asarray(g), batch + tuple(g.shape[k:]))
    except ValueError:
        return g  # batch axes that do not fit: the check fails, and the error says why
    return np.moveaxis(g, range(k), range(-k, 0))


def _describe(out: Any) -> str:
    n = len(jax.tree_util.tree_leaves(out))
    return f"{short_repr(out) if n <= 1 else f'{n} outputs'} (structure {jax.tree_util.tree_structure(out)})"
