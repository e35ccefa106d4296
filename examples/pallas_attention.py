"""Causal flash attention whose forward and backward are Pallas kernels, inside a vjpkit Function.

    python examples/pallas_attention.py     # checks the kernels against plain attention (interpret mode on CPU)

The PyTorch pattern this replaces: a ``torch.autograd.Function`` whose
forward and backward launch flash attention's CUDA or Triton kernels
(flash-attn's ``FlashAttnFunc``, the Triton tutorial's fused attention). Here
the three kernels are ``pl.pallas_call``s, which Pallas lowers through Triton
on a GPU; on a CPU they run in interpret mode (the kernel body evaluated as
ordinary JAX code, one grid step at a time), so this file runs and is tested
anywhere.

* forward: one program per block of queries (and batch-head). It walks the
  key blocks left of the diagonal with an online softmax, accumulating in
  float32 whatever the input dtype, and writes the output and one
  log-sum-exp per row. Key blocks right of the diagonal are never loaded
  (the loop stops there); only the blocks the diagonal crosses are masked.
* backward, two kernels that recompute the probabilities from q, k and the
  log-sum-exp instead of keeping them: ``dk, dv`` (one program per key
  block, walking the query blocks below the diagonal) and ``dq`` (one
  program per query block, walking the key blocks left of it). Each runs
  only when ``ctx.needs_input_grad`` asks for its outputs.

``FlashAttention`` keeps what PyTorch's flash Functions keep: q, k, v, the
output and the log-sum-exp (float32), O(T) per head, never (T, T).
Its backward is ``@vjpkit.once_differentiable``: a ``pallas_call`` has no
transpose rule, so a second derivative would have nothing to differentiate;
asking for one raises an error naming the Function. (The ``lax.scan``
version in transformer_ops.py is differentiable to any order.)

On a GPU, block sizes are powers of two and the head dimension is padded
with zeros to a power of two of at least 16 (Triton's ``tl.dot`` wants
that); the sequence length must be a multiple of 16 there.
"""

import functools
import inspect
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

import vjpkit

NEG_INF = -1e30  # finite, as in transformer_ops.py: a masked score's exp is 0, never NaN
LOG2E = math.log2(math.e)
SQUEEZED = getattr(pl, "squeezed", None)  # a block dimension the kernel does not see (None before JAX 0.7)

# Tile sizes (rows of queries, rows of keys) per kernel, after the Triton tutorial's fused attention
# for head dimension 64; each is capped by ``block`` and by the sequence length's largest power-of-two divisor.
FORWARD_BLOCKS = (128, 64)
DKDV_BLOCKS = (32, 128)  # one program per 128 keys, walking queries 32 at a time
DQ_BLOCKS = (128, 32)  # one program per 128 queries, walking keys 32 at a time
MIN_GPU_BLOCK = 16  # Triton's tl.dot needs at least 16 rows and columns


def computes_on_a_gpu():
    """Whether JAX computes on a GPU here: the default backend's platform, unless ``jax.default_device``
    pins another device (the CPU, say, on a GPU machine)."""
    pinned = jax.config.jax_default_device  # a Device, a platform name, or None
    return (getattr(pinned, "platform", pinned) or jax.default_backend()) == "gpu"


def interpret_default():
    """Kernels are compiled on GPUs (Triton); anywhere else Pallas interprets them."""
    return not computes_on_a_gpu()


def triton_params(num_warps, num_stages):
    """Triton's compiler parameters, spelt as the installed JAX spells them.

    ``jax.experimental.pallas.triton.CompilerParams`` (JAX 0.7 on),
    ``TritonCompilerParams`` before; imported here, when a kernel is compiled,
    so that interpreting on a CPU never loads Pallas's Triton backend.
    """
    try:
        from jax.experimental.pallas import triton as plgpu
    except ImportError:  # pragma: no cover - JAX before 0.4.36 named it .gpu
        from jax.experimental.pallas import gpu as plgpu
    params = getattr(plgpu, "CompilerParams", None) or getattr(plgpu, "TritonCompilerParams", None)
    if params is None:  # pragma: no cover - older JAX took a dict
        return {"triton": {"num_warps": num_warps, "num_stages": num_stages}}
    return params(num_warps=num_warps, num_stages=num_stages)


def accumulator_dtype(dtype):
    """float32 for 16-bit and 32-bit inputs; float64 stays float64 (interpret mode's gradcheck)."""
    return jnp.promote_types(dtype, jnp.float32)


