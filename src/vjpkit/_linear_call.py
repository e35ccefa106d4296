"""``linear_call``: a function linear in some inputs, with its own transpose.

Forward mode needs the user's ``jvp`` and reverse mode the user's
``backward`` on ONE function, which neither ``custom_jvp`` nor
``custom_vjp`` allows (jax#3996). vjpkit's ``custom_jvp`` rule returns its
tangent through this primitive: evaluating it runs ``apply`` (the user's
jvp); transposing it runs ``transpose`` (the user's backward) inline, as
JAX runs a ``custom_vjp``'s backward, so a derivative of the gradient
differentiates backward's code. Unlike JAX's own
``custom_derivatives.linear_call`` it batches (both rules, lazily, under
``jax.vmap``, an output whose primal is unbatched staying unbatched) and
its JVP also differentiates through the residuals, so
``jax.hessian``, ``jacfwd(jacrev)`` and ``jacrev(jacfwd)`` are right.
It also declares the effects of the rule it runs (``jax.debug.print``,
ordered or not), keeps ``shard_map``'s varying types, and batches under the
vmap's axis name, so that collectives over it work inside the rules.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
from jax.extend.core import jaxpr_as_fun

from . import _jax_internals
from ._jax_internals import Primitive, ad, batching, mlir, partial_eval


class _LinearCallPrimitive(Primitive):
    """Each bind notes whether reverse mode is recording it to transpose it.

    Why: JAX caches abstract evaluation by parameters, and replays recorded
    equations with theirs; the one recorded for ``jax.grad`` (no effects:
    its jvp is never traced) must not stand for the one ``jax.jvp`` runs.
    """

    def bind(self, *args: Any, **params: Any) -> Any:
        params["recorded"] = _jax_internals.differentiation("custom_jvp rule") == "vjp"
        return super().bind(*args, **params)

    def bind_recorded(self, *args: Any, **params: Any) -> Any:
        """A bind its caller knows reverse mode records (``Program.linearize``): no callers to look at."""
        return super().bind(*args, **params, recorded=True)


_linear_call_p = _LinearCallPrimitive("vjpkit_linear_call")
_linear_call_p.multiple_results = True


def linear_call(
    residuals: Sequence[Any],
    linear_inputs: Sequence[Any],
    *,
    apply: Callable,
    transpose: Callable | None,
    out_avals: Sequence[Any],
    name: str,
    primals: Sequence[Any] = (),
    recorded: bool = False,
) -> list:
    """``apply(residuals, linear_inputs)``, linear in ``linear_inputs``.

    ``transpose(residuals, cotangents)`` returns one cotangent per linear
    input; ``None`` means "transpose ``apply`` with ``jax.linear_transpose``".
    A ``transpose`` with the attribute ``takes_symbolic_zeros`` receives
    ``None`` for cotangents that JAX knows are zero.
    ``out_avals`` are ``apply``'s output types (no tracing to find them).
    ``primals``: where a vmap may batch the call (under ``jax.vmap``, or
    traced into a jaxpr), the primal of each linear input, then of each
    output; empty elsewhere. Only their batch axes are read: an output
    whose primal is not batched stays unbatched (see ``_linear_call_batch``).
    ``recorded``: the caller knows that reverse mode records the call to
    transpose it (otherwise the callers say, see ``_LinearCallPrimitive``).
    """
    witnesses = tuple(map(_batch_witness, primals))
    return _bind(residuals, witnesses, linear_inputs, apply=apply, transpose=transpose, out_avals=out_avals,
                 name=name, recorded=recorded)


def _bind(residuals: Sequence[Any], witnesses: tuple, linear_inputs: Sequence[Any], *, apply: Callable,
          transpose: Callable | None, out_avals: Sequence[Any], name: str, traced: _TracedRule | None = None,
          recorded: bool = False) -> list:
    num_res, out_avals = len(residuals), tuple(out_avals)
    if traced is None:
        traced = _TracedRule(apply, num_res, len(witnesses), out_avals)
    bind = _linear_call_p.bind_recorded if recorded else _linear_call_p.bind
    return bind(
        *residuals,
        *witnesses,
        *linear_inputs,
        num_res=num_res,
        num_witnesses=len(witnesses),
        apply=apply,
        transpose=transpose,
        out_avals=out_avals,
        name=name,
        traced=traced,
    )


def _batch_witness(x: Any) -> Any:
    """A primal's batch axis without its data: an empty slice of it (``_linear_call_jvp`` ignores its tangent)."""
    x = jnp.reshape(x, (1,)) if jnp.ndim(x) == 0 else x
    return jax.lax.slice(x, (0,) * x.ndim, (0,) * x.ndim)


