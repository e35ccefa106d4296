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
import collections
import functools
import json
import os
import platform
import statistics
import time
import traceback
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

try:  # JAX >= 0.11-ish: HiPrim
    from jax.experimental.hijax import HiPrim as _Base

    API = "HiPrim"
except ImportError:  # JAX 0.10.x: VJPHiPrimitive
    from jax.experimental.hijax import VJPHiPrimitive as _Base

    API = "VJPHiPrimitive"
from jax._src.interpreters import ad as _ad  # GradAccum (exported publicly only from 0.12)
from jax.experimental.hijax import Zero

jax.config.update("jax_enable_x64", False)

COUNTS: collections.Counter = collections.Counter()
NEEDS_LOG: list = []  # needs_input_grad seen by each backward


@jax.tree_util.register_static
@dataclass(frozen=True)
class Static:
    val: Any


class Ctx:
    def __init__(self, needs_input_grad):
        self.needs_input_grad = tuple(bool(n) for n in needs_input_grad)
        self.saved_tensors = ()

    def save_for_backward(self, *ts):
        self.saved_tensors = ts


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

    transpose = FnTangent.transpose

    def batch(self, axis_data, args, dims):
        if all(d is None for d in dims):
            return self(*args), None
        args = tuple(a if d is None else jnp.moveaxis(a, d, 0) for a, d in zip(args, dims, strict=True))
        dims = tuple(None if d is None else 0 for d in dims)
        return FnTangentVmap(self, axis_data.size, axis_data.name, dims)(*args), 0

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


# ---------------------------------------------------------------- the user's Function


class TanhLinear:
    """y = tanh(x @ w); saves x, w and the output y."""

    @staticmethod
    def forward(ctx, x, w):
        y = jnp.tanh(x @ w)
        ctx.save_for_backward(x, w, y)
        return y

    @staticmethod
    def backward(ctx, g):
        x, w, y = ctx.saved_tensors
        gz = g * (1 - y * y)
        gx = gz @ w.T if ctx.needs_input_grad[0] else None
        gw = jnp.outer(x, gz) if ctx.needs_input_grad[1] else None
        return gx, gw

    @staticmethod
    def jvp(ctx, tx, tw):
        x, w, y = ctx.saved_tensors
        tz = 0
        if tx is not None:
            tz = tz + tx @ w
        if tw is not None:
            tz = tz + x @ tw
        return (1 - y * y) * tz


class OpaqueTanhLinear(TanhLinear):
    """Same rules, but forward hides itself from JAX (stop_gradient): any derivative,
    first or second order, is right only if it comes from the Function's own rules."""

    @staticmethod
    def forward(ctx, x, w):
        y = lax.stop_gradient(jnp.tanh(x @ w))
        ctx.save_for_backward(x, w, y)
        return y


def reference(x, w):
    return jnp.tanh(x @ w)


# ---------------------------------------------------------------- checks


def _close(a, b, tol=1e-4):
    la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
    return len(la) == len(lb) and all(
        np.shape(p) == np.shape(q) and np.allclose(p, q, rtol=tol, atol=tol) for p, q in zip(la, lb, strict=True))