def dot(a, b, acc, contract=(1, 0)):
    """``a @ b`` (or with ``contract=(1, 1)``, ``a @ b.T``; ``(0, 0)``, ``a.T @ b``), accumulated in ``acc``."""
    return lax.dot_general(a, b, (((contract[0],), (contract[1],)), ((), ())), preferred_element_type=acc)


def div(a, b):
    """``a // b`` of a program id's arithmetic and a Python int (``//`` of a program id does not lower for Triton)."""
    return lax.div(a, jnp.asarray(b, jnp.int32))


def causal_mask(s, row0, col0):
    """``s`` with entries above the diagonal (key after query) set to NEG_INF."""
    rows = row0 + lax.broadcasted_iota(jnp.int32, s.shape, 0)
    cols = col0 + lax.broadcasted_iota(jnp.int32, s.shape, 1)
    return jnp.where(cols <= rows, s, NEG_INF)


# ---------------------------------------------------------------------------
# The kernels. Arrays are (batch * heads, T, D); each program sees one head.
# Scores are kept in base 2 (scaled by log2(e)), so exp is exp2; the saved
# log-sum-exp is in nats, as the lax.scan version's.

def forward_kernel(q_ref, k_ref, v_ref, o_ref, lse_ref, *, scale, block_q, block_k):
    i = pl.program_id(0)
    q = q_ref[...]
    acc = accumulator_dtype(q.dtype)
    qk_scale = scale * LOG2E

    def step(j, carry, masked):
        o, m, denom = carry
        keys = pl.ds(j * block_k, block_k)
        s = dot(q, k_ref[keys, :], acc, (1, 1)) * qk_scale
        if masked:
            s = causal_mask(s, i * block_q, j * block_k)
        m_new = jnp.maximum(m, s.max(axis=1))
        p = jnp.exp2(s - m_new[:, None])
        rescale = jnp.exp2(m - m_new)
        v = v_ref[keys, :]
        o = o * rescale[:, None] + dot(p.astype(v.dtype), v, acc)
        return o, m_new, denom * rescale + p.sum(axis=1)

    carry = (jnp.zeros(q.shape, acc), jnp.full((block_q,), NEG_INF, acc), jnp.zeros((block_q,), acc))
    # Key blocks wholly left of this query block need no mask; those the diagonal crosses do;
    # those wholly right of it are skipped.
    unmasked = div(i * block_q, block_k)
    end = div((i + 1) * block_q + block_k - 1, block_k)
    carry = lax.fori_loop(0, unmasked, functools.partial(step, masked=False), carry)
    o, m, denom = lax.fori_loop(unmasked, end, functools.partial(step, masked=True), carry)
    o_ref[...] = (o / denom[:, None]).astype(o_ref.dtype)
    lse_ref[...] = ((m + jnp.log2(denom)) / LOG2E).astype(lse_ref.dtype)


