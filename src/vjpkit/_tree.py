"""Pytrees split into dynamic leaves and a hashable static rest, and put back together.

The one mechanism behind every split vjpkit makes: ``apply``'s arguments
(arrays are traced, the rest is part of the compile-cache key), forward's
outputs (arrays leave the program, the rest rides in the pytree's static
data), the residuals that ctx carries to backward, the host callbacks'
arguments and gradcheck's inputs. As Equinox's ``partition``/``combine``,
but the static part is kept as positions and values, with a key that
tells ``1``, ``1.0`` and ``True`` apart.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import functools
import struct
import types
from typing import Any, Callable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

ARRAY_TYPES = (jax.Array, np.ndarray, np.generic)  # what vjpkit traces: JAX or NumPy arrays, tracers


def is_array(x: Any) -> bool:
    """Whether ``x`` is traced by vjpkit (a JAX or NumPy array, or a tracer)."""
    return isinstance(x, ARRAY_TYPES)


@functools.lru_cache(maxsize=None)  # few distinct dtypes; asked per array while tracing
def is_differentiable_dtype(dtype: Any) -> bool:
    """Whether arrays of ``dtype`` carry gradients (floating and complex ones do)."""
    return jnp.issubdtype(dtype, jnp.inexact)


class _ById:
    """Hashes an unhashable static value by identity (a cache then keys on the object)."""

    __slots__ = ("value",)

    def __init__(self, value: Any):
        self.value = value

    def __hash__(self) -> int:
        return id(self.value)

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, _ById) and other.value is self.value


class Unkeyable(TypeError):
    """A static value with no fingerprint: at ``path`` inside ``value`` is ``culprit``.

    ``reason``: ``"array"`` (its value would be baked into a program),
    ``"opaque"`` (unhashable, with no fields to compare) or ``"cycle"``.
    """

    def __init__(self, value: Any, path: str, culprit: Any, reason: str):
        super().__init__(f"{type(value).__name__}{path}: {reason} ({type(culprit).__name__})")
        self.value = value
        self.path = path
        self.culprit = culprit
        self.reason = reason


_DOUBLE = struct.Struct("<d").pack
_DOUBLES = struct.Struct("<dd").pack


def _number_key(value: Any) -> Any:
    # By bits: -0.0 is not 0.0 (1 / x tells them apart), and nan equals itself.
    if type(value) is float:
        return (float, _DOUBLE(value))
    return (complex, _DOUBLES(value.real, value.imag))


def static_key(value: Any, by_value: bool = False) -> Any:
    """A hashable key for a static value that tells ``1``, ``1.0`` and ``True`` apart.

    Floats are keyed by their bits. Tuples (named or not), frozensets and
    dataclasses whose equality ``dataclass`` wrote are keyed by the type and
    key of each part, wherever they sit: ``Cfg(True)`` equals ``Cfg(1)`` in
    Python, but a forward may branch on the type. Other hashable values keep
    their own equality (as ``jax.jit`` does). An unhashable value is keyed by
    identity, or with ``by_value`` by a fingerprint of its contents (``fingerprint``).
    """
    kind = type(value)
    if kind is float:
        return (float, _DOUBLE(value))
    if kind is complex:
        return _number_key(value)
    if kind is slice:
        return _slice_key(value, by_value)
    try:
        hash(value)
    except TypeError:
        return fingerprint(value) if by_value else _ById(value)
    if kind in _KEYED_BY_ITSELF:
        return (kind, value)
    return _typed_key(value)


def _slice_key(value: slice, by_value: bool) -> Any:
    """A slice's key: by the typed key of its start, stop and step.

    Why: a slice is unhashable before Python 3.12, and ``slice(True, 2)``
    equals ``slice(1, 2)`` after it; a static ``x[s]`` is common.
    """
    parts = (value.start, value.stop, value.step)
    if by_value and not all(map(_is_hashable, parts)):
        return fingerprint(value)  # a bound that is a list or an array: keyed by contents, or refused
    return (slice, tuple(static_key(part, by_value) for part in parts))


# Hashable types whose equal values are the same value.
_KEYED_BY_ITSELF = frozenset({int, bool, str, bytes, type(None), type, range})


def _typed_key(value: Any) -> Any:
    """The key of a hashable value: containers and generated dataclass equality by typed parts."""
    kind = type(value)
    if isinstance(value, tuple):  # named tuples too: their equality is the tuple's
        return (kind, tuple(map(static_key, value)))
    if isinstance(value, frozenset):
        return (kind, frozenset(map(static_key, value)))
    if _has_generated_eq(kind):
        fields = dataclasses.fields(value)
        return (kind, tuple((f.name, static_key(getattr(value, f.name))) for f in fields if f.compare))
    return (kind, value)


def _has_generated_eq(kind: type) -> bool:
    """Whether ``kind`` is a dataclass whose ``__eq__`` ``dataclass`` wrote (compiled from a string), not the user."""
    params = getattr(kind, "__dataclass_params__", None)
    eq = kind.__dict__.get("__eq__")
    code = getattr(eq, "__code__", None)
    return bool(params is not None and params.eq and code is not None and code.co_filename == "<string>")


def fingerprint(value: Any) -> Any:
    """A hashable key equal for equal contents: lists, tuples, dicts, sets, dataclass fields, ``__dict__``.

    Recursively, with hashable leaves by value (floats by their bits), so a
    mutated config gets a new key and an equal new object the same one.
    Raises ``Unkeyable`` for an array inside (its value would be baked into
    a program) or an unhashable object with no fields to compare.
    """
    return _fingerprint(value, value, "", set())


def _fingerprint(root: Any, value: Any, path: str, open_ids: set) -> Any:
    kind = type(value)
    if kind is float or kind is complex:
        return _number_key(value)
    if isinstance(value, ARRAY_TYPES):
        raise Unkeyable(root, path, value, "array")
    if id(value) in open_ids:
        raise Unkeyable(root, path, value, "cycle")
    open_ids.add(id(value))
    try:
        parts: Any
        if isinstance(value, (list, tuple)):
            parts = tuple(_fingerprint(root, v, f"{path}[{i}]", open_ids) for i, v in enumerate(value))
        elif isinstance(value, dict):
            parts = tuple(
                (static_key(k), _fingerprint(root, v, f"{path}[{k!r}]", open_ids)) for k, v in value.items()
            )
        elif isinstance(value, (set, frozenset)):
            parts = frozenset(_fingerprint(root, v, f"{path}{{...}}", open_ids) for v in value)
        elif kind is slice:
            parts = tuple(
                _fingerprint(root, getattr(value, name), f"{path}.{name}", open_ids)
                for name in ("start", "stop", "step")
            )
        elif _is_hashable(value):
            return static_key(value)
        elif dataclasses.is_dataclass(value):
            parts = tuple(
                (f.name, _fingerprint(root, getattr(value, f.name), f"{path}.{f.name}", open_ids))
                for f in dataclasses.fields(value)
            )
        elif hasattr(value, "__dict__"):
            parts = tuple(
                (name, _fingerprint(root, v, f"{path}.{name}", open_ids)) for name, v in vars(value).items()
            )
        else:
            raise Unkeyable(root, path, value, "opaque")
    finally:
        open_ids.discard(id(value))
    return (kind, parts)


def _is_hashable(value: Any) -> bool:
    try:
        hash(value)
    except TypeError:
        return False
    return True


def find_tracer(value: Any, path: str = "", limit: int = 10_000) -> tuple[str, Any] | None:
    """The first JAX tracer inside a static value, and the path to it; None if it holds none.

    Looks where Python objects keep values: containers, dataclass fields,
    ``__dict__``, closures' cells, bound methods and ``functools.partial``.
    Why: such a value travels as static data, fixed when JAX traces, so an
    array of the trace inside it is gone by the time it is used.
    """
    return next(find_tracers(value, path, limit), None)


def find_tracers(value: Any, path: str = "", limit: int = 10_000) -> Iterator[tuple[str, Any]]:
    """Every JAX tracer inside a static value (as ``find_tracer`` looks), each with the path to it."""
    seen: set = set()
    stack = [(value, path)]
    while stack and len(seen) < limit:
        value, path = stack.pop()
        if isinstance(value, jax.core.Tracer):
            yield path, value
            continue
        if id(value) in seen or isinstance(value, (type, types.ModuleType, str, bytes, int, float, complex)):
            continue
        seen.add(id(value))
        stack.extend(reversed(list(_parts(value, path))))


def _parts(value: Any, path: str) -> Iterator[tuple[Any, str]]:
    if isinstance(value, (list, tuple)):
        yield from ((v, f"{path}[{i}]") for i, v in enumerate(value))
    elif isinstance(value, dict):
        yield from ((v, f"{path}[{k!r}]") for k, v in value.items())
    elif isinstance(value, (set, frozenset)):
        yield from ((v, f"{path}{{...}}") for v in value)
    elif isinstance(value, functools.partial):
        yield value.func, f"{path}.func"
        yield from ((v, f"{path}.args[{i}]") for i, v in enumerate(value.args))
        yield from ((v, f"{path}.keywords[{k!r}]") for k, v in value.keywords.items())
    elif isinstance(value, types.MethodType):
        yield value.__self__, f"{path}.__self__"
    elif isinstance(value, types.FunctionType):
        for name, cell in zip(value.__code__.co_freevars, value.__closure__ or (), strict=True):
            try:
                yield cell.cell_contents, f"{path} (its closed-over {name!r})"
            except ValueError:  # an empty cell
                continue
    else:
        if dataclasses.is_dataclass(value) and not hasattr(value, "__dict__"):
            yield from ((getattr(value, f.name), f"{path}.{f.name}") for f in dataclasses.fields(value))
        elif hasattr(value, "__dict__"):
            yield from ((v, f"{path}.{k}") for k, v in vars(value).items())


def replace_tracers(value: Any, replacement: dict[int, Any]) -> Any:
    """``value`` rebuilt with each tracer whose id ``replacement`` maps replaced by what it maps to.

    Looks where ``find_tracers`` looks; only what holds such a tracer is
    rebuilt (a new ``functools.partial``, function with new cells, bound
    method, container, or a shallow copy of an object with new fields), the
    rest is shared. Why: a static value holding a tracer of an enclosing
    transformation reaches backward with that tracer as a residual in its place
    (``Lifted``).
    """
    return _replace(value, replacement, {})


def _replace(value: Any, replacement: dict[int, Any], memo: dict[int, Any]) -> Any:
    if isinstance(value, jax.core.Tracer):
        return replacement.get(id(value), value)
    if isinstance(value, (type, types.ModuleType, str, bytes, int, float, complex, *ARRAY_TYPES)) or value is None:
        return value
    if id(value) in memo:
        return memo[id(value)]
    memo[id(value)] = value  # a cycle back to it keeps the original
    new = _rebuilt(value, replacement, memo)
    memo[id(value)] = new
    return new


def _rebuilt(value: Any, replacement: dict[int, Any], memo: dict[int, Any]) -> Any:
    def sub(v: Any) -> Any:
        return _replace(v, replacement, memo)

    if isinstance(value, (list, tuple)):
        parts = [sub(v) for v in value]
        if all(p is v for p, v in zip(parts, value, strict=True)):
            return value
        if isinstance(value, list):
            return type(value)(parts) if type(value) is list else _with_fields(value, None, parts)
        return type(value)(*parts) if hasattr(value, "_fields") else type(value)(parts)
    if isinstance(value, dict):
        items = {k: sub(v) for k, v in value.items()}
        if all(items[k] is v for k, v in value.items()):
            return value
        if type(value) is dict:
            return items
        new = copy.copy(value)
        new.update(items)
        return new
    if isinstance(value, functools.partial):
        func, args, keywords = sub(value.func), tuple(sub(v) for v in value.args), {
            k: sub(v) for k, v in value.keywords.items()
        }
        if func is value.func and all(a is b for a, b in zip(args, value.args, strict=True)) and all(
            keywords[k] is v for k, v in value.keywords.items()
        ):
            return value
        return type(value)(func, *args, **keywords)
    if isinstance(value, types.MethodType):
        owner = sub(value.__self__)
        return value if owner is value.__self__ else types.MethodType(value.__func__, owner)
    if isinstance(value, types.FunctionType):
        cells = value.__closure__ or ()
        contents = []
        for cell in cells:
            try:
                contents.append((True, cell.cell_contents))
            except ValueError:  # an empty cell
                contents.append((False, None))
        new_contents = [(full, sub(v) if full else v) for full, v in contents]
        if all(a[1] is b[1] for a, b in zip(new_contents, contents, strict=True)):
            return value
        closure = tuple(
            cell if new is old else types.CellType(new)
            for cell, (_, new), (_, old) in zip(cells, new_contents, contents, strict=True)
        )
        function = types.FunctionType(value.__code__, value.__globals__, value.__name__, value.__defaults__, closure)
        function.__kwdefaults__ = value.__kwdefaults__
        function.__qualname__ = value.__qualname__
        function.__dict__.update(value.__dict__)
        return functools.update_wrapper(function, value, assigned=("__module__", "__doc__"), updated=())
    if dataclasses.is_dataclass(value) and not hasattr(value, "__dict__"):
        fields = {f.name: sub(getattr(value, f.name)) for f in dataclasses.fields(value)}
        if all(fields[name] is getattr(value, name) for name in fields):
            return value
        return _with_fields(value, fields, None)
    if hasattr(value, "__dict__"):
        fields = {k: sub(v) for k, v in vars(value).items()}
        if all(fields[k] is v for k, v in vars(value).items()):
            return value
        return _with_fields(value, fields, None)
    return value


def _with_fields(value: Any, fields: dict | None, items: list | None) -> Any:
    """A shallow copy of ``value``: ``fields`` set (past a frozen dataclass's ``__setattr__``), or ``items``."""
    new = copy.copy(value)
    if items is not None:
        new[:] = items
    for name, v in (fields or {}).items():
        object.__setattr__(new, name, v)
    return new


class Lifted:
    """A static value whose tracers (of an enclosing transformation) travel as pytree leaves.

    Flattens to those tracers; unflattening rebuilds the value with the
    leaves given in their place (``replace_tracers``), so it comes back as
    the user's object (a ``functools.partial``, a closure), not a ``Lifted``.
    """

    __slots__ = ("value", "tracers")

    def __init__(self, value: Any, tracers: tuple):
        self.value = value
        self.tracers = tracers


def _unflatten_lifted(lifted: Lifted, leaves: Sequence[Any]) -> Any:
    return replace_tracers(lifted.value, dict(zip(map(id, lifted.tracers), leaves, strict=True)))


jax.tree_util.register_pytree_node(Lifted, lambda lifted: (lifted.tracers, lifted), _unflatten_lifted)


def lift_tracers(value: Any) -> Any:
    """``Lifted(value)`` if ``value`` holds JAX tracers (where ``find_tracers`` looks), else ``value`` itself."""
    tracers = tuple({id(t): t for _, t in find_tracers(value)}.values())
    return Lifted(value, tracers) if tracers else value


def lift_static_tracers(args: tuple, kwargs: dict) -> tuple[tuple, dict, bool]:
    """``args`` and ``kwargs`` with each non-array leaf that holds tracers ``Lifted``; and whether any was.

    Why: a static argument holding a tracer of an enclosing transformation
    (``functools.partial(layer, key=key)`` under ``jax.jit`` or ``jax.vmap``)
    would be closed over by the program, and JAX may run the program's rules
    where that tracer no longer lives (``jax.grad`` of a ``jax.jit``); lifted,
    its tracers are the program's inputs, and forward gets the value rebuilt
    around them.
    """
    found = False

    def lift(leaf: Any) -> Any:
        nonlocal found
        if is_array(leaf):
            return leaf
        lifted = lift_tracers(leaf)
        found = found or lifted is not leaf
        return lifted

    lifted_args, lifted_kwargs = jax.tree_util.tree_map(lift, (args, kwargs))
    return (lifted_args, lifted_kwargs, True) if found else (args, kwargs, False)


def lifted_positions(treedef: Any) -> frozenset:
    """The positions of the leaves of ``treedef`` that ``Lifted`` nodes hold."""
    positions: set[int] = set()

    def walk(node: Any, start: int, inside: bool) -> None:
        data = node.node_data()
        if data is None:  # a leaf
            if inside and node.num_leaves == 1:
                positions.add(start)
            return
        inside = inside or data[0] is Lifted
        for child in node.children():
            walk(child, start, inside)
            start += child.num_leaves

    walk(treedef, 0, False)
    return frozenset(positions)


class Partition:
    """Where each leaf of a pytree goes: the static part of a split.

    ``treedef`` is the pytree's structure; ``static`` maps leaf positions to
    the static leaves; ``dynamic`` lists the positions of the dynamic leaves,
    in the order ``partition`` returned them. Equal (and equally hashed)
    when ``key`` is: the structure and the static leaves by ``static_key``.
    """

    __slots__ = ("treedef", "static", "dynamic", "key")

    def __init__(self, treedef: Any, static: tuple, dynamic: tuple, key: tuple):
        self.treedef = treedef
        self.static = static  # ((leaf position, value), ...)
        self.dynamic = dynamic  # (leaf position, ...)
        self.key = key

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, Partition) and self.key == other.key

    def __hash__(self) -> int:
        return hash(self.key)

    def leaves(self, dynamic_values: Sequence[Any], keep_static: bool = True) -> list:
        """All leaves, ``dynamic_values`` in the dynamic positions; None for static ones unless kept."""
        leaves: list = [None] * self.treedef.num_leaves
        if keep_static:
            for i, value in self.static:
                leaves[i] = value
        for i, value in zip(self.dynamic, dynamic_values, strict=True):
            leaves[i] = value
        return leaves

    def combine(self, dynamic_values: Sequence[Any], keep_static: bool = True) -> Any:
        """The pytree, with ``dynamic_values`` in place of its dynamic leaves (static ones None unless kept)."""
        return jax.tree_util.tree_unflatten(self.treedef, self.leaves(dynamic_values, keep_static))

    def snapshot(self) -> Partition:
        """This partition with its unhashable static values deep-copied.

        Why: such values are keyed by their contents (``fingerprint``); a
        program keeps the copy, so mutating the caller's object later cannot
        change what the program keyed by the old contents computes.
        """
        if all(_is_hashable(value) for _, value in self.static):
            return self
        static = []
        for i, value in self.static:
            if not _is_hashable(value):
                try:
                    value = copy.deepcopy(value)
                except Exception:  # noqa: BLE001 - an object that cannot be copied is kept as is
                    pass
            static.append((i, value))
        return Partition(self.treedef, tuple(static), self.dynamic, self.key)

    def is_tuple(self) -> bool:
        """Whether the pytree is a plain tuple (not a namedtuple, list or leaf)."""
        return self.treedef == jax.tree_util.treedef_tuple(self.treedef.children())

    def owners(self) -> tuple[tuple[int, int], ...]:
        """For the partition of a tuple: per leaf, (element holding it, its position in that element)."""
        return tuple(
            (i, j) for i, child in enumerate(self.treedef.children()) for j in range(child.num_leaves)
        )