def run_checks():
    F = hijax_function(TanhLinear)
    G = hijax_function(OpaqueTanhLinear)
    R = reference
    rng = np.random.default_rng(0)
    n, m, B = 4, 4, 3
    x = jnp.asarray(rng.standard_normal(n), jnp.float32)
    w = jnp.asarray(rng.standard_normal((n, m)) * 0.5, jnp.float32)
    xs = jnp.asarray(rng.standard_normal((B, n)), jnp.float32)
    tx = jnp.asarray(rng.standard_normal(n), jnp.float32)
    tw = jnp.asarray(rng.standard_normal((n, m)), jnp.float32)

    def loss(f):
        return lambda x, w: jnp.sum(jnp.sin(f(x, w)))

    def loop(f, xs_):  # vmap as a loop over examples
        return jnp.stack([f(xs_[i]) for i in range(xs_.shape[0])])

    cases = {
        "eager call": lambda f: f(x, w),
        "jax.jit": lambda f: jax.jit(f)(x, w),
        "jax.grad": lambda f: jax.grad(loss(f), (0, 1))(x, w),
        "jax.jit(jax.grad)": lambda f: jax.jit(jax.grad(loss(f), (0, 1)))(x, w),
        "jax.grad(jax.jit(f))": lambda f: jax.grad(loss(jax.jit(f)), (0, 1))(x, w),
        "jax.vjp wrt x only": lambda f: jax.vjp(lambda x: f(x, w), x)[1](jnp.ones(m)),
        "jax.vjp wrt w only": lambda f: jax.vjp(lambda w: f(x, w), w)[1](jnp.ones(m)),
        "jax.jvp": lambda f: jax.jvp(f, (x, w), (tx, tw)),
        "jax.jvp wrt x only": lambda f: jax.jvp(lambda x: f(x, w), (x,), (tx,)),
        "jax.jacfwd": lambda f: jax.jacfwd(f, (0, 1))(x, w),
        "jax.jacrev": lambda f: jax.jacrev(f, (0, 1))(x, w),
        "jax.linearize": lambda f: jax.linearize(f, x, w)[1](tx, tw),
        "jax.hessian (wrt x)": lambda f: jax.hessian(loss(f))(x, w),
        "jax.jacfwd(jax.grad)": lambda f: jax.jacfwd(jax.grad(loss(f), 1), 1)(x, w),
        "grad(grad) (scalar path)": lambda f: jax.grad(lambda s: jax.grad(lambda t: loss(f)(t * x, w))(s))(1.3),
        "jax.jit(jax.hessian)": lambda f: jax.jit(jax.hessian(loss(f), 1))(x, w),
        "jax.vmap": lambda f: jax.vmap(f, (0, None))(xs, w),
        "jax.vmap(jax.grad)": lambda f: jax.vmap(jax.grad(loss(f), (0, 1)), (0, None))(xs, w),
        "jax.grad(jax.vmap)": lambda f: jax.grad(
            lambda x, w: jnp.sum(jnp.sin(jax.vmap(f, (0, None))(x, w))), (0, 1))(xs, w),
        "jax.jvp(jax.vmap)": lambda f: jax.jvp(lambda x: jax.vmap(f, (0, None))(x, w), (xs,), (xs * 0.5,)),
        "jax.linearize(jax.vmap)": lambda f: jax.linearize(lambda w: jax.vmap(f, (0, None))(xs, w), w)[1](tw),
        "vmap(vmap)": lambda f: jax.vmap(jax.vmap(f, (0, None)), (0, None))(jnp.stack([xs, xs * 2]), w),
        "jax.hessian(jax.vmap)": lambda f: jax.hessian(lambda w: jnp.sum(jnp.sin(jax.vmap(f, (0, None))(xs, w))))(w),
        "lax.scan body (grad)": lambda f: jax.grad(
            lambda w: lax.scan(lambda c, xi: (c + jnp.sum(jnp.sin(f(xi, w))), None), 0.0, xs)[0])(w),
        "lax.cond (grad)": lambda f: jax.grad(
            lambda w: lax.cond(True, lambda w: jnp.sum(jnp.sin(f(x, w))), lambda w: 0.0, w))(w),
        "jax.checkpoint (grad)": lambda f: jax.grad(lambda w: jnp.sum(jnp.sin(jax.checkpoint(f)(x, w))))(w),
        "checkpoint policy=nothing_saveable": lambda f: jax.grad(lambda w: jnp.sum(jnp.sin(
            jax.checkpoint(f, policy=jax.checkpoint_policies.nothing_saveable)(x, w))))(w),
        "jax.jvp(jax.checkpoint)": lambda f: jax.jvp(jax.checkpoint(f), (x, w), (tx, tw)),
        "jax.grad(jax.checkpoint(jax.vmap))": lambda f: jax.grad(
            lambda w: jnp.sum(jnp.sin(jax.checkpoint(jax.vmap(f, (0, None)))(xs, w))))(w),
        "jax.vmap(jax.grad(jax.checkpoint))": lambda f: jax.vmap(
            jax.grad(lambda x, w: jnp.sum(jnp.sin(jax.checkpoint(f)(x, w))), (0, 1)), (0, None))(xs, w),
        "jax.export (call)": lambda f: _export(f, x, w),
        "jax.export of jax.grad": lambda f: _export(jax.grad(loss(f), 1), x, w),
    }
    loops = {  # where the reference is a loop over examples, not vmap of plain JAX
        "jax.vmap": lambda f: loop(lambda xi: f(xi, w), xs),
        "jax.vmap(jax.grad)": lambda f: jax.tree_util.tree_map(
            lambda *a: jnp.stack(a), *[jax.grad(loss(f), (0, 1))(xs[i], w) for i in range(B)]),
        "jax.vmap(jax.grad(jax.checkpoint))": lambda f: jax.tree_util.tree_map(
            lambda *a: jnp.stack(a), *[jax.grad(loss(f), (0, 1))(xs[i], w) for i in range(B)]),
    }
    rows = []
    for name, case in cases.items():
        ref_fn = loops.get(name, case)
        try:
            want = ref_fn(R)
        except Exception as e:  # noqa: BLE001
            rows.append((name, "n/a", f"reference failed: {type(e).__name__}: {str(e).splitlines()[0]}"))
            continue
        res = {}
        for label, f in (("hijax", F), ("opaque", G)):
            COUNTS.clear()
            NEEDS_LOG.clear()
            try:
                got = case(f)
                ok = _close(got, want)
                note = "works" if ok else "WRONG ANSWER"
            except Exception as e:  # noqa: BLE001
                msg = str(e).strip().splitlines()[0][:160] if str(e).strip() else ""
                note = f"fails: {type(e).__name__}: {msg}"
                if os.environ.get("PROBE_TRACE"):
                    traceback.print_exc()
            res[label] = (note, dict(COUNTS), list(NEEDS_LOG))
        rows.append((name, res["hijax"], res["opaque"]))
    return rows


