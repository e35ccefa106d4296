"""Experiment: a vjpkit-shaped Function as a JAX primitive of its own, on every JAX vjpkit supports (no frame walks).

Standalone probe, not wired into vjpkit. It runs the checks of
``_probe_checks.py`` (the same as ``hijax_probe.py``'s) on a
``torch.autograd.Function``-shaped class built as two primitives
(``jax.extend.core.Primitive``), where vjpkit's core builds a ``jax.custom_jvp``:

- ``probe_call``: the call. Evaluated or lowered, it runs ``forward`` with
  every ``needs_input_grad`` False. Its JVP rule runs ``forward`` knowing
  which inputs have a tangent (``needs_input_grad``: JAX passes ``Zero`` for
  the others), and returns the output tangent as a ``probe_tangent``. Its
  batching rule makes the call of a ``VmapRules``: every rule of the class
  as a loop over the examples (``jax.vmap`` of it).
- ``probe_tangent``: the output tangent, linear in the input tangents, with
  the saved arrays as residuals. Evaluated (``jax.jvp``, ``jax.jacfwd``,
  ``jax.linearize``'s linear function), it runs the user's ``jvp``, or
  raises for a class without one; transposed (``jax.grad``, and reverse
  mode through ``jax.checkpoint``), it runs the user's ``backward``. So
  which differentiation runs is decided by what JAX does with the
  tangent, never asked while tracing: JAX's own ``custom_vjp`` waits the
  same way (``custom_lin``).
- Second order: in a rule whose arguments are tracers, the output (and a
  saved output) is bound again as ``probe_call`` (a "tie"), so an outer
  derivative takes it by the Function's own rules.

Where JAX linearizes directly (0.7 on; ``--linearize-rule``), a
linearization rule can run ``forward`` on the primals' trace and bind the
tangent on the tangents' trace, as JAX's own primitives do, with no tracer
made by hand: the only private name this file uses
(``jax._src.interpreters.ad.primitive_linearizations``). Without it JAX
linearizes the JVP rule under partial evaluation.

    PYTHONPATH=src python benchmarks/primitive_probe.py [--no-speed] [--linearize-rule] [--json out.json]

What the probe leaves out, which vjpkit's core has: effects of the rules,
``jax.linearize``'s split of ``jvp``'s work on the residuals, an output left
unbatched where neither its value nor its derivative varies along the
batch, vmap's axis names in the rules, ``shard_map``'s varying types,
integer inputs (``float0`` tangents), pytrees.
"""

from __future__ import annotations

import argparse
import inspect
import os
import platform

import jax
import jax.numpy as jnp
from _probe_checks import COUNTS, NEEDS_LOG, Ctx, report
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

jax.config.update("jax_enable_x64", False)


def _aval(x):
    return jax.core.ShapedArray(jnp.shape(x), jnp.result_type(x))


def _is_tracer(x):
    return isinstance(x, jax.core.Tracer)


# ---------------------------------------------------------------- a class's rules, on flat arrays


