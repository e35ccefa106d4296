"""A program: the user's methods run on one static part of a call, while JAX traces.

The one forward runner and the one backward runner live here, shared by
the ``custom_vjp`` rules (``_function.py``) and the forward-mode rule
(``_forward.py``):

- ``run_forward``: arguments rebuilt from their array leaves, a ctx, the
  user's forward (and setup_context), outputs packed and checked, and what
  forward left on ctx split into residual arrays and static data;
- ``run_backward``: output cotangents as backward expects them, a ctx
  rebuilt from the residuals, the user's backward, its gradients checked.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Sequence

import jax
from jax.errors import TracerArrayConversionError

from . import _anomaly, _host, _jax_internals, _sharding
from ._args import Signature, split_residuals
from ._ctx import FunctionCtx, call_forward, closing, forwarded, method_of, rule_ctx
from ._once import call_without_derivative, is_once_differentiable
from ._outputs import (
    Packed,
    check_backward_outputs,
    differentiable_outputs,
    is_differentiable_dtype,
    output_cotangents,
    pack_outputs,
)
from ._tree import Partition


class Spec:
    """What vjpkit reads off a class, once: its methods (those ``base`` defines count as absent) and options."""

    def __init__(self, cls: Any, base: type):
        self.name = cls.__name__
        self.forward = cls.forward
        self.backward = _defined(cls, base, "backward")
        self.jvp = _defined(cls, base, "jvp")
        self.setup_context = _defined(cls, base, "setup_context")
        self.signature = Signature(self.name, self.forward, skip_first=self.setup_context is None)
        self.jit = bool(cls.jit)
        self.cache_size = int(cls.cache_size)
        self.once_differentiable = is_once_differentiable(self.backward)
        if cls.host:
            _host.make_host(self, cls)  # NumPy methods, run through jax.pure_callback


def _defined(cls: type, base: type, method: str) -> Callable | None:
    fn = getattr(cls, method)
    return None if fn is getattr(base, method) else fn


# ---------------------------------------------------------------------------
# Residuals: arrays as pytree children, everything else as static data.


class ResidualMeta(NamedTuple):
    """Static data carried from forward to backward inside the residual treedef."""

    layout: Partition  # where saved arrays and ctx attributes go
    needs: tuple
    differentiable: tuple  # per array output: whether it carries a gradient
    out_avals: tuple
    materialize: bool
    in_kinds: tuple


class Residuals:
    __slots__ = ("arrays", "meta")

    def __init__(self, arrays: tuple, meta: ResidualMeta):
        self.arrays = arrays
        self.meta = meta


jax.tree_util.register_dataclass(Residuals, data_fields=["arrays"], meta_fields=["meta"])


def _kind(x: Any) -> tuple:
    return (tuple(x.shape), x.dtype)


class Program:
    """The user's methods for one static part of a call (``layout``), and their checks."""

    def __init__(self, spec: Spec, layout: Partition, n_values: int, anomaly: bool = False):
        self.spec = spec
        self.layout = layout
        self.anomaly = anomaly  # traced under vjpkit.detect_anomaly: NaN/Inf checks
        self.names = spec.signature.names(n_values)
        self.param_treedefs = tuple(layout.treedef.children())
        owners = layout.owners()
        self.param_of_dynamic = tuple(owners[k][0] for k in layout.dynamic)
        self.n_params = n_values

    def needs_input_grad(self, perturbed: Any, arrays: Any) -> tuple[bool, ...]:
        """One flag per parameter: whether JAX differentiates any of its float leaves."""
        needs = [False] * self.n_params
        for param, p, x in zip(self.param_of_dynamic, perturbed, arrays, strict=True):
            if p and is_differentiable_dtype(x.dtype):
                needs[param] = True
        return tuple(needs)

    def input_kinds(self, arrays: Any) -> tuple:
        """Per leaf of the bound arguments: None (static) or the array's type."""
        kinds = [(*_kind(x), _jax_internals.varying_axes(x), _sharding.explicit_sharding(x)) for x in arrays]
        return tuple(self.layout.leaves(kinds, keep_static=False))

    # -- forward -----------------------------------------------------------

    def primal(self, *arrays: Any) -> Packed:
        """forward's outputs when nothing is differentiated."""
        packed, _, _ = self._forward(arrays, (False,) * self.n_params)
        return packed

    def run_forward(self, arrays: tuple, needs: tuple, forward_mode: bool = False) -> tuple[Packed, Residuals]:
        """forward's outputs, and what backward (and, in ``forward_mode``, jvp) needs of it."""
        packed, out, ctx = self._forward(arrays, needs)
        left = forwarded(ctx, forward_mode)
        layout, res_arrays = split_residuals(left.carried)
        meta = ResidualMeta(
            layout, needs, differentiable_outputs(out, left.non_differentiable),
            tuple(_kind(a) for a in packed.arrays), left.materialize, self.input_kinds(arrays),
        )
        return packed, Residuals(res_arrays, meta)

    def _forward(self, arrays: tuple, needs: tuple) -> tuple[Packed, Any, FunctionCtx]:
        spec = self.spec
        values = self.layout.combine(arrays)
        ctx = FunctionCtx(spec.name, needs, values)
        try:
            with closing(ctx):
                out = call_forward(ctx, spec.signature, spec.forward, spec.setup_context, values)
        except _sharding.sharding_type_errors() as e:
            raise _sharding.forward_sharding_error(spec.name, method_of(ctx), e) from None
        except TracerArrayConversionError as e:
            raise TypeError(
                f"{spec.name}.{method_of(ctx)} converted a traced JAX array to "
                "NumPy. forward runs while JAX traces, so its arrays are tracers, "
                "not concrete values: write it with jax.numpy, or declare the "
                f"Function host-side (@vjpkit.function(host=True)) to run NumPy code."
            ) from e
        dirty = {id(x) for x in forwarded(ctx).dirty}
        if dirty and any(id(leaf) in dirty for leaf in jax.tree_util.tree_leaves(out)):
            raise ValueError(
                f"{spec.name}.forward marked an input dirty (ctx.mark_dirty) and "
                "returned that same input object unchanged. JAX arrays are "
                "immutable: compute the new value (e.g. x = x.at[i].set(v)) and "
                "return it."
            )
        packed = pack_outputs(spec.name, out)
        if self.anomaly:
            self.check_outputs(packed)
        return packed, out, ctx

    # -- backward ----------------------------------------------------------

    def run_backward(self, residuals: Residuals, out_layout: Partition, cotangents: Sequence[Any]) -> list:
        """backward's checked gradients: one cotangent (or None) per array input leaf.

        ``cotangents`` has one entry per array output, a ``SymbolicZero``
        where JAX passes none; backward receives zeros there, or None when
        forward turned materialization off (PyTorch's rule). Under Explicit
        mesh axes backward runs with them Auto, each gradient typed as its input.
        """
        return _sharding.call_with_auto_axes(
            self._run_backward,
            (residuals, out_layout, cotangents),
            _sharding.gradient_shardings(residuals.meta.in_kinds),
        )

    def _run_backward(self, residuals: Residuals, out_layout: Partition, cotangents: Sequence[Any]) -> list:
        meta = residuals.meta
        grads = output_cotangents(out_layout, cotangents, meta.out_avals, meta.differentiable, meta.materialize)
        if not self.spec.once_differentiable:
            return self._backward(meta, residuals.arrays, grads)
        grad_leaves, grad_treedef = jax.tree_util.tree_flatten(grads)
        n_res = len(residuals.arrays)

        def backward_of_arrays(*xs: Any) -> list:
            return self._backward(meta, xs[:n_res], jax.tree_util.tree_unflatten(grad_treedef, xs[n_res:]))

        return call_without_derivative(backward_of_arrays, (*residuals.arrays, *grad_leaves), self.once_message())

    def _backward(self, meta: ResidualMeta, res_arrays: Sequence[Any], grads: tuple) -> list:
        spec = self.spec
        assert spec.backward is not None  # run_backward is reached only when backward exists
        ctx = rule_ctx(spec.name, "backward", meta.needs, meta.layout.combine(res_arrays), meta.materialize)
        with closing(ctx):
            result = spec.backward(ctx, *grads)
        cotangents = check_backward_outputs(
            spec.name, result, self.param_treedefs, self.names, meta.in_kinds, meta.needs
        )
        if self.anomaly:
            self.check_gradients(cotangents)
        return cotangents

    def once_message(self) -> str:
        return (
            f"{self.spec.name}.backward is decorated with @once_differentiable, so it "
            "cannot be differentiated (a second derivative such as jax.hessian or "
            "grad of grad was asked for). Remove the decorator if backward is "
            "written in differentiable JAX operations."
        )

    # -- vjpkit.detect_anomaly ----------------------------------------------

    def check_outputs(self, packed: Packed) -> None:
        labelled = [(f"output {j}", a) for j, a in enumerate(packed.arrays)]
        _anomaly.check_finite(self.spec.name, "forward", labelled)

    def check_gradients(self, grads: list, method: str = "backward") -> None:
        """``grads``: one per array input leaf, as ``check_backward_outputs`` returns them."""
        labels = _anomaly.input_labels(self.names, self.layout)
        _anomaly.check_finite(self.spec.name, method, list(zip(labels, grads, strict=True)))
