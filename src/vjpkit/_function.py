"""The Function front: ``vjpkit.Function``, ``@vjpkit.function`` and ``apply``.

The one path for data::

    apply -> bind arguments -> split traced/static -> cached jitted custom_jvp
          -> user forward with a ctx -> residuals -> user backward
          -> checked gradients

A class becomes a cache of *programs*, one per static part of a call
(``_tree.partition`` of the bound arguments), in front of which ``apply``
dispatches on the call's shape (``_dispatch.py``). A program
(``_program.py``) owns one ``jax.custom_jvp`` whose primal and rule run the
user's methods (``_runner.py``), and its ``jax.jit``; JAX's own jit cache
then handles shapes and dtypes.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable

from ._ctx import FunctionCtx
from ._dispatch import CacheInfo, _Cache, _make_apply
from ._runner import Spec


class _FunctionMeta(type):
    """Builds a class's spec, cache and ``apply`` once, when the class is created."""

    forward: Callable[..., Any]  # what every class it builds has

    def __init__(cls, name: str, bases: tuple, namespace: dict, **kwargs: Any):
        super().__init__(name, bases, namespace, **kwargs)
        if not any(isinstance(b, _FunctionMeta) for b in bases):
            return  # Function itself
        if cls.forward is Function.forward:
            return  # an abstract intermediate base
        cache = _Cache(Spec(cls, Function))
        cls._vjpkit_cache = cache
        cls.apply = staticmethod(_make_apply(cache))

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        if not args and not kwargs:
            cache = cls.__dict__.get("_vjpkit_cache")
            if cache is not None and cache.spec.takes_inputs:
                # MyFunction().apply(x): PyTorch allows an instance, with this warning.
                warnings.warn(
                    f"{cls.__name__} should not be instantiated. Methods on Functions are all static, "
                    f"so you should invoke them on the class itself ({cls.__name__}.apply(...)).",
                    DeprecationWarning,
                    stacklevel=2,
                )
                return super().__call__()
        return cls.apply(*args, **kwargs)


class Function(metaclass=_FunctionMeta):
    """Base class for custom-gradient functions, written as in PyTorch.

    For example:

    ```python
    class Exp(vjpkit.Function):
        @staticmethod
        def forward(ctx, x):
            y = jnp.exp(x)
            ctx.save_for_backward(y)
            return y

        @staticmethod
        def backward(ctx, g):
            (y,) = ctx.saved_tensors
            return g * y

    jax.grad(lambda x: Exp.apply(x).sum())(x)   # or Exp(x)
    ```

    The key differences to ``jax.custom_vjp`` are:

    - ``ctx`` carries saved arrays and any attribute to backward (arrays as
      residuals, everything else as static data), and ``ctx.needs_input_grad``
      says which inputs JAX is differentiating;
    - non-array arguments (Python scalars, strings, callables) are static,
      part of the compile-cache key, never ``nondiff_argnums`` tracers;
    - backward's gradients are checked: count, structure, shape (broadcast
      shapes are summed down) and dtype (cast; complex for real raises).

    ``apply`` is jit-compiled (one program per static signature); set the
    class attribute ``jit = False`` to run forward op by op for debugging.
    forward and backward run while JAX traces, not on every call.
    """

    jit: bool = True
    cache_size: int = 256
    host: bool = False  # forward/backward in NumPy (see _host.py)
    vmap_method: str = "sequential"  # how jax.vmap batches a host Function's callbacks (see _host.py)
    # PyTorch's flag: jax.vmap batches forward as written unless a vmap staticmethod is defined.
    generate_vmap_rule: bool = False

    @staticmethod
    def forward(ctx: FunctionCtx, *args: Any, **kwargs: Any) -> Any:
        """Computes the outputs; receives ``ctx`` first unless ``setup_context`` is defined."""
        raise NotImplementedError

    @staticmethod
    def setup_context(ctx: FunctionCtx, inputs: tuple, output: Any) -> None:
        """PyTorch 2.x style: fills ``ctx`` from forward's inputs and output."""
        raise NotImplementedError

    @staticmethod
    def backward(ctx: FunctionCtx, *grad_outputs: Any) -> Any:
        """Returns one gradient per forward input (``None`` for zero)."""
        raise NotImplementedError

    @staticmethod
    def jvp(ctx: FunctionCtx, *tangents: Any) -> Any:
        """Returns one output tangent per output (forward mode)."""
        raise NotImplementedError

    @classmethod
    def apply(cls, *args: Any, **kwargs: Any) -> Any:
        raise TypeError(
            f"{cls.__name__} defines no forward, so it cannot be applied. Add a "
            f"forward(ctx, *inputs) staticmethod to {cls.__name__}."
        )

    @classmethod
    def cache_info(cls) -> CacheInfo:
        """How many programs the compile cache holds, and its hits and misses."""
        cache = cls.__dict__.get("_vjpkit_cache")
        if cache is None:
            return CacheInfo(0, int(cls.cache_size), 0, 0)
        return cache.info()