class Rules:
    """The user's methods on flat arrays; hashed by the class (a primitive's parameter)."""

    def __init__(self, fn):
        self.fn = fn
        self._out_avals: dict = {}

    def __hash__(self):
        return hash(self.fn)

    def __eq__(self, other):
        return type(other) is Rules and other.fn is self.fn

    def out_aval(self, in_avals):
        key = tuple(in_avals)
        if key not in self._out_avals:
            structs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in key]
            out = jax.eval_shape(self.primal, *structs)
            self._out_avals[key] = jax.core.ShapedArray(out.shape, out.dtype)
        return self._out_avals[key]

    def primal(self, *args):
        COUNTS["forward"] += 1
        return self.fn.forward(Ctx([False] * len(args)), *args)

    def forward(self, needs, *args):
        """forward's output and saved arrays, and which saved arrays are the output itself."""
        COUNTS["forward"] += 1
        ctx = Ctx(needs)
        y = self.fn.forward(ctx, *args)
        saved = tuple(ctx.saved_tensors)
        return y, saved, tuple(i for i, s in enumerate(saved) if s is y)

    def jvp(self, needs, saved, ts):
        if not hasattr(self.fn, "jvp"):
            raise NotImplementedError(f"{self.fn.__name__} has no jvp (forward mode)")
        COUNTS["jvp"] += 1
        ctx = Ctx(needs)
        ctx.saved_tensors = tuple(saved)
        it = iter(ts)
        return self.fn.jvp(ctx, *[next(it) if n else None for n in needs])

    def grads(self, needs, saved, ct):
        """The user's backward: one gradient per input that has a tangent."""
        COUNTS["backward"] += 1
        NEEDS_LOG.append(tuple(needs))
        ctx = Ctx(needs)
        ctx.saved_tensors = tuple(saved)
        grads = self.fn.backward(ctx, ct)
        return [g for g, n in zip(grads, needs, strict=True) if n]

    def differentiable_jvp(self, needs, saved, ts, out_aval):
        """The tangent map as JAX code a derivative can go through: jvp, or without one backward transposed."""
        if hasattr(self.fn, "jvp"):
            return self.jvp(needs, saved, ts)
        transposed = jax.linear_transpose(lambda ct: self.grads(needs, saved, ct), out_aval)
        return transposed(list(ts))[0]


class _PerExample:
    """The tangent rules of ``inner`` as a loop over the examples (``jax.vmap`` of ``size``).

    ``_axes(needs)``: the batch axes (0 or None) of the saved arrays and of
    the tangents; an input shared by every example gets the sum of the
    examples' gradients.
    """

    def _vmap(self, f, in_axes, out_axes=0):
        return jax.vmap(f, in_axes=in_axes, out_axes=out_axes, axis_size=self.size)

    def jvp(self, needs, saved, ts):
        return self._vmap(lambda s, t: self.inner.jvp(needs, s, t), self._axes(needs))(tuple(saved), tuple(ts))

    def grads(self, needs, saved, ct):
        saved_axes, tangent_axes = self._axes(needs)
        per_example = self._vmap(lambda s, c: self.inner.grads(needs, s, c), (saved_axes, 0))(tuple(saved), ct)
        return [g if d == 0 else g.sum(0) for g, d in zip(per_example, tangent_axes, strict=True)]

    def differentiable_jvp(self, needs, saved, ts, out_aval):
        one = jax.core.ShapedArray(out_aval.shape[1:], out_aval.dtype)
        return self._vmap(lambda s, t: self.inner.differentiable_jvp(needs, s, t, one),
                          self._axes(needs))(tuple(saved), tuple(ts))


class VmapRules(_PerExample):
    """``inner``'s rules over a leading batch axis of ``size`` (``dims``: 0 or None per input): a loop over examples."""

    def __init__(self, inner, size, dims):
        self.inner, self.size, self.dims = inner, size, tuple(dims)

    def __hash__(self):
        return hash((self.inner, self.size, self.dims))

    def __eq__(self, other):
        return type(other) is VmapRules and (other.inner, other.size, other.dims) == (self.inner, self.size, self.dims)

    def out_aval(self, in_avals):
        per = [a if d is None else jax.core.ShapedArray(a.shape[1:], a.dtype)
               for a, d in zip(in_avals, self.dims, strict=True)]
        out = self.inner.out_aval(per)
        return jax.core.ShapedArray((self.size, *out.shape), out.dtype)

    def primal(self, *args):
        return self._vmap(self.inner.primal, self.dims)(*args)

    def forward(self, needs, *args):
        out_at = []

        def one(*a):
            y, saved, at = self.inner.forward(needs, *a)
            out_at[:] = at
            return y, saved

        y, saved = self._vmap(one, self.dims)(*args)  # every saved array batched (out_axes=0)
        return y, saved, tuple(out_at)

    def _axes(self, needs):
        return 0, tuple(d for d, n in zip(self.dims, needs, strict=True) if n)


