"""Every ported Function whose torch operations all map to JAX runs in ``from_torch(..., mode="trace")``.

The cases are ``FROM_TORCH_CASES`` of each ``test_port_*.py`` module (see
``test_ports_from_torch.py``). A traced original must equal its port and
the same original run through callbacks (``mode="callback"``), in one
jitted program under ``jax.jit(jax.grad)`` (and second order, and
``jax.vmap``, where the case asks), and compile with no host callback. The
originals that cannot be traced are listed with the operation that stops
them; ``mode="auto"`` runs those through callbacks, still equal to the port.
"""

import jax
import numpy as np
import pytest
from test_ports_from_torch import CASES, pytestmark, through_from_torch  # noqa: F401  (its warning filter too)

from vjpkit.testing import assert_port_matches_original

# Originals that read values while tracing, call a Function inside a callable or backward, draw random numbers
# or communicate: the operation named.
UNTRACEABLE = {
    "entmax-TorchSparsemaxFunction-1": r"TorchSparsemaxFunction.forward calls torch.Tensor.__bool__",  # if any()
    "maskrcnn-TorchNewEmptyTensorOp-0": r"TorchNewEmptyTensorOp.backward calls TorchNewEmptyTensorOp.apply",
    "quantizers-TorchFunLSQ-2": r"TorchFunLSQ.forward calls torch.Tensor.__bool__",  # assert alpha > 0
    "softdtw-TorchSoftDTW-0": r"TorchSoftDTW.forward calls torch.Tensor.numpy",
    "deq-torch_deq-0": r"torch_deq calls torch.Tensor.item",  # the solver stops on a residual's .item()
    # A Function inside a callable (its backward would run .backward() and read .grad, out of the trace's reach).
    "checkpoint-torch_checkpointed_block-0": r"torch_checkpointed_block calls CheckpointFunction.apply",
    # The Function inside the callable that hands it the port's noise (a TorchFunctionMode); forward's
    # one_hot, topk and sort, and the noise as a constant, trace.
    "perturbed_topk-torch_perturbed_topk_with_the_ports_noise-0":
        r"torch_perturbed_topk_with_the_ports_noise calls TorchPerturbedTopKFunction.apply",
    # nn.Linear(C, C) built on every call draws its initial weights (then replaced by the arguments); past
    # that, a Function whose backward runs .backward() inside the callable.
    "revtorch-torch_reversible_sequence-0": r"torch_reversible_sequence calls torch.nn.init.uniform_, which draws",
    # torch.distributed's collectives: a process group's communication, no JAX operation on one device.
    "allgather-_AllGather-0": r"_AllGather.forward calls all_gather",
    "megatron-TorchDistCopyToModelParallelRegion-0": r"TorchDistCopyToModelParallelRegion.backward calls all_reduce",
    "megatron-TorchDistReduceFromModelParallelRegion-1":
        r"TorchDistReduceFromModelParallelRegion.forward calls all_reduce",
    "megatron-TorchDistScatterToModelParallelRegion-2":
        r"TorchDistScatterToModelParallelRegion.backward calls all_gather",
    "megatron-TorchDistGatherFromModelParallelRegion-3":
        r"TorchDistGatherFromModelParallelRegion.forward calls all_gather",
}
TRACED = [c for c in CASES if c.id not in UNTRACEABLE]
REFUSED = [pytest.param(*c.values, c.id, id=c.id) for c in CASES if c.id in UNTRACEABLE]


def check(port, original, case, vmap=False):
    args = case.get("vmap_args", case["args"]) if vmap else case["args"]
    assert_port_matches_original(port, original, *args, argnums=case.get("argnums"),
                                 second_order=case.get("second_order", False) and not vmap,
                                 in_axes=case["in_axes"] if vmap else None, atol=case.get("atol", 1e-6))


@pytest.mark.parametrize("case", TRACED)
def test_traced_original_matches_port_and_callbacks_under_jit_grad(case, needs):
    traced = through_from_torch(case, "trace")
    check(case["port"], traced, case)
    check(traced, through_from_torch(case), case)  # the original itself, run by callbacks


@pytest.mark.parametrize("case", [c for c in TRACED if "in_axes" in c.values[0]])
def test_traced_original_matches_port_and_callbacks_under_vmap(case, needs):
    traced = through_from_torch(case, "trace")
    check(case["port"], traced, case, vmap=True)
    check(traced, through_from_torch(case), case, vmap=True)


def jaxpr_of_gradient(wrapped, case):
    fn = getattr(wrapped, "apply", wrapped)  # a Function's class, or a callable
    args = case["args"]
    at = [k for k, a in enumerate(args) if isinstance(a, np.ndarray)]
    argnums = case.get("argnums")
    if argnums is None:
        argnums = [k for k in at if np.issubdtype(args[k].dtype, np.inexact)]

    def loss(*xs):
        values = list(args)
        for k, x in zip(at, xs, strict=True):
            values[k] = x
        leaves = jax.tree_util.tree_leaves(fn(*values))
        return sum((leaf.sum() for leaf in leaves if np.issubdtype(leaf.dtype, np.inexact)), 0.0)

    grad = jax.grad(loss, argnums=tuple(at.index(k) for k in argnums)) if argnums else loss
    return str(jax.make_jaxpr(grad)(*[args[k] for k in at]))


@pytest.mark.parametrize("case", TRACED)
def test_traced_original_compiles_without_a_callback(case, needs):
    assert "callback" not in jaxpr_of_gradient(through_from_torch(case, "trace"), case)


@pytest.mark.parametrize(("case", "name"), REFUSED)
def test_untraceable_original_names_the_operation(case, name, needs):
    traced = through_from_torch(case, "trace")
    with pytest.raises(NotImplementedError, match=UNTRACEABLE[name]):
        jaxpr_of_gradient(traced, case)


@pytest.mark.parametrize(("case", "name"), REFUSED)
def test_auto_runs_an_untraceable_original_through_callbacks(case, name, needs):
    auto = through_from_torch(case, "auto")
    assert "callback" in jaxpr_of_gradient(auto, case)
    check(case["port"], auto, case)


def test_every_untraceable_case_exists():
    assert sorted(c.id for c in REFUSED) == sorted(UNTRACEABLE)  # no stale entry
