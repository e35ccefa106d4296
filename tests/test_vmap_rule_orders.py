"""A ``vmap`` staticmethod composes with every order: grad of grad, jacrev of jacrev, hessian, vjp of vjp.

With and without an outer ``jax.vmap``, for rules that call the Function's
own ``apply`` recursively, as PyTorch's do: ``autograd_function_db``'s
``NumpyCube``, ``NumpyMul`` and ``Select``, and the torch.func
documentation's ``MyCube`` (backward only, so ``jax.hessian`` takes its
outputs' derivative from backward transposed). The reference is PyTorch
itself: the originals (``autograd_function_db``'s own classes; the docs'
``MyCube`` written out) under ``torch.func``; and, under ``vmap``, the loop
over the examples.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import vjpkit

try:
    import torch
    import torch.func
except ImportError:  # torch is never a dependency of vjpkit
    torch = None

needs_torch = pytest.mark.skipif(torch is None, reason="torch is not installed")


# ---------------------------------------------------------------------------
# The ports: autograd_function_db's NumpyMul, NumpyCube and Select (NumPy becomes jax.numpy), the docs' MyCube.


class NumpyMul(vjpkit.Function):
    @staticmethod
    def forward(x, y):
        return x * y

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs)
        ctx.save_for_forward(*inputs)

    @staticmethod
    def backward(ctx, grad_output):
        x, y = ctx.saved_tensors
        gx = NumpyMul.apply(grad_output, y) if ctx.needs_input_grad[0] else None
        gy = NumpyMul.apply(grad_output, x) if ctx.needs_input_grad[1] else None
        return gx, gy

    @staticmethod
    def vmap(info, in_dims, x, y):
        x_bdim, y_bdim = in_dims
        x = jnp.moveaxis(x, x_bdim, -1) if x_bdim is not None else x[..., None]
        y = jnp.moveaxis(y, y_bdim, -1) if y_bdim is not None else y[..., None]
        return jnp.moveaxis(NumpyMul.apply(x, y), -1, 0), 0

    @staticmethod
    def jvp(ctx, x_tangent, y_tangent):
        x, y = ctx.saved_tensors
        return x_tangent * y + y_tangent * x


class NumpyCube(vjpkit.Function):
    @staticmethod
    def forward(x):
        return x**3, 3 * x**2

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[0], output[1])
        ctx.save_for_forward(inputs[0], output[1])

    @staticmethod
    def backward(ctx, grad_output, grad_saved):
        x, dx = ctx.saved_tensors
        return NumpyMul.apply(grad_output, dx) + 6 * NumpyMul.apply(grad_saved, x)

    @staticmethod
    def vmap(info, in_dims, x):
        return NumpyCube.apply(x), (in_dims[0], in_dims[0])

    @staticmethod
    def jvp(ctx, x_tangent):
        x, dx = ctx.saved_tensors
        return NumpyMul.apply(x_tangent, dx), 6 * NumpyMul.apply(x_tangent, x)


class Select(vjpkit.Function):
    @staticmethod
    def forward(x, idx):
        return x[idx]

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, idx = inputs
        ctx.x_shape = x.shape
        ctx.idx = idx

    @staticmethod
    def backward(ctx, grad_output):
        return jnp.zeros(ctx.x_shape, grad_output.dtype).at[ctx.idx].set(grad_output), None

    @staticmethod
    def vmap(info, in_dims, x, idx):
        x_bdim, _ = in_dims
        return Select.apply(jnp.moveaxis(x, x_bdim, 1), idx), 0

    @staticmethod
    def jvp(ctx, x_tangent, _):
        return Select.apply(x_tangent, ctx.idx)


class MyCube(vjpkit.Function):
    """The torch.func documentation's MyCube, with its vmap staticmethod: backward only."""

    @staticmethod
    def forward(x):
        return x**3, 3 * x**2

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[0], output[1])

    @staticmethod
    def backward(ctx, grad_output, grad_dx):
        x, dx = ctx.saved_tensors
        return grad_output * dx + grad_dx * 6 * x

    @staticmethod
    def vmap(info, in_dims, x):
        return MyCube.apply(jnp.moveaxis(x, in_dims[0], 0)), (0, 0)


