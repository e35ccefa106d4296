"""``assert_matches_torch``: a port checked against the PyTorch original.

For example:

```python
from vjpkit.testing import assert_matches_torch

def test_linear_port_matches_pytorch():
    x, w, b = np.random.randn(4, 3), np.random.randn(2, 3), np.random.randn(2)
    assert_matches_torch(TorchLinear, Linear, (x, w, b), check_second_order=True)
```

Runs the original ``torch.autograd.Function`` (its ``.apply``) and the
vjpkit port on the same float64 (or complex128) inputs, and compares the
outputs, the gradient for every differentiated input (one seeded random
cotangent per output, the same for both), and on request the second order:
Hessian-vector products of the scalar ``sum(c * sin(outputs))``, so the
outputs' own derivatives enter the second derivative, with respect to the
inputs and to ``c``. When only the second order differs, finite differences
of the first derivative say which side is right. A failure is an
``AssertionError`` listing every mismatch with its worst element, the way
``vjpkit.gradcheck`` reports.

The key difference to ``vjpkit.gradcheck`` is the reference: PyTorch's own
numbers for the class being ported, not finite differences, so it also
catches a port whose forward or backward computes *different* (but
self-consistent) math, e.g. a dropped bias term in both.

Complex numbers: for a real loss, PyTorch's gradient with respect to
``z = a + ib`` is ``dL/da + i dL/db``; JAX's is its conjugate, ``dL/da - i
dL/db`` (JAX's vector-Jacobian product does not conjugate). In general
PyTorch's ``grad(y, z, c)`` equals ``conj(vjp(conj(c)))`` in JAX; the
comparison applies that rule, so a faithful port matches and reports show
gradients in PyTorch's convention.

An original that refuses ``torch.autograd.grad`` (``torch.utils.checkpoint``
with ``use_reentrant=True``) is differentiated through ``.backward()``.

torch is never a dependency of vjpkit, nor is pytest: torch is imported when
the helper runs; without it, a test run by pytest is skipped, and elsewhere
the helper raises ``ModuleNotFoundError``.
"""

from __future__ import annotations

import inspect
import sys
import warnings
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from .. import _jax_internals
from .._function import reject_torch_function
from .report import format_element

# Central differences of the first derivative, when the second orders disagree.
_FD_EPS = 1e-6
_FD_ATOL, _FD_RTOL = 1e-5, 1e-3


