"""Checkers: one compiled checking program per (function, input signature, options), cached.

The checking program is compiled with XLA, with the options a user's
``jax.jit`` gets, so that the verdict is that of the code users run: the
same kernels, the same flushing of subnormals to zero, the same
accumulation order in half precision.
"""

from __future__ import annotations

import collections
import threading
import time
import types
import weakref
from typing import Any, Callable

import jax
from jax.extend.core import jaxpr_as_fun

from .. import _jax_internals
from .._caches import on_clear
from .._tree import static_key
from .jacobian import (
    Notes,
    Numbers,
    Output,
    build_program,
    detached,
    forward_mode_errors,
    on_real_views,
    random_directions,
)
from .leaves import CheckedLeaf, Inputs, input_leaves, signature
from .op_by_op import OpByOp
from .options import Options, Tolerances

_CACHE_SIZE = 64


class Checker:
    """One function checked at one input signature with one set of options.

    It holds no reference to the function (``run`` is given it), so that
    the cache, keyed weakly on the function, lets the function go.
    """

    def __init__(self, split: Inputs, diff: list, options: Options):
        self.options = options
        self.split = split
        self.inputs = input_leaves(split, diff)
        self.outputs: list[CheckedLeaf] = []  # fn's differentiable outputs (known after the first trace)
        # report variant or not -> (program, what its trace recorded): the
        # variants record their summary rows in different orders.
        self._variants: dict[bool, tuple[Callable, Notes]] = {}
        self.forward_unavailable: BaseException | None = None  # why fn has no forward mode
        self.forward_undefined_errors: dict[int, BaseException] = {}  # input alone -> jvp's error
        self.directions: tuple = ()  # fast mode's (us, vs)
        self.rerun = False  # whether to run twice for nondet_tol (decided at the first trace)

    def run(self, fn: Callable, diff: list, fixed: list, tol: Tolerances,
            report: bool = False) -> tuple[Output, Notes]:
        """Runs the program (the report variant: with full Jacobians); its output and its trace's notes."""
        args = (tuple(diff), tuple(fixed), Numbers.of(tol))
        variant = self._variants.get(report)
        if variant is None:
            variant = self._variants[report] = self._trace(fn, args, report)
        program, notes = variant
        return program(*args, self.directions), notes

    def _trace(self, fn: Callable, args: tuple, report: bool) -> tuple[Callable, Notes]:
        if not self._variants:  # the first program: learn what fn supports
            fixed = args[1]
            probe = on_real_views(fn, self.split, self.inputs, Notes())
            if self.options.check_forward_ad:
                each_input = self.options.check_undefined_grad and len(self.inputs) > 1
                unavailable, undefined = forward_mode_errors(probe, self.inputs, fixed, each_input)
                self.forward_unavailable = None if unavailable is None else detached(unavailable)
                self.forward_undefined_errors = {k: detached(e) for k, e in undefined.items()}
            if self.options.fast_mode:
                self.directions = random_directions(probe, self.inputs, fixed)
        options = self.options
        if self.forward_unavailable is not None:
            options = options._replace(check_forward_ad=False)
        notes = Notes()
        evaluate = on_real_views(fn, self.split, self.inputs, notes)
        program = build_program(evaluate, options, notes, report, frozenset(self.forward_undefined_errors))
        jaxpr, out_shape = jax.make_jaxpr(program, return_shape=True)(*args, self.directions)
        if not report:
            self.rerun = jax.default_backend() != "cpu" or _has_host_calls(jaxpr.jaxpr)
        self.outputs = notes.outputs
        notes.detach()
        return TracedCheck(jaxpr, jax.tree.structure(out_shape)), notes


class TracedCheck:
    """One traced checking program: run op by op while that is cheaper, compiled once compiling pays.

    Both ways run the same jaxpr with XLA's kernels, the ones a user's
    program runs. Compiling costs about a millisecond of XLA's CPU compiler
    per equation (more for very long programs), and running op by op costs a
    compile per distinct kernel and then a dispatch per equation. So a
    program with few repeated kernels (most checks) is compiled at once, and
    one that repeats its kernels many times (a Python loop in ``fn``, unrolled
    into thousands of equations) runs op by op, until the time spent so
    reaches the compile's estimated cost (ski rental): a check run once, as
    in a test suite, never pays the compile of a long loop, and one run many
    times is compiled.
    """

    def __init__(self, jaxpr: Any, out_tree: Any):
        self.jaxpr = jaxpr
        self.out_tree = out_tree
        self.compiled: Callable | None = None
        equations, kernels = _equations_and_kernels(jaxpr.jaxpr)
        self.op_by_op = equations >= _REPEATS_FOR_OP_BY_OP * kernels
        self.op_by_op_budget = _compile_seconds(equations)
        self.op_by_op_seconds: float | None = None  # from the second run on
        self.eager = OpByOp(jaxpr)

    def __call__(self, *args: Any) -> Any:
        flat = jax.tree.leaves(args)
        if self.compiled is None and not (self.op_by_op and (self.op_by_op_seconds or 0.0) < self.op_by_op_budget):
            self.compiled = jax.jit(jaxpr_as_fun(self.jaxpr)).lower(*flat).compile()
        if self.compiled is not None:
            out = self.compiled(*flat)
        else:
            start = time.perf_counter()
            out = jax.block_until_ready(self.eager(*flat))
            # The first run also compiles each kernel once; the runs after it are what op by op costs.
            seconds = 0.0 if self.op_by_op_seconds is None else self.op_by_op_seconds + time.perf_counter() - start
            self.op_by_op_seconds = seconds
        return jax.tree.unflatten(self.out_tree, out)


