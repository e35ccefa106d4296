"""The Function front: ``vjpkit.Function``, ``@vjpkit.function`` and ``apply``.

The one path for data::

    apply -> bind arguments -> split traced/static -> cached jitted custom_vjp
          -> user forward with a ctx -> residuals -> user backward
          -> checked gradients

A class becomes a cache of *programs*, one per static part of a call
(``_args.split_static``). A program owns one ``jax.custom_vjp`` whose
primal, forward and backward rules run the user's methods, and one
``jax.jit`` of it; JAX's own jit cache then handles shapes and dtypes.
"""

from __future__ import annotations

import collections
import threading
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax.errors import TracerArrayConversionError, UnexpectedTracerError

from . import _anomaly, _host, _jax_internals
from ._args import Layout, Signature, as_jax_leaf, split_residuals, split_static, static_key_of
from ._ctx import FunctionCtx
from ._forward import forward_mode_function
from ._once import call_without_derivative, is_once_differentiable
from ._outputs import (
    Packed,
    check_backward_outputs,
    differentiable_outputs,
    is_differentiable_dtype,
    output_cotangents,
    pack_outputs,
)

__all__ = ["Function", "function", "CacheInfo"]

# The concrete type of a non-traced jax.Array: the fast path's test.
_ArrayImpl = _jax_internals.ArrayImpl


class CacheInfo(NamedTuple):
    """What a Function's compile cache holds (``Sub.cache_info()``)."""

    programs: int  # static signatures currently cached
    maxsize: int  # least recently used programs are dropped beyond this
    hits: int
    misses: int  # each miss traced the user's forward anew


# ---------------------------------------------------------------------------
# What vjpkit reads off a class, once.


class _Spec:
    def __init__(self, cls: type):
        self.name = cls.__name__
        self.forward = cls.forward
        self.backward = _defined(cls, "backward")
        self.jvp = _defined(cls, "jvp")
        self.setup_context = _defined(cls, "setup_context")
        self.signature = Signature(self.name, self.forward, skip_first=self.setup_context is None)
        self.jit = bool(cls.jit)
        self.cache_size = int(cls.cache_size)
        self.once_differentiable = is_once_differentiable(self.backward)
        if cls.host:
            _host.make_host(self, cls)  # NumPy methods, run through jax.pure_callback


def _defined(cls: type, method: str) -> Callable | None:
    fn = getattr(cls, method)
    return None if fn is getattr(Function, method) else fn


# ---------------------------------------------------------------------------
# Residuals: arrays as pytree children, everything else as static data.


class _ResidualMeta:
    """Static data carried from forward to backward inside the residual treedef."""

    __slots__ = ("layout", "needs", "differentiable", "out_avals", "materialize", "in_kinds", "_key")

    def __init__(self, layout, needs, differentiable, out_avals, materialize, in_kinds):
        self.layout = layout  # where saved arrays and ctx attributes go
        self.needs = needs
        self.differentiable = differentiable
        self.out_avals = out_avals
        self.materialize = materialize
        self.in_kinds = in_kinds
        self._key = (layout.treedef, tuple((i, static_key_of(v)) for i, v in layout.static),
                     layout.dynamic, needs, differentiable, out_avals, materialize, in_kinds)

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, _ResidualMeta) and self._key == other._key

    def __hash__(self) -> int:
        return hash(self._key)


class _Residuals:
    __slots__ = ("arrays", "meta")

    def __init__(self, arrays: tuple, meta: _ResidualMeta):
        self.arrays = arrays
        self.meta = meta


jax.tree_util.register_pytree_node(
    _Residuals,
    lambda r: (r.arrays, r.meta),
    lambda meta, arrays: _Residuals(tuple(arrays), meta),
)


def _kind(x: Any) -> tuple:
    return (tuple(x.shape), x.dtype)


# ---------------------------------------------------------------------------
# One program per static signature.