def assert_matches_torch(
    torch_fn: Any,
    jax_fn: Any,
    inputs: Any,
    *,
    differentiate: Sequence[bool] | None = None,
    grad_outputs: Sequence[Any] | None = None,
    atol: float = 1e-8,
    rtol: float = 1e-6,
    check_second_order: bool = False,
    seed: int = 0,
) -> None:
    """Asserts that a vjpkit port computes what the PyTorch Function computes.

    Args:
        torch_fn: a ``torch.autograd.Function`` subclass (its ``apply`` is
            called), or any function of torch tensors. Its tensor inputs are
            fresh copies of leaf tensors, so an original that modifies an
            input in place (``ctx.mark_dirty``) needs no wrapper.
        jax_fn: the port: a vjpkit Function (its ``apply`` is called), or any
            JAX function.
        inputs: a tuple of positional arguments (or one argument). NumPy
            arrays become float64 (complex128) tensors, with
            ``requires_grad`` where differentiated, or int64 tensors
            (integer), and float64 (complex128) JAX arrays for the port;
            other values (Python scalars, ``None``, strings) go to both as
            they are.
        differentiate: one bool per input: whether to differentiate with
            respect to it (torch: ``requires_grad``; vjpkit: an argument of
            ``jax.vjp``), so both see ``needs_input_grad`` False for the
            others. Default: every floating or complex array.
        grad_outputs: one cotangent per output; default: seeded standard
            normal arrays (complex for complex outputs; zeros for outputs
            torch does not differentiate).
        atol: absolute tolerance: elementwise ``|vjpkit - torch| <= atol + rtol * |torch|``.
        rtol: relative tolerance, in the same comparison.
        check_second_order: also compare Hessian-vector products of
            ``L = sum(real(conj(c) * sin(y)))`` over the differentiable
            outputs ``y`` (``c``: the cotangents), with respect to the
            inputs and ``c``. Needs a differentiable backward in both (torch
            differentiates it with ``create_graph``). On a mismatch, central
            differences of the first derivative of ``L`` tell which side is
            right, and the report says so.
        seed: seed of the default cotangents and second-order directions.

    Raises:
        AssertionError: listing every mismatching output or gradient.
        ValueError: ``differentiate`` has the wrong length, or marks an
            input that is not a floating or complex array.
        ModuleNotFoundError: when torch is not importable (under pytest, the
            calling test is skipped instead).

    Examples:
        >>> import numpy as np
        >>> import torch
        >>> import vjpkit
        >>> from vjpkit.testing import assert_matches_torch
        >>> class TorchCube(torch.autograd.Function):  # the original
        ...     @staticmethod
        ...     def forward(ctx, x):
        ...         ctx.save_for_backward(x)
        ...         return x**3
        ...
        ...     @staticmethod
        ...     def backward(ctx, g):
        ...         (x,) = ctx.saved_tensors
        ...         return 3 * x**2 * g
        >>> class Cube(vjpkit.Function):  # its port
        ...     @staticmethod
        ...     def forward(ctx, x):
        ...         ctx.save_for_backward(x)
        ...         return x**3
        ...
        ...     @staticmethod
        ...     def backward(ctx, g):
        ...         (x,) = ctx.saved_tensors
        ...         return 3 * x**2 * g
        >>> x = np.linspace(-1.0, 1.0, 5)
        >>> assert_matches_torch(TorchCube, Cube, (x,), check_second_order=True)
    """
    __tracebackhide__ = True  # pytest: show the caller's line
    torch = _import_torch()
    inputs = tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)
    names = _input_names(torch_fn, len(inputs))
    diff = _differentiated(inputs, differentiate, names)
    reject_torch_function(jax_fn, "vjpkit.testing.assert_matches_torch (its port, jax_fn)")
    call_torch = getattr(torch_fn, "apply", torch_fn)
    call_jax = getattr(jax_fn, "apply", jax_fn)
    rng = np.random.default_rng(seed)
    report = _Report(_name(torch_fn), _name(jax_fn), atol, rtol)
    inputs = tuple(_as_wide(v) if _is_array(v) else v for v in inputs)

    # --- torch -----------------------------------------------------------
    def run_torch(values: Sequence[Any]) -> tuple[list, list]:
        leaves = [_to_torch(torch, v, k in diff) for k, v in enumerate(values)]
        # Clones: an in-place original may not modify a leaf that requires grad.
        out = call_torch(*[t.clone() if isinstance(t, torch.Tensor) else t for t in leaves])
        return leaves, list(out) if isinstance(out, (tuple, list)) else [out]

    t_inputs, t_outs = run_torch(inputs)
    t_differentiable = [
        isinstance(y, torch.Tensor) and y.requires_grad and (y.is_floating_point() or y.is_complex())
        for y in t_outs
    ]
    if grad_outputs is None:
        cts = [
            _random_like(rng, y) if d else np.zeros(tuple(getattr(y, "shape", ())))
            for y, d in zip(t_outs, t_differentiable, strict=True)
        ]
    else:
        cts = [_as_wide(np.asarray(c)) for c in grad_outputs]
    pairs = [(y, torch.tensor(c)) for y, c, d in zip(t_outs, cts, t_differentiable, strict=True) if d]
    t_grads: list = [None] * len(diff)
    if pairs and diff:
        t_grads = _torch_grad(torch, [y for y, _ in pairs], [t_inputs[k] for k in diff], [c for _, c in pairs])
    vs = [_random_like(rng, inputs[k]) for k in diff]

    def sin_loss(outs: Sequence[Any], cotangents: Sequence[Any]) -> Any:
        return sum(
            (c.conj() * y.sin()).real.sum()
            for y, c, d in zip(outs, cotangents, t_differentiable, strict=True) if d
        )

    def torch_first(values: Sequence[Any]) -> list[np.ndarray]:
        """The gradient of ``sin_loss`` with respect to the differentiated inputs."""
        leaves, outs = run_torch(values)
        wrt = [leaves[k] for k in diff]
        grads = _torch_grad(torch, [sin_loss(outs, [torch.tensor(c) for c in cts])], wrt)
        return [np.zeros(w.shape, _numpy(torch, w).dtype) if g is None else _numpy(torch, g)
                for g, w in zip(grads, wrt, strict=True)]

    t_second: list = []
    if check_second_order and diff:
        t_cts = [torch.tensor(c, requires_grad=True) for c in cts]
        first = _torch_grad(torch, [sin_loss(t_outs, t_cts)], [t_inputs[k] for k in diff], create_graph=True)
        s = sum((g * torch.tensor(v).conj()).real.sum() for g, v in zip(first, vs, strict=True) if g is not None)
        wrt = [t_inputs[k] for k in diff] + [c for c, d in zip(t_cts, t_differentiable, strict=True) if d]
        if isinstance(s, torch.Tensor) and s.requires_grad:
            t_second = [None if g is None else _numpy(torch, g) for g in _torch_grad(torch, [s], wrt)]
        else:
            t_second = [None] * len(wrt)

    # --- the port, in float64 ----------------------------------------------
    with _jax_internals.enable_x64(True):
        j_inputs = [jnp.asarray(_as_float64(v)) if _is_array(v) else v for v in inputs]

        def port(*xs: Any) -> list:
            args = list(j_inputs)
            for k, x in zip(diff, xs, strict=True):
                args[k] = x
            out = call_jax(*args)
            return list(out) if isinstance(out, (tuple, list)) else [out]

        def port_grads(xs: tuple, cotangents: list) -> list:
            """PyTorch's convention: conj(vjp(conj(c)))."""
            outs, pullback = jax.vjp(port, *xs)
            grads = pullback([
                jnp.asarray(c, y.dtype).conj() if jnp.issubdtype(y.dtype, jnp.inexact) else _float0(y)
                for c, y in zip(cotangents, outs, strict=True)
            ])
            return [g.conj() for g in grads]

        xs = tuple(j_inputs[k] for k in diff)
        j_outs = port(*xs)
        if len(j_outs) != len(t_outs):
            raise AssertionError(
                f"assert_matches_torch: {report.torch_name} returned {len(t_outs)} output(s), "
                f"the port {report.jax_name} returned {len(j_outs)}."
            )
        for j, (t, y) in enumerate(zip(t_outs, j_outs, strict=True)):
            report.compare(f"output {j}", _numpy(torch, t), np.asarray(y))
        j_grads = port_grads(xs, [jnp.asarray(c) for c in cts]) if diff else []
        for k, tg, jg in zip(diff, t_grads, j_grads, strict=True):
            expected = np.zeros(inputs[k].shape, inputs[k].dtype) if tg is None else _numpy(torch, tg)
            report.compare(f"the gradient with respect to input {k} ({names[k]})", expected, np.asarray(jg))
        if check_second_order and diff:
            def jax_sin_loss(xs: tuple, cotangents: list) -> Any:
                return sum(
                    jnp.sum(jnp.real(jnp.conj(c) * jnp.sin(y)))
                    for y, c, d in zip(port(*xs), cotangents, t_differentiable, strict=True) if d
                )

            def inner(xs: tuple, cotangents: list) -> Any:
                first = [g.conj() for g in jax.grad(jax_sin_loss)(xs, cotangents)]
                return sum(jnp.sum(jnp.real(g * jnp.conj(v))) for g, v in zip(first, vs, strict=True))

            j_cts = [jnp.asarray(c) for c in cts]
            j_dx, j_dct = jax.grad(inner, argnums=(0, 1))(xs, j_cts)
            j_second = [np.asarray(g).conj() for g in j_dx]
            j_second += [np.asarray(g).conj() for g, d in zip(j_dct, t_differentiable, strict=True) if d]
            what = [f"the second derivative with respect to input {k} ({names[k]})" for k in diff]
            what += [f"the second derivative with respect to the cotangent of output {j}"
                     for j, d in enumerate(t_differentiable) if d]
            t_second_full = [np.zeros(g.shape, g.dtype) if tg is None else tg
                             for tg, g in zip(t_second, j_second, strict=True)]
            before = len(report.problems)
            for w, e, g in zip(what, t_second_full, j_second, strict=True):
                report.compare(w, e, g)
            if len(report.problems) > before:
                # Only the inputs' part: the cotangents' part is no directional derivative of one gradient.
                fd = _central_difference(torch_first, inputs, diff, vs)
                n = len(diff)
                report.problems.append(_second_order_verdict(fd, t_second_full[:n], j_second[:n]))
    report.raise_if_any()


