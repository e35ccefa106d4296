"""Experiment: a vjpkit-shaped Function on JAX's hijax primitive API (no frame walks).

Standalone probe, not wired into vjpkit. It builds a ``torch.autograd.Function``
shaped class (``forward(ctx, x, w)`` saving residuals, ``backward(ctx, g)``
reading ``ctx.needs_input_grad``, optional ``jvp(ctx, tx, tw)``) on
``jax.experimental.hijax.HiPrim`` (JAX 0.12) or ``VJPHiPrimitive`` (JAX 0.10),
checks it against plain JAX autodiff and a loop over examples under every
transformation in the brief, then times it against a hand-written
``jax.jit(jax.custom_vjp)`` of the same math (and vjpkit's current path).

    cd /work/wt-hijax && PYTHONPATH=src python benchmarks/hijax_probe.py [--no-speed] [--json out.json]

Design (what a port of the core would look like):

- ``expand``: forward, all ``needs_input_grad`` False (eager, jit, export);
- ``jvp``: jax.jvp: forward + the user's ``jvp``;
- ``lin``/``linearized``: jax.linearize: forward saves residuals, the user's
  ``jvp`` is the linear map;
- ``vjp_fwd``/``vjp_bwd``: reverse mode: forward with ``needs_input_grad`` =
  the ``nzs_in`` hijax passes, backward with the gradient accumulators;
- ``batch``: a ``FnVmap`` primitive whose every rule is the per-example rule
  under ``jax.vmap`` (vmap as a loop over examples, own rules kept);
- second order: inside a rule whose arguments are tracers, the outputs (and
  saved outputs) are re-bound as the primitive itself (a "tie"), so an outer
  transformation differentiates them by the Function's own rules.

Which differentiation runs is told to the primitive by which method JAX
calls: there is no frame walk anywhere in this file.
"""

from __future__ import annotations

import argparse
import functools
import os
import platform
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

try:  # JAX >= 0.11-ish: HiPrim
    from jax.experimental.hijax import HiPrim as _Base

    API = "HiPrim"
except ImportError:  # JAX 0.10.x: VJPHiPrimitive
    from jax.experimental.hijax import VJPHiPrimitive as _Base

    API = "VJPHiPrimitive"
from _probe_checks import COUNTS, NEEDS_LOG, Ctx, report
from jax._src.interpreters import ad as _ad  # GradAccum (exported publicly only from 0.12)
from jax.experimental.hijax import Zero

jax.config.update("jax_enable_x64", False)


@jax.tree_util.register_static
@dataclass(frozen=True)
class Static:
    val: Any


def _aval(x):
    return jax.core.ShapedArray(np.shape(x), jnp.result_type(x))


def _is_tracer(x):
    return isinstance(x, jax.core.Tracer)


# ---------------------------------------------------------------- the primitive


class _Rules:
    """Rules shared by ``FnPrim`` and ``FnVmap``: ``batch`` makes a ``FnVmap``."""

    def batch(self, axis_data, args, dims):
        if all(d is None for d in dims):  # JAX calls a HiPrim's batch rule with nothing batched too
            return self(*args), None
        args = tuple(a if d is None else jnp.moveaxis(a, d, 0) for a, d in zip(args, dims, strict=True))
        dims = tuple(None if d is None else 0 for d in dims)
        COUNTS["batch"] += 1
        return FnVmap(self, axis_data.size, axis_data.name, dims)(*args), 0

    # 0.10's VJPHiPrimitive.batch calls batch_dim_rule + its own VmapOf; we override batch.


