"""The checks both probes run: a vjpkit-shaped Function's derivatives under every transformation.

Shared by ``hijax_probe.py`` (the Function on ``jax.experimental.hijax``) and
``primitive_probe.py`` (the Function as a ``jax.extend.core.Primitive`` of its
own): each builds ``apply`` from a class by its ``make(fn)``, and the checks
compare it with plain JAX autodiff of the same math, or with a loop over the
examples where vmap is checked. ``COUNTS`` and ``NEEDS_LOG`` record which of
the user's methods ran (at trace time), and the ``needs_input_grad`` each
``backward`` saw.
"""

from __future__ import annotations

import collections
import gc
import json
import os
import re
import statistics
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

COUNTS: collections.Counter = collections.Counter()
NEEDS_LOG: list = []  # needs_input_grad seen by each backward


class Ctx:
    def __init__(self, needs_input_grad):
        self.needs_input_grad = tuple(bool(n) for n in needs_input_grad)
        self.saved_tensors = ()

    def save_for_backward(self, *ts):
        self.saved_tensors = ts



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


def run_checks(make):
    F = make(TanhLinear)
    G = make(OpaqueTanhLinear)
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
        "jax.jvp(jax.jit(f))": lambda f: jax.jvp(jax.jit(f), (x, w), (tx, tw)),
        "jax.jacfwd(jax.jacfwd) (jvp of jvp)": lambda f: jax.jacfwd(jax.jacfwd(f))(x, w),
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
        "jax.grad(jax.jit(jax.vmap)) (vmap staged first)": lambda f: jax.grad(
            jax.jit(lambda w: jnp.sum(jnp.sin(jax.vmap(f, (0, None))(xs, w)))))(w),
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
        for label, f in (("plain", F), ("opaque", G)):
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
        rows.append((name, res["plain"], res["opaque"]))
    return rows


def _export(f, x, w):
    from jax import export

    exp = export.export(jax.jit(f))(x, w)
    blob = exp.serialize()
    return export.deserialize(blob).call(x, w)


def needs_input_grad_checks(make):
    """jax#16614's shape: one jitted program differentiated wrt x, then w, then both."""
    F = make(TanhLinear)
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


def backward_only_checks(make):
    F = make(BackwardOnly)
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


def hand_written_tanh_linear():
    """TanhLinear as a hand-written ``jax.custom_vjp``: the reference of the HLO comparison and the timings."""

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
    return cv


def optimized_hlo_differences(make, calls=10):
    """How the optimized HLO of ``jit(value_and_grad)`` of a chain differs from custom_vjp's: opcode counts."""

    cv = hand_written_tanh_linear()

    def opcodes(f):
        def chain(x, w):
            for _ in range(calls):
                x = f(x, w)
            return jnp.sum(x)

        x, w = jnp.ones(16), jnp.eye(16) * 0.3
        text = jax.jit(jax.value_and_grad(chain, (0, 1))).lower(x, w).compile().as_text()
        return collections.Counter(re.findall(r"= \S+ (\w[\w-]*)\(", text))

    mine, theirs = opcodes(make(TanhLinear)), opcodes(cv)
    differences = {k: mine[k] - theirs[k] for k in mine | theirs if mine[k] != theirs[k]}
    return sum(mine.values()), sum(theirs.values()), differences


# ---------------------------------------------------------------- speed


