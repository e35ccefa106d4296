"""``vjpkit.from_torch(..., mode="trace")``: a PyTorch original run as JAX operations.

Expected values are ``jax.grad`` of the same maths written in JAX, or
torch's own numbers (the original run eagerly).
"""

import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import vjpkit

torch = pytest.importorskip("torch")  # CI installs the torch extra
from test_from_torch import TCube, TExpWithVmapRule, TMul, TSin, TTwoOutputs  # noqa: E402  (shared originals)
from test_from_torch_idioms import TScan  # noqa: E402  (an optional tensor argument)
from torch_functions import TorchExp  # noqa: E402

X = np.array([0.3, -1.2, 2.0], np.float32)
WAIT_S = 60  # a guard against a deadlock only: the threads wait for each other's events




class TSort(torch.autograd.Function):
    """Sorted values and their indices, marked non-differentiable; a scale kept as a ctx attribute."""

    @staticmethod
    def forward(ctx, x, scale):
        values, indices = torch.sort(x)
        ctx.save_for_backward(indices)
        ctx.scale = scale
        ctx.mark_non_differentiable(indices)
        return values * scale, indices

    @staticmethod
    def backward(ctx, g_values, g_indices):
        (indices,) = ctx.saved_tensors
        g = torch.zeros_like(g_values)
        g[indices] = g_values * ctx.scale
        return g, None





class TSeesRequiresGrad(torch.autograd.Function):
    seen: list = []

    @staticmethod
    def forward(ctx, x):
        TSeesRequiresGrad.seen.append(x.requires_grad)
        return x * 2

    @staticmethod
    def backward(ctx, g):
        return g * 2


