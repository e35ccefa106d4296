"""Functions where an array's type carries its sharding: inside `shard_map`, and under Explicit mesh axes.

The device count is fixed when JAX starts and this pytest process has one
CPU device, so `scripts/sharding_types_script.py` runs once in a subprocess with
`XLA_FLAGS=--xla_force_host_platform_device_count=4`; each test below
checks one of its cases. A case needing a feature that this JAX lacks
(Explicit axes came after JAX 0.4.38) is skipped, saying so.
"""

from script_cases import script_case_tests

CASES = [
    # host=True Functions inside shard_map equal autodiff (the callback's
    # result varies over the devices like its inputs).
    "host_shard_map_gradient_of_varying_input",
    "host_shard_map_gradient_of_replicated_input",
    "host_grad_inside_shard_map_sums_replicated_gradient",
    "host_shard_map_forward_is_per_device",
    # Explicit mesh axes: a ported backward (g.T @ x over a sharded batch)
    # works unchanged and each gradient has its input's sharding.
    "explicit_backward_contracting_sharded_batch",
    "explicit_backward_without_jit",
    "explicit_backward_of_forward_mode_function",
    "explicit_jvp",
    "explicit_host_function",
    "mixed_mesh_explicit_batch_auto_model",
    "mixed_mesh_auto_batch_explicit_model",
    "explicit_forward_ambiguity_names_the_class",
    "explicit_training_equals_auto",  # the digits model of examples/train_mlp.py
]
# A training run (an epoch of the digits model, under Auto and under Explicit
# axes): two thirds of the script's CPU time. Left out of the script when deselected.
SLOW = ["explicit_training_equals_auto"]

results, test_script_runs_every_case, test_sharding_types_case = script_case_tests(
    "sharding_types_script.py", devices=4, cases=CASES, slow=SLOW
)