def dkdv_kernel(q_ref, k_ref, v_ref, g_ref, lse_ref, delta_ref, dk_ref, dv_ref, *, scale, block_q, block_k, t):
    j = pl.program_id(0)
    k, v = k_ref[...], v_ref[...]
    acc = accumulator_dtype(k.dtype)
    qk_scale = scale * LOG2E

    def step(i, carry, masked):
        dk, dv = carry
        rows = pl.ds(i * block_q, block_q)
        q, g = q_ref[rows, :], g_ref[rows, :]
        s = dot(q, k, acc, (1, 1)) * qk_scale
        if masked:
            s = causal_mask(s, i * block_q, j * block_k)
        p = jnp.exp2(s - lse_ref[rows][:, None] * LOG2E)  # the probabilities, recomputed
        dv = dv + dot(p.astype(g.dtype), g, acc, (0, 0))
        ds = p * (dot(g, v, acc, (1, 1)) - delta_ref[rows][:, None]) * scale
        dk = dk + dot(ds.astype(q.dtype), q, acc, (0, 0))
        return dk, dv

    carry = (jnp.zeros(k.shape, acc), jnp.zeros(v.shape, acc))
    # Query blocks wholly above this key block are skipped; those the diagonal crosses are masked.
    first = div(j * block_k, block_q)
    unmasked = jnp.minimum(div((j + 1) * block_k + block_q - 2, block_q), t // block_q)
    carry = lax.fori_loop(first, unmasked, functools.partial(step, masked=True), carry)
    dk, dv = lax.fori_loop(unmasked, t // block_q, functools.partial(step, masked=False), carry)
    dk_ref[...] = dk.astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def dq_kernel(q_ref, k_ref, v_ref, g_ref, lse_ref, delta_ref, dq_ref, *, scale, block_q, block_k):
    i = pl.program_id(0)
    q, g = q_ref[...], g_ref[...]
    acc = accumulator_dtype(q.dtype)
    qk_scale = scale * LOG2E
    lse2, delta = lse_ref[...] * LOG2E, delta_ref[...]

    def step(j, dq, masked):
        keys = pl.ds(j * block_k, block_k)
        k = k_ref[keys, :]
        s = dot(q, k, acc, (1, 1)) * qk_scale
        if masked:
            s = causal_mask(s, i * block_q, j * block_k)
        p = jnp.exp2(s - lse2[:, None])
        ds = p * (dot(g, v_ref[keys, :], acc, (1, 1)) - delta[:, None]) * scale
        return dq + dot(ds.astype(k.dtype), k, acc)

    unmasked = div(i * block_q, block_k)
    end = div((i + 1) * block_q + block_k - 1, block_k)
    dq = lax.fori_loop(0, unmasked, functools.partial(step, masked=False), jnp.zeros(q.shape, acc))
    dq = lax.fori_loop(unmasked, end, functools.partial(step, masked=True), dq)
    dq_ref[...] = dq.astype(dq_ref.dtype)


# ---------------------------------------------------------------------------
# The pallas_calls.

class Plan:
    """Shapes, tile sizes and launch settings for one (T, D, dtype, block, interpret)."""

    def __init__(self, t, d, dtype, block, interpret):
        self.t, self.d, self.interpret = t, d, interpret
        self.scale = 1.0 / math.sqrt(d)
        # Triton wants power-of-two tiles: pad the head dimension with zeros (they change no score).
        self.d_pad = d if interpret else max(MIN_GPU_BLOCK, pl.next_power_of_2(d))
        largest = t & -t  # the largest power of two dividing t: tiles tile the sequence exactly
        if not interpret and largest < MIN_GPU_BLOCK:
            raise ValueError(f"FlashAttention: sequence length {t} is not a multiple of {MIN_GPU_BLOCK}, "
                             f"which the GPU kernels' tiles need; pad the sequence")
        if block is not None and (block <= 0 or block & (block - 1)):
            raise ValueError(f"FlashAttention: block={block} is not a power of two")
        cap = min(largest, block or largest)
        if not interpret and cap < MIN_GPU_BLOCK:
            raise ValueError(f"FlashAttention: block={block} is below {MIN_GPU_BLOCK}, the GPU kernels' "
                             f"smallest tile")

        def tiles(sizes):
            return tuple(min(size, cap) for size in sizes)

        self.forward_blocks, self.dkdv_blocks, self.dq_blocks = map(tiles, (FORWARD_BLOCKS, DKDV_BLOCKS, DQ_BLOCKS))
        wide = self.d_pad > 64 or np.dtype(dtype).itemsize > 2
        self.warps = 8 if wide else 4

    def call(self, kernel, name, grid, in_specs, out_specs, out_shape, stages):
        return pl.pallas_call(
            kernel,
            grid=grid,
            in_specs=in_specs,
            out_specs=out_specs,
            out_shape=out_shape,
            interpret=self.interpret,
            compiler_params=None if self.interpret else triton_params(self.warps, stages),
            name=name,
        )

    def rows(self, block):
        """The block of ``block`` rows (of T) that grid step ``(i, head)`` works on."""
        return pl.BlockSpec((SQUEEZED, block, self.d_pad), lambda i, h: (h, i, 0))

    def row_vector(self, block):
        return pl.BlockSpec((SQUEEZED, block), lambda i, h: (h, i))

    def whole(self):
        """The whole (T, D) of the step's head."""
        return pl.BlockSpec((SQUEEZED, self.t, self.d_pad), lambda i, h: (h, 0, 0))

    def whole_vector(self):
        return pl.BlockSpec((SQUEEZED, self.t), lambda i, h: (h, 0))

    def forward(self, q, k, v):
        """q, k, v (heads, T, D_pad) -> out (heads, T, D_pad), lse (heads, T) in float32 (or float64)."""
        bq, bk = self.forward_blocks
        kernel = functools.partial(forward_kernel, scale=self.scale, block_q=bq, block_k=bk)
        lse_dtype = accumulator_dtype(q.dtype)
        return self.call(
            kernel, "flash_attention_forward", (self.t // bq, q.shape[0]),
            [self.rows(bq), self.whole(), self.whole()],
            [self.rows(bq), self.row_vector(bq)],
            [jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct(q.shape[:2], lse_dtype)],
            stages=3,
        )(q, k, v)

    def dkdv(self, q, k, v, g, lse, delta):
        bq, bk = self.dkdv_blocks
        kernel = functools.partial(dkdv_kernel, scale=self.scale, block_q=bq, block_k=bk, t=self.t)
        return self.call(
            kernel, "flash_attention_dkdv", (self.t // bk, q.shape[0]),
            [self.whole(), self.rows(bk), self.rows(bk), self.whole(), self.whole_vector(), self.whole_vector()],
            [self.rows(bk), self.rows(bk)],
            [jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
            stages=2,
        )(q, k, v, g, lse, delta)

    def dq(self, q, k, v, g, lse, delta):
        bq, bk = self.dq_blocks
        kernel = functools.partial(dq_kernel, scale=self.scale, block_q=bq, block_k=bk)
        return self.call(
            kernel, "flash_attention_dq", (self.t // bq, q.shape[0]),
            [self.rows(bq), self.whole(), self.whole(), self.rows(bq), self.row_vector(bq), self.row_vector(bq)],
            self.rows(bq),
            jax.ShapeDtypeStruct(q.shape, q.dtype),
            stages=2,
        )(q, k, v, g, lse, delta)


def _check(q, k, v):
    if not (q.shape == k.shape == v.shape) or q.ndim < 2:
        raise ValueError(f"FlashAttention: q, k and v must have one shape (..., T, D); got {q.shape}, "
                         f"{k.shape} and {v.shape}")
    if not (q.dtype == k.dtype == v.dtype) or not jnp.issubdtype(q.dtype, jnp.floating):
        raise TypeError(f"FlashAttention: q, k and v must have one floating dtype; got {q.dtype}, "
                        f"{k.dtype} and {v.dtype}")


def _to_heads(x, d_pad):
    """(..., T, D) -> (prod(...), T, D_pad)."""
    x = x.reshape(-1, *x.shape[-2:])
    return x if d_pad == x.shape[-1] else jnp.pad(x, ((0, 0), (0, 0), (0, d_pad - x.shape[-1])))


def _from_heads(x, shape):
    return x[..., :shape[-1]].reshape(shape)


SECOND_ORDER = ("FlashAttention.backward is decorated with @once_differentiable, so it cannot be differentiated "
                "(a second derivative such as jax.hessian or grad of grad was asked for): Pallas kernels have no "
                "derivative of their own. transformer_ops.CausalAttention (lax.scan) has second derivatives.")


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def forward_without_derivative(plan, q, k, v):
    """The forward kernel. Backward's kernels give its first derivative; a second one would differentiate
    the kernel itself (JAX reaches forward before backward's own ``once_differentiable`` guard), so that raises."""
    return plan.forward(q, k, v)


@forward_without_derivative.defjvp
def _forward_jvp(plan, primals, tangents):
    raise RuntimeError(SECOND_ORDER)


class FlashAttention(vjpkit.Function):
    """``softmax(q k^T / sqrt(D) + causal mask) v`` over the last two axes (T, D), as Pallas kernels.

    Leading axes (batch, heads) are batch axes. ``block`` (a static power of
    two, or None) caps every kernel's tile; None keeps the tuned sizes.
    ``interpret`` (static): None interprets the kernels unless the default
    backend is a GPU; False compiles them (for a GPU, or ``jax.export``).
    """

    @staticmethod
    def forward(ctx, q, k, v, block=None, interpret=None):
        _check(q, k, v)
        interpret = interpret_default() if interpret is None else interpret
        plan = Plan(*q.shape[-2:], q.dtype, block, interpret)
        out, lse = forward_without_derivative(plan, *(_to_heads(x, plan.d_pad) for x in (q, k, v)))
        out = _from_heads(out, q.shape)
        ctx.plan = plan
        ctx.save_for_backward(q, k, v, out, lse.reshape(q.shape[:-1]))
        return out

    @staticmethod
    @vjpkit.once_differentiable
    def backward(ctx, g):
        q, k, v, out, lse = ctx.saved_tensors
        plan = ctx.plan
        # rowsum(P * dP) = rowsum(dO * O): one number per row, from the output instead of P.
        acc = accumulator_dtype(q.dtype)
        delta = (g.astype(acc) * out.astype(acc)).sum(-1).reshape(-1, plan.t)
        lse = lse.reshape(-1, plan.t)
        q_, k_, v_, g_ = (_to_heads(x, plan.d_pad) for x in (q, k, v, g.astype(q.dtype)))
        dq = dk = dv = None
        if ctx.needs_input_grad[0]:
            dq = _from_heads(plan.dq(q_, k_, v_, g_, lse, delta), q.shape)
        if ctx.needs_input_grad[1] or ctx.needs_input_grad[2]:
            dk, dv = (_from_heads(x, q.shape) for x in plan.dkdv(q_, k_, v_, g_, lse, delta))
            dk = dk if ctx.needs_input_grad[1] else None
            dv = dv if ctx.needs_input_grad[2] else None
        return dq, dk, dv, None, None


def flash_attention(q, k, v, block=None, interpret=None):
    """``FlashAttention.apply``, with ``interpret=None`` resolved here: a static argument, so part of its cache key."""
    return FlashAttention.apply(q, k, v, block, interpret_default() if interpret is None else interpret)


# The custom calls Pallas's Triton lowering emits: the Triton IR (JAX 0.10 and before) or the compiled kernel.
TRITON_CALL_TARGETS = ("__gpu$xla.gpu.triton", "triton_kernel_call_ffi")
EXPORT_GPU = "NVIDIA H100"  # the GPU a CPU-only export compiles for (Hopper, compute capability 9.0)


def export_for_cuda(fn, *shapes):
    """``jax.export`` of ``jax.jit(fn)`` at ``shapes`` for CUDA, on any machine: the kernels lower without a GPU.

    Triton kernels are custom calls without JAX's compatibility guarantee, so
    their check is disabled. From JAX 0.11 the lowering asks the device for
    its compute capability; without a GPU an abstract mesh names one
    (``EXPORT_GPU``).
    """
    from jax import export

    checks = [export.DisabledSafetyCheck.custom_call(name) for name in TRITON_CALL_TARGETS]
    exporter = export.export(jax.jit(fn), platforms=("cuda",), disabled_checks=checks)
    abstract_device = getattr(jax.sharding, "AbstractDevice", None)
    # Before JAX 0.11 the lowering asks no device, and abstract devices may name no platform.
    names_a_platform = abstract_device is not None and "platform" in inspect.signature(abstract_device).parameters
    if jax.default_backend() == "gpu" or not names_a_platform:
        return exporter(*shapes)
    device = jax.sharding.AbstractDevice(device_kind=EXPORT_GPU, num_cores=None, platform="gpu")
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("_",), abstract_device=device)):
        return exporter(*shapes)


def reference_attention(q, k, v):
    """The same maths in plain jnp, computed in float32 (or float64) whatever the input dtype."""
    acc = accumulator_dtype(q.dtype)
    t, d = q.shape[-2:]
    s = jnp.einsum("...qd,...kd->...qk", q.astype(acc), k.astype(acc)) / math.sqrt(d)
    s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, -jnp.inf)
    return jnp.einsum("...qk,...kd->...qd", jax.nn.softmax(s, axis=-1), v.astype(acc))


if __name__ == "__main__":
    compiled = not interpret_default()
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.normal(size=(1, 2, 64, 16)), jnp.float32) for _ in range(3))

    def loss(attention):
        return lambda *x: jnp.sin(attention(*x)).sum()

    got = jax.jit(jax.value_and_grad(loss(lambda *x: flash_attention(*x, 16)), (0, 1, 2)))(q, k, v)
    with jax.default_matmul_precision("highest"):
        want = jax.value_and_grad(loss(reference_attention), (0, 1, 2))(q, k, v)
    tolerance = 2e-2 if compiled else 2e-4  # compiled, float32 matrix products are TF32 (10-bit mantissas)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(a, b, rtol=tolerance, atol=tolerance)
    where = f"compiled for {jax.devices()[0].device_kind}" if compiled else "interpreted on the CPU"
    print(f"flash attention ({where}): output and gradients match plain attention")
