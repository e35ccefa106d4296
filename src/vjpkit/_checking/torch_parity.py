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

import functools
import inspect
import sys
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from .. import _jax_internals
from .._function import reject_torch_function
from .comparison import Mismatches, sin_loss, within_tolerance

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
    case = _case(torch, torch_fn, jax_fn, inputs, differentiate)
    reference = _run_torch(case, case.inputs)
    probe = _probe(np.random.default_rng(seed), case, reference, grad_outputs)
    expected = _torch_results(case, reference, probe, check_second_order)
    got = _port_results(case, probe, check_second_order)
    report = Mismatches(atol, rtol)
    _compare_first_order(report, case, expected, got)
    if check_second_order and case.diff:
        _compare_second_order(report, case, probe, expected.second_order, got.second_order)
    report.raise_if_any(f"assert_matches_torch: the port {case.jax_name} does not match {case.torch_name} (PyTorch)")


@dataclass(frozen=True)
class _Case:
    """The two sides and what they run on: the inputs (float64), and which are differentiated."""

    torch: Any
    call_torch: Callable
    call_jax: Callable
    torch_name: str
    jax_name: str
    inputs: tuple
    names: list[str]
    diff: list[int]


@dataclass(frozen=True)
class _Probe:
    """What both sides are probed with: a cotangent per output, a direction per differentiated input."""

    differentiable: list[bool]  # per output: whether torch differentiates it
    cotangents: list[np.ndarray]
    directions: list[np.ndarray]

    def select(self, per_output: Sequence[Any]) -> list:
        """The entries of ``per_output`` that belong to differentiable outputs."""
        return [v for v, d in zip(per_output, self.differentiable, strict=True) if d]


@dataclass(frozen=True)
class _TorchRun:
    """One call of the original: its inputs as torch leaves, and its outputs."""

    leaves: list
    outputs: list


@dataclass(frozen=True)
class _Results:
    """One side's numbers, in PyTorch's convention; a second derivative is ``None`` where torch has none."""

    outputs: list[np.ndarray]
    gradients: list[np.ndarray]
    second_order: list


def _case(torch: Any, torch_fn: Any, jax_fn: Any, inputs: Any, differentiate: Sequence[bool] | None) -> _Case:
    """Checks the arguments and widens the array inputs to float64 (complex128)."""
    inputs = tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)
    names = _input_names(torch_fn, len(inputs))
    diff = _differentiated(inputs, differentiate, names)
    reject_torch_function(jax_fn, "vjpkit.testing.assert_matches_torch (its port, jax_fn)")
    return _Case(
        torch=torch, call_torch=getattr(torch_fn, "apply", torch_fn), call_jax=getattr(jax_fn, "apply", jax_fn),
        torch_name=_name(torch_fn), jax_name=_name(jax_fn),
        inputs=tuple(_as_wide(v) if _is_array(v) else v for v in inputs), names=names, diff=diff,
    )


def _run_torch(case: _Case, values: Sequence[Any]) -> _TorchRun:
    """The original called on fresh leaves made of ``values`` (``requires_grad`` where differentiated)."""
    torch = case.torch
    leaves = [_to_torch(torch, v, k in case.diff) for k, v in enumerate(values)]
    # Clones: an in-place original may not modify a leaf that requires grad.
    out = case.call_torch(*[t.clone() if isinstance(t, torch.Tensor) else t for t in leaves])
    return _TorchRun(leaves, list(out) if isinstance(out, (tuple, list)) else [out])


