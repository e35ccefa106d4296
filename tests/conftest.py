"""Shared pytest configuration: hypothesis profiles, the slow and thorough-only
tests, CI's rule that no test may skip, and two fixtures: ``x64`` (64-bit
floats for one test) and ``run_script`` (a script of tests/scripts/ on several
devices).

Three hypothesis profiles, each a fixed number of derandomized examples (runs
are reproducible) except the last: ``default`` (a plain ``pytest``) runs a
few, ``ci`` (picked when ``CI=true``) three times as many, and ``thorough``
at least 10,000 of each property, and the tests marked
``@pytest.mark.thorough`` (slow ones whose point the other runs already prove
on a smaller scale):

    VJPKIT_HYPOTHESIS_PROFILE=thorough python -m pytest tests/test_properties.py

Tests marked ``@pytest.mark.slow`` (several processes, a training run: each
minutes of CPU on a small machine) are left out of a plain ``pytest``, so it
stays quick; ``CI=true``, ``--run-slow`` or any ``-m`` expression brings them
back (``-m slow`` runs only them). They are deselected, never skipped.

With ``CI=true`` (CI sets it), a skipped test fails instead: CI installs every
optional dependency (torch, equinox, flax, ...), so a skip there means a test
silently did not run. Only two kinds of skip are expected, recognised by
their reason's first words (``ALLOWED_SKIPS_IN_CI``): the thorough-only tests,
and features that an older JAX lacks (the floor-JAX run).
"""

import json
import os
import pathlib
import subprocess
import sys

import pytest
from _pytest.doctest import DoctestModule  # pytest exports DoctestItem, not the module collector
from hypothesis import HealthCheck, settings

# One OpenMP thread for torch (and NumPy's BLAS), here and in every subprocess
# the tests start, set before either library loads. With more, each worker's
# threads spin waiting for each other on a machine whose cores the other
# workers already fill: PyTorch's gradcheck of porting.md took 6-8 CPU
# seconds with 2 threads, under 1 with one. The tests' arrays are small.
os.environ.setdefault("OMP_NUM_THREADS", "1")

from vjpkit._jax_internals import enable_x64  # jax.enable_x64, or its older home

# JAX compiles on first use of a program: per-example times vary by orders of
# magnitude, which is not slowness of the data generation.
_JAX = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

settings.register_profile("default", max_examples=50, derandomize=True, print_blob=True, **_JAX)
settings.register_profile("ci", max_examples=150, derandomize=True, print_blob=True, **_JAX)
settings.register_profile("thorough", max_examples=10_000, print_blob=True, **_JAX)
PROFILE = os.environ.get("VJPKIT_HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") == "true" else "default")
settings.load_profile(PROFILE)

THOROUGH_ONLY = "thorough profile only: runs with VJPKIT_HYPOTHESIS_PROFILE=thorough"
ALLOWED_SKIPS_IN_CI = (THOROUGH_ONLY, "this JAX lacks")


@pytest.fixture
def x64():
    """64-bit floats for one test: tight tolerances need them.

    The switch is thread-local and undone after the test, so it never leaks
    into another test (or another file's default float32).
    """
    with enable_x64(True):
        yield


SCRIPTS = pathlib.Path(__file__).parent / "scripts"


@pytest.fixture(scope="session")
def run_script():
    """Runs ``tests/scripts/NAME ARGS`` on DEVICES host CPU devices and returns the JSON it prints.

    The device count is fixed when JAX starts and a pytest process has one
    CPU device, so a multi-device check runs once in a subprocess (from a
    module-scoped fixture) and each test checks one of its cases.
    """

    def run(name, devices, *args, timeout=300):
        env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}", JAX_PLATFORMS="cpu")
        done = subprocess.run([sys.executable, str(SCRIPTS / name), *args], env=env, capture_output=True, text=True,
                              timeout=timeout)
        assert done.returncode == 0, f"{name} failed:\n{done.stdout}\n{done.stderr}"
        return json.loads(done.stdout)

    return run


def pytest_addoption(parser):
    parser.addoption("--run-slow", action="store_true", help="also run the tests marked slow (CI=true runs them)")


def pytest_configure(config):
    config.addinivalue_line("markers", f"thorough: {THOROUGH_ONLY}")


def _runs_slow_tests(config):
    asked = config.getoption("--run-slow") or bool(config.option.markexpr)
    return asked or os.environ.get("CI") == "true" or PROFILE == "thorough"


def pytest_report_header(config):
    if not _runs_slow_tests(config):
        return "tests marked slow: left out (--run-slow, or CI=true, runs them)"


def pytest_collection_modifyitems(config, items):
    if not _runs_slow_tests(config):
        slow = [item for item in items if item.get_closest_marker("slow")]
        if slow:
            config.hook.pytest_deselected(items=slow)
            items[:] = [item for item in items if not item.get_closest_marker("slow")]
    if PROFILE == "thorough":
        return
    for item in items:
        if item.get_closest_marker("thorough"):
            item.add_marker(pytest.mark.skip(reason=THOROUGH_ONLY))


@pytest.hookimpl(wrapper=True)
def pytest_collect_file(file_path, parent):
    """The tests' own files are collected as tests, never for doctests.

    ``--doctest-modules`` (pyproject.toml) is for vjpkit's docstrings
    (src/vjpkit, src/conftest.py). Collecting this folder for doctests would
    import every helper and script in it, and a script's top level may need
    several devices (tests/ports/allgather_script.py builds a mesh of four).
    """
    collected = yield
    return [node for node in collected if not isinstance(node, DoctestModule)]


def _fail_unexpected_skip(report):
    """In CI, turns a skip whose reason is not allowed into a failure that names the reason."""
    if os.environ.get("CI") != "true" or not report.skipped or hasattr(report, "wasxfail"):
        return
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    reason = reason.removeprefix("Skipped: ")
    if not reason.startswith(ALLOWED_SKIPS_IN_CI):
        report.outcome = "failed"
        report.longrepr = f"skipped in CI, where every test must run: {reason}"


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    _fail_unexpected_skip(report)
    return report


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector):
    report = yield
    _fail_unexpected_skip(report)
    return report
