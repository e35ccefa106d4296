"""The only module that reaches into ``jax._src``.

Checked against JAX 0.10.2 (``pyproject.toml`` pins ``jax>=0.10.2,<0.11``).
Each function says which private name it relies on, so that a JAX upgrade
that moves one fails here, loudly, rather than somewhere in a trace.
"""

from __future__ import annotations

import sys

from jax._src import config as _config
from jax._src import core as _core
from jax._src.interpreters import ad as _ad
from jax._src.interpreters import partial_eval as _pe

__all__ = ["is_staging", "called_from_forward_mode"]

_DynamicJaxprTrace = _pe.DynamicJaxprTrace
_JVP_CUSTOM_VJP_CODE = _ad.JVPTrace.process_custom_vjp_call.__code__


def is_staging() -> bool:
    """Whether a staging trace (``jit``, ``scan``, ``checkpoint``, ...) is active.

    Why: calling an inner ``jax.jit`` while an outer one traces leaves a
    nested call in the program (extra HLO instructions); under a staging
    trace vjpkit calls its ``custom_vjp`` directly so it inlines instead.
    Relies on ``core.trace_ctx.trace`` and each trace's ``parent_trace``.
    """
    trace = _core.trace_ctx.trace
    while trace is not None:
        if isinstance(trace, _DynamicJaxprTrace):
            return True
        trace = getattr(trace, "parent_trace", None)
    return False


def called_from_forward_mode(max_depth: int = 32) -> bool:
    """Whether a ``custom_vjp`` forward rule is being run by forward-mode AD.

    Why: JAX runs a ``custom_vjp``'s ``fwd`` both for reverse mode (through
    ``LinearizeTrace``) and for forward mode (through ``JVPTrace``); forward
    mode then fails later with "can't apply forward-mode autodiff (jvp) to a
    custom_vjp function", which cannot name the user's class. Looking for
    ``JVPTrace.process_custom_vjp_call`` among the callers lets vjpkit raise
    its own error while tracing. Only meaningful with
    ``jax_use_direct_linearize`` on (the default), where reverse mode never
    goes through ``JVPTrace``.
    """
    if not _config.use_direct_linearize.value:
        return False
    frame = sys._getframe(1)
    for _ in range(max_depth):
        if frame is None:
            return False
        if frame.f_code is _JVP_CUSTOM_VJP_CODE:
            return True
        frame = frame.f_back
    return False
