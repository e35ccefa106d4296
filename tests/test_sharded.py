"""Sharded `jit` over 8 devices and `jax.shard_map` give the single-device
results.

The device count is fixed when JAX starts, and this pytest process has one
CPU device, so `scripts/sharded_script.py` runs once in a subprocess with
`XLA_FLAGS=--xla_force_host_platform_device_count=8`; each test below checks
one of its cases.
"""

from script_cases import script_case_tests

CASES = [
    "sharded_jit_forward",  # batch split over 8 devices, params replicated
    "sharded_jit_grad",
    "sharded_jit_train_step",
    "sharded_eager_apply",  # apply's own jit on sharded inputs keeps the sharding
    "per_example_grads_sharded",
    "shard_map_forward",
    "shard_map_forward_with_replication_checked",  # check_rep (JAX before 0.6) or check_vma
    "shard_map_grad",  # grad inside shard_map, psum'd loss, replicated params
    "grad_of_shard_map",
    "shard_map_grad_of_sharded_input",
    "shard_map_invariant_gradient_for_sharded_input",
]

results, test_script_runs_every_case, test_sharded_result_matches_single_device = script_case_tests(
    "sharded_script.py", devices=8, cases=CASES
)
