"""``linear_call``: a function linear in some inputs, with its own transpose.

Forward mode needs the user's ``jvp`` and reverse mode the user's
``backward`` on ONE function, which neither ``custom_jvp`` nor
``custom_vjp`` allows (jax#3996). The call's JVP rule (``_call.py``,
``_program.Program.rule``) returns its tangent through this primitive:
evaluating it runs ``apply`` (the user's jvp); transposing it runs
``transpose`` (the user's backward) inline, as JAX runs a ``custom_vjp``'s
backward, so a derivative of the gradient differentiates backward's code.
Unlike JAX's own ``custom_derivatives.linear_call`` it batches (both rules,
lazily, as a loop over the examples under ``jax.vmap``: an output is
batched where the rule that runs makes it depend on the batch) and its JVP
also differentiates through the residuals, so ``jax.hessian``,
``jacfwd(jacrev)`` and ``jacrev(jacfwd)`` are right. Where ``apply`` may
run, its work on the residuals alone runs before the call, so that
``jax.linearize`` and ``jax.checkpoint``'s policies keep it, as they keep a
``custom_jvp`` rule's. It also declares the effects of the rule it runs
(``jax.debug.print``, ordered or not), keeps ``shard_map``'s varying
types, and batches under the vmap's axis name, so that collectives over it
work inside the rules. Its binders say which differentiation runs the
rule that binds it (``differentiation``): reverse mode records the call to
transpose it, and never traces ``apply``.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
from jax.extend.core import jaxpr_as_fun

from . import _jax_internals
from ._args import as_arrays
from ._jax_internals import Primitive, ad, batching, mlir
from ._site import see_catalogue

_linear_call_p = Primitive("vjpkit_linear_call")
_linear_call_p.multiple_results = True


def linear_call(
    residuals: Sequence[Any],
    linear_inputs: Sequence[Any],
    *,
    apply: Callable,
    transpose: Callable | None,
    out_avals: Sequence[Any],
    name: str,
    differentiation: str,
) -> list:
    """``apply(residuals, linear_inputs)``, linear in ``linear_inputs``.

    ``transpose(residuals, cotangents)`` returns one cotangent per linear
    input; ``None`` means "transpose ``apply`` with ``jax.linear_transpose``".
    A ``transpose`` with the attribute ``takes_symbolic_zeros`` receives
    ``None`` for cotangents that JAX knows are zero.
    ``out_avals`` are ``apply``'s output types (no tracing to find them).
    ``differentiation``: which runs the rule that binds the call
    (``"jvp"``, ``"traced_jvp"``, ``"linearize"``, ``"vjp"``): reverse mode records it to
    transpose it, never tracing ``apply``.
    """
    recorded = differentiation == "vjp"
    may_be_transposed = differentiation == "traced_jvp"
    traced = None
    if not recorded and not hasattr(apply, "forward_mode_error"):
        residuals, apply, transpose, traced = _residual_work_first(tuple(residuals), tuple(linear_inputs),
                                                                   apply, transpose, tuple(out_avals))
    return _bind(residuals, linear_inputs, apply=apply, transpose=transpose, out_avals=out_avals,
                 name=name, traced=traced, recorded=recorded, may_be_transposed=may_be_transposed)


def _residual_work_first(residuals: tuple, linear_inputs: tuple, apply: Callable,
                         transpose: Callable | None, out_avals: tuple) -> tuple:
    """``apply``'s work on the residuals alone done before the call, as plain JAX operations; the rest in the call.

    Why: partial evaluation sees into no primitive's rule. ``jax.linearize``
    and ``jax.checkpoint``'s policies split a ``custom_jvp``'s rule into the
    work known from the primals (``cos(x)``), which they keep or save, and
    the work on the tangents (``cos_x * t``), which the linear function
    runs; kept inside the call, the first would run again on every call of
    that function, whatever the policy. The call then gets the values that
    work computed as residuals too (``transpose`` still sees only its own).
    Wherever ``apply`` may run: not where reverse mode records the call
    (it never runs ``apply``). A rule learns ``jax.linearize`` only from
    JAX 0.9 on, and never inside a ``jax.checkpoint`` (whose JVP JAX traces
    before deciding what to do with it), so the call is split under
    ``jax.jvp`` as well, where it costs tracing only. Not for a rule with
    effects (they stay where the rule runs).

    Returns the call's residuals, rules and traced rule (None: traced when
    bound). The rule is traced here once, as binding it would trace it.
    """
    num_res = len(residuals)
    in_avals = tuple(map(_jax_internals.typeof, residuals + linear_inputs))
    traced = _TracedRule(apply, num_res, out_avals)
    try:
        jaxpr = traced.jaxpr(in_avals)
    except Exception:  # noqa: BLE001 - a rule that cannot be traced reports its error where it runs
        return residuals, apply, transpose, traced
    if jaxpr.effects:
        return residuals, apply, transpose, traced
    unknowns = [False] * num_res + [True] * len(linear_inputs)
    known, unknown = _jax_internals.split_known(jaxpr, unknowns)
    if not known.eqns:
        return residuals, apply, transpose, traced
    with _jax_internals.on_primal_trace(residuals):
        computed = tuple(jaxpr_as_fun(known)(*residuals))
    linear_part = jaxpr_as_fun(unknown)

    def apply_rest(res: tuple, lin: tuple) -> list:
        return linear_part(*res[num_res:], *lin)

    if transpose is None:  # JAX transposes the linear part
        return residuals + computed, apply_rest, None, None

    def transpose_own(res: tuple, cts: tuple) -> list:
        return transpose(res[:num_res], cts)

    transpose_own.takes_symbolic_zeros = getattr(transpose, "takes_symbolic_zeros", False)  # type: ignore[attr-defined]
    return residuals + computed, apply_rest, transpose_own, None


def _bind(residuals: Sequence[Any], linear_inputs: Sequence[Any], *, apply: Callable,
          transpose: Callable | None, out_avals: Sequence[Any], name: str, traced: _TracedRule | None = None,
          recorded: bool = False, may_be_transposed: bool = False) -> list:
    num_res, out_avals = len(residuals), tuple(out_avals)
    if traced is None:
        traced = _TracedRule(apply, num_res, out_avals)
    return _linear_call_p.bind(
        *residuals,
        *linear_inputs,
        num_res=num_res,
        apply=apply,
        transpose=transpose,
        out_avals=out_avals,
        name=name,
        traced=traced,
        recorded=recorded,
        may_be_transposed=may_be_transposed,
    )


def _split(args: Sequence[Any], num_res: int) -> tuple[tuple, tuple]:
    """(residuals, linear inputs) of a call's operands."""
    return tuple(args[:num_res]), tuple(args[num_res:])


