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
batching.batch_custom_jvp_subtrace (its code: a frame  all             none; a primitive of vjpkit's own
  that traces a custom_jvp's rule for a vmap)                          batches its rules itself (below)
batching.BatchTrace.process_custom_jvp_call (its       all             none; as above
  code: a frame that batches a custom_jvp's function
  and rule together)
experimental.shard_map.ShardMapTrace (eager shard_map  0.4.38 to 0.5   none (JAX without ``jax.shard_map``)
  that refuses a custom_jvp with symbolic zeros)
partial_eval.DynamicJaxprTrace                         all             none
partial_eval.partial_eval_jaxpr_nounits (a rule's      all             none (public before JAX 0.10)
  work on its residuals, split off under linearize)
partial_eval.JaxprTrace, JaxprTracer (reverse mode's   0.4.38 to 0.6   none (and later JAX with
  jvp over partial evaluation, its known values)                       jax_use_direct_linearize off)
partial_eval.JaxprTrace, JaxprTracer (a rule run by    0.7 on          none
  linearize_from_jvp)
ad.JVPTrace, ad.LinearizeTrace (and their methods'    all             none; ``jax.experimental.hijax``
  code: frames that run a rule)                                        (0.10 on), or a primitive of
                                                                       vjpkit's own needs neither (below)
ad.LinearizeTracer, JVPTracer (vjpkit's linearize)     all             none; JAX makes them for a primitive
                                                                       with a linearization rule (below)
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
api_util.debug_info, save_wrapped_fun_debug_info       0.7 on          none (found by the saver's name)
source_info_util._source_info_context (a named scope)  0.4.38          ``jax.named_scope`` (0.5 on: as
                                                                       cheap)
=====================================================  ==============  ==========================================

The frame walks (``traces.differentiation``, ``vmap_batches_here``,
``custom_jvp_rule_batching``) answer what a ``custom_jvp`` rule is never
told: which differentiation, or which vmap, runs it. Three routes were
measured (``benchmarks/results/``). ``jax.custom_vjp(symbolic_zeros=True)``
for classes with only ``backward`` gives first order alone: a second
derivative then differentiates forward's code, not the Function's rules, a
staged call differentiated later brings back the stale residuals of
jax#16614, and every walk is still reached on the other paths.
``jax.experimental.hijax``'s class-based primitive (``VJPHiPrimitive`` in
0.10, ``HiPrim`` in 0.12) is told by which rule JAX calls; a probe passed
first and second order, vmap against a loop, scan, cond, checkpoint (its
tangent a second, linear primitive whose transpose runs ``backward``) and
export on 0.10.2 and 0.12, but JAX before 0.10 has none, and its names and
signatures changed between 0.10 and 0.12. A primitive of vjpkit's own in
place of the ``custom_jvp`` (``jax.extend.core.Primitive`` and the rule
tables of ``jax.interpreters.ad``, ``batching`` and ``mlir``) passed the
same checks on the newest release of every JAX minor from 0.4.38 to 0.12,
with no frame walk and no tracer made by hand: its JVP rule returns the output tangent as a linear
primitive that runs ``jvp`` where JAX evaluates it and ``backward`` where
JAX transposes it, so no rule asks which differentiation runs, and a vmap
batches the call by the call's own rule, never its rule apart from its
function. Its optimized HLO is ``custom_vjp``'s; tracing is 1.2x
``custom_vjp`` through JAX's generic linearization, 0.78x with a
linearization rule of its own (``ad.primitive_linearizations``, JAX 0.7 on).
That is the route for the core; what it must still carry over is listed in
``benchmarks/results/primitive_probe.md``.

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
differentiation runs a rule, reverse mode's linearization, where a trace
stands), ``programs`` (effects, jit, JAX's caches, configuration states,
a jaxpr split by what is known)
and ``apis`` (sharding types, the FFI, JAX's error messages). The rest of
vjpkit imports their names from here.
"""

from __future__ import annotations

from ._lookup import JAX_RELEASE, NEWEST_TESTED_JAX, Primitive, ShapedArray, ad, batching, mlir, partial_eval
from .apis import (
    ShardingApi,
    buffer_callback_api,
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
    save_debug_info,
    save_rule_debug_info,
    split_known,
    thread_local_flag,
    trace_configuration,
)
from .traces import (
    JVP_AFTER_GRAD_KEEPS_ORDERED_EFFECTS,
    LINEARIZE_IS_TOLD_FROM_VJP,
    custom_jvp_rule_batching,
    differentiating_here,
    differentiation,
    is_batching,
    is_staging,
    linearize_inputs,
    linearized_output,
    on_primal_trace,
    on_trace,
    reaches_eager_shard_map_refusing_symbolic_zeros,
    reverse_linearize_trace,
    vmap_batches_here,
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
    "JVP_AFTER_GRAD_KEEPS_ORDERED_EFFECTS", "LINEARIZE_IS_TOLD_FROM_VJP", "NEWEST_TESTED_JAX", "PARAMETERS_HELD_WEAKLY",
    "Primitive",
    "ShapedArray", "ShardingApi", "ad", "batch_example", "batched_aval", "batching", "buffer_callback_api",
    "cast_to_varying", "closed_over_tracer_type", "custom_jvp_rule_batching", "differentiating_here",
    "differentiation", "eager_kernel", "effects_barrier", "enable_x64", "example_aval", "ffi_api",
    "hold_weakly_in_caches", "is_batching",
    "is_closed_over_differentiated_error", "is_staging", "linearize_inputs", "linearized_output", "mlir",
    "named_scope",
    "on_primal_trace", "on_trace", "ordered_effects_without_tokens", "partial_eval",
    "reaches_eager_shard_map_refusing_symbolic_zeros", "reverse_linearize_trace", "save_debug_info",
    "save_rule_debug_info", "sharding_api", "split_known", "symbolic_zero_like", "tangent_aval", "thread_local_flag",
    "trace_configuration", "typeof", "varying_axes", "varying_axes_of_type", "vmap_axis_names",
    "vmap_batches_here",
]