def _export(f, x, w):
    from jax import export

    exp = export.export(jax.jit(f))(x, w)
    blob = exp.serialize()
    return export.deserialize(blob).call(x, w)


def needs_input_grad_checks():
    """jax#16614's shape: one jitted program differentiated wrt x, then w, then both."""
    F = hijax_function(TanhLinear)
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal(4), jnp.float32)
    w = jnp.asarray(rng.standard_normal((4, 4)), jnp.float32)
    g = jax.jit(lambda x, w: jnp.sum(F(x, w)))
    out = []
    for argnums in (0, 1, (0, 1), 0):
        NEEDS_LOG.clear()
        COUNTS.clear()
        got = jax.grad(g, argnums)(x, w)
        want = jax.grad(lambda x, w: jnp.sum(reference(x, w)), argnums)(x, w)
        out.append((argnums, list(NEEDS_LOG), COUNTS["backward"], _close(got, want)))
    # backward runs once per reverse pass (eager, un-jitted; trace-time counts)
    COUNTS.clear()
    jax.grad(lambda x, w: jnp.sum(F(F(x, w), w)), (0, 1))(x, w)
    once = dict(COUNTS)
    return out, once


class BackwardOnly:
    """forward + backward, no jvp: reverse mode must run backward, never a jvp."""

    forward = staticmethod(TanhLinear.forward)
    backward = staticmethod(TanhLinear.backward)


