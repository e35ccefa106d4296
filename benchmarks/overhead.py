"""Per-call overhead of a vjpkit Function, against hand-written JAX and PyTorch.

    python benchmarks/overhead.py [--quick]

1. Eager forward: `Exp.apply(x)` on a 3-element float32 array, against a
   hand-written `jax.jit(jax.custom_vjp)` of the same math and, when torch is
   importable, `torch.autograd.Function.apply` of the same Function. With 3
   elements the work is nothing; what is timed is the Python path plus JAX's
   dispatch. Target: vjpkit / hand-written <= 1.2.
2. A jitted gradient step, `jax.jit(jax.grad(loss))`, against torch's
   forward + backward of the same Function.

All candidates run in one process, interleaved repeat by repeat in a rotating
order (so drift and cache effects hit all of them alike); each repeat times `number` back-to-back calls and
blocks once at the end (benchmarks/_timing.py). Printed: the median and the
minimum over repeats, in µs per call, and each ratio as the median of
per-repeat ratios (robust to load from other processes).
"""

import argparse
import platform

import jax
import jax.numpy as jnp
import numpy as np
from _timing import Candidate, median, no_wait, paired_ratio, print_table, time_interleaved

import vjpkit

try:
    import torch
except ImportError:  # torch is only a comparison, never a dependency
    torch = None


class Exp(vjpkit.Function):
    @staticmethod
    def forward(ctx, x):
        y = jnp.exp(x)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, g):
        (y,) = ctx.saved_tensors
        return g * y


@jax.custom_vjp
def exp_by_hand(x):
    return jnp.exp(x)


def exp_by_hand_fwd(x):
    y = jnp.exp(x)
    return y, y


def exp_by_hand_bwd(y, g):
    return (g * y,)


exp_by_hand.defvjp(exp_by_hand_fwd, exp_by_hand_bwd)


if torch is not None:

    class TorchExp(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            y = x.exp()
            ctx.save_for_backward(y)
            return y

        @staticmethod
        def backward(ctx, g):
            (y,) = ctx.saved_tensors
            return g * y


def table(title, samples, baseline):
    """Median and minimum µs per call, and each candidate's paired ratio to ``baseline``."""
    rows = [(name, f"{median(s) * 1e6:.2f}", f"{min(s) * 1e6:.2f}", f"{paired_ratio(samples, name, baseline):.2f}")
            for name, s in samples.items()]
    print_table(f"{title} (ratio: median of per-repeat ratios to {baseline})",
                ["candidate", "median µs/call", "min µs/call", "ratio"], rows)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats, for a smoke run")
    args = parser.parse_args()
    number, repeat = (200, 21) if args.quick else (500, 201)

    print(f"jax {jax.__version__} on {jax.devices()[0].platform}, python {platform.python_version()}"
          + (f", torch {torch.__version__} ({torch.get_num_threads()} threads)" if torch else ", torch not installed"))
    print(f"{repeat} repeats of {number} calls each")

    # --- 1. eager forward-only ---------------------------------------------
    x = jnp.array([0.0, 0.5, 1.0], dtype=jnp.float32)
    exp_by_hand_jit = jax.jit(exp_by_hand)
    exp_by_hand_jit_copy = jax.jit(exp_by_hand)  # A/A control: the noise between identical callables
    np.testing.assert_allclose(Exp.apply(x), exp_by_hand_jit(x), rtol=1e-6)

    candidates = [
        Candidate("hand-written jax.jit(jax.custom_vjp)", lambda: exp_by_hand_jit(x)),
        Candidate("vjpkit Exp.apply", lambda: Exp.apply(x)),
        Candidate("hand-written, second copy (A/A control)", lambda: exp_by_hand_jit_copy(x)),
    ]
    if torch is not None:
        tx = torch.tensor([0.0, 0.5, 1.0], dtype=torch.float32)
        tx_req = tx.clone().requires_grad_(True)
        candidates += [
            Candidate("torch Function.apply", lambda: TorchExp.apply(tx), no_wait),
            Candidate("torch Function.apply (requires_grad input)", lambda: TorchExp.apply(tx_req), no_wait),
        ]
    baseline = candidates[0].name
    forward = time_interleaved(candidates, number=number, repeat=repeat, warmup=max(10, number // 10))
    table("Eager forward, 3-element float32 Exp", forward, baseline)
    ratio = paired_ratio(forward, "vjpkit Exp.apply", baseline)
    verdict = "met" if ratio <= 1.2 else "NOT met"
    print(f"\nvjpkit / hand-written (eager forward): {ratio:.3f}  (target <= 1.2: {verdict})")

    # --- 2. jitted gradient step -------------------------------------------
    def loss(exp):
        return lambda x: (exp(x) * x).sum()

    grad_vjpkit = jax.jit(jax.grad(loss(Exp.apply)))
    grad_by_hand = jax.jit(jax.grad(loss(exp_by_hand)))
    np.testing.assert_allclose(grad_vjpkit(x), grad_by_hand(x), rtol=1e-6)
    candidates = [
        Candidate("hand-written jax.jit(jax.grad(loss))", lambda: grad_by_hand(x)),
        Candidate("vjpkit jax.jit(jax.grad(loss))", lambda: grad_vjpkit(x)),
    ]
    if torch is not None:
        tx_req = torch.tensor([0.0, 0.5, 1.0], dtype=torch.float32, requires_grad=True)

        def torch_step():
            tx_req.grad = None
            (TorchExp.apply(tx_req) * tx_req).sum().backward()
            return tx_req.grad

        np.testing.assert_allclose(torch_step().numpy(), np.asarray(grad_vjpkit(x)), rtol=1e-6)
        candidates.append(Candidate("torch forward + backward", torch_step, no_wait))
    baseline = candidates[0].name
    step = time_interleaved(candidates, number=number // 2, repeat=repeat, warmup=max(10, number // 20))
    table("Gradient step, loss = sum(exp(x) * x), 3-element float32", step, baseline)
    ratio = paired_ratio(step, "vjpkit jax.jit(jax.grad(loss))", baseline)
    print(f"\nvjpkit / hand-written (jitted grad step): {ratio:.3f}")
    if torch is not None:
        print(f"vjpkit jitted grad step / torch forward+backward: "
              f"{paired_ratio(step, 'vjpkit jax.jit(jax.grad(loss))', 'torch forward + backward'):.3f}")


if __name__ == "__main__":
    main()
