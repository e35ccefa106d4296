"""A program: one static part of a call, as one ``jax.custom_jvp`` for both modes, and its ``jit``s.

``Program`` owns the ``custom_jvp`` of the call's array leaves: its primal
runs the user's forward, and its rule (``Program.rule``) runs forward
knowing which inputs are differentiated, ties the outputs (``_tie.py``),
and returns the output tangent as a ``linear_call`` (``_linear_call.py``)
whose two rules are the Function's own derivative (``OwnDerivative``).
Where reverse mode linearizes a call directly, ``apply`` makes the same
split itself (``Program.linearize``). The user's methods run in ``_runner.py``.

Every Function becomes a ``jax.custom_jvp`` (symbolic zeros, so
``needs_input_grad`` is real) whose rule runs the user's forward and returns
the output tangent through ``_linear_call.linear_call`` (``OwnDerivative``):

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
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
from jax.custom_derivatives import SymbolicZero
from jax.extend.core import ClosedJaxpr, jaxpr_as_fun

from . import _jax_internals, _sharding
from ._args import as_arrays
from ._linear_call import linear_call
from ._outputs import Packed, ResidualMeta, Residuals
from ._runner import Runner
from ._site import see_catalogue
from ._spec import Spec
from ._tie import tie_outputs
from ._tree import Partition, is_differentiable_dtype


class Program:
    """The differentiable function (and its ``jit``) for one static part of a call (``layout``).

    ``differentiable``: the ``custom_jvp`` of the call's array leaves,
    returning ``Packed``; ``jit()``: new ``jax.jit``s of it. ``runner``
    runs the user's methods.
    """

    def __init__(self, spec: Spec, layout: Partition, n_values: int, anomaly: bool = False):
        self.spec = spec
        self.anomaly = anomaly  # traced under vjpkit.detect_anomaly: NaN/Inf checks
        self.runner = Runner(spec, layout, n_values, anomaly)
        self.differentiable: Callable = self._custom_jvp()
        # The jit of _jit_body lives in the cache entry, not on the program: JAX's
        # caches keep jaxprs whose custom_jvp rules refer to the program, so a
        # program that referred to its jit would keep that jit's cache key (and
        # compiled executables) alive after vjpkit's cache dropped it.

    def _custom_jvp(self) -> Any:
        spec, runner = self.spec, self.runner
        primal = _named(self._primal, spec.name)
        function = jax.custom_jvp(primal)

        def rule(primals: tuple, tangents: tuple) -> tuple[Packed, Packed]:
            return self.rule(primals, tangents)

        rule.__name__ = rule.__qualname__ = f"{spec.name}.jvp"
        # JAX would work these out anew on every call while tracing (the same each time).
        n_arrays = len(runner.layout.dynamic)
        _jax_internals.save_debug_info(primal, "custom_jvp fun", n_arrays)
        _jax_internals.save_rule_debug_info(rule, "custom_jvp jvp", n_arrays)
        function.defjvp(rule, symbolic_zeros=True)
        return function

    def _primal(self, *arrays: Any) -> Packed:
        """forward's outputs where JAX runs the ``custom_jvp``'s function (nothing is differentiated there).

        Staged outside any vmap (a ``jit``, ``scan``, ``cond`` or
        ``checkpoint`` body), the outputs are tied: a vmap that batches the
        staged function later fixes its outputs' batch axes before a
        derivative runs the rule, and the tie's batching rule batches an
        output whose derivative varies along the batch even where its value
        does not (a loop over the examples gives each its own derivative).
        The tie lowers to nothing. Only where JAX's caches hold it weakly
        (JAX 0.7 on): before, a staged call's tie would keep its program
        alive, and such a vmap of a staged call raises an error naming the
        class instead (``_linear_call``).
        """
        if self.spec.host or not _jax_internals.is_staging() or not _jax_internals.PARAMETERS_HELD_WEAKLY:
            return self.runner.primal(*arrays)
        arrays = as_arrays(arrays)
        packed, residuals = self.runner.run_primal(arrays)
        return self._tied(arrays, packed, residuals)[0]

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

    # -- the custom_jvp's rule ---------------------------------------------

    def rule(self, primals: tuple, tangents: tuple) -> tuple[Packed, Packed]:
        """forward's outputs, and their tangent through ``linear_call`` (``tangents``: ``SymbolicZero`` where none)."""
        spec = self.spec
        self._check_differentiable()
        if spec.jvp is None and _jax_internals.differentiation("custom_jvp rule") != "vjp":
            raise no_forward_mode(spec)
        arrays = as_arrays(primals)
        perturbed = [type(t) is not SymbolicZero for t in tangents]
        tangents = tuple(t if type(t) is SymbolicZero else as_arrays((t,))[0] for t in tangents)
        with _jax_internals.on_primal_trace(arrays):
            packed, residuals, own = self._forward(arrays, perturbed)
        computed = self._tangents(own, arrays, packed, residuals, tangents)
        tangents_out = tuple(
            computed[j] if j in computed else _jax_internals.symbolic_zero_like(a) for j, a in enumerate(packed.arrays)
        )
        return packed, Packed(tangents_out, packed.layout)

    def linearize(self, trace: Any, leaves: tuple) -> Packed:
        """Reverse mode's linearization of the ``custom_jvp`` (``trace``: the trace that linearizes the call).

        What JAX makes of ``rule`` there (forward on the primals' trace, the
        ``linear_call`` on the tangents'), made directly. From JAX 0.7
        (``LinearizeTrace``) JAX would trace the rule under partial
        evaluation and evaluate its linear part again; before (a ``JVPTrace``
        over partial evaluation) it would run the rule, and every operation
        of forward, through partial evaluation, after checking its outputs.
        """
        self._check_differentiable()
        primal_trace, tangent_trace, primals, tangents = _jax_internals.linearize_inputs(trace, leaves)
        with _jax_internals.on_trace(primal_trace):
            arrays = as_arrays(primals)
            # JAX passes an integer input's tangent (float0) to the rule as a symbolic zero.
            perturbed = [t is not None and is_differentiable_dtype(x.dtype)
                         for t, x in zip(tangents, arrays, strict=True)]
            packed, residuals, own = self._forward(arrays, perturbed)
        with _jax_internals.on_trace(tangent_trace):
            computed = self._tangents(own, arrays, packed, residuals, tangents, linearizing=True)
        outputs = [_jax_internals.linearized_output(trace, a, computed.get(j)) for j, a in enumerate(packed.arrays)]
        return Packed(tuple(outputs), packed.layout)

    def _check_differentiable(self) -> None:
        if self.spec.backward is None and self.spec.jvp is None:
            raise not_differentiable(self.spec)

    def _forward(self, arrays: tuple, perturbed: list) -> tuple[Packed, Residuals, OwnDerivative]:
        """forward's tied outputs and residuals, and its own derivative along the ``perturbed`` inputs."""
        runner = self.runner
        needs = runner.needs_input_grad(perturbed, arrays)
        packed, residuals = runner.run_forward(arrays, needs, forward_mode=True)
        # Under a higher-order derivative, outputs and saved outputs differentiate by jvp, not forward's code.
        packed, residuals = self._tied(arrays, packed, residuals)
        in_avals = [(tuple(x.shape), x.dtype) for x in arrays]
        linear = [d for d, (p, x) in enumerate(zip(perturbed, arrays, strict=True))
                  if p and is_differentiable_dtype(x.dtype)]
        return packed, residuals, OwnDerivative(self, residuals.meta, packed.layout, in_avals, linear, first_order=True)

    @staticmethod
    def _tangents(own: OwnDerivative, arrays: tuple, packed: Packed, residuals: Residuals, tangents: Sequence[Any],
                  linearizing: bool = False) -> dict:
        """Output position -> its tangent, for the differentiable outputs, when any input moves."""
        if not (own.linear and own.outputs):
            return {}
        # The primal outputs' own types: inside shard_map, a tangent varies where its output does.
        out_types = [_jax_internals.tangent_aval(packed.arrays[j]) for j in own.outputs]
        of = [arrays[d] for d in own.linear] + [packed.arrays[j] for j in own.outputs]  # the primals of both
        tangents_of = own.tangents(residuals.arrays, [tangents[d] for d in own.linear], out_types, of,
                                   linearizing=linearizing)
        return dict(zip(own.outputs, tangents_of, strict=True))

    # -- the tie's derivative ----------------------------------------------

    def _tied(self, arrays: tuple, packed: Packed, residuals: Residuals) -> tuple[Packed, Residuals]:
        """forward's outputs and residuals, each output (returned or saved) tied to the Function's own rules.

        Host Functions are left alone: their second derivative raises anyway.
        """
        if self.spec.host:
            return packed, residuals
        outputs, res = tie_outputs(self, residuals.meta, packed.layout, arrays, packed.arrays, residuals.arrays)
        return Packed(outputs, packed.layout), Residuals(res, residuals.meta)

    def tie_tangents(self, tie: Any, inputs: list, residuals: list, moving: list, tangents: list,
                     out_types: list, outputs: list) -> list:
        """The tangents of a tie's ``outputs``: the Function's own derivative along the ``moving`` inputs.

        ``tie`` (a ``_tie._Tie``) carries the forward run's residual metadata
        and output layout; ``residuals`` are that run's residuals, tied again.
        """
        meta, runner = tie.meta, self.runner
        perturbed = [d in moving for d in range(len(inputs))]
        needs = tuple(a or b for a, b in zip(meta.needs, runner.needs_input_grad(perturbed, inputs), strict=True))
        if needs != meta.needs:
            # The outer derivative moves an input that forward was told needs
            # no gradient (a gradient penalty's parameters): run forward again
            # as PyTorch would have, knowing every input that needs one.
            packed, again = runner.run_forward(as_arrays(inputs), needs, forward_mode=True)
            _, again = self._tied(tuple(inputs), packed, again)
            meta, residuals = again.meta, list(again.arrays)
        in_avals = [(tuple(x.shape), x.dtype) for x in inputs]
        own = OwnDerivative(self, meta, tie.out_layout, in_avals, moving)
        return own.tangents(residuals, tangents, out_types, [inputs[d] for d in moving] + list(outputs))


