"""Forward mode: Functions that define ``jvp`` (alone, or with ``backward``).

A class with only ``backward`` is a plain ``custom_vjp`` (``_function.py``).
A class with ``jvp`` becomes a ``jax.custom_jvp`` (symbolic zeros, so
``needs_input_grad`` is real) whose rule runs the user's forward and returns
the output tangent through ``_jax_internals.linear_call``:

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

from typing import Any

import jax
import jax.numpy as jnp
from jax.custom_derivatives import SymbolicZero

from . import _anomaly, _jax_internals, _sharding
from ._ctx import _short_repr, closing, is_array, rule_ctx
from ._outputs import Packed, is_differentiable_dtype
from ._program import Program, Residuals, as_arrays, naming_traced_values, profiled


def forward_mode_function(program: Program) -> Any:
    """The ``custom_jvp`` of ``program``'s array leaves, returning ``Packed``."""
    spec = program.spec

    def primal(*arrays: Any) -> Packed:
        return program.primal(*arrays)

    primal.__name__ = primal.__qualname__ = spec.name
    function = jax.custom_jvp(primal)

    def rule(primals: tuple, tangents: tuple) -> tuple[Packed, Packed]:
        return _Rule(program).run(primals, tangents)

    rule.__name__ = rule.__qualname__ = f"{spec.name}.jvp"
    function.defjvp(rule, symbolic_zeros=True)
    return function


class _Rule:
    """One run of the custom_jvp rule: forward, then the tangent via linear_call."""

    def __init__(self, program: Program):
        self.program = program
        self.spec = program.spec
        self.name = program.spec.name

    def run(self, primals: tuple, tangents: tuple) -> tuple[Packed, Packed]:
        program, spec = self.program, self.spec
        arrays = as_arrays(primals)
        perturbed = [type(t) is not SymbolicZero for t in tangents]
        tangents = tuple(t if type(t) is SymbolicZero else as_arrays((t,))[0] for t in tangents)
        needs = program.needs_input_grad(perturbed, arrays)
        perturbed = [
            p and is_differentiable_dtype(jnp.result_type(x)) for p, x in zip(perturbed, arrays, strict=True)
        ]
        packed, residuals = program.run_forward(arrays, needs, forward_mode=True)
        self.meta = residuals.meta
        self.out_layout = packed.layout
        self.in_avals = [(tuple(x.shape), x.dtype) for x in arrays]
        self.linear = [d for d, p in enumerate(perturbed) if p]
        self.outputs = [j for j, diff in enumerate(self.meta.differentiable) if diff]

        tangents_out: list = [_jax_internals.symbolic_zero_like(a) for a in packed.arrays]

        shardings = _sharding.gradient_shardings(self.meta.in_kinds)  # one per array input
        gradient_shardings = [shardings[d] for d in self.linear]

        def backward_rule(residuals: tuple, cotangents: tuple) -> list:
            # Under Explicit mesh axes the zeros for absent gradients are typed as their inputs too.
            return _sharding.call_with_auto_axes(self.apply_backward, (residuals, cotangents), gradient_shardings)

        backward_rule.takes_symbolic_zeros = True  # type: ignore[attr-defined]  # backward sees None for absent gradients
        if self.linear and self.outputs:
            computed = _jax_internals.linear_call(
                residuals.arrays,
                [tangents[d] for d in self.linear],
                apply=self.apply_jvp,
                transpose=backward_rule if spec.backward is not None else None,
                out_avals=[
                    jax.core.ShapedArray(packed.arrays[j].shape, packed.arrays[j].dtype)
                    for j in self.outputs
                ],
                name=self.name,
            )
            for j, t in zip(self.outputs, computed, strict=True):
                tangents_out[j] = t
        return packed, Packed(tuple(tangents_out), packed.layout)

    # -- the two rules of the linear_call ---------------------------------

    def apply_jvp(self, residuals: tuple, linear: tuple) -> list:
        """Output tangents (differentiable outputs) from input tangents: user's jvp."""
        program, meta = self.program, self.meta
        assert self.spec.jvp is not None  # a forward-mode rule exists only for a class with jvp
        tangent_leaves: list = [None] * len(self.in_avals)
        for d, t in zip(self.linear, linear, strict=True):
            tangent_leaves[d] = t
        for d, t in enumerate(tangent_leaves):
            if t is None and meta.materialize and is_differentiable_dtype(self.in_avals[d][1]):
                tangent_leaves[d] = jnp.zeros(*self.in_avals[d])
        ctx = rule_ctx(self.name, "jvp", meta.needs, meta.layout.combine(residuals), meta.materialize)
        try:
            with naming_traced_values(self.name, lambda: "jvp"), closing(ctx), profiled(self.name, "jvp"):
                result = self.spec.jvp(ctx, *program.layout.combine(tangent_leaves, keep_static=False))
        except _sharding.sharding_type_errors() as e:
            raise _sharding.forward_sharding_error(self.name, "jvp", e) from None
        tangents_out = self._check_jvp_outputs(result)
        if program.anomaly:
            labelled = [
                (f"the tangent of output {j}", t) for j, t in zip(self.outputs, tangents_out, strict=True)
            ]
            _anomaly.check_finite(self.name, "jvp", labelled)
        return tangents_out

    def apply_backward(self, residuals: tuple, cotangents: tuple) -> list:
        """Input cotangents (perturbed inputs) from output cotangents: user's backward."""
        full: list = [SymbolicZero(None)] * len(self.meta.out_avals)  # type: ignore[arg-type]  # absent
        for j, ct in zip(self.outputs, cotangents, strict=True):
            if ct is not None:
                full[j] = ct
        per_leaf = self.program.run_backward(Residuals(tuple(residuals), self.meta), self.out_layout, full)
        return [
            jnp.zeros(*self.in_avals[d]) if per_leaf[d] is None else per_leaf[d]
            for d in self.linear
        ]

    def _check_jvp_outputs(self, result: Any) -> list:
        layout, name = self.out_layout, self.name
        spread = layout.is_tuple()  # a tuple output: one tangent per element
        n_outputs = len(layout.treedef.children()) if spread else 1
        if spread:
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
        by_position = dict(zip(layout.dynamic, range(len(layout.dynamic)), strict=True))
        tangents = []
        for position, t in enumerate(leaves):
            j = by_position.get(position)
            if j is None or not self.meta.differentiable[j]:
                continue
            shape, dtype = self.meta.out_avals[j]
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
            if jnp.issubdtype(t.dtype, jnp.complexfloating) and not jnp.issubdtype(dtype, jnp.complexfloating):
                raise TypeError(
                    f"{name}.jvp returned a complex tangent ({t.dtype}) for output {j}, "
                    f"which is real ({dtype}): expected dtype {dtype}. Take the real part "
                    "explicitly if that is what you mean."
                )
            tangents.append(t if t.dtype == dtype else t.astype(dtype))
        return tangents


def _same_structure(treedef: Any, value: Any) -> bool:
    try:
        treedef.flatten_up_to(value)
    except (ValueError, TypeError):
        return False
    return True
