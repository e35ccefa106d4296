"""The Function front: ``vjpkit.Function``, ``@vjpkit.function`` and ``apply``.

The one path for data::

    apply -> bind arguments -> split traced/static -> cached jitted custom_vjp
          -> user forward with a ctx -> residuals -> user backward
          -> checked gradients

A class becomes a cache of *programs*, one per static part of a call
(``_tree.partition`` of the bound arguments). A program owns one ``jax.custom_vjp`` whose
primal, forward and backward rules run the user's methods, and one
``jax.jit`` of it; JAX's own jit cache then handles shapes and dtypes.
"""

from __future__ import annotations

import collections
import threading
import weakref
from typing import Any, Callable, NamedTuple

import jax
from jax.errors import UnexpectedTracerError

from . import _anomaly, _jax_internals
from ._args import as_jax_leaf
from ._caches import on_clear
from ._ctx import FunctionCtx, is_array
from ._forward import forward_mode_function
from ._outputs import Packed
from ._program import Program, Residuals, Spec
from ._tie import tie_outputs
from ._tree import Partition, partition

# The concrete type of a non-traced jax.Array: the fast path's test.
_ArrayImpl = _jax_internals.ArrayImpl


class CacheInfo(NamedTuple):
    """What a Function's compile cache holds (``Sub.cache_info()``)."""

    programs: int  # static signatures currently cached
    maxsize: int  # least recently used programs are dropped beyond this
    hits: int
    misses: int  # each miss traced the user's forward anew


# ---------------------------------------------------------------------------
# One program per static signature.


class _Program(Program):
    """The ``custom_vjp`` (and its ``jit``) for one static part of a call."""

    def __init__(self, spec: Spec, layout: Partition, n_values: int, anomaly: bool = False):
        super().__init__(spec, layout, n_values, anomaly)
        # The differentiable function of the array leaves, returning Packed.
        self.differentiable: Callable
        if spec.jvp is None:
            self.differentiable = jax.custom_vjp(_named(self.primal, spec.name))
            self.differentiable.defvjp(
                _named(self._fwd, f"{spec.name}.forward"),
                _named(self._bwd, f"{spec.name}.backward"),
                symbolic_zeros=True,
            )
        else:
            self.differentiable = forward_mode_function(self)
        # The jit of _jit_body lives in the cache entry, not on the program: JAX's
        # caches keep jaxprs whose custom_vjp rules refer to the program, so a
        # program that referred to its jit would keep that jit's cache key (and
        # compiled executables) alive after vjpkit's cache dropped it.

    def jit(self) -> Callable:
        """A new ``jax.jit`` of the program (one per cache entry)."""
        return jax.jit(_named(self._jit_body, self.spec.name))

    def _jit_body(self, *arrays: Any) -> Any:
        packed = self.differentiable(*arrays)
        # jit can return static leaves only inside a pytree's static data.
        return packed if packed.layout.static else packed.unpack()

    # -- the custom_vjp rules ---------------------------------------------

    def _fwd(self, *primals: Any) -> tuple[Packed, Residuals]:
        spec = self.spec
        if spec.backward is None:
            raise TypeError(
                f"{spec.name} cannot be differentiated: it defines no backward "
                f"(and no jvp). Add a backward(ctx, *grad_outputs) staticmethod to "
                f"{spec.name} for reverse mode (jax.grad, jax.vjp, jax.jacrev), or "
                "a jvp(ctx, *tangents) staticmethod for forward mode (jax.jvp, "
                "jax.jacfwd)."
            )
        if _jax_internals.called_from_forward_mode():
            raise _no_forward_mode(spec)
        arrays = tuple(p.value for p in primals)
        needs = self.needs_input_grad([p.perturbed for p in primals], arrays)
        packed, residuals = self.run_forward(arrays, needs)
        # Under a higher-order derivative, outputs and saved outputs differentiate by backward, not forward's code.
        return tie_outputs(self, arrays, packed, residuals)

    def _bwd(self, residuals: Residuals, cotangents: Packed) -> tuple:
        return tuple(self.run_backward(residuals, cotangents.layout, cotangents.arrays))


_JAX_NO_FORWARD_MODE = "can't apply forward-mode autodiff (jvp) to a custom_vjp function"


def _no_forward_mode(spec: Spec) -> TypeError:
    return TypeError(
        f"{spec.name} has no forward-mode derivative (jax.jvp, jax.jacfwd, "
        f"jax.linearize): it defines backward but no jvp. Add a "
        f"jvp(ctx, *tangents) staticmethod to {spec.name}, or use reverse "
        "mode (jax.grad, jax.vjp, jax.jacrev)."
    )


def _leaked_tracer(spec: Spec, e: UnexpectedTracerError) -> UnexpectedTracerError:
    # JAX's report says where the value was created; vjpkit says why and what to do.
    return UnexpectedTracerError(
        f"{spec.name}: an array that leaked out of an earlier trace was used here "
        f"(as an argument of {spec.name}.apply, or inside {spec.name}'s methods). "
        "forward, setup_context, backward and jvp run while JAX traces, so their "
        "arrays (inputs, results, saved tensors) are tracers, valid only during "
        "that call; one kept by user code (in a list, a global, a class or a kept "
        "ctx) fails when used later. Return it from forward as an extra output "
        "instead (ctx.mark_non_differentiable if it needs no gradient).\n\n"
        f"JAX's report:\n{e}"
    )


