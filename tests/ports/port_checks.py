"""Checks every port in tests/ports runs besides ``assert_matches_torch``.

``assert_jit_grad_matches_torch``: ``jax.jit(jax.grad(...))`` of a nonlinear
loss of one output equals PyTorch's gradient of the same loss (the original
is the reference). ``assert_vmap_matches_loop``: ``jax.vmap`` of the port and
of its gradient equals the port applied example by example (each example
being checked against PyTorch elsewhere).
"""

import re
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

# jax.enable_x64 or its older home. Not the x64 fixture: each helper scopes float64 to its own JAX
# side, so the many tests calling it need not ask for it.
from vjpkit._jax_internals import enable_x64


def torch_grad(torch_fn: Any, inputs: Sequence[Any], argnums: Sequence[int], output: int = 0) -> list[np.ndarray]:
    """PyTorch's gradient of ``sum(sin(output))`` with respect to the inputs at ``argnums``."""
    leaves = [
        torch.tensor(np.asarray(v, np.float64), requires_grad=k in argnums)
        if isinstance(v, np.ndarray) and v.dtype.kind == "f" else
        torch.tensor(v) if isinstance(v, np.ndarray) else v
        for k, v in enumerate(inputs)
    ]
    call = getattr(torch_fn, "apply", torch_fn)
    out = call(*[t.clone() if isinstance(t, torch.Tensor) else t for t in leaves])
    y = out[output] if isinstance(out, (tuple, list)) else out
    grads = torch.autograd.grad(y.sin().sum(), [leaves[k] for k in argnums], allow_unused=True)
    return [np.zeros(leaves[k].shape) if g is None else g.detach().numpy()
            for k, g in zip(argnums, grads, strict=True)]


def sin_loss(port: Callable, inputs: Sequence[Any], argnums: Sequence[int], output: int = 0) -> Callable:
    """``sum(sin(port(...)[output]))`` as a function of the inputs at ``argnums``."""
    def loss(*xs: Any) -> Any:
        args = list(inputs)
        for k, x in zip(argnums, xs, strict=True):
            args[k] = x
        out = port(*args)
        return jnp.sum(jnp.sin(out[output] if isinstance(out, (tuple, list)) else out))
    return loss


def assert_jit_grad_matches_torch(torch_fn: Any, port: Any, inputs: Sequence[Any], argnums: Sequence[int] = (0,),
                                  output: int = 0, rtol: float = 1e-7, atol: float = 1e-9) -> None:
    expected = torch_grad(torch_fn, inputs, argnums, output)
    call = getattr(port, "apply", port)
    with enable_x64(True):
        args = [jnp.asarray(v) if isinstance(v, np.ndarray) else v for v in inputs]
        loss = sin_loss(call, args, argnums, output)
        got = jax.jit(jax.grad(loss, argnums=tuple(range(len(argnums)))))(*[args[k] for k in argnums])
    for g, e in zip(got, expected, strict=True):
        np.testing.assert_allclose(np.asarray(g), e, rtol=rtol, atol=atol)


def assert_vmap_matches_loop(port: Any, batched: Sequence[Any], in_axes: Sequence[Any], argnums: Sequence[int] = (0,),
                             output: int = 0, rtol: float = 1e-10, atol: float = 1e-12) -> None:
    """``batched``: the inputs, those with ``in_axes`` 0 carrying a leading batch axis."""
    call = getattr(port, "apply", port)
    n = next(np.shape(v)[0] for v, a in zip(batched, in_axes, strict=True) if a == 0)

    def example(b: int) -> list:
        return [v[b] if a == 0 else v for v, a in zip(batched, in_axes, strict=True)]

    def per_example_grad(*args: Any) -> Any:
        return jax.grad(sin_loss(call, args, argnums, output), argnums=tuple(range(len(argnums))))(
            *[args[k] for k in argnums])

    with enable_x64(True):
        arrays = [jnp.asarray(v) if isinstance(v, np.ndarray) else v for v in batched]
        dynamic = [k for k, v in enumerate(arrays) if isinstance(v, jax.Array)]

        def over_arrays(fn: Callable) -> Callable:
            def wrapped(*xs: Any) -> Any:
                args = list(arrays)
                for k, x in zip(dynamic, xs, strict=True):
                    args[k] = x
                return fn(*args)
            return wrapped

        axes = tuple(in_axes[k] for k in dynamic)
        xs = [arrays[k] for k in dynamic]
        outs = jax.vmap(over_arrays(call), in_axes=axes)(*xs)
        grads = jax.vmap(over_arrays(per_example_grad), in_axes=axes)(*xs)
        for b in range(n):
            args = [jnp.asarray(v) if isinstance(v, np.ndarray) else v for v in example(b)]
            want = call(*args)
            for got_leaf, want_leaf in zip(jax.tree.leaves(outs), jax.tree.leaves(want), strict=True):
                np.testing.assert_allclose(np.asarray(got_leaf[b]), np.asarray(want_leaf), rtol=rtol, atol=atol)
            for got_g, want_g in zip(grads, per_example_grad(*args), strict=True):
                np.testing.assert_allclose(np.asarray(got_g[b]), np.asarray(want_g), rtol=rtol, atol=atol)


# What JAX before 0.6 (``jax.experimental.shard_map``, no ``jax.shard_map``) cannot do with a Function inside
# shard_map, in JAX's own words: the replication check (``check_rep=True``) of a differentiated custom_jvp with
# symbolic zeros (every Function is one).
# JAX before 0.6: jax.experimental.shard_map's replication check has no rule for the primitives a derivative of a
# Function binds (its tie and its tangent's linear_call), and says so.
_OLD_SHARD_MAP_ERROR = re.compile(r"No replication rule for vjpkit_(tie|linear_call)\. .*check_rep=False")


def skip_where_this_jax_lacks_it(error: str | None) -> None:
    """Skips a script check that failed only because this JAX's shard_map lacks a feature (JAX before 0.6)."""
    if error is not None and not hasattr(jax, "shard_map") and _OLD_SHARD_MAP_ERROR.search(error):
        pytest.skip("this JAX lacks the replication check of a differentiated Function in "
                    "jax.experimental.shard_map (JAX 0.6's jax.shard_map has it)")


def assert_script_check_passed(results: dict, name: str) -> None:
    """A 4-device script's check ``name`` passed (skipped where only this JAX's shard_map lacks a feature)."""
    error = results[name]
    skip_where_this_jax_lacks_it(error)
    assert error is None, error
