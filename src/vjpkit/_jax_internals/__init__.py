"""What vjpkit needs from JAX that no public JAX API offers, or that differs between JAX versions.

The only package that imports ``jax._src``, and the only one that knows which
JAX it runs on: vjpkit supports every JAX from 0.4.38 on, and was last tested
with ``NEWEST_TESTED_JAX``. Each name is found by looking for it (not by
comparing version strings), and each branch says which JAX versions take it.
A name vjpkit cannot work without is looked up at import: a JAX that no
longer has it fails ``import vjpkit`` with an ImportError naming it, instead
of an AttributeError deep inside a trace.

Every private name used, by JAX subsystem (versions: those that need it):

=====================================================  ==============  ==========================================
private name                                           JAX versions    public replacement
=====================================================  ==============  ==========================================
core.trace_ctx (the current trace)                     all             none
core.set_current_trace (a rule's forward on its        all             none
  primals' trace)
core.get_aval                                          0.4.38 to 0.5.2 ``jax.typeof`` (0.5.3 on)
core.ShardingTypeError                                 0.5 on          none
core.no_axis_name, core.unmapped_aval                  all             none (vmap batching rules)
core.mapped_aval, batching.batch_jaxpr (which outputs  all             none
  of a rule vary along a vmap)
batching.BatchTrace (is a vmap active)                 all             none
core.EvalTrace (no transformation active: forward      all             none
  runs on concrete arrays)
experimental.shard_map._check_rules, _rewrite_rules,   0.4.38 to 0.5   none (``jax.shard_map``, 0.6 on,
  _check_rep, _no_rewrite (the call's replication                      checks varying types instead)
  rule)
partial_eval.DynamicJaxprTrace                         all             none
partial_eval.partial_eval_jaxpr_nounits (a rule's      all             none (public before JAX 0.10)
  work on its residuals, split off under linearize)
partial_eval.JaxprTrace, JaxprTracer (a JVP rule run  all             none
  to linearize: reverse mode's jvp over partial
  evaluation before 0.7, linearize_from_jvp from 0.7;
  its known values)
ad.JVPTrace, ad.LinearizeTrace (is a differentiation   all             none
  active; ``is_vjp`` in LinearizeTrace's signature
  0.9 on, its ``structured_residuals`` 0.11 on)
ad.primitive_linearizations, fallback_linearize_rule   0.7 on          none (a primitive's
  (the call's linearization rule; a JVP rule told                      linearization rule, and whether
  ``is_vjp``, 0.9 on)                                                  reverse mode runs it)
config.use_direct_linearize                            all             none (read as on where absent)
config.config_ext                                      all             none (``jax.config`` defines no states)
config.trace_context (called: gradcheck's cache key)   all             none
ad.custom_lin_p (its rules wrapped to name a class)    all             none
effects.ordered_effects                                all             none
dispatch.runtime_tokens (its output tokens dropped     all             none
  after a failed effects barrier)
dispatch.apply_primitive, xla_primitive_callable (the  all             none
  kernel eager mode runs a primitive by); pjit.jit_p
  (pjit_p before 0.7)
pjit._pjit_transpose_trace (presence only)             0.4.38 to 0.7   none
util.weakref_cache_key_types                           0.7 on          none
source_info_util._source_info_context (a named scope)  0.4.38          ``jax.named_scope`` (0.5 on: as
                                                                       cheap)
=====================================================  ==============  ==========================================

A Function's call is a primitive of vjpkit's own (``_call.py``), not a
``jax.custom_jvp``: JAX calls a custom_jvp's rule for forward mode,
``jax.linearize`` and reverse mode alike, and batches one staged in a jaxpr
by its function before a derivative batches its rule, so only JAX's call
stack told which (vjpkit once read it, frame by frame). A primitive's rules
are told: the JVP rule runs for forward mode, or under partial evaluation
to linearize; the linearization rule (JAX 0.7 on) gets ``is_vjp`` (0.9 on);
the batching rule batches function and rules together. Two other routes
were measured (``benchmarks/results/``): ``jax.custom_vjp(symbolic_zeros=True)``
gives first order alone (a second derivative then differentiates forward's
code, and a staged call differentiated later brings back jax#16614's stale
residuals), and ``jax.experimental.hijax`` (0.10 on) has no equivalent
before JAX 0.10, and its names changed between 0.10 and 0.12.

Public names whose home or meaning changed: ``jax.enable_x64`` (0.8 on;
``jax.experimental.enable_x64`` before), ``jax.Inline`` (``jit``'s
``inline=True`` inlines only when lowering from 0.11), ``jax.ffi`` (0.5 on;
``jax.extend.ffi`` in 0.4.38), ``jax.lax.pcast`` (0.8 on; ``pvary`` in 0.6
and 0.7), ``jax.sharding.AxisType`` and friends (0.5-0.6 on),
``jax.experimental.buffer_callback`` (0.6 on: ``from_torch`` on the arrays' device),
``jax.experimental.xla_metadata.set_xla_metadata`` (0.4.38 to 0.7: where
``detect_anomaly`` joins the trace caches' key; from 0.8 a state of its
own does).

Its modules, by JAX subsystem: ``_lookup`` (finding names, the modules
looked in), ``values`` (core: types of values, vmap's batched types),
``traces`` (core, partial_eval, ad: the current trace, which
differentiation runs a rule, a primitive's linearization rule, where a
trace stands), ``programs`` (effects, jit, JAX's caches, configuration states,
a jaxpr split by what is known)
and ``apis`` (sharding types, the FFI, JAX's error messages). The rest of
vjpkit imports their names from here.
"""

