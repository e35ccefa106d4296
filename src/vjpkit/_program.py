"""The differentiable function of a program: one ``custom_jvp`` for both modes.

Every Function becomes a ``jax.custom_jvp`` (symbolic zeros, so
``needs_input_grad`` is real) whose rule runs the user's forward and returns
the output tangent through ``_linear_call.linear_call`` (``_tie.OwnDerivative``):

- ``jax.jvp``/``jax.jacfwd`` evaluate that call: the user's ``jvp`` runs
  (a class with only ``backward`` raises, naming the class);
- ``jax.grad``/``jax.vjp``/``jax.jacrev`` transpose it: the user's
  ``backward`` runs, or, for a class with only ``jvp``, JAX transposes the
  user's ``jvp`` (which must then be linear in the tangents);
- second order differentiates through the residuals as well, and takes the
  derivative of outputs and saved outputs from the same rules (``_tie``).

Why not ``custom_vjp`` for a class with only ``backward``: forward may
save different arrays (and always sees other ``needs_input_grad``) for each
set of differentiated inputs, and ``custom_vjp`` keeps one residual
structure per traced call, that of the last forward rule it traced, for
every backward of that call (jax#16614): a jitted program differentiated
eagerly with respect to ``x``, then ``w``, then both, ran backward with the
second call's ``needs_input_grad``. A ``custom_jvp`` keeps each rule's
trace, with its residuals and ``linear_call``, together.

Why not ``custom_jvp`` alone: JAX would transpose the jvp rule for reverse
mode and never call ``backward``. Why not ``linear_call`` from JAX: it has
no batching rule (``jax.jacfwd`` vmaps) and its JVP rule asserts that the
residuals are constant (``jax.hessian`` fails).
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.custom_derivatives import SymbolicZero

from . import _jax_internals
from ._outputs import Packed, is_differentiable_dtype
from ._runner import Program, Spec, as_arrays, no_forward_mode, not_differentiable
from ._tie import OwnDerivative, tie_outputs
from ._tree import Partition

_ANY_ARGUMENTS = inspect.signature(lambda *args: None)


def forward_mode_function(program: Program) -> Any:
    """The ``custom_jvp`` of ``program``'s array leaves, returning ``Packed``."""
    spec = program.spec

    def primal(*arrays: Any) -> Packed:
        return program.primal(*arrays)

    primal.__name__ = primal.__qualname__ = spec.name
    primal.__signature__ = _ANY_ARGUMENTS  # type: ignore[attr-defined]  # read by JAX on each call, never built
    function = jax.custom_jvp(primal)

    def rule(primals: tuple, tangents: tuple) -> tuple[Packed, Packed]:
        return _Rule(program).run(primals, tangents)

    rule.__name__ = rule.__qualname__ = f"{spec.name}.jvp"
    # JAX would work these out anew on every call while tracing (the same each time).
    n_arrays = len(program.layout.dynamic)
    _jax_internals.save_debug_info(primal, "custom_jvp fun", n_arrays)
    _jax_internals.save_rule_debug_info(rule, "custom_jvp jvp", n_arrays)
    function.defjvp(rule, symbolic_zeros=True)
    return function


class _Rule:
    """One run of the custom_jvp rule: forward, then the tangent via linear_call."""

    def __init__(self, program: Program):
        self.program = program

    def run(self, primals: tuple, tangents: tuple) -> tuple[Packed, Packed]:
        program = self.program
        spec = program.spec
        if spec.backward is None and spec.jvp is None:
            raise not_differentiable(spec)
        if spec.jvp is None and _jax_internals.differentiation("custom_jvp rule") != "vjp":
            raise no_forward_mode(spec)
        arrays = as_arrays(primals)
        perturbed = [type(t) is not SymbolicZero for t in tangents]
        tangents = tuple(t if type(t) is SymbolicZero else as_arrays((t,))[0] for t in tangents)
        needs = program.needs_input_grad(perturbed, arrays)
        perturbed = [
            p and is_differentiable_dtype(jnp.result_type(x)) for p, x in zip(perturbed, arrays, strict=True)
        ]
        packed, residuals = program.run_forward(arrays, needs, forward_mode=True)
        # Under a higher-order derivative, outputs and saved outputs differentiate by jvp, not forward's code.
        packed, residuals = tie_outputs(program, arrays, packed, residuals)
        in_avals = [(tuple(x.shape), x.dtype) for x in arrays]
        linear = [d for d, p in enumerate(perturbed) if p]
        own = OwnDerivative(program, residuals.meta, packed.layout, in_avals, linear, first_order=True)

        tangents_out: list = [_jax_internals.symbolic_zero_like(a) for a in packed.arrays]
        if linear and own.outputs:
            # The primal outputs' own types: inside shard_map, a tangent varies where its output does.
            out_types = [_jax_internals.tangent_aval(packed.arrays[j]) for j in own.outputs]
            computed = own.tangents(residuals.arrays, [tangents[d] for d in linear], out_types)
            for j, t in zip(own.outputs, computed, strict=True):
                tangents_out[j] = t
        return packed, Packed(tuple(tangents_out), packed.layout)


# ---------------------------------------------------------------------------
# One program per static signature.


class _Program(Program):
    """The differentiable function (and its ``jit``) for one static part of a call."""

    def __init__(self, spec: Spec, layout: Partition, n_values: int, anomaly: bool = False):
        super().__init__(spec, layout, n_values, anomaly)
        # The differentiable function of the array leaves, returning Packed: a
        # custom_jvp whose rule's tangent transposes to backward (see _forward.py).
        self.differentiable: Callable = forward_mode_function(self)
        # The jit of _jit_body lives in the cache entry, not on the program: JAX's
        # caches keep jaxprs whose custom_jvp rules refer to the program, so a
        # program that referred to its jit would keep that jit's cache key (and
        # compiled executables) alive after vjpkit's cache dropped it.

    def jit(self) -> tuple[Callable, Callable]:
        """New ``jax.jit``s of the program (one pair per cache entry): for calls on tracers, and on arrays.

        The second inlines when an outer jit traces (a call on closed-over
        arrays); the first keeps backward in a program of its own under
        eager ``jax.grad`` (backward sees tracers, as everywhere else).
        """
        body = _named(self._jit_body, self.spec.name)
        return jax.jit(body), jax.jit(body, inline=_jax_internals.INLINE_INTO_CALLER)

    def _jit_body(self, *arrays: Any) -> Any:
        packed = self.differentiable(*arrays)
        # jit can return static leaves only inside a pytree's static data.
        return packed if packed.layout.static else packed.unpack()


def _named(fn: Callable, name: str) -> Callable:
    """A plain function named ``name`` (JAX's error messages and jaxprs show it)."""

    def named(*args: Any) -> Any:
        return fn(*args)

    named.__name__ = named.__qualname__ = name
    named.__signature__ = _ANY_ARGUMENTS  # type: ignore[attr-defined]  # read by JAX on each call, never built
    return named


_ANY_ARGUMENTS = inspect.signature(lambda *args: None)