# ---------------------------------------------------------------------------
# Second-order disagreements: which side agrees with finite differences.


def _central_difference(first: Any, inputs: tuple, diff: list[int], vs: list) -> list[np.ndarray]:
    """(first(x + eps v) - first(x - eps v)) / 2 eps: the Hessian of the loss times v."""
    def shifted(sign: float) -> list[np.ndarray]:
        values = list(inputs)
        for k, v in zip(diff, vs, strict=True):
            values[k] = inputs[k] + sign * _FD_EPS * v
        return first(values)

    return [(p - m) / (2 * _FD_EPS) for p, m in zip(shifted(1.0), shifted(-1.0), strict=True)]


def _agrees(reference: list[np.ndarray], values: list[np.ndarray]) -> bool:
    return all(
        bool(np.all(np.abs(v - r) <= _FD_ATOL + _FD_RTOL * np.abs(r)))
        for r, v in zip(reference, values, strict=True)
    )


def _second_order_verdict(fd: list[np.ndarray], torch_second: list, jax_second: list) -> str:
    torch_ok, jax_ok = _agrees(fd, torch_second), _agrees(fd, jax_second)
    said = (f"for the second derivatives with respect to the inputs, finite differences of the first "
            f"derivative (central, eps={_FD_EPS:g}, atol={_FD_ATOL:g}, rtol={_FD_RTOL:g})")
    if jax_ok and not torch_ok:
        return (
            f"verdict: {said} agree with vjpkit, not with PyTorch: PyTorch's double backward is the "
            "wrong one. Likely cause: the original's backward uses an intermediate saved in forward "
            "(neither an input nor an output), which PyTorch treats as a constant when it differentiates "
            "backward (pytorch#58509), while vjpkit differentiates it through forward's code; check the "
            "port's second order with vjpkit.gradgradcheck instead."
        )
    if torch_ok and not jax_ok:
        return (
            f"verdict: {said} agree with PyTorch, not with vjpkit: the port's second derivative is the "
            "wrong one. Likely cause: backward uses an intermediate saved in forward (neither an input nor "
            "an output) that forward computes with code whose derivative is not that value's true "
            "derivative (an iterative solve such as bisection, thresholding, stop_gradient, a while_loop): "
            "vjpkit differentiates saved intermediates through forward's code (saved outputs through the "
            "Function's own rules), so save the output and recompute from it in backward, as the original "
            "does; or the port's backward hides a dependence on its inputs (stop_gradient in backward)."
        )
    if torch_ok and jax_ok:
        return f"verdict: {said} agree with both within their tolerance: the difference is small."
    return (
        f"verdict: {said} agree with neither side. When backward is deliberately not forward's derivative "
        "(a straight-through estimator, gradient scaling), the first derivative is no gradient of anything "
        "and finite differences cannot judge; otherwise both second derivatives are suspect."
    )


