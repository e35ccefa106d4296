"""Training with vjpkit Functions: the numbers the examples promise.

The training examples run here, once each: their own ``main()`` in this
process (with the examples directory on ``sys.path`` and ``sys.argv`` set, as
``python examples/NAME.py`` would have them), and the numbers they print are
checked; tests/test_examples.py leaves them to this file. The sharded example
needs 8 host devices, which XLA only creates at start-up, so it runs in a
subprocess.
"""

import importlib.util
import os
import pathlib
import re
import subprocess
import sys

import numpy as np
import pytest

EXAMPLES_DIR = pathlib.Path(__file__).resolve().parent.parent / "examples"
BENCHMARKS_DIR = EXAMPLES_DIR.parent / "benchmarks"


@pytest.fixture(autouse=True)
def examples_importable(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES_DIR))


def run_main(module, *args):
    """Runs the example script's ``main()`` as ``python examples/NAME.py ARGS`` would."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sys, "argv", [f"{module.__name__}.py", *args])
        module.main()


def printed(pattern, out):
    """Every match of ``pattern`` (one group, a number) in the printed lines, as floats."""
    return [float(value) for value in re.findall(pattern, out, re.MULTILINE)]


def test_layers_pass_gradcheck():
    import layers

    assert layers.gradcheck_layers() == ["Linear", "ReLU", "SoftmaxCrossEntropy"]


def test_digits_classifier_reaches_95_percent_test_accuracy(capsys, tmp_path):
    pytest.importorskip("optax")
    pytest.importorskip("sklearn")
    import train_mlp

    run_main(train_mlp, "--plot", str(tmp_path / "loss.png"))
    out = capsys.readouterr().out

    assert out.startswith("gradcheck: Linear ok, ReLU ok, SoftmaxCrossEntropy ok\n")
    losses = printed(r"^epoch +\d+ +loss ([\d.]+)", out)
    (accuracy,) = printed(r"^test accuracy: ([\d.]+)%", out)
    assert len(losses) == 30
    assert accuracy >= 95.0
    assert losses[-1] < losses[0] / 10
    if importlib.util.find_spec("matplotlib"):  # the loss curve is drawn when it is installed
        assert (tmp_path / "loss.png").stat().st_size > 0


@pytest.mark.slow  # a second JAX process with 8 devices, training 3 epochs twice
def test_data_parallel_training_ends_at_the_single_device_loss():
    pytest.importorskip("optax")
    pytest.importorskip("sklearn")
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    result = subprocess.run(
        [sys.executable, "train_sharded.py", "--epochs", "3"],
        cwd=EXAMPLES_DIR,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.startswith("8 devices (cpu)")
    sharded, single = map(float, re.search(r"sharded ([\d.]+), one device ([\d.]+)", result.stdout).groups())
    assert sharded == pytest.approx(single, rel=1e-4)


def test_function_inside_equinox_module_trains_with_optax(capsys):
    pytest.importorskip("equinox")
    pytest.importorskip("optax")
    import equinox_module

    run_main(equinox_module, "--steps", "300")
    assert printed(r"^final mse: ([\d.]+)$", capsys.readouterr().out)[0] < 1e-3


def test_function_inside_flax_nnx_module_trains_with_optax(capsys):
    pytest.importorskip("flax")
    pytest.importorskip("optax")
    import flax_nnx_module

    run_main(flax_nnx_module, "--steps", "300")
    assert printed(r"^final mse: ([\d.]+)$", capsys.readouterr().out)[0] < 1e-3


def test_fused_cross_entropies_give_autodiff_gradients():
    import memory

    memory.check_same_gradients()


def test_fused_cross_entropies_need_less_temporary_memory_than_autodiff():
    import memory

    tokens, vocab = 1024, 16384
    temp = memory.measure(tokens=tokens, d_model=128, vocab=vocab)
    logits_bytes = tokens * vocab * 4
    # Autodiff keeps logits and softmax, SoftmaxCrossEntropy the logits only;
    # how much of that XLA's buffer reuse turns into less peak memory depends
    # on the XLA release: one (tokens, vocab) buffer with JAX 0.4.38 and 0.10,
    # none with 0.5 to 0.9. It is never more.
    assert temp["SoftmaxCrossEntropy"] <= temp["plain autodiff"]
    # LinearCrossEntropy holds a few (tokens, 4096) chunks, never a (tokens, vocab) buffer.
    assert temp["LinearCrossEntropy"] < 0.6 * logits_bytes


def test_benchmark_autodiff_model_is_the_vjpkit_model(monkeypatch):
    pytest.importorskip("optax")
    pytest.importorskip("sklearn")
    import jax

    monkeypatch.syspath_prepend(str(BENCHMARKS_DIR))
    import train_mlp
    import train_step

    rng = np.random.default_rng(0)
    x = rng.normal(size=(8, 64)).astype(np.float32)
    y = rng.integers(0, 10, size=8).astype(np.int32)
    params = train_mlp.init_params(jax.random.key(0))
    # Jitted: two compilations instead of one per op of each model.
    want_loss, want_grads = jax.jit(jax.value_and_grad(train_step.plain_loss))(params, x, y)
    got_loss, got_grads = jax.jit(jax.value_and_grad(train_mlp.loss_fn))(params, x, y)

    np.testing.assert_allclose(got_loss, want_loss, rtol=1e-6)
    for got, want in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
