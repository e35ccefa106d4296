"""The call-shape dispatch in front of a Function's compile cache, and ``apply``."""

from __future__ import annotations

import functools
import operator
import threading
import weakref
from typing import Any, Callable, NamedTuple

import jax
from jax.errors import UnexpectedTracerError

from . import _anomaly, _jax_internals
from ._args import as_jax_leaf
from ._caches import on_clear
from ._outputs import Packed
from ._program import Program, closed_over_differentiated, no_forward_mode
from ._site import see_catalogue
from ._spec import Spec
from ._tree import Partition, Unkeyable, dict_key_types, find_tracer, is_array, lift_static_tracers, static_key


class CacheInfo(NamedTuple):
    """What a Function's compile cache holds (``Sub.cache_info()``).

    Attributes:
        programs: The static signatures currently cached, one compiled
            program each.
        maxsize: The class's ``cache_size``: beyond it the least recently
            used program is dropped.
        hits: Calls that found their program cached.
        misses: Calls that traced forward anew to make a program.

    Examples:
        >>> import jax.numpy as jnp
        >>> import vjpkit
        >>> class Double(vjpkit.Function):
        ...     @staticmethod
        ...     def forward(ctx, x):
        ...         return 2 * x
        ...
        ...     @staticmethod
        ...     def backward(ctx, g):
        ...         return 2 * g
        >>> _ = Double.apply(jnp.ones(3)), Double.apply(jnp.ones(3))
        >>> info = Double.cache_info()
        >>> info
        CacheInfo(programs=1, maxsize=256, hits=1, misses=1)
        >>> info.hits / (info.hits + info.misses)
        0.5
    """

    programs: int  # static signatures currently cached
    maxsize: int  # least recently used programs are dropped beyond this
    hits: int
    misses: int  # each miss traced the user's forward anew


def _leaked_tracer(spec: Spec, e: UnexpectedTracerError) -> UnexpectedTracerError:
    # JAX's report says where the value was created; vjpkit says why and what to do.
    return UnexpectedTracerError(
        f"{spec.name}: an array that leaked out of an earlier trace was used here "
        f"(as an argument of {spec.name}.apply, or inside {spec.name}'s methods). "
        "forward, setup_context, backward and jvp run while JAX traces, so their "
        "arrays (inputs, results, saved tensors) are tracers, valid only during "
        "that call; one kept by user code (in a list, a global, a class or a kept "
        "ctx) fails when used later. Return it from forward as an extra output "
        "instead (ctx.mark_non_differentiable if it needs no gradient). "
        # JAX's error types end their text with a link of their own, so vjpkit's ends its part.
        f"{see_catalogue('leaked-array-used-after-the-call')}\n\nJAX's report:\n{e}"
    )



# ---------------------------------------------------------------------------
# The per-class cache and ``apply``.
#
# ``apply`` dispatches on the *call shape*, as ``jax.jit``'s own fast path
# does: the type of each argument and the keyword names; for arguments that
# are pytrees (tuples, dicts, None, ...), their structure and the type of each
# leaf; and the static leaves by value. A call shape fixes how the
# arguments bind to forward's parameters, hence the program: a call of a
# known shape only reads that key and runs the program's jit on its array
# leaves, with no Python call of its own. Binding and splitting run once per
# new call shape.

# Call shapes remembered per program (keyword or positional, NumPy or JAX
# arrays, ...); beyond it the oldest is forgotten and binds again when next seen.
_SHAPES_PER_PROGRAM = 16


class _Entry:
    """A cached program, its jits, and the call shapes routed to it."""

    __slots__ = ("key", "program", "jitted", "on_arrays", "in_reverse_mode", "routes", "used")

    def __init__(self, key: Any, program: Program, jits: tuple[Callable, Callable] | None):
        self.key = key  # the program's key in _Cache.programs
        self.program = program
        # Its jits (None for ``jit = False``): for calls on tracers, and on concrete arrays.
        self.jitted: Callable | None = jits[0] if jits else None
        self.on_arrays: Callable | None = jits[1] if jits else None
        self.in_reverse_mode: Callable | None = None  # made when first needed (JAX before 0.7)
        self.routes: list[tuple] = []  # where each call shape routed here is remembered (see _Cache.route)
        self.used = 0  # the number of the last call that ran it (_Cache.calls): the least recent is dropped


