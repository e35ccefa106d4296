"""The character transformer: vjpkit Functions vs plain JAX autodiff vs PyTorch.

    python benchmarks/transformer.py            # several minutes on 2 CPU cores
    python benchmarks/transformer.py --quick    # fewer steps, rougher figures
    python benchmarks/transformer.py --memory-only --memory-contexts 128 256 512 1024 2048 4096 \
        --json benchmarks/results/transformer_cpu.json --plots docs/img   # figures as JSON and plots

The model of examples/train_transformer.py (4 layers, width 128, 4 heads,
batch 8), one training step (forward, backward, optimizer update), written
four ways, all in this process:

* vjpkit: the four Functions of transformer_ops.py in a ``jax.jit`` step;
* autodiff: the same maths in plain ``jnp`` (dense attention), differentiated
  by JAX, in the same ``jax.jit`` step;
* PyTorch eager: the ``torch.autograd.Function`` originals, with
  ``torch.optim.AdamW``, on as many threads as XLA uses (every core;
  ``--torch-threads``);
* PyTorch compiled: the same, loss and gradients through ``torch.compile``
  (its inductor backend compiles C++ on the CPU, with gcc).

All candidates take turns step by step, so the ratios pair neighbouring
steps. On a machine that other processes load, PyTorch's OpenMP threads wait
for each other and a step on 2 threads can take several times longer than on
1; ``--torch-threads 1`` then shows PyTorch at its best.

Figures:

* step time at context 256 (median of interleaved steps; ratios are medians
  of paired ratios, benchmarks/_timing.py), and tokens per second;
* peak memory of a step: for the JAX programs, XLA's plan
  (``jit(...).lower(...).compile().memory_analysis().temp_size_in_bytes``) at
  context 256, 1024 and 4096, nothing executed; for every candidate at
  context 256, the rise of the process's resident-set high-water mark over a
  few steps (Linux ``/proc/self/clear_refs`` resets it), so the four compare
  on one scale;
* the attention's residuals (what its forward keeps for backward: the
  arrays the VJP closes over, ``jax.vjp`` traced with ``jax.eval_shape``),
  per layer;
* the optimized HLO's instruction count.

Each timed figure has an A/A row: the same candidate timed again under
another name, interleaved with the rest, which shows how much of a
difference is noise. Targets: vjpkit / autodiff step time <= 1.05, the
attention's residuals <= 0.25x autodiff's at context 1024 and falling.
"""

import argparse
import ctypes
import os
import re
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from _timing import Candidate, median, no_wait, paired_ratio, print_table, time_interleaved

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
import train_transformer as tt  # noqa: E402
import transformer_ops as ops  # noqa: E402

BATCH = 8
CONFIG = tt.Config()
MEMORY_CONTEXTS = (256, 1024, 4096)
JAX_OPS = {"vjpkit": tt.VJPKIT_OPS, "autodiff": tt.AUTODIFF_OPS}


def batch_of(config, seed=0):
    rng = np.random.default_rng(seed)
    return tt.sample_batch(rng.integers(0, tt.VOCAB, 100_000).astype(np.int32), BATCH, config.context, rng)


def jax_step(o, config):
    """The jitted train step, its arguments, and a zero-argument stepper that waits for it."""
    optimizer = tt.make_optimizer(1000)
    params = tt.init_params(jax.random.key(0), config)
    args = [params, optimizer.init(params), *batch_of(config)]
    train_step = tt.make_train_step(optimizer, config, o)

    def step():
        args[0], args[1], loss = train_step(*args)
        jax.block_until_ready(loss)

    return train_step, args, step


def compiled_figures(o, config):
    """XLA's planned temporary bytes and the optimized HLO's instruction count of one step."""
    train_step, args, _ = jax_step(o, config)
    compiled = train_step.lower(*args).compile()
    instructions = sum(1 for line in compiled.as_text().splitlines() if re.match(r"\s*(ROOT )?%\S+ = ", line))
    return compiled.memory_analysis().temp_size_in_bytes, instructions


