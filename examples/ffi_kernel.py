"""Log-softmax whose forward and backward are C++ kernels (XLA FFI), inside a vjpkit Function.

    python examples/ffi_kernel.py

The PyTorch pattern this replaces: a C++ extension built with
`torch.utils.cpp_extension.load_inline`, whose forward and backward
functions a `torch.autograd.Function` calls. Here the two kernels are XLA
FFI handlers in one C++ source string; `vjpkit.cpp_extension.load_inline`
compiles it with the system's C++ compiler against the FFI headers that
jaxlib ships (once: the library is cached by a hash of its content),
registers both handlers as XLA targets for the CPU, and returns them as
JAX-callable functions.

Both kernels treat every leading axis as a batch of independent rows, so
`vmap_method="broadcast_all"` batches them in one call under `jax.vmap`.
They handle float32 and float64 (gradcheck runs in float64). JAX cannot
differentiate an FFI call, so the Function has first derivatives only
(a second derivative raises JAX's "The FFI call to ... cannot be
differentiated"); backward is `@vjpkit.once_differentiable` to say so.
"""

import jax
import jax.numpy as jnp
import numpy as np

import vjpkit
from vjpkit import cpp_extension

LOG_SOFTMAX_SOURCE = r"""
#include <algorithm>
#include <cmath>
#include <cstdint>

namespace ffi = xla::ffi;

// y = x - logsumexp(x), row by row over the last axis.
template <typename T>
void LogSoftmaxRows(const T* x, T* y, int64_t rows, int64_t cols) {
  for (int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * cols;
    T* yr = y + r * cols;
    T top = *std::max_element(xr, xr + cols);
    T sum = 0;
    for (int64_t c = 0; c < cols; ++c) sum += std::exp(xr[c] - top);
    T log_sum = top + std::log(sum);
    for (int64_t c = 0; c < cols; ++c) yr[c] = xr[c] - log_sum;
  }
}

// dx = g - softmax(x) * sum(g), with softmax(x) = exp(y), row by row.
template <typename T>
void LogSoftmaxBackwardRows(const T* y, const T* g, T* dx, int64_t rows, int64_t cols) {
  for (int64_t r = 0; r < rows; ++r) {
    const T* yr = y + r * cols;
    const T* gr = g + r * cols;
    T* dxr = dx + r * cols;
    T g_sum = 0;
    for (int64_t c = 0; c < cols; ++c) g_sum += gr[c];
    for (int64_t c = 0; c < cols; ++c) dxr[c] = gr[c] - std::exp(yr[c]) * g_sum;
  }
}

// Every axis but the last is a row: a vmap batch axis too.
std::pair<int64_t, int64_t> RowsAndCols(const ffi::AnyBuffer& buffer) {
  auto dims = buffer.dimensions();
  int64_t cols = dims.size() == 0 ? 1 : dims.back();
  int64_t rows = cols == 0 ? 0 : static_cast<int64_t>(buffer.element_count()) / cols;
  return {rows, cols};
}

ffi::Error LogSoftmaxForwardImpl(ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y) {
  auto [rows, cols] = RowsAndCols(x);
  switch (x.element_type()) {
    case ffi::F32:
      LogSoftmaxRows(x.typed_data<float>(), y->typed_data<float>(), rows, cols);
      return ffi::Error::Success();
    case ffi::F64:
      LogSoftmaxRows(x.typed_data<double>(), y->typed_data<double>(), rows, cols);
      return ffi::Error::Success();
    default:
      return ffi::Error::InvalidArgument("LogSoftmaxForward: x must be float32 or float64");
  }
}

ffi::Error LogSoftmaxBackwardImpl(ffi::AnyBuffer y, ffi::AnyBuffer g, ffi::Result<ffi::AnyBuffer> dx) {
  auto [rows, cols] = RowsAndCols(y);
  if (g.element_type() != y.element_type()) {
    return ffi::Error::InvalidArgument("LogSoftmaxBackward: y and g must have the same dtype");
  }
  switch (y.element_type()) {
    case ffi::F32:
      LogSoftmaxBackwardRows(y.typed_data<float>(), g.typed_data<float>(), dx->typed_data<float>(), rows, cols);
      return ffi::Error::Success();
    case ffi::F64:
      LogSoftmaxBackwardRows(y.typed_data<double>(), g.typed_data<double>(), dx->typed_data<double>(), rows, cols);
      return ffi::Error::Success();
    default:
      return ffi::Error::InvalidArgument("LogSoftmaxBackward: y must be float32 or float64");
  }
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(LogSoftmaxForward, LogSoftmaxForwardImpl,
                              ffi::Ffi::Bind().Arg<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(LogSoftmaxBackward, LogSoftmaxBackwardImpl,
                              ffi::Ffi::Bind().Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>());
"""

kernels = cpp_extension.load_inline(
    "log_softmax",
    LOG_SOFTMAX_SOURCE,
    functions=["LogSoftmaxForward", "LogSoftmaxBackward"],
    vmap_method="broadcast_all",
)


class LogSoftmax(vjpkit.Function):
    """``log_softmax(x)`` over the last axis, computed by C++ kernels."""

    @staticmethod
    def forward(ctx, x):
        # The output has the input's shape and dtype: x itself describes it.
        y = kernels.LogSoftmaxForward(x, result_shape_dtypes=x)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    @vjpkit.once_differentiable
    def backward(ctx, g):
        (y,) = ctx.saved_tensors
        return kernels.LogSoftmaxBackward(y, g, result_shape_dtypes=g)


log_softmax = LogSoftmax.apply


def loss(log_softmax_fn, x):
    # A nonlinear loss, so every element's gradient differs.
    return jnp.sum(jnp.sin(log_softmax_fn(x)))


def main():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(6, 10)), jnp.float32)
    print(f"library: {kernels.library_path}")

    np.testing.assert_allclose(log_softmax(x), jax.nn.log_softmax(x), rtol=1e-5, atol=1e-6)
    print("forward matches jax.nn.log_softmax")

    grad = jax.jit(jax.grad(loss, argnums=1), static_argnums=0)
    np.testing.assert_allclose(grad(log_softmax, x), grad(jax.nn.log_softmax, x), rtol=1e-5, atol=1e-6)
    print("jit(grad) matches jax.grad of jax.nn.log_softmax")

    # Per-example gradients of a (3, 2, 10) batch: one kernel call each way.
    xs = x.reshape(3, 2, 10)
    per_example = jax.vmap(jax.grad(loss, argnums=1), in_axes=(None, 0))
    np.testing.assert_allclose(
        per_example(log_softmax, xs), per_example(jax.nn.log_softmax, xs), rtol=1e-5, atol=1e-6
    )
    print("vmap(grad) per-example gradients match")

    # Finite differences, in float64 (the kernels' double branch).
    vjpkit.gradcheck(log_softmax, (rng.normal(size=(3, 5)),))
    print("gradcheck: ok")
    print("ffi_kernel: ok")


if __name__ == "__main__":
    main()