def _last_used(entry: _Entry) -> int:
    return entry.used


class _CallShape:
    """What a call's argument types (or, for pytree arguments, their structure and leaf types) tell.

    ``nested``: some argument is a pytree, so the shape depends on its
    structure: ``routes`` maps structure and leaf types to the inner shape.
    Otherwise the arguments are the leaves, and ``routes`` maps the key of
    the static leaves (``keyer(leaves)``; ``()`` when there are none) to
    ``(entry, pick, run)``, ``pick`` taking the program's arrays out of the
    leaves (None: all the leaves, in order) and ``run`` running the program
    on them (its jit, or ``_run_in_trace`` for calls on tracers). ``route``
    is that route when the shape alone fixes it (no static leaf), so such a
    call reads one table. ``last`` (nested shapes): the structure, leaf
    types and inner shape of the last call that found one, compared before
    ``routes`` is read (comparing a structure costs less than hashing it);
    a call that binds anew forgets it.
    """

    __slots__ = ("route", "nested", "keyer", "routes", "last")

    def __init__(self, nested: bool, keyer: Callable[[Any], Any] | None = None):
        self.route: tuple | None = None
        self.nested = nested
        self.keyer = keyer
        self.routes = _Routes()
        self.last: tuple | None = None

    def add(self, statics: Any, route: tuple) -> None:
        self.routes.put(statics, route)
        if self.keyer is None:
            self.route = route

    def remove(self, statics: Any) -> None:
        self.routes.drop(statics)
        self.route = None


class _Routes(dict):
    """Routes by the key of the static leaves: ``routes[key]`` is the route, or None.

    Keys of plain values (``int``, ``str``, ``float``, ...) are the values
    themselves, which are equal when the static values are the same, but
    for floats: ``0.0 == -0.0``, and ``nan`` is not equal to itself. A key
    holding a zero or nan float (or complex) is kept by ``static_key``, which
    tells them apart by their bits, in ``exact``; a lookup that finds no
    equal key reads it there.
    """

    __slots__ = ("exact",)

    def __init__(self) -> None:
        super().__init__()
        self.exact: dict = {}

    def __missing__(self, key: Any) -> tuple | None:
        return self.exact.get(_exact_key(key)) if self.exact else None

    def put(self, key: Any, route: Any) -> None:
        if _ambiguous(key):
            self.exact[_exact_key(key)] = route
        else:
            self[key] = route

    def drop(self, key: Any) -> None:
        if _ambiguous(key):
            del self.exact[_exact_key(key)]
        else:
            del self[key]

    def __bool__(self) -> bool:
        return bool(len(self) or self.exact)


def _exact_key(key: Any) -> Any:
    # A key of several static leaves is a tuple (a single leaf is never one: tuples are pytrees).
    return tuple(map(_static_key_by_value, key)) if type(key) is tuple else static_key(key, True)


def _ambiguous(key: Any) -> bool:
    """Whether ``key`` holds a float or complex that equals another of other bits (zeros) or not itself (nan)."""
    for value in key if type(key) is tuple else (key,):
        kind = type(value)
        if kind is float and (value != value or value == 0):
            return True
        if kind is complex and (value != value or value.real == 0 or value.imag == 0):
            return True
    return False


_UNSEEN = _CallShape(False)  # what apply finds for a call shape not (or no longer) routed


class _Argument:
    """Stands for argument ``at`` (a position or a keyword) when binding a call shape."""

    __slots__ = ("at",)

    def __init__(self, at: int | str):
        self.at = at


def _picker(picked: list[int], constants: list, n_leaves: int) -> Callable[[Any], Any] | None:
    """The call's leaves -> the program's arrays (``picked`` indexes the leaves, then ``constants``)."""
    if any(i >= n_leaves for i in picked):  # an array default: appended to the call's leaves
        take = _picker(picked, [], n_leaves + len(constants)) or list
        return lambda leaves: take([*leaves, *constants])
    if picked == list(range(n_leaves)):
        return None
    if not picked:
        return operator.itemgetter(slice(0, 0))
    first, last = picked[0], picked[-1]
    if picked == list(range(first, last + 1)):  # a run of the leaves (one, at least): a slice
        return operator.itemgetter(slice(first, last + 1))
    return operator.itemgetter(*picked)  # two or more: a tuple


