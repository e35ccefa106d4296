"""What vjpkit reads off a Function's class, once: ``Spec``, which nothing changes after.

``describe(cls, Function)`` reads the methods (those the base class defines
count as absent), forward's signature, the options (``jit``, ``cache_size``,
``host``), the vmap staticmethod, and the tracers the methods close over. A
host class's spec is the same description with the methods replaced by ones
that run the user's NumPy code through callbacks (``_host.host_methods``).
"""

from __future__ import annotations

import dataclasses
import functools
import types
from typing import Any, Callable

import jax

from . import _host
from ._args import Signature
from ._once import is_once_differentiable
from ._site import see_catalogue
from ._tree import Partition, Unkeyable, is_array, partition


@dataclasses.dataclass(frozen=True, eq=False)
class Spec:
    """A Function class as vjpkit runs it: its methods, forward's signature and its options.

    Compared and hashed by identity (``eq=False``): each class has one, and
    the tracers it may hold have no equality to compare by.

    Attributes:
        name: the class's name, which every message and profile scope uses.
        forward: ``forward(ctx, *args)``, or ``forward(*args)`` with ``setup_context``.
        backward: the class's backward (or ``vjp``); None if it defines none.
        jvp: the class's jvp; None if it defines none.
        setup_context: the class's setup_context; None if forward takes ctx.
        vmap: the class's vmap staticmethod (PyTorch's batching rule); None if absent.
        signature: forward's signature without ctx, which binds ``apply``'s arguments.
        takes_inputs: whether forward has a parameter without a default.
        closure_values: the JAX tracers the methods close over, each once.
        closure_tracers: their ids.
        jit: whether each call runs as its own ``jax.jit`` program (False
            when the methods close over tracers, which a program of its own
            cannot hold: such a class runs as a plain ``custom_vjp`` does).
        cache_size: how many compiled programs the class keeps.
        once_differentiable: whether backward may not be differentiated itself.
        host: whether the methods are NumPy code run through callbacks.
    """

    name: str
    forward: Callable
    backward: Callable | None
    jvp: Callable | None
    setup_context: Callable | None
    vmap: Callable | None
    signature: Signature
    takes_inputs: bool
    closure_values: tuple
    closure_tracers: frozenset
    jit: bool
    cache_size: int
    once_differentiable: bool
    host: bool

    @property
    def closes_over_tracer(self) -> bool:
        """Whether a method closes over a JAX tracer (a class made inside a transformed function)."""
        return bool(self.closure_values)

    def partition_arguments(self, values: tuple) -> tuple[Partition, list]:
        """The bound arguments split into the static part (keyed by value) and the arrays."""
        try:
            return partition(values, is_array, by_value=True)
        except Unkeyable as e:
            raise self._unkeyable(values, e) from None

    def _unkeyable(self, values: tuple, e: Unkeyable) -> TypeError:
        holder = next(i for i, v in enumerate(values) if _path_in(e, v) is not None)
        name = self.signature.names(len(values))[holder]
        where = f"{name}{_path_in(e, values[holder])}"
        culprit, owner = e.culprit, type(e.value).__name__
        if e.reason == "array":
            problem = (
                f"{where} is an array (shape {tuple(culprit.shape)}, dtype {culprit.dtype}), which cannot be "
                "part of a compile-cache key. Pass the array as an argument of its own (arrays are traced), "
                f"or hold Python values (floats, tuples) in the {owner} instead. "
                f"{see_catalogue('static-argument-holding-an-array')}"
            )
        else:
            kind = type(culprit).__name__
            problem = (
                f"{where} is an unhashable {kind} "
                f"{'that refers back to itself' if e.reason == 'cycle' else 'with no fields to compare'}. "
                f"Make {kind} hashable (define __eq__ and __hash__, or use @dataclass(frozen=True)) "
                "to key it by its own equality."
            )
        return TypeError(
            f"{self.name}.apply: static argument {name!r} ({owner}) is keyed by its contents, so that a "
            f"changed object gets a new program; but {problem}"
        )


def _path_in(e: Unkeyable, value: Any) -> str | None:
    """Where in the argument ``value`` the unkeyable part is (None if elsewhere)."""
    for path, leaf in jax.tree_util.tree_flatten_with_path(value)[0]:
        if leaf is e.value:
            return jax.tree_util.keystr(path) + e.path
    return None


