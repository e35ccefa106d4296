"""``vjpkit.from_torch``: an unported ``torch.autograd.Function`` (or torch callable) run inside JAX.

Expected values are PyTorch's own numbers (the original run eagerly in
torch) or ``jax.grad`` of the same maths written in JAX.
"""

import os
import pathlib
import re
import subprocess
import sys

import functions
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from functions import Sin

import vjpkit

# jax.enable_x64 or its older home. Not the x64 fixture:
# A scope inside one test: float32 with x64 off, float64 with it on.
from vjpkit._jax_internals import enable_x64

torch = pytest.importorskip("torch")  # CI installs the torch extra
from torch.autograd.function import once_differentiable  # noqa: E402
from torch_functions import TorchAddOneInPlace, TorchExp  # noqa: E402

X = np.array([0.3, -1.2, 2.0])


Exp = vjpkit.from_torch(TorchExp)


class TScale(torch.autograd.Function):
    """x * scale, scale a Python float (static); records what torch saw."""

    seen: list = []

    @staticmethod
    def forward(ctx, x, scale, power=1):
        ctx.scale, ctx.power = scale, power
        ctx.save_for_backward(x)
        return scale * x ** power

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        TScale.seen.append((type(ctx.scale), ctx.power))
        return g * ctx.scale * ctx.power * x ** (ctx.power - 1), None, None


class TMul(torch.autograd.Function):
    needs: list = []

    @staticmethod
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        return a * b

    @staticmethod
    def backward(ctx, g):
        TMul.needs.append(tuple(ctx.needs_input_grad))
        a, b = ctx.saved_tensors
        return (g * b if ctx.needs_input_grad[0] else None, g * a if ctx.needs_input_grad[1] else None)


class TSort(torch.autograd.Function):
    """Values and indices; the indices are marked non-differentiable."""

    @staticmethod
    def forward(ctx, x):
        values, indices = torch.sort(x)
        ctx.save_for_backward(indices)
        ctx.mark_non_differentiable(indices)
        return values, indices

    @staticmethod
    def backward(ctx, g_values, g_indices):
        (indices,) = ctx.saved_tensors
        g = torch.zeros_like(g_values)
        g[indices] = g_values
        return g


class TTwoOutputs(torch.autograd.Function):
    """2x and 3x; with materialization off an unused output's gradient is None."""

    got_none: list = []

    @staticmethod
    def forward(ctx, x):
        ctx.set_materialize_grads(False)
        return 2 * x, 3 * x

    @staticmethod
    def backward(ctx, ga, gb):
        TTwoOutputs.got_none.append((ga is None, gb is None))
        g = torch.zeros_like(ga if ga is not None else gb)
        if ga is not None:
            g = g + 2 * ga
        if gb is not None:
            g = g + 3 * gb
        return g


class TCube(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x ** 3

    @staticmethod
    @once_differentiable
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return 3 * x ** 2 * g


class TSin(torch.autograd.Function):
    """With a jvp staticmethod: forward mode runs it."""

    jvp_calls = 0

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_forward(x)
        ctx.save_for_backward(x)
        return x.sin()

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g * x.cos()

    @staticmethod
    def jvp(ctx, t):
        TSin.jvp_calls += 1
        (x,) = ctx.saved_tensors
        return t * x.cos()


class TExpWithVmapRule(torch.autograd.Function):
    batch_sizes: list = []

    @staticmethod
    def forward(x):
        return x.exp()

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(output)

    @staticmethod
    def backward(ctx, g):
        (y,) = ctx.saved_tensors
        return g * y

    @staticmethod
    def vmap(info, in_dims, x):
        TExpWithVmapRule.batch_sizes.append(info.batch_size)
        return x.exp(), in_dims[0]


class TFailingBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, g):
        raise ValueError("this backward always fails")


def jit_grad(fn, *args, **kwargs):
    return jax.jit(jax.grad(fn, **kwargs))(*[jnp.asarray(a) for a in args])


# ---------------------------------------------------------------------------
# The basics: values, gradients, transformations.


def test_forward_equals_pytorch():
    np.testing.assert_allclose(np.asarray(Exp.apply(jnp.asarray(X, jnp.float32))), np.exp(X), rtol=1e-6)