def _linear_call_partial_eval(trace: Any, *tracers: Any, num_res: int, num_witnesses: int, **params: Any) -> list:
    """A call with unknown (linear) inputs staged without its batch witnesses.

    Why: partial evaluation (``jax.linearize``, reverse mode) would keep them
    as residuals, for a call that is then evaluated or transposed, never
    batched by them; the tangents it computes are already batched where
    they need be.
    """
    res, witnesses, lin = _parts(tracers, num_res, num_witnesses)
    if witnesses and not all(t.is_known() for t in tracers):
        tracers, num_witnesses = res + lin, 0
        params["traced"] = _TracedRule(params["apply"], num_res, 0, params["out_avals"])
    return trace.default_process_primitive(
        _linear_call_p, tracers, dict(params, num_res=num_res, num_witnesses=num_witnesses)
    )


def _parts(args: Sequence[Any], num_res: int, num_witnesses: int) -> tuple[tuple, tuple, tuple]:
    """A call's operands: (residuals, batch witnesses, linear inputs)."""
    return tuple(args[:num_res]), tuple(args[num_res:num_res + num_witnesses]), tuple(args[num_res + num_witnesses:])


def _split(args: Sequence[Any], num_res: int, num_witnesses: int = 0) -> tuple[tuple, tuple]:
    """(residuals, linear inputs) of a call's operands, without the batch witnesses between them."""
    res, _, lin = _parts(args, num_res, num_witnesses)
    return res, lin


def _flat_rule(apply: Callable, num_res: int, out_avals: Sequence[Any], num_witnesses: int = 0) -> Callable:
    """``apply`` on flat arguments, its outputs typed as ``out_avals`` inside ``shard_map``.

    Why: there a tangent or cotangent must vary across devices wherever its
    primal does; a rule's ``jnp.zeros``, or a value computed from
    replicated residuals only, does not (which changes no value).
    """

    def rule(*args: Any) -> list:
        res, lin = _split(args, num_res, num_witnesses)
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
    __slots__ = ("apply", "num_res", "num_witnesses", "out_avals", "name", "_jaxprs", "__weakref__")

    def __init__(self, apply: Callable, num_res: int, num_witnesses: int, out_avals: tuple):
        self.apply, self.num_res, self.num_witnesses, self.out_avals = apply, num_res, num_witnesses, out_avals
        self.name = getattr(apply, "__qualname__", "rule")
        self._jaxprs: dict | None = None

    def jaxpr(self, in_avals: Sequence[Any]) -> Any:
        key = tuple(in_avals)
        if self._jaxprs is None:
            self._jaxprs = {}
        if key not in self._jaxprs:
            rule = _flat_rule(self.apply, self.num_res, self.out_avals, self.num_witnesses)
            self._jaxprs[key] = jax.make_jaxpr(rule)(*key)
        return self._jaxprs[key]

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


def _linear_call_impl(*args, num_res, num_witnesses, apply, transpose, out_avals, name, traced, recorded):
    refuse_forward_mode(apply)
    res, lin = _split(args, num_res, num_witnesses)
    return list(apply(res, lin))


def _linear_call_abstract_eval(*in_avals, num_res, num_witnesses, apply, transpose, out_avals, name, traced, recorded):
    if recorded or hasattr(apply, "forward_mode_error"):
        # Recorded to be transposed, never run: grad must not trace the jvp
        # (nor a rule forward mode may not run, whose transpose is traced when bound).
        return list(out_avals), set()
    return list(out_avals), traced.jaxpr(in_avals).effects