def _named(fn: Callable, name: str) -> Callable:
    """A plain function named ``name`` (JAX's error messages and jaxprs show it)."""

    def named(*args: Any) -> Any:
        return fn(*args)

    named.__name__ = named.__qualname__ = name
    return named


# ---------------------------------------------------------------------------
# The per-class cache and ``apply``.


class _Cache:
    """Programs by static signature, least recently used dropped first."""

    def __init__(self, spec: Spec):
        self.spec = spec
        self.programs: collections.OrderedDict = collections.OrderedDict()
        self.lock = threading.Lock()
        self.hits = 0
        self.misses = 0
        # arity -> jitted program, for calls whose arguments are all plain
        # arrays: their layout is known without flattening anything.
        self.fast: dict[int, Callable] = {}
        _CACHES.add(self)

    def clear(self) -> None:
        """Drops every program (``apply`` holds ``fast`` itself, so it is emptied in place)."""
        with self.lock:
            self.programs.clear()
            self.fast.clear()

    def program(self, key: Any, layout: Partition, n_values: int, anomaly: bool = False) -> tuple[_Program, Callable]:
        """The program for ``key`` and its jit."""
        with self.lock:
            entry = self.programs.get(key)
            if entry is not None:
                self.programs.move_to_end(key)
                self.hits += 1
                return entry
            self.misses += 1
            program = _Program(self.spec, layout, n_values, anomaly)
            entry = self.programs[key] = (program, program.jit())
            while len(self.programs) > self.spec.cache_size:
                self.programs.popitem(last=False)
            return entry

    def call(self, args: tuple, kwargs: dict) -> Any:
        spec = self.spec
        values = spec.signature.bind(args, kwargs)
        layout, arrays = partition(values, is_array)
        key = layout.key  # the static part of the call
        anomaly = _anomaly.enabled()
        if anomaly:  # a program with NaN/Inf checks, never on the fast path
            key = ("detect_anomaly", key)
        program, jitted = self.program(key, layout, len(values), anomaly)
        try:
            if not spec.jit or _jax_internals.is_staging():
                # Under an outer jit (or scan, checkpoint, ...) the custom_vjp
                # inlines into the caller's program; jit=False runs op by op.
                return program.differentiable(*map(as_jax_leaf, arrays)).unpack()
            out = jitted(*arrays)
        except UnexpectedTracerError as e:
            raise _leaked_tracer(spec, e) from None
        except TypeError as e:
            # JAX reuses a forward rule it traced for reverse mode, so vjpkit's
            # own check in _fwd can be skipped; name the class here instead.
            if str(e).startswith(_JAX_NO_FORWARD_MODE):
                raise _no_forward_mode(spec) from None
            raise
        except Exception as e:
            if anomaly:  # a failed check, wrapped by JAX in JaxRuntimeError
                _anomaly.reraise_anomaly(e)
            raise
        if (
            not anomaly
            and not kwargs
            and len(values) == len(args)
            and all(type(a) is _ArrayImpl for a in args)
        ):
            self.fast[len(args)] = jitted
        return out.unpack() if type(out) is Packed else out

    def info(self) -> CacheInfo:
        with self.lock:
            return CacheInfo(len(self.programs), self.spec.cache_size, self.hits, self.misses)


_CACHES: weakref.WeakSet[_Cache] = weakref.WeakSet()  # every Function's, while its class lives


@on_clear
def _clear_function_caches() -> None:
    for cache in list(_CACHES):
        cache.clear()


def _make_apply(cache: _Cache) -> Callable:
    fast = cache.fast
    slow = cache.call
    anomaly = _anomaly.ACTIVE  # [number of open detect_anomaly blocks]
    current_trace = _jax_internals.current_trace
    EvalTrace = _jax_internals.EvalTrace

    def apply(*args: Any, **kwargs: Any) -> Any:
        if not kwargs and not anomaly[0]:
            run = fast.get(len(args))
            if run is not None and type(current_trace.value) is EvalTrace:
                for a in args:
                    if type(a) is not _ArrayImpl:
                        break
                else:
                    out = run(*args)
                    return out.unpack() if type(out) is Packed else out
        return slow(args, kwargs)

    apply.__name__ = apply.__qualname__ = f"{cache.spec.name}.apply"
    apply.__doc__ = cache.spec.forward.__doc__
    return apply


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
        return cls.apply(*args, **kwargs)


class Function(metaclass=_FunctionMeta):
    """Base class for custom-gradient functions, written as in PyTorch.

    Usage::

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


def function(cls: type | None = None, /, **options: Any) -> Any:
    """Class decorator: turns a class with ``forward``/``backward`` into a Function.

    Usage::

        @vjpkit.function
        class Exp:
            @staticmethod
            def forward(ctx, x): ...
            @staticmethod
            def backward(ctx, g): ...

        @vjpkit.function(jit=False)     # op by op, so print works in forward
        class Debug: ...

        Exp(x); Exp.apply(x)            # both call it

    Options, the same as the class attributes of :class:`Function`:
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
        namespace = {k: v for k, v in vars(cls).items() if k not in ("__dict__", "__weakref__")}
        namespace.update(options)
        bases = tuple(b for b in cls.__bases__ if b is not object)
        if not any(issubclass(b, Function) for b in bases):
            bases = (*bases, Function)
        return _FunctionMeta(cls.__name__, bases, namespace)

    return wrap if cls is None else wrap(cls)