# ---------------------------------------------------------------------------


class _Report:
    """Collects mismatches; one ``AssertionError`` lists them all."""

    def __init__(self, torch_name: str, jax_name: str, atol: float, rtol: float):
        self.torch_name, self.jax_name = torch_name, jax_name
        self.atol, self.rtol = atol, rtol
        self.problems: list[str] = []

    def compare(self, what: str, expected: np.ndarray, got: np.ndarray) -> None:
        if expected.shape != got.shape:
            self.problems.append(
                f"{what}: shape {got.shape} from vjpkit, {expected.shape} from torch."
            )
            return
        if expected.dtype.kind not in "fc" or got.dtype.kind not in "fc":
            if not np.array_equal(expected, got):
                bad = np.argwhere(expected != got)
                self.problems.append(
                    f"{what}: {len(bad)} of {expected.size} elements differ "
                    f"(first at {tuple(int(i) for i in bad[0])}: torch {expected[tuple(bad[0])]!r}, "
                    f"vjpkit {got[tuple(bad[0])]!r})."
                )
            return
        if (expected.dtype.kind == "c") != (got.dtype.kind == "c"):
            self.problems.append(
                f"{what}: {'complex' if got.dtype.kind == 'c' else 'real'} from vjpkit, "
                f"{'complex' if expected.dtype.kind == 'c' else 'real'} from torch."
            )
            return
        wide = np.complex128 if expected.dtype.kind == "c" else np.float64
        got = got.astype(wide)
        diff = np.abs(got - expected)
        ok = diff <= self.atol + self.rtol * np.abs(expected)
        ok |= np.isnan(got) & np.isnan(expected)
        if ok.all():
            return
        score = np.where(np.isnan(diff), np.inf, diff)
        worst = np.unravel_index(int(np.argmax(score)), expected.shape) if expected.shape else ()
        e, g = expected[worst].item(), got[worst].item()
        rel = abs(g - e) / abs(e) if e != 0 else float("inf")
        self.problems.append(
            f"{what}: {int((~ok).sum())} of {expected.size} elements differ by more than "
            f"atol + rtol * |torch| (atol={self.atol:g}, rtol={self.rtol:g}).\n"
            f"  worst: element {format_element(worst)}\n"
            f"    torch:  {e!r}\n"
            f"    vjpkit: {g!r}\n"
            f"    abs diff: {abs(g - e):.6g}    rel diff: {rel:.6g}"
        )

    def raise_if_any(self) -> None:
        __tracebackhide__ = True
        if self.problems:
            raise AssertionError(
                f"assert_matches_torch: the port {self.jax_name} does not match "
                f"{self.torch_name} (PyTorch) in {len(self.problems)} place(s):\n"
                + "\n".join(f"- {p}" for p in self.problems)
            )


