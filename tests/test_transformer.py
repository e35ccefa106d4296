"""The transformer example: its ops against plain JAX and PyTorch, its training step, its runs.

Each Function in examples/transformer_ops.py is checked against the same
maths in plain ``jnp`` differentiated by JAX (gradients under ``jit``,
``vmap``, second order, attention's ``jvp``) and against its PyTorch
original. One training step of examples/train_transformer.py equals plain
autodiff's in float64, and the example itself runs (tiny flags), also
data-parallel over two host devices in a subprocess. The benchmark's PyTorch
model computes the JAX model's loss and gradients.
"""

import contextlib
import importlib.util
import io
import os
import pathlib
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from vjpkit.testing import assert_gradcheck, assert_gradgradcheck, assert_matches_torch

EXAMPLES_DIR = pathlib.Path(__file__).resolve().parent.parent / "examples"
sys.path.insert(0, str(EXAMPLES_DIR))
import transformer_ops as ops  # noqa: E402

pytest.importorskip("optax")
import train_transformer  # noqa: E402

RNG = np.random.default_rng(0)
# (batch, heads, T, D) with T = 8 and block 4: two key blocks, so attention's loops loop.
Q, K, V = (RNG.normal(size=(2, 2, 8, 3)) for _ in range(3))
X, WEIGHT, BIAS = RNG.normal(size=(3, 4, 6)), RNG.normal(size=6), RNG.normal(size=6)
LOGITS, LABELS = RNG.normal(size=(5, 7)), np.array([0, 6, 3, 3, 1])

# name -> (vjpkit Function's apply, plain jnp maths, inputs); attention's block is a static 4. Attention is
# CausalAttention itself, the lax.scan Function, on every backend (on a GPU causal_attention chooses the
# Pallas kernels instead: test_pallas_attention.py).
CASES = {
    "CausalAttention": (lambda q, k, v: ops.CausalAttention.apply(q, k, v, 4), ops.plain_causal_attention, (Q, K, V)),
    "LayerNorm": (ops.layer_norm, ops.plain_layer_norm, (X, WEIGHT, BIAS)),
    "GELU": (ops.gelu, ops.plain_gelu, (X,)),
    "SoftmaxCrossEntropy": (ops.softmax_cross_entropy, ops.plain_softmax_cross_entropy, (LOGITS, LABELS)),
}


def float_argnums(inputs):
    return tuple(i for i, x in enumerate(inputs) if np.issubdtype(np.asarray(x).dtype, np.floating))


def scalar_loss(fn):
    """``sum(sin(fn(...)))``: every output element gets its own cotangent."""
    return lambda *xs: jnp.sin(fn(*xs)).sum()


@pytest.mark.parametrize("name", CASES)
def test_op_passes_gradcheck(name):
    fn, _, inputs = CASES[name]
    assert_gradcheck(fn, inputs)


@pytest.mark.parametrize("name", CASES)
def test_op_jitted_gradient_equals_autodiff_of_plain_maths(name, x64):
    fn, plain, inputs = CASES[name]
    argnums = float_argnums(inputs)
    got = jax.jit(jax.grad(scalar_loss(fn), argnums))(*inputs)
    want = jax.grad(scalar_loss(plain), argnums)(*inputs)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("name", ["CausalAttention", "LayerNorm", "GELU"])
def test_op_per_example_gradients_under_vmap_equal_autodiff(name, x64):
    fn, plain, inputs = CASES[name]
    # LayerNorm's weight and bias are shared by the examples; attention's q, k, v are all per example.
    in_axes = 0 if name != "LayerNorm" else (0, None, None)
    got = jax.vmap(jax.grad(scalar_loss(fn)), in_axes)(*inputs)
    want = jax.vmap(jax.grad(scalar_loss(plain)), in_axes)(*inputs)
    np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)


def test_cross_entropy_per_example_gradients_under_vmap_equal_autodiff(x64):
    logits, labels = LOGITS.reshape(5, 1, 7), LABELS.reshape(5, 1)
    got = jax.vmap(jax.grad(ops.softmax_cross_entropy))(logits, labels)
    want = jax.vmap(jax.grad(ops.plain_softmax_cross_entropy))(logits, labels)
    np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("name", CASES)
def test_op_second_derivative_passes_gradgradcheck(name):
    fn, _, inputs = CASES[name]
    if name == "CausalAttention":  # one batch and head, two blocks of 2: second order's Jacobians grow fast
        fn, inputs = (lambda q, k, v: ops.CausalAttention.apply(q, k, v, 2)), tuple(x[0, 0, :4] for x in inputs)
    assert_gradgradcheck(fn, inputs)