def backward_only_checks():
    F = hijax_function(BackwardOnly)
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal(4), jnp.float32)
    w = jnp.asarray(rng.standard_normal((4, 4)) * 0.5, jnp.float32)
    want = jax.grad(lambda w: jnp.sum(jnp.sin(reference(x, w))))(w)
    cases = {
        "grad": lambda: jax.grad(lambda w: jnp.sum(jnp.sin(F(x, w))))(w),
        "grad(checkpoint)": lambda: jax.grad(lambda w: jnp.sum(jnp.sin(jax.checkpoint(F)(x, w))))(w),
        "grad(checkpoint(jit))": lambda: jax.grad(lambda w: jnp.sum(jnp.sin(jax.checkpoint(jax.jit(F))(x, w))))(w),
        "grad(checkpoint(vmap)), summed over 3 copies of x": lambda: jax.grad(lambda w: jnp.sum(jnp.sin(
            jax.checkpoint(jax.vmap(F, (0, None)))(jnp.stack([x, x, x]), w))) / 3)(w),
    }
    out = []
    flags = [False, True] if hasattr(jax.config, "jax_remat3") or "jax_remat3" in jax.config.values else [False]
    for remat3 in flags:
        for name, case in cases.items():
            if remat3:
                jax.config.update("jax_remat3", True)
            COUNTS.clear()
            try:
                ok = _close(case(), want)
                note = "works" if ok else "WRONG ANSWER"
            except Exception as e:  # noqa: BLE001
                note = f"fails: {type(e).__name__}: {str(e).strip().splitlines()[0][:120]}"
            finally:
                if remat3:
                    jax.config.update("jax_remat3", False)
            out.append((name + (" [jax_remat3=True]" if remat3 else ""), note, dict(COUNTS)))
    try:
        jax.jvp(lambda x: F(x, w), (x,), (x,))
        out.append(("jvp (no jvp rule)", "ran?!", {}))
    except Exception as e:  # noqa: BLE001
        out.append(("jvp (no jvp rule)", f"raises {type(e).__name__}: {str(e).strip().splitlines()[0][:100]}", {}))
    return out


# ---------------------------------------------------------------- speed


