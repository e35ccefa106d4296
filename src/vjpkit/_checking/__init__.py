"""Checking derivatives: ``gradcheck``, ``gradgradcheck``, and the helpers of ``vjpkit.testing``.

For example:

```python
import numpy as np
import vjpkit

x = np.random.randn(20, 20)          # float64 inputs (NumPy, or JAX with x64)
w = np.random.randn(30, 20)
assert vjpkit.gradcheck(Linear.apply, (x, w), eps=1e-6, atol=1e-4)
assert vjpkit.gradgradcheck(Linear.apply, (x, w))
```

``fn`` is any JAX function of arrays: a vjpkit Function's ``apply``, a
hand-written ``jax.custom_vjp``, or plain JAX code calling several of them.
``inputs`` is a tuple (or list) of positional arguments, or one argument;
arguments and outputs may be pytrees.

The key differences to ``torch.autograd.gradcheck`` are in speed and in the
report, not in what is checked:

- All one-hot output cotangents go through one ``vmap`` of the VJP, and all
  central-difference perturbations through one ``vmap`` of ``fn``, inside a
  single traced program that also compares the two Jacobians. The program
  is cached per (function, input signature, options), so a second check of
  the same function runs only that program.
- That program is compiled by XLA as ``jax.jit`` compiles the user's own
  code, and nothing else computes the verdict: the derivatives compared are
  the ones the compiled program produces, with the same kernels, the same
  flushing of subnormals to zero on the CPU, the same half-precision
  accumulation. The first check of a function therefore costs a compile
  (see docs/gradcheck.md); JAX's persistent compilation cache makes later
  processes skip it.
- The work runs in float64 with ``jax_enable_x64`` switched on for
  gradcheck's own calls only (JAX's thread-local context), whatever the
  process-wide setting. Float32 inputs are cast, with a warning.
- A failure names every mismatching (output, input) pair, with pytree paths,
  and the worst element of each.

The key difference to ``jax.test_util.check_grads`` is that the whole
Jacobian is compared, not one random direction, and that functions without
a forward mode (``jax.custom_vjp``) need no ``modes=("rev",)``.

The package, one module per concern; the core of vjpkit never imports it:

- ``api``: ``gradcheck`` and the course of one check;
- ``options``, ``leaves``: what is checked, and the leaves it is checked on;
- ``jacobian``: the checking program (Jacobians and their comparison);
- ``checkers``: checkers, each a traced check run op by op or compiled, cached per function;
- ``report``: ``GradcheckError``, ``JacobianMismatch`` and the reports;
- ``gradgrad``: ``gradgradcheck``;
- ``assertions``, ``random_inputs``, ``torch_parity``: ``vjpkit.testing``;
- ``cli``: ``python -m vjpkit check``.

Tips:

- Finite differences need smooth functions: keep inputs away from kinks
  (``relu`` at 0, ``abs`` at 0) by more than ``eps``.
- Integer arrays and non-array inputs (Python scalars, strings) are held
  fixed; pass ``jnp.asarray(c)`` to check the derivative with respect to a
  scalar.
- ``fast_mode=True`` compares random projections ``v^T J u`` only (cheap for
  large inputs); on failure it reruns the full check for the report.
- Complex leaves are checked as pairs of reals (``"real"``/``"imag"`` in
  reports), which tests JAX's convention for complex VJPs, not PyTorch's
  conjugate one.
"""

from .api import gradcheck
from .gradgrad import gradgradcheck
from .report import GradcheckError, JacobianMismatch

__all__ = ["GradcheckError", "JacobianMismatch", "gradcheck", "gradgradcheck"]
