"""``vjpkit.from_torch`` (callbacks): complex gradients in JAX's convention.

PyTorch's and JAX's vector-Jacobian products of a complex function differ by
a conjugate: ``vjp_jax(ct) = conj(vjp_torch(conj(ct)))``. from_torch gives
JAX's, for complex inputs and for complex outputs of real inputs (``fft.*``,
``stft``, ``polar``, ``complex``, ``view_as_complex``, ``linalg.eig``), at
every order. Expected values are ``jax.vjp`` of the same maths in ``jnp``,
and, where JAX has no counterpart, torch's own numbers through that formula.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import vjpkit

torch = pytest.importorskip("torch")  # CI installs the torch extra

RNG = np.random.default_rng(0)
R = RNG.standard_normal(8)  # real input
Z = RNG.standard_normal(5) + 1j * RNG.standard_normal(5)  # complex input
M = RNG.standard_normal((3, 3))


def complex_cotangent(shape):
    rng = np.random.default_rng(1)
    return rng.standard_normal(shape) + 1j * rng.standard_normal(shape)


def assert_vjps_equal(torch_fn, jax_fn, *args):
    """from_torch(torch_fn)'s vjp at a complex (or real) cotangent equals jax.vjp of jax_fn."""
    args = [jnp.asarray(a) for a in args]
    want_out, want_vjp = jax.vjp(jax_fn, *args)
    ct = complex_cotangent(want_out.shape)
    ct = jnp.asarray(ct if jnp.iscomplexobj(want_out) else ct.real, want_out.dtype)
    got_out, got_vjp = jax.vjp(vjpkit.from_torch(torch_fn), *args)
    np.testing.assert_allclose(got_out, want_out, rtol=1e-10, atol=1e-12)
    for got, want in zip(got_vjp(ct), want_vjp(ct), strict=True):
        assert got.dtype == want.dtype
        np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)


