"""The call of a Function: ``vjpkit_call``, a primitive of vjpkit's own whose rules are the Function's.

Evaluated or compiled, the call runs forward with nothing differentiated
(``Rules.primal``). JAX differentiates it by its JVP rule (``Rules.rule``:
forward knowing which inputs move, the outputs tied, the output tangent a
``linear_call`` whose evaluation runs the user's jvp and whose transpose
runs backward), told which differentiation runs it
(``differentiation_running_rule``). A vmap batches it by its batching rule:
function and rules together, as a loop over the examples (``Batched``),
each output batched where its value or its derivative varies along the
batch, decided before any derivative runs.

Why a primitive, not ``jax.custom_jvp``: JAX calls a custom_jvp's rule for
forward mode, ``jax.linearize`` and reverse mode alike, and batches a
custom_jvp staged in a jaxpr by its function before a derivative batches
its rule; only JAX's call stack told which. A primitive's rules are told
by JAX itself.
"""

from __future__ import annotations

from typing import Any, Protocol, Sequence

import jax
from jax.extend.core import ClosedJaxpr, jaxpr_as_fun

from . import _jax_internals
from ._jax_internals import Primitive, ad, batching, mlir


class Rules(Protocol):
    """What the call runs: a program (``_program.Program``), or one batched (``Batched``)."""

    name: str

    def primal(self, *arrays: Any) -> list:
        """forward's output arrays, nothing differentiated (JAX code)."""

    def evaluate(self, *arrays: Any) -> list:
        """forward's output arrays on concrete ``arrays`` (eagerly, no transformation active)."""

    def tied_primal(self, *arrays: Any) -> list:
        """forward's output arrays, tied to the Function's own derivative (JAX code)."""

    def traced(self, in_avals: tuple) -> ClosedJaxpr:
        """``primal`` traced for ``in_avals`` (cached)."""

    def rule(self, primals: Sequence[Any], tangents: Sequence[Any], differentiation: str) -> tuple[list, list]:
        """The call's JVP: outputs and their tangents (``ad.Zero`` where none)."""


call_p = Primitive("vjpkit_call")
call_p.multiple_results = True


def call(rules: Any, arrays: Sequence[Any], reverse_jit: bool = False) -> list:
    """The call of ``rules`` on ``arrays``: its output arrays.

    ``reverse_jit``: the call is made in a ``jax.jit`` that reverse mode
    differentiates by its JVP (JAX before 0.7, or with
    ``jax_use_direct_linearize`` off): there JAX traces the JVP of the
    jit's body before it partially evaluates and transposes it, so the
    call's JVP rule would hear forward mode (``_program.Program.jit``).

    Staged into a program, the equation carries the function's jaxpr
    (``jaxpr``), as JAX's own calls do: what it runs, for its lowering and
    effects, and for anyone reading the program. Bound to a transformation
    (differentiation, vmap), it carries none (None): a rule runs and binds
    again, or, on concrete arrays, forward itself runs, as JAX runs a
    ``custom_jvp``'s function (op by op, never traced); where JAX asks for
    its types after all, it is traced then.
    """
    jaxpr = rules.traced(tuple(map(_jax_internals.typeof, arrays))) if _jax_internals.stages_here() else None
    return call_p.bind(*arrays, rules=rules, jaxpr=jaxpr, reverse_jit=reverse_jit)


def _function(rules: Any, jaxpr: ClosedJaxpr | None, avals: Sequence[Any]) -> ClosedJaxpr:
    return rules.traced(tuple(avals)) if jaxpr is None else jaxpr


def _impl(*arrays: Any, rules: Any, jaxpr: ClosedJaxpr | None, reverse_jit: bool) -> list:
    if jaxpr is None:
        return list(rules.evaluate(*arrays))
    return jaxpr_as_fun(jaxpr)(*arrays)


