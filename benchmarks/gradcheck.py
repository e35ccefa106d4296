"""vjpkit.gradcheck against torch.autograd.gradcheck and jax.test_util.check_grads.

    python benchmarks/gradcheck.py [--quick] [--bisection N]
    python benchmarks/gradcheck.py --bisection-only [--bisection N[,N...]]        # 4. only
    python benchmarks/gradcheck.py --breakdown [--quick] [--bisection N[,N...]]
    python benchmarks/gradcheck.py --sweep-sizes [--quick] [--json F.json] [--plot F.png]   # 5.

The PyTorch tutorial's example: LinearFunction on inputs randn(20, 20) and
randn(30, 20) in float64, ``eps=1e-6, atol=1e-4``; a (400 + 600) x 600
Jacobian.

1. Warm calls (compiled programs cached), side by side in one process:
   vjpkit full-Jacobian and fast mode, ``jax.test_util.check_grads(order=1,
   modes=("rev",))`` (one random direction only; its default modes fail on
   a custom_vjp), and, when torch is importable, torch slow and fast mode
   with one thread. Interleaved repeat by repeat in a rotating order;
   speedups are medians of per-repeat ratios, which stay steady when other
   processes load the machine.
2. torch with its default threads, warm, each mode in its own process:
   after a call its idle OpenMP threads keep spinning for a while, which
   would slow down whatever runs next in the same process. Speedups are
   ratios of medians.
3. The first call in a fresh process: each candidate in its own subprocess
   (after imports and input creation), several times; medians. vjpkit's
   first call traces its checking program and compiles it with XLA, as
   ``jax.jit`` compiles user code: the verdict is the compiled program's.
   "persistent cache" rows: the same first call in a process whose JAX
   persistent compilation cache (``JAX_COMPILATION_CACHE_DIR``) already
   holds the program, from an earlier process: what a test suite run again
   pays.
4. A Python loop in ``fn``: entmax's bisection (``--bisection N[,N...]``,
   default 10, 50 and 200 steps, one table each, then the first calls against
   the length) in plain ``jnp`` on a 3x5 float64 input, against the same loop
   in torch checked by ``torch.autograd.gradcheck`` (1 thread), each in a
   fresh subprocess. The check fails for both (differentiating through a
   bisection is not its derivative); what is timed is the work of checking
   and reporting. Columns: the first call (vjpkit: tracing the loop, unrolled
   into thousands of equations that repeat a few dozen kernels, and running
   it op by op, each distinct kernel compiled once, on a pool of threads as
   many as the machine's cores) and a warm call (still op by op:
   the whole program is compiled only once op by op has cost as much); for
   vjpkit also the first call with the persistent compilation cache filled
   by an earlier process.

``--breakdown``: where the bisection's first call goes (each length in a
fresh process, under cProfile, which sees the calling thread only): tracing,
lowering, XLA's compiling as far as the calling thread waits for it (the
kernels' compiles on the pool overlap with lowering and running), and the
rest.

Targets: warm full gradcheck >= 50x faster than torch slow mode; fast_mode
no slower than torch's; the bisection's first call within 2x torch's, and
growing no faster than linearly with the loop's length.

Why torch with one thread too: on 20x30 matrices its intra-op threads only
add synchronization, and when other processes load the machine its default
threads made slow mode up to 10x slower here. One thread is its fastest and
steadiest setting, so it is the conservative comparison. JAX runs with its
defaults throughout.
"""

import argparse
import os
import platform
import subprocess
import sys
import tempfile
import time

import numpy as np
from _timing import Candidate, median, no_wait, paired_ratio, print_table, time_interleaved

EPS, ATOL = 1e-6, 1e-4
FIRST_CALL = ("vjpkit", "vjpkit fast_mode", "torch slow", "torch slow, 1 thread",
              "torch fast_mode, 1 thread")
TORCH_DEFAULT_THREADS = ("torch slow", "torch fast_mode")
BISECTION = ("vjpkit", "torch, 1 thread")