CASES = {
    # complex outputs of real inputs
    "fft.rfft": (lambda x: torch.fft.rfft(x), lambda x: jnp.fft.rfft(x), (R,)),
    "fft.fft": (lambda x: torch.fft.fft(x), lambda x: jnp.fft.fft(x), (R,)),
    "polar": (lambda r, t: torch.polar(r, t), lambda r, t: r * jnp.exp(1j * t), (np.abs(R) + 0.5, R)),
    "complex": (lambda a, b: torch.complex(a, b), lambda a, b: jax.lax.complex(a, b), (R, R[::-1].copy())),
    "view_as_complex": (lambda x: torch.view_as_complex(x.reshape(4, 2)),
                        lambda x: x.reshape(4, 2)[:, 0] + 1j * x.reshape(4, 2)[:, 1], (R,)),
    # complex inputs
    "sin": (lambda z: torch.sin(z), lambda z: jnp.sin(z), (Z,)),
    "z * conj(z) * z": (lambda z: z * z.conj() * z, lambda z: z * jnp.conj(z) * z, (Z,)),
    # real outputs of complex inputs
    "abs": (lambda z: torch.abs(z), lambda z: jnp.abs(z), (Z,)),
    "fft.irfft": (lambda z: torch.fft.irfft(z), lambda z: jnp.fft.irfft(z), (Z,)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_vjp_equals_jaxs(name, x64):
    torch_fn, jax_fn, args = CASES[name]
    assert_vjps_equal(torch_fn, jax_fn, *args)


def test_grad_of_a_real_loss_through_rfft_equals_jax_grad(x64):
    w = jnp.asarray(complex_cotangent(5))
    rfft = vjpkit.from_torch(lambda x: torch.fft.rfft(x))
    got = jax.jit(jax.grad(lambda x: jnp.abs(rfft(x) * w).sum()))(R)
    want = jax.grad(lambda x: jnp.abs(jnp.fft.rfft(x) * w).sum())(R)
    np.testing.assert_allclose(got, want, rtol=1e-10)


def test_grad_with_respect_to_a_complex_input_equals_jax_grad(x64):
    sin = vjpkit.from_torch(lambda z: torch.sin(z))
    got = jax.grad(lambda z: sin(z).real.sum())(jnp.asarray(Z))
    np.testing.assert_allclose(got, jax.grad(lambda z: jnp.sin(z).real.sum())(jnp.asarray(Z)), rtol=1e-12)


def test_a_function_class_backward_gets_torchs_convention(x64):
    """The original's backward sees what it would in PyTorch: grad_output conjugated back."""

    class TSquare(torch.autograd.Function):
        @staticmethod
        def forward(ctx, z):
            ctx.save_for_backward(z)
            return z * z

        @staticmethod
        def backward(ctx, g):  # PyTorch's convention: g * conj(dy/dz)
            (z,) = ctx.saved_tensors
            return g * (2 * z).conj()

    Square = vjpkit.from_torch(TSquare)
    z = jnp.asarray(Z)
    ct = jnp.asarray(complex_cotangent(5))
    got = jax.vjp(Square.apply, z)[1](ct)[0]
    np.testing.assert_allclose(got, jax.vjp(lambda z: z * z, z)[1](ct)[0], rtol=1e-12)


def test_linalg_eig_equals_torch_through_the_conjugation_formula(x64):
    """JAX's eig has no reverse rule on every version: the reference is torch, conjugated as JAX's convention is."""
    eigvals = vjpkit.from_torch(lambda m: torch.linalg.eig(m)[0])
    ct = complex_cotangent(3)
    got = jax.vjp(eigvals, jnp.asarray(M))[1](jnp.asarray(ct))[0]
    m = torch.tensor(M, requires_grad=True)
    (g,) = torch.autograd.grad(torch.linalg.eig(m)[0], m, torch.tensor(ct).conj())
    np.testing.assert_allclose(got, np.conj(g.numpy()), rtol=1e-10)


def test_stft_equals_torch_through_the_conjugation_formula(x64):
    x = RNG.standard_normal(32)
    window = np.hanning(8)

    def spectrum(x, window):
        return torch.stft(x, 8, hop_length=4, window=window, return_complex=True)

    stft = vjpkit.from_torch(spectrum)
    out = stft(jnp.asarray(x), jnp.asarray(window))
    ct = complex_cotangent(out.shape)
    got = jax.vjp(stft, jnp.asarray(x), jnp.asarray(window))[1](jnp.asarray(ct))
    xt, wt = torch.tensor(x, requires_grad=True), torch.tensor(window, requires_grad=True)
    want = torch.autograd.grad(spectrum(xt, wt), (xt, wt), torch.tensor(ct).conj())
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, np.conj(w.numpy()), rtol=1e-10, atol=1e-12)


def test_second_order_through_a_complex_intermediate_equals_jax(x64):
    fn = vjpkit.from_torch(lambda x: torch.fft.rfft(torch.sin(x)) * torch.fft.rfft(x))

    def loss(f):
        return lambda x: jnp.abs(f(x)).sum()

    got = jax.grad(lambda x: jax.grad(loss(fn))(x).sum())(jnp.asarray(R))
    want = jax.grad(lambda x: jax.grad(loss(lambda x: jnp.fft.rfft(jnp.sin(x)) * jnp.fft.rfft(x)))(x).sum())(
        jnp.asarray(R))
    np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-12)


def test_second_order_with_respect_to_a_complex_input_equals_jax(x64):
    fn = vjpkit.from_torch(lambda z: torch.sin(z) * z)
    z = jnp.asarray(Z)
    got = jax.grad(lambda z: jax.grad(lambda z: fn(z).real.sum())(z).imag.sum())(z)
    want = jax.grad(lambda z: jax.grad(lambda z: (jnp.sin(z) * z).real.sum())(z).imag.sum())(z)
    np.testing.assert_allclose(got, want, rtol=1e-10)


def test_forward_mode_of_a_complex_function_equals_jax_jvp(x64):
    fn = vjpkit.from_torch(lambda z: torch.sin(z) * z.conj())
    z, t = jnp.asarray(Z), jnp.asarray(complex_cotangent(5))
    got = jax.jvp(fn, (z,), (t,))
    want = jax.jvp(lambda z: jnp.sin(z) * jnp.conj(z), (z,), (t,))
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-12)


def test_hessian_through_rfft_equals_jax(x64):
    fn = vjpkit.from_torch(lambda x: torch.fft.rfft(x * x))
    got = jax.hessian(lambda x: jnp.abs(fn(x)).sum())(jnp.asarray(R[:4]))
    want = jax.hessian(lambda x: jnp.abs(jnp.fft.rfft(x * x)).sum())(jnp.asarray(R[:4]))
    np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-10)
