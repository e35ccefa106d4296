"""Tracing a model of many Functions costs what tracing hand-written `jax.custom_vjp` costs.

    python benchmarks/trace.py [--quick] [--calls 10 200 1000] [--trace-only] [--json F.json] [--plot F.png]

A chain of small layers, alternately `Linear` (`h @ w`) and `Tanh`, with
10, 200 and 1,000 Function calls, built twice: from vjpkit Functions, and
from hand-written `jax.custom_vjp` with the same forward, residuals and
backward. For each size:

- trace + lower of `jax.jit(jax.value_and_grad(loss)).lower(params, x)`, a
  fresh `jax.jit` every time (so nothing is reused from JAX's trace cache;
  vjpkit's per-class caches are warm, as in any process after the first
  trace). Interleaved repeats in one process, timed by the CPU time of
  the tracing thread (tracing and lowering run in it alone; other
  processes' load, which stretches wall time by whole scheduler slices,
  barely changes it; Python's garbage collections count where they fall,
  as for a user: a full collection before each sample would favour
  whichever model ends just under the collector's threshold);
  medians; the ratio is the median of per-repeat ratios, with an A/A row (a
  second, separately built copy of the hand-written model). Target:
  vjpkit / hand-written <= 1.05.
- compile time of the lowered program (`Lowered.compile()`), interleaved the
  same way with fewer repeats: same program, so target equal.
- whether the optimized HLO is the same: instruction count, opcode counts,
  and the text with source-location metadata removed;
- the equations of the traced program (jaxpr of ``value_and_grad``): vjpkit
  adds one per call, the tie that makes outputs differentiate by the
  Function's own rules at higher order (it lowers to nothing).

Then a deep model of one Function: 200 layers of ``LinearFunction.apply(h, w)``
(README's ``LinearFunction``, bias left at its ``None`` default) against the
same layers as a hand-written ``jax.custom_vjp``: trace + lower medians, the
ratio, the jaxpr equations, and the Python function calls of one trace +
lower (a count the machine's load does not change).
"""

import argparse
import cProfile
import os
import platform
import pstats
import time

import jax
import jax.numpy as jnp
from _timing import Candidate, median, no_wait, paired_ratio, print_table, time_interleaved
from jit_parity import hlo_instructions, hlo_opcodes

import vjpkit

WIDTH, BATCH = 8, 4


class Linear(vjpkit.Function):
    @staticmethod
    def forward(ctx, h, w):
        ctx.save_for_backward(h, w)
        return h @ w

    @staticmethod
    def backward(ctx, g):
        h, w = ctx.saved_tensors
        return g @ w.T, h.T @ g


class Tanh(vjpkit.Function):
    @staticmethod
    def forward(ctx, h):
        y = jnp.tanh(h)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, g):
        (y,) = ctx.saved_tensors
        return g * (1 - y * y)


class LinearFunction(vjpkit.Function):
    """README's LinearFunction."""

    @staticmethod
    def forward(ctx, x, w, b=None):
        ctx.save_for_backward(x, w, b)
        y = x @ w.T
        return y if b is None else y + b

    @staticmethod
    def backward(ctx, g):
        x, w, b = ctx.saved_tensors
        gx = g @ w if ctx.needs_input_grad[0] else None
        gw = g.T @ x if ctx.needs_input_grad[1] else None
        gb = g.sum(0) if b is not None and ctx.needs_input_grad[2] else None
        return gx, gw, gb


def hand_written_linear():
    """LinearFunction without bias as a hand-written custom_vjp."""

    @jax.custom_vjp
    def linear(x, w):
        return x @ w.T

    def linear_fwd(x, w):
        return x @ w.T, (x, w)

    def linear_bwd(res, g):
        x, w = res
        return g @ w, g.T @ x

    linear.defvjp(linear_fwd, linear_bwd)
    return linear


def make_deep_loss(linear):
    def loss(params, x):
        h = x
        for w in params:
            h = linear(h, w)
        return h.sum()

    return loss


def python_calls(fn):
    """Python function calls made by ``fn()``: the tracing work, whatever the machine's load."""
    profile = cProfile.Profile()
    profile.enable()
    fn()
    profile.disable()
    return pstats.Stats(profile).total_calls