def _flat_rule(apply: Callable, num_res: int, out_avals: Sequence[Any]) -> Callable:
    """``apply`` on flat arguments, its outputs typed as ``out_avals`` inside ``shard_map``.

    Why: there a tangent or cotangent must vary across devices wherever its
    primal does; a rule's ``jnp.zeros``, or a value computed from
    replicated residuals only, does not (which changes no value). The
    arguments reach the user's methods as JAX arrays: JAX 0.7 passes a
    constant of the program it transposes as its own host-side literal,
    which a Function called in ``backward`` would take for a static argument.
    """

    def rule(*args: Any) -> list:
        res, lin = _split(as_arrays(args), num_res)
        outs = list(apply(res, lin))
        for k, (out, aval) in enumerate(zip(outs, out_avals, strict=True)):
            missing = _jax_internals.varying_axes_of_type(aval) - _jax_internals.varying_axes(out)
            if missing:
                outs[k] = _jax_internals.cast_to_varying(out, tuple(sorted(missing, key=str)))
        return outs

    return rule


class _TracedRule:
    """A rule traced to a jaxpr (once per input types): its effects and its lowering.

    Why: a primitive declares the effects of what it runs when it is bound,
    so that JAX threads tokens through ordered ones (``ordered=True`` debug
    prints and callbacks) and never removes a call that has effects.
    """

    # Slots, and the rule's jaxprs made on the first asked for (reverse mode never asks): a trace
    # keeps one per bound call alive until it ends, and Python's garbage collector walks them all.
    __slots__ = ("apply", "num_res", "out_avals", "name", "_jaxprs", "__weakref__")

    def __init__(self, apply: Callable, num_res: int, out_avals: tuple):
        self.apply, self.num_res, self.out_avals = apply, num_res, out_avals
        self.name = getattr(apply, "__qualname__", "rule")
        self._jaxprs: dict | None = None

    def jaxpr(self, in_avals: Sequence[Any]) -> Any:
        key = tuple(in_avals)
        if self._jaxprs is None:
            self._jaxprs = {}
        if key not in self._jaxprs:
            rule = _flat_rule(self.apply, self.num_res, self.out_avals)
            self._jaxprs[key] = jax.make_jaxpr(rule)(*key)
        return self._jaxprs[key]

    def effects(self, in_avals: Sequence[Any]) -> Any:
        """The rule's effects; none where it cannot be traced.

        Why: JAX before 0.7 differentiates a ``jit`` by its JVP, traced
        before JAX knows whether reverse mode transposes it, so a rule that
        only reverse mode needs is bound as forward mode's; one that cannot
        run (``backward`` that JAX cannot transpose, at second order)
        reports its error where it runs, if it ever does.
        """
        try:
            return self.jaxpr(in_avals).effects
        except Exception:  # noqa: BLE001 - the rule's own error comes where it runs
            return set()

    def __repr__(self) -> str:
        return f"<traced {self.name}>"