class FnPrim(_Rules, _Base):
    def __init__(self, fn, in_avals):
        self.in_avals = tuple(in_avals)
        out = jax.eval_shape(lambda *a: fn.forward(Ctx([False] * len(a)), *a), *in_avals)
        self.out_aval = jax.core.ShapedArray(out.shape, out.dtype)
        self.params = dict(fn=fn, avals=self.in_avals)
        super().__init__()

    # eager / jit / export: forward only
    def expand(self, *args):
        COUNTS["forward"] += 1
        return self.fn.forward(Ctx([False] * len(args)), *args)

    def _forward(self, nzs, args):
        COUNTS["forward"] += 1
        ctx = Ctx(nzs)
        y_raw = self.fn.forward(ctx, *args)
        # The tie: at higher order (arguments are tracers of an outer trace, or of a jit
        # that may later be differentiated), outputs and saved outputs become the
        # primitive itself, so the outer transformation uses the Function's own rules.
        y = self(*args) if any(map(_is_tracer, args)) else y_raw
        ctx.saved_tensors = tuple(y if s is y_raw else s for s in ctx.saved_tensors)
        return y, ctx

    # jax.jvp / jacfwd, and default jax.checkpoint (which differentiates by jvp, then transposes)
    def jvp(self, primals, tangents):
        nzs = [not isinstance(t, Zero) for t in tangents]
        y, ctx = self._forward(nzs, primals)
        if not any(nzs):
            return y, Zero(self.out_aval.to_tangent_aval())
        # The tangent is a linear primitive of its own: evaluated (jax.jvp) it runs the user's jvp,
        # transposed (reverse mode through jax.checkpoint) the user's backward.
        saved = tuple(ctx.saved_tensors)
        ts = tuple(t for t in tangents if not isinstance(t, Zero))
        tangent = FnTangent(self.fn, ctx.needs_input_grad, tuple(map(_aval, saved)), tuple(map(_aval, ts)),
                            self.out_aval.to_tangent_aval())
        return y, tangent(*saved, *ts)

    def _user_jvp(self, ctx, tangents):
        if not hasattr(self.fn, "jvp"):
            raise NotImplementedError(f"{self.fn.__name__} has no jvp (forward mode)")
        COUNTS["jvp"] += 1
        ts = [None if isinstance(t, Zero) else t for t in tangents]
        ty = self.fn.jvp(ctx, *ts)
        return Zero(self.out_aval.to_tangent_aval()) if ty is None else ty

    # jax.linearize
    def lin(self, nzs_in, *primals):
        y, ctx = self._forward(nzs_in, primals)
        return y, (ctx.saved_tensors, Static(ctx.needs_input_grad))

    def linearized(self, residuals, *tangents):
        saved, nig = residuals
        ctx = Ctx(nig.val)
        ctx.saved_tensors = saved
        return self._user_jvp(ctx, tangents)

    # reverse mode
    def vjp_fwd(self, nzs_in, *args):
        y, ctx = self._forward(nzs_in, args)
        return y, (ctx.saved_tensors, Static(ctx.needs_input_grad))

    def _user_backward(self, residuals, g):
        saved, nig = residuals
        ctx = Ctx(nig.val)
        ctx.saved_tensors = saved
        if isinstance(g, Zero):
            g = jnp.zeros(g.aval.shape, g.aval.dtype)
        COUNTS["backward"] += 1
        NEEDS_LOG.append(ctx.needs_input_grad)
        grads = self.fn.backward(ctx, g)
        return tuple(gi if n else None for gi, n in zip(grads, ctx.needs_input_grad, strict=True))

    def vjp_bwd(self, res, g, *accums):
        for acc, gi in zip(accums, self._user_backward(res, g), strict=True):
            if gi is not None and isinstance(acc, _ad.GradAccum):
                acc.accum(gi)


