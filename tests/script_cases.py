"""The tests of a multi-device script's cases (importable as ``script_cases``).

The device count is fixed when JAX starts and a pytest process has one CPU
device, so a script of tests/scripts/ runs once in a subprocess (the
``run_script`` fixture) and prints a JSON object: for each case, None when it
passed, its error otherwise, or ``{"skip": reason}`` for a case that needs a
feature this JAX lacks. ``script_case_tests`` makes a test file's fixture and
tests from the script's name, its device count and the cases it must run.

A case that trains a model can be marked slow: when its test is deselected
(a plain ``pytest``), the script is told to leave it out (its arguments name
the cases to leave out), so the subprocess does not train for nothing.
"""

import pytest


def script_case_tests(script, devices, cases, slow=()):
    """The module-scoped ``results`` fixture, a test that the script ran every case, and one test per case.

    ``slow``: the cases marked slow, which the script leaves out when their tests are deselected.
    """

    def left_out(session):
        selected = {item.callspec.params["case"] for item in session.items if getattr(item, "obj", None) is test_case}
        return [case for case in slow if case not in selected]

    @pytest.fixture(scope="module")
    def results(run_script, request):
        return run_script(script, devices, *left_out(request.session))

    def test_script_runs_every_case(results, request):
        assert sorted(results) == sorted(set(cases) - set(left_out(request.session)))

    @pytest.mark.parametrize("case", [pytest.param(c, marks=[pytest.mark.slow] if c in slow else []) for c in cases])
    def test_case(case, results):
        result = results[case]
        if isinstance(result, dict):
            pytest.skip(result["skip"])
        assert result is None, f"{case}:\n{result}"

    return results, test_script_runs_every_case, test_case
