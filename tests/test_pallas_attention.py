"""The flash-attention Function whose forward and backward are Pallas kernels (examples/pallas_attention.py).

The kernels run in Pallas's interpret mode here, on every backend (the kernel
bodies evaluated as JAX operations, their matrix products in full float32,
so the tolerances are float32's), at tiny shapes (one
batch, two heads, T = 32 or 64, head dimension 16, tiles of 16, so every
kernel's loops take several blocks, masked and unmasked). Its backward is
the derivative of forward's maths, so plain JAX autodiff of softmax
attention is the reference: gradients under ``jit``, ``vmap``, bfloat16
inputs, ``needs_input_grad``, the errors, the refused second derivative,
and ``jax.export`` for CUDA on this machine (the Triton lowering needs no
GPU). transformer_ops.py's ``causal_attention`` chooses these kernels on a
GPU and its ``lax.scan`` version elsewhere. The compiled kernels are checked
on a GPU by ``python examples/pallas_attention.py``, a step of
``scripts/gpu_check.sh`` (at the tolerance of the matrix units' float32
mode, TF32), and by the GPU benchmark's kernel check.
"""

import pathlib
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jaxprs import equations

import vjpkit
from vjpkit.testing import assert_gradcheck

EXAMPLES_DIR = pathlib.Path(__file__).resolve().parent.parent / "examples"
sys.path.insert(0, str(EXAMPLES_DIR))
import pallas_attention as pa  # noqa: E402
import transformer_ops as ops  # noqa: E402

ON_GPU = jax.default_backend() == "gpu"


@pytest.fixture(autouse=True)
def full_float32_products():
    """XLA's float32 matrix products run in full float32, as on the CPU (a GPU's default is TF32)."""
    with jax.default_matmul_precision("highest"):
        yield

RNG = np.random.default_rng(0)
SHAPE = (1, 2, 64, 16)  # batch, heads, T, head dimension
Q, K, V = (RNG.normal(size=SHAPE).astype(np.float32) for _ in range(3))
BLOCK = 16  # four query blocks and four key blocks: skipped, masked and unmasked tiles


def flash(q, k, v):
    """The kernels, interpreted (on a GPU too: these tests judge the kernels' maths at float32's tolerance)."""
    return pa.flash_attention(q, k, v, BLOCK, True)


def loss(attention):
    """``sum(sin(attention(...)))`` in float32: every output element gets its own cotangent."""
    return lambda *xs: jnp.sin(attention(*xs).astype(jnp.float32)).sum()


@pytest.mark.skipif(ON_GPU, reason="the choice where the default backend is not a GPU")
def test_off_a_gpu_the_kernels_are_interpreted_by_default():
    assert pa.interpret_default()


def output_and_gradients(attention):
    """A jitted ``(q, k, v, cotangent) -> (output, dq, dk, dv)``: one program for the forward and backward kernels."""
    def run(q, k, v, cotangent):
        out, pullback = jax.vjp(attention, q, k, v)
        return (out, *pullback(cotangent.astype(out.dtype)))
    return jax.jit(run)


COTANGENT = RNG.normal(size=SHAPE).astype(np.float32)


def test_output_and_jitted_gradients_equal_autodiff_of_plain_attention():
    got = output_and_gradients(flash)(Q, K, V, COTANGENT)
    want = output_and_gradients(ops.plain_causal_attention)(Q, K, V, COTANGENT)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)


def test_per_example_gradients_under_vmap_equal_autodiff():
    q, k, v = (x[0, :, :32] for x in (Q, K, V))  # vmap over the heads: (2, 32, 16)
    got = jax.jit(jax.vmap(jax.grad(loss(flash), (0, 1, 2))))(q, k, v)
    want = jax.jit(jax.vmap(jax.grad(loss(pa.reference_attention), (0, 1, 2))))(q, k, v)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)


def test_bfloat16_inputs_accumulate_in_float32():
    q, k, v = (jnp.asarray(x, jnp.bfloat16) for x in (Q, K, V))
    got = output_and_gradients(flash)(q, k, v, COTANGENT)
    assert all(x.dtype == jnp.bfloat16 for x in got)
    # The reference computes in float32 from the same bfloat16 values: the difference is bfloat16's
    # rounding of the outputs and of the probabilities the kernels feed to their second matrix products.
    want = output_and_gradients(pa.reference_attention)(q, k, v, COTANGENT)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(g, np.float32), w, rtol=2e-2, atol=2e-2)


def test_gradcheck_in_float64():
    # One head, T = 32 (two blocks of 16), head dimension 4 (interpret mode needs no tile of 16 there).
    q, k, v = (x[0, :1, :32, :4].astype(np.float64) for x in (Q, K, V))
    assert_gradcheck(flash, (q, k, v))


def test_forward_keeps_q_k_v_the_output_and_a_float32_log_sum_exp_per_row():
    shape = jax.ShapeDtypeStruct((2, 256, 64), jnp.bfloat16)
    pullback = jax.eval_shape(lambda *x: jax.vjp(lambda *a: pa.flash_attention(*a, 64), *x)[1], shape, shape, shape)
    leaves = jax.tree.leaves(pullback)
    assert sum(leaf.size * leaf.dtype.itemsize for leaf in leaves) == 4 * (2 * 256 * 64) * 2 + 2 * 256 * 4


KERNELS = ("flash_attention_forward", "flash_attention_dq", "flash_attention_dkdv")


