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
    try:
        hash(value)
    except TypeError:
        return fingerprint(value) if by_value else _ById(value)
    if kind in _KEYED_BY_ITSELF:
        return (kind, value)
    return _typed_key(value)


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
    seen: set = set()
    stack = [(value, path)]
    while stack and len(seen) < limit:
        value, path = stack.pop()
        if isinstance(value, jax.core.Tracer):
            return path, value
        if id(value) in seen or isinstance(value, (type, types.ModuleType, str, bytes, int, float, complex)):
            continue
        seen.add(id(value))
        stack.extend(reversed(list(_parts(value, path))))
    return None


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