def speed(make, label, repeats=15):
    """Eager call, eager grad and trace + lower of a 200-call chain: ``make``'s Function, custom_vjp, vjpkit."""
    import vjpkit

    class VTanh(vjpkit.Function):
        forward = staticmethod(TanhLinear.forward)
        backward = staticmethod(TanhLinear.backward)
        jvp = staticmethod(TanhLinear.jvp)

    cv = hand_written_tanh_linear()
    cv_a = jax.jit(cv)
    cv_b = jax.jit(cv)  # A/A: an identical second candidate

    H = make(TanhLinear)
    cands = {
        "custom_vjp jit (A)": cv_a,
        "custom_vjp jit (A/A)": cv_b,
        f"{label} (op-by-op)": H,
        f"{label} jit": jax.jit(H),
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
    raw = {"custom_vjp jit (A)": cv, "custom_vjp jit (A/A)": cv, f"{label} (op-by-op)": H,
           f"{label} jit": H, "vjpkit": VTanh.apply}
    keys = list(cands)
    for r in range(repeats):
        for k in keys[r % len(keys):] + keys[: r % len(keys)]:
            f = raw[k]
            fn = jax.jit(jax.value_and_grad(chain(f), (0, 1)))  # a fresh jit each time: no cache
            # A full collection first: otherwise one candidate can meet the collector's oldest generation in
            # every repeat (its cost then dominates: 1.5x to 1.8x for a copy of custom_vjp in early runs).
            gc.collect()
            t0 = time.thread_time()  # this thread's CPU time: other processes' load barely changes it
            fn.trace(x, w).lower()
            lower_ms[k].append((time.thread_time() - t0) * 1e3)
    # The ratio: median over repeats of each candidate's time over custom_vjp (A)'s in the same repeat.
    lower_ratio = {k: statistics.median(a / b for a, b in zip(v, lower_ms["custom_vjp jit (A)"], strict=True))
                   for k, v in lower_ms.items()}
    lower_ms = {k: statistics.median(v) for k, v in lower_ms.items()}
    return call_us, grad_us, lower_ms, lower_ratio


def report(make, label, with_speed, json_path):
    """Runs every check (and, ``with_speed``, the timings) on ``make``'s Functions; prints them, and writes JSON."""
    rows = run_checks(make)
    print(f"\n{'check':38s} | {'TanhLinear (' + label + ')':60s} | OpaqueTanhLinear (own rules only)")
    for name, a, b in rows:
        if a == "n/a":
            print(f"{name:38s} | {b}")
            continue
        print(f"{name:38s} | {a[0][:60]:60s} | {b[0][:70]}")
    print("\ncounts (TanhLinear): forward/jvp/backward/batch rule runs, needs_input_grad seen by backward")
    for name, a, _ in rows:
        if a != "n/a":
            print(f"  {name:38s} {a[1]} {a[2] if a[2] else ''}")
    nig, once = needs_input_grad_checks(make)
    print("\njit program differentiated wrt x, w, both, x (jax#16614 shape):")
    for argnums, log, nb, ok in nig:
        print(f"  argnums={argnums}: needs_input_grad seen={log} backward runs={nb} correct={ok}")
    print(f"eager grad of F(F(x,w),w): counts {once} (2 calls -> expect 2 backward)")
    bo = backward_only_checks(make)
    print("\nBackwardOnly (forward+backward, no jvp):")
    for name, note, counts in bo:
        print(f"  {name:40s} {note}  {counts}")
    mine, theirs, differences = optimized_hlo_differences(make)
    print(f"\noptimized HLO of jit(value_and_grad) of a 10-call chain: {mine} instructions, custom_vjp {theirs}; "
          f"opcode counts that differ: {differences or 'none'}")
    out = {"backward_only": bo, "jax": jax.__version__, "rows": [
        (n, a if a == "n/a" else a[0], b if a == "n/a" else b[0]) for n, a, b in rows],
        "needs_input_grad": [(str(a), label, nb, ok) for a, label, nb, ok in nig], "once": once,
        "hlo": {"instructions": mine, "custom_vjp": theirs, "differences": differences}}
    if with_speed:
        call_us, grad_us, lower_ms, lower_ratio = speed(make, label)
        print("\nspeed (CPU; medians of 15 interleaved repeats; trace + lower of jit(value_and_grad) of a 200-call "
              "chain in thread CPU time after a full garbage collection, and its ratio to custom_vjp (A): the "
              "median of per-repeat ratios)")
        header = f"{'candidate':24s} {'eager call us':>14s} {'eager grad us':>14s}"
        print(f"{header} {'trace+lower ms':>15s} {'ratio':>6s}")
        for k in call_us:
            print(f"{k:24s} {call_us[k]:14.1f} {grad_us[k]:14.1f} {lower_ms[k]:15.1f} {lower_ratio[k]:6.2f}")
        out["speed"] = {"call_us": call_us, "grad_us": grad_us, "lower_ms": lower_ms, "lower_ratio": lower_ratio}
    if json_path:
        with open(json_path, "w") as f:
            json.dump(out, f, indent=1, default=str)
    return out