def _abstract_eval(*avals: Any, rules: Any, jaxpr: ClosedJaxpr | None, reverse_jit: bool) -> tuple[list, Any]:
    jaxpr = _function(rules, jaxpr, avals)
    return list(jaxpr.out_avals), jaxpr.effects


def _lowering(ctx: Any, *args: Any, rules: Any, jaxpr: ClosedJaxpr | None, reverse_jit: bool) -> Any:
    jaxpr = _function(rules, jaxpr, ctx.avals_in)
    return mlir.lower_fun(jaxpr_as_fun(jaxpr), multiple_results=True)(ctx, *args)


def _jvp(primals: Sequence[Any], tangents: Sequence[Any], *, rules: Any, jaxpr: ClosedJaxpr | None,
         reverse_jit: bool) -> tuple[list, list]:
    differentiation = _jax_internals.differentiation_running_rule()
    if reverse_jit and differentiation in ("jvp", "traced_jvp"):
        differentiation = "vjp"
    return rules.rule(primals, tangents, differentiation)


def _batch(axis_data: Any, args: Sequence[Any], dims: Sequence[Any], *, rules: Any, jaxpr: ClosedJaxpr | None,
           reverse_jit: bool) -> tuple[list, list]:
    axis_names = _jax_internals.vmap_axis_names(axis_data)
    if all(d is None for d in dims) and axis_names["axis_name"] is None:
        out = call(rules, args, reverse_jit)
        return out, [None] * len(out)
    size = axis_data.size
    args = [x if d is None else batching.bdim_at_front(x, d, size) for x, d in zip(args, dims, strict=True)]
    in_axes = tuple(None if d is None else 0 for d in dims)
    batched = Batched(rules, in_axes, axis_data, tuple(map(_jax_internals.typeof, args)))
    return call(batched, args, reverse_jit), list(batched.out_axes)