class OwnDerivative:
    """A Function's own derivative at one forward run: output tangents from input tangents.

    ``linear`` lists the input leaves whose tangents are the linear inputs;
    the tangents computed are those of the differentiable outputs.
    ``first_order``: the Function's own rule, not a tie's; evaluating it
    is forward mode, which a class without ``jvp`` does not have.
    """

    # Slots: a trace keeps one per call alive until it ends, and Python's garbage collector walks them all.
    __slots__ = ("runner", "spec", "name", "meta", "out_layout", "in_avals", "linear", "outputs", "first_order")

    def __init__(self, program: Program, meta: ResidualMeta, out_layout: Any, in_avals: list, linear: list,
                 first_order: bool = False):
        self.runner = program.runner
        self.spec = program.spec
        self.name = program.spec.name
        self.meta = meta
        self.out_layout = out_layout
        self.in_avals = in_avals
        self.linear = linear
        self.outputs = [j for j, diff in enumerate(meta.differentiable) if diff]
        self.first_order = first_order

    def tangents(self, residuals: Sequence[Any], linear_tangents: Sequence[Any], out_types: Sequence[Any],
                 primals: Sequence[Any], linearizing: bool = False) -> list:
        """One tangent per differentiable output (of types ``out_types``), as a ``linear_call``.

        Evaluating it runs ``jvp`` (or, without one, ``backward`` transposed
        by JAX); transposing it runs ``backward`` (or, without one, ``jvp``
        transposed by JAX). ``primals``: the primal of each linear input,
        then of each differentiable output; under ``jax.vmap`` the call
        carries the outputs' batch axes (see ``linear_call``).
        ``linearizing``: bound on reverse mode's tangent trace
        (``Program.linearize``), to be transposed, with no primals (partial
        evaluation would drop them).
        """
        spec = self.spec
        apply: Any
        if spec.jvp is not None:
            apply = self.apply_jvp
        else:
            apply = _NoForwardMode(self) if self.first_order else self.apply_transposed_backward
        transpose: Any = self.apply_backward if spec.backward is not None else None
        residuals = tuple(residuals)
        if spec.closes_over_tracer:
            # The methods close over tracers of an enclosing transformation, which the primitive's rules may
            # run where those tracers are not (under its own vmap, lowered after the trace, evaluated from a
            # jax.linearize): pass them in.
            apply = _ClosureConverted(apply, len(residuals), spec.closure_values)
            if transpose is not None:
                transpose = _ClosureConverted(transpose, len(residuals), spec.closure_values)
            residuals += spec.closure_values
            primals = ()  # the rules' tangents vary wherever those tracers do, whatever the primals' batch axes
        return linear_call(
            residuals,
            list(linear_tangents),
            apply=apply,
            transpose=transpose,
            out_avals=out_types,
            name=self.name,
            primals=primals if not linearizing and _jax_internals.vmap_batches_here() else (),
            recorded=linearizing,
        )

    # -- the two rules of the linear_call ---------------------------------

    def apply_jvp(self, residuals: tuple, linear: tuple) -> list:
        """Output tangents (differentiable outputs) from input tangents: user's jvp."""
        return self.runner.run_jvp(self.meta, residuals, self.out_layout, self.in_avals, self.linear, linear)

    def apply_backward(self, residuals: tuple, cotangents: tuple) -> list:
        """Input cotangents (linear inputs) from output cotangents: user's backward.

        Under Explicit mesh axes it runs with them switched to Auto, and each
        gradient (the zeros for an absent one too) is typed as its input.
        """
        shardings = _sharding.gradient_shardings(self.meta.in_kinds)  # one per array input
        gradient_shardings = [shardings[d] for d in self.linear]
        return _sharding.call_with_auto_axes(self._backward, (residuals, cotangents), gradient_shardings)

    apply_backward.takes_symbolic_zeros = True  # type: ignore[attr-defined]  # backward sees None for absent gradients

    def _backward(self, residuals: tuple, cotangents: tuple) -> list:
        full: list = [SymbolicZero(None)] * len(self.meta.out_avals)  # type: ignore[arg-type]  # absent
        for j, ct in zip(self.outputs, cotangents, strict=True):
            if ct is not None:
                full[j] = ct
        per_leaf = self.runner.run_backward(Residuals(tuple(residuals), self.meta), self.out_layout, full)
        return [
            jnp.zeros(*self.in_avals[d]) if per_leaf[d] is None else per_leaf[d]
            for d in self.linear
        ]

    def apply_transposed_backward(self, residuals: tuple, linear: tuple) -> list:
        """Output tangents from input tangents, for a class without jvp: backward, transposed by JAX."""
        structs = [jax.ShapeDtypeStruct(*self.meta.out_avals[j]) for j in self.outputs]
        try:
            transposed = jax.linear_transpose(lambda *cts: self.apply_backward(residuals, cts), *structs)
            return list(transposed(list(linear)))
        except Exception as e:  # JAX raises several types for code it cannot transpose
            raise TypeError(
                f"{self.name} defines no jvp, so inside a higher-order derivative taken "
                "in forward mode (jax.hessian, jax.jacfwd of jax.grad) the derivative of "
                f"its outputs is {self.name}.backward transposed by JAX, which needs "
                "backward to be linear in the gradients and written in transposable "
                f"JAX operations; transposing it failed: {str(e).rstrip('.')}. Define "
                f"{self.name}.jvp(ctx, *tangents), or take the derivative in reverse "
                "mode twice (jax.jacrev of jax.jacrev). "
                f"{see_catalogue('backward-not-transposable-under-forward-over-reverse')}"
            ) from e

