"""Every `examples/*.py` runs as a user would run it and exits 0.

Each example checks its own numbers against `jax.grad` of the plain math and
exits non-zero on a mismatch, so this file only needs the exit status.

An example that needs optional packages says so in a comment line near the
top, e.g. `# requires: optax, sklearn` (import names); it is skipped when
one of them is not importable. Most of a small example's run is importing
JAX, so one subprocess (tests/scripts/run_examples.py) imports JAX and
vjpkit once and forks a fresh process per example, which runs the script as
`python examples/NAME.py` would; two or more at a time (they are
independent), each with a timeout: `VJPKIT_EXAMPLE_TIMEOUT` seconds, 300 by
default.

The training examples are the exception (`RUN_BY_TEST_TRAINING`):
tests/test_training.py (tests/test_transformer.py for the transformer) runs
their scripts and checks the numbers they print, so running them here too
would only train the same models twice.
"""

import importlib.util
import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

EXAMPLES_DIR = pathlib.Path(__file__).resolve().parent.parent / "examples"
ALL_EXAMPLES = sorted(EXAMPLES_DIR.glob("*.py"))
RUNNER = pathlib.Path(__file__).resolve().parent / "scripts" / "run_examples.py"
TIMEOUT_S = float(os.environ.get("VJPKIT_EXAMPLE_TIMEOUT", "300"))
REQUIRES_LINE = re.compile(r"^#\s*requires:\s*(.+)$", re.MULTILINE)
RUN_BY_TEST_TRAINING = {
    "train_mlp.py", "train_sharded.py", "equinox_module.py", "flax_nnx_module.py", "train_transformer.py",
}
EXAMPLES = [p for p in ALL_EXAMPLES if p.name not in RUN_BY_TEST_TRAINING]
# Several JAX processes and a distributed run, and the examples that compile kernels (C++ with a compiler, Pallas
# in interpret mode; their own tests check the kernels in the plain run): marked slow (run in CI).
SLOW = {"train_multiprocess.py", "cuda_kernel.py", "ffi_kernel.py", "pallas_attention.py"}


def required_modules(path):
    """Import names listed on `# requires:` lines in the example's first 30 lines."""
    head = "\n".join(path.read_text().splitlines()[:30])
    return [name for line in REQUIRES_LINE.findall(head) for name in re.split(r"[,\s]+", line) if name]


def is_importable(name):
    try:
        return importlib.util.find_spec(name) is not None
    except ImportError:  # a dotted name whose parent package is missing
        return False


def missing_modules(path):
    return [name for name in required_modules(path) if not is_importable(name)]


def run_examples(paths):
    """``{path: {"returncode", "stdout", "stderr"}}`` for each example; returncode None: it timed out."""
    workers = max(2, min(len(paths), os.cpu_count() or 2))
    env = dict(os.environ, JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"))
    done = subprocess.run(
        [sys.executable, str(RUNNER), str(TIMEOUT_S), str(workers), *map(str, paths)],
        cwd=EXAMPLES_DIR.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S * (len(paths) + 1),  # the runner times each example out itself
    )
    assert done.returncode == 0, f"{RUNNER.name} failed:\n{done.stdout}\n{done.stderr}"
    return {pathlib.Path(path): result for path, result in json.loads(done.stdout).items()}


def example_param(path):
    missing = missing_modules(path)
    marks = [pytest.mark.skip(reason=f"needs {', '.join(missing)}")] if missing else []
    if path.name in SLOW:
        marks.append(pytest.mark.slow)
    return pytest.param(path, id=path.stem, marks=marks)


@pytest.fixture(scope="module")
def example_runs(request):
    """Every selected, runnable example's run, all started at once."""
    selected = [
        item.callspec.params["example"]
        for item in request.session.items
        if getattr(item, "originalname", None) == "test_example_runs"
        and not missing_modules(item.callspec.params["example"])
    ]
    return run_examples(selected)


def test_examples_exist():
    assert EXAMPLES, f"no examples found in {EXAMPLES_DIR}"
    assert RUN_BY_TEST_TRAINING <= {p.name for p in ALL_EXAMPLES}


@pytest.mark.parametrize("example", [example_param(p) for p in EXAMPLES])
def test_example_runs(example, example_runs):
    result = example_runs[example]
    if result["returncode"] is None:
        pytest.fail(f"{example.name} did not finish within {TIMEOUT_S:g} s")
    assert result["returncode"] == 0, (
        f"python examples/{example.name} exited with {result['returncode']}\n"
        f"--- stdout ---\n{result['stdout']}\n--- stderr ---\n{result['stderr']}"
    )
