"""Megatron-LM's four tensor-parallel mappings, each built from its two collectives.

Original: NVIDIA/Megatron-LM, megatron/core/tensor_parallel/mappings.py. Each
mapping is an autograd Function whose forward is one collective and whose
backward is that collective's transpose:

    _CopyToModelParallelRegion       identity     all-reduce
    _ReduceFromModelParallelRegion   all-reduce   identity
    _ScatterToModelParallelRegion    split        all-gather
    _GatherFromModelParallelRegion   all-gather   split

Megatron writes the four classes out; here that table builds them, so that
the port (``megatron_port.py``: vjpkit Functions over ``lax`` collectives),
the original with its ranks simulated (``megatron_script.py``) and the
original on a process group (``test_port_megatron.py``) are the same four
classes over different collectives.
"""


def mapping(function_base, name, forward_collective, backward_collective):
    """A ``function_base`` subclass (``torch.autograd.Function`` or ``vjpkit.Function``) named ``name``."""

    class Mapping(function_base):
        @staticmethod
        def forward(ctx, input_):
            return forward_collective(input_)

        @staticmethod
        def backward(ctx, grad_output):
            return backward_collective(grad_output)

    Mapping.__name__ = Mapping.__qualname__ = name
    for rule in (Mapping.forward, Mapping.backward):
        rule.__qualname__ = f"{name}.{rule.__name__}"
    return Mapping


def mappings(function_base, prefix, *, reduce, split, gather, copy=lambda input_: input_):
    """Megatron's four mappings over these collectives, keyed by Megatron's function names.

    ``copy`` is the copy mapping's forward (Megatron's returns its input).
    """
    return {
        "copy_to_model_parallel_region": mapping(function_base, f"{prefix}CopyToModelParallelRegion", copy, reduce),
        "reduce_from_model_parallel_region":
            mapping(function_base, f"{prefix}ReduceFromModelParallelRegion", reduce, lambda grad_output: grad_output),
        "scatter_to_model_parallel_region":
            mapping(function_base, f"{prefix}ScatterToModelParallelRegion", split, gather),
        "gather_from_model_parallel_region":
            mapping(function_base, f"{prefix}GatherFromModelParallelRegion", gather, split),
    }