class FnVmap(_Rules, _Base):
    """``prim`` over a leading batch axis: each rule is ``prim``'s rule under ``jax.vmap``."""

    def __init__(self, prim, size, name, dims):
        def unmap(a, d):
            return a if d is None else jax.core.ShapedArray((size, *a.shape), a.dtype)

        self.in_avals = tuple(map(unmap, prim.in_avals, dims))
        self.out_aval = jax.core.ShapedArray((size, *prim.out_aval.shape), prim.out_aval.dtype)
        self.params = dict(prim=prim, size=size, name=name, dims=tuple(dims))
        super().__init__()

    def _vmap(self, f, in_axes, out_axes):
        return jax.vmap(f, in_axes=in_axes, out_axes=out_axes, axis_size=self.size, axis_name=self.name)

    def expand(self, *args):
        return self._vmap(self.prim.expand, self.dims, 0)(*args)

    def _tangent_split(self, tangents):
        nz = tuple(not isinstance(t, Zero) for t in tangents)
        return nz, tuple(t for t in tangents if not isinstance(t, Zero))

    def _rebuild(self, nz, nz_ts):
        it = iter(nz_ts)
        return tuple(next(it) if n else Zero(a.to_tangent_aval()) for n, a in zip(nz, self.prim.in_avals, strict=True))

    def jvp(self, primals, tangents):
        nz, ts = self._tangent_split(tangents)

        def per(p, t):
            y, ty = self.prim.jvp(p, self._rebuild(nz, t))
            return y, (jnp.zeros_like(y) if isinstance(ty, Zero) else ty)

        t_axes = tuple(d for d, n in zip(self.dims, nz, strict=True) if n)
        return self._vmap(per, (self.dims, t_axes), (0, 0))(tuple(primals), ts)

    def lin(self, nzs_in, *primals):
        (y, res), (_, res_axes) = self._vmap(
            lambda *a: self.prim.lin(nzs_in, *a), self.dims, (0, _infer()))(*primals)
        return y, (res, Static((res_axes, tuple(nzs_in))))

    def linearized(self, residuals, *tangents):
        res, st = residuals
        res_axes, _ = st.val
        nz, ts = self._tangent_split(tangents)
        t_axes = tuple(d for d, n in zip(self.dims, nz, strict=True) if n)

        def per(r, t):
            ty = self.prim.linearized(r, *self._rebuild(nz, t))
            return jnp.zeros(self.prim.out_aval.shape, self.prim.out_aval.dtype) if isinstance(ty, Zero) else ty

        return self._vmap(per, (res_axes, t_axes), 0)(res, ts)

    def vjp_fwd(self, nzs_in, *args):
        (y, res), (_, res_axes) = self._vmap(
            lambda *a: self.prim.vjp_fwd(nzs_in, *a), self.dims, (0, _infer()))(*args)
        return y, (res, Static((res_axes, tuple(nzs_in))))

    def vjp_bwd(self, res_, g, *accums):
        res, st = res_
        res_axes, nzs = st.val
        if isinstance(g, Zero):
            g = jnp.zeros(g.aval.shape, g.aval.dtype)

        def per(r, gi):
            grads = self.prim._bwd_retval(r, gi)
            return tuple(x for x, n in zip(grads, nzs, strict=True) if n)

        out = iter(self._vmap(per, (res_axes, 0), 0)(res, g))
        for acc, n, d in zip(accums, nzs, self.dims, strict=True):
            if n:
                gi = next(out)
                if d is None:  # an input shared by all examples: sum over them
                    gi = gi.sum(0)
                if isinstance(acc, _ad.GradAccum):
                    acc.accum(gi)

    def _bwd_retval(self, res_, g):  # for nested vmap
        res, st = res_
        res_axes, nzs = st.val

        def per(r, gi):
            grads = self.prim._bwd_retval(r, gi)
            return tuple(x for x, n in zip(grads, nzs, strict=True) if n)

        out = iter(self._vmap(per, (res_axes, 0), 0)(res, g))
        grads = []
        for n, d in zip(nzs, self.dims, strict=True):
            gi = next(out) if n else None
            grads.append(gi.sum(0) if gi is not None and d is None else gi)
        return tuple(grads)


