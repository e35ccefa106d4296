"""``assert_matches_torch``: a port checked against the PyTorch original.

Usage::

    from vjpkit.testing import assert_matches_torch

    def test_linear_port_matches_pytorch():
        x, w, b = np.random.randn(4, 3), np.random.randn(2, 3), np.random.randn(2)
        assert_matches_torch(TorchLinear, Linear, (x, w, b), check_second_order=True)

Runs the original ``torch.autograd.Function`` (its ``.apply``) and the
vjpkit port on the same float64 inputs, and compares the outputs, the
gradient for every floating input (one seeded random cotangent per output,
the same for both), and on request the second order (the gradient of
``<gradients, v>`` with respect to the inputs and the cotangents, i.e. what
``gradgradcheck`` differentiates). A failure is an ``AssertionError`` listing
every mismatch with its worst element, the way ``vjpkit.gradcheck`` reports.

The key difference to ``vjpkit.gradcheck`` is the reference: PyTorch's own
numbers for the class being ported, not finite differences, so it also
catches a port whose forward or backward computes *different* (but
self-consistent) math, e.g. a dropped bias term in both.

torch is never a dependency of vjpkit: it is imported when the helper
runs, and without it the calling test is skipped (``pytest.skip``).
"""

from __future__ import annotations

import inspect
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from . import _jax_internals

__all__ = ["assert_matches_torch"]


