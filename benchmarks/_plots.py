"""The benchmarks' figures as JSON, and as plots for the docs.

A script given ``--json PATH`` writes what it measured there, with `environment`
(machine, load, versions) beside it; ``--plot PATH.png`` draws it. The plots of
``docs/img/`` are redrawn from the JSONs of ``benchmarks/results/`` with

    python benchmarks/_plots.py            # every figure the JSONs there allow

matplotlib (the ``examples`` extra) is imported only when a plot is drawn, on
its Agg backend (no display), so writing JSON needs only the benchmark's own
imports.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
IMAGES = ROOT / "docs" / "img"
NOT_MEASURED = "GPU: not measured yet"


def cpu_model() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    found = re.search(r"^model name\s*:\s*(.+)$", text, re.MULTILINE)
    return found.group(1).strip() if found else platform.machine()


def environment(load_before: float) -> dict[str, Any]:
    """Where a run's figures came from: machine, load before and after, versions, the command."""
    import jax

    device = jax.devices()[0]
    return {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M"),
        "cpu": cpu_model(), "cpu_count": os.cpu_count(),
        "device": f"{device.platform} ({device.device_kind})",
        "load_average": [round(load_before, 1), round(os.getloadavg()[0], 1)],
        "jax": jax.__version__, "python": platform.python_version(),
        "command": " ".join(["python", *(Path(a).name if i == 0 else a for i, a in enumerate(sys.argv))]),
    }


def write_json(path: str | os.PathLike, figures: dict[str, Any], load_before: float) -> None:
    """``figures`` and `environment` as indented JSON at ``path``."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps({"environment": environment(load_before), **figures}, indent=1) + "\n")
    print(f"figures: {path}")


def load_text(env: dict[str, Any]) -> str:
    """The load average at the start and end of a run: "load average 14–18"."""
    low, high = sorted(env["load_average"])
    return f"load average {low:.0f}–{high:.0f}" if round(low) != round(high) else f"load average {low:.0f}"


def machine_line(env: dict[str, Any]) -> str:
    """One line for a plot: the machine, its load during the run, JAX, the date."""
    return f"{env['cpu_count']}-core {env['cpu']} CPU, {load_text(env)}, JAX {env['jax']}, {env['date_utc']} UTC"


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # The docs show a figure about 700 pixels wide: large type survives the scaling.
    plt.rcParams.update({"font.size": 12, "legend.fontsize": 10, "axes.titlesize": 12})
    return plt


def _ticks(ax: Any, values: list[int]) -> None:
    """Ticks at the measured x values, written out (log axes would print 2×10³)."""
    ax.set_xticks(values, [f"{v:,}" for v in values])
    ax.minorticks_off()


def _save(fig: Any, path: str | os.PathLike) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    fig.savefig(path, dpi=110, bbox_inches="tight")
    _pyplot().close(fig)
    print(f"plot: {path}")


def memory_plot(data: dict[str, Any], path: str | os.PathLike) -> None:
    """Attention residuals and XLA's planned step memory against context (log-log); their ratio against 1/T."""
    plt = _pyplot()
    rows = data["memory"]
    t = [r["context"] for r in rows]
    mib = 2.0**20
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.3))
    left.loglog(t, [r["vjpkit_residual_bytes"] / mib for r in rows], "o-", color="C0",
                label="vjpkit attention residuals / layer")
    left.loglog(t, [r["autodiff_residual_bytes"] / mib for r in rows], "o-", color="C3",
                label="autodiff attention residuals / layer")
    planned = [r for r in rows if r.get("vjpkit_temp_bytes") is not None]
    if planned:
        tp = [r["context"] for r in planned]
        left.loglog(tp, [r["vjpkit_temp_bytes"] / mib for r in planned], "s--", color="C0", alpha=0.6,
                    label="vjpkit whole step, XLA's plan")
        left.loglog(tp, [r["autodiff_temp_bytes"] / mib for r in planned], "s--", color="C3", alpha=0.6,
                    label="autodiff whole step, XLA's plan")
    left.set_xlabel("context length T (tokens)")
    left.set_ylabel("MiB")
    left.set_title("Memory a training step keeps (batch 8)")
    left.set_ylim(top=left.get_ylim()[1] * 60)  # room for the legend above the lines
    left.legend(loc="upper left", fontsize=9)
    ratio = [r["vjpkit_residual_bytes"] / r["autodiff_residual_bytes"] for r in rows]
    right.loglog(t, ratio, "o-", color="C0", label="attention residuals, vjpkit / autodiff")
    # The 1/T line through the first point: what "falls as 1/T" predicts for the others.
    right.loglog(t, [ratio[0] * t[0] / x for x in t], ":", color="gray", label="∝ 1/T")
    if planned:
        right.loglog(tp, [r["vjpkit_temp_bytes"] / r["autodiff_temp_bytes"] for r in planned], "s--",
                     color="C2", alpha=0.7, label="whole step's plan, vjpkit / autodiff")
    right.set_xlabel("context length T (tokens)")
    right.set_ylabel("vjpkit / autodiff")
    right.set_title("Ratio: falls as 1/T")
    right.legend(loc="upper right", fontsize=9)
    for ax in (left, right):
        _ticks(ax, t)
        ax.grid(True, which="both", alpha=0.3)
    fig.suptitle("Character transformer: memory against context (computed by XLA and jax.eval_shape; "
                 "nothing executed)\n" + machine_line(data["environment"]), fontsize=11)
    _save(fig, path)


