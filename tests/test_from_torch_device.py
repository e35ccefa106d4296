"""``vjpkit.from_torch`` on the device where JAX's arrays are: torch runs on XLA's own buffers.

Where JAX has ``jax.experimental.buffer_callback``, the original receives
tensors sharing the arrays' memory (here, on the CPU, the same addresses);
elsewhere (JAX before 0.6) it runs in ``jax.pure_callback`` on host arrays.
Both paths run here: the device one where this JAX has it, the host one
forced. Expected values are ``jax.grad`` of the same maths in JAX (swish's
hand-written backward is its derivative).
"""

import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import vjpkit
from vjpkit._torch.device import host_callbacks  # internal on purpose: forces the fallback path

torch = pytest.importorskip("torch")  # CI installs the torch extra
from torch_functions import TORCH_DEVICE, TorchAddOneInPlace  # noqa: E402

# Decided apart from vjpkit's own detection: whether this JAX has the public module at all.
HAS_BUFFER_CALLBACK = importlib.util.find_spec("jax.experimental.buffer_callback") is not None
NO_BUFFER_CALLBACK = "this JAX lacks jax.experimental.buffer_callback (JAX 0.6 on): from_torch takes pure_callback"
X = np.array([0.3, -1.2, 2.0, 0.5], np.float32)


class TSwish(torch.autograd.Function):
    """x * sigmoid(x) with its hand-written backward; records what torch was handed when it ran."""

    seen: list = []  # (method, address, device) of x; not the meta tensors of vjpkit's shape inference

    @staticmethod
    def forward(ctx, x):
        if x.device.type != "meta":
            TSwish.seen.append(("forward", x.data_ptr(), x.device.type))
        ctx.save_for_backward(x)
        return x * torch.sigmoid(x)

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        TSwish.seen.append(("backward", x.data_ptr(), x.device.type))
        s = torch.sigmoid(x)
        return g * (s * (1 + x * (1 - s)))


class TSwishBatched(TSwish):
    """The same with torch's generated vmap rule: jax.vmap hands it the whole batch at once."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x):
        return x * torch.sigmoid(x)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[0])


def swish(x):
    return x * jax.nn.sigmoid(x)


def primitives(fn, *args):
    return str(jax.make_jaxpr(fn)(*args))


@pytest.fixture(params=["device", "host"])
def path(request):
    """The path a test's calls take while they are traced: the device buffers, or host callbacks forced."""
    if request.param == "device" and not HAS_BUFFER_CALLBACK:
        pytest.skip(NO_BUFFER_CALLBACK)
    if request.param == "host":
        with host_callbacks():
            yield request.param
    else:
        yield request.param


def committed(x):
    return jax.device_put(jnp.asarray(x), jax.devices()[0])


def test_the_callback_is_jaxs_buffer_callback_where_jax_has_it_and_pure_callback_elsewhere():
    Swish = vjpkit.from_torch(TSwish)
    x = jnp.asarray(X)
    for fn in (Swish.apply, jax.grad(lambda x: Swish.apply(x).sum())):
        jaxpr = primitives(fn, x)
        assert ("buffer_callback" in jaxpr) == HAS_BUFFER_CALLBACK
        assert ("pure_callback" in jaxpr) != HAS_BUFFER_CALLBACK


def test_host_callbacks_forces_pure_callback():
    Swish = vjpkit.from_torch(TSwish)
    with host_callbacks():
        jaxpr = primitives(Swish.apply, jnp.asarray(X))
    assert "pure_callback" in jaxpr and "buffer_callback" not in jaxpr


@pytest.mark.skipif(not HAS_BUFFER_CALLBACK, reason=NO_BUFFER_CALLBACK)
def test_the_original_works_on_the_input_arrays_own_memory():
    Swish = vjpkit.from_torch(TSwish)
    x = committed(X)
    TSwish.seen.clear()
    jax.block_until_ready(jax.jit(Swish.apply)(x))
    assert TSwish.seen == [("forward", x.unsafe_buffer_pointer(), TORCH_DEVICE)]