class Batched:
    """``inner``'s rules under a ``jax.vmap``: a loop over the examples.

    ``in_axes``: 0 or None per input (batched along the leading axis, or
    shared by every example). An output is batched (``out_axes``) where its
    value or its derivative varies along the batch: read from ``inner``'s
    tied function for one example batched by JAX, where each tie batches
    an output whose derivative varies (``_tie._derivative_batched``). So a
    derivative taken later finds each output's axis already right.
    """

    __slots__ = ("inner", "in_axes", "axis_data", "axis_names", "size", "name", "out_axes", "closed_over", "_jaxpr",
                 "__weakref__")

    def __init__(self, inner: Any, in_axes: tuple, axis_data: Any, in_avals: tuple):
        self.inner, self.in_axes, self.axis_data = inner, in_axes, axis_data
        # The tracers the Function's methods close over, the call's first operands (see ``_closure_free``).
        self.closed_over = getattr(inner, "closed_over", ())
        self.axis_names = _jax_internals.vmap_axis_names(axis_data)
        self.size = axis_data.size
        self.name = inner.name
        example = tuple(a if d is None else _jax_internals.example_aval(a, self.size)
                        for a, d in zip(in_avals, in_axes, strict=True))
        # Where nothing may differentiate the call (an eager vmap, no derivative under way), by value alone.
        later = _jax_internals.differentiating_here() or _jax_internals.is_staging()
        function = jax.make_jaxpr(self._free(inner.tied_primal if later else inner.primal))(*example)
        batched, out_batched = _jax_internals.batch_example(function, axis_data, [d is not None for d in in_axes])
        self.out_axes = tuple(0 if b else None for b in out_batched)
        # What the call runs: that function batched (the ties in it lower to nothing).
        self._jaxpr: dict = {in_avals: batched}

    def _vmap(self, fn: Any, in_axes: Any, out_axes: Any) -> Any:
        return jax.vmap(self._free(fn), in_axes=in_axes, out_axes=out_axes, axis_size=self.size, **self.axis_names)

    def _free(self, fn: Any) -> Any:
        return _closure_free(fn, self.closed_over) if self.closed_over else fn

    def primal(self, *arrays: Any) -> list:
        return self._vmap(lambda *a: list(self.inner.primal(*a)), self.in_axes, list(self.out_axes))(*arrays)

    def evaluate(self, *arrays: Any) -> list:
        return jaxpr_as_fun(self.traced(tuple(map(_jax_internals.typeof, arrays))))(*arrays)

    def tied_primal(self, *arrays: Any) -> list:
        return self._vmap(lambda *a: list(self.inner.tied_primal(*a)), self.in_axes, list(self.out_axes))(*arrays)

    def traced(self, in_avals: tuple) -> ClosedJaxpr:
        jaxpr = self._jaxpr.get(in_avals)
        if jaxpr is None:
            jaxpr = self._jaxpr[in_avals] = jax.make_jaxpr(self.primal)(*in_avals)
        return jaxpr

    def rule(self, primals: Sequence[Any], tangents: Sequence[Any], differentiation: str) -> tuple[list, list]:
        moving = [i for i, t in enumerate(tangents) if type(t) is not ad.Zero]
        zero_out: list = []

        def one(primals_: list, moving_tangents: list) -> tuple[list, list]:
            full: list = [ad.Zero(_jax_internals.tangent_aval(p)) for p in primals_]
            for i, t in zip(moving, moving_tangents, strict=True):
                full[i] = t
            outs, out_tangents = self.inner.rule(primals_, full, differentiation)
            zero_out[:] = [type(t) is ad.Zero for t in out_tangents]
            return list(outs), [ad.instantiate_zeros(t) for t in out_tangents]

        out_axes = list(self.out_axes)
        in_axes = (list(self.in_axes), [self.in_axes[i] for i in moving])
        args = (list(primals), [tangents[i] for i in moving])
        try:
            outs, out_tangents = self._vmap(one, in_axes, (out_axes, out_axes))(*args)
        except ValueError:
            if self._tangent_batched_apart(one, in_axes, args):
                raise batched_apart_from_output(self.name) from None
            raise
        out_tangents = [ad.Zero(_jax_internals.tangent_aval(y)) if z else t
                        for y, t, z in zip(outs, out_tangents, zero_out, strict=True)]
        return outs, out_tangents

    def _tangent_batched_apart(self, one: Any, in_axes: tuple, args: tuple) -> bool:
        """Whether ``one`` (the rule for one example) batches a tangent whose output this vmap fixed unbatched."""
        flat_axes, _ = jax.tree_util.tree_flatten(in_axes, is_leaf=lambda a: a is None)
        flat_args = jax.tree_util.tree_leaves(args)
        example = [_jax_internals.typeof(x) if d is None else _jax_internals.example_aval(_jax_internals.typeof(x),
                                                                                          self.size)
                   for x, d in zip(flat_args, flat_axes, strict=True)]
        tree = jax.tree_util.tree_structure(args)
        jaxpr = jax.make_jaxpr(lambda *xs: one(*jax.tree_util.tree_unflatten(tree, xs)))(*example)
        _, out_batched = _jax_internals.batch_example(jaxpr, self.axis_data, [d is not None for d in flat_axes])
        tangent_batched = out_batched[len(self.out_axes):]
        return any(b and d is None for b, d in zip(tangent_batched, self.out_axes, strict=True))

    def __repr__(self) -> str:
        return f"vmapped {self.name}"


