"""Anomaly detection: ``vjpkit.detect_anomaly()``, as ``torch.autograd.detect_anomaly``.

For example:

```python
with vjpkit.detect_anomaly():
    grads = jax.grad(loss)(params)   # or a jitted train step
# FloatingPointError: Exp.backward returned nan in gradient 0 (input 'x'):
# 1 of 3 elements (the first at index (1,)). ...
```

Inside the block, every vjpkit Function checks what its own methods produce
(forward's outputs, backward's gradients, jvp's tangents) for NaN and Inf,
and the first bad value raises ``FloatingPointError`` naming the class, the
method and the position. JAX's ``jax_debug_nans`` cannot do this: it sees
primitives, not the user's class.

The key differences to ``torch.autograd.detect_anomaly`` are:

- The checks are traced into the program (``jax.debug.callback`` on three
  scalars per array), so they work under ``jax.jit``, ``vmap``, ``scan``
  and every other transformation.
- Where the error is raised: outside any compiled program, inside the block
  a Function runs op by op (as with ``jit=False``: its methods run on every
  call), so the check runs as the call (or the backward pass of an eager
  ``jax.grad`` or ``jax.vjp`` pullback) runs, and that call raises
  ``FloatingPointError``, as in PyTorch; code inside the block can catch it. Inside a compiled program
  (a function under ``jax.jit``, a ``lax.scan`` body) the check runs on
  XLA's threads, and JAX reports it as ``jax.errors.JaxRuntimeError`` (a
  ``RuntimeError`` with vjpkit's message in its text) where the program's
  result is awaited: at the compiled call on the CPU; on a GPU, which runs
  programs asynchronously, where a result is read (``block_until_ready``,
  ``float``, printing), if anywhere. Leaving the block waits for the
  programs started in it (``jax.effects_barrier``) and raises the check's
  ``FloatingPointError`` on every backend (where a program ran
  asynchronously, also if code inside the block caught the runtime's error:
  the block cannot tell): the check hands vjpkit its exception itself,
  beside the runtime's error, whose text differs by backend.
- In a sharded program the counts are global (the index is into the whole
  array) and the check runs on every device, so every process of a
  multi-process run raises the same error (on JAX 0.4.38, whose debug
  callbacks run on device 0 only, just process 0 raises). There a
  Function's top-level calls stay jitted (a check outside a program sees
  only this process's data), so they report as inside ``jax.jit``.
- The mode is thread-local and part of JAX's compile-cache key: a function
  that ``jax.jit`` compiled outside the block is traced again inside it (with
  the checks), and the program compiled outside is reused after it.
- Off, it costs nothing: vjpkit traces exactly the program it traces without
  this module (``tests/test_anomaly.py`` compares the HLO).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from typing import Any, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from . import _callback_errors, _jax_internals, _sharding
from ._site import see_catalogue
from ._tree import Partition

# Thread-local, and in JAX's jit and trace cache keys (see _jax_internals).
FLAG = _jax_internals.thread_local_flag("vjpkit_detect_anomaly")

# How many detect_anomaly blocks are open, in all threads: apply's fast path
# reads this one list item (cheaper than FLAG.value) and, while it is not 0,
# leaves the call to the slow path, which reads FLAG.
ACTIVE = [0]
_ACTIVE_LOCK = threading.Lock()


def enabled() -> bool:
    """Whether this thread is inside ``detect_anomaly``."""
    return FLAG.value is True


@contextlib.contextmanager
def detect_anomaly() -> Iterator[None]:
    """Checks every vjpkit Function's outputs, gradients and tangents for NaN/Inf.

    The first NaN or Inf that a Function's ``forward``, ``backward`` or
    ``jvp`` returns raises ``FloatingPointError``, e.g.
    ``Exp.backward returned nan in gradient 0 (input 'x'): ...``, from the
    call that produced it, also when the Function runs inside ``jax.jit``
    (there JAX raises ``jax.errors.JaxRuntimeError`` where the program's
    result is awaited: at the jitted call on the CPU, when a result is read
    on a GPU, which runs programs asynchronously; the block waits for the
    programs it started as it exits, and raises the check's
    ``FloatingPointError``). Use it to find the Function that
    produced a NaN, then switch it off: the checks copy three scalars per
    array to the host on every call, and outside ``jax.jit`` Functions run
    op by op.

    Also a decorator (``@vjpkit.detect_anomaly()``). The mode is
    thread-local; code that ``jax.jit`` compiled outside the block is traced
    again inside it, so that its Functions are checked. Under ``jax.vmap``
    the host check runs once per batch element (JAX unrolls callbacks).

    Examples:
        >>> import jax
        >>> import jax.numpy as jnp
        >>> import vjpkit
        >>> class Sqrt(vjpkit.Function):
        ...     @staticmethod
        ...     def forward(ctx, x):
        ...         y = jnp.sqrt(x)
        ...         ctx.save_for_backward(y)
        ...         return y
        ...
        ...     @staticmethod
        ...     def backward(ctx, g):
        ...         (y,) = ctx.saved_tensors
        ...         return g / (2 * y)
        >>> x = jnp.array([4.0, 0.0])
        >>> jax.grad(lambda x: Sqrt.apply(x).sum())(x).tolist()  # unchecked
        [0.25, inf]
        >>> with vjpkit.detect_anomaly():
        ...     jax.grad(lambda x: Sqrt.apply(x).sum())(x)
        Traceback (most recent call last):
        ...
        FloatingPointError: Sqrt.backward returned inf in gradient 0 (input 'x'):
        1 inf of 2 elements (the first at index (1,)). Found by
        vjpkit.detect_anomaly; look for a division by zero, a log or sqrt at 0,
        or an overflow in Sqrt.backward, or NaN/Inf in the incoming gradient.
        See https://vjpkit.github.io/vjpkit/errors/#nan-in-backward
    """
    _quiet_jax_callback_log()
    with _ACTIVE_LOCK:
        ACTIVE[0] += 1
    previous = FLAG.swap_local(True)
    starts = _starts()
    start = _callback_errors.mark()
    starts.append(start)
    try:
        yield
    except Exception as e:
        failure = failed_check(e, start)
        if failure is None:
            raise  # not a failed check; or the check's own error, raised outside a program
        raise _deliver(failure) from None
    else:
        # A check that failed in a compiled program reached this thread only if code
        # here awaited the program's results, and may not have run yet: wait for the
        # programs. Where one failed (the barrier raises its error), report the check
        # whichever thread ran it: a GPU may run a program's callbacks on the calling
        # thread and report the failure only where the result is awaited. Otherwise
        # only a check run on another thread is undelivered: one that failed in a
        # program on this thread failed the call that ran it. (A check run op by op
        # is never carried: it raised to its caller as itself.)
        # Other errors of those programs are theirs, raised where their results are awaited.
        try:
            _jax_internals.effects_barrier()
            program_failed = False
        except Exception:  # noqa: BLE001 - see above
            program_failed = True
        failures = _undelivered(start, off_thread=None if program_failed else threading.get_ident())
        if failures:
            raise _deliver(failures[-1]) from None
    finally:
        starts.pop()
        FLAG.set_local(previous)
        with _ACTIVE_LOCK:
            ACTIVE[0] -= 1


# ---------------------------------------------------------------------------
# The checks, traced into the program.


def input_labels(names: Sequence[str], layout: Partition) -> list[str]:
    """"gradient i (input 'name')" for each array leaf, in the order backward's checked gradients come."""
    owners = layout.owners()
    param_treedefs = layout.treedef.children()
    labels = []
    for k in layout.dynamic:
        i, j = owners[k]
        at = f" at leaf {j}" if param_treedefs[i].num_leaves > 1 else ""
        labels.append(f"gradient {i} (input {names[i]!r}{at})")
    return labels


