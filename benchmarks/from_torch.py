"""Per-call cost of ``vjpkit.from_torch``: the PyTorch original run from JAX, beside its port and PyTorch.

    python benchmarks/from_torch.py [--quick] [--size N] [--device cpu|gpu] [--modes M,...] [--repeat R]

One Function, swish (``x * sigmoid(x)`` with a hand-written backward), on
N float32 elements (default 1000: little work, so the times are the call
machinery). Candidates, each in four modes:

- port: the vjpkit port (``Swish.apply``, compiled jax.numpy);
- from_torch: the unchanged ``torch.autograd.Function`` through
  ``vjpkit.from_torch`` (a callback per call; where JAX has
  ``buffer_callback``, torch runs on XLA's own buffers on the arrays'
  device, else on host arrays through ``pure_callback``);
- traced: the same through ``vjpkit.from_torch(..., mode="trace")`` (its
  torch operations traced into JAX ones: no callback);
- torch: the original in PyTorch eager (forward under ``no_grad``; the
  gradient as forward with ``requires_grad`` then ``backward``).

Modes: forward called directly (vjpkit's apply is itself compiled, so this
is its eager call), forward inside ``jax.jit``, ``jax.grad`` called
directly (it traces on every call), and ``jax.jit(jax.grad)``; PyTorch
eager's figure in the jitted rows is its forward, or forward and backward. The loss is
``sum(swish(x) * x)``. All candidates run in one process, interleaved
repeat by repeat; figures are medians in µs per call, ratios are medians of
per-repeat ratios (paired), so load that comes and goes cancels out.

A second table sets the callback paths side by side where JAX has
``buffer_callback``: the device buffers (the default) against the host
callbacks forced (``pure_callback``, what JAX before 0.6 runs), each with an
A/A row (a second, identical ``from_torch`` of the same class).

``--device gpu`` puts JAX's arrays on the first GPU and PyTorch eager on
CUDA (torch's candidates wait with ``torch.cuda.synchronize``), and first
prints what device the original's tensors were on and whether they share the
arrays' memory. The issue's GPU row, in well under a minute::

    XLA_PYTHON_CLIENT_PREALLOCATE=false python benchmarks/from_torch.py \
        --device gpu --size 1000000 --modes "jit(grad)" --quick --repeat 15
"""

import argparse
import contextlib
import os
import platform

import jax
import jax.numpy as jnp
import numpy as np
import torch
from _timing import Candidate, median, no_wait, paired_ratio, print_table, time_interleaved

import vjpkit
from vjpkit._jax_internals import buffer_callback_api
from vjpkit._torch.device import host_callbacks  # forces the fallback path, for the side-by-side table


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
# The callback paths side by side, each twice (A/A): separate classes, so separate compiled programs.
PATHS = {"device": (FromTorch, vjpkit.from_torch(TorchSwish)),
         "host": (vjpkit.from_torch(TorchSwish), vjpkit.from_torch(TorchSwish))}


@contextlib.contextmanager
def as_is():
    """The device path: the same kind of context as host_callbacks, so both pay the same to enter one."""
    yield