class FnTangent(_Base):
    """``FnPrim``'s output tangent, linear in the input tangents (``needs``: which inputs have one).

    ``expand`` (jax.jvp evaluates it): the user's ``jvp``, or the forward-mode
    error of a class without one. ``transpose`` (reverse mode through default
    ``jax.checkpoint``, which calls ``FnPrim.jvp`` and transposes its tangent):
    the user's ``backward``, never the jvp transposed. Under vmap it is
    ``FnTangentVmap``, a loop over the examples of both rules.
    """

    def __init__(self, fn, needs, res_avals, tangent_avals, out_aval):
        self.in_avals = tuple(res_avals) + tuple(tangent_avals)
        self.out_aval = out_aval
        self.params = dict(fn=fn, needs=tuple(needs), n_res=len(res_avals))
        super().__init__()

    def _ctx(self, saved):
        ctx = Ctx(self.needs)
        ctx.saved_tensors = tuple(saved)
        return ctx

    def expand(self, *args):
        saved, ts = args[:self.n_res], iter(args[self.n_res:])
        if not hasattr(self.fn, "jvp"):
            raise NotImplementedError(f"{self.fn.__name__} has no jvp (forward mode)")
        COUNTS["jvp"] += 1
        return self.fn.jvp(self._ctx(saved), *[next(ts) if n else None for n in self.needs])

    def grads(self, saved, ct):
        """The user's backward: one gradient per input that has a tangent."""
        COUNTS["backward"] += 1
        NEEDS_LOG.append(self.needs)
        grads = self.fn.backward(self._ctx(saved), ct)
        return [g for g, n in zip(grads, self.needs, strict=True) if n]

    def differentiable(self, *args):
        """The tangent map as JAX code a derivative can go through: jvp, or without one backward transposed."""
        if hasattr(self.fn, "jvp"):
            return self.expand(*args)
        saved, ts = args[:self.n_res], args[self.n_res:]
        transposed = jax.linear_transpose(lambda ct: self.grads(saved, ct), self.out_aval)
        return transposed(list(ts))[0]

    def jvp(self, primals, tangents):
        """jvp of jvp: the tangent map's own derivative, along its residuals and its tangents."""
        tangents = [jnp.zeros(t.aval.shape, t.aval.dtype) if isinstance(t, Zero) else t for t in tangents]
        return jax.jvp(self.differentiable, tuple(primals), tuple(tangents))

    def transpose(self, ct, *maybe_accums):
        saved, accums = maybe_accums[:self.n_res], maybe_accums[self.n_res:]
        if isinstance(ct, Zero):
            return None
        for acc, g in zip(accums, self.grads(saved, ct), strict=True):
            if isinstance(acc, _ad.GradAccum):
                acc.accum(g)
        return None

    def batch(self, axis_data, args, dims):
        if all(d is None for d in dims):
            return self(*args), None
        args = tuple(a if d is None else jnp.moveaxis(a, d, 0) for a, d in zip(args, dims, strict=True))
        dims = tuple(None if d is None else 0 for d in dims)
        return FnTangentVmap(self, axis_data.size, axis_data.name, dims)(*args), 0


class FnTangentVmap(_Base):
    """``FnTangent`` over a leading batch axis: each example's jvp, or each example's backward."""

    def __init__(self, prim, size, name, dims):
        self.in_avals = tuple(a if d is None else jax.core.ShapedArray((size, *a.shape), a.dtype)
                              for a, d in zip(prim.in_avals, dims, strict=True))
        self.out_aval = jax.core.ShapedArray((size, *prim.out_aval.shape), prim.out_aval.dtype)
        self.params = dict(prim=prim, size=size, name=name, dims=tuple(dims))
        super().__init__()

    def _vmap(self, f, in_axes):
        return jax.vmap(f, in_axes=in_axes, out_axes=0, axis_size=self.size, axis_name=self.name)

    def expand(self, *args):
        return self._vmap(self.prim.expand, self.dims)(*args)

    def grads(self, saved, ct):
        n_res = self.prim.n_res
        per_example = self._vmap(lambda s, c: self.prim.grads(s, c), (self.dims[:n_res], 0))(tuple(saved), ct)
        # An input shared by every example gets the sum of the examples' gradients.
        return [g if d == 0 else g.sum(0) for g, d in zip(per_example, self.dims[n_res:], strict=True)]

    def differentiable(self, *args):
        return self._vmap(self.prim.differentiable, self.dims)(*args)

    transpose = FnTangent.transpose
    jvp = FnTangent.jvp
    batch = FnTangent.batch  # a vmap of this one nests another FnTangentVmap

    @property
    def n_res(self):
        return self.prim.n_res


def _fnprim_bwd_retval(self, residuals, g):
    grads = self._user_backward(residuals, g)
    return tuple(
        gi if gi is not None else None for gi in grads)


FnPrim._bwd_retval = _fnprim_bwd_retval


def _infer():
    from jax._src.interpreters import batching

    return batching.infer


@functools.lru_cache(maxsize=None)
def _prim(fn, avals):
    return FnPrim(fn, avals)


def hijax_function(fn):
    """``fn``: a class with static forward/backward[/jvp]; returns ``apply``."""

    def apply(*args):
        return _prim(fn, tuple(map(_aval, args)))(*args)

    apply.__name__ = fn.__name__
    return apply

def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--no-speed", action="store_true")
    ap.add_argument("--json")
    args = ap.parse_args()
    print(f"JAX {jax.__version__}, hijax API: {API}, python {platform.python_version()}, "
          f"backend {jax.default_backend()}, {os.cpu_count()} cpus")
    report(hijax_function, "hijax", not args.no_speed, args.json)


if __name__ == "__main__":
    main()
