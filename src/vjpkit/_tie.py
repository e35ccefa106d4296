"""A Function's outputs differentiate through the Function's own rules, at every order.

At first order JAX never looks inside forward: reverse mode calls the
user's ``backward``, forward mode the user's ``jvp``. A higher-order
derivative (``jax.hessian``, grad of grad, a gradient penalty) also needs
the derivative of what forward *returned* and of what it *saved*, and JAX
takes both from forward's code, which runs as plain code under the outer
differentiation. That is wrong whenever forward's code is not the math
that the rules describe: an iterative solver (bisection, ``while_loop``),
``stop_gradient``, thresholding, an identity whose backward scales the
gradient (gradient reversal, straight-through estimators). PyTorch takes
the derivative of an output, and of a saved output, from the Function's
own backward; so does vjpkit, with a *tie*::

    tie(inputs, residuals, outputs) = outputs

a ``custom_jvp`` whose rule ignores the outputs' tangents (forward's code)
and returns the Function's own derivative instead: one
``linear_call`` of the input tangents, applying the user's ``jvp`` (or
``backward`` transposed) and transposing to the user's ``backward``. The
forward rules return tied outputs, and tied copies of the saved arrays
that are outputs (by identity). Saved intermediates are not tied: their
derivative through forward's code is right (PyTorch gets it wrong,
pytorch#58509). At first order nothing differentiates the tie, so it
compiles to nothing.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp
from jax.custom_derivatives import SymbolicZero

from . import _anomaly, _jax_internals, _sharding
from ._ctx import _short_repr, is_array, rule_ctx
from ._jax_internals import Primitive, ad, batching, mlir
from ._linear_call import linear_call
from ._outputs import Packed, _fit_dtype, is_differentiable_dtype
from ._runner import Program, ResidualMeta, Residuals, as_arrays, no_forward_mode, run_user_method


class OwnDerivative:
    """A Function's own derivative at one forward run: output tangents from input tangents.

    ``linear`` lists the input leaves whose tangents are the linear inputs;
    the tangents computed are those of the differentiable outputs.
    ``first_order``: the Function's own rule, not a tie's; evaluating it
    is forward mode, which a class without ``jvp`` does not have.
    """

    def __init__(self, program: Program, meta: ResidualMeta, out_layout: Any, in_avals: list, linear: list,
                 first_order: bool = False):
        self.program = program
        self.spec = program.spec
        self.name = program.spec.name
        self.meta = meta
        self.out_layout = out_layout
        self.in_avals = in_avals
        self.linear = linear
        self.outputs = [j for j, diff in enumerate(meta.differentiable) if diff]
        self.first_order = first_order

    def tangents(self, residuals: Sequence[Any], linear_tangents: Sequence[Any], out_types: Sequence[Any]) -> list:
        """One tangent per differentiable output (of types ``out_types``), as a ``linear_call``.

        Evaluating it runs ``jvp`` (or, without one, ``backward`` transposed
        by JAX); transposing it runs ``backward`` (or, without one, ``jvp``
        transposed by JAX).
        """
        spec = self.spec
        if spec.closes_over_tracer and spec.jvp is not None:
            # The methods close over a tracer of an enclosing transformation, which a primitive's rule cannot
            # hold: jvp runs inline, where that tracer lives, and reverse mode transposes it (a custom_jvp's way).
            return self.apply_jvp(tuple(residuals), tuple(linear_tangents))

        shardings = _sharding.gradient_shardings(self.meta.in_kinds)  # one per array input
        gradient_shardings = [shardings[d] for d in self.linear]

        def backward_rule(residuals: tuple, cotangents: tuple) -> list:
            # Under Explicit mesh axes the zeros for absent gradients are typed as their inputs too.
            return _sharding.call_with_auto_axes(self.apply_backward, (residuals, cotangents), gradient_shardings)

        backward_rule.takes_symbolic_zeros = True  # type: ignore[attr-defined]  # backward sees None for absent gradients
        if spec.jvp is not None:
            apply = self.apply_jvp
        else:
            apply = _NoForwardMode(self) if self.first_order else self.apply_transposed_backward
        return linear_call(
            tuple(residuals),
            list(linear_tangents),
            apply=apply,
            transpose=backward_rule if spec.backward is not None else None,
            out_avals=out_types,
            name=self.name,
        )

    # -- the two rules of the linear_call ---------------------------------

    def apply_jvp(self, residuals: tuple, linear: tuple) -> list:
        """Output tangents (differentiable outputs) from input tangents: user's jvp."""
        program, meta = self.program, self.meta
        assert self.spec.jvp is not None  # chosen by tangents() only for a class with jvp
        tangent_leaves: list = [None] * len(self.in_avals)
        # Evaluated eagerly (jax.linearize of a jaxpr), a tangent may be JAX's weakly typed Python scalar.
        for d, t in zip(self.linear, as_arrays(linear), strict=True):
            tangent_leaves[d] = t
        for d, t in enumerate(tangent_leaves):
            if t is None and meta.materialize and is_differentiable_dtype(self.in_avals[d][1]):
                tangent_leaves[d] = jnp.zeros(*self.in_avals[d])
        ctx = rule_ctx(self.name, "jvp", meta.needs, meta.layout.combine(residuals), meta.materialize)
        try:
            result = run_user_method(
                self.name, ctx, self.spec.jvp, ctx, *program.layout.combine(tangent_leaves, keep_static=False)
            )
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
        """Input cotangents (linear inputs) from output cotangents: user's backward."""
        full: list = [SymbolicZero(None)] * len(self.meta.out_avals)  # type: ignore[arg-type]  # absent
        for j, ct in zip(self.outputs, cotangents, strict=True):
            if ct is not None:
                full[j] = ct
        per_leaf = self.program.run_backward(Residuals(tuple(residuals), self.meta), self.out_layout, full)
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
                f"JAX operations; transposing it failed: {e}. Define "
                f"{self.name}.jvp(ctx, *tangents), or take the derivative in reverse "
                "mode twice (jax.jacrev of jax.jacrev)."
            ) from e

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
            tangents.append(_fit_dtype(name, "jvp", f"output {j}", t, dtype, what="tangent"))
        return tangents


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