def deep_model(layers, repeat):
    """Trace + lower of 200 (``layers``) LinearFunction.apply calls vs the hand-written custom_vjp."""
    keys = jax.random.split(jax.random.key(1), layers + 1)
    params = [jax.random.normal(k, (WIDTH, WIDTH)) / WIDTH**0.5 for k in keys[1:]]
    x = jax.random.normal(keys[0], (BATCH, WIDTH))
    losses = dict(zip(MODELS, [make_deep_loss(hand_written_linear()), make_deep_loss(LinearFunction.apply),
                               make_deep_loss(hand_written_linear())], strict=True))
    cands = [Candidate(name, lambda loss=loss: lower(loss, params, x), no_wait, 1) for name, loss in losses.items()]
    samples = time_interleaved(cands, repeat=repeat, warmup=1, clock=time.thread_time)
    calls = {m: python_calls(lambda m=m: lower(losses[m], params, x)) for m in MODELS[:2]}
    eqns = {m: len(jax.make_jaxpr(jax.value_and_grad(losses[m]))(params, x).jaxpr.eqns) for m in MODELS[:2]}
    row = (f"{layers}", f"{median(samples[MODELS[1]]) * 1e3:.1f}", f"{median(samples[MODELS[0]]) * 1e3:.1f}",
           f"{paired_ratio(samples, MODELS[1], MODELS[0]):.3f}", f"{paired_ratio(samples, MODELS[2], MODELS[0]):.3f}",
           f"{eqns[MODELS[1]]} / {eqns[MODELS[0]]}", f"{calls[MODELS[1]] / calls[MODELS[0]]:.3f}")
    print_table(f"{layers} layers of LinearFunction.apply(h, w) vs hand-written custom_vjp: trace + lower, "
                "thread CPU time (medians; ratio: median of per-repeat ratios)",
                ["layers", "vjpkit ms", "hand-written ms", "ratio", "A/A ratio", "jaxpr equations",
                 "Python calls ratio"], [row])
    return float(row[3])


def hand_written():
    """The same two layers as hand-written custom_vjp (a new pair on each call: the A/A copy is its own)."""

    @jax.custom_vjp
    def linear(h, w):
        return h @ w

    def linear_fwd(h, w):
        return h @ w, (h, w)

    def linear_bwd(res, g):
        h, w = res
        return g @ w.T, h.T @ g

    linear.defvjp(linear_fwd, linear_bwd)

    @jax.custom_vjp
    def tanh(h):
        return jnp.tanh(h)

    def tanh_fwd(h):
        y = jnp.tanh(h)
        return y, y

    def tanh_bwd(y, g):
        return (g * (1 - y * y),)

    tanh.defvjp(tanh_fwd, tanh_bwd)
    return linear, tanh


def make_loss(linear, tanh):
    def loss(params, x):
        h = x
        for w in params:
            h = tanh(linear(h, w))
        return h.sum()

    return loss