def test_result_is_callable_as_well_as_apply():
    np.testing.assert_allclose(np.asarray(Exp(jnp.asarray(X, jnp.float32))), np.exp(X), rtol=1e-6)


def test_jit_grad_uses_the_originals_backward(x64):
    np.testing.assert_allclose(jit_grad(lambda x: Exp.apply(x).sum(), X), np.exp(X), rtol=1e-12)


def test_second_order_by_torchs_double_backward(x64):
    got = jax.grad(jax.grad(lambda x: Exp.apply(x)))(jnp.asarray(1.5))
    np.testing.assert_allclose(got, np.exp(1.5), rtol=1e-12)


def test_second_order_in_float32_where_the_output_feeds_the_cotangent():
    def loss(x):
        return jnp.sin(Exp.apply(x)).sum()

    x = jnp.asarray(X, jnp.float32)
    got = jax.grad(lambda x: jax.grad(loss)(x).sum())(x)
    y = np.exp(X)
    np.testing.assert_allclose(got, -np.sin(y) * y * y + np.cos(y) * y, rtol=1e-5)


def test_vmap_without_a_rule_loops_and_matches_per_example_gradients(x64):
    xs = np.stack([X, 2 * X])
    per_example = jax.vmap(jax.grad(lambda x: jnp.sum(jnp.sin(Exp.apply(x)))))(jnp.asarray(xs))
    np.testing.assert_allclose(per_example, np.cos(np.exp(xs)) * np.exp(xs), rtol=1e-12)


def test_scan_body(x64):
    def total(xs):
        return jax.lax.scan(lambda c, x: (c + Exp.apply(x).sum(), None), 0.0, xs)[0]

    xs = np.stack([X, -X])
    np.testing.assert_allclose(jit_grad(total, xs), np.exp(xs), rtol=1e-12)


def test_checkpoint(x64):
    np.testing.assert_allclose(jit_grad(lambda x: jax.checkpoint(lambda y: Exp.apply(y).sum())(x), X),
                               np.exp(X), rtol=1e-12)


def test_float32_stays_float32_and_float64_stays_float64():
    assert Exp.apply(jnp.ones(2, jnp.float32)).dtype == jnp.float32
    with enable_x64(True):  # float32 where x64 is off, float64 where it is on: one test of both
        assert Exp.apply(jnp.ones(2, jnp.float64)).dtype == jnp.float64
        assert jax.grad(lambda x: Exp.apply(x).sum())(jnp.ones(2, jnp.float64)).dtype == jnp.float64


# ---------------------------------------------------------------------------
# Arguments: statics, keywords, needs_input_grad.


def test_python_scalars_and_keywords_reach_torch_as_static_values(x64):
    Scale = vjpkit.from_torch(TScale)
    TScale.seen.clear()
    got = jit_grad(lambda x: Scale.apply(x, 2.5, power=3).sum(), X)
    np.testing.assert_allclose(got, 2.5 * 3 * X ** 2, rtol=1e-12)
    assert TScale.seen == [(float, 3)]


def test_needs_input_grad_is_what_jax_differentiates(x64):
    Mul = vjpkit.from_torch(TMul)
    TMul.needs.clear()
    got = jit_grad(lambda a, b: Mul.apply(a, b).sum(), X, 2 * X, argnums=1)
    np.testing.assert_allclose(got, X, rtol=1e-12)
    assert TMul.needs == [(False, True)]


def test_integer_inputs_are_not_differentiated(x64):
    class TTake(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, index):
            ctx.save_for_backward(index)
            ctx.n = x.shape[0]
            return x[index]

        @staticmethod
        def backward(ctx, g):
            (index,) = ctx.saved_tensors
            return torch.zeros(ctx.n, dtype=g.dtype, device=g.device).index_add_(0, index, g), None

    Take = vjpkit.from_torch(TTake)
    index = np.array([2, 0, 2])
    got = jit_grad(lambda x: Take.apply(x, jnp.asarray(index)).sum(), X)
    np.testing.assert_allclose(got, [1.0, 0.0, 2.0])


# ---------------------------------------------------------------------------
# The ctx flags, honoured by torch itself.