def _same_structure(treedef: Any, value: Any) -> bool:
    try:
        treedef.flatten_up_to(value)
    except (ValueError, TypeError):
        return False
    return True


# ---------------------------------------------------------------------------
# The tie.


def tie_outputs(program: Program, arrays: tuple, packed: Packed, residuals: Residuals) -> tuple[Packed, Residuals]:
    """forward's outputs and residuals, each output (returned or saved) tied to the Function's own rules.

    A non-differentiable output (integer, or ``ctx.mark_non_differentiable``)
    has derivative zero at every order, as at first order and in PyTorch.
    Host Functions are left alone: their second derivative raises anyway.
    """
    if program.spec.host:
        return packed, residuals
    meta = residuals.meta
    tied = tuple(j for j, diff in enumerate(meta.differentiable) if diff)
    # The tie's operands: inputs, residuals and tied outputs, each array once
    # (forward often saves its inputs, or the output it returns).
    operands: list = []
    operand_at: dict[int, int] = {}  # id of an array -> its position among the operands

    def operand(x: Any) -> int:
        at = operand_at.get(id(x))
        if at is None:
            at = operand_at[id(x)] = len(operands)
            operands.append(x)
        return at

    inputs_at = tuple(map(operand, arrays))
    n_inputs = len(operands)
    residuals_at = tuple(map(operand, residuals.arrays))
    outputs_at = tuple(operand(packed.arrays[j]) for j in tied)
    output_of: dict[int, int] = {}  # operand of an output array (not an input) -> its position among the outputs
    for j, x in enumerate(packed.arrays):
        at = operand_at.get(id(x), n_inputs)
        if at >= n_inputs:  # an input returned as is keeps its own derivative when saved
            output_of.setdefault(at, j)
    saved = tuple((k, output_of[at]) for k, at in enumerate(residuals_at) if at in output_of)
    tie = _Tie(program, meta, packed.layout, tuple(x.dtype for x in arrays), tied, saved,
               inputs_at, residuals_at, outputs_at)
    outputs, res = tie(operands)
    by_position = dict(zip(tied, outputs, strict=True))
    all_outputs = tuple(by_position[j] if j in by_position else _constant(y) for j, y in enumerate(packed.arrays))
    return Packed(all_outputs, packed.layout), Residuals(tuple(res), meta)


