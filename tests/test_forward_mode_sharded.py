"""Functions with ``jvp`` inside ``jax.shard_map`` match autodiff of the same math.

shard_map types each array by the mesh axes it varies along (``check_vma``,
on by default); a tangent or cotangent must have its primal's type. The
device count is fixed when JAX starts and this pytest process has one CPU
device, so `scripts/sharded_forward_mode_script.py` runs once in a subprocess with
4 host devices; each test below checks one of its cases.
"""

import jax
import pytest
from script_cases import script_case_tests

TRANSFORMS = [
    "jvp_of_shard_map",
    "jit_jvp_of_shard_map",
    "jvp_inside_shard_map",
    "grad_of_shard_map",  # the replicated parameter's gradient is summed over devices
    "jit_grad_of_shard_map",
    "grad_inside_shard_map",
    "jacfwd_of_shard_map",
]
CASES = [f"{cls}:{t}" for cls in ("ScaledSin", "ScaledSinJvpOnly") for t in TRANSFORMS]

pytestmark = pytest.mark.skipif(
    not (hasattr(jax.lax, "pcast") or hasattr(jax.lax, "pvary")),
    reason="this JAX lacks shard_map's varying types (check_vma, from JAX 0.6.1)",
)

results, test_script_runs_every_case, test_function_with_jvp_in_shard_map_matches_autodiff = script_case_tests(
    "sharded_forward_mode_script.py", devices=4, cases=CASES
)