def refuse_forward_mode(rule: Callable) -> None:
    """Raises the rule's own error if it may not run for its value (a class without jvp, in forward mode).

    A rule with ``forward_mode_error`` (a function returning the error) can
    still be traced for its effects, transposed, or differentiated along
    its residuals at a higher order; evaluating or compiling it is forward mode.
    """
    error = getattr(rule, "forward_mode_error", None)
    if error is not None:
        raise error()


def _linear_call_impl(*args, num_res, apply, transpose, out_avals, name, traced, recorded,
        may_be_transposed):
    refuse_forward_mode(apply)
    res, lin = _split(args, num_res)
    return list(apply(res, lin))


def _linear_call_abstract_eval(*in_avals, num_res, apply, transpose, out_avals, name, traced, recorded,
        may_be_transposed):
    if recorded or hasattr(apply, "forward_mode_error"):
        # Recorded to be transposed, never run: grad must not trace the jvp
        # (nor a rule forward mode may not run, whose transpose is traced when bound).
        return list(out_avals), set()
    return list(out_avals), traced.effects(in_avals)


def _linear_call_lowering(ctx, *args, num_res, apply, transpose, out_avals, name, traced, recorded,
        may_be_transposed):
    refuse_forward_mode(apply)
    jaxpr = traced.jaxpr(ctx.avals_in)
    missing = _jax_internals.ordered_effects_without_tokens(ctx, jaxpr.effects)
    if missing:
        # Only a call that reverse mode recorded, run after all (older JAX).
        raise TypeError(
            f"{name}.jvp uses ordered effects ({', '.join(map(str, missing))}) in a call that "
            "reverse mode recorded without them (reverse mode never runs jvp, so it did not "
            f"trace it), and JAX {_jax_internals.JAX_RELEASE} runs that record here: before JAX 0.9 "
            f"jax.linearize shares it. Pass ordered=False in {name}.jvp, or use JAX 0.9 or later."
        )
    return mlir.lower_fun(jaxpr_as_fun(jaxpr), multiple_results=True)(ctx, *args)


_linear_call_p.def_impl(_linear_call_impl)
_linear_call_p.def_effectful_abstract_eval(_linear_call_abstract_eval)
mlir.register_lowering(_linear_call_p, _linear_call_lowering)


