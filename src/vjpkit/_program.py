"""A program: one static part of a call, as one call of vjpkit's own primitive for both modes, and its ``jit``s.

``Program`` is what the call (``_call.call_p``) of the call's array leaves
runs: its function runs the user's forward, and its JVP rule
(``Program.rule``) runs forward knowing which inputs are differentiated,
ties the outputs (``_tie.py``), and returns the output tangent as a
``linear_call`` (``_linear_call.py``) whose two rules are the Function's
own derivative (``OwnDerivative``). Where reverse mode linearizes the call
(JAX 0.7 on), ``Program.linearize`` makes the same split, forward on the
primals' trace and the ``linear_call`` on the tangents'. The user's methods
run in ``_runner.py``.

- ``jax.jvp``/``jax.jacfwd`` evaluate the ``linear_call``: the user's
  ``jvp`` runs (a class with only ``backward`` raises, naming the class);
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
second call's ``needs_input_grad``. The call's rules run for each
differentiation, each with its own inputs, residuals and ``linear_call``.

Why not ``custom_jvp``: JAX would transpose the jvp rule for reverse mode
and never call ``backward``, and its rule is not told which
differentiation runs it (``_call.py``). Why not ``linear_call`` from JAX:
it has no batching rule (``jax.jacfwd`` vmaps) and its JVP rule asserts
that the residuals are constant (``jax.hessian`` fails).
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
from ._caches import table
from ._call import call
from ._jax_internals import ad
from ._linear_call import linear_call
from ._outputs import Packed, ResidualMeta, Residuals
from ._runner import Runner
from ._site import see_catalogue
from ._spec import Spec
from ._tie import tie_outputs
from ._tree import Partition, is_differentiable_dtype

_VARIES = object()  # runs of forward gave different output layouts (``Program._layout``)


class Program:
    """The differentiable function (and its ``jit``) for one static part of a call (``layout``).

    ``differentiable``: the call (``_call.call_p``) of the call's array
    leaves, returning ``Packed``; ``jit()``: new ``jax.jit``s of it.
    ``runner`` runs the user's methods. The program is the call's rules
    (``_call.Rules``): its function, and its JVP rule (``rule``).
    """

    def __init__(self, spec: Spec, layout: Partition, n_values: int, anomaly: bool = False):
        self.spec = spec
        self.name = spec.name
        self.anomaly = anomaly  # traced under vjpkit.detect_anomaly: NaN/Inf checks
        self.runner = Runner(spec, layout, n_values, anomaly)
        self.closed_over = spec.closure_values  # the call's first operands: the tracers the methods close over
        self.n_closed = len(self.closed_over)
        # By operand types and JAX's trace-time configuration (x64, matmul precision, ...: what forward's
        # code may read while it traces): the function's jaxpr and output layout (_traced), and the output
        # layout of runs of forward (_layouts, once runs gave different ones: see _note_layout).
        self._traced = table()
        self._layouts = table()
        # forward's output layout while every run of forward gave the same one (None: no run yet; _VARIES:
        # runs gave different ones, and _layouts holds them by operand types from then on).
        self._layout: Any = None
        # The jit of _jit_body lives in the cache entry, not on the program: JAX's
        # caches keep jaxprs whose calls refer to the program, so a program
        # that referred to its jit would keep that jit's cache key (and
        # compiled executables) alive after vjpkit's cache dropped it.

    def differentiable(self, *arrays: Any, reverse_jit: bool = False) -> Packed:
        """forward's outputs, as the call of this program (differentiated by its rules; ``reverse_jit``: see
        ``_call.call``)."""
        if _jax_internals.is_evaluating():  # on concrete arrays (a jit = False class): forward, op by op
            return self.runner.primal(*arrays)
        operands = (*self.spec.closure_values, *arrays)
        outs = call(self, operands, reverse_jit)
        layout = self._layout  # every run of forward so far (this call's too, if it ran one) gave this one
        if layout is None or layout is _VARIES:
            in_avals = tuple(map(_jax_internals.typeof, operands))
            key = (in_avals, _jax_internals.trace_configuration())
            layout = self._layouts.get(key)
            if layout is None:  # no run of forward at these types noted (a vmap runs it for one example)
                layout = self._traced_function(in_avals)[1]
        return Packed(tuple(outs), layout)

    def _seen(self, operands: Sequence[Any], packed: Packed) -> Packed:
        """Notes the output layout of a run of forward on ``operands``."""
        self._note_layout(operands, None, packed.layout)
        return packed

    def _note_layout(self, operands: Sequence[Any], in_avals: tuple | None, layout: Any) -> None:
        """Notes ``layout``, given by a run of forward on ``operands`` (or on values of types ``in_avals``).

        While every run gives one layout, that is all there is to know;
        once runs differ (forward's output structure depends on its input
        shapes, or on JAX's configuration), each is kept by its key.
        """
        if self._layout is None:
            self._layout = layout
        elif self._layout is not _VARIES and layout != self._layout:
            self._layout = _VARIES
        if self._layout is _VARIES:
            in_avals = tuple(map(_jax_internals.typeof, operands)) if in_avals is None else in_avals
            self._layouts[in_avals, _jax_internals.trace_configuration()] = layout

    # -- the call's function ----------------------------------------------

    def primal(self, *operands: Any) -> list:
        """forward's output arrays where nothing is differentiated."""
        return list(self._seen(operands, self.runner.primal(*operands[self.n_closed:])).arrays)

    evaluate = primal  # on concrete arrays: forward itself, op by op

    def tied_primal(self, *operands: Any) -> list:
        """forward's output arrays, each tied to the Function's own derivative (read by a vmap, ``_call.Batched``)."""
        arrays = as_arrays(operands[self.n_closed:])
        if self.spec.host:
            return list(self.runner.primal(*arrays).arrays)
        packed, residuals = self.runner.run_primal(arrays)
        return list(self._tied(arrays, packed, residuals)[0].arrays)

    def traced(self, in_avals: tuple) -> ClosedJaxpr:
        """The function traced for ``in_avals`` (once), the tracers it closes over taken from its operands."""
        return self._traced_function(in_avals)[0]

    def _traced_function(self, in_avals: tuple) -> tuple[ClosedJaxpr, Any]:
        """The function traced for ``in_avals`` and JAX's configuration (once), and forward's output layout."""
        key = (in_avals, _jax_internals.trace_configuration())
        found = self._traced.get(key)
        if found is None:
            layouts: list = []

            def function(*operands: Any) -> list:
                packed = self.runner.primal(*operands[self.n_closed:])
                layouts.append(packed.layout)
                return list(packed.arrays)

            jaxpr = jax.make_jaxpr(function)(*in_avals)
            if self.n_closed:
                jaxpr = _closure_converted(jaxpr, self.spec.closure_values, in_avals)
            found = self._traced[key] = (jaxpr, layouts[0])
            self._note_layout((), in_avals, layouts[0])
        return found

    def jit(self) -> tuple[Callable, Callable]:
        """New ``jax.jit``s of the program (one pair per cache entry): for calls on tracers, and on arrays.

        The second inlines when an outer jit traces (a call on closed-over
        arrays); the first keeps backward in a program of its own under
        eager ``jax.grad`` (backward sees tracers, as everywhere else).
        """
        body = _named(self._jit_body, self.spec.name)
        return jax.jit(body), jax.jit(body, inline=_jax_internals.INLINE_INTO_CALLER)

    def reverse_jit(self) -> Callable:
        """A new ``jax.jit`` of the program for eager reverse mode where JAX differentiates a jit by its JVP
        (before JAX 0.7): its call knows (``_call.call``'s ``reverse_jit``)."""
        return jax.jit(_named(self._reverse_jit_body, self.spec.name))

    def _reverse_jit_body(self, *arrays: Any) -> Any:
        return self._jit_body(*arrays, reverse_jit=True)

    def _jit_body(self, *arrays: Any, reverse_jit: bool = False) -> Any:
        packed = self.differentiable(*arrays, reverse_jit=reverse_jit)
        # jit can return static leaves only inside a pytree's static data.
        return packed if packed.layout.static else packed.unpack()

    # -- the call's JVP rule ----------------------------------------------

    def rule(self, primals: Sequence[Any], tangents: Sequence[Any], differentiation: str) -> tuple[list, list]:
        """forward's outputs, and their tangent through ``linear_call`` (``tangents``: ``ad.Zero`` where none).

        ``differentiation``: which runs the rule (``_jax_internals.differentiation_running_rule``).
        """
        spec = self.spec
        self._check_differentiable()
        if any(type(t) is not ad.Zero for t in tangents[:self.n_closed]):
            raise closed_over_differentiated(spec, "closes over it")
        primals_in, primals, tangents = primals, primals[self.n_closed:], tangents[self.n_closed:]
        if spec.jvp is None and differentiation == "linearize":
            # Elsewhere (jax.jvp; a jax.checkpoint's JVP, whatever differentiates it) the tangent raises
            # where it is evaluated (``_NoForwardMode``).
            raise no_forward_mode(spec)
        arrays = as_arrays(primals)
        perturbed = [type(t) is not ad.Zero and is_differentiable_dtype(x.dtype)
                     for t, x in zip(tangents, arrays, strict=True)]
        tangents = tuple(t if type(t) is ad.Zero else as_arrays((t,))[0] for t in tangents)
        with _jax_internals.on_primal_trace(arrays):
            packed, residuals, own = self._forward(arrays, perturbed)
        self._seen(primals_in, packed)
        computed = self._tangents(own, arrays, packed, residuals, tangents, differentiation)
        tangents_out = [
            computed[j] if j in computed else ad.Zero(_jax_internals.tangent_aval(a))
            for j, a in enumerate(packed.arrays)
        ]
        return list(packed.arrays), tangents_out

    def linearize(self, primals: Sequence[Any], nonzeros: Sequence[bool]) -> tuple:
        """Reverse mode's linearization of the call (``_call._linearize``): what ``rule`` does, split.

        Forward runs now, on the primals' trace; the tangent's
        ``linear_call`` is bound by the returned function, on the tangents'.
        """
        spec = self.spec
        self._check_differentiable()
        if any(nonzeros[:self.n_closed]):
            raise closed_over_differentiated(spec, "closes over it")
        arrays = as_arrays(primals[self.n_closed:])
        # JAX passes an integer input's tangent (float0) as a zero.
        perturbed = [nz and is_differentiable_dtype(x.dtype)
                     for nz, x in zip(nonzeros[self.n_closed:], arrays, strict=True)]
        packed, residuals, own = self._forward(arrays, perturbed)
        self._seen(primals, packed)
        moving = set(own.outputs) if own.linear else set()
        nonzeros_out = [j in moving for j in range(len(packed.arrays))]

        def linearized(state: Any, tangents: Sequence[Any]) -> list:
            computed = self._tangents(own, arrays, packed, residuals, tangents[self.n_closed:], "vjp")
            return [computed[j] if j in moving else ad.Zero(_jax_internals.tangent_aval(a))
                    for j, a in enumerate(packed.arrays)]

        return list(packed.arrays), nonzeros_out, None, linearized

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
                  differentiation: str) -> dict:
        """Output position -> its tangent, for the differentiable outputs, when any input moves."""
        if not (own.linear and own.outputs):
            return {}
        # The primal outputs' own types: inside shard_map, a tangent varies where its output does.
        out_types = [_jax_internals.tangent_aval(packed.arrays[j]) for j in own.outputs]
        tangents_of = own.tangents(residuals.arrays, [tangents[d] for d in own.linear], out_types, differentiation)
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
                     out_types: list, differentiation: str) -> list:
        """The tangents of a tie's outputs: the Function's own derivative along the ``moving`` inputs.

        ``tie`` (a ``_tie._Tie``) carries the forward run's residual metadata
        and output layout; ``residuals`` are that run's residuals, tied again.
        ``differentiation``: which runs the tie's rule.
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
        return own.tangents(residuals, tangents, out_types, differentiation)


# JAX's caches keyed by equation parameters (a call's) must not keep a program alive after vjpkit dropped it.
_jax_internals.hold_weakly_in_caches(Program)


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
                 differentiation: str) -> list:
        """One tangent per differentiable output (of types ``out_types``), as a ``linear_call``.

        Evaluating it runs ``jvp`` (or, without one, ``backward`` transposed
        by JAX); transposing it runs ``backward`` (or, without one, ``jvp``
        transposed by JAX). ``differentiation`` (which runs the rule that
        binds it): reverse mode records the call to transpose it,
        ``jax.linearize`` splits off its work on the residuals.
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
        return linear_call(
            residuals,
            list(linear_tangents),
            apply=apply,
            transpose=transpose,
            out_avals=out_types,
            name=self.name,
            differentiation=differentiation,
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


def closed_over_differentiated(spec: Spec, how: str) -> TypeError:
    """The error for differentiating a value that the class's methods hold but that is no argument of ``apply``."""
    # JAX raises CustomVJPException or UnexpectedTracerError, naming neither the class nor the value's way in.
    return TypeError(
        f"{spec.name}.forward uses a value that JAX is differentiating but that is not an argument of "
        f"{spec.name}.apply: {spec.name} {how} (a function argument closing over parameters, "
        f"{spec.name}.apply(lambda x: f(x, w), x) under jax.grad with respect to w, or a class defined "
        f"inside the differentiated function using its variables). {spec.name}'s derivative covers "
        f"apply's arguments only, so pass the value as an argument of its own ({spec.name}.apply(f, x, w), "
        f"with f taking it) and return its gradient from {spec.name}.backward (its tangent from jvp). "
        f"{see_catalogue('closure-over-a-differentiated-value')}"
    )


def _closure_converted(jaxpr: ClosedJaxpr, closed_over: tuple, in_avals: tuple) -> ClosedJaxpr:
    """``jaxpr`` (of operands whose first are ``closed_over``) with those tracers, its constants, read from them.

    Why: the call's function closes over tracers of an enclosing
    transformation, which its lowering (after that trace) cannot hold; as
    operands they also batch and differentiate with the call.
    """
    at = {id(t): k for k, t in enumerate(closed_over)}

    def converted(*operands: Any) -> list:
        consts = [operands[at[id(c)]] if id(c) in at else c for c in jaxpr.consts]
        return jaxpr_as_fun(ClosedJaxpr(jaxpr.jaxpr, consts))(*operands)

    return jax.make_jaxpr(converted)(*in_avals)


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