class _ClosureConverted:
    """A rule of ``linear_call`` taking the tracers that its Function's methods close over as residuals.

    ``rule(residuals, xs)`` is traced to a jaxpr, whose constants that are
    those tracers (``closed_over``, by identity) are replaced by the values
    passed after the ``n_residuals`` residuals: closure conversion, as
    ``jax.closure_convert`` makes it, for every tracer (not only those JAX
    may differentiate), so that the primitive's vmap batches along them and
    its lowering holds no tracer.
    """

    def __init__(self, rule: Callable, n_residuals: int, closed_over: tuple):
        self.rule, self.n_residuals, self.closed_over = rule, n_residuals, closed_over
        self.takes_symbolic_zeros = getattr(rule, "takes_symbolic_zeros", False)
        if hasattr(rule, "forward_mode_error"):
            self.forward_mode_error = rule.forward_mode_error
        self.__qualname__ = getattr(rule, "__qualname__", "rule")

    def __call__(self, residuals: tuple, xs: tuple) -> list:
        residuals, values = tuple(residuals[:self.n_residuals]), residuals[self.n_residuals:]
        closed = jax.make_jaxpr(lambda r, x: list(self.rule(r, x)))(residuals, tuple(xs))
        at = {id(t): k for k, t in enumerate(self.closed_over)}
        consts = [values[at[id(c)]] if id(c) in at else c for c in closed.consts]
        return jaxpr_as_fun(ClosedJaxpr(closed.jaxpr, consts))(*jax.tree_util.tree_leaves((residuals, tuple(xs))))


