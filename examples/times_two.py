"""The smallest Function, in the PyTorch 2.x style: `forward` without ctx,
plus `setup_context`.

    python examples/times_two.py

d/dx sum(2 x) = 2 everywhere: the input [1., 2., 3.] gives [2., 2., 2.].
"""

import jax
import jax.numpy as jnp
import numpy as np

import vjpkit


@vjpkit.function
class TimesTwo:
    @staticmethod
    def forward(x):
        return x * 2

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass  # the derivative is the constant 2: nothing to save

    @staticmethod
    def backward(ctx, g):
        return g * 2


def main():
    x = jnp.array([1.0, 2.0, 3.0])
    print("x                  ", x)
    print("TimesTwo(x)        ", TimesTwo(x))

    grad = jax.grad(lambda x: TimesTwo(x).sum())(x)
    print("grad of sum        ", grad)
    np.testing.assert_array_equal(grad, [2.0, 2.0, 2.0])
    np.testing.assert_array_equal(grad, jax.grad(lambda x: (x * 2).sum())(x))

    # value_and_grad under jit, on a less trivial loss.
    vg = jax.jit(jax.value_and_grad(lambda x: jnp.sin(TimesTwo(x)).sum()))
    value, grad = vg(x)
    e_value, e_grad = jax.value_and_grad(lambda x: jnp.sin(2 * x).sum())(x)
    print("sin(2x): value, grad", value, grad)
    np.testing.assert_allclose(value, e_value, rtol=1e-6)
    np.testing.assert_allclose(grad, e_grad, rtol=1e-6)
    print("times_two: ok")


if __name__ == "__main__":
    main()