def _linear_call_lowering(ctx, *args, num_res, num_witnesses, apply, transpose, out_avals, name, traced, recorded):
    refuse_forward_mode(apply)
    jaxpr = traced.jaxpr(ctx.avals_in)
    missing = _jax_internals.ordered_effects_without_tokens(ctx, jaxpr.effects)
    if missing:
        # Only a call that reverse mode recorded, run after all (older JAX).
        raise TypeError(
            f"{name}.jvp uses ordered effects ({', '.join(map(str, missing))}) in a call that "
            "reverse mode recorded without them (reverse mode never runs jvp, so it did not "
            f"trace it), and JAX {_jax_internals.JAX_RELEASE} runs that record here: before JAX 0.9 "
            "jax.linearize shares it, and before JAX 0.7 so does jax.jvp of a function that "
            f"jax.grad already differentiated. Pass ordered=False in {name}.jvp, or use "
            "JAX 0.9 or later."
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
            raise TypeError(
                f"{name} defines jvp but no backward, so reverse mode (jax.grad, "
                f"jax.vjp, jax.jacrev) transposes {name}.jvp, which must then be "
                "linear in the tangents and written in transposable JAX "
                f"operations; transposing it failed: {_transpose_failure(e)}. Define "
                f"{name}.backward(ctx, *grad_outputs) instead."
            ) from e

    return transposed


def _transpose_failure(e: Exception) -> str:
    """What JAX's failed transpose says, or what it means where JAX says nothing useful.

    Why: a product of two tangents, or a comparison of one, fails an internal
    assertion of JAX's transpose, whose text is empty or a tuple of JAX's
    accumulator objects.
    """
    text = str(e).strip()
    if isinstance(e, AssertionError) or not text:
        return (
            "JAX met an operation that is not linear in the tangents (such as a product of "
            "two tangents, or a comparison or branch on one)"
        )
    return text


def _linear_call_transpose(cts, *args, num_res, num_witnesses, apply, transpose, out_avals, name, traced, recorded):
    res, witnesses, lin = _parts(args, num_res, num_witnesses)
    if any(ad.is_undefined_primal(r) for r in res + witnesses):
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
    return [None] * (num_res + num_witnesses) + list(cts_in)


def _with_zeros_as_none(rule: Callable, zero: tuple) -> Callable:
    def rule_with_zeros(res: tuple, cts: tuple) -> list:
        return rule(res, tuple(None if z else ct for z, ct in zip(zero, cts, strict=True)))

    return rule_with_zeros


def _linear_call_jvp(primals, tangents, *, num_res, num_witnesses, apply, transpose, out_avals, name, traced,
                     recorded):
    res, witnesses, lin = _parts(primals, num_res, num_witnesses)
    d_res, _, d_lin = _parts(tangents, num_res, num_witnesses)  # a witness's value is never read
    primals, tangents = res + lin, d_res + d_lin
    rule = _flat_rule(apply, num_res, out_avals)
    if all(type(t) is ad.Zero for t in d_res):
        # Only the linear inputs move: the derivative is the call itself, same
        # rules. The value is computed inline: it is never transposed.
        refuse_forward_mode(apply)
        out = rule(*primals)
        if all(type(t) is ad.Zero for t in d_lin):
            return out, [ad.Zero(a.to_tangent_aval()) for a in out_avals]
        return out, _bind(res, witnesses, list(map(ad.instantiate_zeros, d_lin)), apply=apply, transpose=transpose,
                          out_avals=out_avals, name=name, traced=traced)
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


def _linear_call_batch(axis_data, args, dims, *, num_res, num_witnesses, apply, transpose, out_avals, name, traced,
                       recorded):
    axis_names = _jax_internals.vmap_axis_names(axis_data)
    res, witnesses, lin = _parts(args, num_res, num_witnesses)
    if all(d is None for d in dims) and axis_names["axis_name"] is None:
        out = _bind(res, witnesses, lin, apply=apply, transpose=transpose, out_avals=out_avals, name=name)
        return out, [None] * len(out)
    size = axis_data.size
    res_dims, witness_dims, lin_dims = _parts(dims, num_res, num_witnesses)
    res = tuple(
        x if d is None else jnp.moveaxis(x, d, 0) for x, d in zip(res, res_dims, strict=True)
    )
    res_axes = tuple(None if d is None else 0 for d in res_dims)
    # Every linear input batched at 0: the transposed rule then maps cleanly.
    lin = tuple(batching.bdim_at_front(x, d, size) for x, d in zip(lin, lin_dims, strict=True))
    unbatched = _unbatched_outputs(witness_dims, lin_dims, len(out_avals))
    ct_axes = tuple(None if u else 0 for u in unbatched)

    def vmapped(rule: Callable, in_axes: Any) -> Callable:
        def batched_rule(r: tuple, xs: tuple) -> list:
            return jax.vmap(
                lambda r_, xs_: list(rule(r_, xs_)), in_axes=(res_axes, in_axes), axis_size=size, **axis_names
            )(r, tuple(xs))

        batched_rule.takes_symbolic_zeros = getattr(rule, "takes_symbolic_zeros", False)  # type: ignore[attr-defined]
        if hasattr(rule, "forward_mode_error"):
            batched_rule.forward_mode_error = rule.forward_mode_error  # type: ignore[attr-defined]
        return batched_rule

    batched_apply = vmapped(apply, 0)
    batched_transpose = None if transpose is None else vmapped(transpose, ct_axes)
    if any(unbatched):
        batched_apply = _mean_where(batched_apply, unbatched)
        if batched_transpose is not None:
            batched_transpose = _spread_where(batched_transpose, unbatched, size)
    batched_out_avals = tuple(
        a if u else _jax_internals.batched_aval(a, size, axis_data) for a, u in zip(out_avals, unbatched, strict=True)
    )
    out = _bind(res, witnesses, lin, apply=batched_apply, transpose=batched_transpose, out_avals=batched_out_avals,
                name=name)
    return out, [None if u else 0 for u in unbatched]


def _unbatched_outputs(witness_dims: Sequence[Any], lin_dims: Sequence[Any], n_out: int) -> list[bool]:
    """Which outputs stay unbatched: those whose primal is not batched, when every batched tangent's primal is.

    The witnesses' axes are those of the primal of each linear input, then of
    each output (none outside a vmap: then every output is batched). An
    output whose primal does not depend on the batch has a derivative that
    does not either (its tangent comes from tangents of inputs that it
    depends on, all unbatched); but under ``jax.jacfwd`` (a vmap of tangents
    around unbatched primals) tangents vary where primals do not, and every
    output is batched.
    """
    if not witness_dims:
        return [False] * n_out
    in_dims, out_dims = witness_dims[:len(lin_dims)], witness_dims[len(lin_dims):]
    if any(t is not None and p is None for t, p in zip(lin_dims, in_dims, strict=True)):
        return [False] * n_out
    return [d is None for d in out_dims]


def _mean_where(batched_apply: Callable, unbatched: Sequence[bool]) -> Callable:
    """The batched rule with each unbatched output the mean of its per-example values.

    Why the mean: the per-example values of an output whose primal does not
    depend on the batch are equal (for a rule that is the derivative of
    forward), and the mean is linear, with a transpose (``_spread_where``)
    that reverse mode can run by the user's backward.
    """

    def rule(r: tuple, xs: tuple) -> list:
        outs = batched_apply(r, xs)
        return [jnp.mean(o, axis=0) if u else o for o, u in zip(outs, unbatched, strict=True)]

    for attribute in ("takes_symbolic_zeros", "forward_mode_error"):
        if hasattr(batched_apply, attribute):
            setattr(rule, attribute, getattr(batched_apply, attribute))
    return rule


def _spread_where(batched_transpose: Callable, unbatched: Sequence[bool], size: int) -> Callable:
    """The transpose of ``_mean_where``: each example gets an unbatched output's cotangent divided by ``size``.

    Why not the whole cotangent to each example (as ``jax.custom_vjp`` under
    vmap does): backward would count it once per example wherever it adds
    to an unbatched input's gradient (``F(x, w) = (x * w, w ** 2)`` under
    ``vmap(F, (0, None), out_axes=(0, None))`` gives ``w`` the gradient of
    ``w ** 2`` ``size`` times).
    """

    def rule(r: tuple, cts: tuple) -> list:
        return batched_transpose(r, tuple(
            ct / size if u and ct is not None else ct for ct, u in zip(cts, unbatched, strict=True)
        ))

    rule.takes_symbolic_zeros = getattr(batched_transpose, "takes_symbolic_zeros", False)  # type: ignore[attr-defined]
    return rule


ad.primitive_jvps[_linear_call_p] = _linear_call_jvp
# JAX's caches keyed by equation parameters must not keep a rule (and the
# program it runs) alive after the jaxprs holding the call are gone.
_jax_internals.hold_weakly_in_caches(_TracedRule)
ad.primitive_transposes[_linear_call_p] = _linear_call_transpose
batching.fancy_primitive_batchers[_linear_call_p] = _linear_call_batch
partial_eval.custom_partial_eval_rules[_linear_call_p] = _linear_call_partial_eval
