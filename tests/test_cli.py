"""The command line: ``python -m vjpkit check MODULE:NAME --inputs SPEC``.

Most tests call ``vjpkit.__main__.main`` in process (fast); one runs the real
``python -m vjpkit`` to check the wiring. Functions come from gc_functions.py.
"""

import os
import subprocess
import sys

import pytest

import vjpkit
from vjpkit.__main__ import main

TESTS = os.path.dirname(os.path.abspath(__file__))
# The directory this vjpkit was imported from, for subprocesses run elsewhere: a
# relative PYTHONPATH (PYTHONPATH=src, a checkout used without installing it)
# would not reach it from tests/.
SOURCE = os.path.dirname(os.path.dirname(os.path.abspath(vjpkit.__file__)))


def installed():
    """Skips a test of the installed distribution where this vjpkit is a checkout on PYTHONPATH."""
    from importlib.metadata import PackageNotFoundError, distribution

    try:
        distribution("vjpkit")
    except PackageNotFoundError:
        pytest.skip("vjpkit is imported from a source tree (PYTHONPATH), not installed: no distribution metadata")


def run(capsys, *argv):
    status = main(list(argv))
    out, err = capsys.readouterr()
    return status, out, err


def test_passing_function_exits_0_with_a_report(capsys):
    status, out, _ = run(capsys, "check", "gc_functions:LinearFunction", "--inputs", "f64[4,3] f64[5,3]")
    assert status == 0
    assert out.startswith("vjpkit check gc_functions:LinearFunction on f64[4,3] f64[5,3] (seed 0)\n")
    assert "gradcheck: passed" in out


def test_gradient_mismatch_exits_1_with_the_report(capsys):
    status, out, _ = run(capsys, "check", "gc_functions:ScaledLinearFunction", "--inputs", "f64[4,3] f64[5,3]")
    assert status == 1
    assert "gradcheck: FAILED\nJacobian mismatch for output 0 with respect to input 1:" in out


def test_host_function_is_checked_without_global_x64(capsys):
    status, out, _ = run(capsys, "check", "gc_functions:HostRowScale", "--inputs", "f64[3,4] f64[4]")
    assert (status, "gradcheck: passed" in out) == (0, True), out


def test_plain_function_is_checked(capsys):
    status, out, _ = run(capsys, "check", "gc_functions:square", "--inputs", "f64[3]")
    assert (status, "gradcheck: passed" in out) == (0, True)


def test_gradgrad_option_runs_gradgradcheck(capsys):
    status, out, _ = run(capsys, "check", "gc_functions:Exp", "--inputs", "f64[3]", "--gradgrad")
    assert status == 0
    assert "gradcheck: passed" in out and "gradgradcheck: passed" in out


def test_tolerance_options_are_passed_on(capsys):
    status, _, _ = run(capsys, "check", "gc_functions:ScaledLinearFunction", "--inputs", "f64[4,3] f64[5,3]",
                       "--rtol", "0.2")
    assert status == 0


def test_function_raising_on_the_inputs_exits_1(capsys):
    status, out, err = run(capsys, "check", "gc_functions:LinearFunction", "--inputs", "f64[4,3] f64[5,2]")
    assert status == 1
    assert "gradcheck: FAILED: gc_functions:LinearFunction raised TypeError" in out
    assert "Traceback" in err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["check", "no_such_module_xyz:F", "--inputs", "f64[3]"],
         "vjpkit: error: cannot import module 'no_such_module_xyz': ModuleNotFoundError: "
         "No module named 'no_such_module_xyz'"),
        (["check", "gc_functions:Nope", "--inputs", "f64[3]"],
         "vjpkit: error: module 'gc_functions' has no attribute 'Nope'"),
        (["check", "gc_functions:NOT_A_FUNCTION", "--inputs", "f64[3]"],
         "vjpkit: error: gc_functions:NOT_A_FUNCTION is a int, not a Function or a function"),
        (["check", "gc_functions", "--inputs", "f64[3]"],
         "vjpkit: error: expected MODULE:NAME (e.g. mypkg.ops:Linear), got 'gc_functions'"),
        (["check", "gc_functions:square", "--inputs", "f64[3,x]"],
         "vjpkit: error: malformed input spec 'f64[3,x]': expected DTYPE[d0,d1,...]"),
        (["check", "gc_functions:square"],
         "vjpkit: error: the following arguments are required: --inputs"),
        (["check", "gc_functions:square", "--inputs", "f64[3]", "--atol", "small"],
         "vjpkit: error: argument --atol: invalid float value: 'small'"),
        (["frobnicate"],
         "vjpkit: error: argument COMMAND: invalid choice: 'frobnicate'"),
    ],
)
def test_bad_arguments_exit_2_with_one_line_on_stderr(capsys, argv, message):
    status, out, err = run(capsys, *argv)
    assert status == 2
    assert out == ""
    assert err.startswith(message) and err.count("\n") == 1


def test_python_dash_m_vjpkit_runs_the_check():
    result = subprocess.run(
        [sys.executable, "-m", "vjpkit", "check", "gc_functions:ScaledLinearFunction", "--inputs", "f64[2,2] f64[3,2]"],
        cwd=TESTS, capture_output=True, text=True, timeout=300,
        env=dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, (SOURCE, os.environ.get("PYTHONPATH"))))),
    )
    assert result.returncode == 1, result.stderr
    assert "Jacobian mismatch for output 0 with respect to input 1" in result.stdout


def test_version_option_prints_the_installed_version(capsys):
    from importlib.metadata import version

    installed()
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out == f"vjpkit {version('vjpkit')}\n"


def test_package_version_is_the_installed_distribution_version():
    from importlib.metadata import version

    installed()
    assert vjpkit.__version__ == version("vjpkit")


def test_console_command_is_declared_and_runs_the_same_main():
    from importlib.metadata import entry_points

    installed()
    (command,) = [e for e in entry_points(group="console_scripts") if e.name == "vjpkit"]
    assert command.value == "vjpkit.__main__:main"
    assert command.load() is main


def test_a_torch_function_exits_2_pointing_to_from_torch(capsys, tmp_path, monkeypatch):
    pytest.importorskip("torch")
    (tmp_path / "torch_ops.py").write_text(
        "import torch\n\n\nclass TExp(torch.autograd.Function):\n"
        "    @staticmethod\n    def forward(ctx, x):\n        return x.exp()\n\n"
        "    @staticmethod\n    def backward(ctx, g):\n        return g\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    status, out, err = run(capsys, "check", "torch_ops:TExp", "--inputs", "f64[3]")
    assert status == 2
    assert err.startswith("vjpkit: error: vjpkit check torch_ops:TExp: TExp is a torch.autograd.Function, which "
                          "takes torch tensors, not JAX arrays. Pass vjpkit.from_torch(TExp).apply")