def _probe(rng: np.random.Generator, case: _Case, reference: _TorchRun, grad_outputs: Sequence[Any] | None) -> _Probe:
    """The cotangents (given, or seeded: zeros for outputs torch does not differentiate) and directions."""
    torch = case.torch
    differentiable = [
        isinstance(y, torch.Tensor) and y.requires_grad and (y.is_floating_point() or y.is_complex())
        for y in reference.outputs
    ]
    if grad_outputs is None:
        cotangents = [
            _random_like(rng, y) if d else np.zeros(tuple(getattr(y, "shape", ())))
            for y, d in zip(reference.outputs, differentiable, strict=True)
        ]
    else:
        cotangents = [_as_wide(np.asarray(c)) for c in grad_outputs]
    directions = [_random_like(rng, case.inputs[k]) for k in case.diff]
    return _Probe(differentiable, cotangents, directions)


def _torch_results(case: _Case, reference: _TorchRun, probe: _Probe, second_order: bool) -> _Results:
    """The original's outputs, gradients (zeros where torch gives none) and, if asked, second derivatives."""
    torch = case.torch
    wrt = [reference.leaves[k] for k in case.diff]
    outputs = probe.select(reference.outputs)
    grads: list = [None] * len(wrt)
    if outputs and wrt:
        grads = _torch_grad(torch, outputs, wrt, [torch.tensor(c) for c in probe.select(probe.cotangents)])
    return _Results(
        outputs=[_numpy(torch, y) for y in reference.outputs],
        gradients=[np.zeros(case.inputs[k].shape, case.inputs[k].dtype) if g is None else _numpy(torch, g)
                   for k, g in zip(case.diff, grads, strict=True)],
        second_order=_torch_second_order(case, reference, probe) if second_order and wrt else [],
    )


def _torch_second_order(case: _Case, reference: _TorchRun, probe: _Probe) -> list[np.ndarray | None]:
    """The derivatives of ``<grad sin_loss, directions>`` (torch: ``create_graph``) by the inputs and cotangents."""
    torch = case.torch
    cotangents = [torch.tensor(c, requires_grad=True) for c in probe.select(probe.cotangents)]
    wrt = [reference.leaves[k] for k in case.diff]
    loss = sin_loss(torch, probe.select(reference.outputs), cotangents)
    first = _torch_grad(torch, [loss], wrt, create_graph=True) if loss.requires_grad else [None] * len(wrt)
    along = _along(torch, first, [torch.tensor(v) for v in probe.directions])
    if not along.requires_grad:
        return [None] * (len(wrt) + len(cotangents))
    return [None if g is None else _numpy(torch, g) for g in _torch_grad(torch, [along], wrt + cotangents)]


def _torch_loss_gradient(case: _Case, probe: _Probe, values: Sequence[Any]) -> list[np.ndarray]:
    """The gradient of ``sin_loss`` by the differentiated inputs, the original called on ``values``."""
    torch = case.torch
    run = _run_torch(case, values)
    wrt = [run.leaves[k] for k in case.diff]
    loss = sin_loss(torch, probe.select(run.outputs), [torch.tensor(c) for c in probe.select(probe.cotangents)])
    return [np.zeros(w.shape, _numpy(torch, w).dtype) if g is None else _numpy(torch, g)
            for g, w in zip(_torch_grad(torch, [loss], wrt), wrt, strict=True)]


def _along(xp: Any, gradients: Sequence[Any], directions: Sequence[Any]) -> Any:
    """``sum(real(g * conj(v)))``: the gradients along the directions (``None``: an unused input)."""
    return sum(
        (xp.sum(xp.real(g * xp.conj(v))) for g, v in zip(gradients, directions, strict=True) if g is not None),
        xp.zeros(()),
    )


def _port_results(case: _Case, probe: _Probe, second_order: bool) -> _Results:
    """The port's outputs, gradients and, if asked, second derivatives, in float64 and PyTorch's convention."""
    __tracebackhide__ = True
    with _jax_internals.enable_x64(True):
        args = [jnp.asarray(_as_float64(v)) if _is_array(v) else v for v in case.inputs]
        port = functools.partial(_call_port, case, args)
        xs = tuple(args[k] for k in case.diff)
        outputs = port(*xs)
        if len(outputs) != len(probe.differentiable):
            raise AssertionError(
                f"assert_matches_torch: {case.torch_name} returned {len(probe.differentiable)} output(s), "
                f"the port {case.jax_name} returned {len(outputs)}."
            )
        return _Results(
            outputs=[np.asarray(y) for y in outputs],
            gradients=_port_gradients(port, xs, probe.cotangents) if case.diff else [],
            second_order=_port_second_order(port, xs, probe) if second_order and case.diff else [],
        )