def attention_residual_bytes(attention, config):
    """Bytes of the arrays one layer's attention keeps for its backward (batch BATCH)."""
    shape = jax.ShapeDtypeStruct((BATCH, config.heads, config.context, config.width // config.heads), jnp.float32)
    pullback = jax.eval_shape(lambda q, k, v: jax.vjp(lambda *a: attention(*a, config.block), q, k, v)[1],
                              shape, shape, shape)
    return sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(pullback))


def torch_model(config):
    """The model with the PyTorch originals: its loss function, parameters (the JAX model's) and a batch."""
    import torch

    originals = ops.torch_originals()
    attention, layer_norm = originals["CausalAttention"].apply, originals["LayerNorm"].apply
    gelu, cross_entropy = originals["GELU"].apply, originals["SoftmaxCrossEntropy"].apply
    params = jax.tree.map(lambda a: torch.tensor(np.asarray(a), requires_grad=True),
                          tt.init_params(jax.random.key(0), config))
    tokens, targets = (torch.tensor(a, dtype=torch.int64) for a in batch_of(config))
    h, d = config.heads, config.width

    def loss_fn(p, tokens, targets):
        b, t = tokens.shape
        x = p["embed"][tokens] + p["pos"][:t]
        for blk in p["blocks"]:
            y = layer_norm(x, blk["ln1"]["weight"], blk["ln1"]["bias"])
            q, k, v = (z.reshape(b, t, h, d // h).transpose(1, 2) for z in (y @ blk["qkv"]).split(d, dim=-1))
            a = attention(q, k, v, config.block).transpose(1, 2).reshape(b, t, d)
            x = x + a @ blk["proj"]
            y = layer_norm(x, blk["ln2"]["weight"], blk["ln2"]["bias"])
            x = x + gelu(y @ blk["fc"] + blk["fc_bias"]) @ blk["out"] + blk["out_bias"]
        x = layer_norm(x, p["ln_f"]["weight"], p["ln_f"]["bias"])
        return cross_entropy((x @ p["head"]).reshape(-1, tt.VOCAB), targets.reshape(-1))

    return loss_fn, params, tokens, targets


def torch_stepper(config, compiled, threads):
    """A zero-argument step of the PyTorch model: AdamW and gradient clipping, as the JAX step."""
    import torch

    loss_fn, params, tokens, targets = torch_model(config)
    torch.set_num_threads(threads)
    run = torch.compile(loss_fn) if compiled else loss_fn
    weights = jax.tree.leaves(params)
    optimizer = torch.optim.AdamW(weights, lr=1e-3, weight_decay=0.1)

    def step():
        optimizer.zero_grad(set_to_none=True)
        run(params, tokens, targets).backward()
        torch.nn.utils.clip_grad_norm_(weights, 1.0)
        optimizer.step()

    return step


def resident_rise(step, steps=3):
    """Bytes the resident-set high-water mark rises over ``steps`` steps above the resting size (Linux)."""
    status = Path("/proc/self/status")
    if not status.exists():
        return None

    def field(name):
        return int(re.search(rf"^{name}:\s+(\d+) kB", status.read_text(), re.MULTILINE).group(1)) * 1024

    # glibc keeps freed memory resident (PyTorch's CPU tensors live there); hand it back first.
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current resident size
    resting = field("VmRSS")
    for _ in range(steps):
        step()
    return field("VmHWM") - resting


def mib(n):
    return "-" if n is None else f"{n / 2**20:.1f} MiB"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps: rougher figures, sooner")
    parser.add_argument("--memory-contexts", type=int, nargs="+", default=list(MEMORY_CONTEXTS), metavar="T",
                        help="context lengths of the memory figures")
    parser.add_argument("--memory-only", action="store_true", help="only the memory figures (nothing executed)")
    parser.add_argument("--json", metavar="PATH", help="write the figures there (benchmarks/_plots.py)")
    parser.add_argument("--plots", metavar="DIR", help="draw transformer_memory.png and transformer_tokens.png there")
    parser.add_argument("--no-torch", action="store_true", help="leave PyTorch out")
    parser.add_argument("--no-torch-compile", action="store_true", help="leave torch.compile out")
    parser.add_argument("--torch-threads", type=int, default=os.cpu_count(),
                        help="PyTorch's intra-op threads; default: every core, as XLA uses")
    args = parser.parse_args()
    steps = 5 if args.quick else 20

    device = jax.devices()[0]
    print(f"device: {device.platform} ({device.device_kind}), {os.cpu_count()} CPU cores, "
          f"load average {os.getloadavg()[0]:.1f}; {CONFIG.layers} layers, width {CONFIG.width}, "
          f"{CONFIG.heads} heads, batch {BATCH}, attention block {CONFIG.block}")

    load_before = os.getloadavg()[0]
    # --- JAX: memory plans, residuals and HLO size at every context length.
    memory_rows, figures_of = [], {"memory": [], "steps": []}
    for context in args.memory_contexts:
        config = CONFIG._replace(context=context)
        figures = {name: compiled_figures(o, config) for name, o in JAX_OPS.items()}
        residuals = {name: attention_residual_bytes(o.attention, config) for name, o in JAX_OPS.items()}
        memory_rows.append((
            context,
            mib(figures["vjpkit"][0]), mib(figures["autodiff"][0]),
            f"{figures['vjpkit'][0] / figures['autodiff'][0]:.2f}",
            mib(residuals["vjpkit"]), mib(residuals["autodiff"]),
            f"{residuals['vjpkit'] / residuals['autodiff']:.3f}",
            figures["vjpkit"][1], figures["autodiff"][1],
        ))
        figures_of["memory"].append({"context": context, **{f"{n}_{k}": v for n in JAX_OPS for k, v in (
            ("temp_bytes", figures[n][0]), ("residual_bytes", residuals[n]), ("hlo_instructions", figures[n][1]))}})
    print_table("Memory XLA plans for one training step (nothing executed), and HLO size",
                ["context", "vjpkit temp", "autodiff temp", "ratio", "vjpkit attention residuals / layer",
                 "autodiff attention residuals / layer", "ratio", "vjpkit HLO instructions",
                 "autodiff HLO instructions"], memory_rows)
    if args.memory_only:
        return save(args, figures_of, load_before)

    # --- Step times at context 256: every candidate interleaved with the others, A/A rows included.
    tokens = BATCH * CONFIG.context
    steppers = {name: jax_step(o, CONFIG)[2] for name, o in JAX_OPS.items()}
    notes = []
    if not args.no_torch:
        makers = {"pytorch eager": False, "pytorch torch.compile": True}
        if args.no_torch_compile:
            del makers["pytorch torch.compile"]
        for name, compiled in makers.items():
            try:
                step = torch_stepper(CONFIG, compiled, args.torch_threads)
                step()  # torch.compile compiles here; it needs a working C++ compiler, among others
            except Exception as error:
                notes.append(f"{name}: failed: {type(error).__name__}: {str(error).splitlines()[0][:200]}")
                continue
            steppers[name] = step
    candidates = [Candidate(name, step, no_wait) for name, step in steppers.items()]
    candidates += [Candidate(f"{name} (A/A)", step, no_wait) for name, step in steppers.items()]
    times = time_interleaved(candidates, repeat=steps, warmup=2)
    rises = {name: resident_rise(step) for name, step in steppers.items()}

    rows = []
    for name, samples in times.items():
        base = name.removesuffix(" (A/A)")
        aa = paired_ratio(times, name, base) if name != base else None
        rows.append((
            name,
            f"{median(samples) * 1e3:.1f} ms",
            f"{tokens / median(samples):,.0f}",
            f"{paired_ratio(times, name, 'autodiff'):.3f}",
            f"{paired_ratio(times, name, 'vjpkit'):.3f}",
            "-" if aa is None else f"{aa:.3f}",
            mib(rises.get(name)) if name == base else "-",
        ))
        figures_of["steps"].append({
            "candidate": name, "step_ms": median(samples) * 1e3, "tokens_per_s": tokens / median(samples),
            "per_autodiff": paired_ratio(times, name, "autodiff"), "aa": aa,
            "peak_rss_rise_bytes": rises.get(name), "samples_ms": [t * 1e3 for t in samples]})
    print_table(f"One training step at context {CONFIG.context} ({tokens} tokens), median of {steps}; "
                f"PyTorch on {args.torch_threads} thread(s)",
                ["candidate", "step", "tokens/s", "/ autodiff", "/ vjpkit", "/ A (A/A)", "peak RSS rise"], rows)
    print("Ratios are medians of per-repeat ratios (paired); peak RSS rise: resident-set high-water mark "
          "over 3 steps above the resting size.")
    for note in notes:
        print(note)
    print(f"load average after: {os.getloadavg()[0]:.1f}")
    figures_of.update(context=CONFIG.context, tokens_per_step=tokens, torch_threads=args.torch_threads, notes=notes)
    save(args, figures_of, load_before)


def save(args, figures, load_before):
    """--json and --plots (benchmarks/_plots.py)."""
    import _plots

    figures = {"model": dict(CONFIG._asdict(), batch=BATCH), **figures}
    if args.json:
        _plots.write_json(args.json, figures, load_before)
    if args.plots:
        figures = {"environment": _plots.environment(load_before), **figures}
        _plots.memory_plot(figures, Path(args.plots) / "transformer_memory.png")
        if figures["steps"]:
            _plots.throughput_plot(figures, Path(args.plots) / "transformer_tokens.png")


if __name__ == "__main__":
    main()