class _Program:
    """The ``custom_vjp`` (and its ``jit``) for one static part of a call."""

    def __init__(self, spec: _Spec, layout: Layout, n_values: int, anomaly: bool = False):
        self.spec = spec
        self.layout = layout
        self.anomaly = anomaly  # traced under vjpkit.detect_anomaly: NaN/Inf checks
        self.names = spec.signature.names(n_values)
        self.param_treedefs = tuple(layout.treedef.children())
        param_of_leaf = [i for i, td in enumerate(self.param_treedefs) for _ in range(td.num_leaves)]
        self.param_of_dynamic = tuple(param_of_leaf[k] for k in layout.dynamic)
        self.n_params = n_values

        # The differentiable function of the array leaves, returning Packed.
        if spec.jvp is None:
            self.differentiable = jax.custom_vjp(_named(self._primal, spec.name))
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

    # -- calling ---------------------------------------------------------

    def jit(self) -> Callable:
        """A new ``jax.jit`` of the program (one per cache entry)."""
        return jax.jit(_named(self._jit_body, self.spec.name))

    def _jit_body(self, *arrays: Any) -> Any:
        packed = self.differentiable(*arrays)
        # jit can return static leaves only inside a pytree's static data.
        return packed if packed.layout.static else packed.unpack()

    def _run_forward(self, ctx: FunctionCtx, values: tuple) -> Any:
        spec = self.spec
        try:
            if spec.setup_context is None:
                out = spec.signature.call(spec.forward, (ctx,), values)
            else:
                out = spec.signature.call(spec.forward, (), values)
                ctx._vjpkit_method = "setup_context"
                spec.setup_context(ctx, values, out)
        except TracerArrayConversionError as e:
            raise TypeError(
                f"{spec.name}.{ctx._vjpkit_method} converted a traced JAX array to "
                "NumPy. forward runs while JAX traces, so its arrays are tracers, "
                "not concrete values: write it with jax.numpy, or declare the "
                f"Function host-side (@vjpkit.function(host=True)) to run NumPy code."
            ) from e
        dirty = {id(x) for x in ctx._vjpkit_dirty}
        if dirty and any(id(leaf) in dirty for leaf in jax.tree_util.tree_leaves(out)):
            raise ValueError(
                f"{spec.name}.forward marked an input dirty (ctx.mark_dirty) and "
                "returned that same input object unchanged. JAX arrays are "
                "immutable: compute the new value (e.g. x = x.at[i].set(v)) and "
                "return it."
            )
        return out

    # -- the custom_vjp rules ---------------------------------------------

    def _primal(self, *arrays: Any) -> Packed:
        values = self.layout.rebuild(arrays)
        ctx = FunctionCtx(self.spec.name, (False,) * self.n_params, values)
        try:
            packed = pack_outputs(self.spec.name, self._run_forward(ctx, values))
        finally:
            ctx._vjpkit_open = False
        if self.anomaly:
            self.check_outputs(packed)
        return packed

    def _fwd(self, *primals: Any) -> tuple[Packed, _Residuals]:
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
        values = self.layout.rebuild(arrays)
        ctx = FunctionCtx(spec.name, needs, values)
        try:
            out = self._run_forward(ctx, values)
            packed = pack_outputs(spec.name, out)
            if self.anomaly:
                self.check_outputs(packed)
            layout, res_arrays = split_residuals((ctx._vjpkit_saved, ctx._user_attributes()))
            meta = _ResidualMeta(
                layout, needs, differentiable_outputs(out, ctx._vjpkit_non_differentiable),
                tuple(_kind(a) for a in packed.arrays), ctx._vjpkit_materialize,
                self.input_kinds(arrays),
            )
            return packed, _Residuals(res_arrays, meta)
        finally:
            ctx._vjpkit_open = False

    def needs_input_grad(self, perturbed: Any, arrays: Any) -> tuple[bool, ...]:
        """One flag per parameter: whether JAX differentiates any of its float leaves."""
        needs = [False] * self.n_params
        for param, p, x in zip(self.param_of_dynamic, perturbed, arrays):
            if p and is_differentiable_dtype(jnp.result_type(x)):
                needs[param] = True
        return tuple(needs)

    def input_kinds(self, arrays: Any) -> tuple:
        """Per leaf of the bound arguments: None (static) or the array's type."""
        kinds: list = [None] * self.layout.treedef.num_leaves
        for k, x in zip(self.layout.dynamic, arrays):
            kinds[k] = (*_kind(x), _jax_internals.varying_axes(x))
        return tuple(kinds)

    def _bwd(self, residuals: _Residuals, cotangents: Packed) -> tuple:
        cts = self._bwd_cotangents(residuals, cotangents)
        if not _jax_internals.BWD_STRUCTURE_IS_FIXED:
            return cts
        # JAX 0.5 to 0.7: no None in bwd's result, whose structure must not vary.
        kinds = [residuals.meta.in_kinds[k] for k in self.layout.dynamic]
        zero = _jax_internals.zero_cotangent
        return tuple(zero(*kind) if ct is None else ct for ct, kind in zip(cts, kinds, strict=True))

    def _bwd_cotangents(self, residuals: _Residuals, cotangents: Packed) -> tuple:
        meta = residuals.meta
        grads = output_cotangents(
            cotangents.layout, cotangents.arrays, meta.out_avals, meta.differentiable, meta.materialize
        )
        if not self.spec.once_differentiable:
            return tuple(self._backward(meta, residuals.arrays, grads))
        grad_leaves, grad_treedef = jax.tree_util.tree_flatten(grads)
        n_res = len(residuals.arrays)

        def backward_of_arrays(*xs: Any) -> list:
            return self._backward(meta, xs[:n_res], jax.tree_util.tree_unflatten(grad_treedef, xs[n_res:]))

        return tuple(
            call_without_derivative(
                backward_of_arrays, (*residuals.arrays, *grad_leaves), self.once_message()
            )
        )

    def once_message(self) -> str:
        return (
            f"{self.spec.name}.backward is decorated with @once_differentiable, so it "
            "cannot be differentiated (a second derivative such as jax.hessian or "
            "grad of grad was asked for). Remove the decorator if backward is "
            "written in differentiable JAX operations."
        )

    def _backward(self, meta: _ResidualMeta, res_arrays: Any, grads: tuple) -> list:
        spec = self.spec
        saved, attributes = meta.layout.rebuild(res_arrays)
        ctx = FunctionCtx(spec.name, meta.needs)
        ctx._vjpkit_method = "backward"
        ctx._vjpkit_saved = saved
        ctx._vjpkit_materialize = meta.materialize
        ctx.__dict__.update(attributes)
        return self.run_backward(ctx, grads, meta.in_kinds, meta.needs)

    def run_backward(self, ctx: FunctionCtx, grads: tuple, in_kinds: tuple, needs: tuple) -> list:
        """The user's backward, its result checked: one cotangent (or None) per array input leaf."""
        try:
            result = self.spec.backward(ctx, *grads)
        finally:
            ctx._vjpkit_open = False
        cotangents = check_backward_outputs(
            self.spec.name, result, self.param_treedefs, self.names, in_kinds, needs
        )
        if self.anomaly:
            self.check_gradients(cotangents)
        return cotangents

    # -- vjpkit.detect_anomaly ----------------------------------------------

    def check_outputs(self, packed: Packed) -> None:
        labelled = [(f"output {j}", a) for j, a in enumerate(packed.arrays)]
        _anomaly.check_finite(self.spec.name, "forward", labelled)

    def check_gradients(self, grads: list, method: str = "backward") -> None:
        """``grads``: one per array input leaf, as ``check_backward_outputs`` returns them."""
        labels = _anomaly.input_labels(self.names, self.param_treedefs, self.layout.dynamic)
        _anomaly.check_finite(self.spec.name, method, list(zip(labels, grads)))