def _call_port(case: _Case, args: Sequence[Any], *xs: Any) -> list:
    """The port's outputs, as a list, with the differentiated inputs replaced by ``xs``."""
    args = list(args)
    for k, x in zip(case.diff, xs, strict=True):
        args[k] = x
    out = case.call_jax(*args)
    return list(out) if isinstance(out, (tuple, list)) else [out]


def _port_gradients(port: Callable, xs: tuple, cotangents: Sequence[np.ndarray]) -> list[np.ndarray]:
    """The port's vector-Jacobian products in PyTorch's convention: ``conj(vjp(conj(c)))``."""
    outs, pullback = jax.vjp(port, *xs)
    grads = pullback([
        jnp.asarray(c, y.dtype).conj() if jnp.issubdtype(y.dtype, jnp.inexact) else _float0(y)
        for c, y in zip(cotangents, outs, strict=True)
    ])
    return [np.asarray(g.conj()) for g in grads]


def _port_second_order(port: Callable, xs: tuple, probe: _Probe) -> list[np.ndarray]:
    """The derivatives of ``<grad sin_loss, directions>`` by the inputs and cotangents, as torch's."""
    def loss(xs: tuple, cotangents: list) -> Any:
        return sin_loss(jnp, probe.select(port(*xs)), cotangents)

    def along(xs: tuple, cotangents: list) -> Any:
        return _along(jnp, [g.conj() for g in jax.grad(loss)(xs, cotangents)], probe.directions)

    cotangents = [jnp.asarray(c) for c in probe.select(probe.cotangents)]
    by_inputs, by_cotangents = jax.grad(along, argnums=(0, 1))(xs, cotangents)
    return [np.asarray(g).conj() for g in (*by_inputs, *by_cotangents)]


def _compare_first_order(report: Mismatches, case: _Case, expected: _Results, got: _Results) -> None:
    """Outputs and gradients, pair by pair."""
    for j, (e, g) in enumerate(zip(expected.outputs, got.outputs, strict=True)):
        report.compare(f"output {j}", e, g)
    for k, e, g in zip(case.diff, expected.gradients, got.gradients, strict=True):
        report.compare(f"the gradient with respect to input {k} ({case.names[k]})", e, g)


def _compare_second_order(report: Mismatches, case: _Case, probe: _Probe, expected: list, got: list) -> None:
    """Second derivatives by the inputs and by the cotangents; on a mismatch, finite differences' verdict."""
    what = [f"the second derivative with respect to input {k} ({case.names[k]})" for k in case.diff]
    what += [f"the second derivative with respect to the cotangent of output {j}"
             for j, d in enumerate(probe.differentiable) if d]
    reference = [np.zeros(g.shape, g.dtype) if e is None else e for e, g in zip(expected, got, strict=True)]
    mismatched = [report.compare(w, e, g) for w, e, g in zip(what, reference, got, strict=True)]
    if any(mismatched):
        # Only the inputs' part: the cotangents' part is no directional derivative of one gradient.
        fd = _central_difference(functools.partial(_torch_loss_gradient, case, probe), case.inputs, case.diff,
                                 probe.directions)
        n = len(case.diff)
        report.note(_second_order_verdict(fd, reference[:n], got[:n]))


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
    """Whether ``values`` agree with finite differences within their (loose) tolerance."""
    return all(
        bool(np.all(within_tolerance(v, r, _FD_ATOL, _FD_RTOL))) for r, v in zip(reference, values, strict=True)
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