@pytest.mark.skipif(not HAS_BUFFER_CALLBACK, reason=NO_BUFFER_CALLBACK)
def test_the_original_backward_works_on_the_saved_inputs_own_memory():
    Swish = vjpkit.from_torch(TSwish)
    x = committed(X)
    TSwish.seen.clear()
    jax.block_until_ready(jax.jit(jax.grad(lambda x: Swish.apply(x).sum()))(x))
    # XLA drops the unused forward callback: the backward one runs forward again, on x itself.
    at = (x.unsafe_buffer_pointer(), TORCH_DEVICE)
    assert TSwish.seen == [("forward", *at), ("backward", *at)]


@pytest.mark.skipif(not HAS_BUFFER_CALLBACK, reason=NO_BUFFER_CALLBACK)
def test_copy_inputs_hands_torch_a_copy_on_the_device_path():
    Swish = vjpkit.from_torch(TSwish, copy_inputs=True)
    x = committed(X)
    TSwish.seen.clear()
    jax.block_until_ready(jax.jit(Swish.apply)(x))
    assert TSwish.seen[0][1] != x.unsafe_buffer_pointer()


def test_an_original_writing_into_its_input_is_refused_while_tracing():
    # Before any run: on the device path a run would write into the array's own buffer.
    AddOne = vjpkit.from_torch(TorchAddOneInPlace)
    x = committed(np.zeros(3, np.float32))
    with pytest.raises(RuntimeError, match=r"TorchAddOneInPlace\.forward \(PyTorch, run by vjpkit\.from_torch\) "
                                           r"wrote into its input x in place.*copy_inputs=True"):
        jax.make_jaxpr(AddOne.apply)(x)
    with pytest.raises(RuntimeError, match="wrote into its input x in place"):
        AddOne.apply(x)
    np.testing.assert_array_equal(x, np.zeros(3))


def test_copy_inputs_leaves_the_array_unchanged(path):
    AddOne = vjpkit.from_torch(TorchAddOneInPlace, copy_inputs=True)
    x = committed(np.zeros(3, np.float32))
    np.testing.assert_array_equal(jax.jit(AddOne.apply)(x), np.ones(3))
    np.testing.assert_array_equal(x, np.zeros(3))


def test_values_and_gradients_under_jit_grad_vmap_and_scan(path):
    Swish = vjpkit.from_torch(TSwish)
    x = jnp.asarray(X)
    xs = jnp.stack([x, 2 * x, -x])
    loss = lambda f: lambda x: (f(x) * x).sum()  # noqa: E731
    np.testing.assert_allclose(jax.jit(Swish.apply)(x), swish(x), rtol=1e-6)
    np.testing.assert_allclose(jax.jit(jax.grad(loss(Swish.apply)))(x), jax.grad(loss(swish))(x), rtol=1e-6)
    np.testing.assert_allclose(jax.grad(loss(Swish.apply))(x), jax.grad(loss(swish))(x), rtol=1e-6)
    np.testing.assert_allclose(jax.vmap(jax.grad(loss(Swish.apply)))(xs), jax.vmap(jax.grad(loss(swish)))(xs),
                               rtol=1e-6)

    def scanned(f):
        return lambda xs: jax.lax.scan(lambda c, x: (c + (f(x) * x).sum(), None), 0.0, xs)[0]

    np.testing.assert_allclose(jax.jit(jax.grad(scanned(Swish.apply)))(xs), jax.grad(scanned(swish))(xs),
                               rtol=1e-6)


