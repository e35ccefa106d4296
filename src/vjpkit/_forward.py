"""Forward mode: Functions that define ``jvp`` (alone, or with ``backward``).

A class with only ``backward`` is a plain ``custom_vjp`` (``_function.py``).
A class with ``jvp`` becomes a ``jax.custom_jvp`` (symbolic zeros, so
``needs_input_grad`` is real) whose rule runs the user's forward and returns
the output tangent through ``_linear_call.linear_call``:

- ``jax.jvp``/``jax.jacfwd`` evaluate that call: the user's ``jvp`` runs;
- ``jax.grad``/``jax.vjp``/``jax.jacrev`` transpose it: the user's
  ``backward`` runs, or, for a class with only ``jvp``, JAX transposes the
  user's ``jvp`` (which must then be linear in the tangents);
- second order differentiates through the residuals as well.

Why not ``custom_jvp`` alone: JAX would transpose the jvp rule for reverse
mode and never call ``backward``. Why not ``linear_call`` from JAX: it has
no batching rule (``jax.jacfwd`` vmaps) and its JVP rule asserts that the
residuals are constant (``jax.hessian`` fails).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
from jax.custom_derivatives import SymbolicZero

from . import _anomaly, _jax_internals, _linear_call
from ._args import Layout, split_residuals
from ._ctx import FunctionCtx, _short_repr, is_array
from ._once import call_without_derivative
from ._outputs import (
    Packed,
    differentiable_outputs,
    is_differentiable_dtype,
    output_cotangents,
    pack_outputs,
)

if TYPE_CHECKING:
    from ._function import _Program

__all__ = ["forward_mode_function"]


def forward_mode_function(program: _Program) -> Any:
    """The ``custom_jvp`` of ``program``'s array leaves, returning ``Packed``."""
    spec = program.spec

    def primal(*arrays: Any) -> Packed:
        return program._primal(*arrays)

    primal.__name__ = primal.__qualname__ = spec.name
    function = jax.custom_jvp(primal)

    def rule(primals: tuple, tangents: tuple) -> tuple[Packed, Packed]:
        return _Rule(program).run(primals, tangents)

    rule.__name__ = rule.__qualname__ = f"{spec.name}.jvp"
    function.defjvp(rule, symbolic_zeros=True)
    return function


