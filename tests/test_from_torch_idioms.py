"""``vjpkit.from_torch`` (callbacks) on ordinary PyTorch idioms.

Optional arguments the caller leaves out, ``**kwargs`` forwards, a backward
that writes into ``grad_output``, and operations whose output shapes depend
on values (``nonzero``, ``masked_select``, a boolean mask index). Expected
values are PyTorch's own: the original run eagerly in torch.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import vjpkit

torch = pytest.importorskip("torch")  # CI installs the torch extra

A = np.array([0.5, -1.0, 2.0, 1.5])
X = np.array([1.0, 3.0, -2.0, 0.25])


def torch_grads(fn, *args):
    """Values and gradients (of the sum of the output) of ``fn`` run eagerly in torch."""
    ts = [torch.tensor(a, requires_grad=True) for a in args]
    out = fn(*ts)
    return out.detach().numpy(), [g.numpy() for g in torch.autograd.grad(out, ts, torch.ones_like(out))]


def assert_matches_torch(wrapped, original, *args):
    want_out, want_grads = torch_grads(original, *args)
    arrays = [jnp.asarray(a) for a in args]
    got_out = wrapped(*arrays)
    got_grads = jax.jit(jax.grad(lambda *a: wrapped(*a).sum(), argnums=tuple(range(len(args)))))(*arrays)
    np.testing.assert_allclose(got_out, want_out, rtol=1e-12)
    for got, want in zip(got_grads, want_grads, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-12)


# ---------------------------------------------------------------------------
# Arguments: only what the caller passed reaches the original.


class TScan(torch.autograd.Function):
    """An optional tensor argument (mamba's parallel scan's ``Y_init=None``); backward returns two gradients."""

    @staticmethod
    def forward(ctx, a, x, y_init=None):
        ctx.save_for_backward(a, x)
        return a * x if y_init is None else a * x + y_init

    @staticmethod
    def backward(ctx, g):
        a, x = ctx.saved_tensors
        return g * x, g * a


def test_an_optional_argument_left_out_is_not_passed_to_the_original(x64):
    Scan = vjpkit.from_torch(TScan)
    assert_matches_torch(lambda a, x: Scan.apply(a, x), lambda a, x: TScan.apply(a, x), A, X)


def test_a_keyword_after_a_left_out_argument_goes_by_name():
    seen = []

    def scaled(x, bias=None, scale=1.0):
        seen.append(bias)
        return x * scale

    fn = vjpkit.from_torch(scaled)
    np.testing.assert_allclose(fn(jnp.asarray(A, jnp.float32), scale=3.0), 3 * A, rtol=1e-6)
    assert seen and all(b is None for b in seen)


def test_a_torch_tensor_default_reaches_the_original_as_its_own(x64):
    def shifted(x, shift=torch.tensor(2.0, dtype=torch.float64)):  # noqa: B008 - the idiom under test
        return x + shift

    assert_matches_torch(vjpkit.from_torch(shifted), shifted, A)


def test_extra_keyword_arguments_reach_a_forward_taking_kwargs(x64):
    def affine(x, **kwargs):
        return x * kwargs["scale"] + kwargs["shift"]

    fn = vjpkit.from_torch(affine)
    got = jax.grad(lambda x, s: fn(x, scale=s, shift=1.5).sum(), argnums=(0, 1))(jnp.asarray(A), jnp.asarray(X))
    ta, tx = torch.tensor(A, requires_grad=True), torch.tensor(X, requires_grad=True)
    want = torch.autograd.grad(affine(ta, scale=tx, shift=1.5).sum(), (ta, tx))
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w.numpy(), rtol=1e-12)
    np.testing.assert_allclose(fn(jnp.asarray(A), scale=2.0, shift=0.0), 2 * A, rtol=1e-12)


# ---------------------------------------------------------------------------
# In-place writes into grad_output.


class TClipGrad(torch.autograd.Function):
    """Zeroes grad_output where x < 0, in place (as Sinkhorn's and straight-through backwards do)."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return 2 * x

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        g[x < 0] = 0
        return 2 * g


def test_copy_inputs_covers_a_backward_writing_into_grad_output(x64):
    Clip = vjpkit.from_torch(TClipGrad, copy_inputs=True)
    ct = jnp.ones(4)
    out, vjp = jax.vjp(Clip.apply, jnp.asarray(X))
    (got,) = vjp(ct)
    np.testing.assert_allclose(got, torch_grads(TClipGrad.apply, X)[1][0], rtol=1e-12)
    np.testing.assert_allclose(ct, np.ones(4))  # JAX's cotangent untouched


def test_a_write_into_grad_output_without_copy_inputs_names_grad_output(x64):
    Clip = vjpkit.from_torch(TClipGrad)
    with pytest.raises(Exception, match=r"TClipGrad\.backward \(PyTorch, run by vjpkit\.from_torch\) wrote into "
                                        r"grad_output \(g\) in place, .*copy_inputs=True"):
        jax.block_until_ready(jax.grad(lambda x: Clip.apply(x).sum())(jnp.asarray(X)))


def test_a_write_into_a_keyword_argument_names_it(x64):
    def bump(x, **kwargs):
        kwargs["w"].add_(1)
        return x * 2

    fn = vjpkit.from_torch(bump)
    with pytest.raises(Exception, match=r"bump \(PyTorch, run by vjpkit\.from_torch\) wrote into its input "
                                        r"kwargs\['w'\] in place"):
        jax.block_until_ready(fn(jnp.asarray(X), w=jnp.asarray(A)))


# ---------------------------------------------------------------------------
# Output shapes that depend on values: refused, never learned from sample values.


@pytest.mark.parametrize("name, fn", [
    ("torch.masked_select", lambda x: torch.masked_select(x, x > 1.0)),
    ("torch.nonzero", lambda x: torch.nonzero(x > 1.0)),
    ("torch.argwhere", lambda x: torch.argwhere(x)),
    ("torch.Tensor.__getitem__ with a boolean mask", lambda x: x[x > 1.0] * 2),
    ("torch.unique", lambda x: torch.unique(x)),
])
def test_an_output_shape_that_depends_on_values_is_refused_naming_the_operation(name, fn):
    wrapped = vjpkit.from_torch(fn)
    with pytest.raises(ValueError, match=rf"lambda \(run by vjpkit\.from_torch\): the shape of its output 0 depends "
                                         rf"on its inputs' values, through {name.replace('.', '[.]')}\. JAX fixes"):
        wrapped(jnp.asarray(X, jnp.float32))


def test_an_integer_inputs_nonzero_is_refused_too():
    wrapped = vjpkit.from_torch(lambda i: torch.nonzero(i))
    with pytest.raises(ValueError, match=r"through torch\.nonzero"):
        wrapped(jnp.asarray([0, 3, 0, 1]))


def test_a_masked_reduction_keeps_its_fixed_shape(x64):
    def masked_sum(x):
        return x[x > 0].sum() * x

    assert_matches_torch(vjpkit.from_torch(masked_sum), masked_sum, X)


def test_nonzero_inside_a_sparse_matmul_keeps_its_fixed_shape(x64):
    """pyGAT's sparse attention: the edges come from adj.nonzero(), the output is dense and fixed."""
    adj = np.array([[1.0, 0.0, 2.0], [0.0, 0.5, 0.0], [3.0, 0.0, 0.0]])
    h = np.arange(6.0).reshape(3, 2)

    def sparse_matmul(adj, h):
        edge = adj.nonzero().t()
        values = adj[edge[0], edge[1]]
        return torch.sparse.mm(torch.sparse_coo_tensor(edge, values, adj.shape, check_invariants=True), h)

    assert_matches_torch(vjpkit.from_torch(sparse_matmul), sparse_matmul, adj, h)


def test_an_output_shape_read_from_a_value_is_checked_on_every_call():
    """No operation to name (``.item()``), so the callback compares each output's shape with the one traced."""
    wrapped = vjpkit.from_torch(lambda x: x[: int((x > 1.0).sum().item())])
    with pytest.raises(Exception, match=r"lambda \(PyTorch, run by vjpkit\.from_torch\) returned output 0 of shape "
                                        r"\(4,\), but of shape \([0-3],\) on the values vjpkit ran it on to "
                                        r"learn its output shapes: its output shapes depend on its inputs' values\. "
                                        r"JAX fixes"):
        jax.block_until_ready(wrapped(jnp.asarray([5.0, 6.0, 7.0, 8.0])))


def test_a_torch_return_types_result_comes_back_as_a_namedtuple_with_torchs_values():
    top = vjpkit.from_torch(lambda x: torch.max(x, 1))
    x = np.array([[3.0, 1.0, 2.0], [0.0, 5.0, 1.0]], np.float32)
    want = torch.max(torch.tensor(x), 1)
    got = top(x)
    assert type(got).__name__ == "max" and got._fields == ("values", "indices")
    np.testing.assert_array_equal(got.values, want.values.numpy())
    np.testing.assert_array_equal(got.indices, want.indices.numpy())
    np.testing.assert_array_equal(jax.grad(lambda x: top(x).values.sum())(x), [[1, 0, 0], [0, 1, 0]])