# Static leaf types whose values key themselves: equal values are the same static
# value (the call shape already tells their types apart, so 1, 1.0 and True differ).
_KEYED_BY_EQUALITY = frozenset({int, bool, str, bytes, float, complex})  # floats: see _Routes


def _keyer(leaves: Any, static_at: tuple[int, ...]) -> Callable[[Any], Any] | None:
    """The call's leaves -> the key of its static leaves (by value); None when there are none.

    Chosen once per call shape, which fixes the static leaves' types. The
    general key (``static_key``) may raise ``Unkeyable``; ``apply`` then
    takes the slow path, which says why.
    """
    if not static_at:
        return None
    kinds = {type(leaves[i]) for i in static_at}
    if kinds <= _KEYED_BY_EQUALITY:
        return operator.itemgetter(*static_at)
    if len(static_at) == 1:
        (i,) = static_at
        return lambda leaves: static_key(leaves[i], True)
    get = operator.itemgetter(*static_at)
    return lambda leaves: tuple(map(_static_key_by_value, get(leaves)))


def _static_key_by_value(value: Any) -> Any:
    return static_key(value, True)


def _call_leaves(args: tuple, kwargs: dict) -> tuple:
    """The arguments in call-shape order: positional, then keywords as given."""
    return (*args, *kwargs.values()) if kwargs else args


_flatten = jax.tree_util.default_registry.flatten  # tree_flatten without its Python frame


def _is_pytree(x: Any) -> bool:
    return not jax.tree_util.treedef_is_leaf(jax.tree_util.tree_structure(x)) or x is None


