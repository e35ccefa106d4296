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

a primitive whose JVP rule ignores the outputs' tangents (forward's code)
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

import threading
from typing import Any, Protocol, Sequence

import jax
import jax.numpy as jnp

from . import _jax_internals
from ._args import as_arrays
from ._jax_internals import Primitive, ad, batching, mlir
from ._tree import is_differentiable_dtype


class _ReadingBatching(threading.local):
    """Whether this thread is reading which outputs of a rule vary along a batch (``_derivative_batched``).

    That reading traces and batches the rule for one example, nested in
    whatever batching asked. The ties of the rule read are batched by
    their values there, which stops the reading from recursing.
    """

    active = False


reading_batching = _ReadingBatching()


# ---------------------------------------------------------------------------
# The tie.


class Owner(Protocol):
    """What a tie asks of the program that tied its outputs (``_program.Program``): their derivative.

    A protocol, so that the tie (below the program) never imports it.
    """

    spec: Any  # the Function's Spec: its name names the tie in jaxprs

    def tie_tangents(self, tie: Any, inputs: list, residuals: list, moving: list, tangents: list,
                     out_types: list, differentiation: str) -> list: ...


def tie_outputs(owner: Owner, meta: Any, out_layout: Any, arrays: tuple, outputs: tuple,
                residuals: tuple) -> tuple[tuple, tuple]:
    """forward's array ``outputs`` and ``residuals``, each output (returned or saved) tied to the Function's own rules.

    ``meta`` (the forward run's ``ResidualMeta``) says which outputs are
    differentiable. A non-differentiable output (integer, or
    ``ctx.mark_non_differentiable``) has derivative zero at every order, as
    at first order and in PyTorch.
    """
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
    residuals_at = tuple(map(operand, residuals))
    outputs_at = tuple(operand(outputs[j]) for j in tied)
    output_of: dict[int, int] = {}  # operand of an output array (not an input) -> its position among the outputs
    for j, x in enumerate(outputs):
        at = operand_at.get(id(x), n_inputs)
        if at >= n_inputs:  # an input returned as is keeps its own derivative when saved
            output_of.setdefault(at, j)
    saved = tuple((k, output_of[at]) for k, at in enumerate(residuals_at) if at in output_of)
    tie = _Tie(owner, meta, out_layout, tuple(x.dtype for x in arrays), tied, saved,
               inputs_at, residuals_at, outputs_at)
    tied_outputs, res = tie(operands)
    by_position = dict(zip(tied, tied_outputs, strict=True))
    all_outputs = tuple(by_position[j] if j in by_position else _constant(y) for j, y in enumerate(outputs))
    return all_outputs, tuple(res)


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

    def __init__(self, program: Owner, meta: Any, out_layout: Any, in_dtypes: tuple,
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

    def rule(self, primals: Sequence[Any], tangents: Sequence[Any], differentiation: str) -> tuple[list, list]:
        """The tie's JVP: outputs tied again, and their tangents by the Function's own derivative.

        ``tangents`` has one per operand, ``ad.Zero`` where JAX knows it is zero;
        ``differentiation``: which runs the rule.
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
        # Tied again for the derivative after this one (this rule runs as
        # plain code under it): the outputs returned and the saved ones.
        outputs, res = self(primals)
        out_types = [_jax_internals.tangent_aval(y) for y in outputs]
        moving_tangents = [tangents[self.inputs_at[d]] for d in moving]
        return outputs, self.program.tie_tangents(self, inputs, res, moving, moving_tangents, out_types,
                                                  differentiation)

    def __repr__(self) -> str:
        return self.program.spec.name


def _rule_along(tie: Any, primals: list, moving: list, moving_tangents: list,
                differentiation: str) -> tuple[list, list]:
    """The tie's JVP with the tangents of the ``moving`` operands (every other one zero), all tangents instantiated."""
    full: list = [ad.Zero(_jax_internals.tangent_aval(p)) for p in primals]
    for at, t in zip(moving, moving_tangents, strict=True):
        full[at] = t
    outputs, out_tangents = tie.rule(primals, full, differentiation)
    return list(outputs), [ad.instantiate_zeros(t) for t in out_tangents]


class _BatchedTie:
    """A tie under ``jax.vmap``: the unbatched tie's derivative, run under the same vmap.

    ``dims``: the batch axis of each operand (None: not batched); each
    output keeps its operand's axis (``out_dims``).
    """

    __slots__ = ("inner", "dims", "size", "axis_names", "inputs_at", "in_dtypes", "outputs_at", "out_dims",
                 "__weakref__")

    def __init__(self, inner: Any, dims: tuple, size: int, axis_names: dict):
        self.inner = inner
        self.dims = dims
        self.size = size
        self.axis_names = axis_names
        self.inputs_at = inner.inputs_at  # the operands of the inner tie, each with a batch axis more or not
        self.in_dtypes = inner.in_dtypes
        self.outputs_at = inner.outputs_at
        self.out_dims = [dims[at] for at in inner.outputs_at]

    def rule(self, primals: Sequence[Any], tangents: Sequence[Any], differentiation: str) -> tuple[list, list]:
        moving = [
            at for at, t in enumerate(tangents) if type(t) is not ad.Zero and is_differentiable_dtype(t.dtype)
        ]

        def unbatched(primals: list, moving_tangents: list) -> tuple[list, list]:
            return _rule_along(self.inner, primals, moving, moving_tangents, differentiation)

        in_axes = (list(self.dims), [self.dims[at] for at in moving])
        # An output left unbatched has a derivative that does not vary along the batch (``_tie_batch``).
        out_axes = (list(self.out_dims), list(self.out_dims))
        args = (list(primals), [tangents[at] for at in moving])
        return jax.vmap(unbatched, in_axes=in_axes, out_axes=out_axes, axis_size=self.size, **self.axis_names)(*args)

    def __repr__(self) -> str:
        return f"vmapped {self.inner!r}"


# The tie as a primitive: one equation per forward run, which lowers to
# nothing (its outputs are some of its operands). A jax.custom_jvp would
# trace a nested jaxpr per call and lower it as a function of its own.
_tie_p = Primitive("vjpkit_tie")
_tie_p.multiple_results = True


def _tie_impl(*args: Any, tie: Any) -> list:
    return [args[at] for at in tie.outputs_at]


def _tie_abstract_eval(*avals: Any, tie: Any) -> list:
    return [avals[at] for at in tie.outputs_at]


def _tie_lowering(ctx: Any, *args: Any, tie: Any) -> list:
    return [args[at] for at in tie.outputs_at]


def _tie_jvp(primals: Sequence[Any], tangents: Sequence[Any], *, tie: Any) -> tuple[list, list]:
    return tie.rule(primals, tangents, _jax_internals.differentiation_running_rule())


def _tie_transpose(cts: Sequence[Any], *args: Any, tie: Any) -> list:
    """The tie's transpose: each output's cotangent goes to the operand it is (a staged call's function is
    transposed where it is linear, as ``jax.linear_transpose`` of a jvp-only Function's ``apply``)."""
    out: list = [None] * len(args)
    for at, ct in zip(tie.outputs_at, cts, strict=True):
        if type(ct) is ad.Zero or not ad.is_undefined_primal(args[at]):
            continue
        out[at] = ct if out[at] is None else out[at] + ct
    return out


def _tie_batch(axis_data: Any, args: Sequence[Any], dims: Sequence[Any], *, tie: Any) -> tuple[list, list]:
    axis_names = _jax_internals.vmap_axis_names(axis_data)
    if all(d is None for d in dims) and axis_names["axis_name"] is None:
        out = _tie_p.bind(*args, tie=tie)
        return out, [None] * len(out)
    size = axis_data.size
    args, dims = list(args), list(dims)
    if _jax_internals.differentiating_here():
        # Its derivative is taken now, and may vary along the batch even where its value does not.
        moving = set(tie.outputs_at)
    elif not reading_batching.active:
        # Its derivative may be taken later (reverse mode records the tie first, a second derivative
        # differentiates the record, and a vmap of the call reads it, ``_call.Batched``): an output is batched
        # where its value or its derivative varies along the batch.
        moving = _derivative_batched(tie, args, dims, axis_data)
    else:  # a tie of a derivative being read: only its tangents count
        moving = set()
    for at in moving:
        args[at], dims[at] = batching.bdim_at_front(args[at], dims[at], size), 0
    # Every other output keeps its own batch axis: one that does not depend on the batch stays unbatched.
    batched = _BatchedTie(tie, tuple(dims), size, axis_names)
    return _tie_p.bind(*args, tie=batched), list(batched.out_dims)


def _derivative_batched(tie: Any, args: Sequence[Any], dims: Sequence[Any], axis_data: Any) -> set[int]:
    """The operands of tied outputs unbatched in value whose derivative varies along the batch.

    Read as ``_linear_call`` reads a rule's: the tie's derivative for one
    example, traced and batched by JAX, each input's tangent batched where
    the input is (a tangent's shape is its primal's). Outputs whose value
    is batched need nothing, and where no input is batched no derivative
    varies: the common cases trace nothing. A rule that cannot be traced
    says nothing here (its error comes where it runs).
    """
    unbatched = {at for at in tie.outputs_at if dims[at] is None}
    if not unbatched or all(dims[at] is None for at in tie.inputs_at):
        return set()
    size = axis_data.size
    avals = [_jax_internals.typeof(x) if d is None else _jax_internals.example_aval(_jax_internals.typeof(x), size, d)
             for x, d in zip(args, dims, strict=True)]
    # Every differentiable input: any may move in a derivative taken later (forward runs again for those it was
    # not told need one). The function of a staged call and its rule read the same, so a vmap that batched the
    # function first gets from the rule the batch axes it fixed.
    moving = sorted({at for d, at in enumerate(tie.inputs_at) if is_differentiable_dtype(tie.in_dtypes[d])})

    def derivative(primals: list, moving_tangents: list) -> list:
        # Read as reverse mode records it: no rule is traced for its effects, and a backward JAX cannot
        # transpose (clipped gradients) still tells (``_linear_call._batched_outputs``).
        return _rule_along(tie, primals, moving, moving_tangents, "vjp")[1]

    reading_batching.active = True
    try:
        jaxpr = jax.make_jaxpr(derivative)(avals, [avals[at].strip_weak_type().to_tangent_aval() for at in moving])
        in_batched = [d is not None for d in dims] + [dims[at] is not None for at in moving]
        out_batched = _jax_internals.batch_example(jaxpr, axis_data, in_batched)[1]
    except Exception:  # noqa: BLE001 - the rule's own error comes where it runs
        return set()
    finally:
        reading_batching.active = False
    return {at for at, b in zip(tie.outputs_at, out_batched, strict=True) if b and at in unbatched}


_tie_p.def_impl(_tie_impl)
_tie_p.def_abstract_eval(_tie_abstract_eval)
mlir.register_lowering(_tie_p, _tie_lowering)
ad.primitive_jvps[_tie_p] = _tie_jvp
ad.primitive_transposes[_tie_p] = _tie_transpose
batching.fancy_primitive_batchers[_tie_p] = _tie_batch
_jax_internals.tell_jvp_rule_which_differentiation(_tie_p)
# JAX's caches keyed by equation parameters must not keep a tie (and its
# program) alive after the jaxprs holding it are gone.
_jax_internals.hold_weakly_in_caches(_Tie)
_jax_internals.hold_weakly_in_caches(_BatchedTie)


def _constant(x: Any) -> Any:
    """A non-differentiable output: derivative zero at every order."""
    return jax.lax.stop_gradient(x) if is_differentiable_dtype(jnp.result_type(x)) else x