class TangentVmapRules(_PerExample):
    """A ``probe_tangent``'s rules over a leading batch axis (``saved_dims``, ``tangent_dims``: 0 or None)."""

    def __init__(self, inner, size, saved_dims, tangent_dims):
        self.inner, self.size = inner, size
        self.saved_dims, self.tangent_dims = tuple(saved_dims), tuple(tangent_dims)

    def _key(self):
        return (self.inner, self.size, self.saved_dims, self.tangent_dims)

    def __hash__(self):
        return hash(self._key())

    def __eq__(self, other):
        return type(other) is TangentVmapRules and other._key() == self._key()

    def _axes(self, needs):
        return self.saved_dims, self.tangent_dims


# ---------------------------------------------------------------- the two primitives

call_p = Primitive("probe_call")
tangent_p = Primitive("probe_tangent")


def _call_impl(*args, rules):
    return rules.primal(*args)


def _forward_tied(rules, needs, primals):
    """forward's output and saved arrays; at higher order the output is bound again, to differentiate by the rules."""
    y, saved, out_at = rules.forward(needs, *primals)
    if any(map(_is_tracer, primals)):
        y = call_p.bind(*primals, rules=rules)
        saved = tuple(y if i in out_at else s for i, s in enumerate(saved))
    return y, saved


def _tangent(rules, needs, saved, ts, out_aval):
    return tangent_p.bind(*saved, *ts, rules=rules, needs=tuple(needs), n_res=len(saved), out_aval=out_aval)


def _call_jvp(primals, tangents, *, rules):
    needs = tuple(type(t) is not ad.Zero for t in tangents)
    y, saved = _forward_tied(rules, needs, primals)
    out_aval = _aval(y)  # a float output: its tangent has its type
    if not any(needs):
        return y, ad.Zero(out_aval)
    return y, _tangent(rules, needs, saved, [t for t in tangents if type(t) is not ad.Zero], out_aval)


def _call_batch(args, dims, *, rules):
    if all(d is None for d in dims):
        return call_p.bind(*args, rules=rules), None
    size = next(a.shape[d] for a, d in zip(args, dims, strict=True) if d is not None)
    args = [a if d is None else jnp.moveaxis(a, d, 0) for a, d in zip(args, dims, strict=True)]
    return call_p.bind(*args, rules=VmapRules(rules, size, [None if d is None else 0 for d in dims])), 0


call_p.def_impl(_call_impl)
call_p.def_abstract_eval(lambda *avals, rules: rules.out_aval(avals))
mlir.register_lowering(call_p, mlir.lower_fun(_call_impl, multiple_results=False))
ad.primitive_jvps[call_p] = _call_jvp
batching.primitive_batchers[call_p] = _call_batch


def _tangent_impl(*args, rules, needs, n_res, out_aval):
    return rules.jvp(needs, args[:n_res], args[n_res:])


def _tangent_transpose(ct, *args, rules, needs, n_res, out_aval):
    if type(ct) is ad.Zero:
        return [None] * len(args)
    return [None] * n_res + list(rules.grads(needs, args[:n_res], ct))


def _tangent_jvp(primals, tangents, *, rules, needs, n_res, out_aval):
    out = tangent_p.bind(*primals, rules=rules, needs=needs, n_res=n_res, out_aval=out_aval)
    if all(type(t) is ad.Zero for t in tangents[:n_res]):  # only the linear inputs move: the call itself
        if all(type(t) is ad.Zero for t in tangents[n_res:]):
            return out, ad.Zero(out_aval)
        return out, tangent_p.bind(*primals[:n_res], *map(ad.instantiate_zeros, tangents[n_res:]), rules=rules,
                                   needs=needs, n_res=n_res, out_aval=out_aval)
    # The residuals move too: differentiate the tangent map's JAX code.
    _, t_out = jax.jvp(lambda *a: rules.differentiable_jvp(needs, a[:n_res], a[n_res:], out_aval), tuple(primals),
                       tuple(map(ad.instantiate_zeros, tangents)))
    return out, t_out