def _quartiles(values: list[float]) -> tuple[float, float, float]:
    import statistics

    if len(values) < 2:
        return values[0], values[0], values[0]
    q1, q2, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, q2, q3


def throughput_plot(data: dict[str, Any], path: str | os.PathLike, gpu: dict[str, Any] | None = None) -> None:
    """Tokens per second of each candidate and its A/A copy (median, quartiles of steps); GPU beside."""
    plt = _pyplot()
    fig, (cpu_ax, gpu_ax) = plt.subplots(1, 2, figsize=(11, 4.3), gridspec_kw={"width_ratios": [3, 2]})
    steps = data["steps"]
    bases = [r["candidate"] for r in steps if not r["candidate"].endswith(" (A/A)")]
    by_name = {r["candidate"]: r for r in steps}
    tokens = data["tokens_per_step"]
    for i, base in enumerate(bases):
        right_end = 0.0  # where the label goes: past both bars' whiskers
        for k, name in enumerate((base, f"{base} (A/A)")):
            if name not in by_name:
                continue
            per_step = [tokens / (ms / 1e3) for ms in by_name[name]["samples_ms"]]
            q1, q2, q3 = _quartiles(per_step)
            y = i - 0.2 + 0.4 * k
            cpu_ax.barh(y, q2, height=0.38, color=f"C{i}", alpha=1.0 if k == 0 else 0.45,
                        hatch=None if k == 0 else "//")
            cpu_ax.errorbar(q2, y, xerr=[[q2 - q1], [q3 - q2]], color="black", capsize=3, lw=1)
            right_end = max(right_end, q3)
        aa = by_name.get(f"{base} (A/A)", {}).get("aa")
        ratio = by_name[base].get("per_autodiff") if base != "autodiff" else None
        label = f" {by_name[base]['tokens_per_s']:,.0f}/s" + (f", {ratio:.2f}× autodiff's time" if ratio else "") + \
            (f"; A/A {aa:.2f}" if aa else "")
        cpu_ax.text(right_end * 1.02, i, label, va="center", fontsize=10)
    best = max(r["tokens_per_s"] for r in steps)
    cpu_ax.set_xlim(0, best * 2.7)
    cpu_ax.set_yticks(range(len(bases)), bases)
    cpu_ax.invert_yaxis()
    cpu_ax.set_xlabel("tokens per second (bar: median step; whisker: quartiles;\n"
                      "hatched: the A/A copy, the same program timed again)")
    cpu_ax.set_title(f"CPU, context {data['context']}, {tokens} tokens a step, "
                     f"PyTorch on {data['torch_threads']} thread(s)", fontsize=11)
    cpu_ax.grid(True, axis="x", alpha=0.3)
    if gpu is None:
        gpu_ax.text(0.5, 0.5, NOT_MEASURED, ha="center", va="center", fontsize=12, color="gray",
                    transform=gpu_ax.transAxes)
        gpu_ax.set_xticks([])
        gpu_ax.set_yticks([])
        gpu_ax.set_title("GPU")
    else:
        _gpu_panel(gpu_ax, gpu)
    fig.suptitle("Character transformer: one training step, tokens per second\n"
                 + machine_line(data["environment"]) + "; ratios are medians of paired neighbouring steps",
                 fontsize=11)
    _save(fig, path)


