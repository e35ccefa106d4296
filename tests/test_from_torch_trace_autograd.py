"""Trace mode keeps torch's autograd semantics: ``detach``, ``.data``, ``no_grad`` and ``torch.autograd.grad``.

Each expected gradient is torch's own: the same callable run eagerly by
torch, differentiated by ``torch.autograd.grad`` (what callback mode does).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import vjpkit

torch = pytest.importorskip("torch")  # CI installs the torch extra

X = np.array([0.3, -1.2, 2.6, 1.5], np.float32)
W = np.array([1.0, 2.0, 3.0, 4.0], np.float32)


def torch_gradient(fn, x=X, w=W):
    """d sum(w * fn(x)) / dx, by torch."""
    t = torch.tensor(x, requires_grad=True)
    out = fn(t)
    (g,) = torch.autograd.grad((out * torch.tensor(w)).sum(), t, allow_unused=True)
    return np.zeros_like(x) if g is None else g.numpy()


def traced_gradient(fn, x=X, w=W):
    traced = vjpkit.from_torch(fn, mode="trace")
    return np.asarray(jax.jit(jax.grad(lambda x: (traced(x) * w).sum()))(x))


def assert_torchs_gradient(fn):
    want = torch_gradient(fn)
    np.testing.assert_allclose(traced_gradient(fn), want, rtol=1e-6)
    return want


def test_straight_through_detach_gives_torchs_gradient():
    want = assert_torchs_gradient(lambda x: x + (torch.round(x) - x).detach())
    np.testing.assert_array_equal(want, W)


def test_data_and_detach_function_and_detach_in_place_stop_the_gradient():
    assert_torchs_gradient(lambda x: x * (x * x).data)
    assert_torchs_gradient(lambda x: x * torch.detach(x * x))

    def detached_in_place(x):
        y = x * x
        y.detach_()
        return x * y

    assert_torchs_gradient(detached_in_place)


def test_no_grad_stops_the_gradient_of_what_it_computes():
    def scaled(x):
        with torch.no_grad():
            s = x * 3
        return x * s

    np.testing.assert_allclose(assert_torchs_gradient(scaled), W * 3 * X, rtol=1e-6)


def test_enable_grad_inside_no_grad_and_set_grad_enabled():
    def nested(x):
        with torch.no_grad():
            a = x.exp()
            with torch.enable_grad():
                b = x.sin()
        with torch.set_grad_enabled(False):
            c = x * x
        return a * b * c

    assert_torchs_gradient(nested)


def test_inference_mode_stops_the_gradient():
    def inferred(x):
        with torch.inference_mode():
            s = x.exp()
        return x * s.clone()

    assert_torchs_gradient(inferred)


def test_requires_grad_false_on_a_leaf_stops_its_gradient():
    def frozen(x):
        y = x.detach().requires_grad_()
        y.requires_grad_(False)
        return x * y

    assert_torchs_gradient(frozen)


def test_a_write_under_no_grad_keeps_the_tensor_a_leaf():
    def updated(x):
        y = x * 1.0
        z = y.detach().clone().requires_grad_()
        with torch.no_grad():
            z.mul_(2)
        return y * z

    assert_torchs_gradient(updated)


def test_requires_grad_is_leaf_and_grad_fn_read_as_in_torch():
    seen = []

    def reads(x):
        y = x * 2
        with torch.no_grad():
            z = x * 2
        d = y.detach()
        seen.append((x.requires_grad, x.is_leaf, y.requires_grad, y.is_leaf, y.grad_fn is not None,
                     z.requires_grad, d.requires_grad, d.is_leaf))
        return y

    reads(torch.tensor(X, requires_grad=True))
    vjpkit.from_torch(reads, mode="trace")(X)
    assert seen[0] == seen[1] == (True, True, True, False, True, False, False, True)


def test_autograd_grad_inside_a_callable_equals_torchs():
    def slope(x):
        y = x.detach().requires_grad_()
        (g,) = torch.autograd.grad((y ** 3).sum(), y)
        return g * x

    want = torch_gradient(slope)
    traced = vjpkit.from_torch(slope, mode="trace")
    np.testing.assert_allclose(traced(X), 3 * X ** 2 * X, rtol=1e-6)
    np.testing.assert_allclose(traced_gradient(slope), want, rtol=1e-6)


def test_autograd_grad_with_create_graph_is_differentiated_again():
    def first_derivative(x):
        y = (x.sin() * x).sum()
        (g,) = torch.autograd.grad(y, x, create_graph=True)
        return g

    assert_torchs_gradient(first_derivative)

    def second_derivative(x):
        (g,) = torch.autograd.grad((x ** 4).sum(), x, create_graph=True)
        (h,) = torch.autograd.grad(g.sum(), x)
        return h

    traced = vjpkit.from_torch(second_derivative, mode="trace")
    np.testing.assert_allclose(traced(X), 12 * X ** 2, rtol=1e-5)


def test_autograd_grad_with_grad_outputs_and_an_intermediate_input():
    def partial(x):
        h = x * x
        out = h.sin()
        (gh,) = torch.autograd.grad(out, h, grad_outputs=torch.ones_like(out) * 2, retain_graph=True)
        return gh

    traced = vjpkit.from_torch(partial, mode="trace")
    np.testing.assert_allclose(traced(X), 2 * np.cos(X * X), rtol=1e-5)


def test_autograd_grad_refuses_as_torch_does():
    def unused(x):
        y = x * 2
        z = (x.detach() * 3).requires_grad_()
        return torch.autograd.grad(y.sum(), z)

    with pytest.raises(RuntimeError, match="appears to not have been used in the graph"):
        vjpkit.from_torch(unused, mode="trace")(X)

    def allowed(x):
        z = x.detach().requires_grad_()
        (g,) = torch.autograd.grad((x * 2).sum(), z, allow_unused=True, materialize_grads=True)
        return g

    np.testing.assert_array_equal(vjpkit.from_torch(allowed, mode="trace")(X), np.zeros_like(X))

    def constant(x):
        with torch.no_grad():
            y = x * 2
        return torch.autograd.grad(y.sum(), x)

    with pytest.raises(RuntimeError, match="does not require grad"):
        vjpkit.from_torch(constant, mode="trace")(X)


class TImplicit(torch.autograd.Function):
    """y = x ** 3, whose backward differentiates its forward again with torch.autograd.grad (implicit idiom)."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x ** 3

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        with torch.enable_grad():
            x = x.detach().requires_grad_()
            y = x ** 3
            (gx,) = torch.autograd.grad(y, x, g)
        return gx