class _Cache:
    """Programs by static signature, least recently used dropped first, and the call shapes routed to them."""

    def __init__(self, spec: Spec):
        self.spec = spec
        self.programs: dict[Any, _Entry] = {}
        # Argument types and keyword names -> _CallShape; the second table is for calls under detect_anomaly.
        self.shapes: tuple[dict, dict] = ({}, {})
        self.lock = threading.Lock()
        self.calls = 0  # calls that ran a program (apply counts them without the lock: a count, not an id)
        self.misses = 0
        _CACHES.add(self)

    def clear(self) -> None:
        """Drops every program (``apply`` holds the tables themselves, so they are emptied in place)."""
        with self.lock:
            self.programs.clear()
            for table in self.shapes:
                table.clear()

    def route(self, args: tuple, kwargs: dict, anomaly: bool) -> tuple[tuple, Any]:
        """For a call of a new shape: binds it, finds (or makes) its program, and remembers the route.

        Returns the route (entry, pick, run) and the call's leaves.
        """
        spec = self.spec
        # A static argument holding a tracer of an enclosing transformation: its tracers become the program's inputs.
        args, kwargs, lifted = lift_static_tracers(args, kwargs)
        values = spec.signature.bind(args, kwargs)
        layout, _ = spec.partition_arguments(values)
        key = ("detect_anomaly", layout.key) if anomaly else layout.key
        leaves: Any = _call_leaves(args, kwargs)
        path: list[Any] = [(self.shapes[anomaly], (*map(type, leaves), *kwargs))]  # (table, key) down to the route
        nested = any(map(_is_pytree, leaves))
        routable = True
        if nested:
            leaves, treedef = _flatten(leaves)
            path.append((None, (treedef, *map(type, leaves))))
            # A treedef holds dict keys by equality ({True: x} is {1: x}): such calls always bind.
            routable = not dict_key_types(treedef) and not lifted  # a Lifted is keyed by identity: never again
        pick = self._pick(args, kwargs, layout, len(leaves))
        with self.lock:
            self.calls += 1
            entry = self.programs.get(key)
            if entry is None:
                self.misses += 1
                program = Program(spec, layout, len(values), anomaly)
                # Under detect_anomaly a top-level call runs op by op: a check then raises at the
                # call (and in an eager jax.grad's backward pass), not from inside a jit. Not across
                # processes: an eager callback sees only local data, a jitted one every device's.
                jitted = spec.jit and (not anomaly or jax.process_count() > 1)
                entry = self.programs[key] = _Entry(key, program, program.jit() if jitted else None)
                entry.used = self.calls
                while len(self.programs) > spec.cache_size:
                    self._forget_routes(self.programs.pop(min(self.programs.values(), key=_last_used).key))
            else:
                entry.used = self.calls
            # On concrete arrays, the jit (it inlines if an outer jit traces); on tracers, _run_in_trace; with a
            # static argument holding a tracer of an enclosing transformation (a function closing over it), the
            # call itself, as for a class whose methods close over one (a jit of its own cannot hold it).
            on_tracers = entry.jitted is None or any(isinstance(leaf, jax.core.Tracer) for leaf in leaves)
            run: Any = functools.partial(_run_in_trace, entry) if on_tracers else entry.on_arrays
            if any(find_tracer(value) for _, value in layout.static):
                run = functools.partial(_run_unjitted, entry)
            route = (entry, pick, run)
            if not routable:
                return route, leaves
            table, (_, shape_key) = path[0][0], path[0]
            shape = table.get(shape_key)
            if shape is None:
                shape = table[shape_key] = _CallShape(nested)
            if nested:
                shape.last = None  # it may hold an inner shape this call replaces
                table, shape_key = shape.routes, path[1][1]
                shape = table.get(shape_key)
                if shape is None:
                    shape = table[shape_key] = _CallShape(False)
                path[1] = (table, shape_key)
            if shape.keyer is None and not shape.routes:  # the leaf types fix which leaves are static
                shape.keyer = _keyer(leaves, tuple(i for i, x in enumerate(leaves) if not is_array(x)))
            statics = () if shape.keyer is None else shape.keyer(leaves)
            shape.add(statics, route)
            entry.routes.append((*path, (shape, statics)))
            if len(entry.routes) > _SHAPES_PER_PROGRAM:
                self._forget_route(entry, entry.routes.pop(0))
        return route, leaves

    def _pick(self, args: tuple, kwargs: dict, layout: Partition, n_leaves: int) -> Callable[[Any], Any] | None:
        """Which of the call's leaves are the program's arrays: binds the call shape once, with stand-ins."""
        where = {}  # argument -> (first leaf, number of leaves) among the call's leaves
        start = 0
        for at, value in (*enumerate(args), *kwargs.items()):
            n = len(jax.tree_util.tree_leaves(value))
            where[at], start = (start, n), start + n
        bound = self.spec.signature.bind(
            tuple(_Argument(i) for i in range(len(args))), {name: _Argument(name) for name in kwargs}
        )
        sources: list[int] = []  # per leaf of the bound values: its index among leaves, then constants
        constants: list = []  # array leaves of defaults
        for value in bound:
            if type(value) is _Argument:
                first, n = where[value.at]
                sources.extend(range(first, first + n))
            else:
                for leaf in jax.tree_util.tree_leaves(value):
                    sources.append(n_leaves + len(constants))
                    constants.append(leaf)
        return _picker([sources[i] for i in layout.dynamic], constants, n_leaves)

    def _forget_routes(self, entry: _Entry) -> None:
        for route in entry.routes:
            self._forget_route(entry, route)
        entry.routes.clear()

    @staticmethod
    def _forget_route(entry: _Entry, path: tuple) -> None:
        """Removes a route (its path of (table, key) pairs), and the shapes it leaves empty."""
        shape, statics = path[-1]
        if (shape.routes[statics] or (None,))[0] is not entry:
            return
        shape.remove(statics)
        for table, key in reversed(path[:-1]):
            shape = table.get(key)
            if shape is None or shape.routes:
                return
            del table[key]

    def info(self) -> CacheInfo:
        with self.lock:
            return CacheInfo(len(self.programs), self.spec.cache_size, self.calls - self.misses, self.misses)


_CACHES: weakref.WeakSet[_Cache] = weakref.WeakSet()  # every Function's, while its class lives


@on_clear
def _clear_function_caches() -> None:
    for cache in list(_CACHES):
        cache.clear()


