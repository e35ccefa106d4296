"""``assert_gradcheck`` and ``assert_gradgradcheck``: gradient checks that read well in a test suite.

For example:

```python
import chex
from vjpkit.testing import assert_gradcheck, assert_gradgradcheck, random_inputs

def test_linear_gradients():
    x, w = random_inputs("f64[20,20] f64[30,20]")
    assert_gradcheck(Linear.apply, (x, w), atol=1e-4)

def test_exp_second_derivative():
    assert_gradgradcheck(Exp.apply, random_inputs("f64[5]"))
```

The key difference to calling ``vjpkit.gradcheck`` directly is that a
failure is an ``AssertionError`` carrying the full report (the mismatching
output and input, the worst element, both Jacobians), so pytest shows it as
a test failure with the report as its message, and the helper's own frames
are hidden from the traceback.
"""

from __future__ import annotations

from typing import Any, Callable

from .api import gradcheck
from .gradgrad import gradgradcheck
from .report import GradcheckError


def assert_gradcheck(fn: Callable[..., Any], inputs: Any, **options: Any) -> None:
    """Asserts that ``vjpkit.gradcheck(fn, inputs, **options)`` passes.

    Args:
        fn: as for `vjpkit.gradcheck`.
        inputs: as for `vjpkit.gradcheck`.
        **options: ``eps``, ``atol``, ``rtol``, ``fast_mode`` and the other
            keyword options of `vjpkit.gradcheck` (not
            ``raise_exception``).

    Raises:
        AssertionError: with gradcheck's report as the message.

    Examples:
        >>> import vjpkit
        >>> from vjpkit.testing import assert_gradcheck, random_inputs
        >>> class Cube(vjpkit.Function):
        ...     @staticmethod
        ...     def forward(ctx, x):
        ...         ctx.save_for_backward(x)
        ...         return x**3
        ...
        ...     @staticmethod
        ...     def backward(ctx, g):
        ...         (x,) = ctx.saved_tensors
        ...         return 3 * x**2 * g
        >>> assert_gradcheck(Cube.apply, random_inputs("f64[5]"))
        >>> class WrongCube(Cube):
        ...     @staticmethod
        ...     def backward(ctx, g):
        ...         (x,) = ctx.saved_tensors
        ...         return 2 * x**2 * g
        >>> assert_gradcheck(WrongCube.apply, random_inputs("f64[5]"))
        Traceback (most recent call last):
        ...
        AssertionError: gradcheck failed for WrongCube.apply:
        Jacobian mismatch for output 0 with respect to input 0:
        ...
    """
    __tracebackhide__ = True  # pytest: show the caller's line, not this one
    try:
        gradcheck(fn, inputs, **options)
    except GradcheckError as e:
        raise AssertionError(f"gradcheck failed for {_name(fn)}:\n{e}") from None


def assert_gradgradcheck(fn: Callable[..., Any], inputs: Any, grad_outputs: Any = None,
                         **options: Any) -> None:
    """Asserts that ``vjpkit.gradgradcheck(fn, inputs, grad_outputs, **options)`` passes.

    Raises:
        AssertionError: with gradgradcheck's report as the message.

    Examples:
        >>> import vjpkit
        >>> from vjpkit.testing import assert_gradgradcheck, random_inputs
        >>> class Cube(vjpkit.Function):
        ...     @staticmethod
        ...     def forward(ctx, x):
        ...         ctx.save_for_backward(x)
        ...         return x**3
        ...
        ...     @staticmethod
        ...     def backward(ctx, g):
        ...         (x,) = ctx.saved_tensors
        ...         return 3 * x**2 * g
        >>> assert_gradgradcheck(Cube.apply, random_inputs("f64[5]"))
    """
    __tracebackhide__ = True
    try:
        gradgradcheck(fn, inputs, grad_outputs, **options)
    except GradcheckError as e:
        raise AssertionError(f"gradgradcheck failed for {_name(fn)}:\n{e}") from None


def _name(fn: Any) -> str:
    return getattr(fn, "__qualname__", None) or repr(fn)