class _NoForwardMode:
    """The first-order rule of a class without jvp: backward transposed, which forward mode may not run.

    ``linear_call`` raises ``forward_mode_error()`` where the rule would run
    for its value (``jax.jvp``, ``jax.jacfwd``, ``jax.linearize``; also after
    ``jax.grad`` of a jitted program, whose rule trace JAX reuses); tracing
    it for its effects, transposing it (reverse mode) and differentiating it
    along the residuals (a higher order) run backward transposed.
    """

    def __init__(self, own: OwnDerivative):
        self.own = own

    def __call__(self, residuals: tuple, linear: tuple) -> list:
        return self.own.apply_transposed_backward(residuals, linear)

    def forward_mode_error(self) -> TypeError:
        return no_forward_mode(self.own.spec)


def no_forward_mode(spec: Spec) -> TypeError:
    """The error for forward mode (jax.jvp, jax.jacfwd, jax.linearize) of a class without jvp."""
    return TypeError(
        f"{spec.name} has no forward-mode derivative (jax.jvp, jax.jacfwd, "
        f"jax.linearize): it defines backward but no jvp. Add a "
        f"jvp(ctx, *tangents) staticmethod to {spec.name}, or use reverse "
        f"mode (jax.grad, jax.vjp, jax.jacrev). {see_catalogue('no-jvp-under-forward-mode')}"
    )


def not_differentiable(spec: Spec) -> TypeError:
    """The error for differentiating a class with neither backward nor jvp."""
    return TypeError(
        f"{spec.name} cannot be differentiated: it defines no backward "
        f"(and no jvp). Add a backward(ctx, *grad_outputs) staticmethod to "
        f"{spec.name} for reverse mode (jax.grad, jax.vjp, jax.jacrev), or "
        "a jvp(ctx, *tangents) staticmethod for forward mode (jax.jvp, "
        f"jax.jacfwd). {see_catalogue('no-backward-under-grad')}"
    )


def _named(fn: Callable, name: str) -> Callable:
    """A plain function named ``name`` (JAX's error messages and jaxprs show it)."""

    def named(*args: Any) -> Any:
        return fn(*args)

    named.__name__ = named.__qualname__ = name
    named.__signature__ = _ANY_ARGUMENTS  # type: ignore[attr-defined]  # read by JAX on each call, never built
    return named


_ANY_ARGUMENTS = inspect.signature(lambda *args: None)