if torch is not None:

    # PyTorch's own originals (its functorch tests' database of custom Functions with vmap staticmethods).
    from torch.testing._internal.autograd_function_db import NumpyCube as TorchNumpyCube
    from torch.testing._internal.autograd_function_db import NumpyMul as TorchNumpyMul
    from torch.testing._internal.autograd_function_db import Select as TorchSelect

    class TorchMyCube(torch.autograd.Function):
        @staticmethod
        def forward(x):
            return x**3, 3 * x**2

        @staticmethod
        def setup_context(ctx, inputs, output):
            ctx.save_for_backward(inputs[0], output[1])

        @staticmethod
        def backward(ctx, grad_output, grad_dx):
            x, dx = ctx.saved_tensors
            return grad_output * dx + grad_dx * 6 * x

        @staticmethod
        def vmap(info, in_dims, x):
            return TorchMyCube.apply(x.movedim(in_dims[0], 0)), (0, 0)


# ---------------------------------------------------------------------------
# Each port as a vector function of one array, and the same of the torch original.

_Y = np.array([0.5, -1.5, 2.0], np.float32)


def _cube(apply):
    def f(x):
        y, dy = apply(x)
        return y + 0.5 * dy  # both outputs: backward's second gradient matters at second order

    return f


def _mul(apply, y):
    return lambda x: apply(apply(x, x), y)


def _select(apply):
    return lambda x: apply(x * x * x, 1)


_PORTS = {  # name -> (vjpkit's function, torch's, an input)
    "NumpyCube": (lambda: _cube(NumpyCube.apply), lambda: _cube(TorchNumpyCube.apply), np.array([0.9, 1.3, 1.7])),
    "NumpyMul": (lambda: _mul(NumpyMul.apply, jnp.asarray(_Y)), lambda: _mul(TorchNumpyMul.apply, torch.tensor(_Y)),
                 np.array([0.9, 1.2, 1.9])),
    "Select": (lambda: _select(Select.apply), lambda: _select(TorchSelect.apply),
               np.array([[0.9, 1.1], [1.3, 1.4], [1.6, 2.0]])),
    "MyCube": (lambda: _cube(MyCube.apply), lambda: _cube(TorchMyCube.apply), np.array([0.9, 1.3, 1.7])),
}


def _jax_orders(f):
    """Each second order of ``f`` at ``x``: vjp of vjp with cotangents of ones, the others of f's sum."""

    def total(x):
        return f(x).sum()

    def vjp_of_vjp(x):
        inner = lambda x: jax.vjp(f, x)[1](jnp.ones_like(f(x)))[0]  # noqa: E731
        return jax.vjp(inner, x)[1](jnp.ones_like(x))[0]

    return {
        "grad_of_grad": lambda x: jax.grad(lambda x: (jax.grad(total)(x) ** 2).sum())(x),
        "jacrev_of_jacrev": jax.jacrev(jax.jacrev(total)),
        "hessian": jax.hessian(total),
        "vjp_of_vjp": vjp_of_vjp,
    }


def _torch_orders(f):
    """The same, by torch.func (hessian by jacrev of jacrev: MyCube has no jvp, so PyTorch's jacfwd refuses)."""
    tf = torch.func

    def total(x):
        return f(x).sum()

    def vjp_of_vjp(x):
        inner = lambda x: tf.vjp(f, x)[1](torch.ones_like(f(x)))[0]  # noqa: E731
        return tf.vjp(inner, x)[1](torch.ones_like(x))[0]

    return {
        "grad_of_grad": tf.grad(lambda x: (tf.grad(total)(x) ** 2).sum()),
        "jacrev_of_jacrev": tf.jacrev(tf.jacrev(total)),
        "hessian": tf.jacrev(tf.jacrev(total)),
        "vjp_of_vjp": vjp_of_vjp,
    }


_ORDERS = ["grad_of_grad", "jacrev_of_jacrev", "hessian", "vjp_of_vjp"]