def _transpose_by_jax(apply: Callable, name: str, in_avals: Sequence[Any]) -> Callable:
    def transposed(res: tuple, cts: tuple) -> list:
        try:
            # The inputs' own types: inside shard_map, whether a tangent varies
            # across devices decides where the transpose sums over them.
            linear_transpose = jax.linear_transpose(lambda *lin: list(apply(res, lin)), *in_avals)
            return list(linear_transpose(list(cts)))
        except Exception as e:  # JAX raises several types for non-linear code
            said = _jax_said(e)
            failure = said or (
                "JAX met an operation that is not linear in the tangents (such as a product of "
                "two tangents, or a comparison or branch on one)"
            )
            raise TypeError(
                f"{name} defines jvp but no backward, so reverse mode (jax.grad, "
                f"jax.vjp, jax.jacrev) transposes {name}.jvp, which must then be "
                "linear in the tangents and written in transposable JAX "
                f"operations; transposing it failed: {failure}. Define "
                f"{name}.backward(ctx, *grad_outputs) instead. "
                + (see_catalogue("jvp-only-and-not-linear") if said
                   else see_catalogue("jvp-only-and-a-product-of-tangents"))
            ) from e

    return transposed


def _jax_said(e: Exception) -> str:
    """What JAX's failed transpose says, or "" where it says nothing useful.

    Why: a product of two tangents, or a comparison of one, fails an internal
    assertion of JAX's transpose, whose text is empty or a tuple of JAX's
    accumulator objects.
    """
    return "" if isinstance(e, AssertionError) else str(e).strip()


def _linear_call_transpose(cts, *args, num_res, apply, transpose, out_avals, name, traced, recorded,
        may_be_transposed):
    res, lin = _split(args, num_res)
    if any(ad.is_undefined_primal(r) for r in res):
        raise TypeError(f"{name}: internal error: a residual of linear_call is linear.")
    in_avals = tuple(x.aval for x in lin)
    zero = tuple(type(ct) is ad.Zero for ct in cts)
    cts = [ad.instantiate_zeros(ct) for ct in cts]
    if transpose is None:
        transpose = _transpose_by_jax(apply, name, in_avals)
    elif any(zero) and getattr(transpose, "takes_symbolic_zeros", False):
        # The rule wants to know which cotangents JAX knows are zero (vjpkit:
        # backward sees None for them when materialization is off).
        transpose = _with_zeros_as_none(transpose, zero)
    # Run inline, as a custom_vjp's backward is: a derivative of it differentiates its code.
    cts_in = _flat_rule(transpose, num_res, in_avals)(*res, *cts)
    return [None] * num_res + list(cts_in)


def _with_zeros_as_none(rule: Callable, zero: tuple) -> Callable:
    def rule_with_zeros(res: tuple, cts: tuple) -> list:
        return rule(res, tuple(None if z else ct for z, ct in zip(zero, cts, strict=True)))

    return rule_with_zeros


def _linear_call_jvp(primals, tangents, *, num_res, apply, transpose, out_avals, name, traced, recorded,
        may_be_transposed):
    differentiation = _jax_internals.differentiation_running_rule()
    res, lin = _split(primals, num_res)
    d_res, d_lin = _split(tangents, num_res)
    primals, tangents = res + lin, d_res + d_lin
    rule = _flat_rule(apply, num_res, out_avals)
    if all(type(t) is ad.Zero for t in d_res):
        # Only the linear inputs move: the derivative is the call itself, same
        # rules. The value is computed inline: it is never transposed.
        refuse_forward_mode(apply)
        out = rule(*primals)
        if all(type(t) is ad.Zero for t in d_lin):
            return out, [ad.Zero(a.to_tangent_aval()) for a in out_avals]
        return out, _bind(res, list(map(ad.instantiate_zeros, d_lin)), apply=apply, transpose=transpose,
                          out_avals=out_avals, name=name, traced=traced, recorded=differentiation == "vjp",
                          may_be_transposed=differentiation == "traced_jvp")
    # The residuals move too: differentiate the rule's JAX code along every
    # moving input at once. (Splitting it into call(res, d_lin) + d/d_res
    # computes shared factors twice, and XLA does not merge a@w + b@w.) Inputs
    # with symbolic-zero tangents stay constants, so no work is spent on them.
    # The linearization of JAX code is transposable: reverse-over-forward works.
    moving = [i for i, t in enumerate(tangents) if type(t) is not ad.Zero]

    def along_moving(*values: Any) -> list:
        full = list(primals)
        for i, value in zip(moving, values, strict=True):
            full[i] = value
        return rule(*full)

    out, tangent_out = jax.jvp(
        along_moving, [primals[i] for i in moving], [tangents[i] for i in moving]
    )
    return list(out), list(tangent_out)


