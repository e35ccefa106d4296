"""Step time of the MLP: vjpkit Functions vs plain JAX autodiff vs PyTorch.

    python benchmarks/train_step.py            # about 30 s on 2 idle CPU cores
    python benchmarks/train_step.py --quick    # about 10 s, rougher figures

One training step (forward, backward, Adam update) of the classifier in
examples/train_mlp.py, written three ways:

* vjpkit: the examples' Linear/ReLU/SoftmaxCrossEntropy Functions in a
  ``jax.jit`` step (``train_mlp.make_train_step``);
* autodiff: the same maths in plain ``jnp``, differentiated by JAX, in the
  same ``jax.jit`` step;
* PyTorch (when torch is importable): the same three layers as
  ``torch.autograd.Function`` classes, eager, with ``torch.optim.Adam``.

Each time is the median of one step. The two JAX versions take turns, one
step at a time, and their ratio is the median of the ratios of neighbouring
steps, which stays steady when other processes load the machine; PyTorch
runs after them (benchmarks/_timing.py). Targets: vjpkit / autodiff <= 1.05 (the jitted programs
should be the same), and vjpkit faster than PyTorch eager.
"""

import argparse
import os
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from _timing import Candidate, median, no_wait, paired_ratio, print_table, time_interleaved

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
from train_mlp import init_params, make_train_step  # noqa: E402

# (name, batch size, layer sizes): the digits model itself, where a step is
# mostly dispatch overhead, and an MNIST-sized one, where it is mostly matmuls.
MODELS = [
    ("digits 64-128-128-10", 64, (64, 128, 128, 10)),
    ("mnist 784-512-512-10", 128, (784, 512, 512, 10)),
]


def plain_loss(params, x, y):
    """The vjpkit model's maths in plain jnp, for JAX's autodiff."""
    *hidden, (w_out, b_out) = params
    for w, b in hidden:
        x = jnp.maximum(x @ w.T + b, 0)
    logits = x @ w_out.T + b_out
    lse = jax.nn.logsumexp(logits, axis=-1)
    return jnp.mean(lse - jnp.take_along_axis(logits, y[:, None], axis=-1)[:, 0])


def jax_stepper(loss, params, x, y):
    """A zero-argument function that runs one jitted step and waits for it."""
    optimizer = optax.adam(1e-3)
    train_step = make_train_step(optimizer, loss=loss) if loss else make_train_step(optimizer)
    state = [params, optimizer.init(params)]

    def step():
        state[0], state[1], value = train_step(state[0], state[1], x, y)
        jax.block_until_ready((state[0], state[1], value))

    return step


def torch_stepper(params, x, y):
    """The same model as ``torch.autograd.Function`` layers, eager, with Adam."""
    import torch

    class Linear(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w, b):
            ctx.save_for_backward(x, w, b)
            return x @ w.T + b

        @staticmethod
        def backward(ctx, g):
            x, w, b = ctx.saved_tensors
            gx = g @ w if ctx.needs_input_grad[0] else None
            return gx, g.T @ x, g.sum(0)

    class ReLU(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return x.clamp(min=0)

        @staticmethod
        def backward(ctx, g):
            (x,) = ctx.saved_tensors
            grad_input = g.clone()
            grad_input[x < 0] = 0
            return grad_input

    class SoftmaxCrossEntropy(torch.autograd.Function):
        @staticmethod
        def forward(ctx, logits, labels):
            lse = torch.logsumexp(logits, dim=-1)
            ctx.save_for_backward(logits, labels, lse)
            return (lse - logits.gather(1, labels[:, None])[:, 0]).mean()

        @staticmethod
        def backward(ctx, g):
            logits, labels, lse = ctx.saved_tensors
            grad = torch.exp(logits - lse[:, None])
            grad[torch.arange(len(labels)), labels] -= 1
            return grad * (g / len(labels)), None

    torch.set_num_threads(os.cpu_count())
    weights = [torch.tensor(np.asarray(a), requires_grad=True) for layer in params for a in layer]
    xt, yt = torch.tensor(np.asarray(x)), torch.tensor(np.asarray(y), dtype=torch.int64)
    optimizer = torch.optim.Adam(weights, lr=1e-3)

    def step():
        optimizer.zero_grad(set_to_none=True)
        h = xt
        for i in range(0, len(weights) - 2, 2):
            h = ReLU.apply(Linear.apply(h, weights[i], weights[i + 1]))
        loss = SoftmaxCrossEntropy.apply(Linear.apply(h, weights[-2], weights[-1]), yt)
        loss.backward()
        optimizer.step()

    return step


def step_times(steppers, steps):
    """Seconds of each of ``steps`` steps, per stepper, taking turns one step at a time.

    Each stepper waits for its own step, so there is nothing left to wait for.
    """
    candidates = [Candidate(name, step, no_wait) for name, step in steppers.items()]
    return time_interleaved(candidates, repeat=steps, warmup=3)


def bench_model(batch, sizes, steps):
    """Median step times in seconds, and the paired vjpkit / autodiff ratio."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(batch, sizes[0])).astype(np.float32)
    y = rng.integers(0, sizes[-1], size=batch).astype(np.int32)
    params = init_params(jax.random.key(0), sizes)
    times = step_times(
        {"vjpkit": jax_stepper(None, params, x, y), "autodiff": jax_stepper(plain_loss, params, x, y)}, steps
    )
    # PyTorch runs on its own: its idle OpenMP threads keep spinning for a
    # while after each step, which would slow down whatever ran next.
    try:
        times.update(step_times({"pytorch": torch_stepper(params, x, y)}, steps))
    except ImportError:
        pass
    medians = {name: median(t) for name, t in times.items()}
    return medians, paired_ratio(times, "vjpkit", "autodiff")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps: rougher figures, sooner")
    args = parser.parse_args()
    steps = 100 if args.quick else 1000

    device = jax.devices()[0]
    print(f"device: {device.platform} ({device.device_kind}), {os.cpu_count()} CPU cores, "
          f"median of {steps} steps each")
    rows = []
    for name, batch, sizes in MODELS:
        t, ratio = bench_model(batch, sizes, steps)
        per_step = (f"{t[key] * 1e6:.0f} us" if key in t else "-" for key in ("vjpkit", "autodiff", "pytorch"))
        torch_ratio = f"{t['pytorch'] / t['vjpkit']:.2f}" if "pytorch" in t else "-"
        rows.append((name, batch, *per_step, f"{ratio:.3f}", torch_ratio))
    print_table(None, ["model", "batch", "vjpkit", "autodiff", "pytorch", "vjpkit/autodiff", "pytorch/vjpkit"], rows)


if __name__ == "__main__":
    main()