def _kernel_name(eqn):
    """A ``pallas_call``'s kernel: its ``name_and_src_info`` parameter, or (JAX 0.7) its kernel's debug info."""
    named = eqn.params.get("name_and_src_info")
    if named is not None:
        return named.name
    return eqn.params["jaxpr"].debug_info.func_src_info.split()[0]


def count_kernel_calls(fn, *args):
    """How many times each kernel (by name) is called in ``fn``'s jaxpr, nested ones included."""
    counts = dict.fromkeys(KERNELS, 0)
    for eqn in equations(jax.make_jaxpr(fn)(*args).jaxpr):
        if eqn.primitive.name == "pallas_call" and _kernel_name(eqn) in counts:
            counts[_kernel_name(eqn)] += 1
    return counts


def test_backward_runs_only_the_kernels_needs_input_grad_asks_for():
    only_q = count_kernel_calls(jax.grad(loss(flash), 0), Q, K, V)
    assert only_q["flash_attention_dq"] > 0 and only_q["flash_attention_dkdv"] == 0
    only_v = count_kernel_calls(jax.grad(loss(flash), 2), Q, K, V)
    assert only_v["flash_attention_dq"] == 0 and only_v["flash_attention_dkdv"] > 0
    every = count_kernel_calls(jax.grad(loss(flash), (0, 1, 2)), Q, K, V)
    assert every["flash_attention_dq"] > 0 and every["flash_attention_dkdv"] > 0


def test_second_derivative_is_refused_by_name():
    q, k, v = (x[:, :1, :32] for x in (Q, K, V))
    with pytest.raises(RuntimeError, match=r"FlashAttention\.backward is decorated with @once_differentiable"):
        jax.grad(lambda q: jax.grad(loss(flash))(q, k, v).sum())(q)


def test_forward_mode_is_refused_by_name():
    q = Q[0, 0, :32]
    with pytest.raises(TypeError, match=r"FlashAttention has no forward-mode derivative"):
        jax.jvp(flash, (q, q, q), (q, q, q))


@pytest.mark.parametrize(("args", "error", "message"), [
    ((Q, K[:, :, :32], V), ValueError, r"FlashAttention: q, k and v must have one shape"),
    ((Q, K.astype(np.float16), V), TypeError, r"FlashAttention: q, k and v must have one floating dtype"),
    ((Q, K, V, 24), ValueError, r"FlashAttention: block=24 is not a power of two"),
])
def test_errors_name_the_function(args, error, message):
    with pytest.raises(error, match=message):
        pa.flash_attention(*args)


def test_the_gpu_kernels_need_sequences_in_tiles_of_16():
    q = jnp.zeros((1, 24, 16), jnp.float32)
    with pytest.raises(ValueError, match=r"FlashAttention: sequence length 24 is not a multiple of 16"):
        pa.flash_attention(q, q, q, None, False)


def test_the_gpu_kernels_refuse_a_block_below_16():
    q = jnp.zeros((1, 32, 16), jnp.float32)
    with pytest.raises(ValueError, match=r"FlashAttention: block=8 is below 16, the GPU kernels' smallest tile"):
        pa.flash_attention(q, q, q, 8, False)


def test_kernels_lower_for_cuda_on_this_machine():
    shape = jax.ShapeDtypeStruct((2, 4, 256, 64), jnp.bfloat16)
    grad = jax.grad(loss(lambda *x: pa.flash_attention(*x, None, False)), (0, 1, 2))
    exported = pa.export_for_cuda(grad, shape, shape, shape)
    assert exported.platforms == ("cuda",)
    text = exported.mlir_module()
    # Three Triton kernels, no interpreter's loops: forward's (again, under grad), dq's and dk/dv's.
    assert set(re.findall(r'name = "(flash_attention_\w+)"', text)) == {
        "flash_attention_forward", "flash_attention_dq", "flash_attention_dkdv"}
    assert re.search(r"custom_call @(__gpu\$xla\.gpu\.triton|triton_kernel_call_ffi)", text)


def test_transformer_ops_choose_the_scan_on_the_cpu_and_the_kernels_on_a_gpu(monkeypatch):
    def kernels(fn):
        return count_kernel_calls(jax.grad(loss(fn), (0, 1, 2)), Q, K, V)

    assert ops.use_pallas_kernels() == ON_GPU
    attention = lambda *x: ops.causal_attention(*x, BLOCK)  # noqa: E731
    monkeypatch.setattr(ops, "use_pallas_kernels", lambda: False)  # what any other backend answers
    assert set(kernels(attention).values()) == {0}
    assert "scan" in str(jax.make_jaxpr(attention)(Q, K, V))
    monkeypatch.setattr(ops, "use_pallas_kernels", lambda: True)  # what a GPU backend answers
    assert kernels(attention) == kernels(flash)
    assert all(kernels(attention).values())


def test_the_function_is_a_vjpkit_function_with_a_once_differentiable_backward():
    assert issubclass(pa.FlashAttention, vjpkit.Function)
    assert pa.FlashAttention.backward._vjpkit_once_differentiable


def test_pinning_the_cpu_chooses_the_scan_and_interpreted_kernels_on_any_machine():
    with jax.default_device(jax.devices("cpu")[0]):
        assert pa.interpret_default() and not ops.use_pallas_kernels()
    with jax.default_device("cpu"):
        assert pa.interpret_default() and not ops.use_pallas_kernels()