class _Rule:
    """One run of the custom_jvp rule: forward, then the tangent via linear_call."""

    def __init__(self, program: _Program):
        self.program = program
        self.spec = program.spec
        self.name = program.spec.name

    def run(self, primals: tuple, tangents: tuple) -> tuple[Packed, Packed]:
        program, spec = self.program, self.spec
        arrays = tuple(primals)
        perturbed = [type(t) is not SymbolicZero for t in tangents]
        self.needs = program.needs_input_grad(perturbed, arrays)
        self.perturbed = perturbed = [
            p and is_differentiable_dtype(jnp.result_type(x)) for p, x in zip(perturbed, arrays)
        ]
        values = program.layout.rebuild(arrays)
        ctx = FunctionCtx(self.name, self.needs, values)
        try:
            out = program._run_forward(ctx, values)
            packed = pack_outputs(self.name, out)
            if program.anomaly:
                program.check_outputs(packed)
            self.differentiable = differentiable_outputs(out, ctx._vjpkit_non_differentiable)
            self.residual_layout, res_arrays = split_residuals(
                (ctx._vjpkit_saved, ctx._vjpkit_saved_forward, ctx._user_attributes())
            )
            self.materialize = ctx._vjpkit_materialize
        finally:
            ctx._vjpkit_open = False

        self.out_layout = packed.layout
        self.out_avals = [(tuple(a.shape), a.dtype) for a in packed.arrays]
        self.in_kinds = program.input_kinds(arrays)
        self.in_avals = [(tuple(x.shape), x.dtype) for x in arrays]
        self.linear = [d for d, p in enumerate(perturbed) if p]
        self.outputs = [j for j, diff in enumerate(self.differentiable) if diff]

        tangents_out: list = [_jax_internals.symbolic_zero_like(a) for a in packed.arrays]
        def backward_rule(residuals: tuple, cotangents: tuple) -> list:
            return self.apply_backward(residuals, cotangents)

        backward_rule.takes_symbolic_zeros = True  # backward sees None for absent gradients
        if self.linear and self.outputs:
            computed = _linear_call.linear_call(
                res_arrays,
                [tangents[d] for d in self.linear],
                apply=self.apply_jvp,
                transpose=backward_rule if spec.backward is not None else None,
                # The primal outputs' own types: inside shard_map, a tangent varies where its output does.
                out_avals=[_jax_internals.tangent_aval(packed.arrays[j]) for j in self.outputs],
                name=self.name,
            )
            for j, t in zip(self.outputs, computed):
                tangents_out[j] = t
        return packed, Packed(tuple(tangents_out), packed.layout)

    # -- the two rules of the linear_call ---------------------------------

    def _ctx(self, method: str, residuals: tuple) -> FunctionCtx:
        saved, saved_forward, attributes = self.residual_layout.rebuild(residuals)
        ctx = FunctionCtx(self.name, self.needs)
        ctx._vjpkit_method = method
        ctx._vjpkit_saved = saved
        ctx._vjpkit_saved_forward = saved_forward
        ctx._vjpkit_in_jvp = method == "jvp"
        ctx._vjpkit_materialize = self.materialize
        ctx.__dict__.update(attributes)
        return ctx

    def apply_jvp(self, residuals: tuple, linear: tuple) -> list:
        """Output tangents (differentiable outputs) from input tangents: user's jvp."""
        program = self.program
        tangent_leaves: list = [None] * len(self.in_avals)
        for d, t in zip(self.linear, linear):
            tangent_leaves[d] = t
        for d, t in enumerate(tangent_leaves):
            if t is None and self.materialize and is_differentiable_dtype(self.in_avals[d][1]):
                tangent_leaves[d] = jnp.zeros(*self.in_avals[d])
        layout = program.layout
        tangents = Layout(layout.treedef, tuple((i, None) for i, _ in layout.static), layout.dynamic)
        ctx = self._ctx("jvp", residuals)
        try:
            result = self.spec.jvp(ctx, *tangents.rebuild(tangent_leaves))
        finally:
            ctx._vjpkit_open = False
        tangents_out = self._check_jvp_outputs(result)
        if program.anomaly:
            labelled = [(f"the tangent of output {j}", t) for j, t in zip(self.outputs, tangents_out)]
            _anomaly.check_finite(self.name, "jvp", labelled)
        return tangents_out

    def apply_backward(self, residuals: tuple, cotangents: tuple) -> list:
        """Input cotangents (perturbed inputs) from output cotangents: user's backward."""
        if not self.spec.once_differentiable:
            return self._backward(residuals, cotangents)
        n = len(residuals)
        present = [ct is not None for ct in cotangents]

        def backward_of_arrays(*xs: Any) -> list:
            given = iter(xs[n:])
            return self._backward(xs[:n], [next(given) if p else None for p in present])

        return call_without_derivative(
            backward_of_arrays,
            (*residuals, *(ct for ct in cotangents if ct is not None)),
            self.program.once_message(),
        )

    def _backward(self, residuals: tuple, cotangents: tuple) -> list:
        program = self.program
        full: list = [SymbolicZero(None)] * len(self.out_avals)  # absent: zeros or None
        for j, ct in zip(self.outputs, cotangents):
            if ct is not None:
                full[j] = ct
        grads = output_cotangents(
            self.out_layout, full, self.out_avals, self.differentiable, self.materialize
        )
        per_leaf = program.run_backward(self._ctx("backward", residuals), grads, self.in_kinds, self.needs)
        return [
            jnp.zeros(*self.in_avals[d]) if per_leaf[d] is None else per_leaf[d]
            for d in self.linear
        ]

    def _check_jvp_outputs(self, result: Any) -> list:
        layout, name = self.out_layout, self.name
        n_outputs = len(layout.treedef.children()) if layout.spread else 1
        if layout.spread:
            if not isinstance(result, tuple):
                result = (result,)
            if len(result) != n_outputs:
                raise TypeError(
                    f"{name}.jvp returned {len(result)} tangent{'s' if len(result) != 1 else ''}, "
                    f"expected {n_outputs} (one per output of forward)."
                )
            structured = result
        else:
            # A single array matches any structure, so a tuple is never its tangent.
            single = jax.tree_util.treedef_is_leaf(layout.treedef)
            if isinstance(result, tuple) and (single or not _same_structure(layout.treedef, result)):
                if len(result) != 1:
                    raise TypeError(
                        f"{name}.jvp returned {len(result)} tangents, expected 1 (one per "
                        f"output of forward, which returns a single "
                        f"{'array' if single else 'pytree'}, not a tuple). Return the "
                        "tangent itself."
                    )
                result = result[0]
            structured = result
        try:
            leaves = layout.treedef.flatten_up_to(structured)
        except (ValueError, TypeError):
            got = jax.tree_util.tree_structure(structured, is_leaf=lambda x: x is None)
            raise TypeError(
                f"{name}.jvp returned tangents with structure {got}, expected the "
                f"output's structure {layout.treedef} (None is allowed for any part)."
            ) from None
        by_position = dict(zip(layout.dynamic, range(len(layout.dynamic))))
        tangents = []
        for position, t in enumerate(leaves):
            j = by_position.get(position)
            if j is None or not self.differentiable[j]:
                continue
            shape, dtype = self.out_avals[j]
            if t is None:
                tangents.append(jnp.zeros(shape, dtype))
                continue
            if not is_array(t):
                raise TypeError(
                    f"{name}.jvp returned {_short_repr(t)} as the tangent of output {j}: "
                    f"expected an array of shape {shape} and dtype {dtype}, or None."
                )
            if tuple(t.shape) != shape:
                raise ValueError(
                    f"{name}.jvp returned a tangent of shape {tuple(t.shape)} for "
                    f"output {j}: expected shape {shape}."
                )
            tangents.append(t if t.dtype == dtype else t.astype(dtype))
        return tangents


def _same_structure(treedef: Any, value: Any) -> bool:
    try:
        treedef.flatten_up_to(value)
    except (ValueError, TypeError):
        return False
    return True