from __future__ import annotations

from ._lookup import JAX_RELEASE, NEWEST_TESTED_JAX, Primitive, ShapedArray, ad, batching, mlir
from .apis import (
    ShardingApi,
    buffer_callback_api,
    check_replication_by_jaxpr,
    closed_over_tracer_type,
    ffi_api,
    is_closed_over_differentiated_error,
    sharding_api,
)
from .programs import (
    INLINE_INTO_CALLER,
    JAX_KEEPS_TRANSPOSED_JITS,
    PARAMETERS_HELD_WEAKLY,
    eager_kernel,
    effects_barrier,
    enable_x64,
    hold_weakly_in_caches,
    named_scope,
    ordered_effects_without_tokens,
    split_known,
    thread_local_flag,
    trace_configuration,
)
from .traces import (
    LINEARIZE_IS_TOLD_FROM_VJP,
    differentiating_here,
    differentiation_of_apply,
    differentiation_running_rule,
    is_batching,
    is_evaluating,
    is_staging,
    linearize_by_jvp_rule,
    linearizes_by_jvp_here,
    linearizes_directly,
    on_primal_trace,
    register_linearization,
    stages_here,
    tell_jvp_rule_which_differentiation,
)
from .values import (
    HAS_VARYING_TYPES,
    batch_example,
    batched_aval,
    cast_to_varying,
    example_aval,
    symbolic_zero_like,
    tangent_aval,
    typeof,
    varying_axes,
    varying_axes_of_type,
    vmap_axis_names,
)

__all__ = [
    "HAS_VARYING_TYPES", "INLINE_INTO_CALLER", "JAX_KEEPS_TRANSPOSED_JITS", "JAX_RELEASE",
    "LINEARIZE_IS_TOLD_FROM_VJP", "NEWEST_TESTED_JAX", "PARAMETERS_HELD_WEAKLY",
    "Primitive",
    "ShapedArray", "ShardingApi", "ad", "batch_example", "batched_aval", "batching", "buffer_callback_api",
    "cast_to_varying", "check_replication_by_jaxpr", "closed_over_tracer_type", "differentiating_here",
    "differentiation_of_apply", "differentiation_running_rule", "eager_kernel", "effects_barrier", "enable_x64",
    "example_aval", "ffi_api", "hold_weakly_in_caches", "is_batching", "is_evaluating",
    "is_closed_over_differentiated_error", "is_staging", "linearize_by_jvp_rule", "linearizes_by_jvp_here",
    "linearizes_directly", "mlir",
    "named_scope",
    "on_primal_trace", "ordered_effects_without_tokens",
    "register_linearization",
    "sharding_api", "split_known", "stages_here", "symbolic_zero_like", "tangent_aval",
    "tell_jvp_rule_which_differentiation", "thread_local_flag",
    "trace_configuration", "typeof", "varying_axes", "varying_axes_of_type", "vmap_axis_names",
]