def entmax_bisect(X, n_iter, where, clip, keep):
    """entmax 1.5 by bisection, written once for jnp and torch.

    ``where``: jnp.where or torch.where; ``clip``: x -> max(x, 0); ``keep``: the
    keep-dimensions keyword of ``sum`` (``{"keepdims": True}`` or ``{"keepdim": True}``).
    """
    alpha, d = 1.5, X.shape[-1]
    X = X * (alpha - 1)
    max_val = X.max(-1, **keep)
    if not hasattr(max_val, "shape"):  # torch's max along a dimension returns (values, indices)
        max_val = max_val[0]
    tau_lo = max_val - 1.0
    tau_hi = max_val - (1.0 / d) ** (alpha - 1)
    f_lo = (clip(X - tau_lo) ** (1 / (alpha - 1))).sum(-1, **keep) - 1
    dm = tau_hi - tau_lo
    for _ in range(n_iter):
        dm = dm / 2
        tau_m = tau_lo + dm
        p_m = clip(X - tau_m) ** (1 / (alpha - 1))
        f_m = p_m.sum(-1, **keep) - 1
        mask = f_m * f_lo >= 0
        tau_lo = where(mask, tau_m, tau_lo)
    return p_m / p_m.sum(-1, **keep)


def bisection_checker(kind, n_iter):
    """A no-argument call running one gradient check of the n_iter-step bisection; kinds as in BISECTION."""
    x = np.random.default_rng(0).standard_normal((3, 5))
    if kind == "vjpkit":
        import jax.numpy as jnp

        import vjpkit

        def f(X):
            return entmax_bisect(X, n_iter, jnp.where, lambda v: jnp.clip(v, 0), {"keepdims": True})

        return lambda: vjpkit.gradcheck(f, (x,), raise_exception=False)
    import torch

    torch.set_num_threads(1)
    tx = torch.tensor(x, requires_grad=True)

    def g(X):
        return entmax_bisect(X, n_iter, torch.where, lambda v: v.clamp(min=0), {"keepdim": True})

    return lambda: torch.autograd.gradcheck(g, (tx,), raise_exception=False)


def tutorial_inputs():
    rng = np.random.default_rng(0)
    return rng.standard_normal((20, 20)), rng.standard_normal((30, 20))


def vjpkit_linear():
    import vjpkit

    class LinearFunction(vjpkit.Function):
        @staticmethod
        def forward(ctx, input, weight, bias=None):
            ctx.save_for_backward(input, weight, bias)
            output = input @ weight.T
            if bias is not None:
                output = output + bias
            return output

        @staticmethod
        def backward(ctx, grad_output):
            input, weight, bias = ctx.saved_tensors
            grad_input = grad_weight = grad_bias = None
            if ctx.needs_input_grad[0]:
                grad_input = grad_output @ weight
            if ctx.needs_input_grad[1]:
                grad_weight = grad_output.T @ input
            if bias is not None and ctx.needs_input_grad[2]:
                grad_bias = grad_output.sum(0)
            return grad_input, grad_weight, grad_bias

    return LinearFunction


def torch_linear():
    import torch

    class LinearFunction(torch.autograd.Function):
        @staticmethod
        def forward(ctx, input, weight, bias=None):
            ctx.save_for_backward(input, weight, bias)
            output = input.mm(weight.t())
            if bias is not None:
                output += bias.unsqueeze(0).expand_as(output)
            return output

        @staticmethod
        def backward(ctx, grad_output):
            input, weight, bias = ctx.saved_tensors
            grad_input = grad_weight = grad_bias = None
            if ctx.needs_input_grad[0]:
                grad_input = grad_output.mm(weight)
            if ctx.needs_input_grad[1]:
                grad_weight = grad_output.t().mm(input)
            if bias is not None and ctx.needs_input_grad[2]:
                grad_bias = grad_output.sum(0)
            return grad_input, grad_weight, grad_bias

    return LinearFunction