def _run_in_trace(entry: _Entry, *arrays: Any) -> Any:
    """A call on tracers (or of a ``jit = False`` class)."""
    spec = entry.program.spec
    # JAX may reuse a forward rule traced for reverse mode.
    if spec.jvp is None and _jax_internals.differentiation_of_apply() == "linearize":
        raise no_forward_mode(spec)
    if entry.jitted is None or _jax_internals.is_staging() or _jax_internals.is_batching():
        # Under an outer jit (or scan, checkpoint, ...) the call inlines into
        # the caller's program; jit=False runs op by op. Under vmap, its
        # batching rule batches it.
        return _differentiable(entry.program, arrays)
    if _jax_internals.linearizes_by_jvp_here():  # reverse mode that differentiates a jit by its JVP
        if entry.in_reverse_mode is None:
            entry.in_reverse_mode = entry.program.reverse_jit()
        return entry.in_reverse_mode(*arrays)
    return entry.jitted(*arrays)


def _run_unjitted(entry: _Entry, *arrays: Any) -> Any:
    """A call whose static arguments hold a tracer of an enclosing transformation."""
    if entry.program.spec.jvp is None and _jax_internals.differentiation_of_apply() == "linearize":
        raise no_forward_mode(entry.program.spec)
    return _differentiable(entry.program, arrays)


def _differentiable(program: Program, arrays: tuple) -> Any:
    """The program's call of ``arrays``."""
    return program.differentiable(*map(as_jax_leaf, arrays))


def _reraise(spec: Spec, program: Program, e: Exception, run: Any) -> None:
    """Raises vjpkit's error for a JAX error that it can explain better; returns otherwise."""
    passed_in = getattr(run, "func", None) is _run_unjitted  # a static argument holds an outer tracer
    how = "holds it in a closure passed in" if passed_in or not spec.closes_over_tracer else "closes over it"
    if isinstance(e, UnexpectedTracerError):
        if spec.closes_over_tracer or passed_in:  # JAX's report for a closure over a value it differentiates
            raise closed_over_differentiated(spec, how) from None
        raise _leaked_tracer(spec, e) from None
    if _jax_internals.is_closed_over_differentiated_error(e):
        raise closed_over_differentiated(spec, how) from None
    tracer = _jax_internals.closed_over_tracer_type(e)
    if tracer is not None:
        # A tracer that no argument brought in, which JAX's lowering met as a constant.
        if tracer in ("JVPTracer", "LinearizeTracer"):
            raise closed_over_differentiated(spec, how) from None
        raise TypeError(
            f"{spec.name}'s methods use a value of an enclosing transformation ({tracer}) that is not an "
            f"argument of {spec.name}.apply: {spec.name} {how}. Pass the value as an argument of its own."
        ) from None
    if program.anomaly:  # a failed check, wrapped by JAX in JaxRuntimeError
        _anomaly.reraise_anomaly(e)


def _make_apply(cache: _Cache) -> Callable:
    spec = cache.spec
    shapes = cache.shapes
    active = _anomaly.ACTIVE  # [number of open detect_anomaly blocks, in all threads]
    anomaly_enabled = _anomaly.enabled
    flatten = _flatten
    unseen = _UNSEEN

    def apply(*args: Any, **kwargs: Any) -> Any:
        leaves: Any = (*args, *kwargs.values()) if kwargs else args
        shape = shapes[active[0] and anomaly_enabled()].get((*map(type, leaves), *kwargs), unseen)
        route = shape.route
        if route is None:  # a pytree argument or a static leaf: the route lies deeper (or a new call shape)
            if shape.nested:  # by the pytrees' structure and leaf types
                leaves, treedef = flatten(leaves)
                types = (*map(type, leaves),)
                last = shape.last
                if last is None or last[1] != types or last[0] != treedef:
                    last = shape.last = (treedef, types, shape.routes.get((treedef, *types), unseen))
                shape = last[2]
                route = shape.route
            if route is None and shape.keyer is not None:  # by the static leaves' values
                try:
                    route = shape.routes[shape.keyer(leaves)]
                except Unkeyable:  # the slow path says why
                    pass
        if route is None:
            route, leaves = cache.route(args, kwargs, bool(active[0] and anomaly_enabled()))
            entry, pick, run = route
        else:
            entry, pick, run = route
            cache.calls = entry.used = cache.calls + 1
        try:
            out = run(*(leaves if pick is None else pick(leaves)))
        except Exception as e:
            _reraise(spec, entry.program, e, run)
            raise
        return out.unpack() if type(out) is Packed else out

    apply.__name__ = apply.__qualname__ = f"{spec.name}.apply"
    apply.__doc__ = spec.forward.__doc__
    return apply

