"""Running a traced checking program op by op, each equation on the XLA kernel JAX's eager mode runs it with.

JAX outside ``jit`` runs a primitive by compiling ``jax.jit`` of that one
primitive (``xla_primitive_callable``), once per primitive, parameters and
operand types, and then dispatching to it (about 70 us an equation).
``jaxpr_as_fun`` runs a traced program so: it compiles each distinct kernel
in turn, on the calling thread, when the run first reaches it.

`OpByOp` runs the same kernels, the very ``jax.jit`` objects eager mode
uses, lowered for each equation's operand types (under the equation's own
context, as eager mode lowers them), but compiles them up front on a pool of
threads (XLA's compiler releases the GIL, so kernels compile side by side on
the machine's cores while the run starts), and calls the compiled kernels
directly (a few microseconds each). Equations that eager mode does not run as
one kernel (a call into a ``jit``, a custom derivative's call, a primitive
with an implementation of its own, or one with effects) are bound, as
``jaxpr_as_fun`` binds them.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
from typing import Any, Callable

import jax
from jax.extend.core import Literal

from .. import _jax_internals


class OpByOp:
    """A closed jaxpr run op by op; its kernels are compiled on the first run."""

    def __init__(self, closed_jaxpr: Any):
        self.closed_jaxpr = closed_jaxpr
        self.kernels: list[Callable | None] | None = None  # per equation: its compiled kernel, or None to bind it
        jaxpr = closed_jaxpr.jaxpr
        last: dict[Any, int] = {}
        for i, eqn in enumerate(jaxpr.eqns):
            for v in eqn.invars:
                if not isinstance(v, Literal):
                    last[v] = i
        for v in jaxpr.outvars:
            if not isinstance(v, Literal):
                last[v] = len(jaxpr.eqns)
        # What is dead after each equation (read for the last time, or never), so that a run holds
        # only live values.
        self.dead_after: list[list] = [[] for _ in jaxpr.eqns]
        for i, eqn in enumerate(jaxpr.eqns):
            for v in eqn.outvars:
                last.setdefault(v, i)
        for v, i in last.items():
            if i < len(jaxpr.eqns):
                self.dead_after[i].append(v)

    def __call__(self, *args: Any) -> list:
        # As jaxpr_as_fun: a NaN check would rerun each kernel and would stop at ops meant to make NaNs.
        with jax.debug_nans(False):
            if self.kernels is not None:
                return self._run(args, self.kernels)
            with concurrent.futures.ThreadPoolExecutor(_workers(), thread_name_prefix="vjpkit-compile") as pool:
                try:
                    futures = _submit_compiles(self.closed_jaxpr.jaxpr, pool)
                    out = self._run(args, futures)
                finally:
                    pool.shutdown(wait=True, cancel_futures=True)
            self.kernels = [None if f is None else f.result() for f in futures]
            return out

    def _run(self, args: tuple, kernels: list) -> list:
        jaxpr = self.closed_jaxpr.jaxpr
        env: dict[Any, Any] = {}

        def read(v: Any) -> Any:
            return v.val if isinstance(v, Literal) else env[v]

        env.update(zip(jaxpr.constvars, self.closed_jaxpr.consts, strict=True))
        env.update(zip(jaxpr.invars, args, strict=True))
        for eqn, kernel, dead in zip(jaxpr.eqns, kernels, self.dead_after, strict=True):
            ins = [read(v) for v in eqn.invars]
            if kernel is None:
                with _context(eqn):
                    out = _bind(eqn, ins)
            else:
                if isinstance(kernel, concurrent.futures.Future):
                    kernel = kernel.result()
                out = kernel(*ins)
            if not eqn.primitive.multiple_results:
                out = [out]
            env.update(zip(eqn.outvars, out, strict=True))
            for v in dead:
                del env[v]
        return [read(v) for v in jaxpr.outvars]


def _workers() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


def _context(eqn: Any) -> Any:
    """The equation's own context (as traced), which eager mode runs and lowers it under."""
    ctx = getattr(eqn, "ctx", None)
    return contextlib.nullcontext() if ctx is None else ctx.manager


def _bind(eqn: Any, ins: list) -> Any:
    """``eqn``'s primitive bound to ``ins``, as ``eval_jaxpr`` binds it (sub-functions first in older JAX)."""
    params = eqn.primitive.get_bind_params(eqn.params)
    if isinstance(params, tuple):  # older JAX: (subfuns, params)
        subfuns, params = params
        return eqn.primitive.bind(*subfuns, *ins, **params)
    return eqn.primitive.bind(*ins, **params)


def _submit_compiles(jaxpr: Any, pool: concurrent.futures.Executor) -> list:
    """Per equation, a future of its compiled kernel (one per distinct kernel), or None to bind it.

    Each kernel is lowered here, in equation order, and compiled on ``pool``.
    """
    compiles: dict[Any, concurrent.futures.Future | None] = {}
    futures: list[concurrent.futures.Future | None] = []
    for eqn in jaxpr.eqns:
        key = _kernel_key(eqn)
        if key is not None and key not in compiles:
            with _context(eqn):
                kernel = _jax_internals.eager_kernel(eqn.primitive, eqn.params)
                if kernel is None:
                    compiles[key] = None
                else:
                    try:
                        compiles[key] = pool.submit(kernel.lower(*(_argument_type(v.aval) for v in eqn.invars)).compile)
                    except Exception as e:  # raised when the run reaches the equation, as eager mode raises it
                        compiles[key] = failed = concurrent.futures.Future[Any]()
                        failed.set_exception(e)
        futures.append(None if key is None else compiles[key])
    return futures


def _kernel_key(eqn: Any) -> Any:
    """What tells one kernel from another (primitive, parameters, operand types, context), or None
    for an equation that is not run as one kernel."""
    if eqn.effects or not all(isinstance(v.aval, jax.core.ShapedArray) for v in eqn.invars):
        return None
    try:
        key = (eqn.primitive, tuple(v.aval for v in eqn.invars), tuple(sorted(eqn.params.items())),
               getattr(eqn, "ctx", None))
        hash(key)
    except TypeError:  # parameters eager mode could not cache either
        return None
    return key


def _argument_type(aval: Any) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(aval.shape, aval.dtype, weak_type=aval.weak_type)
