"""PyTorch's custom-Function tests, translated into vjpkit Functions.

From ``torch/testing/_internal/autograd_function_db.py`` (the Functions
functorch's transforms are tested on: NumPy code becomes jax.numpy, ``vmap``
staticmethods and ``generate_vmap_rule`` stay), ``test/test_autograd.py``'s
Function tests and ``test/functorch/test_eager_transforms.py``'s
autograd.Function tests. Expected values are PyTorch's, or derived from
``jax.grad``/``jax.jvp`` of the same math in plain JAX. Each test names the
test it mirrors. Where vjpkit's contract differs (Python scalars are static,
``None`` gradients are zeros), the comment says so.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from functions import Double, Identity

import vjpkit


def close(actual, expected, rtol=1e-5):
    jax.tree_util.tree_map(lambda a, e: np.testing.assert_allclose(a, e, rtol=rtol, atol=1e-6), actual, expected)


# ---------------------------------------------------------------------------
# autograd_function_db: each Function with its plain-JAX reference.


def _mul_backward(mul, ctx, grad_output):
    """NumpyMul's and MulGenVmap's backward: the product rule through ``mul`` itself, so that it composes."""
    x, y = ctx.saved_tensors
    gx = mul.apply(grad_output, y) if ctx.needs_input_grad[0] else None
    gy = mul.apply(grad_output, x) if ctx.needs_input_grad[1] else None
    return gx, gy


class _MulRules(vjpkit.Function):
    """NumpyMul's and MulGenVmap's forward, context and jvp (PyTorch writes them twice)."""

    @staticmethod
    def forward(x, y):
        return x * y

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs)
        ctx.save_for_forward(*inputs)

    @staticmethod
    def jvp(ctx, x_tangent, y_tangent):
        x, y = ctx.saved_tensors
        return x_tangent * y + y_tangent * x


class NumpyMul(_MulRules):
    @staticmethod
    def backward(ctx, grad_output):
        return _mul_backward(NumpyMul, ctx, grad_output)

    @staticmethod
    def vmap(info, in_dims, x, y):
        x_bdim, y_bdim = in_dims
        x = jnp.moveaxis(x, x_bdim, -1) if x_bdim is not None else x[..., None]
        y = jnp.moveaxis(y, y_bdim, -1) if y_bdim is not None else y[..., None]
        return jnp.moveaxis(NumpyMul.apply(x, y), -1, 0), 0


class MulGenVmap(_MulRules):
    generate_vmap_rule = True

    @staticmethod
    def backward(ctx, grad_output):
        return _mul_backward(MulGenVmap, ctx, grad_output)


class _CubeForward(vjpkit.Function):
    """NumpyCube's and CubeGenVmap's forward and context (PyTorch writes them twice): x**3 and its derivative."""

    @staticmethod
    def forward(x):
        return x**3, 3 * x**2

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[0], output[1])
        ctx.save_for_forward(inputs[0], output[1])


class NumpyCube(_CubeForward):
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


class CubeGenVmap(_CubeForward):
    generate_vmap_rule = True

    @staticmethod
    def backward(ctx, grad_output, grad_saved):
        _, dx = ctx.saved_tensors
        return grad_output * dx + 6 * dx  # PyTorch's (deliberately not the derivative in grad_saved)

    @staticmethod
    def jvp(ctx, x_tangent):
        x, dx = ctx.saved_tensors
        return MulGenVmap.apply(x_tangent, dx), 6 * NumpyMul.apply(x_tangent, x)


class NumpyTake(vjpkit.Function):
    @staticmethod
    def forward(x, ind, ind_inv, dim):
        return jnp.take_along_axis(x, ind, dim)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _, ind, ind_inv, dim = inputs
        ctx.save_for_backward(ind, ind_inv)
        ctx.save_for_forward(ind, ind_inv)
        ctx.dim = dim

    @staticmethod
    def backward(ctx, grad_output):
        ind, ind_inv = ctx.saved_tensors
        return NumpyTake.apply(grad_output, ind_inv, ind, ctx.dim), None, None, None

    @staticmethod
    def vmap(info, in_dims, x, ind, ind_inv, dim):
        x_bdim, ind_bdim, ind_inv_bdim, _ = in_dims
        logical_dim = x.ndim if x_bdim is None else x.ndim - 1
        dim = dim if dim >= 0 else dim + logical_dim

        def expand_bdim(a, a_bdim):
            if a_bdim is None:
                return jnp.broadcast_to(a, (info.batch_size, *a.shape))
            return jnp.moveaxis(a, a_bdim, 0)

        x, ind, ind_inv = expand_bdim(x, x_bdim), expand_bdim(ind, ind_bdim), expand_bdim(ind_inv, ind_inv_bdim)
        return NumpyTake.apply(x, ind, ind_inv, dim + 1), 0

    @staticmethod
    def jvp(ctx, x_tangent, ind_tangent, ind_inv_tangent, _):
        ind, ind_inv = ctx.saved_tensors
        return NumpyTake.apply(x_tangent, ind, ind_inv, ctx.dim)


class _SortRules(vjpkit.Function):
    """NumpySort's and SortGenVmap's forward and rules (PyTorch writes them twice; only vmap differs)."""

    @staticmethod
    def forward(x, dim):
        ind = jnp.argsort(x, axis=dim)
        ind_inv = jnp.argsort(ind, axis=dim)
        return jnp.take_along_axis(x, ind, dim), ind, ind_inv

    @staticmethod
    def setup_context(ctx, inputs, output):
        _, dim = inputs
        _, ind, ind_inv = output
        ctx.mark_non_differentiable(ind, ind_inv)
        ctx.save_for_backward(ind, ind_inv)
        ctx.save_for_forward(ind, ind_inv)
        ctx.dim = dim

    @staticmethod
    def backward(ctx, grad_output, _0, _1):
        ind, ind_inv = ctx.saved_tensors
        return NumpyTake.apply(grad_output, ind_inv, ind, ctx.dim), None

    @staticmethod
    def jvp(ctx, x_tangent, _):
        ind, ind_inv = ctx.saved_tensors
        return NumpyTake.apply(x_tangent, ind, ind_inv, ctx.dim), None, None


class NumpySort(_SortRules):
    @staticmethod
    def vmap(info, in_dims, x, dim):
        x_bdim, _ = in_dims
        x = jnp.moveaxis(x, x_bdim, 0)
        dim = dim if dim >= 0 else dim + x.ndim - 1
        return NumpySort.apply(x, dim + 1), (0, 0, 0)


class SortGenVmap(_SortRules):
    generate_vmap_rule = True


class _SelectRules(vjpkit.Function):
    """Select's and SelectGenVmap's forward, context and backward (PyTorch writes them twice)."""

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


class Select(_SelectRules):
    @staticmethod
    def vmap(info, in_dims, x, idx):
        x_bdim, _ = in_dims
        return Select.apply(jnp.moveaxis(x, x_bdim, 1), idx), 0

    @staticmethod
    def jvp(ctx, x_tangent, _):
        return Select.apply(x_tangent, ctx.idx)


class SelectGenVmap(_SelectRules):
    generate_vmap_rule = True

    @staticmethod
    def jvp(ctx, x_tangent, _):
        return SelectGenVmap.apply(x_tangent, ctx.idx)


class ScaleGradGenVmap(vjpkit.Function):
    generate_vmap_rule = True
    scale = 3.14

    @staticmethod
    def forward(x):
        return x + 0.0

    @staticmethod
    def setup_context(ctx, inputs, outputs):
        pass

    @staticmethod
    def backward(ctx, grad_output):
        return grad_output * ScaleGradGenVmap.scale

    @staticmethod
    def jvp(ctx, x_tangent):
        return x_tangent * ScaleGradGenVmap.scale


class ZeroGradientsGenVmap(vjpkit.Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(x, y):
        return x + 0.0, y + 0.0

    @staticmethod
    def setup_context(ctx, inputs, outputs):
        pass

    @staticmethod
    def backward(ctx, gx, gy):
        # PyTorch's: a gradient too large for x (3, 4 prepended), which broadcasting sums down to x's shape.
        return jnp.zeros((3, 4, *gx.shape), gx.dtype), jnp.zeros(gy.shape, gy.dtype)

    @staticmethod
    def jvp(ctx, gx, gy):
        return jnp.zeros(gx.shape, gx.dtype), jnp.zeros(gy.shape, gy.dtype)


class ForwardHasDefaultArgs(Select):
    """Select with ``idx`` defaulting to (2,). PyTorch writes Select's rules out again, each calling
    ForwardHasDefaultArgs.apply; here they call Select.apply, the same function of x and idx."""

    @staticmethod
    def forward(x, idx=(2,)):
        return x[idx]


_X35 = jnp.asarray(np.random.RandomState(0).uniform(-2, 2, (3, 5)), jnp.float32)
_X4 = jnp.asarray(np.random.RandomState(1).uniform(0.9, 2, (4,)), jnp.float32)
_Y34 = jnp.asarray(np.random.RandomState(2).uniform(0.9, 2, (3, 4)), jnp.float32)
_CUBE_IN = jnp.asarray([1.3], jnp.float32)


def _sorted_take(x):
    ind = jnp.argsort(x, axis=1)
    return jnp.take_along_axis(x, ind, 1), ind, jnp.argsort(ind, axis=1)


# name -> (function of the differentiable arguments, the arguments, the same math in plain JAX). The first
# output of each is what the transforms below differentiate; the plain math of CubeGenVmap is its own backward.
_DB = {
    "NumpyMul": (NumpyMul.apply, (_X4, _Y34), lambda x, y: x * y),
    "MulGenVmap": (MulGenVmap.apply, (_X4, _Y34), lambda x, y: x * y),
    "NumpyCube": (lambda x: NumpyCube.apply(x)[0], (_CUBE_IN,), lambda x: x**3),
    "NumpySort": (lambda x: NumpySort.apply(x, 1)[0], (_X35,), lambda x: jnp.sort(x, axis=1)),
    "SortGenVmap": (lambda x: SortGenVmap.apply(x, 1)[0], (_X35,), lambda x: jnp.sort(x, axis=1)),
    "NumpyTake": (lambda x: NumpyTake.apply(x, *_sorted_take(_X35)[1:], 1), (_X35,),
                  lambda x: jnp.take_along_axis(x, _sorted_take(_X35)[1], 1)),
    "Select": (lambda x: Select.apply(x, 2), (_X35,), lambda x: x[2]),
    "SelectGenVmap": (lambda x: SelectGenVmap.apply(x, 2), (_X35,), lambda x: x[2]),
    "ScaleGradGenVmap": (ScaleGradGenVmap.apply, (_X35,), lambda x: 3.14 * x),  # its gradient is 3.14 * g
    "ForwardHasDefaultArgs": (ForwardHasDefaultArgs.apply, (_X35,), lambda x: x[(2,)]),
}


# Where a Function's value is not the reference math's (whose derivative is the Function's own).
_VALUE = {"ScaleGradGenVmap": lambda x: x}


@pytest.mark.parametrize("name", sorted(_DB))
def test_autograd_function_db_vjp(name):
    # autograd_function_db, as test_ops' vjp tests run it: the gradient of the first output, summed with weights.
    fn, args, reference = _DB[name]
    weights = jnp.linspace(0.5, 1.5, np.size(reference(*args))).reshape(np.shape(reference(*args)))
    argnums = tuple(range(len(args)))
    got = jax.grad(lambda *a: jnp.sum(fn(*a) * weights), argnums)(*args)
    expected = jax.grad(lambda *a: jnp.sum(reference(*a) * weights), argnums)(*args)
    close(got, expected)


@pytest.mark.parametrize("name", sorted(_DB))
def test_autograd_function_db_jvp(name):
    # autograd_function_db under forward mode (PyTorch's jvp staticmethods).
    fn, args, reference = _DB[name]
    tangents = tuple(jnp.ones_like(a) for a in args)
    _, got = jax.jvp(fn, args, tangents)
    _, expected = jax.jvp(reference, args, tangents)
    close(got, expected)


@pytest.mark.parametrize("name", sorted(_DB))
def test_autograd_function_db_vmap(name):
    # autograd_function_db under vmap (the vmap staticmethod, or generate_vmap_rule): a batch of 2 of every input.
    fn, args, reference = _DB[name]
    batched = tuple(jnp.stack([a, 2 * a]) for a in args)
    close(jax.vmap(fn)(*batched), jax.vmap(_VALUE.get(name, reference))(*batched))


@pytest.mark.parametrize("name", sorted(_DB))
def test_autograd_function_db_vmap_of_vjp(name):
    # autograd_function_db: per-example gradients, vmap of grad.
    fn, args, reference = _DB[name]
    batched = tuple(jnp.stack([a, 2 * a]) for a in args)

    def per_example(f):
        return jax.vmap(jax.grad(lambda *a: jnp.sum(f(*a)), tuple(range(len(args)))))

    close(per_example(fn)(*batched), per_example(reference)(*batched))


@pytest.mark.parametrize("name", sorted(_DB))
def test_autograd_function_db_jacrev_and_jacfwd(name):
    # autograd_function_db under jacrev (vmap of vjp) and jacfwd (vmap of jvp).
    fn, args, reference = _DB[name]
    close(jax.jacrev(fn)(*args), jax.jacrev(reference)(*args))
    close(jax.jacfwd(fn)(*args), jax.jacfwd(reference)(*args))


@pytest.mark.parametrize("name", sorted(_DB))
def test_autograd_function_db_vjp_of_vjp(name):
    # autograd_function_db, as functorch's test_ops test_vjpvjp runs it: the vjp of the first output's vjp,
    # with respect to the inputs and the cotangent.
    fn, args, reference = _DB[name]
    cotangent = jnp.linspace(0.5, 1.5, np.size(reference(*args))).reshape(np.shape(reference(*args)))

    def vjp_of_vjp(f):
        def gradients(args, cotangent):
            return jax.vjp(f, *args)[1](cotangent)

        outer = jax.vjp(gradients, args, cotangent)[1]
        return outer(tuple(jnp.linspace(0.2, 1.2, np.size(a)).reshape(np.shape(a)) for a in args))

    close(vjp_of_vjp(fn), vjp_of_vjp(reference))


def test_autograd_function_db_cube_gen_vmap():
    # autograd_function_db's CubeGenVmap: its backward is PyTorch's grad_output * dx + 6 * dx.
    x = _CUBE_IN
    got = jax.grad(lambda x: CubeGenVmap.apply(x)[0].sum())(x)
    close(got, 3 * x**2 + 6 * 3 * x**2)
    close(jax.vmap(lambda x: CubeGenVmap.apply(x)[0])(jnp.stack([x, 2 * x])), jnp.stack([x, 2 * x]) ** 3)
    _, tangents = jax.jvp(CubeGenVmap.apply, (x,), (jnp.ones_like(x),))
    close(tangents, (3 * x**2, 6 * x))


def test_autograd_function_db_zero_gradients_gen_vmap():
    # autograd_function_db's ZeroGradientsGenVmap: zero gradients, x's too large (summed down, PyTorch's rule).
    x, y = _X35, _X4
    gx, gy = jax.grad(lambda x, y: sum(o.sum() for o in ZeroGradientsGenVmap.apply(x, y)), (0, 1))(x, y)
    close((gx, gy), (np.zeros((3, 5)), np.zeros(4)))
    _, tangents = jax.jvp(ZeroGradientsGenVmap.apply, (x, y), (jnp.ones_like(x), jnp.ones_like(y)))
    close(tangents, (np.zeros((3, 5)), np.zeros(4)))
    per_example = jax.vmap(jax.grad(lambda x, y: ZeroGradientsGenVmap.apply(x, y)[0].sum(), (0, 1)))
    close(per_example(jnp.stack([x, x]), jnp.stack([y, y])), (np.zeros((2, 3, 5)), np.zeros((2, 4))))


def test_autograd_function_db_sort_indices_are_not_differentiable():
    # autograd_function_db's NumpySort: ind and ind_inv are marked non-differentiable (and are integers).
    out, ind, ind_inv = NumpySort.apply(_X35, 1)
    _, tangents = jax.jvp(lambda x: NumpySort.apply(x, 1), (_X35,), (jnp.ones_like(_X35),))
    assert tangents[1].dtype == jax.dtypes.float0 and tangents[2].dtype == jax.dtypes.float0
    close(ind, np.argsort(np.asarray(_X35), axis=1))


# ---------------------------------------------------------------------------
# test/test_autograd.py: TestAutograd's Function tests.


def _function_test(cls):
    """TestAutograd._function_test: apply(x, 2, y) summed; x.grad = y + 1, y.grad = x + 2."""
    rng = np.random.RandomState(3)
    x = jnp.asarray(rng.randn(5, 5), jnp.float32)
    y = jnp.asarray(rng.randn(5, 5), jnp.float32)
    gx, gy = jax.grad(lambda x, y: cls.apply(x, 2, y).sum(), (0, 1))(x, y)
    close(gx, y + jnp.ones((5, 5)))
    close(gy, x + jnp.ones((5, 5)) * 2)
    return x, y


def _my_function(backward_decorator=lambda f: f):
    class MyFunction(vjpkit.Function):
        @staticmethod
        def forward(ctx, tensor1, pyscalar, tensor2):
            ctx.pyscalar = pyscalar
            ctx.save_for_backward(tensor1, tensor2)
            return tensor1 + pyscalar * tensor2 + tensor1 * tensor2

        @staticmethod
        @backward_decorator
        def backward(ctx, grad_output):
            var1, var2 = ctx.saved_tensors
            return grad_output + grad_output * var2, None, grad_output * ctx.pyscalar + grad_output * var1

    return MyFunction


def test_function():
    # TestAutograd.test_function; the gradient of the gradient (create_graph=True) exists too.
    my_function = _my_function()
    x, y = _function_test(my_function)
    second = jax.grad(lambda x, y: jax.grad(lambda x: my_function.apply(x, 2, y).sum())(x).sum(), 1)(x, y)
    close(second, np.ones((5, 5)))


def test_once_differentiable():
    # TestAutograd.test_once_differentiable: first order works; the gradient's own derivative raises.
    my_function = _my_function(vjpkit.once_differentiable)
    x, y = _function_test(my_function)
    with pytest.raises(RuntimeError, match=r"MyFunction.backward is decorated with @once_differentiable"):
        jax.grad(lambda x, y: jax.grad(lambda x: my_function.apply(x, 2, y).sum())(x).sum(), 1)(x, y)


@pytest.mark.parametrize("shape", [(1,), ()])
def test_function_returns_input(shape):
    # TestAutograd.test_function_returns_input
    class MyFunction(Identity):  # forward returns its input
        @staticmethod
        def backward(ctx, grad):
            return grad * 2

    v = jnp.ones(shape)
    close(jax.grad(lambda v: MyFunction.apply(v).sum())(v), np.full(shape, 2.0))
    close(jax.grad(lambda v: MyFunction.apply(v + 0).sum())(v), np.full(shape, 2.0))


def test_function_returns_undefined_tensor():
    # TestAutograd.test_function_returns_undefined_tensor. vjpkit: JAX has no undefined gradient, so backward's
    # None is a zero gradient (PyTorch leaves x.grad None).
    class MyFunction(Double):  # forward: 2 * x
        @staticmethod
        def backward(ctx, grad):
            return None

    x = jnp.ones(1)
    close(jax.grad(lambda x: MyFunction.apply(x).sum())(x), np.zeros(1))
    close(jax.grad(lambda x: MyFunction.apply(x**2).sum())(x), np.zeros(1))


def test_materialize_grads():
    # TestAutograd.test_materialize_grads: an output given no gradient (PyTorch's UndefinedGrad) arrives as zeros.
    seen = []

    class MyFunction(vjpkit.Function):
        @staticmethod
        def forward(ctx, x):
            return x, x * 2

        @staticmethod
        def backward(ctx, grad, unused):
            seen.append(unused.shape)
            return grad + 10 * unused  # the gradient shows whether unused was zeros

    close(jax.grad(lambda x: MyFunction.apply(x)[0].sum())(jnp.ones(1)), np.ones(1))
    assert seen[-1] == (1,)


def test_dont_materialize_grads():
    # TestAutograd.test_dont_materialize_grads
    seen = []

    class MyFunction(vjpkit.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.set_materialize_grads(False)
            return x, x * 2

        @staticmethod
        def backward(ctx, grad, unused):
            seen.append(unused)
            return grad

    close(jax.grad(lambda x: MyFunction.apply(x)[0].sum())(jnp.ones(1)), np.ones(1))
    assert seen[-1] is None


def test_set_materialize_non_diff_grads():
    # TestAutograd.test_set_materialize_non_diff_grads: a non-differentiable output's gradient is None with
    # materialization off (vjpkit has set_materialize_grads for it, not the private _materialize_non_diff_grads).
    seen = []

    class Func(vjpkit.Function):
        @staticmethod
        def forward(ctx, x):
            out0, out1 = x + 0, x + 0
            ctx.mark_non_differentiable(out1)
            ctx.set_materialize_grads(False)
            return out0, out1

        @staticmethod
        def backward(ctx, g0, g1):
            seen.append(g1)
            return g0

    close(jax.grad(lambda a: Func.apply(a)[0])(1.0), 1.0)
    assert seen == [None]


def test_custom_function_exception():
    # TestAutograd.test_custom_function_exception: backward's exception reaches the caller.
    class SimulateBackwardError(vjpkit.Function):
        @staticmethod
        def forward(ctx, x):
            return x + 0

        @staticmethod
        @vjpkit.once_differentiable
        def backward(ctx, g):
            raise Exception("Simulate error on backward pass")  # noqa: TRY002 - PyTorch's test raises it

    t1, t2 = jnp.ones((3, 3)), jnp.ones((3, 3))
    with pytest.raises(Exception, match="Simulate error on backward pass"):
        jax.grad(lambda t1, t2: SimulateBackwardError.apply((t1 + t2) * (t1 + t2)).sum())(t1, t2)


def test_custom_function_non_tensor_inputs_outputs():
    # TestAutograd.test_custom_function_non_tensor_inputs_outputs: static outputs pass through; backward gets a
    # slot per output (vjpkit: a static output's gradient slot is None).
    seen = []

    class MyFunction(vjpkit.Function):
        @staticmethod
        def forward(ctx, t1, t2, scale, t3):
            t4 = (t1 + t2 * t3) * scale
            t5 = (t1 * t2 + t3) * scale
            ctx.scale = scale
            ctx.save_for_backward(t1, t2, t3)
            return scale, t4, None, True, t5, "bar", t1

        @staticmethod
        @vjpkit.once_differentiable
        def backward(ctx, *grads):
            seen.append(len(grads))
            assert grads[0] is None and grads[2] is None and grads[3] is None and grads[5] is None
            scale = ctx.scale
            var1, var2, var3 = ctx.saved_tensors
            return (
                grads[1] * scale + grads[4] * var2 * scale + grads[6],
                grads[1] * var3 * scale + grads[4] * var1 * scale,
                None,
                grads[1] * var2 * scale + grads[4] * scale,
            )

    rng = np.random.RandomState(4)
    t1, t2, t3 = (jnp.asarray(rng.rand(10), jnp.float32) for _ in range(3))
    scale = 7
    res = MyFunction.apply(t1, t2, scale, t3)
    assert res[0] == scale and res[2] is None and res[3] is True and res[5] == "bar"
    close(res[1], (t1 + t2 * t3) * scale)
    close(res[4], (t1 * t2 + t3) * scale)
    close(res[6], t1)

    def loss(t1, t2, t3):
        res = MyFunction.apply(t1, t2, scale, t3)
        return res[1].sum() + res[4].sum() + res[6].sum()

    def plain(t1, t2, t3):
        return ((t1 + t2 * t3) * scale).sum() + ((t1 * t2 + t3) * scale).sum() + t1.sum()

    close(jax.grad(loss, (0, 1))(t1, t2, t3), jax.grad(plain, (0, 1))(t1, t2, t3))
    assert seen == [7]


def test_invalid_gradients():
    # TestAutograd.test_invalid_gradients: a gradient of the wrong shape raises, naming the expected shape.
    class MyFunction(Double):  # forward: 2 * x
        @staticmethod
        def backward(ctx, grad_output):
            return jnp.ones(10)

    with pytest.raises(ValueError, match=r"MyFunction.backward returned a gradient of shape \(10,\).*expected shape"):
        jax.grad(lambda x: MyFunction.apply(x).sum())(jnp.ones((5, 5)))


def test_mark_non_differentiable():
    # TestAutograd.test_mark_non_differentiable: a mask output carries no gradient.
    class MyFunction(vjpkit.Function):
        @staticmethod
        def forward(ctx, x):
            output = (x > 0).astype(x.dtype)
            ctx.mark_non_differentiable(output)
            return output

        @staticmethod
        def backward(ctx, grad_output):
            return grad_output * 0

    x = jnp.asarray(np.random.RandomState(5).randn(5, 5), jnp.float32)

    def loss(x):
        mask = MyFunction.apply(x)
        return jnp.where(mask > 0, 0.0, x).sum()

    close(jax.grad(loss)(x), np.where(np.asarray(x) > 0, 0.0, 1.0))


def test_mark_non_differentiable_mixed():
    # TestAutograd.test_mark_non_differentiable_mixed: the non-differentiable output's gradient is zeros.
    class MyFunction(vjpkit.Function):
        @staticmethod
        def forward(ctx, x):
            a, b = x + 1, x + 2
            ctx.mark_non_differentiable(a)
            return a, b

        @staticmethod
        def backward(ctx, grad_a, grad_b):
            return grad_b + 10 * grad_a  # grad_a is zeros

    close(jax.grad(lambda x: MyFunction.apply(x)[1].sum())(jnp.ones((5, 5))), np.ones((5, 5)))


def test_return_duplicate():
    # TestAutograd.test_return_duplicate: the same array returned twice gets both gradients.
    class DoubleDuplicate(vjpkit.Function):
        @staticmethod
        def forward(ctx, x):
            output = x * 2
            return output, output

        @staticmethod
        def backward(ctx, grad1, grad2):
            return grad1 * 2 + grad2 * 2

    x = jnp.asarray(np.random.RandomState(6).rand(3), jnp.float64 if jax.config.jax_enable_x64 else jnp.float32)
    close(jax.grad(lambda x: sum(o.sum() for o in DoubleDuplicate.apply(x)))(x), np.full(3, 4.0))
    assert vjpkit.gradcheck(lambda x: DoubleDuplicate.apply(x)[0], (np.random.RandomState(6).rand(3),))


def test_save_none_for_backward():
    # TestAutograd.test_save_none_for_backward: Nones saved come back as None.
    seen = []

    class MyFn(vjpkit.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(None, x, None)
            return x * x

        @staticmethod
        def backward(ctx, grad_output):
            n1, x, n2 = ctx.saved_tensors
            seen.append((n1, n2))
            return 2 * x * grad_output

    x = jnp.asarray(np.random.RandomState(7).randn(5, 5), jnp.float32)
    close(jax.grad(lambda x: MyFn.apply(x).sum())(x), 2 * x)
    assert seen == [(None, None)]


def test_custom_function_save_for_forward():
    # TestAutograd.test_custom_function_save_for_forward: PyTorch's vjp spelling of backward, jvp from
    # save_for_forward, a static z=4, and an array attribute ctx.prod.
    class Func(vjpkit.Function):
        @staticmethod
        def forward(ctx, x, y, z):
            ctx.save_for_backward(x, y)
            ctx.save_for_forward(x, y)
            ctx.z = z
            ctx.prod = x * y
            return z * ctx.prod

        @staticmethod
        def jvp(ctx, x_t, y_t, _):
            x_p, y_p = ctx.saved_tensors
            return ctx.z * (y_p * x_t + x_p * y_t)

        @staticmethod
        def vjp(ctx, grad_out):
            x, y = ctx.saved_tensors
            return ctx.z * grad_out * y, ctx.z * grad_out * x, None

    a, b, c = jnp.float32(1.0), jnp.float32(2.0), 4
    out, tangent = jax.jvp(lambda a: Func.apply(a, b, c), (a,), (jnp.float32(1.0),))
    close((out, tangent), (8.0, 8.0))
    close(jax.grad(Func.apply, (0, 1))(a, b, c), (8.0, 4.0))
    assert vjpkit.gradcheck(Func.apply, (np.float64(1.0), np.float64(2.0), c), check_forward_ad=True)


# ---------------------------------------------------------------------------
# test/functorch/test_eager_transforms.py: TestAutogradFunction and TestAutogradFunctionVmapAPI.


class _SavesNothing(vjpkit.Function):
    """A Function whose forward leaves nothing for its rules (TestAutogradFunctionVmapAPI's setup_context)."""

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass


class _Id(_SavesNothing):
    """TestAutogradFunctionVmapAPI's Id: each test adds its vmap staticmethod."""

    @staticmethod
    def forward(x):
        return x


class _Zeros(_SavesNothing):
    """TestAutogradFunctionVmapAPI's Zeros: each test adds its vmap staticmethod."""

    @staticmethod
    def forward(x):
        return jnp.zeros(x.shape)


class _TwoZeros(_SavesNothing):
    """TestAutogradFunctionVmapAPI's TwoZeros (and test_should_have_two_returns' FourReturns)."""

    @staticmethod
    def forward(x):
        r = jnp.zeros(x.shape)
        return r, r


def test_set_materialize_grads_under_functorch_grad():
    # TestAutogradFunction.test_set_materialize_grads: y's gradient is None, under grad and grad of grad.
    class A(vjpkit.Function):
        @staticmethod
        def forward(x, y):
            return x, y

        @staticmethod
        def setup_context(ctx, inputs, output):
            ctx.set_materialize_grads(False)

        @staticmethod
        def backward(ctx, gx, gy):
            assert gx is not None
            assert gy is None
            return gx, gy

    def f(y, x):
        x, y = A.apply(x, y)
        return x**2

    x, y = jnp.float32(2.0), jnp.float32(3.0)
    close(jax.grad(f)(y, x), 0.0)  # grad differentiates w.r.t. argument 0, y
    close(jax.grad(jax.grad(f))(y, x), 0.0)


def test_needs_input_grads():
    # TestAutogradFunction.test_needs_input_grads
    seen = []

    class A(_SavesNothing):
        @staticmethod
        def forward(x, y):
            return x * y

        @staticmethod
        def backward(ctx, grad_output):
            seen.append(ctx.needs_input_grad)
            return None, None

    x, y = jnp.float32(2.0), jnp.float32(3.0)
    jax.grad(A.apply)(x, y)
    jax.grad(jax.grad(A.apply))(x, y)
    assert seen and all(needs == (True, False) for needs in seen)


def test_once_differentiable_autograd_vjp():
    # TestAutogradFunction.test_once_differentiable_autograd_vjp: differentiating the vjp raises.
    class NumpyCubeNotComposable(vjpkit.Function):
        @staticmethod
        def forward(x):
            return x**3, x

        @staticmethod
        def setup_context(ctx, inputs, output):
            ctx.save_for_backward(inputs[0])

        @staticmethod
        @vjpkit.once_differentiable
        def backward(ctx, grad_output, grad_saved):
            (x,) = ctx.saved_tensors
            return 3 * x**2 * grad_output

    def f(x):
        y, _ = NumpyCubeNotComposable.apply(x)
        return y

    x, grad_y = jnp.float32(0.7), jnp.float32(1.3)
    (gx,) = jax.vjp(f, x)[1](grad_y)
    close(gx, 3 * 0.7**2 * 1.3)
    with pytest.raises(RuntimeError, match=r"decorated with @once_differentiable"):
        jax.grad(lambda x: jax.vjp(f, x)[1](grad_y)[0])(x)


def test_has_vmap_staticmethod_and_has_generate_vmap_rule():
    # TestAutogradFunctionVmapAPI.test_has_vmap_staticmethod_and_has_generate_vmap_rule. vjpkit raises when the
    # class is made (PyTorch: under vmap).
    with pytest.raises(TypeError, match=r"generate_vmap_rule = True and a vmap staticmethod"):

        class NumpyCube(_SavesNothing):
            generate_vmap_rule = True

            @staticmethod
            def forward(x):
                return x**3, 3 * x**2

            @staticmethod
            def vmap(info, in_dims, x):
                raise RuntimeError("foobar")


def test_info_object():
    # TestAutogradFunctionVmapAPI.test_info_object. vjpkit: jax.vmap has no randomness option; info.randomness
    # is PyTorch's default, "error".
    seen = []

    class Id(_Id):
        @staticmethod
        def vmap(info, in_dims, x):
            seen.append((info.batch_size, info.randomness))
            return x, in_dims[0]

    jax.vmap(Id.apply)(jnp.ones((10, 3)))
    assert seen == [(10, "error")]


def test_in_dims_single_input():
    # TestAutogradFunctionVmapAPI.test_in_dims_single_input. vjpkit (JAX's custom_vmap): the batch axis arrives
    # at the front whatever vmap's in_axes, so in_dims is (0,) for in_axes=1.
    x = jnp.arange(30.0).reshape(3, 10)
    seen = []

    class Id(_Id):
        @staticmethod
        def vmap(info, in_dims, x):
            seen.append(in_dims)
            return x, in_dims[0]

    close(jax.vmap(Id.apply, in_axes=1)(x), x.T)
    assert seen == [(0,)]


def test_in_dims_multiple_inputs():
    # TestAutogradFunctionVmapAPI.test_in_dims_multiple_inputs: a list input gets a list of dims.
    seen = []

    class Id(_SavesNothing):
        @staticmethod
        def forward(x, y):
            return x, y

        @staticmethod
        def vmap(info, in_dims, x, y):
            seen.append(in_dims)
            return (x, y), in_dims

    x = jnp.arange(2.0)
    out = jax.vmap(Id.apply)(x, [x, x])
    close(out, (x, [x, x]))
    assert seen == [(0, [0, 0])] and isinstance(seen[0], tuple) and isinstance(seen[0][1], list)


def test_skips_empty_layer():
    # TestAutogradFunctionVmapAPI.test_skips_empty_layer: an unbatched call never runs the rule.
    class Id(_Id):
        @staticmethod
        def vmap(info, in_dims, x):
            raise RuntimeError("expected to not be called")

    def f(x):
        Id.apply(jnp.float32(1.0))
        return x * 1

    x = jnp.ones((2, 3))
    close(jax.vmap(f)(x), x)


def test_none_returns():
    # TestAutogradFunctionVmapAPI.test_none_returns: out_dims None broadcasts the unbatched outputs.
    class Zeros(_Zeros):
        @staticmethod
        def vmap(info, in_dims, x):
            assert in_dims == (0,)
            return jnp.zeros(x.shape[1:]), None

    class TwoZeros(_TwoZeros):
        @staticmethod
        def vmap(info, in_dims, x):
            r = jnp.zeros(x.shape[1:])
            return (r, r), None

    x = jnp.ones((2, 3))
    close(jax.vmap(Zeros.apply)(x), np.zeros((2, 3)))
    y, z = jax.vmap(TwoZeros.apply)(x)
    close((y, z), (np.zeros((2, 3)), np.zeros((2, 3))))


def test_should_have_two_returns():
    # TestAutogradFunctionVmapAPI.test_should_have_two_returns
    class Zeros(_Zeros):
        @staticmethod
        def vmap(info, in_dims, x):
            return jnp.zeros(x.shape[1:])

    class FourReturns(_TwoZeros):
        @staticmethod
        def vmap(info, in_dims, x):
            r = jnp.zeros(x.shape[1:])
            return r, r, 0, 0

    for cls in (Zeros, FourReturns):
        with pytest.raises(TypeError, match=rf"{cls.__name__}.vmap returned .*expected a pair \(outputs, out_dims\)"):
            jax.vmap(cls.apply)(jnp.ones((2, 3)))


def test_incompatible_out_dims_error_msg():
    # TestAutogradFunctionVmapAPI.test_incompatible_out_dims_error_msg
    class Zeros(_Zeros):
        @staticmethod
        def vmap(info, in_dims, x):
            return jnp.zeros(x.shape[1:]), (None,)

    class ListZeros(_SavesNothing):
        @staticmethod
        def forward(x):
            return [jnp.zeros(x.shape)]

        @staticmethod
        def vmap(info, in_dims, x):
            return [jnp.zeros(x.shape[1:])], (None,)

    for cls in (Zeros, ListZeros):
        with pytest.raises(TypeError, match=rf"{cls.__name__}.vmap returned out_dims \(None,\), incompatible"):
            jax.vmap(cls.apply)(jnp.ones((2, 3)))
