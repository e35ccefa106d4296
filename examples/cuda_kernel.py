"""A CUDA kernel with a gradient: forward and backward kernels compiled by `load_inline`, inside a vjpkit Function.

    python examples/cuda_kernel.py

The PyTorch pattern this replaces::

    ext = torch.utils.cpp_extension.load_inline("swish", cpp_sources, cuda_sources=cuda_source, functions=[...])

    class Swish(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return ext.swish_forward(x)

        @staticmethod
        def backward(ctx, g):
            (x,) = ctx.saved_tensors
            return ext.swish_backward(x, g)

Here the CUDA source holds the kernels and one XLA FFI handler per kernel
(the handler launches it on XLA's stream); `cpp_extension.load_inline`
compiles it with `nvcc` and registers the handlers for CUDA GPUs; the
Function calls them as PyTorch's calls `ext.*`. It runs under `jit`, `grad`
and `vmap`, checked against `jax.grad` of the plain math.

It needs a GPU (and `nvcc`: the CUDA toolkit, or `pip install
nvidia-cuda-nvcc`); on a machine without one it says so and exits.
"""

import jax
import jax.numpy as jnp
import numpy as np

import vjpkit
from vjpkit import cpp_extension

CUDA_SOURCE = r"""
namespace ffi = xla::ffi;

__device__ float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

__global__ void SwishForwardKernel(const float* x, float* y, size_t n) {
  size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
  if (i < n) y[i] = x[i] * sigmoid(x[i]);
}

__global__ void SwishBackwardKernel(const float* x, const float* g, float* gx, size_t n) {
  size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
  if (i < n) {
    float s = sigmoid(x[i]);
    gx[i] = g[i] * (s + x[i] * s * (1.0f - s));
  }
}

static ffi::Error LaunchError() {
  cudaError_t error = cudaGetLastError();
  return error == cudaSuccess ? ffi::Error::Success() : ffi::Error::Internal(cudaGetErrorString(error));
}

ffi::Error SwishForwardImpl(cudaStream_t stream, ffi::Buffer<ffi::F32> x, ffi::ResultBuffer<ffi::F32> y) {
  size_t n = x.element_count();
  SwishForwardKernel<<<(n + 255) / 256, 256, 0, stream>>>(x.typed_data(), y->typed_data(), n);
  return LaunchError();
}

ffi::Error SwishBackwardImpl(cudaStream_t stream, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> g,
                             ffi::ResultBuffer<ffi::F32> gx) {
  size_t n = x.element_count();
  SwishBackwardKernel<<<(n + 255) / 256, 256, 0, stream>>>(x.typed_data(), g.typed_data(), gx->typed_data(), n);
  return LaunchError();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(swish_forward, SwishForwardImpl,
    ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>().Arg<ffi::Buffer<ffi::F32>>().Ret<ffi::Buffer<ffi::F32>>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(swish_backward, SwishBackwardImpl,
    ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>().Arg<ffi::Buffer<ffi::F32>>()
                    .Arg<ffi::Buffer<ffi::F32>>().Ret<ffi::Buffer<ffi::F32>>());
"""


def main() -> None:
    if jax.default_backend() != "gpu":
        print(f"cuda_kernel.py needs a GPU: JAX's default backend here is {jax.default_backend()!r}. "
              "Nothing to run.")
        return
    # Elementwise kernels: a batch under vmap is more elements, in one launch.
    ext = cpp_extension.load_inline("swish", functions=["swish_forward", "swish_backward"], cuda_sources=CUDA_SOURCE,
                                    vmap_method="broadcast_all")

    class Swish(vjpkit.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return ext.swish_forward(x, result_shape_dtypes=x)

        @staticmethod
        def backward(ctx, g):
            (x,) = ctx.saved_tensors
            return ext.swish_backward(x, g, result_shape_dtypes=x)

    x = jnp.linspace(-4.0, 4.0, 1_000_003, dtype=jnp.float32)  # not a multiple of the block size

    def plain(x):
        return x * jax.nn.sigmoid(x)

    loss = jax.jit(jax.value_and_grad(lambda x: Swish.apply(x).sum()))
    want = jax.value_and_grad(lambda x: plain(x).sum())(x)
    got = loss(x)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-4)
    np.testing.assert_allclose(got[1], want[1], rtol=1e-5, atol=1e-6)
    rows = x[:12].reshape(3, 4)
    per_row = jax.vmap(jax.grad(lambda r: Swish.apply(r).sum()))(rows)
    np.testing.assert_allclose(per_row, jax.vmap(jax.grad(lambda r: plain(r).sum()))(rows), rtol=1e-5, atol=1e-6)
    print(f"Swish CUDA kernels on {jax.devices()[0]}: value and gradient of {x.size} elements match jax.grad")


if __name__ == "__main__":
    main()