def _closure_free(fn: Any, closed_over: tuple) -> Any:
    """``fn`` (of the call's operands, the first ``closed_over``), reading those tracers from its arguments.

    Why: the Function's methods use tracers of an enclosing transformation
    in their Python code, which a vmap of one example cannot batch. ``fn``
    is traced to a jaxpr, whose constants that are those tracers (by
    identity) are replaced by the arguments in their place: closure
    conversion, as ``jax.closure_convert`` makes it.
    """
    at = {id(t): k for k, t in enumerate(closed_over)}

    def free(*args: Any) -> Any:
        flat, tree = jax.tree_util.tree_flatten(args)
        out_tree: list = []

        def flat_fn(*xs: Any) -> list:
            out, out_def = jax.tree_util.tree_flatten(fn(*jax.tree_util.tree_unflatten(tree, xs)))
            out_tree.append(out_def)
            return out

        closed = jax.make_jaxpr(flat_fn)(*map(_jax_internals.typeof, flat))
        consts = [flat[at[id(c)]] if id(c) in at else c for c in closed.consts]  # the operands come first
        return jax.tree_util.tree_unflatten(out_tree[0], jaxpr_as_fun(ClosedJaxpr(closed.jaxpr, consts))(*flat))

    return free


def batched_apart_from_output(name: str) -> ValueError:
    """The error for a tangent batched where a vmap fixed its output unbatched before any derivative.

    Why: the call's batching rule fixes each output's batch axis by its
    value and its derivative (``Batched``); this guard stands where they
    still disagree (a rule that could not be read then), for JAX would
    broadcast each example's tangent against the fixed axis.
    """
    return ValueError(
        f"{name} has an output that does not vary along a jax.vmap but whose derivative does ({name}'s rules "
        "make it vary along the batch), and that vmap fixed the output's batch axis by its value alone, before "
        f"differentiating. There JAX cannot give each example its own derivative of an unbatched output. Make "
        f"that output of {name}.forward depend on the batched input, or take the derivative inside the vmap."
    )


def _transpose(cts: Sequence[Any], *args: Any, rules: Any, jaxpr: ClosedJaxpr | None, reverse_jit: bool) -> list:
    """The call transposed where it is linear in some operands (a jvp-only Function's jvp calling a Function on
    its tangents, transposed by reverse mode): its function's jaxpr transposed by JAX."""
    linear = [ad.is_undefined_primal(x) for x in args]
    function = jaxpr_as_fun(_function(rules, jaxpr, [x.aval if lin else _jax_internals.typeof(x)
                                                     for x, lin in zip(args, map(ad.is_undefined_primal, args),
                                                                       strict=True)]))

    def along_linear(*values: Any) -> list:
        it = iter(values)
        return function(*[next(it) if lin else x for x, lin in zip(args, linear, strict=True)])

    avals = [x.aval for x, lin in zip(args, linear, strict=True) if lin]
    transposed = iter(jax.linear_transpose(along_linear, *avals)([ad.instantiate_zeros(ct) for ct in cts]))
    return [next(transposed) if lin else None for lin in linear]


def _linearize(is_vjp: bool, nonzeros: Sequence[bool], primals: Sequence[Any], params: dict) -> tuple:
    """Reverse mode's linearization of a program's call: forward on the primals' trace, the tangent on the tangents'.

    What JAX would make of the JVP rule, made directly (JAX's generic
    linearization traces the rule under partial evaluation and evaluates
    its linear part again). ``jax.linearize`` (which splits the tangent's
    work on the residuals off it) and a batched call take JAX's.
    """
    rules = params["rules"]
    if not is_vjp or type(rules) is Batched:
        return _jax_internals.linearize_by_jvp_rule(call_p, is_vjp, nonzeros, primals, params)
    return rules.linearize(primals, nonzeros)


call_p.def_impl(_impl)
call_p.def_effectful_abstract_eval(_abstract_eval)
mlir.register_lowering(call_p, _lowering)
ad.primitive_jvps[call_p] = _jvp
ad.primitive_transposes[call_p] = _transpose
batching.fancy_primitive_batchers[call_p] = _batch
_jax_internals.check_replication_by_jaxpr(call_p, lambda params, avals: _function(params["rules"], params["jaxpr"],
                                                                                  avals))
_jax_internals.register_linearization(call_p, _linearize)
# JAX's caches keyed by equation parameters must not keep a program alive after the jaxprs holding its call are gone.
_jax_internals.hold_weakly_in_caches(Batched)