_DICTS = (dict, collections.OrderedDict, collections.defaultdict)


def dict_key_types(treedef: Any) -> tuple:
    """The typed keys of ``treedef``'s dicts whose keys are not all strings (none: ``()``).

    Why: a treedef holds dict keys by equality, so ``{True: x}`` and ``{1: x}``
    have one treedef, yet forward sees the key's type.
    """
    typed = []
    stack = [treedef]
    while stack:
        node = stack.pop()
        data = node.node_data()
        if data is None:
            continue
        kind, aux = data
        if kind in _DICTS:
            keys = aux[1] if kind is collections.defaultdict else aux
            if any(type(k) is not str for k in keys):
                typed.append(tuple(map(static_key, keys)))
        stack.extend(node.children())
    return tuple(typed)


def partition(tree: Any, is_dynamic: Callable[[Any], bool], by_value: bool = False) -> tuple[Partition, list]:
    """Splits ``tree`` into its static part and the list of its dynamic leaves.

    ``by_value``: unhashable static leaves are keyed by their contents
    (``fingerprint``), not by identity.
    """
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    static, dynamic, values, key = [], [], [], [treedef, *dict_key_types(treedef)]
    for i, leaf in enumerate(leaves):
        if is_dynamic(leaf):
            dynamic.append(i)
            values.append(leaf)
        else:
            static.append((i, leaf))
            key.append((i, static_key(leaf, by_value)))
    return Partition(treedef, tuple(static), tuple(dynamic), tuple(key)), values