def check_finite(owner: str, method: str, labelled: Sequence[tuple[str, Any]]) -> None:
    """Traces a check that each array is finite; raises FloatingPointError when one is not.

    ``labelled`` holds ``(where, array_or_None)`` pairs; ``None``, integer
    and empty arrays are skipped. Each array is reduced on the device to its
    NaN count, Inf count and first bad index, and one ``jax.debug.callback``
    per call compares them on the host of every device (a callback has
    effects, so neither jit nor DCE drops it).
    """
    wheres, stats = [], []
    for where, x in labelled:
        if x is None or not jnp.issubdtype(x.dtype, jnp.inexact) or x.size == 0:
            continue
        finite = jnp.isfinite(x)
        wheres.append((where, tuple(x.shape)))
        stats.append((
            jnp.sum(jnp.isnan(x), dtype=jnp.int32),
            jnp.sum(jnp.isinf(x), dtype=jnp.int32),
            jnp.argmin(finite.ravel()).astype(jnp.int32),
        ))
    if not stats:
        return
    report = _Report(owner, method, tuple(wheres))
    leaves = jax.tree.leaves(stats)
    if not any(isinstance(s, jax.core.Tracer) for s in leaves) and all(s.is_fully_addressable for s in leaves):
        # Op by op: the check runs here, and its error reaches this very caller as itself. (Arrays spread over
        # several processes take the callback below, which runs in every process.)
        report(stats, op_by_op=True)
        return
    # On every device: in a multi-process run every process must raise.
    jax.debug.callback(report, stats, **_sharding.debug_callback_everywhere())