def _gpu_panel(ax: Any, gpu: dict[str, Any]) -> None:
    """Tokens per second against context on the GPU (benchmarks/transformer.py --device gpu's JSON)."""
    records = [r for r in gpu["results"] if not r["candidate"].endswith(" (A/A)")]
    for i, (name, dtype) in enumerate(sorted({(r["candidate"], r["dtype"]) for r in records})):
        mine = sorted((r for r in records if (r["candidate"], r["dtype"]) == (name, dtype)),
                      key=lambda r: r["context"])
        x, y = [r["context"] for r in mine], [r["tokens_per_s"] for r in mine]
        ax.loglog(x, y, "o-", color=f"C{i % 10}", label=f"{name}, {dtype}")
        if all(r.get("samples_ms") for r in mine):  # whiskers: quartiles of the steps, as on the CPU panel
            spread = [_quartiles([r["tokens_per_s"] * r["step_ms"] / ms for ms in r["samples_ms"]]) for r in mine]
            ax.errorbar(x, y, yerr=[[v - q[0] for v, q in zip(y, spread, strict=True)],
                                    [q[2] - v for v, q in zip(y, spread, strict=True)]],
                        fmt="none", color=f"C{i % 10}", capsize=2)
    # The preamble's first line: "device: <kind> (<platform>); jax <version>, ...".
    device, *versions = gpu.get("preamble", ["device: GPU"])[0].removeprefix("device: ").split("; ")
    jax_version = next((v for p in versions for v in p.split(", ") if v.startswith("jax ")), "")
    ax.set_title(f"GPU: {device}, {jax_version.replace('jax', 'JAX')}", fontsize=10)
    _ticks(ax, sorted({r["context"] for r in records}))
    ax.set_xlabel("context length")
    ax.set_ylabel("tokens per second")
    ax.legend(fontsize=7)
    ax.grid(True, which="both", alpha=0.3)