def test_attention_jvp_equals_autodiff_of_plain_maths(x64):
    tangents = tuple(RNG.normal(size=Q.shape) for _ in range(3))
    out, tangent = jax.jit(lambda p, t: jax.jvp(CASES["CausalAttention"][0], p, t))((Q, K, V), tangents)
    want_out, want_tangent = jax.jvp(ops.plain_causal_attention, (Q, K, V), tangents)
    np.testing.assert_allclose(out, want_out, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(tangent, want_tangent, rtol=1e-10, atol=1e-12)


def test_attention_with_one_block_equals_attention_with_several(x64):
    one = jax.grad(scalar_loss(lambda q, k, v: ops.CausalAttention.apply(q, k, v, 8)), (0, 1, 2))(Q, K, V)
    two = jax.grad(scalar_loss(lambda q, k, v: ops.CausalAttention.apply(q, k, v, 2)), (0, 1, 2))(Q, K, V)
    for a, b in zip(one, two, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12)


def test_attention_rejects_a_block_that_does_not_divide_the_length():
    with pytest.raises(ValueError, match=r"CausalAttention: sequence length 8 is not a multiple of block=3; "
                                         r"pass a block that divides it"):
        ops.CausalAttention.apply(Q, K, V, 3)


def residual_bytes(fn, *shapes):
    """Bytes of the arrays ``jax.vjp(fn, ...)``'s pullback closes over: what forward keeps for backward."""
    structs = [jax.ShapeDtypeStruct(shape, jnp.float32) for shape in shapes]
    pullback = jax.eval_shape(lambda *xs: jax.vjp(fn, *xs)[1], *structs)
    return sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(pullback))


def test_attention_keeps_q_k_v_output_and_one_log_sum_exp_per_row():
    t, d = 1024, 32
    saved = residual_bytes(lambda q, k, v: ops.causal_attention(q, k, v, 128), *[(t, d)] * 3)
    assert saved == (4 * t * d + t) * 4
    # Autodiff keeps at least the (T, T) probabilities.
    assert residual_bytes(ops.plain_causal_attention, *[(t, d)] * 3) >= t * t * 4


TORCH_INPUTS = {
    "CausalAttention": (Q, K, V, 4),
    "LayerNorm": (X, WEIGHT, BIAS),
    "GELU": (X,),
    "SoftmaxCrossEntropy": (LOGITS, LABELS),
}


@pytest.mark.parametrize("name", TORCH_INPUTS)
def test_op_matches_its_pytorch_original(name):
    pytest.importorskip("torch")
    # Second order only for GELU: the other originals' backward reads intermediates saved in
    # forward (lse, mean, rstd), which PyTorch's double backward takes for constants (pytorch#58509).
    assert_matches_torch(ops.torch_originals()[name], getattr(ops, name), TORCH_INPUTS[name],
                         check_second_order=name == "GELU")


@pytest.mark.parametrize("name", TORCH_INPUTS)
def test_pytorch_originals_run_on_their_inputs_device(name):
    # PyTorch's meta device stands in for CUDA: a tensor an original makes on the CPU (a mask from
    # torch.arange(t)) cannot meet the inputs there either.
    torch = pytest.importorskip("torch")
    inputs = [torch.tensor(np.asarray(a)).to("meta") if hasattr(a, "shape") else a for a in TORCH_INPUTS[name]]
    inputs = [a.requires_grad_() if torch.is_tensor(a) and a.is_floating_point() else a for a in inputs]
    out = ops.torch_originals()[name].apply(*inputs)
    out.sum().backward()
    assert out.device.type == "meta"
    assert all(a.grad.device.type == "meta" for a in inputs if torch.is_tensor(a) and a.requires_grad)


# ---------------------------------------------------------------------------
# The model.

# Two key blocks of 4: attention's loops loop.
TINY = train_transformer.Config(layers=1, width=8, heads=2, context=8, block=4)