class _Report:
    """The host side of ``check_finite``: raises on the first bad array."""

    def __init__(self, owner: str, method: str, wheres: tuple):
        self.owner, self.method, self.wheres = owner, method, wheres

    def __call__(self, stats: Sequence[tuple], op_by_op: bool = False) -> None:
        """``op_by_op``: called by the check itself, not by a program's callback: its error is not carried."""
        for (where, shape), (n_nan, n_inf, first) in zip(self.wheres, stats, strict=True):
            n_nan, n_inf = int(n_nan), int(n_inf)
            if n_nan or n_inf:
                error = FloatingPointError(anomaly_message(self.owner, self.method, where, shape, n_nan, n_inf,
                                                           int(first)))
                if not op_by_op:  # raised inside a program: the caller gets the runtime's error, and this beside it
                    _callback_errors.carry(error, _SOURCE)
                raise error


def anomaly_message(owner: str, method: str, where: str, shape: tuple, n_nan: int, n_inf: int, first: int) -> str:
    kind = "nan" if n_nan else "inf"
    size = int(np.prod(shape))
    index = tuple(int(i) for i in np.unravel_index(first, shape)) if shape else ()
    counts = " and ".join(
        f"{n} {k}" for n, k in ((n_nan, "nan"), (n_inf, "inf")) if n
    )
    cause = {
        "forward": f"look for a log, sqrt, division or overflow in {owner}.forward, or NaN/Inf already in its inputs",
        "backward": f"look for a division by zero, a log or sqrt at 0, or an overflow in {owner}.backward, "
        "or NaN/Inf in the incoming gradient",
        "jvp": f"look for a division by zero, a log or sqrt at 0, or an overflow in {owner}.jvp, "
        "or NaN/Inf in the incoming tangents",
    }.get(method, f"look at {owner}.{method}")
    return (
        f"{owner}.{method} returned {kind} in {where}: {counts} of {size} "
        f"element{'s' if size != 1 else ''} (the first at index {index}). "
        f"Found by vjpkit.detect_anomaly; {cause}. {see_catalogue('nan-in-backward')}"
    )


# ---------------------------------------------------------------------------
# Getting the message back to the caller: the check's exception is carried
# beside the runtime's error (_callback_errors), never read out of its text.

_DELIVERED: list = []  # compiled checks' errors a block has raised (by identity; the newest few)
_SOURCE = "anomaly"
_BLOCKS = threading.local()  # .starts: this thread's open blocks, each as its _callback_errors.mark()


def _starts() -> list:
    starts = getattr(_BLOCKS, "starts", None)
    if starts is None:
        starts = _BLOCKS.starts = []
    return starts


def failed_check(error: BaseException, start: int | None = None) -> FloatingPointError | None:
    """The check's own ``FloatingPointError`` behind ``error``, a runtime error of a program; None if none.

    ``start``: where to look from (the innermost open block's start by default).
    A program's failed check reaches the caller as the runtime's error (its
    text differs by backend). A failed check stops its program (and the
    programs that take its results), so the newest check that failed since
    the block began is the cause.
    """
    if not isinstance(error, jax.errors.JaxRuntimeError):
        return None
    if start is None:
        starts = _starts()
        start = starts[-1] if starts else 0
    failures = _undelivered(start)
    return failures[-1] if failures else None


def _undelivered(start: int, off_thread: int | None = None) -> list:
    """The checks' errors carried after ``start`` (raised off ``off_thread``) that no block has raised yet."""
    carried = _callback_errors.carried_since(start, _SOURCE, off_thread)
    return [e for e in carried if not any(e is d for d in _DELIVERED)]


def _deliver(failure: BaseException) -> BaseException:
    _DELIVERED.append(failure)
    del _DELIVERED[:-64]
    return failure


def reraise_anomaly(error: BaseException) -> None:
    """Raises the check's ``FloatingPointError`` if ``error`` is a runtime error from a failed check."""
    failure = failed_check(error)
    if failure is not None:
        raise _deliver(failure) from None


class _DropAnomalyLogs(logging.Filter):
    """JAX logs every failing debug callback with a traceback; ours are raised anyway."""

    def filter(self, record: logging.LogRecord) -> bool:
        e = record.exc_info[1] if record.exc_info else None
        return not (e is not None and _callback_errors.is_carried(e, _SOURCE))


_LOG_FILTER = _DropAnomalyLogs()


def _quiet_jax_callback_log() -> None:
    logger = logging.getLogger("jax._src.debugging")
    if _LOG_FILTER not in logger.filters:
        logger.addFilter(_LOG_FILTER)