def test_mark_non_differentiable_output_is_an_integer_output_without_gradient(x64):
    Sort = vjpkit.from_torch(TSort)
    values, indices = Sort.apply(jnp.asarray(X))
    got = jax.grad(lambda x: (Sort.apply(x)[0] * jnp.arange(3.0)).sum())(jnp.asarray(X))
    np.testing.assert_allclose(values, np.sort(X))
    assert indices.tolist() == np.argsort(X).tolist()
    np.testing.assert_allclose(got, [1.0, 0.0, 2.0])  # each element's rank in the sorted order


def test_materialize_grads_off_gives_none_for_an_unused_output(x64):
    Two = vjpkit.from_torch(TTwoOutputs)
    TTwoOutputs.got_none.clear()
    np.testing.assert_allclose(jit_grad(lambda x: Two.apply(x)[0].sum(), X), 2 * np.ones(3))
    assert TTwoOutputs.got_none == [(False, True)]


def test_once_differentiable_first_order_works_second_order_raises_naming_the_class(x64):
    Cube = vjpkit.from_torch(TCube)
    np.testing.assert_allclose(jit_grad(lambda x: Cube.apply(x).sum(), X), 3 * X ** 2, rtol=1e-12)
    with pytest.raises(RuntimeError, match=r"TCube\.backward is decorated with @once_differentiable"):
        jax.grad(lambda x: jax.grad(lambda y: Cube.apply(y).sum())(x).sum())(jnp.asarray(X, jnp.float32))


# ---------------------------------------------------------------------------
# Forward mode and batching rules.


def test_jvp_staticmethod_gives_forward_mode(x64):
    Sin = vjpkit.from_torch(TSin)
    TSin.jvp_calls = 0
    _, tangent = jax.jvp(Sin.apply, (jnp.asarray(X),), (jnp.ones(3),))
    np.testing.assert_allclose(tangent, np.cos(X), rtol=1e-12)
    assert TSin.jvp_calls == 1


def test_without_jvp_forward_mode_raises_naming_the_class():
    with pytest.raises(TypeError, match=r"TorchExp has no forward-mode derivative \(jax\.jvp, jax\.jacfwd, "
                                        r"jax\.linearize\): it defines backward but no jvp\. Add a jvp"):
        jax.jvp(Exp.apply, (jnp.ones(3),), (jnp.ones(3),))


def test_vmap_staticmethod_batches_in_one_torch_call():
    Rule = vjpkit.from_torch(TExpWithVmapRule)
    TExpWithVmapRule.batch_sizes.clear()
    xs = np.stack([X, 2 * X, 3 * X, 4 * X])
    np.testing.assert_allclose(jax.vmap(Rule.apply)(jnp.asarray(xs, jnp.float32)), np.exp(xs), rtol=1e-6)
    assert TExpWithVmapRule.batch_sizes == [4]


def test_generate_vmap_rule_batches_in_one_torch_call():
    calls = []

    class TSquare(torch.autograd.Function):
        generate_vmap_rule = True

        @staticmethod
        def forward(x):
            calls.append(tuple(x.shape))
            return x * x

        @staticmethod
        def setup_context(ctx, inputs, output):
            ctx.save_for_backward(inputs[0])

        @staticmethod
        def backward(ctx, g):
            (x,) = ctx.saved_tensors
            return 2 * x * g

    Square = vjpkit.from_torch(TSquare)
    Square.apply(jnp.asarray(X, jnp.float32))  # learns the output shape for this input shape
    xs = np.stack([X, 2 * X, 3 * X, 4 * X])
    calls.clear()
    np.testing.assert_allclose(jax.vmap(Square.apply)(jnp.asarray(xs, jnp.float32)), xs ** 2, rtol=1e-6)
    assert calls == [(3,)]  # one call for the 4 examples: torch.func.vmap shows forward one example's shape


def test_class_with_jvp_gives_hessian_by_forward_over_reverse(x64):
    Sin = vjpkit.from_torch(TSin)
    got = jax.hessian(lambda x: Sin.apply(x).sum())(jnp.asarray(X))
    np.testing.assert_allclose(got, np.diag(-np.sin(X)), rtol=1e-12, atol=1e-15)