@needs_torch
@pytest.mark.parametrize("order", _ORDERS)
@pytest.mark.parametrize("name", sorted(_PORTS))
def test_second_order_matches_torch(name, order):
    ours, theirs, x = _PORTS[name]
    expected = _torch_orders(theirs())[order](torch.tensor(x)).numpy()
    np.testing.assert_allclose(_jax_orders(ours())[order](jnp.asarray(x, jnp.float32)), expected, rtol=1e-5)


@needs_torch
@pytest.mark.parametrize("name", sorted(_PORTS))
def test_hessian_under_vmap_matches_torch(name):
    # A batch of two, batched by the vmap staticmethod; PyTorch's torch.func.vmap runs the original's.
    ours, theirs, x = _PORTS[name]
    order = "hessian"
    xs = np.stack([x, 1.1 * x])
    expected = torch.func.vmap(_torch_orders(theirs())[order])(torch.tensor(xs)).numpy()
    np.testing.assert_allclose(jax.vmap(_jax_orders(ours())[order])(jnp.asarray(xs, jnp.float32)), expected,
                               rtol=1e-5)


@pytest.mark.parametrize("order", ["grad_of_grad", "vjp_of_vjp"])
def test_second_order_under_vmap_is_the_loop(order):
    # No torch needed: vmap of each order equals the loop over the examples, for the rule calling apply.
    f = _jax_orders(_cube(MyCube.apply))[order]
    xs = jnp.array([[0.9, 1.3, 1.7], [1.1, -0.4, 2.0]])
    np.testing.assert_allclose(jax.vmap(f)(xs), jnp.stack([f(x) for x in xs]), rtol=1e-6)


def test_grad_of_grad_with_a_vmap_staticmethod_and_no_vmap():
    # d/dx of backward's 3 x^2 (the first output's gradient) at 0.5: 6 x = 3.
    np.testing.assert_allclose(jax.grad(jax.grad(lambda x: MyCube.apply(x)[0]))(0.5), 3.0)
    np.testing.assert_allclose(jax.grad(jax.grad(lambda x: NumpyCube.apply(x)[0]))(0.5), 3.0)


def test_hessian_of_a_backward_only_class_whose_vmap_rule_calls_apply():
    # x^3 + 1.5 x^2 summed: its hessian is diag(6 x + 3), by backward transposed (MyCube defines no jvp).
    x = jnp.array([0.5, 1.0, 2.0])
    np.testing.assert_allclose(jax.hessian(lambda x: _cube(MyCube.apply)(x).sum())(x), np.diag(6 * x + 3), rtol=1e-6)


def test_setup_context_value_computed_from_an_output_differentiates_as_without_the_rule():
    # A vmap staticmethod changes nothing outside vmap: what setup_context computes from an output keeps the
    # derivative of forward's code, as for the class without the rule. Backward g * 2y * x with y = x^2: the
    # gradient is 2 x^3, its derivative 6 x^2 (6 at x = 1, 24 at x = 2), 2 x^2 if 2y were a constant.
    class Square(vjpkit.Function):
        @staticmethod
        def forward(x):
            return x * x

        @staticmethod
        def setup_context(ctx, inputs, output):
            ctx.save_for_backward(inputs[0], 2 * output)

        @staticmethod
        def backward(ctx, g):
            x, twice = ctx.saved_tensors
            return g * twice * x

        @staticmethod
        def vmap(info, in_dims, x):
            return Square.apply(x), in_dims[0]

    class SquareWithoutRule(vjpkit.Function):
        forward, setup_context, backward = Square.forward, Square.setup_context, Square.backward

    for cls in (Square, SquareWithoutRule):
        np.testing.assert_allclose(jax.grad(jax.grad(cls.apply))(1.0), 6.0, err_msg=cls.__name__)
        np.testing.assert_allclose(jax.vmap(jax.grad(jax.grad(cls.apply)))(jnp.array([1.0, 2.0])), [6.0, 24.0],
                                   err_msg=cls.__name__)