# Measured with benchmarks/gradcheck.py on a 2-core CPU: compiling a whole checking program takes
# about 0.5 s + 2e-6 s x equations^2 (1,556 equations: 3.5 s; 6,000: 73 s), a kernel run op by op
# compiles in about 20 ms; op by op wins once the program repeats its kernels about ten times over.
_REPEATS_FOR_OP_BY_OP = 10


def _compile_seconds(equations: int) -> float:
    return 0.5 + 2e-6 * equations**2


def _equations_and_kernels(jaxpr: Any) -> tuple[int, int]:
    """The number of equations of ``jaxpr`` and of distinct kernels among them (primitive, types, parameters)."""
    kernels = set()
    for e in jaxpr.eqns:
        try:  # sub-jaxprs in parameters compare by identity: printing them would cost more than the trace
            key: Any = (e.primitive, tuple(v.aval for v in e.invars), tuple(sorted(e.params.items())))
            hash(key)
        except TypeError:  # unhashable parameters
            key = (e.primitive, tuple(str(v.aval) for v in e.invars), repr(e.params))
        kernels.add(key)
    return len(jaxpr.eqns), len(kernels)


def _has_host_calls(jaxpr: Any) -> bool:
    """Whether a jaxpr calls back to the host (the only source of nondeterminism on CPU)."""
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if "callback" in name or name == "ffi_call":
            return True
        if any(_has_host_calls(sub) for sub in _sub_jaxprs(eqn)):
            return True
    return False


def _sub_jaxprs(eqn: Any) -> list:
    found = []
    for value in eqn.params.values():
        for sub in value if isinstance(value, (tuple, list)) else (value,):
            sub = getattr(sub, "jaxpr", sub)
            if hasattr(sub, "eqns"):
                found.append(sub)
    return found


class DerivedFunction:
    """A function built from another, ``fn``, whose checkers are cached with ``fn``'s (and dropped with it)."""

    fn: Callable

    def cache_part(self) -> Any:
        """What tells this derived function apart from others derived from the same ``fn``."""
        raise NotImplementedError


class CheckerCache:
    """Checkers (and output structures), per function, dropped with the function.

    Keyed weakly on the function, as Equinox's compile cache is: the values
    never refer to it, so deleting a function frees it and what its closure
    holds. A bound method is keyed on its object; a ``gradgradcheck`` VJP on
    the function it differentiates. Callables that cannot be weakly
    referenced are kept, least recently used dropped first.
    """

    def __init__(self) -> None:
        self.by_owner: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self.strong: collections.OrderedDict = collections.OrderedDict()
        self.lock = threading.Lock()

    def get(self, fn: Callable, key: Any, make: Callable[[], Any]) -> Any:
        owner, part = _owner(fn)
        key = (part, key)
        with self.lock:
            try:
                entries = self.by_owner.get(owner)
                if entries is None:
                    entries = self.by_owner[owner] = collections.OrderedDict()
            except TypeError:  # not weakly referenceable, or unhashable
                entries, key = self.strong, (static_key(owner), key)
            if key in entries:
                entries.move_to_end(key)
                return entries[key]
        value = make()
        with self.lock:
            entries[key] = value
            while len(entries) > _CACHE_SIZE:
                entries.popitem(last=False)
        return value

    def clear(self) -> None:
        with self.lock:
            self.by_owner.clear()
            self.strong.clear()


def _owner(fn: Callable) -> tuple[Any, Any]:
    """The object whose life a cache entry for ``fn`` follows, and what else tells ``fn`` apart."""
    if isinstance(fn, DerivedFunction):
        owner, part = _owner(fn.fn)
        return owner, (fn.cache_part(), part)
    if isinstance(fn, types.MethodType):  # a new object at each attribute access
        return fn.__self__, ("method", static_key(fn.__func__))
    return fn, None


CACHE = CheckerCache()
on_clear(CACHE.clear)


def checker_for(fn: Callable, split: Inputs, diff: list, fixed: list, options: Options) -> Checker:
    """The checker of ``fn`` at these arguments: every part of the key changes the checking program.

    JAX's trace-time configuration (x64, matmul precision, default device,
    ``vjpkit.detect_anomaly``, ...) changes what ``fn`` traces to, as it
    does for ``jax.jit``'s own cache.
    """
    key = ("checker", split.key, signature(diff, fixed), options, _jax_internals.trace_configuration())
    return CACHE.get(fn, key, lambda: Checker(split, diff, options))