class _Tie:
    """``tie(inputs, residuals, outputs) = outputs``, with the Function's own derivative.

    The tie primitive's equation holds one (its parameter). Its operands
    are the arrays of one forward run, each once: ``inputs_at``,
    ``residuals_at`` and ``outputs_at`` give the operand of each input, of
    each residual, and of each tied output. ``tied``: the positions of the
    differentiable outputs, the ones tied; ``saved``: (residual position,
    output position) for each residual that is an output. Two ties are
    equal when every field is, so JAX's caches keyed by equation parameters
    (abstract evaluation, lowering) answer for every call of a program.
    """

    __slots__ = ("program", "meta", "out_layout", "in_dtypes", "tied", "saved", "inputs_at", "residuals_at",
                 "outputs_at", "_key", "_hash", "__weakref__")

    def __init__(self, program: Program, meta: ResidualMeta, out_layout: Any, in_dtypes: tuple,
                 tied: tuple, saved: tuple, inputs_at: tuple, residuals_at: tuple, outputs_at: tuple):
        self.program = program
        self.meta = meta
        self.out_layout = out_layout
        self.in_dtypes = in_dtypes
        self.tied = tied
        self.saved = saved
        self.inputs_at = inputs_at
        self.residuals_at = residuals_at
        self.outputs_at = outputs_at
        self._key = (program, meta, out_layout, in_dtypes, tied, saved, inputs_at, residuals_at, outputs_at)
        self._hash: int | None = None

    def __eq__(self, other: Any) -> bool:
        return self is other or (type(other) is _Tie and self._key == other._key)

    def __hash__(self) -> int:
        if self._hash is None:
            self._hash = hash(self._key)
        return self._hash

    def __call__(self, operands: Sequence[Any]) -> tuple[list, list]:
        """The differentiable outputs tied, and the residuals with each saved output tied."""
        tied = _tie_p.bind(*operands, tie=self) if self.tied else []
        res = [operands[at] for at in self.residuals_at]
        if self.saved:
            by_position = dict(zip(self.tied, tied, strict=True))
            for k, j in self.saved:
                res[k] = by_position[j] if j in by_position else _constant(res[k])
        return tied, res

    def rule(self, primals: Sequence[Any], tangents: Sequence[Any]) -> tuple[list, list]:
        """The tie's JVP: outputs tied again, and their tangents by the Function's own derivative.

        ``tangents`` has one per operand, ``ad.Zero`` where JAX knows it is zero.
        """
        # Evaluated eagerly (jax.remat outside jit), a Python scalar operand arrives as JAX's weakly typed float.
        primals = as_arrays(primals)
        inputs = [primals[at] for at in self.inputs_at]
        moving = [
            d for d, at in enumerate(self.inputs_at)
            if type(tangents[at]) is not ad.Zero and is_differentiable_dtype(self.in_dtypes[d])
        ]
        if not moving:
            outputs = [primals[at] for at in self.outputs_at]
            return outputs, [ad.Zero(_jax_internals.tangent_aval(y)) for y in outputs]
        program, meta = self.program, self.meta
        perturbed = [d in moving for d in range(len(inputs))]
        needs = tuple(a or b for a, b in zip(meta.needs, program.needs_input_grad(perturbed, inputs), strict=True))
        # Tied again for the derivative after this one (this rule runs as
        # plain code under it): the outputs returned and the saved ones.
        outputs, res = self(primals)
        if needs != meta.needs:
            # The outer derivative moves an input that forward was told needs
            # no gradient (a gradient penalty's parameters): run forward again
            # as PyTorch would have, knowing every input that needs one.
            packed, again = program.run_forward(as_arrays(inputs), needs)
            _, again = tie_outputs(program, tuple(inputs), packed, again)
            meta, res = again.meta, list(again.arrays)
        in_avals = [(tuple(x.shape), x.dtype) for x in inputs]
        own = OwnDerivative(program, meta, self.out_layout, in_avals, moving)
        out_types = [_jax_internals.tangent_aval(y) for y in outputs]
        return outputs, own.tangents(res, [tangents[self.inputs_at[d]] for d in moving], out_types)

    def __repr__(self) -> str:
        return self.program.spec.name


