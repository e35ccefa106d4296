"""scripts/gpu_check.sh, the check run on a machine with a GPU: its CPU-side part.

The script itself needs a GPU; here it is parsed by bash and its dry run
lists the steps it would run, without running them.
"""

import pathlib
import subprocess

SCRIPT = pathlib.Path(__file__).resolve().parent.parent / "scripts" / "gpu_check.sh"


def dry_run():
    return subprocess.run(["bash", str(SCRIPT), "--dry-run"], capture_output=True, text=True, timeout=60)


def test_the_script_parses():
    done = subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


def test_the_dry_run_lists_every_step_and_runs_nothing():
    done = dry_run()
    assert done.returncode == 0, done.stderr
    steps = [line.split()[0] for line in done.stdout.splitlines() if "(at most" in line]
    assert steps == ["environment", "known", "suite", "pallas", "attention", "from_torch", "transformer"] or steps == [
        "environment", "known", "suite", "pallas", "attention", "cuda_kernel", "from_torch", "transformer"
    ]
    suite = next(line for line in done.stdout.splitlines() if line.startswith("suite"))
    assert "-m pytest" in suite and "-n 15" in suite and "-o addopts=" in suite
    assert "--doctest-modules" in suite  # the docstrings' examples, which the cleared addopts held
    assert "logs in (none: a dry run)" in done.stdout


def test_an_unknown_option_exits_2_with_the_usage():
    done = subprocess.run(["bash", str(SCRIPT), "--gpu"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stderr == "usage: bash scripts/gpu_check.sh [--dry-run]\n"


def test_every_test_the_last_gpu_run_failed_is_still_a_test():
    # The script runs them first by name (pytest -k): a renamed or removed test would silently drop out.
    listed = [line for line in (SCRIPT.parent / "gpu_known_failures.txt").read_text().splitlines()
              if line and not line.startswith("#")]
    assert listed
    for entry in listed:
        path, name = entry.split("::")
        source = (SCRIPT.parent.parent / path).read_text()
        assert f"def {name}(" in source, entry