# ---------------------------------------------------------------------------
# A torch callable: gradients from torch autograd.


def test_callable_forward_and_gradient_by_torch_autograd(x64):
    soft = vjpkit.from_torch(lambda x, t: torch.softmax(x / t, -1))
    x = jnp.asarray(X)
    np.testing.assert_allclose(soft(x, 2.0), jax.nn.softmax(x / 2.0), rtol=1e-12)
    got = jax.jit(jax.grad(lambda x: soft(x, 2.0)[0]))(x)
    np.testing.assert_allclose(got, jax.grad(lambda x: jax.nn.softmax(x / 2.0)[0])(x), rtol=1e-12)


def test_callable_hessian_by_torch_forward_over_reverse(x64):
    def softplus_sum(x):
        return torch.nn.functional.softplus(x).sum()

    fn = vjpkit.from_torch(softplus_sum)
    got = jax.hessian(fn)(jnp.asarray(X))
    sig = 1 / (1 + np.exp(-X))
    np.testing.assert_allclose(got, np.diag(sig * (1 - sig)), rtol=1e-12, atol=1e-15)


def test_gradcheck_judges_an_unported_original():
    class TWrongSquare(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return x ** 2

        @staticmethod
        def backward(ctx, g):
            (x,) = ctx.saved_tensors
            return g * x  # should be 2 * g * x

    assert vjpkit.gradcheck(Exp.apply, (X,))
    assert vjpkit.gradgradcheck(Exp.apply, (X,))
    assert not vjpkit.gradcheck(vjpkit.from_torch(TWrongSquare).apply, (X,), raise_exception=False)


# ---------------------------------------------------------------------------
# Errors and in-place updates.


def test_torch_error_at_run_time_names_the_class_and_method():
    Failing = vjpkit.from_torch(TFailingBackward)
    with pytest.raises(Exception, match=r"TFailingBackward\.backward \(PyTorch, run by vjpkit\.from_torch\) "
                                         r"raised ValueError: this backward always fails"):
        # Awaited: where programs run asynchronously (a GPU), the error arrives there, not at the call.
        jax.jit(jax.grad(lambda x: Failing.apply(x).sum()))(jnp.ones(3)).block_until_ready()


def test_torch_error_while_tracing_names_the_class_and_method():
    class TWrongShapes(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a, b):
            return a @ b

        @staticmethod
        def backward(ctx, g):
            return None, None

    Wrong = vjpkit.from_torch(TWrongShapes)
    with pytest.raises(RuntimeError, match=r"TWrongShapes\.forward \(PyTorch, run by vjpkit\.from_torch\) raised"):
        Wrong.apply(jnp.ones((2, 3)), jnp.ones((2, 3)))


def test_in_place_update_of_an_input_raises_and_says_copy_inputs():
    AddOne = vjpkit.from_torch(TorchAddOneInPlace)
    x = jnp.zeros(3)
    with pytest.raises(Exception, match=r"TorchAddOneInPlace\.forward .*wrote into its input x in place.*"
                                         r"copy_inputs=True"):
        jax.block_until_ready(AddOne.apply(x))


def test_copy_inputs_runs_mark_dirty_on_copies():
    AddOne = vjpkit.from_torch(TorchAddOneInPlace, copy_inputs=True)
    x = jnp.zeros(3)
    np.testing.assert_allclose(AddOne.apply(x), np.ones(3))
    np.testing.assert_allclose(x, np.zeros(3))
    np.testing.assert_allclose(jax.grad(lambda x: AddOne.apply(x).sum())(x), np.ones(3))


def test_vjpkit_function_on_a_torch_class_points_to_from_torch():
    with pytest.raises(TypeError, match=r"vjpkit\.function\(TorchExp\): TorchExp is a torch\.autograd\.Function\. "
                                        r"To run it unchanged .* use vjpkit\.from_torch\(TorchExp\)"):
        vjpkit.function(TorchExp)


def test_from_torch_of_something_else_raises():
    with pytest.raises(TypeError, match=r"vjpkit\.from_torch expects a torch\.autograd\.Function subclass or a "
                                        r"callable of tensors, got int"):
        vjpkit.from_torch(3)


def test_from_torch_of_a_vjpkit_function_points_to_its_apply():
    with pytest.raises(TypeError, match=r"vjpkit\.from_torch\(Sin\): Sin is already a vjpkit Function; "
                                        r"call Sin\.apply directly"):
        vjpkit.from_torch(Sin)


@pytest.mark.parametrize("mode", ["callback", "trace", "auto"])
def test_from_torch_of_its_own_result_asks_for_the_original_with_every_option(mode):
    # Wrapped again, the result would get torch tensors (trace mode's stand-ins) as static arguments,
    # and hand them to the original on the host, where their values are gone.
    for made in (vjpkit.from_torch(lambda x: x @ x.T, reentrant=True), vjpkit.from_torch(TorchExp),
                 vjpkit.from_torch(TorchExp, mode="auto")):
        with pytest.raises(TypeError, match=r"is already what vjpkit\.from_torch made, a function of JAX arrays; "
                                            r"pass the original itself, with every option at once"):
            vjpkit.from_torch(made, mode=mode)


def test_a_torch_tensor_argument_is_refused_naming_its_position():
    with pytest.raises(TypeError, match=r"TMul \(vjpkit\.from_torch\) got a torch\.Tensor in argument 1: it takes "
                                        r"JAX or NumPy arrays"):
        vjpkit.from_torch(TMul).apply(np.ones(3), torch.ones(3))


SHARDED_SCRIPT = """
import jax, jax.numpy as jnp, numpy as np, torch, vjpkit
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
try:
    from jax import shard_map
except ImportError:  # JAX before 0.6: its replication check knows no custom primitive (as in sharded_script.py)
    import functools
    from jax.experimental.shard_map import shard_map as experimental_shard_map
    shard_map = functools.partial(experimental_shard_map, check_rep=False)

class TExp(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        y = x.exp(); ctx.save_for_backward(y); return y
    @staticmethod
    def backward(ctx, g):
        (y,) = ctx.saved_tensors; return g * y

Exp = vjpkit.from_torch(TExp)
mesh = Mesh(np.array(jax.devices()[:2]), ("b",))
x = jax.device_put(jnp.arange(8.0).reshape(4, 2) / 8, NamedSharding(mesh, P("b")))
grad = jax.grad(lambda x: Exp.apply(x).sum())
np.testing.assert_allclose(jax.jit(grad)(x), np.exp(np.asarray(x)), rtol=1e-6)
per_shard = shard_map(grad, mesh=mesh, in_specs=P("b"), out_specs=P("b"))
np.testing.assert_allclose(jax.jit(per_shard)(x), np.exp(np.asarray(x)), rtol=1e-6)
"""


def test_sharded_jit_and_shard_map_over_two_devices():
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu")
    subprocess.run([sys.executable, "-c", SHARDED_SCRIPT], check=True, env=env, capture_output=True)


def test_importing_vjpkit_does_not_import_torch():
    code = "import sys, vjpkit; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


# ---------------------------------------------------------------------------
# The side-by-side check.


def test_port_matches_original_reports_zero_for_a_right_port():
    differences = vjpkit.testing.assert_port_matches_original(functions.Exp, TorchExp, X, second_order=True)
    assert set(differences) == {"output", "gradient", "second order"}
    assert max(differences.values()) < 1e-12


def test_port_matches_original_names_what_differs_for_a_wrong_port():
    class WrongExp(functions.Exp):
        @staticmethod
        def backward(ctx, g):
            (y,) = ctx.saved_tensors
            return 2 * g * y

    with pytest.raises(AssertionError, match=r"WrongExp does not match its original TorchExp within atol=1e-06 "
                                             r"\(gradient\)"):
        vjpkit.testing.assert_port_matches_original(WrongExp, TorchExp, X)


def test_guide_code_blocks_run_in_order():
    guide = pathlib.Path(__file__).resolve().parent.parent / "docs" / "from_torch.md"
    namespace: dict = {}
    for k, block in enumerate(re.findall(r"```python\n(.*?)```", guide.read_text(), re.DOTALL)):
        exec(compile(block, f"docs/from_torch.md (block {k})", "exec"), namespace)