class TorchSeen(torch.autograd.Function):
    """Records the device and address of what the original is handed (not vjpkit's meta tensors)."""

    seen: list = []

    @staticmethod
    def forward(ctx, x):
        if x.device.type != "meta":
            TorchSeen.seen.append((str(x.device), x.data_ptr()))
        return x * 2

    @staticmethod
    def backward(ctx, g):
        return 2 * g


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
    parser.add_argument("--device", choices=("cpu", "gpu"), default="cpu",
                        help="where JAX's arrays live (and PyTorch eager runs: cuda for gpu)")
    parser.add_argument("--modes", default=None, help="comma-separated subset of: forward, forward in jit, grad, "
                                                      "jit(grad) (default: all)")
    parser.add_argument("--repeat", type=int, default=None, help="repeats (default 21, or 5 with --quick)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    device = jax.devices(args.device)[0]
    on_gpu = args.device == "gpu"
    print(f"jax {jax.__version__} on {device.platform} ({device.device_kind}), torch {torch.__version__}"
          f"{' cuda ' + str(torch.version.cuda) if on_gpu else ''}, python {platform.python_version()}, "
          f"{os.cpu_count()} CPUs, x: {args.size} float32, callbacks on "
          f"{'device buffers (buffer_callback)' if buffer_callback_api() else 'host arrays (pure_callback)'}")

    x = jax.device_put(jnp.asarray(np.random.default_rng(0).standard_normal(args.size), jnp.float32), device)
    t = torch.from_numpy(np.asarray(x).copy()).to("cuda" if on_gpu else "cpu")
    torch_sync = (lambda _: torch.cuda.synchronize()) if on_gpu else no_wait
    seen = vjpkit.from_torch(TorchSeen)
    jax.block_until_ready(jax.jit(seen.apply)(x))
    print(f"the original was handed: {TorchSeen.seen[-1][0]} tensors, sharing the array's memory: "
          f"{TorchSeen.seen[-1][1] == x.unsafe_buffer_pointer()}")

    def loss(fn):
        return lambda x: (fn(x) * x).sum()

    modes = {
        "forward": (Swish.apply, FromTorch.apply, Traced.apply, torch_forward),
        # PyTorch eager has no jit: its row's figure is the same work, eager.
        "forward in jit": (jax.jit(Swish.apply), jax.jit(FromTorch.apply), jax.jit(Traced.apply), torch_forward),
        "grad": (jax.grad(loss(Swish.apply)), jax.grad(loss(FromTorch.apply)), jax.grad(loss(Traced.apply)),
                 torch_grad),
        "jit(grad)": (jax.jit(jax.grad(loss(Swish.apply))), jax.jit(jax.grad(loss(FromTorch.apply))),
                      jax.jit(jax.grad(loss(Traced.apply))), torch_grad),
    }
    if args.modes is not None:
        wanted = [m.strip() for m in args.modes.split(",")]
        unknown = set(wanted) - set(modes)
        if unknown:
            parser.error(f"unknown modes {sorted(unknown)}; choose from {list(modes)}")
        modes = {m: modes[m] for m in wanted}
    candidates = []
    for mode, (port, original, traced, in_torch) in modes.items():
        np.testing.assert_allclose(original(x), port(x), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(traced(x), port(x), rtol=1e-5, atol=1e-6)
        candidates += [Candidate(f"{mode}: port", lambda f=port: f(x)),
                       Candidate(f"{mode}: from_torch", lambda f=original: f(x)),
                       Candidate(f"{mode}: traced", lambda f=traced: f(x))]
        if in_torch is not None:
            np.testing.assert_allclose(in_torch(t).cpu().numpy(), port(x), rtol=1e-5, atol=1e-6)
            candidates.append(Candidate(f"{mode}: torch", lambda f=in_torch: f(t), torch_sync))
    sides = path_candidates(modes, x) if buffer_callback_api() else []
    number, repeat = (20, 5) if args.quick else (200, 21)
    repeat = args.repeat or repeat
    samples = time_interleaved(candidates + sides, number=number, repeat=repeat, warmup=10)

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
    if not sides:
        print("\nthis JAX has no buffer_callback: from_torch runs on host arrays only (no side-by-side table)")
        return
    rows = []
    for mode in modes:
        us = {k: median(samples[f"{mode}: {k}"]) * 1e6 for k in ("device", "device A/A", "host", "host A/A")}
        rows.append((
            mode, *(f"{us[k]:.1f}" for k in ("device", "host")),
            f"{paired_ratio(samples, f'{mode}: device', f'{mode}: host'):.3f}",
            f"{paired_ratio(samples, f'{mode}: device A/A', f'{mode}: device'):.3f}",
            f"{paired_ratio(samples, f'{mode}: host A/A', f'{mode}: host'):.3f}",
        ))
    print_table(f"from_torch's callback paths, median µs per call, swish on {args.size} float32 elements",
                ["mode", "device buffers", "host callbacks", "device / host", "device A/A", "host A/A"], rows)


def path_candidates(modes, x):
    """from_torch on device buffers and with host callbacks forced, each twice (A/A), in every mode."""

    def loss(fn):
        return lambda x: (fn(x) * x).sum()

    made = {"forward": lambda cls: cls.apply, "forward in jit": lambda cls: jax.jit(cls.apply),
            "grad": lambda cls: jax.grad(loss(cls.apply)), "jit(grad)": lambda cls: jax.jit(jax.grad(loss(cls.apply)))}
    candidates = []
    for mode in modes:
        for path, context in (("device", as_is), ("host", host_callbacks)):
            for name, cls in zip((path, f"{path} A/A"), PATHS[path], strict=True):
                fn = made[mode](cls)

                def call(fn=fn, context=context):
                    with context():  # traced under it: the path is fixed when the callback is staged
                        return fn(x)

                np.testing.assert_allclose(call(), made[mode](Swish)(x), rtol=1e-5, atol=1e-6)
                candidates.append(Candidate(f"{mode}: {name}", call))
    return candidates


if __name__ == "__main__":
    main()