def inputs(n_calls):
    keys = jax.random.split(jax.random.key(0), n_calls // 2 + 1)
    params = [jax.random.normal(k, (WIDTH, WIDTH)) / WIDTH**0.5 for k in keys[1:]]
    return params, jax.random.normal(keys[0], (BATCH, WIDTH))


def lower(loss, params, x):
    """Trace and lower, with a fresh jit (so JAX's trace cache never answers)."""
    return jax.jit(jax.value_and_grad(loss)).lower(params, x)


MODELS = ("hand-written custom_vjp", "vjpkit", "hand-written, second copy (A/A)")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats, for a smoke run")
    parser.add_argument("--calls", type=int, nargs="+", default=[10, 200, 1000], help="Function calls per model")
    parser.add_argument("--layers", type=int, default=200, help="layers of the deep LinearFunction model")
    parser.add_argument("--trace-only", action="store_true", help="only trace + lower of the chain (no compile, "
                        "HLO or deep model): the ratio against chain length, sooner")
    parser.add_argument("--repeat", type=int, help="repeats of trace + lower (default 21, --quick 5)")
    parser.add_argument("--json", metavar="PATH", help="write the trace + lower figures there")
    parser.add_argument("--plot", metavar="PATH.png", help="plot the ratio against chain length there")
    args = parser.parse_args()
    load_before = os.getloadavg()[0]
    repeat, compile_repeat = (5, 2) if args.quick else (21, 5)
    repeat = args.repeat or repeat
    print(f"jax {jax.__version__} on {jax.devices()[0].platform}, python {platform.python_version()}")
    print(f"Linear/Tanh chain, batch {BATCH}, width {WIDTH}, float32; {repeat} repeats of trace+lower, "
          f"{compile_repeat} of compile")

    trace_rows, compile_rows, hlo_rows, jaxpr_rows, records = [], [], [], [], []
    for n_calls in args.calls:
        params, x = inputs(n_calls)
        losses = dict(zip(MODELS, [make_loss(*hand_written()), make_loss(Linear.apply, Tanh.apply),
                                   make_loss(*hand_written())], strict=True))
        cands = [Candidate(name, lambda loss=loss, params=params, x=x: lower(loss, params, x), no_wait, 1)
                 for name, loss in losses.items()]
        samples = time_interleaved(cands, repeat=repeat, warmup=1, clock=time.thread_time)
        base, ours = samples[MODELS[0]], samples[MODELS[1]]
        trace_rows.append((f"{n_calls}", f"{median(ours) * 1e3:.1f}", f"{median(base) * 1e3:.1f}",
                           f"{paired_ratio(samples, MODELS[1], MODELS[0]):.3f}",
                           f"{paired_ratio(samples, MODELS[2], MODELS[0]):.3f}"))
        records.append({"calls": n_calls, "vjpkit_ms": median(ours) * 1e3, "hand_written_ms": median(base) * 1e3,
                        "ratio": paired_ratio(samples, MODELS[1], MODELS[0]),
                        "aa_ratio": paired_ratio(samples, MODELS[2], MODELS[0]), "repeats": repeat})
        if args.trace_only:
            continue

        # A Lowered keeps its executable after compile(): every timed compile gets its own lowering.
        pending = {name: [lower(loss, params, x) for _ in range(compile_repeat)] for name, loss in losses.items()}
        lowered = {name: lower(loss, params, x) for name, loss in losses.items()}
        cands = [Candidate(name, lambda todo=pending[name]: todo.pop().compile(), no_wait, 1) for name in MODELS]
        samples = time_interleaved(cands, repeat=compile_repeat, warmup=0)
        compile_rows.append((f"{n_calls}", f"{median(samples[MODELS[1]]) * 1e3:.0f}",
                             f"{median(samples[MODELS[0]]) * 1e3:.0f}",
                             f"{paired_ratio(samples, MODELS[1], MODELS[0]):.3f}",
                             f"{paired_ratio(samples, MODELS[2], MODELS[0]):.3f}"))

        theirs, ours = (hlo_instructions(lowered[m].compile().as_text()) for m in MODELS[:2])
        hlo_rows.append((f"{n_calls}", f"{len(ours)}", f"{len(theirs)}",
                         "yes" if hlo_opcodes(ours) == hlo_opcodes(theirs) else "NO",
                         "yes" if ours == theirs else "no"))
        theirs, ours = (len(jax.make_jaxpr(jax.value_and_grad(losses[m]))(params, x).jaxpr.eqns) for m in MODELS[:2])
        jaxpr_rows.append((f"{n_calls}", f"{ours}", f"{theirs}", f"{(ours - theirs) / n_calls:.2f}"))

    header = ["Function calls", "vjpkit ms", "hand-written ms", "ratio", "A/A ratio"]
    print_table("trace + lower of jax.jit(jax.value_and_grad(loss)), thread CPU time (medians; ratio: median of "
                "per-repeat ratios)",
                header, trace_rows)
    if args.trace_only:
        return save(args, records, load_before)
    print_table("compile of the lowered program", header, compile_rows)
    print_table("optimized HLO", ["Function calls", "vjpkit instructions", "hand-written instructions",
                                  "same opcodes", "same text (metadata removed)"], hlo_rows)
    # vjpkit's one extra equation per call is the tie (outputs differentiate by the Function's own
    # rules at higher order); it lowers to nothing, but JAX traces and lowers it as any equation.
    print_table("traced program (jaxpr of value_and_grad)", ["Function calls", "vjpkit equations",
                                                             "hand-written equations", "extra per call"], jaxpr_rows)
    deep = deep_model(args.layers, repeat)
    worst = max([deep, *(float(row[3]) for row in trace_rows)])
    print(f"\nworst trace+lower ratio: {worst:.3f} (target <= 1.05: {'met' if worst <= 1.05 else 'NOT met'})")
    save(args, records, load_before)


def save(args, records, load_before):
    """--json and --plot: the chain's trace + lower figures (benchmarks/_plots.py)."""
    import _plots

    figures = {"chain": records, "width": WIDTH, "batch": BATCH, "clock": "thread CPU time"}
    if args.json:
        _plots.write_json(args.json, figures, load_before)
    if args.plot:
        _plots.trace_plot([{"environment": _plots.environment(load_before), **figures}], args.plot)


if __name__ == "__main__":
    main()