def _tangent_batch(args, dims, *, rules, needs, n_res, out_aval):
    if all(d is None for d in dims):
        return tangent_p.bind(*args, rules=rules, needs=needs, n_res=n_res, out_aval=out_aval), None
    size = next(a.shape[d] for a, d in zip(args, dims, strict=True) if d is not None)
    args = [a if d is None else jnp.moveaxis(a, d, 0) for a, d in zip(args, dims, strict=True)]
    dims = [None if d is None else 0 for d in dims]
    batched = TangentVmapRules(rules, size, dims[:n_res], dims[n_res:])
    out_aval = jax.core.ShapedArray((size, *out_aval.shape), out_aval.dtype)
    return tangent_p.bind(*args, rules=batched, needs=needs, n_res=n_res, out_aval=out_aval), 0


tangent_p.def_impl(_tangent_impl)
tangent_p.def_abstract_eval(lambda *avals, rules, needs, n_res, out_aval: out_aval)
mlir.register_lowering(tangent_p, mlir.lower_fun(_tangent_impl, multiple_results=False))
ad.primitive_transposes[tangent_p] = _tangent_transpose
ad.primitive_jvps[tangent_p] = _tangent_jvp
batching.primitive_batchers[tangent_p] = _tangent_batch


# ---------------------------------------------------------------- direct linearization (optional)


def register_linearize_rule():
    """Registers ``probe_call``'s linearization rule (JAX 0.7 on linearizes directly); False where JAX has none."""
    from jax._src.interpreters import ad as ad_internal

    table = getattr(ad_internal, "primitive_linearizations", None)
    if table is None:
        return False
    told_vjp = "_is_vjp" in inspect.signature(ad_internal.fallback_linearize_rule).parameters  # JAX 0.9 on
    # JAX 0.11 adds structured residuals: a fifth result, and a second argument of the linear function.
    structured = "structured_residuals" in getattr(ad_internal.LinearizeTrace, "__annotations__", {})

    def linearize(*args, rules):
        nzs, primals = (args[1], args[2:]) if told_vjp else (args[0], args[1:])
        needs = tuple(nzs)
        y, saved = _forward_tied(rules, needs, primals)  # on the primals' trace
        out_aval = _aval(y)

        def linearized(residuals, *tangents):  # on the tangents' trace
            tangents = tangents[1:] if structured else tangents
            return _tangent(rules, needs, residuals, [t for t, n in zip(tangents, needs, strict=True) if n], out_aval)

        return (y, True, saved, None, linearized) if structured else (y, True, saved, linearized)

    table[call_p] = linearize
    return True


def primitive_function(fn):
    """``fn``: a class with static forward/backward[/jvp]; returns ``apply``."""
    rules = Rules(fn)

    def apply(*args):
        return call_p.bind(*map(jnp.asarray, args), rules=rules)

    apply.__name__ = fn.__name__
    return apply


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--no-speed", action="store_true")
    ap.add_argument("--linearize-rule", action="store_true",
                    help="register probe_call's linearization rule (JAX's private primitive_linearizations)")
    ap.add_argument("--json")
    args = ap.parse_args()
    registered = register_linearize_rule() if args.linearize_rule else False
    direct = getattr(jax.config, "jax_use_direct_linearize", None)
    print(f"JAX {jax.__version__}, python {platform.python_version()}, backend {jax.default_backend()}, "
          f"{os.cpu_count()} cpus; direct linearization: {direct}; linearization rule registered: {registered}")
    report(primitive_function, "primitive", not args.no_speed, args.json)


if __name__ == "__main__":
    main()