def speed(repeats=15):
    import vjpkit

    class VTanh(vjpkit.Function):
        forward = staticmethod(TanhLinear.forward)
        backward = staticmethod(TanhLinear.backward)
        jvp = staticmethod(TanhLinear.jvp)

    @jax.custom_vjp
    def cv(x, w):
        return jnp.tanh(x @ w)

    def cv_fwd(x, w):
        y = jnp.tanh(x @ w)
        return y, (x, w, y)

    def cv_bwd(res, g):
        x, w, y = res
        gz = g * (1 - y * y)
        return gz @ w.T, jnp.outer(x, gz)

    cv.defvjp(cv_fwd, cv_bwd)
    cv_a = jax.jit(cv)
    cv_b = jax.jit(cv)  # A/A: an identical second candidate

    H = hijax_function(TanhLinear)
    cands = {
        "custom_vjp jit (A)": cv_a,
        "custom_vjp jit (A/A)": cv_b,
        "hijax (op-by-op)": H,
        "hijax jit": jax.jit(H),
        "vjpkit": VTanh.apply,
    }
    rng = np.random.default_rng(2)
    n = 16
    x = jnp.asarray(rng.standard_normal(n), jnp.float32)
    w = jnp.asarray(rng.standard_normal((n, n)) * 0.3, jnp.float32)

    def t_call(f, number):
        t0 = time.perf_counter()
        for _ in range(number):
            r = f(x, w)
        jax.block_until_ready(r)
        return (time.perf_counter() - t0) / number

    def interleave(make, number):
        samples = {k: [] for k in cands}
        fns = {k: make(f) for k, f in cands.items()}
        for f in fns.values():  # warm
            jax.block_until_ready(f(x, w))
        keys = list(cands)
        for r in range(repeats):
            for k in keys[r % len(keys):] + keys[: r % len(keys)]:
                samples[k].append(t_call(fns[k], number))
        return {k: statistics.median(v) for k, v in samples.items()}

    call_us = {k: v * 1e6 for k, v in interleave(lambda f: f, 50).items()}
    grad_us = {k: v * 1e6 for k, v in interleave(
        lambda f: jax.grad(lambda x, w: jnp.sum(f(x, w)), (0, 1)), 20).items()}

    # trace + lower of jax.jit(jax.value_and_grad(200-call chain))
    def chain(f):
        def c(x, w):
            for _ in range(200):
                x = f(x, w)
            return jnp.sum(x)

        return c

    lower_ms = {k: [] for k in cands}
    raw = {"custom_vjp jit (A)": cv, "custom_vjp jit (A/A)": cv, "hijax (op-by-op)": H,
           "hijax jit": H, "vjpkit": VTanh.apply}
    keys = list(cands)
    for r in range(max(3, repeats // 3)):
        for k in keys[r % len(keys):] + keys[: r % len(keys)]:
            f = raw[k]
            fn = jax.jit(jax.value_and_grad(chain(f), (0, 1)))  # a fresh jit each time: no cache
            t0 = time.perf_counter()
            fn.trace(x, w).lower()
            lower_ms[k].append((time.perf_counter() - t0) * 1e3)
    lower_ms = {k: statistics.median(v) for k, v in lower_ms.items()}
    return call_us, grad_us, lower_ms


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--no-speed", action="store_true")
    ap.add_argument("--json")
    args = ap.parse_args()
    print(f"JAX {jax.__version__}, hijax API: {API}, python {platform.python_version()}, "
          f"backend {jax.default_backend()}, {os.cpu_count()} cpus")
    rows = run_checks()
    print(f"\n{'check':38s} | {'TanhLinear (hijax)':60s} | OpaqueTanhLinear (own rules only)")
    for name, a, b in rows:
        if a == "n/a":
            print(f"{name:38s} | {b}")
            continue
        print(f"{name:38s} | {a[0][:60]:60s} | {b[0][:70]}")
    print("\ncounts (TanhLinear): forward/jvp/backward/batch rule runs, needs_input_grad seen by backward")
    for name, a, _ in rows:
        if a != "n/a":
            print(f"  {name:38s} {a[1]} {a[2] if a[2] else ''}")
    nig, once = needs_input_grad_checks()
    print("\njit program differentiated wrt x, w, both, x (jax#16614 shape):")
    for argnums, log, nb, ok in nig:
        print(f"  argnums={argnums}: needs_input_grad seen={log} backward runs={nb} correct={ok}")
    print(f"eager grad of F(F(x,w),w): counts {once} (2 calls -> expect 2 backward)")
    bo = backward_only_checks()
    print("\nBackwardOnly (forward+backward, no jvp):")
    for name, note, counts in bo:
        print(f"  {name:40s} {note}  {counts}")
    out = {"backward_only": bo, "jax": jax.__version__, "api": API, "rows": [
        (n, a if a == "n/a" else a[0], b if a == "n/a" else b[0]) for n, a, b in rows],
        "needs_input_grad": [(str(a), label, nb, ok) for a, label, nb, ok in nig], "once": once}
    if not args.no_speed:
        call_us, grad_us, lower_ms = speed()
        print("\nspeed (CPU, machine loaded by another test suite; medians, interleaved):")
        header = f"{'candidate':24s} {'eager call us':>14s} {'eager grad us':>14s}"
        print(f"{header} {'trace+lower ms (200 chain, v&g)':>32s}")
        for k in call_us:
            print(f"{k:24s} {call_us[k]:14.1f} {grad_us[k]:14.1f} {lower_ms[k]:32.1f}")
        out["speed"] = {"call_us": call_us, "grad_us": grad_us, "lower_ms": lower_ms}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1, default=str)


if __name__ == "__main__":
    main()
