"""Side by side: a port and its unported PyTorch original, in one jitted step.

For example:

```python
from vjpkit.testing import assert_port_matches_original

def test_exp_port():
    assert_port_matches_original(Exp, TExp, np.linspace(0, 1, 5), second_order=True)
```

Why: while swapping ports in for originals (``vjpkit.from_torch``), the
original stays the reference in the same program, so a training step can
check each port where it is used, on the values it is used with.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from .. import _jax_internals
from .._function import reject_torch_function
from .._torch import from_torch
from .comparison import largest_difference, sin_loss

__all__ = ["assert_port_matches_original", "port_differences"]


def port_differences(port: Any, original: Any, *args: Any, argnums: Sequence[int] | None = None,
                     second_order: bool = False, in_axes: Sequence[Any] | None = None) -> dict[str, float]:
    """The largest absolute differences between ``port`` and ``from_torch(original)``.

    Args:
        port: a vjpkit Function (or any JAX function of the same arguments).
        original: the ``torch.autograd.Function`` subclass or torch callable it
            ports (or what ``vjpkit.from_torch`` made of it).
        *args: the arguments; arrays (NumPy or JAX) are traced, anything else
            is static.
        argnums: which arguments to differentiate; default every floating array.
        second_order: also compare the gradient of the gradients' sum.
        in_axes: compare under ``jax.vmap`` with these axes instead (outputs
            and per-example gradients; ``args`` then carry the batch axes).

    Returns:
        ``{"output": ..., "gradient": ..., ...}``: per check, the largest
        absolute difference over every output (or gradient) element (NaN
        where only one side is NaN; a NaN on both sides agrees). Both
        run in one ``jax.jit`` program; the loss differentiated is
        ``sum(sin(leaf))`` over every floating output leaf, so that no
        output's gradient is constant.

    Examples:
        >>> import numpy as np
        >>> import torch
        >>> import vjpkit
        >>> from vjpkit.testing import port_differences
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
        >>> differences = port_differences(Cube, TorchCube, x, second_order=True)
        >>> {check: round(d, 12) for check, d in differences.items()}
        {'gradient': 0.0, 'output': 0.0, 'second order': 0.0}
    """
    reject_torch_function(port, "vjpkit.testing.port_differences (its port)")
    port_call = _callable(port)
    original_call = _callable(original if _is_wrapped(original) else from_torch(original))
    arrays_at = [k for k, a in enumerate(args) if _is_array(a)]
    if argnums is None:
        argnums = [k for k in arrays_at if np.issubdtype(np.asarray(args[k]).dtype, np.inexact)]
    argnums = tuple(argnums)
    x64 = any(np.asarray(args[k]).dtype.itemsize == 8 and np.asarray(args[k]).dtype.kind == "f" for k in arrays_at)
    with _jax_internals.enable_x64(x64 or bool(jax.config.read("jax_enable_x64"))):
        arrays = [jnp.asarray(args[k]) for k in arrays_at]

        def step(*xs: Any) -> dict:
            return {name: _measure(fn, args, arrays_at, argnums, second_order and in_axes is None, xs)
                    for name, fn in (("port", port_call), ("original", original_call))}

        if in_axes is None:
            got = jax.jit(step)(*arrays)
            return {check: largest_difference(got["port"][check], got["original"][check]) for check in got["port"]}
        axes = tuple(in_axes[k] for k in arrays_at)
        batched = jax.jit(jax.vmap(step, in_axes=axes))(*arrays)
        return {f"vmap {check}": largest_difference(batched["port"][check], batched["original"][check])
                for check in batched["port"]}


def assert_port_matches_original(port: Any, original: Any, *args: Any, argnums: Sequence[int] | None = None,
                                 second_order: bool = False, in_axes: Sequence[Any] | None = None,
                                 atol: float = 1e-6) -> dict[str, float]:
    """Asserts that ``port`` and ``vjpkit.from_torch(original)`` agree within ``atol``.

    Takes the arguments of `port_differences` and returns its result.

    Raises:
        AssertionError: naming each check (output, gradient, second order,
            under vmap) whose largest difference exceeds ``atol``.

    Examples:
        >>> import numpy as np
        >>> import torch
        >>> import vjpkit
        >>> from vjpkit.testing import assert_port_matches_original
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
        >>> checked = assert_port_matches_original(Cube, TorchCube, x)
        >>> sorted(checked)  # what was compared
        ['gradient', 'output']
    """
    __tracebackhide__ = True  # pytest: show the caller's line, not this one
    differences = port_differences(port, original, *args, argnums=argnums, second_order=second_order,
                                   in_axes=in_axes)
    failed = {check: d for check, d in differences.items() if not d <= atol}
    if failed:
        lines = "\n".join(f"  {check}: largest difference {d:.3g}" for check, d in differences.items())
        raise AssertionError(
            f"{_name(port)} does not match its original {_name(original)} within atol={atol} "
            f"({', '.join(failed)}):\n{lines}"
        )
    return differences


def _measure(fn: Callable, args: tuple, arrays_at: list, argnums: tuple, second_order: bool, xs: tuple) -> dict:
    def call(*diff: Any) -> Any:
        values = list(args)
        for k, x in zip(arrays_at, xs, strict=True):
            values[k] = x
        for k, d in zip(argnums, diff, strict=True):
            values[k] = d
        return fn(*values)

    def loss(*diff: Any) -> Any:
        leaves = [leaf for leaf in jax.tree_util.tree_leaves(call(*diff))
                  if jnp.issubdtype(jnp.result_type(leaf), jnp.inexact)]
        return sin_loss(jnp, leaves)

    at = [xs[arrays_at.index(k)] for k in argnums]
    result = {"output": call(*at)}
    if argnums:
        result["gradient"] = jax.grad(loss, argnums=tuple(range(len(at))))(*at)
        if second_order:
            def gradient_sum(*diff: Any) -> Any:
                grads = jax.grad(loss, argnums=tuple(range(len(diff))))(*diff)
                return sum((jnp.sum(g) for g in grads), jnp.zeros(()))

            result["second order"] = jax.grad(gradient_sum, argnums=tuple(range(len(at))))(*at)
    return result


def _is_array(x: Any) -> bool:
    return isinstance(x, (np.ndarray, jax.Array))


def _is_wrapped(original: Any) -> bool:
    return bool(getattr(original, "_vjpkit_from_torch", False)) or hasattr(original, "_vjpkit_cache")


def _callable(fn: Any) -> Callable:
    return getattr(fn, "apply", fn)


def _name(fn: Any) -> str:
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)
