"""vjpkit.testing: assertion helpers for a user's pytest suite, and seeded inputs."""

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gc_functions import Exp, LinearFunction, ScaledLinearFunction

from vjpkit.testing import assert_gradcheck, assert_gradgradcheck, random_inputs


def wrong_second_derivative():
    f = jax.custom_vjp(jnp.sin)
    f.defvjp(lambda x: (jnp.sin(x), x), lambda x, g: (g * jnp.cos(jax.lax.stop_gradient(x)),))
    return f


def test_assert_gradcheck_passes_silently():
    assert_gradcheck(LinearFunction.apply, random_inputs("f64[3,2] f64[4,2]"))  # raises or warns on failure


def test_assert_gradcheck_failure_is_an_assertion_error_with_the_report():
    with pytest.raises(AssertionError, match=r"(?s)^gradcheck failed for ScaledLinearFunction.apply:\n"
                       r"Jacobian mismatch for output 0 with respect to input 1:.*worst:"):
        assert_gradcheck(ScaledLinearFunction.apply, random_inputs("f64[3,2] f64[4,2]"))


def test_assert_gradcheck_passes_options_through():
    x, w = random_inputs("f64[3,2] f64[4,2]")
    assert_gradcheck(ScaledLinearFunction.apply, (x, w), rtol=0.2)  # within 20%
    with pytest.raises(AssertionError, match="Fast-mode Jacobian mismatch"):
        assert_gradcheck(ScaledLinearFunction.apply, (x, w), fast_mode=True)


def test_assert_gradgradcheck_passes_silently():
    assert_gradgradcheck(Exp.apply, random_inputs("f64[4]"))  # raises or warns on failure


def test_assert_gradgradcheck_failure_is_an_assertion_error_with_the_report():
    with pytest.raises(AssertionError, match=r"(?s)^gradgradcheck failed for .*\nJacobian mismatch for the "
                       r"gradient of input 0 with respect to input 0:"):
        assert_gradgradcheck(wrong_second_derivative(), random_inputs("f64[4]"))


def test_random_inputs_have_the_spec_dtypes_and_shapes():
    arrays = random_inputs("f64[20,20] f32[3] c128[2,1] i32[4] bool[2] f64[]")
    assert [(a.dtype, a.shape) for a in arrays] == [
        (np.float64, (20, 20)), (np.float32, (3,)), (np.complex128, (2, 1)),
        (np.int32, (4,)), (np.bool_, (2,)), (np.float64, ()),
    ]


def test_random_inputs_are_seeded():
    a, b = random_inputs("f64[3] f64[2]", seed=5), random_inputs("f64[3] f64[2]", seed=5)
    np.testing.assert_array_equal(a[0], b[0])
    rng = np.random.default_rng(5)
    np.testing.assert_array_equal(a[0], rng.standard_normal(3))
    assert not np.array_equal(random_inputs("f64[3]", seed=6)[0], a[0])


def test_random_inputs_allow_spaces_inside_brackets():
    (a,) = random_inputs("f64[2, 3]")
    assert a.shape == (2, 3)


def test_random_inputs_integers_lie_in_zero_to_ten():
    (a,) = random_inputs("i64[1000]")
    assert a.min() >= 0 and a.max() < 10


@pytest.mark.parametrize("spec", ["f64[20,x]", "f65[2]", "f64(2)", "f64[2,,3]"])
def test_random_inputs_reject_malformed_items(spec):
    expected = (
        f"malformed input spec {spec!r}: expected DTYPE[d0,d1,...] such as f64[20,20] or f64[] "
        "for a scalar, with DTYPE one of f16, f32, f64, c64, c128, i8, i16, i32, i64, u8, u32, bool"
    )
    with pytest.raises(ValueError) as info:
        random_inputs(spec)
    assert str(info.value) == expected


def test_random_inputs_reject_empty_spec():
    with pytest.raises(ValueError, match="empty input spec"):
        random_inputs("  ")


# A subprocess in which importing the named modules fails, as when they are not installed.
HIDING = """
import importlib.abc, sys
class Hide(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in HIDDEN:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, Hide())
"""

EXP_PORT = """
import numpy as np
import jax.numpy as jnp
from functions import Exp  # tests/ is on the script's path: it inherits the test's sys.path
from vjpkit.testing import assert_matches_torch
"""


def run_hiding(hidden, body):
    script = f"HIDDEN = {hidden!r}\n" + HIDING + EXP_PORT + textwrap.dedent(body)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)


def test_assert_matches_torch_works_without_pytest():
    pytest.importorskip("torch")
    done = run_hiding(("pytest", "_pytest"), """
        from torch_functions import TorchExp  # imports torch

        assert "pytest" not in sys.modules
        assert_matches_torch(TorchExp, Exp, (np.linspace(-1.0, 1.0, 4),))
        print("matched")
    """)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "matched"