class _BatchedTie:
    """A tie under ``jax.vmap``: the unbatched tie's derivative, run under the same vmap.

    ``dims``: the batch axis of each operand (None: not batched); each
    output keeps its operand's axis (``out_dims``).
    """

    __slots__ = ("inner", "dims", "size", "axis_names", "outputs_at", "out_dims", "__weakref__")

    def __init__(self, inner: Any, dims: tuple, size: int, axis_names: dict):
        self.inner = inner
        self.dims = dims
        self.size = size
        self.axis_names = axis_names
        self.outputs_at = inner.outputs_at
        self.out_dims = [dims[at] for at in inner.outputs_at]

    def rule(self, primals: Sequence[Any], tangents: Sequence[Any]) -> tuple[list, list]:
        moving = [
            at for at, t in enumerate(tangents) if type(t) is not ad.Zero and is_differentiable_dtype(t.dtype)
        ]

        def unbatched(primals: list, moving_tangents: list) -> tuple[list, list]:
            full: list = [ad.Zero(_jax_internals.tangent_aval(p)) for p in primals]
            for at, t in zip(moving, moving_tangents, strict=True):
                full[at] = t
            outputs, out_tangents = self.inner.rule(primals, full)
            return list(outputs), [ad.instantiate_zeros(t) for t in out_tangents]

        in_axes = (list(self.dims), [self.dims[at] for at in moving])
        # An output that is not batched keeps an unbatched tangent (vmap raises if it varies along the batch).
        out_axes = (list(self.out_dims), list(self.out_dims))
        return jax.vmap(unbatched, in_axes=in_axes, out_axes=out_axes, axis_size=self.size, **self.axis_names)(
            list(primals), [tangents[at] for at in moving]
        )

    def __repr__(self) -> str:
        return f"vmapped {self.inner!r}"


# The tie as a primitive: one equation per forward run, which lowers to
# nothing (its outputs are some of its operands). A custom_jvp would trace a
# nested jaxpr per call and lower it as a function of its own.
_tie_p = Primitive("vjpkit_tie")
_tie_p.multiple_results = True
TIE_PRIMITIVE = _tie_p  # gradcheck's host evaluator evaluates it as what it is, a selection of its operands


def _tie_impl(*args: Any, tie: Any) -> list:
    return [args[at] for at in tie.outputs_at]


def _tie_abstract_eval(*avals: Any, tie: Any) -> list:
    return [avals[at] for at in tie.outputs_at]


def _tie_lowering(ctx: Any, *args: Any, tie: Any) -> list:
    return [args[at] for at in tie.outputs_at]


def _tie_jvp(primals: Sequence[Any], tangents: Sequence[Any], *, tie: Any) -> tuple[list, list]:
    return tie.rule(primals, tangents)


def _tie_batch(axis_data: Any, args: Sequence[Any], dims: Sequence[Any], *, tie: Any) -> tuple[list, list]:
    axis_names = _jax_internals.vmap_axis_names(axis_data)
    if all(d is None for d in dims) and axis_names["axis_name"] is None:
        out = _tie_p.bind(*args, tie=tie)
        return out, [None] * len(out)
    size = axis_data.size
    args, dims = list(args), list(dims)
    if _jax_internals.differentiating_here():
        # Its derivative is taken now, and may vary along the batch even where its value does not.
        for at in set(tie.outputs_at):
            args[at], dims[at] = batching.bdim_at_front(args[at], dims[at], size), 0
    # Otherwise each output keeps its own batch axis: one that does not depend on the batch stays unbatched.
    batched = _BatchedTie(tie, tuple(dims), size, axis_names)
    return _tie_p.bind(*args, tie=batched), list(batched.out_dims)


_tie_p.def_impl(_tie_impl)
_tie_p.def_abstract_eval(_tie_abstract_eval)
mlir.register_lowering(_tie_p, _tie_lowering)
ad.primitive_jvps[_tie_p] = _tie_jvp
batching.fancy_primitive_batchers[_tie_p] = _tie_batch
# JAX's caches keyed by equation parameters must not keep a tie (and its
# program) alive after the jaxprs holding it are gone.
_jax_internals.hold_weakly_in_caches(_Tie)
_jax_internals.hold_weakly_in_caches(_BatchedTie)


def _constant(x: Any) -> Any:
    """A non-differentiable output: derivative zero at every order."""
    return jax.lax.stop_gradient(x) if is_differentiable_dtype(jnp.result_type(x)) else x