@pytest.mark.slow  # a whole training step traced and compiled twice: CI runs it; the ops' own tests stay
def test_training_step_equals_plain_autodiffs(x64):
    rng = np.random.default_rng(1)
    tokens, targets = train_transformer.sample_batch(rng.integers(0, 128, 500), 3, TINY.context, rng)
    # Jitted: op by op, the initializations would compile a program per operation.
    init = jax.jit(lambda key: jax.tree.map(lambda a: a.astype(jnp.float64), train_transformer.init_params(key, TINY)))
    params = init(jax.random.key(0))
    optimizer = train_transformer.make_optimizer(steps=10, warmup=0)
    state = jax.jit(optimizer.init)(params)
    got = train_transformer.make_train_step(optimizer, TINY)(params, state, tokens, targets)
    want = train_transformer.make_train_step(optimizer, TINY, train_transformer.AUTODIFF_OPS)(
        params, state, tokens, targets)
    assert got[2].dtype == jnp.float64
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-12)


TINY_FLAGS = ["--steps", "30", "--batch", "4", "--layers", "1", "--width", "32", "--heads", "2",
              "--context", "32", "--block", "16", "--eval-every", "15", "--sample", "20"]


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """The example's output with tiny flags, run in this process as ``python examples/train_transformer.py``."""
    plot = tmp_path_factory.mktemp("plot") / "loss.png"
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sys, "argv", ["train_transformer.py", *TINY_FLAGS, "--plot", str(plot)])
        out = _captured(train_transformer.main)
    return out, plot


def _captured(fn):
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer), contextlib.redirect_stderr(io.StringIO()):
        fn()
    return buffer.getvalue()


def val_losses(out):
    return [float(v) for v in re.findall(r"^step +\d+ +train loss [\d.]+ +val loss ([\d.]+)", out, re.MULTILINE)]


@pytest.mark.slow  # the example's whole run, 30 steps
def test_tiny_training_run_lowers_the_validation_loss(tiny_run):
    out, plot = tiny_run
    assert out.startswith("gradcheck: CausalAttention ok, LayerNorm ok, GELU ok, SoftmaxCrossEntropy ok\n")
    first, last = val_losses(out)
    assert last < first < np.log(128)  # below a uniform guess over the 128 characters
    assert "\nsample:\ndef " in out
    if importlib.util.find_spec("matplotlib"):  # the loss curve is drawn when it is installed
        assert plot.stat().st_size > 0


@pytest.mark.slow  # the example's run again, in a second JAX process
def test_data_parallel_run_over_two_devices_ends_at_the_single_device_loss(tiny_run):
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu")
    result = subprocess.run(
        [sys.executable, "train_transformer.py", *TINY_FLAGS, "--sample", "0", "--plot", "", "--no-gradcheck",
         "--data-parallel"],
        cwd=EXAMPLES_DIR, env=env, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "data-parallel over 2 devices (cpu), 2 sequences each" in result.stdout
    np.testing.assert_allclose(val_losses(result.stdout), val_losses(tiny_run[0]), rtol=1e-4)


@pytest.mark.parametrize("flavour", ["originals", "sdpa"])
def test_benchmark_pytorch_model_is_the_vjpkit_model(monkeypatch, flavour):
    pytest.importorskip("torch")
    monkeypatch.syspath_prepend(str(EXAMPLES_DIR.parent / "benchmarks"))
    import transformer as benchmark

    config = TINY
    # "sdpa": torch.nn.functional's layer norm, GELU, scaled_dot_product_attention and cross-entropy (--device gpu).
    loss_fn, params, tokens, targets = benchmark.torch_model(config, flavour=flavour)
    loss = loss_fn(params, tokens, targets)
    loss.backward()
    with jax.default_device(jax.devices("cpu")[0]):  # torch's model runs on the CPU: so does JAX's, on any machine
        jax_params = train_transformer.init_params(jax.random.key(0), config)
        want, grads = jax.value_and_grad(train_transformer.loss_fn)(jax_params, tokens.numpy(), targets.numpy(), config)
    np.testing.assert_allclose(loss.item(), want, rtol=1e-5)
    for got, expected in zip(jax.tree.leaves(params), jax.tree.leaves(grads), strict=True):
        np.testing.assert_allclose(got.grad.numpy(), expected, rtol=1e-4, atol=1e-6)


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="the refusal on a machine whose JAX has no GPU")
def test_benchmark_refuses_device_gpu_without_a_gpu(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES_DIR.parent / "benchmarks"))
    import transformer as benchmark

    monkeypatch.setenv("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # what --device gpu sets; restored after
    monkeypatch.setattr(sys, "argv", ["transformer.py", "--device", "gpu"])
    with pytest.raises(SystemExit, match=r"--device gpu: JAX's default device is cpu, not a GPU \(--allow-cpu"):
        benchmark.main()