def test_a_backward_calling_autograd_grad_gives_torchs_gradient():
    Implicit = vjpkit.from_torch(TImplicit, mode="trace")
    got = jax.jit(jax.grad(lambda x: (Implicit.apply(x) * W).sum()))(X)
    t = torch.tensor(X, requires_grad=True)
    (want,) = torch.autograd.grad((TImplicit.apply(t) * torch.tensor(W)).sum(), t)
    np.testing.assert_allclose(got, want.numpy(), rtol=1e-6)
    assert "callback" not in str(jax.make_jaxpr(jax.grad(lambda x: Implicit.apply(x).sum()))(X))


def test_backward_is_refused_naming_it():
    def accumulates(x):
        y = (x * x).sum()
        y.backward()
        return x.grad

    with pytest.raises(NotImplementedError, match=r"torch.Tensor.backward, which accumulates gradients into .grad"):
        vjpkit.from_torch(accumulates, mode="trace")(X)


def test_second_order_through_a_detach_matches_jax():
    fn = vjpkit.from_torch(lambda x: x * x + (x ** 3).detach(), mode="trace")
    second = jax.grad(lambda x: jax.grad(lambda x: fn(x).sum())(x).sum())(X)
    np.testing.assert_allclose(second, 2 * np.ones_like(X))
    assert jnp.all(jnp.isfinite(second))