def test_assert_matches_torch_without_torch_or_pytest_says_torch_is_needed():
    done = run_hiding(("pytest", "_pytest", "torch"), """
        try:
            assert_matches_torch(object, Exp, (np.linspace(-1.0, 1.0, 4),))
        except ModuleNotFoundError as e:
            print(e)
    """)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == (
        "assert_matches_torch needs torch, which is not installed: install it (pip install torch) "
        "to compare a port with it"
    )


# ---------------------------------------------------------------------------
# A torch.autograd.Function where a JAX function is expected: an error pointing to vjpkit.from_torch.


@pytest.fixture
def torch_exp():
    pytest.importorskip("torch")
    from torch_functions import TorchExp

    return TorchExp


POINTS_TO_FROM_TORCH = (r"TorchExp is a torch\.autograd\.Function, which takes torch tensors, not JAX arrays\. "
                        r"Pass vjpkit\.from_torch\(TorchExp\)\.apply to run the original inside JAX, or its port")


@pytest.mark.parametrize("as_apply", [True, False], ids=["apply", "class"])
def test_gradcheck_of_a_torch_function_points_to_from_torch(torch_exp, as_apply):
    import vjpkit

    with pytest.raises(TypeError, match=r"^vjpkit\.gradcheck: " + POINTS_TO_FROM_TORCH):
        vjpkit.gradcheck(torch_exp.apply if as_apply else torch_exp, (np.ones(3),))


def test_gradgradcheck_of_a_torch_function_points_to_from_torch(torch_exp):
    with pytest.raises(TypeError, match=r"^vjpkit\.gradgradcheck: " + POINTS_TO_FROM_TORCH):
        assert_gradgradcheck(torch_exp.apply, (np.ones(3),))


def test_assert_matches_torch_with_a_torch_function_as_the_port_points_to_from_torch(torch_exp):
    from vjpkit.testing import assert_matches_torch

    with pytest.raises(TypeError, match=r"^vjpkit\.testing\.assert_matches_torch \(its port, jax_fn\): "
                                        + POINTS_TO_FROM_TORCH):
        assert_matches_torch(torch_exp, torch_exp, (np.ones(3),))


def test_port_check_with_a_torch_function_as_the_port_points_to_from_torch(torch_exp):
    from vjpkit.testing import assert_port_matches_original

    with pytest.raises(TypeError, match=r"^vjpkit\.testing\.port_differences \(its port\): " + POINTS_TO_FROM_TORCH):
        assert_port_matches_original(torch_exp, torch_exp, np.ones(3))


# ---------------------------------------------------------------------------
# assert_matches_torch and assert_port_matches_original compare alike.


def test_both_checks_report_the_same_largest_difference(torch_exp):
    from vjpkit.testing import assert_matches_torch, port_differences

    def port(x):  # exp(x), 0.5 too large at element 2
        return jnp.exp(x) + jnp.array([0.0, 0.0, 0.5, 0.0, 0.0])

    x = np.zeros(5)
    assert port_differences(port, torch_exp, x)["output"] == 0.5
    with pytest.raises(AssertionError) as raised:
        assert_matches_torch(torch_exp, port, (x,))
    message = str(raised.value)
    assert "in 1 place(s)" in message and "- output 0: 1 of 5 elements differ" in message
    assert "worst: element (2,)" in message and "abs diff: 0.5 " in message


def test_both_checks_fail_on_a_nan_that_only_the_port_returns(torch_exp):
    from vjpkit.testing import assert_matches_torch, assert_port_matches_original, port_differences

    def port(x):  # exp(x), but NaN at the last element
        return jnp.where(x > 0.9, jnp.nan, jnp.exp(x))

    x = np.linspace(0.0, 1.0, 5)
    assert np.isnan(port_differences(port, torch_exp, x)["output"])
    expected = r"(?s)does not match its original TorchExp .*\n  output: largest difference nan"
    with pytest.raises(AssertionError, match=expected):
        assert_port_matches_original(port, torch_exp, x)
    with pytest.raises(AssertionError, match=r"(?s)- output 0: 1 of 5 elements differ.*vjpkit: nan"):
        assert_matches_torch(torch_exp, port, (x,))


def test_both_checks_let_a_nan_agree_with_a_nan(torch_exp):
    from vjpkit.testing import assert_matches_torch, port_differences

    x = np.array([0.0, np.nan, 0.0])  # exp and its gradient are NaN at element 1 on both sides
    assert port_differences(jnp.exp, torch_exp, x) == {"output": 0.0, "gradient": 0.0}
    assert_matches_torch(torch_exp, jnp.exp, (x,))
