"""Shared pytest configuration: hypothesis profiles, the thorough-only tests,
CI's rule that no test may skip, and two fixtures: ``x64`` (64-bit floats for
one test) and ``run_script`` (a script of tests/scripts/ on several devices).

``default`` keeps the property-based tests (tests/test_properties.py) within
CI's time budget: a fixed number of derandomized examples, so CI runs are
reproducible. ``thorough`` runs at least 10,000 examples of each property,
and the tests marked ``@pytest.mark.thorough`` (slow ones whose point the
default run already proves on a smaller scale):

    VJPKIT_HYPOTHESIS_PROFILE=thorough python -m pytest tests/test_properties.py

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
from hypothesis import HealthCheck, settings

from vjpkit._jax_internals import enable_x64  # jax.enable_x64, or its older home

# JAX compiles on first use of a program: per-example times vary by orders of
# magnitude, which is not slowness of the data generation.
_JAX = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

settings.register_profile("default", max_examples=150, derandomize=True, print_blob=True, **_JAX)
settings.register_profile("thorough", max_examples=10_000, print_blob=True, **_JAX)
PROFILE = os.environ.get("VJPKIT_HYPOTHESIS_PROFILE", "default")
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
    """Runs ``tests/scripts/NAME`` on DEVICES host CPU devices and returns the JSON it prints.

    The device count is fixed when JAX starts and a pytest process has one
    CPU device, so a multi-device check runs once in a subprocess (from a
    module-scoped fixture) and each test checks one of its cases.
    """

    def run(name, devices, timeout=300):
        env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}", JAX_PLATFORMS="cpu")
        done = subprocess.run([sys.executable, str(SCRIPTS / name)], env=env, capture_output=True, text=True,
                              timeout=timeout)
        assert done.returncode == 0, f"{name} failed:\n{done.stdout}\n{done.stderr}"
        return json.loads(done.stdout)

    return run


def pytest_configure(config):
    config.addinivalue_line("markers", f"thorough: {THOROUGH_ONLY}")


def pytest_collection_modifyitems(config, items):
    if PROFILE == "thorough":
        return
    for item in items:
        if item.get_closest_marker("thorough"):
            item.add_marker(pytest.mark.skip(reason=THOROUGH_ONLY))


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
