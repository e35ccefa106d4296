"""CI's rule (tests/conftest.py): with CI=true a skipped test fails, unless it
is thorough-only or needs a feature this JAX lacks; and the slow tests, left
out of a plain run, run in CI. Checked on small test files run by pytest's
own ``pytester`` with this suite's conftest.
"""

import os
import pathlib

import pytest

import vjpkit

pytest_plugins = ["pytester"]

CONFTEST = (pathlib.Path(__file__).parent / "conftest.py").read_text()
# Where this vjpkit was imported from, absolute: the runs below start in a temporary
# directory, which a relative PYTHONPATH (PYTHONPATH=src) would not reach from.
SOURCE = str(pathlib.Path(vjpkit.__file__).resolve().parent.parent)


@pytest.fixture(autouse=True)
def only_this_suites_plugins(monkeypatch):
    """The small runs load no third-party pytest plugin, and find vjpkit from any directory.

    Why: their outcomes are read from pytest's summary, which installed
    plugins (pytest-benchmark under xdist, pytest-cov, ...) may add to; none
    of them is part of the rule under test.
    """
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, (SOURCE, os.environ.get("PYTHONPATH")))))

SKIPPING_TESTS = """
import pytest

def test_runs():
    pass

def test_needs_a_missing_package():
    pytest.importorskip("a_package_that_is_not_installed")

@pytest.mark.skip(reason="this JAX lacks jax.some_new_feature")
def test_of_a_newer_jax():
    pass

@pytest.mark.thorough
def test_slow_and_thorough():
    pass

@pytest.mark.xfail(strict=True, reason="a known limitation")
def test_known_limitation():
    assert False
"""


@pytest.fixture
def suite(pytester, monkeypatch):
    monkeypatch.delenv("VJPKIT_HYPOTHESIS_PROFILE", raising=False)
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_skips=SKIPPING_TESTS)
    return pytester


def test_in_ci_a_skip_for_a_missing_package_fails(suite, monkeypatch):
    monkeypatch.setenv("CI", "true")
    result = suite.runpytest("-rfs")
    result.assert_outcomes(passed=1, failed=1, skipped=2, xfailed=1)
    result.stdout.fnmatch_lines([
        "skipped in CI, where every test must run: could not import 'a_package_that_is_not_installed'*",
        "FAILED test_skips.py::test_needs_a_missing_package*",
    ])


def test_in_ci_thorough_and_older_jax_skips_are_allowed(suite, monkeypatch):
    monkeypatch.setenv("CI", "true")
    result = suite.runpytest("-rs", "-k", "not missing_package")
    result.assert_outcomes(passed=1, skipped=2, xfailed=1)
    result.stdout.fnmatch_lines_random([
        "SKIPPED*this JAX lacks jax.some_new_feature",
        "SKIPPED*thorough profile only: runs with VJPKIT_HYPOTHESIS_PROFILE=thorough",
    ])


def test_in_ci_a_module_skipped_at_import_fails(pytester, monkeypatch):
    monkeypatch.setenv("CI", "true")
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_torch_only="import pytest\ntorch = pytest.importorskip('a_missing_torch')\n")
    result = pytester.runpytest()
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*skipped in CI, where every test must run: could not import 'a_missing_torch'*"])


def test_outside_ci_skips_are_skips(suite, monkeypatch):
    monkeypatch.setenv("CI", "false")
    suite.runpytest().assert_outcomes(passed=1, skipped=3, xfailed=1)


def test_the_thorough_profile_runs_the_thorough_tests(suite, monkeypatch):
    monkeypatch.setenv("CI", "true")
    monkeypatch.setenv("VJPKIT_HYPOTHESIS_PROFILE", "thorough")
    suite.runpytest_subprocess("-k", "thorough").assert_outcomes(passed=1)


SLOW_AND_QUICK_TESTS = """
import pytest

def test_quick():
    pass

@pytest.mark.slow
def test_slow():
    pass
"""


@pytest.fixture
def slow_suite(pytester, monkeypatch):
    monkeypatch.delenv("VJPKIT_HYPOTHESIS_PROFILE", raising=False)
    pytester.makeconftest(CONFTEST)
    pytester.makeini("[pytest]\nmarkers =\n    slow: a slow test\n")
    pytester.makepyfile(test_slow_and_quick=SLOW_AND_QUICK_TESTS)
    return pytester


def test_outside_ci_slow_tests_are_deselected_not_skipped(slow_suite, monkeypatch):
    monkeypatch.delenv("CI", raising=False)
    result = slow_suite.runpytest()
    result.assert_outcomes(passed=1, deselected=1)
    result.stdout.fnmatch_lines(["tests marked slow: left out (--run-slow, or CI=true, runs them)"])


def test_in_ci_slow_tests_run(slow_suite, monkeypatch):
    monkeypatch.setenv("CI", "true")
    slow_suite.runpytest().assert_outcomes(passed=2)


@pytest.mark.parametrize("args", [["--run-slow"], ["-m", "slow or not slow"]])
def test_run_slow_or_a_mark_expression_runs_slow_tests(slow_suite, monkeypatch, args):
    monkeypatch.delenv("CI", raising=False)
    slow_suite.runpytest(*args).assert_outcomes(passed=2)


def test_mark_expression_slow_runs_only_the_slow_tests(slow_suite, monkeypatch):
    monkeypatch.delenv("CI", raising=False)
    slow_suite.runpytest("-m", "slow").assert_outcomes(passed=1, deselected=1)
