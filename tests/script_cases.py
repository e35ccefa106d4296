"""The tests of a multi-device script's cases (importable as ``script_cases``).

The device count is fixed when JAX starts and a pytest process has one CPU
device, so a script of tests/scripts/ runs once in a subprocess (the
``run_script`` fixture) and prints a JSON object: for each case, None when it
passed, its error otherwise, or ``{"skip": reason}`` for a case that needs a
feature this JAX lacks. ``script_case_tests`` makes a test file's fixture and
tests from the script's name, its device count and the cases it must run.
"""

import pytest


def script_case_tests(script, devices, cases):
    """The module-scoped ``results`` fixture, a test that the script ran every case, and one test per case."""

    @pytest.fixture(scope="module")
    def results(run_script):
        return run_script(script, devices=devices)

    def test_script_runs_every_case(results):
        assert sorted(results) == sorted(cases)

    @pytest.mark.parametrize("case", cases)
    def test_case(case, results):
        result = results[case]
        if isinstance(result, dict):
            pytest.skip(result["skip"])
        assert result is None, f"{case}:\n{result}"

    return results, test_script_runs_every_case, test_case
