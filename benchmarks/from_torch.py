"""Per-call cost of ``vjpkit.from_torch``: the PyTorch original run from JAX, beside its port and PyTorch.

    python benchmarks/from_torch.py [--quick] [--size N]

One Function, swish (``x * sigmoid(x)`` with a hand-written backward), on
N float32 elements (default 1000: little work, so the times are the call
machinery). Candidates, each in four modes:

- port: the vjpkit port (``Swish.apply``, compiled jax.numpy);
- from_torch: the unchanged ``torch.autograd.Function`` through
  ``vjpkit.from_torch`` (a host callback per call, arrays by DLPack);
- traced: the same through ``vjpkit.from_torch(..., mode="trace")`` (its
  torch operations traced into JAX ones: no callback);
- torch: the original in PyTorch eager (forward under ``no_grad``; the
  gradient as forward with ``requires_grad`` then ``backward``).

Modes: forward called directly (vjpkit's apply is itself compiled, so this
is its eager call), forward inside ``jax.jit``, ``jax.grad`` called
directly (it traces on every call), and ``jax.jit(jax.grad)``. The loss is
``sum(swish(x) * x)``. All candidates run in one process, interleaved
repeat by repeat; figures are medians in µs per call, ratios are medians of
per-repeat ratios (paired), so load that comes and goes cancels out.
"""

import argparse
import os
import platform

import jax
import jax.numpy as jnp
import numpy as np
import torch
from _timing import Candidate, median, no_wait, paired_ratio, print_table, time_interleaved

import vjpkit


class TorchSwish(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * torch.sigmoid(x)

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        s = torch.sigmoid(x)
        return g * (s * (1 + x * (1 - s)))


class Swish(vjpkit.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * jax.nn.sigmoid(x)

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        s = jax.nn.sigmoid(x)
        return g * (s * (1 + x * (1 - s)))


FromTorch = vjpkit.from_torch(TorchSwish)
Traced = vjpkit.from_torch(TorchSwish, mode="trace")


def torch_forward(t):
    with torch.no_grad():
        return TorchSwish.apply(t)


def torch_grad(t):
    x = t.detach().requires_grad_(True)
    (TorchSwish.apply(x) * x).sum().backward()
    return x.grad


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats, for a smoke run")
    parser.add_argument("--size", type=int, default=1000, help="elements of x")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"jax {jax.__version__} on {jax.devices()[0].platform}, torch {torch.__version__}, "
          f"python {platform.python_version()}, {os.cpu_count()} CPUs, x: {args.size} float32")

    x = jnp.asarray(np.random.default_rng(0).standard_normal(args.size), jnp.float32)
    t = torch.from_numpy(np.asarray(x).copy())

    def loss(fn):
        return lambda x: (fn(x) * x).sum()

    modes = {
        "forward": (Swish.apply, FromTorch.apply, Traced.apply, torch_forward),
        "forward in jit": (jax.jit(Swish.apply), jax.jit(FromTorch.apply), jax.jit(Traced.apply), None),
        "grad": (jax.grad(loss(Swish.apply)), jax.grad(loss(FromTorch.apply)), jax.grad(loss(Traced.apply)),
                 torch_grad),
        "jit(grad)": (jax.jit(jax.grad(loss(Swish.apply))), jax.jit(jax.grad(loss(FromTorch.apply))),
                      jax.jit(jax.grad(loss(Traced.apply))), None),
    }
    candidates = []
    for mode, (port, original, traced, in_torch) in modes.items():
        np.testing.assert_allclose(original(x), port(x), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(traced(x), port(x), rtol=1e-5, atol=1e-6)
        candidates += [Candidate(f"{mode}: port", lambda f=port: f(x)),
                       Candidate(f"{mode}: from_torch", lambda f=original: f(x)),
                       Candidate(f"{mode}: traced", lambda f=traced: f(x))]
        if in_torch is not None:
            np.testing.assert_allclose(in_torch(t).numpy(), port(x), rtol=1e-5, atol=1e-6)
            candidates.append(Candidate(f"{mode}: torch", lambda f=in_torch: f(t), no_wait))
    number, repeat = (20, 5) if args.quick else (200, 21)
    samples = time_interleaved(candidates, number=number, repeat=repeat, warmup=10)

    rows = []
    for mode in modes:
        us = {kind: median(samples[f"{mode}: {kind}"]) * 1e6 for kind in ("port", "from_torch", "traced", "torch")
              if f"{mode}: {kind}" in samples}
        rows.append((
            mode, f"{us['port']:.1f}", f"{us['from_torch']:.1f}", f"{us['traced']:.1f}",
            f"{us['torch']:.1f}" if "torch" in us else "-",
            f"{paired_ratio(samples, f'{mode}: from_torch', f'{mode}: port'):.1f}",
            f"{paired_ratio(samples, f'{mode}: traced', f'{mode}: port'):.2f}",
            f"{paired_ratio(samples, f'{mode}: from_torch', f'{mode}: torch'):.1f}" if "torch" in us else "-",
        ))
    print_table(f"median µs per call, swish on {args.size} float32 elements",
                ["mode", "port", "from_torch", "traced", "torch eager", "from_torch / port", "traced / port",
                 "from_torch / torch"], rows)


if __name__ == "__main__":
    main()
