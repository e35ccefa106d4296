"""The torch bridge: ``from_torch``, an unported PyTorch Function (or any torch callable) run inside JAX.

One path through it, top to bottom (``docs/code-layout.md`` has the table):

- here, ``from_torch`` checks what it was given, reads the original once
  (``origin.Origin.of``: its methods, parameters and options) and hands that
  one description to the mode asked for;
- callback mode (``callback.py``) runs the original in a callback on every
  call, on XLA's own buffers (``device.py``), its output shapes learned first
  (``shapes.py``);
- trace mode (``traced.py``) runs the original's methods once per compiled
  signature on stand-in tensors (``trace.py``, over ``standin.py``), each torch
  call computed by the rule of the op table (``ops/``) or answered without one
  (``special.py``); ``"auto"`` chooses between the two modes per signature.

Both modes convert dtypes with ``dtypes.py``. Nothing here imports torch
until ``from_torch`` is called.
"""

from __future__ import annotations

import functools
from typing import Any

from .._function import Function
from . import callback
from .origin import Origin

__all__ = ["from_torch"]


def from_torch(obj: Any, *, copy_inputs: bool = False, reentrant: bool = False, mode: str = "callback") -> Any:
    """Wraps a ``torch.autograd.Function`` subclass, or a torch callable, as a JAX function.

    Args:
        obj: a ``torch.autograd.Function`` subclass (the result has ``.apply``
            taking the same arguments, and is callable), or any callable of
            tensors (the result is a function of the same arguments).
        copy_inputs: give torch copies of the arrays instead of zero-copy
            views. Needed when the original writes into its inputs or its
            gradients in place (``x.add_(1)`` with ``ctx.mark_dirty(x)``,
            ``grad_output[mask] = 0``): a view would write into JAX's buffer.
        reentrant: compute gradients with ``torch.autograd.backward(outputs,
            cotangents)`` (no ``inputs``) instead of ``torch.autograd.grad``.
            Needed when the original's backward refuses ``torch.autograd.grad``
            (PyTorch's reentrant checkpoint and its copies). Then every leaf
            the original reaches accumulates ``.grad``, as under ``.backward()``
            in PyTorch; from_torch reads its own leaves' and clears them.
        mode: ``"callback"`` runs the original in a callback on every call;
            ``"trace"`` runs its torch operations as JAX operations, compiled
            with the rest of the program (an operation with no JAX rule, or
            code that reads a value, raises ``NotImplementedError`` naming
            it); ``"auto"`` traces where the original traces on a call's
            signature, and uses callbacks on any failure to trace; its
            result's ``.mode`` says which the latest call ran (``"trace"``
            or ``"callback"``) and ``.mode_for(*args)`` which a call runs.

    Returns:
        A vjpkit Function class (for a Function subclass) or its ``apply``.

    The key differences to porting the class are: it runs PyTorch eager
    on every call (a callback per call, forward run again to
    differentiate), it cannot be fused or sharded by XLA, and forward mode
    needs the original's ``jvp`` (or torch's forward AD, for a callable).

    Examples:
        >>> import jax
        >>> import jax.numpy as jnp
        >>> import torch
        >>> import vjpkit
        >>> class TorchCube(torch.autograd.Function):  # the original, unchanged
        ...     @staticmethod
        ...     def forward(ctx, x):
        ...         ctx.save_for_backward(x)
        ...         return x**3
        ...
        ...     @staticmethod
        ...     def backward(ctx, g):
        ...         (x,) = ctx.saved_tensors
        ...         return 3 * x**2 * g
        >>> Cube = vjpkit.from_torch(TorchCube)  # Cube.apply takes JAX arrays
        >>> x = jnp.array([1.0, 2.0])
        >>> jax.jit(jax.grad(lambda x: Cube.apply(x).sum()))(x).tolist()
        [3.0, 12.0]
        >>> softmax = vjpkit.from_torch(lambda x: torch.softmax(x, -1))
        >>> softmax(jnp.zeros(4)).tolist()
        [0.25, 0.25, 0.25, 0.25]
    """
    if mode not in _MODES:
        raise ValueError(f"vjpkit.from_torch: mode must be one of {', '.join(map(repr, _MODES))}, got {mode!r}.")
    torch = _import_torch()
    if getattr(obj, "_vjpkit_from_torch", False):
        name = getattr(obj, "__name__", type(obj).__name__)
        raise TypeError(
            f"vjpkit.from_torch({name}): {name} is already what vjpkit.from_torch made, a function of JAX "
            "arrays; pass the original itself, with every option at once: "
            "vjpkit.from_torch(original, mode=..., reentrant=..., copy_inputs=...)."
        )
    is_class = isinstance(obj, type) and issubclass(obj, torch.autograd.Function)
    if not is_class and isinstance(obj, type) and issubclass(obj, Function):
        raise TypeError(
            f"vjpkit.from_torch({obj.__name__}): {obj.__name__} is already a vjpkit Function; "
            f"call {obj.__name__}.apply directly."
        )
    if not is_class and not callable(obj):
        raise TypeError(
            f"vjpkit.from_torch expects a torch.autograd.Function subclass or a callable of "
            f"tensors, got {type(obj).__name__}."
        )
    origin = Origin.of(torch, obj, copy_inputs=copy_inputs, reentrant=reentrant)
    if mode == "callback":
        return callback.wrap(origin)
    # Trace mode imports torch as it loads (its stand-in subclasses torch.Tensor): only when asked for,
    # so that ``import vjpkit`` never imports torch.
    from . import traced

    return traced.wrap(origin, mode, functools.partial(callback.wrap, origin))


_MODES = ("callback", "trace", "auto")


def _import_torch() -> Any:
    try:
        import torch
    except ImportError as e:  # pragma: no cover - torch is installed where this is tested
        raise ImportError(
            "vjpkit.from_torch needs PyTorch: pip install torch (the CPU wheel is enough)."
        ) from e
    return torch