_OPTIONS = ("jit", "cache_size", "host", "vmap_method")
_METACLASSES: dict[type, type] = {}


def _metaclass_for(meta: type) -> type:
    """``_FunctionMeta``, combined with the decorated class's own metaclass (``abc.ABCMeta``, ...)."""
    if issubclass(meta, _FunctionMeta):
        return meta
    if issubclass(_FunctionMeta, meta):  # type itself
        return _FunctionMeta
    combined = _METACLASSES.get(meta)
    if combined is None:
        combined = _METACLASSES[meta] = type(f"Function{meta.__name__}", (_FunctionMeta, meta), {})
    return combined


def function(cls: type | None = None, /, **options: Any) -> Any:
    """Class decorator: turns a class with ``forward``/``backward`` into a Function.

    For example:

    ```python
    @vjpkit.function
    class Exp:
        @staticmethod
        def forward(ctx, x): ...
        @staticmethod
        def backward(ctx, g): ...

    @vjpkit.function(jit=False)     # op by op, so print works in forward
    class Debug: ...

    Exp(x); Exp.apply(x)            # both call it
    ```

    Options, the same as the class attributes of `Function`:
    ``jit`` (default True), ``cache_size`` (programs kept per class, default
    256), ``host`` (forward and backward in NumPy, run through
    ``jax.pure_callback``; default False) and ``vmap_method`` (for host
    Functions: ``"sequential"``, ``"expand_dims"`` or ``"broadcast_all"``).
    """
    unknown = sorted(set(options) - set(_OPTIONS))
    if unknown:
        raise TypeError(
            f"vjpkit.function got unknown option(s) {', '.join(unknown)}; "
            f"expected some of: {', '.join(_OPTIONS)}."
        )

    def wrap(cls: type) -> type:
        if _is_torch_function(cls):
            raise TypeError(
                f"vjpkit.function({cls.__name__}): {cls.__name__} is a torch.autograd.Function. "
                f"To run it unchanged (on the host, through PyTorch) use vjpkit.from_torch({cls.__name__}); "
                "to port it, subclass vjpkit.Function instead and write forward and backward in "
                "jax.numpy (see the porting guide, https://vjpkit.github.io/vjpkit/porting/)."
            )
        namespace = {k: v for k, v in vars(cls).items() if k not in ("__dict__", "__weakref__")}
        namespace.update(options)
        bases = tuple(b for b in cls.__bases__ if b is not object)
        if not any(issubclass(b, Function) for b in bases):
            bases = (*bases, Function)
        return _metaclass_for(type(cls))(cls.__name__, bases, namespace)

    return wrap if cls is None else wrap(cls)


def reject_torch_function(fn: Any, where: str) -> None:
    """Raises when ``fn`` is a ``torch.autograd.Function`` subclass or its ``apply``, passed where a
    JAX function is expected: it would be called with JAX arrays, and fail somewhere inside torch."""
    cls = fn if isinstance(fn, type) else getattr(fn, "__self__", None)
    if isinstance(cls, type) and _is_torch_function(cls):
        name = cls.__name__
        raise TypeError(
            f"{where}: {name} is a torch.autograd.Function, which takes torch tensors, not JAX arrays. "
            f"Pass vjpkit.from_torch({name}).apply to run the original inside JAX, or its port "
            "(a vjpkit.Function; see the porting guide, https://vjpkit.github.io/vjpkit/porting/)."
        )


def _is_torch_function(cls: type) -> bool:
    """Whether ``cls`` subclasses ``torch.autograd.Function``, without importing torch."""
    return any(
        base.__name__ == "Function" and base.__module__ == "torch.autograd.function"
        for base in getattr(cls, "__mro__", ())
    )