def _linear_call_batch(axis_data, args, dims, *, num_res, apply, transpose, out_avals, name, traced, recorded,
        may_be_transposed):
    """A loop over the examples, whatever the rules: each example's tangents from its own residuals and inputs.

    An output is batched where the rule that runs makes it depend on the
    batch (``_batched_outputs``, as JAX batches a ``jax.custom_jvp``'s rule).
    An output that does not depend on the batch stays unbatched.
    """
    axis_names = _jax_internals.vmap_axis_names(axis_data)
    res, lin = _split(args, num_res)
    if all(d is None for d in dims) and axis_names["axis_name"] is None:
        out = _bind(res, lin, apply=apply, transpose=transpose, out_avals=out_avals, name=name, recorded=recorded,
                    may_be_transposed=may_be_transposed)
        return out, [None] * len(out)
    size = axis_data.size
    res_dims, lin_dims = _split(dims, num_res)
    res = tuple(x if d is None else jnp.moveaxis(x, d, 0) for x, d in zip(res, res_dims, strict=True))
    lin = tuple(x if d is None else jnp.moveaxis(x, d, 0) for x, d in zip(lin, lin_dims, strict=True))
    res_axes = tuple(None if d is None else 0 for d in res_dims)
    lin_axes = tuple(None if d is None else 0 for d in lin_dims)
    batched, batched_jaxpr = _batched_outputs(apply, transpose, recorded, may_be_transposed, res, lin,
                                              res_axes + lin_axes,
                                              out_avals, axis_data)
    out_axes = tuple(0 if b else None for b in batched)

    def batched_apply(r: tuple, xs: tuple) -> list:
        if batched_jaxpr is not None:  # the rule batched for the outputs' axes (apply, where it was traced): run once
            return jaxpr_as_fun(batched_jaxpr)(*r, *xs)
        return jax.vmap(lambda r_, xs_: list(apply(r_, xs_)), in_axes=(res_axes, lin_axes), out_axes=list(out_axes),
                        axis_size=size, **axis_names)(r, tuple(xs))

    if hasattr(apply, "forward_mode_error"):
        batched_apply.forward_mode_error = apply.forward_mode_error  # type: ignore[attr-defined]
    batched_transpose = None
    if transpose is not None:
        batched_transpose = _batched_transpose(transpose, res_axes, lin_axes, out_axes, size, axis_names)
    batched_out_avals = tuple(
        _jax_internals.batched_aval(a, size, axis_data) if b else a for a, b in zip(out_avals, batched, strict=True)
    )
    out = _bind(res, lin, apply=batched_apply, transpose=batched_transpose, out_avals=batched_out_avals,
                name=name, recorded=recorded, may_be_transposed=may_be_transposed)
    return out, list(out_axes)


def _batched_transpose(transpose: Callable, res_axes: tuple, lin_axes: tuple, out_axes: tuple, size: int,
                       axis_names: dict) -> Callable:
    """``transpose`` run per example: the transpose of the batched call.

    An unbatched output has one value, every example's: each example gets
    an equal share of its cotangent (the examples' rows of the rule are
    equal, so this is the transpose of taking that value). An unbatched
    input's cotangent is the sum of the examples' (the transpose of
    handing every example the same input).
    """

    def batched(r: tuple, cts: tuple) -> list:
        cts = tuple(ct / size if a is None and ct is not None else ct for ct, a in zip(cts, out_axes, strict=True))
        per_example = jax.vmap(lambda r_, cts_: list(transpose(r_, cts_)), in_axes=(res_axes, out_axes),
                               axis_size=size, **axis_names)(r, cts)
        return [ct if a == 0 else jnp.sum(ct, axis=0) for ct, a in zip(per_example, lin_axes, strict=True)]

    batched.takes_symbolic_zeros = getattr(transpose, "takes_symbolic_zeros", False)  # type: ignore[attr-defined]
    return batched