class TItem(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * x.max().item()

    @staticmethod
    def backward(ctx, g):
        return g


class TFft(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return torch.fft.fft(x).real

    @staticmethod
    def backward(ctx, g):
        return g



def no_callback(fn, *args):
    return "callback" not in str(jax.make_jaxpr(fn)(*args))


# ---------------------------------------------------------------------------
# A Function class: its methods as JAX operations, vjpkit's contract.


def test_traced_class_gives_values_and_its_own_backward_without_a_callback():
    Exp = vjpkit.from_torch(TorchExp, mode="trace")
    grad = jax.grad(lambda x: Exp.apply(x).sum())
    np.testing.assert_allclose(Exp.apply(X), np.exp(X), rtol=1e-6)
    np.testing.assert_allclose(jax.jit(grad)(X), np.exp(X), rtol=1e-6)
    assert no_callback(grad, X)


def test_traced_class_sees_needs_input_grad_as_jax_differentiates():
    Mul = vjpkit.from_torch(TMul, mode="trace")
    TMul.needs.clear()
    ga = jax.grad(lambda a, b: Mul.apply(a, b).sum())(X, 2 * X)
    np.testing.assert_allclose(ga, 2 * X)
    assert TMul.needs == [(True, False)]


def test_traced_class_honours_mark_non_differentiable_and_attributes():
    Sort = vjpkit.from_torch(TSort, mode="trace")
    values, indices = Sort.apply(X, 2.0)
    np.testing.assert_allclose(values, np.sort(X) * 2)
    assert indices.tolist() == np.argsort(X).tolist()
    weights = np.array([1.0, 10.0, 100.0], np.float32)
    got = jax.grad(lambda x: (Sort.apply(x, 2.0)[0] * weights).sum())(X)
    want = jax.grad(lambda x: (jnp.sort(x) * 2.0 * weights).sum())(X)
    np.testing.assert_allclose(got, want)


def test_traced_class_without_materialized_grads_gets_none_for_an_unused_output():
    Two = vjpkit.from_torch(TTwoOutputs, mode="trace")
    TTwoOutputs.got_none.clear()
    np.testing.assert_allclose(jax.grad(lambda x: Two.apply(x)[0].sum())(X), [2.0, 2.0, 2.0])
    assert TTwoOutputs.got_none == [(False, True)]


def test_traced_class_second_order_differentiates_its_backward():
    Exp = vjpkit.from_torch(TorchExp, mode="trace")
    second = jax.grad(lambda x: jax.grad(lambda x: Exp.apply(x).sum())(x).sum())(X)
    np.testing.assert_allclose(second, np.exp(X), rtol=1e-6)


def test_traced_once_differentiable_backward_refuses_second_order():
    Cube = vjpkit.from_torch(TCube, mode="trace")
    np.testing.assert_allclose(jax.grad(lambda x: Cube.apply(x).sum())(X), 3 * X ** 2, rtol=1e-6)
    with pytest.raises(Exception, match="once_differentiable"):
        jax.grad(lambda x: jax.grad(lambda x: Cube.apply(x).sum())(x).sum())(X)


def test_traced_class_jvp_staticmethod_gives_forward_mode():
    Sin = vjpkit.from_torch(TSin, mode="trace")
    _, tangent = jax.jvp(Sin.apply, (X,), (np.ones_like(X),))
    np.testing.assert_allclose(tangent, np.cos(X), rtol=1e-6)


def test_traced_class_under_vmap_of_grad_matches_per_example_gradients():
    Exp = vjpkit.from_torch(TorchExp, mode="trace")
    xs = np.stack([X, 2 * X])
    got = jax.jit(jax.vmap(jax.grad(lambda x: Exp.apply(x).sum())))(xs)
    np.testing.assert_allclose(got, np.exp(xs), rtol=1e-6)


def test_traced_forward_sees_requires_grad_as_needs_input_grad():
    Twice = vjpkit.from_torch(TSeesRequiresGrad, mode="trace")
    TSeesRequiresGrad.seen.clear()
    Twice.apply(X)
    jax.grad(lambda x: Twice.apply(x).sum())(X)
    assert TSeesRequiresGrad.seen == [False, True]


def test_two_threads_tracing_at_once_each_see_their_own_grad_mode():
    """A forward (run without grad, as torch runs it) and a callable (JAX differentiates it) traced at once:
    the forward, entered first, reads a saved tensor back while the callable's trace is open, and sees it
    not requiring grad, as alone; the callable's argument requires grad."""
    forward_in, callable_in, forward_read = threading.Event(), threading.Event(), threading.Event()
    seen: dict = {"forward": [], "callable": []}

    class TReadsSaved(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            forward_in.set()
            callable_in.wait(WAIT_S)
            seen["forward"].append(ctx.saved_tensors[0].requires_grad)
            forward_read.set()
            return x * 2

        @staticmethod
        def backward(ctx, g):
            return g * 2

    def doubled(x):
        forward_in.wait(WAIT_S)
        callable_in.set()
        forward_read.wait(WAIT_S)
        seen["callable"].append(x.requires_grad)
        return x * 2

    Twice = vjpkit.from_torch(TReadsSaved, mode="trace")
    twice = vjpkit.from_torch(doubled, mode="trace")
    threads = [threading.Thread(target=Twice.apply, args=(X,)), threading.Thread(target=twice, args=(X,))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert (forward_in.is_set(), callable_in.is_set(), forward_read.is_set()) == (True, True, True)
    assert seen == {"forward": [False], "callable": [True]}


def test_trace_mode_refuses_a_class_with_a_vmap_rule_and_auto_uses_callbacks():
    with pytest.raises(NotImplementedError, match=r"TExpWithVmapRule.vmap, which is torch's batching rule"):
        vjpkit.from_torch(TExpWithVmapRule, mode="trace")
    auto = vjpkit.from_torch(TExpWithVmapRule, mode="auto")
    np.testing.assert_allclose(jax.vmap(auto.apply)(np.stack([X, X])), np.exp(np.stack([X, X])), rtol=1e-6)


# ---------------------------------------------------------------------------
# A callable: traced, differentiated by JAX.


def test_traced_callable_equals_the_same_maths_in_jax_with_its_gradient():
    soft = vjpkit.from_torch(lambda x, t: torch.softmax(x / t, -1), mode="trace")
    np.testing.assert_allclose(soft(X, 2.0), jax.nn.softmax(X / 2.0), rtol=1e-6)
    got = jax.jit(jax.grad(lambda x: soft(x, 2.0)[0]))(X)
    np.testing.assert_allclose(got, jax.grad(lambda x: jax.nn.softmax(x / 2.0)[0])(X), rtol=1e-6)
    assert no_callback(jax.grad(lambda x: soft(x, 2.0)[0]), X)


def test_traced_callable_reductions_take_torchs_dim_and_keepdim():
    fn = vjpkit.from_torch(lambda x: x.sum(1, keepdim=True) - x.amax(dim=0) + x.mean(), mode="trace")
    x = np.arange(6.0, dtype=np.float32).reshape(2, 3)
    np.testing.assert_allclose(fn(x), x.sum(1, keepdims=True) - x.max(0) + x.mean())


def test_traced_callable_keeps_torchs_type_promotion():
    fn = vjpkit.from_torch(lambda x, n: (n * 2.5, x * torch.tensor(2.0, dtype=torch.float64), (x > 0).sum(),
                                         x.to(torch.int32) / 2), mode="trace")
    scaled, by_constant, count, halves = fn(X, np.array([1, 2], np.int32))
    assert scaled.dtype == jnp.float32  # int tensor * Python float: the default float dtype
    assert by_constant.dtype == jnp.float32  # a 0-dim tensor does not promote a dimensioned one
    assert count == 2 and jnp.issubdtype(count.dtype, jnp.integer)
    np.testing.assert_allclose(halves, np.array([0.0, -0.5, 1.0]))  # int / int is true division


def test_traced_callable_one_hot_equals_jax_one_hot():
    indices = np.array([[0, 3], [2, 1]], np.int32)
    hot = vjpkit.from_torch(lambda i: torch.nn.functional.one_hot(i.long(), num_classes=4).float(), mode="trace")
    assert no_callback(hot, indices)
    np.testing.assert_array_equal(hot(indices), jax.nn.one_hot(indices, 4))


def test_traced_callable_runs_torch_functional_einsum_and_split():
    def halves_product(x):
        a, b = torch.split(x, 2, dim=-1)
        return torch.einsum("ij,ij->i", a, b)

    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    traced = vjpkit.from_torch(halves_product, mode="trace")
    assert no_callback(traced, x)
    np.testing.assert_allclose(traced(x), (x[:, :2] * x[:, 2:]).sum(-1))


def test_traced_callable_in_place_ops_on_a_local_tensor_are_functional_updates():
    def clipped(x):
        y = x.clone()
        y.mul_(2).clamp_(max=1.0)
        y[x < 0] = 0.0
        return y

    fn = vjpkit.from_torch(clipped, mode="trace")
    np.testing.assert_allclose(fn(X), [0.6, 0.0, 1.0], rtol=1e-6)
    np.testing.assert_allclose(jax.grad(lambda x: fn(x).sum())(X), [2.0, 0.0, 0.0])


def test_in_place_write_into_a_view_names_the_op():
    def through_view(x):
        y = x.clone()
        y.view(-1).add_(1)
        return y

    with pytest.raises(NotImplementedError, match=r"torch.Tensor.add_, which writes into a view"):
        vjpkit.from_torch(through_view, mode="trace")(X)


def test_traced_callable_calling_a_function_names_it():
    fn = vjpkit.from_torch(lambda x: TorchExp.apply(x) * 2, mode="trace")
    with pytest.raises(NotImplementedError, match=r"lambda calls TorchExp.apply"):
        fn(X)


# ---------------------------------------------------------------------------
# What does not trace: an error naming the op; auto falls back to callbacks.


def test_reading_a_value_names_the_op():
    with pytest.raises(NotImplementedError, match=r"TItem.forward calls torch.Tensor.item, which needs the "
                                                  r"tensor's value"):
        vjpkit.from_torch(TItem, mode="trace").apply(X)


def test_an_unmapped_op_is_named():
    with pytest.raises(NotImplementedError, match=r"TFft.forward calls torch.fft.fft, which has no JAX rule"):
        vjpkit.from_torch(TFft, mode="trace").apply(X)


def test_a_random_draw_is_named_not_frozen_into_the_program():
    noisy = vjpkit.from_torch(lambda x: x + torch.randn(3), mode="trace")
    with pytest.raises(NotImplementedError, match=r"lambda calls torch.randn, which draws random numbers"):
        noisy(X)


def test_auto_falls_back_to_callbacks_for_an_untraceable_original():
    auto = vjpkit.from_torch(TItem, mode="auto")
    assert not no_callback(auto.apply, X)
    np.testing.assert_allclose(auto.apply(X), X * X.max(), rtol=1e-6)
    np.testing.assert_allclose(jax.grad(lambda x: auto(x).sum())(X), np.ones_like(X))


def test_auto_traces_a_traceable_original():
    auto = vjpkit.from_torch(TorchExp, mode="auto")
    assert no_callback(jax.grad(lambda x: auto.apply(x).sum()), X)


def test_auto_callable_falls_back_when_it_reads_a_value():
    auto = vjpkit.from_torch(lambda x: x * float(x.sum()), mode="auto")
    np.testing.assert_allclose(auto(X), X * X.sum(), rtol=1e-6)


def test_unknown_mode_is_refused():
    with pytest.raises(ValueError, match=r"mode must be one of 'callback', 'trace', 'auto', got 'jit'"):
        vjpkit.from_torch(TorchExp, mode="jit")


# ---------------------------------------------------------------------------
# Trace mode's caches: keyed by everything a trace depends on, emptied by vjpkit.clear_caches().


def test_traced_callable_static_output_belongs_to_its_own_shape():
    sized = vjpkit.from_torch(lambda x: (x * 2, x.shape[0]), mode="trace")
    assert [sized(np.ones(n, np.float32))[1] for n in (2, 3, 2)] == [2, 3, 2]


def test_traced_callable_static_1_1_0_true_and_minus_zero_are_different_traces():
    filled = vjpkit.from_torch(lambda x, c: (x * 2, torch.full(x.shape, c)), mode="trace")
    got = [filled(X, c)[1] for c in (1, 1.0, True, 0.0, -0.0, 1)]
    assert [g.dtype for g in got] == [np.int32, np.float32, np.bool_, np.float32, np.float32, np.int32]
    assert [bool(np.signbit(g[0])) for g in got[3:5]] == [False, True]


def test_traced_callable_follows_x64(x64):
    doubled = vjpkit.from_torch(lambda x: x * 2, mode="trace")
    assert doubled(X.astype(np.float64)).dtype == np.float64
    with vjpkit._jax_internals.enable_x64(False):
        assert doubled(X.astype(np.float64)).dtype == np.float32


def test_auto_chooses_per_signature_trace_for_one_and_callbacks_for_another():
    reads_long_inputs = vjpkit.from_torch(lambda x: x * 2 if x.shape[0] < 4 else x * float(x.sum()), mode="auto")
    short, long = np.ones(3, np.float32), np.ones(5, np.float32)
    for _ in range(2):
        assert no_callback(reads_long_inputs, short)
        assert not no_callback(reads_long_inputs, long)
    np.testing.assert_allclose(reads_long_inputs(long), long * 5)


def test_clear_caches_empties_trace_modes_caches():
    runs = []

    def counted(x):
        runs.append(1)
        return x * 2

    for mode in ("trace", "auto"):
        fn = vjpkit.from_torch(counted, mode=mode)
        fn(X)
        first = len(runs)  # trace mode: one run; auto: its choice's too (how many depends on JAX's caches)
        fn(X)
        assert len(runs) == first
        vjpkit.clear_caches()
        fn(X)
        assert len(runs) > first


def test_clear_caches_empties_the_callback_routes_programs():
    on_meta = []

    def counted(x):
        on_meta.append(x.is_meta)  # from_torch runs the original on meta tensors to learn its outputs
        return x * 2

    fn = vjpkit.from_torch(counted)
    fn(X), fn(X)
    assert on_meta.count(True) == 1
    vjpkit.clear_caches()
    fn(X)
    assert on_meta.count(True) == 2


# ---------------------------------------------------------------------------
# Rules that gave values other than torch's, or crashed: each against torch itself.


def traced_equals_torch(fn, *arrays, **kwargs):
    """fn traced on the arrays equals fn run by torch on the same values (dtype included)."""
    want = fn(*[torch.from_numpy(np.array(a)) for a in arrays])
    got = vjpkit.from_torch(fn, mode="trace")(*arrays, **kwargs)
    want_leaves = [w for w in (want if isinstance(want, tuple) else (want,))]
    got_leaves = list(got) if isinstance(got, tuple) else [got]
    for g, w in zip(got_leaves, want_leaves, strict=True):
        w = w.numpy()
        assert np.asarray(g).dtype == jax.dtypes.canonicalize_dtype(w.dtype)
        np.testing.assert_allclose(np.asarray(g), w, rtol=1e-6)
    return got


NONFINITE = np.array([np.inf, -np.inf, np.nan, 1.5, -0.0], np.float32)


def test_the_op_tables_parts_name_no_torch_function_twice():
    """The table is its parts together: a name in two parts would leave one rule silently unused."""
    from vjpkit._torch.ops import RULES, arithmetic, shapes  # internal on purpose: the table's own parts

    assert set(arithmetic.RULES) & set(shapes.RULES) == set()
    assert len(RULES) == len(arithmetic.RULES) + len(shapes.RULES)


def test_predicates_see_nan_and_infinity():
    for predicate in (torch.isnan, torch.isinf, torch.isfinite, torch.signbit):
        traced_equals_torch(predicate, NONFINITE)


def test_sign_of_nan_is_zero_and_sign_of_bool_is_itself():
    traced_equals_torch(torch.sign, NONFINITE)
    traced_equals_torch(torch.sign, np.array([True, False]))


def test_clamp_with_a_nan_bound_is_nan():
    traced_equals_torch(lambda x: torch.clamp(x, min=float("nan")), X)
    traced_equals_torch(lambda x, hi: torch.clamp_max(x, hi), X, np.array([np.nan, 0.0, 1.0], np.float32))


def test_unbind_cuts_along_its_dim():
    traced_equals_torch(lambda x: torch.unbind(x, 1), np.arange(6, dtype=np.float32).reshape(2, 3))


def test_where_method_binds_self_as_the_values():
    traced_equals_torch(lambda x, c, y: x.where(c, y), X, np.array([True, False, True]), -X)


def test_norm_of_minus_infinity_is_the_smallest_magnitude():
    traced_equals_torch(lambda x: torch.norm(x, float("-inf")), X)
    traced_equals_torch(lambda x: torch.norm(x, 2, out=None), X)


def test_integer_pow_with_negative_exponents_is_torchs(x64):
    base = np.array([2, -1, 1, 3, -2], np.int64)
    traced_equals_torch(lambda b, e: torch.pow(b, e), base, np.array([-1, -3, -2, 2, -1], np.int64))
    traced_equals_torch(lambda e: 2 ** e, np.array([-1, 0, 3], np.int64))


def test_integer_division_rounding_toward_zero_is_exact():
    got = traced_equals_torch(lambda x: torch.div(x, 10, rounding_mode="trunc"), np.array([123456789, -17], np.int32))
    assert got.tolist() == [12345678, -1]


def test_new_tensor_holds_its_data():
    traced_equals_torch(lambda x: x.new_tensor([1, 2, 3]), X)


def test_softplus_gradient_past_the_threshold_is_one():
    fn = vjpkit.from_torch(lambda x: torch.nn.functional.softplus(x), mode="trace")
    np.testing.assert_allclose(jax.grad(lambda x: fn(x).sum())(np.array([100.0, 0.0], np.float32)), [1.0, 0.5])


def test_softmax_without_dim_takes_torchs_implicit_dim():
    x = np.arange(24, dtype=np.float32).reshape(2, 3, 4) / 10
    with pytest.warns(UserWarning, match="Implicit dimension choice"):
        traced_equals_torch(lambda x: torch.nn.functional.softmax(x), x)


def test_sort_puts_nan_first_descending_and_sorts_unsigned_integers():
    traced_equals_torch(lambda x: torch.sort(x, descending=True, stable=True), NONFINITE[[0, 2, 3, 1]])
    small = np.array([3, 0, 255, 7], np.uint8)
    traced_equals_torch(lambda x: torch.sort(x, descending=True), small)
    traced_equals_torch(lambda x: torch.topk(x, 2, largest=False), small)


def test_torch_return_types_come_back_as_named_tuples():
    got = vjpkit.from_torch(lambda x: torch.max(x, 1), mode="trace")(np.arange(6, dtype=np.float32).reshape(2, 3))
    assert type(got).__name__ == "max" and got.values.tolist() == [2.0, 5.0] and got.indices.tolist() == [2, 2]


def test_mm_and_is_floating_point_trace():
    fn = vjpkit.from_torch(lambda a: torch.mm(a, a.T) * torch.is_floating_point(a), mode="trace")
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    assert no_callback(fn, a)
    np.testing.assert_allclose(fn(a), a @ a.T)


def test_zero_dimensional_tensors_take_dim_0_and_minus_1():
    x0 = np.float32(1.5)
    traced_equals_torch(lambda x: torch.max(x, 0), x0)
    traced_equals_torch(lambda x: (torch.softmax(x, -1), torch.cumsum(x, 0), torch.logsumexp(x, 0)), x0)
    traced_equals_torch(lambda x, i: torch.gather(x, 0, i), x0, np.int64(0))


def test_keyword_forms_torch_passes_trace():
    traced_equals_torch(lambda x: (torch.nn.functional.relu(x, inplace=False), torch.flip(x, dims=[0])), X)
    traced_equals_torch(lambda x: x[[1, 0]], X)


def test_shape_changing_in_place_ops_change_the_shape():
    def squeezed(x):
        y = x.clone()
        y.unsqueeze_(0)
        y.t_()
        return y.squeeze_()

    traced_equals_torch(squeezed, X)


def test_indexing_does_not_block_a_later_write_and_a_stale_view_is_refused():
    def written(x):
        y = x.clone()
        first = y[0] * 2  # read before the write
        picked = y[[0, 2]]  # a copy
        y[1] = 5.0
        return y + first + picked.sum()

    traced_equals_torch(written, X)

    def stale(x):
        y = x.clone()
        view = y[0]
        y.zero_()
        return view * 2

    with pytest.raises(NotImplementedError, match=r"torch.Tensor.zero_, which writes into a tensor that a view "
                                                  r"was taken from \(by torch.Tensor.__getitem__\)"):
        vjpkit.from_torch(stale, mode="trace")(X)


def test_refusals_carry_the_source_line():
    def reads(x):
        return x * x.max().item()

    line = r"\(at .*test_from_torch_trace.py:\d+: return x \* x.max\(\).item\(\)\)"
    with pytest.raises(NotImplementedError, match=line):
        vjpkit.from_torch(reads, mode="trace")(X)


def test_auto_falls_back_on_any_failure_to_trace_and_says_so():
    def strict(x):
        assert type(x) is torch.Tensor  # true of torch's tensors, not of trace mode's stand-ins
        return x * 2

    auto = vjpkit.from_torch(strict, mode="auto")
    assert auto.mode is None
    np.testing.assert_allclose(auto(X), 2 * X)
    assert auto.mode == auto.mode_for(X) == "callback"
    traced = vjpkit.from_torch(lambda x: x * 2, mode="auto")
    traced(X)
    assert traced.mode == "trace"
    cls = vjpkit.from_torch(TorchExp, mode="auto")
    assert cls.mode_for(X) == "trace" and cls.mode is None
    cls.apply(X)
    assert cls.mode == "trace"


@pytest.mark.parametrize("mode", ["trace", "auto"])
def test_traced_class_passes_only_the_arguments_the_caller_passed(mode):
    Scan = vjpkit.from_torch(TScan, mode=mode)
    a, x = np.array([2.0, 4.0, 6.0], np.float32), np.array([1.0, 2.0, 3.0], np.float32)
    ta = torch.tensor(a, requires_grad=True)
    (expected,) = torch.autograd.grad(TScan.apply(ta, torch.tensor(x)).sum(), ta)
    np.testing.assert_allclose(jax.grad(lambda a: Scan.apply(a, x).sum())(a), expected.numpy())
    if mode == "auto":
        assert Scan.mode == "trace"


def test_traced_class_passed_an_optional_argument_owes_its_gradient_as_in_torch():
    Scan = vjpkit.from_torch(TScan, mode="trace")
    a = x = np.ones(3, np.float32)
    with pytest.raises(TypeError, match=r"TScan\.backward returned 2 gradients, expected 3"):
        jax.grad(lambda a: Scan.apply(a, x, x).sum())(a)


def _sparse_matmul(indices, values, x):
    return torch.sparse_coo_tensor(indices, values, (3, 3), check_invariants=True) @ x


def test_trace_mode_refuses_a_sparse_tensor_naming_the_op_and_auto_runs_it_by_callbacks():
    indices, values, x = np.array([[0, 1], [1, 2]]), np.array([1.0, 2.0], np.float32), np.ones(3, np.float32)
    with pytest.raises(NotImplementedError, match=r"calls torch\.sparse_coo_tensor, which makes a sparse tensor: "
                                                  r"trace mode does not model sparse layouts"):
        vjpkit.from_torch(_sparse_matmul, mode="trace")(indices, values, x)
    auto = vjpkit.from_torch(_sparse_matmul, mode="auto")
    expected = _sparse_matmul(torch.tensor(indices), torch.tensor(values), torch.tensor(x)).numpy()
    np.testing.assert_allclose(auto(indices, values, x), expected)
    assert auto.mode == "callback"
