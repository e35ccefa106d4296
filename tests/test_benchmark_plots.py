"""The benchmarks' plots (benchmarks/_plots.py): drawn from the committed JSONs, and honest about what is missing."""

from __future__ import annotations

import json
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
BENCHMARKS_PAGE = ROOT / "docs" / "benchmarks.md"

pytest.importorskip("matplotlib")


@pytest.fixture
def plots(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import _plots

    return _plots


def _environment(load=(14.2, 17.6)):
    return {"date_utc": "2026-11-28 09:40", "cpu": "AMD EPYC", "cpu_count": 2, "device": "cpu (cpu)",
            "load_average": list(load), "jax": "0.10.2", "python": "3.11.7", "command": "python x.py"}


def test_every_plot_on_the_benchmarks_page_is_redrawn_from_the_committed_json(plots, tmp_path, monkeypatch):
    referenced = set(re.findall(r"\(img/([\w.-]+\.png)\)", BENCHMARKS_PAGE.read_text()))
    assert {"transformer_memory.png", "transformer_tokens.png", "trace_ratio.png", "gradcheck_sizes.png"} <= referenced
    assert all((ROOT / "docs" / "img" / name).is_file() for name in referenced)
    monkeypatch.setattr("sys.argv", ["_plots.py", "--out", str(tmp_path)])
    plots.main()
    assert {p.name for p in tmp_path.iterdir()} == referenced


def test_tokens_plot_without_gpu_figures_says_gpu_not_measured(plots, monkeypatch):
    drawn = []
    monkeypatch.setattr(plots, "_save", lambda fig, path: drawn.append(fig))
    step = {"candidate": "vjpkit", "step_ms": 800.0, "tokens_per_s": 2560.0, "per_autodiff": 0.5, "aa": None,
            "samples_ms": [790.0, 800.0, 810.0]}
    data = {"environment": _environment(), "steps": [step, dict(step, candidate="vjpkit (A/A)", aa=1.01)],
            "tokens_per_step": 2048, "context": 256, "torch_threads": 1}
    plots.throughput_plot(data, "unused.png")
    texts = [t.get_text() for ax in drawn[0].axes for t in ax.texts]
    assert "GPU: not measured yet" in texts


def test_machine_line_names_cores_load_range_and_jax(plots):
    assert plots.machine_line(_environment((17.6, 14.2))) == \
        "2-core AMD EPYC CPU, load average 14–18, JAX 0.10.2, 2026-11-28 09:40 UTC"
    assert plots.machine_line(_environment((3.1, 2.9))) == \
        "2-core AMD EPYC CPU, load average 3, JAX 0.10.2, 2026-11-28 09:40 UTC"


def test_json_of_a_run_records_machine_load_and_jax_version(plots, tmp_path):
    import jax

    path = tmp_path / "figures.json"
    plots.write_json(path, {"chain": [{"calls": 10, "ratio": 0.98}]}, load_before=12.34)
    written = json.loads(path.read_text())
    assert written["chain"] == [{"calls": 10, "ratio": 0.98}]
    assert written["environment"]["jax"] == jax.__version__
    assert written["environment"]["load_average"][0] == 12.3
    assert written["environment"]["cpu_count"] >= 1


def test_tokens_plot_with_gpu_figures_draws_one_line_per_candidate_and_dtype(plots, monkeypatch):
    drawn = []
    monkeypatch.setattr(plots, "_save", lambda fig, path: drawn.append(fig))
    step = {"candidate": "vjpkit", "step_ms": 800.0, "tokens_per_s": 2560.0, "per_autodiff": 0.5, "aa": None,
            "samples_ms": [790.0, 800.0, 810.0]}
    data = {"environment": _environment(), "steps": [step], "tokens_per_step": 2048, "context": 256,
            "torch_threads": 1}
    gpu = {"preamble": ["H200"], "results": [
        {"candidate": c, "dtype": d, "context": t, "tokens_per_s": 1e5}
        for c in ("vjpkit", "autodiff", "vjpkit (A/A)") for d in ("float32", "bfloat16") for t in (1024, 4096)]}
    plots.throughput_plot(data, "unused.png", gpu)
    gpu_axes = drawn[0].axes[1]
    assert sorted(line.get_label() for line in gpu_axes.lines) == [
        "autodiff, bfloat16", "autodiff, float32", "vjpkit, bfloat16", "vjpkit, float32"]
    assert not [t for t in gpu_axes.texts if t.get_text() == "GPU: not measured yet"]