def assert_matches_torch(
    torch_fn: Any,
    jax_fn: Any,
    inputs: Any,
    *,
    grad_outputs: Sequence[Any] | None = None,
    atol: float = 1e-8,
    rtol: float = 1e-6,
    check_second_order: bool = False,
    seed: int = 0,
) -> None:
    """Asserts that a vjpkit port computes what the PyTorch Function computes.

    Args:
        torch_fn: a ``torch.autograd.Function`` subclass (its ``apply`` is
            called), or any function of torch tensors.
        jax_fn: the port: a vjpkit Function (its ``apply`` is called), or any
            JAX function.
        inputs: a tuple of positional arguments (or one argument). NumPy
            arrays become float64 tensors with ``requires_grad`` (floating)
            or int64 tensors (integer) for torch, and float64 JAX arrays for
            the port; other values (Python scalars, ``None``) go to both as
            they are.
        grad_outputs: one cotangent per output; default: seeded standard
            normal arrays (zeros for outputs torch does not differentiate).
        atol, rtol: elementwise ``|vjpkit - torch| <= atol + rtol * |torch|``.
        check_second_order: also compare the derivatives of the gradients
            (needs ``create_graph`` in torch and a differentiable backward in
            both).
        seed: seed of the default cotangents and second-order directions.

    Raises:
        AssertionError: listing every mismatching output or gradient.
        pytest.skip.Exception: when torch is not importable.
    """
    __tracebackhide__ = True  # pytest: show the caller's line
    torch = _import_torch()
    inputs = tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)
    names = _input_names(torch_fn, len(inputs))
    call_torch = getattr(torch_fn, "apply", torch_fn)
    call_jax = getattr(jax_fn, "apply", jax_fn)
    rng = np.random.default_rng(seed)
    diff = [k for k, v in enumerate(inputs) if _is_float_array(v)]
    report = _Report(_name(torch_fn), _name(jax_fn), atol, rtol)

    # --- torch -----------------------------------------------------------
    t_inputs = [_to_torch(torch, v) for v in inputs]
    t_out = call_torch(*t_inputs)
    t_outs = list(t_out) if isinstance(t_out, (tuple, list)) else [t_out]
    t_differentiable = [
        isinstance(y, torch.Tensor) and y.requires_grad and y.is_floating_point() for y in t_outs
    ]
    if grad_outputs is None:
        cts = [
            rng.standard_normal(tuple(y.shape)) if d else np.zeros(tuple(getattr(y, "shape", ())))
            for y, d in zip(t_outs, t_differentiable)
        ]
    else:
        cts = [np.asarray(c, np.float64) for c in grad_outputs]
    t_cts = [torch.tensor(c, dtype=torch.float64, requires_grad=check_second_order) for c in cts]
    pairs = [(y, c) for y, c, d in zip(t_outs, t_cts, t_differentiable) if d]
    t_grads: list = [None] * len(diff)
    if pairs and diff:
        t_grads = list(torch.autograd.grad(
            [y for y, _ in pairs], [t_inputs[k] for k in diff], [c for _, c in pairs],
            allow_unused=True, create_graph=check_second_order,
        ))
    t_second: list = []
    vs = [rng.standard_normal(inputs[k].shape) for k in diff]
    if check_second_order and diff:
        s = sum((g * torch.tensor(v)).sum() for g, v in zip(t_grads, vs) if g is not None)
        wrt = [t_inputs[k] for k in diff] + t_cts
        if isinstance(s, torch.Tensor) and s.requires_grad:
            t_second = [None if g is None else _numpy(torch, g) for g in torch.autograd.grad(s, wrt, allow_unused=True)]
        else:
            t_second = [None] * len(wrt)

    # --- the port, in float64 ----------------------------------------------
    with _jax_internals.enable_x64(True):
        j_inputs = [jnp.asarray(_as_float64(v)) if _is_array(v) else v for v in inputs]

        def port(*xs: Any) -> list:
            args = list(j_inputs)
            for k, x in zip(diff, xs):
                args[k] = x
            out = call_jax(*args)
            return list(out) if isinstance(out, (tuple, list)) else [out]

        def port_grads(xs: tuple, cotangents: list) -> list:
            outs, pullback = jax.vjp(port, *xs)
            return list(pullback([
                jnp.asarray(c, y.dtype) if jnp.issubdtype(y.dtype, jnp.inexact) else _float0(y)
                for c, y in zip(cotangents, outs)
            ]))

        xs = tuple(j_inputs[k] for k in diff)
        j_outs = port(*xs)
        if len(j_outs) != len(t_outs):
            raise AssertionError(
                f"assert_matches_torch: {report.torch_name} returned {len(t_outs)} output(s), "
                f"the port {report.jax_name} returned {len(j_outs)}."
            )
        for j, (t, y) in enumerate(zip(t_outs, j_outs)):
            report.compare(f"output {j}", _numpy(torch, t), np.asarray(y))
        j_grads = port_grads(xs, [jnp.asarray(c) for c in cts]) if diff else []
        for k, tg, jg in zip(diff, t_grads, j_grads):
            expected = np.zeros(inputs[k].shape) if tg is None else _numpy(torch, tg)
            report.compare(f"the gradient with respect to input {k} ({names[k]})", expected, np.asarray(jg))
        if check_second_order and diff:
            def inner(xs: tuple, cotangents: list) -> Any:
                grads = port_grads(xs, cotangents)
                return sum(jnp.vdot(g, v) for g, v in zip(grads, vs))

            j_cts = [jnp.asarray(c) for c in cts]
            j_dx, j_dct = jax.grad(inner, argnums=(0, 1))(xs, j_cts)
            for k, tg, jg in zip(diff, t_second, j_dx):
                expected = np.zeros(inputs[k].shape) if tg is None else tg
                report.compare(f"the second derivative with respect to input {k} ({names[k]})", expected, np.asarray(jg))
            for j, (tg, jg, d) in enumerate(zip(t_second[len(diff):], j_dct, t_differentiable)):
                if d:
                    expected = np.zeros(cts[j].shape) if tg is None else tg
                    report.compare(f"the second derivative with respect to the gradient of output {j}", expected, np.asarray(jg))
    report.raise_if_any()


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
        got = got.astype(np.float64)
        diff = np.abs(got - expected)
        ok = diff <= self.atol + self.rtol * np.abs(expected)
        ok |= np.isnan(got) & np.isnan(expected)
        if ok.all():
            return
        score = np.where(np.isnan(diff), np.inf, diff)
        worst = np.unravel_index(int(np.argmax(score)), expected.shape) if expected.shape else ()
        e, g = float(expected[worst]), float(got[worst])
        rel = abs(g - e) / abs(e) if e != 0 else float("inf")
        self.problems.append(
            f"{what}: {int((~ok).sum())} of {expected.size} elements differ by more than "
            f"atol + rtol * |torch| (atol={self.atol:g}, rtol={self.rtol:g}).\n"
            f"  worst: element {_element(worst)}\n"
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
    try:
        import torch
    except ImportError:
        import pytest

        pytest.skip("assert_matches_torch needs torch, which is not installed")
    return torch


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


def _name(fn: Any) -> str:
    return getattr(fn, "__name__", None) or repr(fn)


def _is_array(v: Any) -> bool:
    return isinstance(v, (np.ndarray, np.generic, jax.Array))


def _is_float_array(v: Any) -> bool:
    return _is_array(v) and np.issubdtype(np.asarray(v).dtype, np.floating)


def _as_float64(v: Any) -> np.ndarray:
    a = np.asarray(v)
    return a.astype(np.float64) if np.issubdtype(a.dtype, np.floating) else a


def _to_torch(torch: Any, v: Any) -> Any:
    if not _is_array(v):
        return v
    a = _as_float64(v)
    if np.issubdtype(a.dtype, np.floating):
        return torch.tensor(a, dtype=torch.float64, requires_grad=True)
    return torch.tensor(a)


def _numpy(torch: Any, t: Any) -> np.ndarray:
    if isinstance(t, torch.Tensor):
        return t.detach().cpu().numpy()
    return np.asarray(t)


def _float0(y: Any) -> np.ndarray:
    return np.zeros(y.shape, jax.dtypes.float0)


def _element(index: tuple) -> str:
    return "(" + ", ".join(str(int(i)) for i in index) + ("," if len(index) == 1 else "") + ")"