def checker(kind):
    """A no-argument call running one checker on the tutorial example; kinds as in FIRST_CALL."""
    x, w = tutorial_inputs()
    fast = "fast_mode" in kind
    if kind.startswith("vjpkit"):
        import vjpkit

        linear = vjpkit_linear()
        return lambda: vjpkit.gradcheck(linear.apply, (x, w), eps=EPS, atol=ATOL, fast_mode=fast)
    import torch

    if kind.endswith("1 thread"):
        torch.set_num_threads(1)
    tlinear = torch_linear()
    tx, tw = (torch.tensor(a, requires_grad=True) for a in (x, w))
    return lambda: torch.autograd.gradcheck(tlinear.apply, (tx, tw), eps=EPS, atol=ATOL, fast_mode=fast)


def check_grads_call():
    import jax
    from jax.test_util import check_grads

    x, w = tutorial_inputs()
    linear = vjpkit_linear()

    def call():
        with jax.enable_x64(True):  # float64, as the others
            check_grads(linear.apply, (x, w), order=1, modes=("rev",), eps=EPS, atol=ATOL)

    return call


def in_subprocess(flag, kind, runs, env=None):
    """Runs this script with ``flag kind`` ``runs`` times; the last number each printed."""
    out = []
    for _ in range(runs):
        result = subprocess.run([sys.executable, __file__, flag, kind],
                                capture_output=True, text=True, check=True, env=env or os.environ)
        out.append(float(result.stdout.split()[-1]))
    return out


def persistent_cache_env(directory):
    """The environment of a process whose JAX keeps every compiled program in ``directory``."""
    return dict(os.environ, JAX_COMPILATION_CACHE_DIR=directory,
                JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0", JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")


def with_persistent_cache(flag, kind, runs, extra=()):
    """First calls in fresh processes sharing a persistent cache that one earlier process filled."""
    with tempfile.TemporaryDirectory() as directory:
        env = persistent_cache_env(directory)
        subprocess.run([sys.executable, __file__, flag, kind, *extra], capture_output=True, check=True, env=env)
        out = []
        for _ in range(runs):
            result = subprocess.run([sys.executable, __file__, flag, kind, *extra],
                                    capture_output=True, text=True, check=True, env=env)
            out.append([float(v) for v in result.stdout.split()])
        return out


def table(title, rows, extra=None):
    """Median and minimum ms per call of each ``(name, seconds per call)``; ``extra``: (header, name -> value)."""
    header = ["checker", "median ms", "min ms", *([extra[0]] if extra else [])]
    print_table(title, header, [(name, f"{median(s) * 1e3:.3f}", f"{min(s) * 1e3:.3f}",
                                 *([f"{extra[1](name):.1f}"] if extra else [])) for name, s in rows])