def _import_torch() -> Any:
    """torch; without it, the calling test is skipped under pytest, and an ImportError elsewhere."""
    try:
        import torch
    except ImportError as e:
        message = "assert_matches_torch needs torch, which is not installed"
        pytest = sys.modules.get("pytest")  # only a test that pytest runs can be skipped
        if pytest is not None:
            pytest.skip(message)
        raise ModuleNotFoundError(f"{message}: install it (pip install torch) to compare a port with it") from e
    return torch


def _torch_grad(torch: Any, outputs: list, inputs: list, grad_outputs: list | None = None,
                create_graph: bool = False) -> list:
    """``torch.autograd.grad(outputs, inputs, grad_outputs)`` (``None`` for an unused input).

    A reentrant original (``torch.utils.checkpoint`` with ``use_reentrant=True``)
    refuses ``torch.autograd.grad``; it is driven through ``.backward()``,
    reading each input's ``.grad``, as its users do. The graph is kept, so
    that the retry (and the second order) can run through it again.
    """
    try:
        return list(torch.autograd.grad(outputs, inputs, grad_outputs, allow_unused=True,
                                        retain_graph=True, create_graph=create_graph))
    except RuntimeError as e:
        if "use_reentrant" not in str(e):
            raise
    before = [x.grad for x in inputs]
    for x in inputs:
        x.grad = None
    with warnings.catch_warnings():
        # create_graph with .backward() warns of a reference cycle through .grad, undone below.
        warnings.filterwarnings("ignore", message="Using backward\\(\\) with create_graph=True")
        torch.autograd.backward(outputs, grad_outputs, retain_graph=True, create_graph=create_graph)
    grads = [x.grad for x in inputs]
    for x, grad in zip(inputs, before, strict=True):
        x.grad = grad
    return grads