def trace_plot(runs: list[dict[str, Any]], path: str | os.PathLike) -> None:
    """Trace + lower time, vjpkit / hand-written custom_vjp, against chain length: one line per JAX."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(9, 5.5))
    runs = sorted(runs, key=lambda r: [int(p) for p in re.findall(r"\d+", r["environment"]["jax"])])
    for i, run in enumerate(runs):
        rows = run["chain"]
        n = [r["calls"] for r in rows]
        ax.semilogx(n, [r["ratio"] for r in rows], "o-", color=f"C{i}", label=f"JAX {run['environment']['jax']}")
        ax.semilogx(n, [r["aa_ratio"] for r in rows], "x:", color=f"C{i}", alpha=0.6,
                    label=f"JAX {run['environment']['jax']}, A/A: hand-written / its copy")
    _ticks(ax, sorted({r["calls"] for run in runs for r in run["chain"]}))
    ax.axhline(1.0, color="black", lw=0.8)
    ax.axhline(1.05, color="gray", ls="--", lw=0.8, label="target 1.05")
    ax.set_xlabel("Function calls in the traced chain (Linear/Tanh)")
    ax.set_ylabel("trace + lower time, vjpkit / hand-written")
    low, high = ax.get_ylim()
    ax.set_ylim(low, high + (high - low) * 0.7)  # room for the legend above the lines
    ax.legend(ncol=2, fontsize=9, loc="upper left")
    ax.grid(True, which="both", alpha=0.3)
    first = runs[0]["environment"]
    loads = ", ".join(f"{load_text(r['environment'])} (JAX {r['environment']['jax']})" for r in runs)
    lines = [f"{first['cpu_count']}-core {first['cpu']} CPU, {first['date_utc'][:10]}: {loads}"]
    repeats = sorted({r["repeats"] for run in runs for r in run["chain"]})
    fig.suptitle("Tracing jax.jit(jax.value_and_grad(loss)): thread CPU time, median of paired ratios over "
                 f"{'/'.join(map(str, repeats))} repeats\n"
                 + "\n".join(lines), fontsize=11)
    _save(fig, path)


def gradcheck_plot(data: dict[str, Any], path: str | os.PathLike) -> None:
    """Warm gradcheck time against the Jacobian's elements, vjpkit beside torch (log-log), and torch / vjpkit."""
    plt = _pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5))
    rows = data["sizes"]
    elements = [r["jacobian_elements"] for r in rows]
    for i, name in enumerate(data["checkers"]):
        style = "o-" if name.startswith("vjpkit") else "s--"
        left.loglog(elements, [r["ms"][name]["median"] for r in rows], style, color=f"C{i}", label=name)
        left.fill_between(elements, [r["ms"][name]["min"] for r in rows], [r["ms"][name]["max"] for r in rows],
                          color=f"C{i}", alpha=0.12)
    left.set_ylabel("ms per check (median; band: min–max)")
    left.set_title("Time per check", fontsize=11)
    for i, mode in enumerate(rows[0]["torch_over_vjpkit"]):
        right.semilogx(elements, [r["torch_over_vjpkit"][mode] for r in rows], "o-", color=f"C{i + 4}",
                       label=f"{mode}: torch / vjpkit")
    right.axhline(1.0, color="black", lw=0.8)
    right.set_yscale("log")
    top = max(max(r["torch_over_vjpkit"].values()) for r in rows)
    marks = [m for m in (0.5, 1, 2, 5, 10, 20, 50, 100, 200) if m <= top * 2]
    right.set_yticks(marks, [f"{m:g}×" for m in marks])
    right.set_ylabel("torch's time / vjpkit's")
    right.set_title("How many times faster vjpkit checks", fontsize=11)
    for ax in (left, right):
        ax.set_xticks(elements, [f"{_short(e)}\nn={r['n']}" for e, r in zip(elements, rows, strict=True)])
        ax.minorticks_off()
        ax.set_xlabel("Jacobian elements (inputs n×n, 3n/2×n)")
        ax.legend()
        ax.grid(True, which="both", alpha=0.3)
    fig.suptitle("Warm gradcheck: vjpkit vs torch.autograd.gradcheck (1 thread)\nthe PyTorch tutorial's "
                 "LinearFunction scaled, float64 (n = 20 is the tutorial's example)\n"
                 f"{machine_line(data['environment'])}, torch {data.get('torch', '-')}", fontsize=11)
    _save(fig, path)


def _short(n: int) -> str:
    """960, 15k, 2.3M."""
    for unit, size in (("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:.{1 if n < 10 * size else 0}f}{unit}"
    return f"{n}"


def _load(name: str) -> dict[str, Any] | None:
    path = RESULTS / name
    return json.loads(path.read_text()) if path.exists() else None


def main() -> None:
    parser = argparse.ArgumentParser(description="Redraws docs/img/*.png from benchmarks/results/*.json.")
    parser.add_argument("--out", type=Path, default=IMAGES, help="folder for the PNGs (default: docs/img)")
    args = parser.parse_args()
    memory = _load("transformer_memory.json") or _load("transformer_cpu.json")
    if memory:
        memory_plot(memory, args.out / "transformer_memory.png")
    transformer = _load("transformer_cpu.json")
    if transformer and transformer.get("steps"):
        throughput_plot(transformer, args.out / "transformer_tokens.png", _load("transformer_gpu.json"))
    traces = [json.loads(p.read_text()) for p in sorted(RESULTS.glob("trace_jax-*.json"))]
    if traces:
        trace_plot(traces, args.out / "trace_ratio.png")
    gradcheck = _load("gradcheck_sizes.json")
    if gradcheck:
        gradcheck_plot(gradcheck, args.out / "gradcheck_sizes.png")


if __name__ == "__main__":
    main()