def test_torchs_own_vmap_rule_gets_the_batch(path):
    Swish = vjpkit.from_torch(TSwishBatched)
    xs = jnp.stack([jnp.asarray(X), -jnp.asarray(X)])
    np.testing.assert_allclose(jax.jit(jax.vmap(Swish.apply))(xs), swish(xs), rtol=1e-6)
    # An unbatched argument arrives with a batch axis of 1 (vmap_method="expand_dims").
    scale = vjpkit.from_torch(lambda x, s: x * s)
    np.testing.assert_allclose(jax.vmap(scale, in_axes=(0, None))(xs, jnp.float32(3.0)), 3 * xs, rtol=1e-6)


def test_forward_mode_and_several_output_kinds(path):
    def parts(x):
        return torch.sin(x), x > 0, x.to(torch.bfloat16)

    Parts = vjpkit.from_torch(parts)
    x = jnp.asarray(X)
    sin, positive, low = jax.jit(Parts)(x)
    np.testing.assert_allclose(sin, jnp.sin(x), rtol=1e-6)
    np.testing.assert_array_equal(positive, X > 0)
    assert low.dtype == jnp.bfloat16
    np.testing.assert_array_equal(low, x.astype(jnp.bfloat16))
    _, tangent = jax.jvp(lambda x: Parts(x)[0], (x,), (jnp.ones_like(x),))
    np.testing.assert_allclose(tangent, jnp.cos(x), rtol=1e-6)


def test_float64_crosses_as_float64(path):
    from vjpkit._jax_internals import enable_x64  # jax.enable_x64 or its older home

    with enable_x64(True):
        Swish = vjpkit.from_torch(TSwish)
        x = jnp.asarray(X.astype(np.float64))
        y = jax.jit(Swish.apply)(x)
        assert y.dtype == jnp.float64
        np.testing.assert_allclose(y, swish(x), rtol=1e-12)
        np.testing.assert_allclose(jax.grad(lambda x: Swish.apply(x).sum())(x), jax.grad(lambda x: swish(x).sum())(x),
                                   rtol=1e-12)


class FakeBuffer:
    def __init__(self, device):
        self.device = device

    def __dlpack_device__(self):
        return self.device


class FakeContext:
    """A buffer callback's execution context; reading its stream off a GPU raises, as XLA's does."""

    def __init__(self, stream):
        self._stream = stream

    @property
    def stream(self):
        if self._stream is None:
            raise RuntimeError("UNIMPLEMENTED: XLA FFI GPU context is not available")
        return self._stream


class FakeCuda:
    """torch.cuda's two calls the GPU path makes, recorded (no GPU runs these tests)."""

    def __init__(self):
        self.calls = []

    def ExternalStream(self, pointer, device):  # noqa: N802 - torch's name
        self.calls.append(("ExternalStream", pointer, device))
        return ("stream", pointer)

    def stream(self, stream):
        self.calls.append(("stream", stream))
        return "torch.cuda.stream context"


def test_on_a_gpu_torch_runs_on_xlas_stream_on_the_buffers_device():
    from vjpkit._torch.device import _on_xla_stream

    fake = type("FakeTorch", (), {"cuda": FakeCuda(), "device": staticmethod(lambda kind, index: f"{kind}:{index}")})
    kCUDA = 2  # noqa: N806 - DLPack's name for a CUDA device
    got = _on_xla_stream(fake, FakeContext(0xABC), [FakeBuffer((kCUDA, 1)), FakeBuffer((kCUDA, 1))])
    assert got == "torch.cuda.stream context"
    assert fake.cuda.calls == [("ExternalStream", 0xABC, "cuda:1"), ("stream", ("stream", 0xABC))]


def test_on_the_cpu_no_stream_is_read():
    from vjpkit._torch.device import _on_xla_stream

    fake = type("FakeTorch", (), {"cuda": FakeCuda()})
    kCPU = 1  # noqa: N806 - DLPack's name for the host
    with _on_xla_stream(fake, FakeContext(None), [FakeBuffer((kCPU, 0))]):
        pass
    with _on_xla_stream(fake, FakeContext(None), []):  # no array at all
        pass
    assert fake.cuda.calls == []
