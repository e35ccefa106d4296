"""The Function front: ``vjpkit.Function``, ``@vjpkit.function`` and ``apply``.

The one path for data::

    apply -> bind arguments -> split traced/static -> cached jitted call
          -> user forward with a ctx -> residuals -> user backward
          -> checked gradients

A class becomes a cache of *programs*, one per static part of a call
(``_tree.partition`` of the bound arguments), in front of which ``apply``
dispatches on the call's shape (``_dispatch.py``). A program
(``_program.py``) is what one call (``_call.py``, a primitive of vjpkit's
own) runs: its function and rules run the user's methods (``_runner.py``);
with its ``jax.jit``, JAX's own jit cache then handles shapes and dtypes.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable

from ._ctx import FunctionCtx
from ._dispatch import CacheInfo, _Cache, _make_apply
from ._site import page, see_catalogue
from ._spec import describe


class _FunctionMeta(type):
    """Builds a class's spec, cache and ``apply`` once, when the class is created."""

    forward: Callable[..., Any]  # what every class it builds has

    def __init__(cls, name: str, bases: tuple, namespace: dict, **kwargs: Any):
        super().__init__(name, bases, namespace, **kwargs)
        if not any(isinstance(b, _FunctionMeta) for b in bases):
            return  # Function itself
        if cls.forward is Function.forward:
            return  # an abstract intermediate base
        cache = _Cache(describe(cls, Function))
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

    Subclass it with a static ``forward(ctx, *inputs)`` and
    ``backward(ctx, *grad_outputs)``; ``apply`` (or calling the class) runs
    it, and JAX differentiates it with ``backward``.

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

    Attributes:
        jit: Compile ``apply`` with ``jax.jit``, one program per static
            signature (default True). False runs forward op by op, so that
            ``print`` in forward shows values.
        cache_size: How many compiled programs (static signatures) the class
            keeps; beyond it the least recently used is dropped (default 256).
        host: forward and backward are NumPy code, run on the host through
            ``jax.pure_callback`` (default False).
        vmap_method: How ``jax.vmap`` batches a host Function's callbacks:
            ``"sequential"`` (the default), ``"expand_dims"`` or
            ``"broadcast_all"``.
        generate_vmap_rule: PyTorch's flag (default False). ``jax.vmap``
            batches forward as written either way, unless the class defines
            a ``vmap`` staticmethod, which True forbids (as in PyTorch).

    Examples:
        >>> import jax
        >>> import jax.numpy as jnp
        >>> import vjpkit
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
        >>> x = jnp.array([1.0, 2.0, 3.0])
        >>> Cube.apply(x).tolist()
        [1.0, 8.0, 27.0]
        >>> jax.grad(lambda x: Cube.apply(x).sum())(x).tolist()
        [3.0, 12.0, 27.0]

        Under any transformation; calling the class is calling ``apply``:

        >>> jax.jit(jax.vmap(jax.grad(Cube)))(x).tolist()
        [3.0, 12.0, 27.0]
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
        """PyTorch 2.x style: fills ``ctx`` from forward's inputs and output.

        Defined, it makes forward take only the inputs (no ``ctx``), as in
        PyTorch; it runs right after forward.

        Examples:
            >>> import jax
            >>> import jax.numpy as jnp
            >>> import vjpkit
            >>> class Mul(vjpkit.Function):
            ...     @staticmethod
            ...     def forward(x, y):
            ...         return x * y
            ...
            ...     @staticmethod
            ...     def setup_context(ctx, inputs, output):
            ...         ctx.save_for_backward(*inputs)
            ...
            ...     @staticmethod
            ...     def backward(ctx, g):
            ...         x, y = ctx.saved_tensors
            ...         return g * y, g * x
            >>> x, y = jnp.array([1.0, 2.0]), jnp.array([3.0, 4.0])
            >>> loss = lambda x, y: Mul.apply(x, y).sum()
            >>> gx, gy = jax.grad(loss, argnums=(0, 1))(x, y)
            >>> gx.tolist(), gy.tolist()
            ([3.0, 4.0], [1.0, 2.0])
        """
        raise NotImplementedError

    @staticmethod
    def backward(ctx: FunctionCtx, *grad_outputs: Any) -> Any:
        """Returns one gradient per forward input (``None`` for zero).

        It receives one gradient per output of forward (per element of a
        tuple output), and returns a tuple of gradients, or the gradient
        itself for a single input. A gradient may have a shape that the
        input's broadcasts to (it is summed down); ``None`` stands for zeros,
        and is what a static (non-array) input takes.

        Examples:
            >>> import jax
            >>> import jax.numpy as jnp
            >>> import vjpkit
            >>> class ScaleTwice(vjpkit.Function):
            ...     @staticmethod
            ...     def forward(ctx, x, factor):
            ...         ctx.factor = factor
            ...         return factor * x, factor**2 * x
            ...
            ...     @staticmethod
            ...     def backward(ctx, g_once, g_twice):
            ...         return ctx.factor * g_once + ctx.factor**2 * g_twice, None
            >>> def loss(x):
            ...     once, twice = ScaleTwice.apply(x, 3.0)
            ...     return once.sum() + twice.sum()
            >>> jax.grad(loss)(jnp.array([1.0, 2.0])).tolist()
            [12.0, 12.0]
        """
        raise NotImplementedError

    @staticmethod
    def jvp(ctx: FunctionCtx, *tangents: Any) -> Any:
        """Returns one output tangent per output (forward mode).

        It receives one tangent per forward input, and what forward saved with
        ``ctx.save_for_forward`` as ``ctx.saved_tensors``. A class with jvp
        but no backward gets reverse mode too: JAX transposes jvp, which must
        then be linear in the tangents.

        Examples:
            >>> import jax
            >>> import jax.numpy as jnp
            >>> import vjpkit
            >>> class Square(vjpkit.Function):
            ...     @staticmethod
            ...     def forward(ctx, x):
            ...         ctx.save_for_forward(x)
            ...         return x**2
            ...
            ...     @staticmethod
            ...     def jvp(ctx, t):
            ...         (x,) = ctx.saved_tensors
            ...         return 2 * x * t
            >>> x = jnp.array([1.0, 2.0, 3.0])
            >>> jax.jvp(Square.apply, (x,), (jnp.ones(3),))[1].tolist()
            [2.0, 4.0, 6.0]
            >>> jax.jacfwd(Square.apply)(x).tolist()
            [[2.0, 0.0, 0.0], [0.0, 4.0, 0.0], [0.0, 0.0, 6.0]]
            >>> jax.grad(lambda x: Square.apply(x).sum())(x).tolist()
            [2.0, 4.0, 6.0]
        """
        raise NotImplementedError

    @classmethod
    def apply(cls, *args: Any, **kwargs: Any) -> Any:
        """Runs the Function: forward's outputs, which JAX differentiates with backward (and jvp).

        Takes forward's arguments without ``ctx``, positionally or by name.
        Arrays (JAX or NumPy) are traced; any other argument is static: part
        of the compile-cache key, and passed to forward as it is. Calling the
        class, ``Scale(x)``, is the same call.

        Examples:
            >>> import jax
            >>> import jax.numpy as jnp
            >>> import vjpkit
            >>> class Scale(vjpkit.Function):
            ...     @staticmethod
            ...     def forward(ctx, x, factor=2.0):
            ...         ctx.factor = factor
            ...         return factor * x
            ...
            ...     @staticmethod
            ...     def backward(ctx, g):
            ...         return ctx.factor * g, None
            >>> x = jnp.array([1.0, 2.0])
            >>> Scale.apply(x).tolist()
            [2.0, 4.0]
            >>> Scale.apply(x, factor=3.0).tolist()
            [3.0, 6.0]
            >>> jax.grad(lambda x: Scale(x, 3.0).sum())(x).tolist()
            [3.0, 3.0]
        """
        raise TypeError(
            f"{cls.__name__} defines no forward, so it cannot be applied. Add a "
            f"forward(ctx, *inputs) staticmethod to {cls.__name__}. {see_catalogue('no-forward')}"
        )

    @classmethod
    def cache_info(cls) -> CacheInfo:
        """How many programs the compile cache holds, and its hits and misses.

        A program is compiled per static signature: per value of the static
        arguments (the arrays' shapes and dtypes are ``jax.jit``'s to cache).

        Examples:
            >>> import jax.numpy as jnp
            >>> import vjpkit
            >>> class Power(vjpkit.Function):
            ...     @staticmethod
            ...     def forward(ctx, x, n):
            ...         ctx.save_for_backward(x)
            ...         ctx.n = n
            ...         return x**n
            ...
            ...     @staticmethod
            ...     def backward(ctx, g):
            ...         (x,) = ctx.saved_tensors
            ...         return ctx.n * x ** (ctx.n - 1) * g, None
            >>> x = jnp.array([1.0, 2.0])
            >>> Power.apply(x, 2).tolist(), Power.apply(x, 2).tolist()
            ([1.0, 4.0], [1.0, 4.0])
            >>> Power.apply(x, 3).tolist()  # another static argument: a new program
            [1.0, 8.0]
            >>> Power.cache_info()
            CacheInfo(programs=2, maxsize=256, hits=1, misses=2)
        """
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

    Options, the same as the class attributes of `Function`:
    ``jit`` (default True), ``cache_size`` (programs kept per class, default
    256), ``host`` (forward and backward in NumPy, run through
    ``jax.pure_callback``; default False) and ``vmap_method`` (for host
    Functions: ``"sequential"``, ``"expand_dims"`` or ``"broadcast_all"``).

    Examples:
        >>> import jax
        >>> import jax.numpy as jnp
        >>> import vjpkit
        >>> @vjpkit.function
        ... class Cube:
        ...     @staticmethod
        ...     def forward(ctx, x):
        ...         ctx.save_for_backward(x)
        ...         return x**3
        ...
        ...     @staticmethod
        ...     def backward(ctx, g):
        ...         (x,) = ctx.saved_tensors
        ...         return 3 * x**2 * g
        >>> jax.grad(lambda x: Cube(x).sum())(jnp.array([1.0, 2.0])).tolist()
        [3.0, 12.0]

        With options: ``jit=False`` runs forward op by op, so ``print``
        shows values:

        >>> @vjpkit.function(jit=False)
        ... class Double:
        ...     @staticmethod
        ...     def forward(ctx, x):
        ...         print("forward got", x.tolist())
        ...         return 2 * x
        ...
        ...     @staticmethod
        ...     def backward(ctx, g):
        ...         return 2 * g
        >>> Double.apply(jnp.array([1.0, 2.0])).tolist()
        forward got [1.0, 2.0]
        [2.0, 4.0]
    """
    unknown = sorted(set(options) - set(_OPTIONS))
    if unknown:
        raise TypeError(
            f"vjpkit.function got unknown option(s) {', '.join(unknown)}; "
            f"expected some of: {', '.join(_OPTIONS)}. {see_catalogue('unknown-decorator-option')}"
        )

    def wrap(cls: type) -> type:
        if _is_torch_function(cls):
            raise TypeError(
                f"vjpkit.function({cls.__name__}): {cls.__name__} is a torch.autograd.Function. "
                f"To run it unchanged (on the host, through PyTorch) use vjpkit.from_torch({cls.__name__}); "
                "to port it, subclass vjpkit.Function instead and write forward and backward in "
                f"jax.numpy (see the porting guide, {page('porting')})."
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
            f"(a vjpkit.Function; see the porting guide, {page('porting')})."
        )


def _is_torch_function(cls: type) -> bool:
    """Whether ``cls`` subclasses ``torch.autograd.Function``, without importing torch."""
    return any(
        base.__name__ == "Function" and base.__module__ == "torch.autograd.function"
        for base in getattr(cls, "__mro__", ())
    )