def _batched_outputs(apply: Callable, transpose: Callable | None, recorded: bool, may_be_transposed: bool,
                     res: tuple, lin: tuple,
                     in_axes: tuple, out_avals: Sequence[Any], axis_data: Any) -> tuple[list[bool], Any]:
    """Which outputs of the call vary along the batch: where the rule that runs makes an example's depend on it.

    Read from that rule traced for one example and batched by JAX, as JAX
    batches a ``custom_jvp``'s: ``apply`` (the user's jvp, or backward
    transposed), or where reverse mode records the call (``apply`` never
    runs then), or where ``apply`` cannot be traced, ``transpose`` (the
    user's backward) transposed by JAX. A backward that JAX cannot
    transpose (not linear in the cotangents: clipped or sign gradients)
    batches every output, for a loop over the examples is right for any
    rule; a rule that cannot be traced at all says nothing (its error comes
    where it runs). Also returns what the batched call runs, as a jaxpr of
    the batched residuals and linear inputs: ``apply`` batched where it was
    traced (else None: ``apply`` under ``jax.vmap`` where it runs).
    """
    size, in_batched = axis_data.size, [a is not None for a in in_axes]
    avals = [
        _jax_internals.example_aval(_jax_internals.typeof(x), size) if a == 0 else _jax_internals.typeof(x)
        for x, a in zip(res + lin, in_axes, strict=True)
    ]
    by_apply: list | None = None
    if transpose is None or not recorded:
        try:
            jaxpr = jax.make_jaxpr(lambda *args: list(apply(*_split(args, len(res)))))(*avals)
            batched_jaxpr, batched = _jax_internals.batch_example(jaxpr, axis_data, in_batched)
            if transpose is None or not may_be_transposed:
                return batched, batched_jaxpr
            # JAX without direct linearization (before 0.7) differentiates a jit by its JVP, traced before JAX
            # knows whether it transposes it: there the call may yet be transposed, so an output is batched
            # where either rule makes it vary (backward's rows below), and apply runs against those axes.
            by_apply = batched
        except Exception:  # the rule reports its error where it runs; backward may still tell
            if transpose is None:
                return [False] * len(out_avals), None
    rows = _rows_of(transpose, *_split(avals, len(res)), out_avals)
    if rows is None or rows is _UNTRACEABLE:
        return [rows is None or bool(by_apply and by_apply[j]) for j in range(len(out_avals))], None
    # Where the recorded call is evaluated after all (``jax.linearize`` before JAX 0.9 shares reverse
    # mode's record; a forward-mode derivative of a record), it runs apply, the user's jvp, as unbatched
    # (never the rows: a class's jvp and backward may be different rules), per example against these axes.
    batched = _jax_internals.batch_example(rows, axis_data, in_batched)[1]
    return batched if by_apply is None else [a or b for a, b in zip(by_apply, batched, strict=True)], None


_UNTRACEABLE = object()


def _rows_of(transpose: Callable, res_avals: tuple, lin_avals: tuple, out_avals: Sequence[Any]) -> Any:
    """The jaxpr of the linear map whose transpose is ``transpose`` (of residuals and linear inputs).

    ``_UNTRACEABLE`` where ``transpose`` itself cannot be traced, None where
    JAX cannot transpose it.
    """
    num_res = len(res_avals)
    try:
        written = jax.make_jaxpr(lambda *args: list(transpose(*_split(args, num_res))))(*res_avals, *out_avals)
    except Exception:  # the rule reports its error where it runs
        return _UNTRACEABLE

    def rows(*args: Any) -> list:
        res, lin = _split(args, num_res)
        backward = jaxpr_as_fun(written)
        return list(jax.linear_transpose(lambda *cts: backward(*res, *cts), *out_avals)(list(lin)))

    try:
        return jax.make_jaxpr(rows)(*res_avals, *lin_avals)
    except Exception:  # JAX's transpose raises several types for code that is not linear
        return None


ad.primitive_jvps[_linear_call_p] = _linear_call_jvp
# JAX's caches keyed by equation parameters must not keep a rule (and the
# program it runs) alive after the jaxprs holding the call are gone.
_jax_internals.hold_weakly_in_caches(_TracedRule)
ad.primitive_transposes[_linear_call_p] = _linear_call_transpose
batching.fancy_primitive_batchers[_linear_call_p] = _linear_call_batch
_jax_internals.tell_jvp_rule_which_differentiation(_linear_call_p)