def verdict(label, ratio, target):
    print(f"{label}: {ratio:.1f}x (target >= {target}x: {'met' if ratio >= target else 'NOT met'})")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats, for a smoke run")
    parser.add_argument("--first-call", choices=FIRST_CALL, help=argparse.SUPPRESS)
    parser.add_argument("--warm", choices=TORCH_DEFAULT_THREADS, help=argparse.SUPPRESS)
    parser.add_argument("--bisection", default="10,50,200", metavar="N[,N...]",
                        help="steps of the bisection case (4.), one table per length")
    parser.add_argument("--bisection-only", action="store_true", help="run only the bisection case (4.)")
    parser.add_argument("--breakdown", action="store_true",
                        help="where the first call's time goes, for each bisection length (each in a fresh process)")
    parser.add_argument("--breakdown-call", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--bisection-call", choices=BISECTION, help=argparse.SUPPRESS)
    args = parser.parse_args()
    repeat, runs = (5, 2) if args.quick else (31, 7)
    if args.first_call:
        call = checker(args.first_call)
        start = time.perf_counter()
        call()
        return print(time.perf_counter() - start)
    if args.breakdown_call is not None:
        return print(*first_call_breakdown(args.breakdown_call))
    if args.breakdown:
        return breakdown_table([int(n) for n in args.bisection.split(",")], 1 if args.quick else 3)
    if args.bisection_call:
        return print(*bisection_calls(bisection_checker(args.bisection_call, int(args.bisection))))
    if args.warm:
        call = checker(args.warm)
        number = 1 if "slow" in args.warm else 100
        samples = time_interleaved([Candidate(args.warm, call, no_wait, number)], repeat=repeat, warmup=2)
        return print(median(samples[args.warm]))

    import jax

    try:
        import torch
    except ImportError:  # torch is only a comparison, never a dependency
        torch = None
    print(f"jax {jax.__version__} on {jax.devices()[0].platform}, python {platform.python_version()}, "
          f"{os.cpu_count()} cpus" + (f", torch {torch.__version__}" if torch else ", torch not installed"))
    if args.bisection_only:
        return bisections(args, torch)
    print("LinearFunction, inputs randn(20, 20), randn(30, 20) float64, eps=1e-6, atol=1e-4")

    full, fast = "vjpkit gradcheck (full Jacobian)", "vjpkit gradcheck fast_mode"
    # Every checker returns only when its check is done: nothing to wait for.
    cands = [Candidate(full, checker("vjpkit"), no_wait, 10),
             Candidate(fast, checker("vjpkit fast_mode"), no_wait, 100),
             Candidate("jax check_grads (one direction)", check_grads_call(), no_wait, 10)]
    if torch:
        cands += [Candidate("torch gradcheck (slow mode), 1 thread", checker("torch slow, 1 thread"), no_wait, 1),
                  Candidate("torch gradcheck fast_mode, 1 thread", checker("torch fast_mode, 1 thread"), no_wait, 100)]
    samples = time_interleaved(cands, repeat=repeat, warmup=2)
    table(f"Warm calls in one process, {repeat} repeats", samples.items(),
          ("vjpkit full is x faster", lambda name: paired_ratio(samples, name, full)))

    kinds = [k for k in FIRST_CALL if torch or k.startswith("vjpkit")]
    if torch:
        warm_default = {k: [in_subprocess("--warm", k, 1)[0]] for k in TORCH_DEFAULT_THREADS}
        table("torch with its default threads, warm, each in its own process (median of repeats)",
              [(f"torch gradcheck ({k}), default threads", v) for k, v in warm_default.items()])
    first = {k: in_subprocess("--first-call", k, runs) for k in kinds}
    for k in ("vjpkit", "vjpkit fast_mode"):
        first[f"{k}, persistent cache"] = [r[-1] for r in with_persistent_cache("--first-call", k, runs)]
    table(f"First call in a fresh process (compilation included), {runs} processes", first.items())

    bisections(args, torch)

    if torch:
        print()
        verdict("warm full vs torch slow mode, 1 thread (paired)",
                paired_ratio(samples, "torch gradcheck (slow mode), 1 thread", full), 50)
        verdict("warm full vs torch slow mode, default threads",
                warm_default["torch slow"][0] / median(samples[full]), 50)
        for torch_kind in ("torch slow", "torch slow, 1 thread"):
            for mine in ("vjpkit", "vjpkit, persistent cache"):
                verdict(f"first call ({mine}) vs {torch_kind}'s first call",
                        median(first[torch_kind]) / median(first[mine]), 1)
        verdict("warm fast_mode vs torch fast_mode, 1 thread (paired)",
                paired_ratio(samples, "torch gradcheck fast_mode, 1 thread", fast), 1)
        verdict("warm fast_mode vs torch fast_mode, default threads",
                warm_default["torch fast_mode"][0] / median(samples[fast]), 1)


def bisections(args, torch):
    """4. for each length, then the first calls against the length."""
    lengths = [int(n) for n in args.bisection.split(",")]
    rows = [bisection_table(n, 1 if args.quick else 3, torch is not None) for n in lengths]
    print_table("The bisection's first call against its length (medians, s)", ["steps", *rows[0].keys()],
                [(n, *(f"{v:.2f}" for v in row.values())) for n, row in zip(lengths, rows, strict=True)])


# Where a first call's time goes: functions whose cumulative time (on the calling thread) is one
# phase. Compiling is XLA's: the whole program's, or, op by op, the kernels' compiles on a pool of
# threads, of which the calling thread's waits for them count (the rest overlaps with lowering and
# running); lowering is JAX's StableHLO emission.
PHASES = {
    "trace": ("make_jaxpr_f", "make_jaxpr"),
    "lower": ("lower_jaxpr_to_module",),
    "XLA compile (waited for)": ("backend_compile_and_load", "backend_compile", "Future.result"),
}


def _phase_seconds(stats, names):
    """The outermost call's cumulative time among ``names`` (a recursive phase counted once); waits
    for a thread's result (``Future.result``, a phase of its own where named) are added to it."""
    waits = sum(v[3] for (file, _, name), v in stats.items()
                if "Future.result" in names and name == "result" and file.endswith("_base.py"))
    return max((v[3] for k, v in stats.items() if k[2] in names), default=0.0) + waits


def first_call_breakdown(n_iter):
    """Seconds of one first call of the bisection check: total, then each of PHASES, then the rest."""
    import cProfile
    import pstats

    call = bisection_checker("vjpkit", n_iter)
    profile = cProfile.Profile()
    start = time.perf_counter()
    profile.runcall(call)
    total = time.perf_counter() - start
    stats = pstats.Stats(profile).stats  # (file, line, name) -> (calls, primitive calls, tottime, cumtime, callers)
    phases = []
    for names in PHASES.values():
        phases.append(_phase_seconds(stats, names))
    return (total, *phases, total - sum(phases))


def breakdown_table(lengths, runs):
    rows = []
    for n in lengths:
        samples = [[float(v) for v in subprocess.run(
            [sys.executable, __file__, "--breakdown-call", str(n)], capture_output=True, text=True, check=True,
            env=os.environ).stdout.split()[-len(PHASES) - 2:]] for _ in range(runs)]
        rows.append((n, *(f"{median(column):.2f}" for column in zip(*samples, strict=True))))
    print_table(f"Where the bisection's first call goes (s, under cProfile; medians of {runs} processes)",
                ["steps", "total", *PHASES, "running and the rest"], rows)


def bisection_calls(call):
    """Seconds of the first call and of a warm call. Printed by the subprocess of each run."""
    start = time.perf_counter()
    call()
    first = time.perf_counter() - start
    warm = median(time_interleaved([Candidate("warm", call, no_wait)], repeat=5, warmup=0)["warm"])
    return first, warm


def bisection_table(n_iter, runs, with_torch):
    """4.: first and warm calls of each checker, each run in its own fresh process."""
    kinds = [k for k in BISECTION if with_torch or k == "vjpkit"]
    results = {}
    for kind in kinds:
        for _ in range(runs):
            out = subprocess.run([sys.executable, __file__, "--bisection-call", kind, "--bisection", str(n_iter)],
                                 capture_output=True, text=True, check=True, env=os.environ)
            results.setdefault(kind, []).append([float(v) for v in out.stdout.split()[-2:]])
    results["vjpkit, persistent cache"] = with_persistent_cache(
        "--bisection-call", "vjpkit", runs, ("--bisection", str(n_iter)))
    rows = []
    for kind, runs_of_kind in results.items():
        first, warm = (median(column) for column in zip(*runs_of_kind, strict=True))
        rows.append((kind, f"{first:.2f}", f"{warm * 1e3:.1f}"))
    print_table(f"entmax bisection, {n_iter} steps, 3x5 float64, gradcheck of the loop itself "
                f"(each in a fresh process, {runs} processes; medians)",
                ["checker", "first call s", "warm call ms"], rows)
    if with_torch:
        torch_first = median([r[0] for r in results[BISECTION[1]]])
        for mine in ("vjpkit", "vjpkit, persistent cache"):
            ratio = median([r[0] for r in results[mine]]) / torch_first
            print(f"bisection, {n_iter} steps, first call ({mine}) / torch's, 1 thread: {ratio:.2f}x "
                  f"(target <= 2x: {'met' if ratio <= 2 else 'NOT met'})")
    return {kind: median([r[0] for r in runs_of_kind]) for kind, runs_of_kind in results.items()}


# --- 5. --sweep-sizes: warm checks of LinearFunction scaled up and down, against the Jacobian's size.
SWEEP_SIZES = (4, 8, 14, 20, 28, 40)  # x (n, n), w (3n/2, n); n = 20 is the tutorial's example
SWEEP = ("vjpkit", "vjpkit fast_mode", "torch slow, 1 thread", "torch fast_mode, 1 thread")


def sweep_checker(kind, n):
    """``checker(kind)`` on inputs randn(n, n), randn(3n/2, n)."""
    rng = np.random.default_rng(0)
    x, w = rng.standard_normal((n, n)), rng.standard_normal((3 * n // 2, n))
    fast = "fast_mode" in kind
    if kind.startswith("vjpkit"):
        import vjpkit

        linear = vjpkit_linear()
        return lambda: vjpkit.gradcheck(linear.apply, (x, w), eps=EPS, atol=ATOL, fast_mode=fast)
    import torch

    torch.set_num_threads(1)
    tlinear = torch_linear()
    tx, tw = (torch.tensor(a, requires_grad=True) for a in (x, w))
    return lambda: torch.autograd.gradcheck(tlinear.apply, (tx, tw), eps=EPS, atol=ATOL, fast_mode=fast)


def sweep_sizes():
    """Warm calls of every checker at each size, interleaved per size; --json and --plot (benchmarks/_plots.py)."""
    parser = argparse.ArgumentParser(description="5. gradcheck time against the Jacobian's size")
    parser.add_argument("--sweep-sizes", action="store_true", required=True)
    parser.add_argument("--quick", action="store_true", help="fewer repeats")
    parser.add_argument("--sizes", type=int, nargs="+", default=list(SWEEP_SIZES), metavar="N")
    parser.add_argument("--json", metavar="PATH")
    parser.add_argument("--plot", metavar="PATH.png")
    args = parser.parse_args()
    load_before = os.getloadavg()[0]
    import _plots
    import torch

    repeat = 3 if args.quick else 7
    records = []
    for n in args.sizes:
        m = 3 * n // 2
        cands = [Candidate(k, sweep_checker(k, n), no_wait, 10 if "fast" in k else 1) for k in SWEEP]
        samples = time_interleaved(cands, repeat=repeat, warmup=1)
        elements = (n * n + m * n) * n * m
        records.append({"n": n, "shapes": f"x {n}×{n}, w {m}×{n}", "jacobian_elements": elements, "ms": {
            k: {"median": median(v) * 1e3, "min": min(v) * 1e3, "max": max(v) * 1e3} for k, v in samples.items()},
            "torch_over_vjpkit": {"slow mode": paired_ratio(samples, SWEEP[2], SWEEP[0]),
                                  "fast_mode": paired_ratio(samples, SWEEP[3], SWEEP[1])}})
        print_table(f"n = {n}: Jacobian ({n * n} + {m * n}) x {n * m} = {elements:,} elements, warm, {repeat} repeats",
                    ["checker", "median ms", "min ms"],
                    [(k, f"{median(v) * 1e3:.2f}", f"{min(v) * 1e3:.2f}") for k, v in samples.items()])
    figures = {"checkers": list(SWEEP), "sizes": records, "torch": torch.__version__, "repeats": repeat}
    if args.json:
        _plots.write_json(args.json, figures, load_before)
    if args.plot:
        _plots.gradcheck_plot({"environment": _plots.environment(load_before), **figures}, args.plot)


if __name__ == "__main__":
    sweep_sizes() if "--sweep-sizes" in sys.argv else main()