def _input_names(torch_fn: Any, n: int) -> list[str]:
    """forward's parameter names (after ctx) of a torch Function, else arg0, arg1, ..."""
    try:
        forward = getattr(torch_fn, "forward", torch_fn)
        params = list(inspect.signature(forward).parameters)
        if hasattr(torch_fn, "apply") and params and params[0] == "ctx":
            params = params[1:]
    except (TypeError, ValueError):
        params = []
    params = [p for p in params if p not in ("args", "kwargs")]
    return [repr(params[k]) if k < len(params) else f"arg{k}" for k in range(n)]


def _differentiated(inputs: tuple, differentiate: Sequence[bool] | None, names: list[str]) -> list[int]:
    """Positions of the inputs to differentiate with respect to."""
    if differentiate is None:
        return [k for k, v in enumerate(inputs) if _is_inexact_array(v)]
    flags = list(differentiate)
    if len(flags) != len(inputs):
        raise ValueError(
            f"assert_matches_torch: differentiate has {len(flags)} flag(s) for {len(inputs)} input(s); "
            "give one bool per input."
        )
    for k, (flag, v) in enumerate(zip(flags, inputs, strict=True)):
        if flag and not _is_inexact_array(v):
            raise ValueError(
                f"assert_matches_torch: differentiate[{k}] is True, but input {k} ({names[k]}) is "
                f"{_describe(v)}, not a floating or complex array."
            )
    return [k for k, flag in enumerate(flags) if flag]


def _describe(v: Any) -> str:
    if _is_array(v):
        return f"an array of dtype {np.asarray(v).dtype}"
    return f"a {type(v).__name__}"


def _name(fn: Any) -> str:
    return getattr(fn, "__name__", None) or repr(fn)


def _is_array(v: Any) -> bool:
    return isinstance(v, (np.ndarray, np.generic, jax.Array))


def _is_inexact_array(v: Any) -> bool:
    return _is_array(v) and np.asarray(v).dtype.kind in "fc"


def _as_wide(v: Any) -> np.ndarray:
    """float64 or complex128 for floating and complex arrays; others as they are."""
    a = np.asarray(v)
    if a.dtype.kind == "f":
        return a.astype(np.float64)
    if a.dtype.kind == "c":
        return a.astype(np.complex128)
    return a


def _random_like(rng: np.random.Generator, y: Any) -> np.ndarray:
    shape = tuple(y.shape)
    complex_ = y.is_complex() if hasattr(y, "is_complex") else np.asarray(y).dtype.kind == "c"
    if complex_:
        return rng.standard_normal(shape) + 1j * rng.standard_normal(shape)
    return rng.standard_normal(shape)


def _to_torch(torch: Any, v: Any, requires_grad: bool) -> Any:
    if not _is_array(v):
        return v
    return torch.tensor(_as_wide(v), requires_grad=requires_grad)


def _numpy(torch: Any, t: Any) -> np.ndarray:
    if isinstance(t, torch.Tensor):
        return t.detach().resolve_conj().cpu().numpy()
    return np.asarray(t)


def _float0(y: Any) -> np.ndarray:
    return np.zeros(y.shape, jax.dtypes.float0)


def _as_float64(v: Any) -> np.ndarray:
    """Floating inputs as float64 (JAX before 0.5 keeps a NumPy array's float32 under enable_x64)."""
    a = np.asarray(v)
    return a.astype(np.float64) if np.issubdtype(a.dtype, np.floating) else a