def _no_forward_mode(spec: _Spec) -> TypeError:
    return TypeError(
        f"{spec.name} has no forward-mode derivative (jax.jvp, jax.jacfwd, "
        f"jax.linearize): it defines backward but no jvp. Add a "
        f"jvp(ctx, *tangents) staticmethod to {spec.name}, or use reverse "
        "mode (jax.grad, jax.vjp, jax.jacrev)."
    )


def _leaked_tracer(spec: _Spec, e: UnexpectedTracerError) -> UnexpectedTracerError:
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

    def __init__(self, spec: _Spec):
        self.spec = spec
        self.programs: collections.OrderedDict = collections.OrderedDict()
        self.lock = threading.Lock()
        self.hits = 0
        self.misses = 0
        # arity -> jitted program, for calls whose arguments are all plain
        # arrays: their layout is known without flattening anything.
        self.fast: dict[int, Callable] = {}

    def program(self, key: Any, layout: Layout, n_values: int, anomaly: bool = False) -> tuple[_Program, Callable]:
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
        key, layout, arrays = split_static(values)
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
            if _jax_internals.is_forward_mode_of_custom_vjp_error(e):
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

    def __init__(cls, name: str, bases: tuple, namespace: dict, **kwargs: Any):
        super().__init__(name, bases, namespace, **kwargs)
        if not any(isinstance(b, _FunctionMeta) for b in bases):
            return  # Function itself
        if cls.forward is Function.forward:
            return  # an abstract intermediate base
        cache = _Cache(_Spec(cls))
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