def describe(cls: Any, base: type) -> Spec:
    """``cls``'s spec: its methods (those ``base`` defines count as absent) and options, checked."""
    name = cls.__name__
    forward = cls.forward
    # PyTorch documents ``vjp`` as another name of ``backward``.
    backward = _defined(cls, base, "backward") or getattr(cls, "vjp", None)
    jvp = _defined(cls, base, "jvp")
    setup_context = _defined(cls, base, "setup_context")
    signature = Signature(name, forward, skip_first=setup_context is None)
    # A class made inside a transformed function may close over that function's tracers, which a jit of
    # its own cannot hold (JAX lowers them as constants): such a class runs as a plain custom_vjp does.
    # Their ids, and the tracers themselves: a rule's primitive takes them as operands (_program._ClosureConverted).
    closure_values = _closure_tracers(forward, backward, jvp, setup_context)
    cache_size = _cache_size(name, cls.cache_size)
    vmap = _vmap_rule(cls, name, setup_context)
    spec = Spec(
        name=name,
        forward=forward,
        backward=backward,
        jvp=jvp,
        setup_context=setup_context,
        vmap=vmap,
        signature=signature,
        takes_inputs=any(p not in signature.defaults for p in (*signature.positional, *signature.keyword_only)),
        closure_values=closure_values,
        closure_tracers=frozenset(map(id, closure_values)),
        jit=bool(cls.jit) and not closure_values,
        cache_size=cache_size,
        once_differentiable=is_once_differentiable(backward),
        host=bool(cls.host),
    )
    if spec.host:  # NumPy methods, run through jax.pure_callback
        spec = dataclasses.replace(spec, **_host.host_methods(spec, cls))
    return spec


def _defined(cls: type, base: type, method: str) -> Callable | None:
    fn = getattr(cls, method)
    return None if fn is getattr(base, method) else fn


def _cache_size(name: str, value: Any) -> int:
    # At least one program: a cache that keeps none would drop the program it just made.
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(
            f"{name}.cache_size must be a positive int (the number of compiled programs kept "
            f"per class), got {value!r}. {see_catalogue('cache-size-not-positive')}"
        )
    return value


def _closure_tracers(*methods: Any) -> tuple:
    """The JAX tracers that the methods' closures hold, each once.

    Directly, as leaves of pytrees, or through the closures of the
    functions they hold (a helper ``backward`` calls that closes over a
    tracer, a ``functools.partial`` over one), at any depth.
    """
    found: dict[int, Any] = {}
    seen: set[int] = set()
    pending = [m for m in methods if m is not None]
    while pending:
        function = pending.pop()
        if id(function) in seen:
            continue
        seen.add(id(function))
        if isinstance(function, functools.partial):
            pending.append(function.func)
            contents = [function.args, function.keywords]
        else:
            contents = []
            for cell in getattr(function, "__closure__", None) or ():
                try:
                    contents.append(cell.cell_contents)
                except ValueError:  # not yet bound (the class itself, referred to by its own methods)
                    continue
        for leaf in jax.tree_util.tree_leaves(contents):
            if isinstance(leaf, jax.core.Tracer):
                found.setdefault(id(leaf), leaf)
            elif isinstance(leaf, (types.FunctionType, functools.partial)):
                pending.append(leaf)
    return tuple(found.values())


def _vmap_rule(cls: Any, name: str, setup_context: Callable | None) -> Callable | None:
    """The class's ``vmap(info, in_dims, *args)`` staticmethod (PyTorch's batching rule), checked; None if absent.

    A host Function runs its rule on the host (``_host.py``).
    """
    rule = getattr(cls, "vmap", None)
    generated = bool(getattr(cls, "generate_vmap_rule", False))
    if rule is None:
        return None  # generate_vmap_rule = True or not: jax.vmap batches forward as written
    if generated:
        raise TypeError(
            f"{name} has both generate_vmap_rule = True and a vmap staticmethod: set "
            "generate_vmap_rule = False to use the vmap staticmethod, or delete the vmap staticmethod "
            "to batch forward as written (as PyTorch requires)."
        )
    if cls.host:
        return None  # run on the host, by the host Function's own forward
    if setup_context is None:
        raise TypeError(
            f"{name} defines a vmap staticmethod, which batches forward's outputs only, so forward "
            f"must not take ctx: write {name}.forward(*inputs) and fill ctx in "
            f"{name}.setup_context(ctx, inputs, output) (PyTorch's rule for a Function with a "
            "vmap staticmethod), or delete the vmap staticmethod to batch forward as written."
        )
    return rule
