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

On a GPU (``--device gpu``; under 4 minutes on an H200) the model is
GPT-2-small-like: 4 layers, width 512, 8 heads (head dimension 64), 16,384
tokens a step (batch 16 at context 1024, 4 at 4096, 1 at 16384), float32
and bfloat16 (parameters kept in float32, cast for the step; logits and
cross-entropy in float32), one AdamW step. Candidates, all on CUDA in this
process:

* vjpkit: the same Functions, attention now ``FlashAttention``'s Pallas
  kernels (examples/pallas_attention.py; transformer_ops.causal_attention
  picks them on a GPU);
* autodiff: plain ``jnp``, dense attention;
* cuDNN: autodiff with ``jax.nn.dot_product_attention(...,
  implementation="cudnn")`` for attention (16-bit only);
* PyTorch SDPA eager and ``torch.compile`` (``dynamic=True``: one graph
  per dtype, which inductor's cache reuses across contexts; see
  ``--torch-compile-static``): the model in ``torch.nn.functional``
  (``scaled_dot_product_attention(is_causal=True)``), fused AdamW, TF32
  matrix products as XLA's default. ``--torch-originals`` adds the
  ``torch.autograd.Function`` originals (eager), ``--with-scan`` the vjpkit
  Function's ``lax.scan`` attention (the CPU path) on the GPU.

Figures per context and dtype: median step time of interleaved steps (A/A
rows included), tokens per second, ratios to autodiff and vjpkit (paired),
XLA's planned temporary memory (``memory_analysis()``, nothing else
allocated) or PyTorch's peak (``torch.cuda.max_memory_allocated`` over a
step, less what was allocated before it), and the attention's residuals per
layer. Each candidate runs in its own ``try``: one that fails (cuDNN in
float32, a plan larger than the free memory) leaves a note, not a hole in
the run. ``--budget-s`` (default 210 s from start) skips what would run
past it; ``$OUT`` (or ``--out``) receives the tables as Markdown and JSON,
rewritten after every configuration.

    python benchmarks/transformer.py --device gpu            # all six configurations
    python benchmarks/transformer.py --device gpu --quick    # 4 timed steps each instead of 10
"""

import argparse
import ctypes
import json
import os
import re
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from _timing import Candidate, block_until_ready, median, no_wait, paired_ratio, print_table, time_interleaved

START = time.perf_counter()  # --budget-s counts from here (after importing JAX)
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
import train_transformer as tt  # noqa: E402
import transformer_ops as ops  # noqa: E402

BATCH = 8
CONFIG = tt.Config()
MEMORY_CONTEXTS = (256, 1024, 4096)
JAX_OPS = {"vjpkit": tt.VJPKIT_OPS, "autodiff": tt.AUTODIFF_OPS}


def batch_of(config, seed=0, batch=BATCH):
    rng = np.random.default_rng(seed)
    return tt.sample_batch(rng.integers(0, tt.VOCAB, 100_000).astype(np.int32), batch, config.context, rng)


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


def map_tree(fn, tree):
    """``fn`` over the leaves of nested dicts and lists (PyTorch tensors; plain Python, which torch.compile traces)."""
    if isinstance(tree, dict):
        return {key: map_tree(fn, value) for key, value in tree.items()}
    if isinstance(tree, list):
        return [map_tree(fn, value) for value in tree]
    return fn(tree)


def torch_model(config, batch=BATCH, device="cpu", dtype=None, flavour="originals"):
    """The model in PyTorch: its loss function, parameters (the JAX model's) and a batch.

    ``flavour``: "originals" (the ``torch.autograd.Function`` classes of
    transformer_ops.py) or "sdpa" (``torch.nn.functional``: layer norm, tanh
    GELU, ``scaled_dot_product_attention(is_causal=True)``, cross-entropy).
    ``dtype``: the parameters are cast to it inside the loss (kept in float32
    for the optimizer), the logits back to float32 for the cross-entropy.
    """
    import torch
    import torch.nn.functional as F

    originals = ops.torch_originals()
    h, d = config.heads, config.width
    if flavour == "originals":
        attention = lambda q, k, v: originals["CausalAttention"].apply(q, k, v, config.block)  # noqa: E731
        layer_norm = lambda x, w, b: originals["LayerNorm"].apply(x, w, b)  # noqa: E731
        gelu, cross_entropy = originals["GELU"].apply, originals["SoftmaxCrossEntropy"].apply
    elif flavour == "sdpa":
        attention = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)  # noqa: E731
        layer_norm = lambda x, w, b: F.layer_norm(x, (d,), w, b)  # noqa: E731
        gelu = lambda x: F.gelu(x, approximate="tanh")  # noqa: E731
        cross_entropy = F.cross_entropy
    else:
        raise ValueError(f"flavour: 'originals' or 'sdpa', not {flavour!r}")
    params = jax.tree.map(lambda a: torch.tensor(np.asarray(a), device=device, requires_grad=True),
                          tt.init_params(jax.random.key(0), config))
    tokens, targets = (torch.tensor(a, dtype=torch.int64, device=device) for a in batch_of(config, batch=batch))

    def loss_fn(p, tokens, targets):
        if dtype is not None:
            p = map_tree(lambda a: a.to(dtype), p)
        b, t = tokens.shape
        x = p["embed"][tokens] + p["pos"][:t]
        for blk in p["blocks"]:
            y = layer_norm(x, blk["ln1"]["weight"], blk["ln1"]["bias"])
            q, k, v = (z.reshape(b, t, h, d // h).transpose(1, 2) for z in (y @ blk["qkv"]).split(d, dim=-1))
            a = attention(q, k, v).transpose(1, 2).reshape(b, t, d)
            x = x + a @ blk["proj"]
            y = layer_norm(x, blk["ln2"]["weight"], blk["ln2"]["bias"])
            x = x + gelu(y @ blk["fc"] + blk["fc_bias"]) @ blk["out"] + blk["out_bias"]
        x = layer_norm(x, p["ln_f"]["weight"], p["ln_f"]["bias"])
        return cross_entropy((x @ p["head"]).float().reshape(-1, tt.VOCAB), targets.reshape(-1))

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


# ---------------------------------------------------------------------------
# --device gpu: the same comparison on CUDA, with cuDNN's and PyTorch's fused attention.

GPU_CONFIG = tt.Config(layers=4, width=512, heads=8, context=1024, block=128)
GPU_TOKENS = 16_384  # per step: batch 16 at context 1024, 4 at 4096, 1 at 16384
GPU_CONTEXTS = (1024, 4096, 16384)
GPU_DTYPES = ("bfloat16", "float32")  # bfloat16 first: the targets are set there


def cudnn_attention(q, k, v, block=None):
    """``jax.nn.dot_product_attention`` with cuDNN's fused kernel; it takes (batch, T, heads, D)."""
    out = jax.nn.dot_product_attention(*(x.transpose(0, 2, 1, 3) for x in (q, k, v)), is_causal=True,
                                       implementation="cudnn")
    return out.transpose(0, 2, 1, 3)


GPU_JAX_OPS = {"vjpkit": tt.VJPKIT_OPS, "autodiff": tt.AUTODIFF_OPS,
               "jax cuDNN": tt.AUTODIFF_OPS._replace(attention=cudnn_attention)}


def mixed_precision_step(optimizer, config, o, dtype):
    """The jitted train step with the parameters cast to ``dtype`` for the forward and backward pass."""
    import optax

    def loss_fn(params, tokens, targets):
        low = jax.tree.map(lambda a: a.astype(dtype), params)
        logits = tt.logits_fn(low, tokens, config, o).astype(jnp.float32)
        return o.cross_entropy(logits.reshape(-1, tt.VOCAB), targets.reshape(-1))

    @jax.jit
    def train_step(params, opt_state, tokens, targets):
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens, targets)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return train_step


def free_device_bytes():
    stats = jax.devices()[0].memory_stats() or {}
    if "bytes_limit" not in stats:
        return None
    return stats["bytes_limit"] - stats.get("bytes_in_use", 0)


def gpu_jax_stepper(o, config, batch, dtype):
    """Compiles one JAX candidate's step: (zero-argument stepper, XLA's planned temporary bytes)."""
    optimizer = tt.make_optimizer(1000)
    params = tt.init_params(jax.random.key(0), config)
    args = [params, optimizer.init(params), *(jnp.asarray(a) for a in batch_of(config, batch=batch))]
    compiled = mixed_precision_step(optimizer, config, o, dtype).lower(*args).compile()
    temp = compiled.memory_analysis().temp_size_in_bytes
    free = free_device_bytes()
    if free is not None and temp > free:
        raise MemoryError(f"XLA plans {temp / 2**30:.1f} GiB of temporaries, {free / 2**30:.1f} GiB free: not run")

    def step():
        args[0], args[1], loss = compiled(*args)
        return loss

    return step, temp


def gpu_torch_stepper(config, batch, dtype, compiled, flavour="sdpa", dynamic=True):
    """One PyTorch candidate's step on CUDA: zero-argument stepper (returns the loss, not waited for).

    ``torch.compile(dynamic=True)`` compiles the loss for symbolic batch and
    context sizes: inductor's on-disk graph cache then serves the other
    contexts of a dtype, so six configurations fit in the time budget
    (``--torch-compile-static`` compiles each shape on its own).
    """
    import torch

    loss_fn, params, tokens, targets = torch_model(config, batch, "cuda", getattr(torch, dtype), flavour)
    if compiled:
        torch._dynamo.reset()  # each configuration's closure is new: start from an empty cache, no recompile limit
    run = torch.compile(loss_fn, dynamic=dynamic) if compiled else loss_fn
    weights = jax.tree.leaves(params)
    optimizer = torch.optim.AdamW(weights, lr=1e-3, weight_decay=0.1, fused=True)

    def step():
        optimizer.zero_grad(set_to_none=True)
        loss = run(params, tokens, targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(weights, 1.0)
        optimizer.step()
        return loss

    return step


def torch_sync(_):
    import torch

    torch.cuda.synchronize()


def torch_step_peak(step):
    """Bytes PyTorch's allocator peaks at during one step, above what was allocated before it."""
    import torch

    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before


def gpu_residual_bytes(attention, config, batch, dtype):
    shape = jax.ShapeDtypeStruct((batch, config.heads, config.context, config.width // config.heads), dtype)
    pullback = jax.eval_shape(lambda q, k, v: jax.vjp(lambda *a: attention(*a, config.block), q, k, v)[1],
                              shape, shape, shape)
    return sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(pullback))


def first_line(error):
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0][:240] if text else ''}"


def gib(n):
    return "-" if n is None else f"{n / 2**30:.2f} GiB"


def run_gpu_configuration(context, dtype_name, args, deadline):
    """Times every candidate at one context and dtype; returns (rows, notes, records)."""
    config = GPU_CONFIG._replace(context=context)
    batch = max(1, GPU_TOKENS // context)
    dtype = jnp.dtype(dtype_name)
    steppers, memory, residuals, notes = {}, {}, {}, []

    def remaining():
        return deadline - time.perf_counter()

    jax_ops = dict(GPU_JAX_OPS)
    if args.with_scan:
        jax_ops["vjpkit lax.scan"] = tt.VJPKIT_OPS._replace(attention=ops.CausalAttention.apply)
    for name, o in jax_ops.items():
        if name == "jax cuDNN" and dtype.itemsize > 2:
            notes.append(f"{name}: not run: cuDNN's fused attention takes 16-bit inputs only")
            continue
        try:
            residuals[name] = gpu_residual_bytes(o.attention, config, batch, dtype)
            step, memory[name] = gpu_jax_stepper(o, config, batch, dtype)
            for _ in range(2):
                jax.block_until_ready(step())
            steppers[name] = (step, block_until_ready)
        except Exception as error:  # one candidate's failure must not end the run
            notes.append(f"{name}: failed: {first_line(error)}")
    torch_candidates = []
    if not args.no_torch:
        torch_candidates = [("pytorch SDPA eager", False, "sdpa")]
        if not args.no_torch_compile:
            torch_candidates.append(("pytorch SDPA torch.compile", True, "sdpa"))
        if args.torch_originals:
            torch_candidates.append(("pytorch originals eager", False, "originals"))
    for name, compiled, flavour in torch_candidates:
        if compiled and remaining() < args.compile_reserve_s:
            notes.append(f"{name}: skipped: {remaining():.0f} s of the time budget left, "
                         f"under --compile-reserve-s {args.compile_reserve_s:.0f}")
            continue
        try:
            step = gpu_torch_stepper(config, batch, dtype_name, compiled, flavour, not args.torch_compile_static)
            for _ in range(2):
                torch_sync(step())  # torch.compile compiles here
            memory[name] = torch_step_peak(step)
            steppers[name] = (step, torch_sync)
        except Exception as error:
            notes.append(f"{name}: failed: {first_line(error)}")
    if not steppers:
        return [], notes, []

    candidates = [Candidate(name, step, sync) for name, (step, sync) in steppers.items()]
    candidates += [Candidate(f"{name} (A/A)", step, sync) for name, (step, sync) in steppers.items()]
    times = time_interleaved(candidates, repeat=args.steps, warmup=0)
    tokens = batch * context
    rows, records = [], []
    for name, samples in times.items():
        base = name.removesuffix(" (A/A)")

        def ratio(to, name=name):
            return paired_ratio(times, name, to) if to in times else None

        record = {
            "context": context, "dtype": dtype_name, "batch": batch, "candidate": name,
            "step_ms": median(samples) * 1e3, "tokens_per_s": tokens / median(samples),
            "per_autodiff": ratio("autodiff"), "per_vjpkit": ratio("vjpkit"),
            "per_cudnn": ratio("jax cuDNN"), "aa": ratio(base) if name != base else None,
            "memory_bytes": memory.get(base) if name == base else None,
            "memory_kind": None if name != base else ("torch peak rise" if base.startswith("pytorch")
                                                       else "XLA temp plan"),
            "attention_residuals_bytes": residuals.get(base) if name == base else None,
            "samples_ms": [t * 1e3 for t in samples],
        }
        records.append(record)

        def fmt(x, digits=3):
            return "-" if x is None else f"{x:.{digits}f}"

        rows.append((
            name, f"{record['step_ms']:.2f} ms", f"{record['tokens_per_s']:,.0f}",
            fmt(record["per_autodiff"]), fmt(record["per_vjpkit"]), fmt(record["per_cudnn"]), fmt(record["aa"]),
            gib(record["memory_bytes"]) + ("" if record["memory_kind"] is None else
                                           f" ({'plan' if record['memory_kind'].startswith('XLA') else 'peak'})"),
            mib(record["attention_residuals_bytes"]),
        ))
    return rows, notes, records


def check_flash_kernels(shape=(4, 8, 1024, 64)):
    """The Pallas kernels' output and gradients against float32 dense attention, as relative errors (a line)."""
    import pallas_attention as pa

    rng = np.random.default_rng(0)
    arrays = [rng.normal(size=shape).astype(np.float32) for _ in range(4)]

    def output_and_gradients(attention):
        def run(q, k, v, cotangent):
            out, pullback = jax.vjp(attention, q, k, v)
            return (out, *pullback(cotangent.astype(out.dtype)))
        return jax.jit(run)

    with jax.default_matmul_precision("highest"):
        want = output_and_gradients(pa.reference_attention)(*arrays)
    parts = []
    for dtype in (jnp.bfloat16, jnp.float32):
        got = output_and_gradients(pa.flash_attention)(
            *(jnp.asarray(a, dtype) for a in arrays))
        errors = [float(jnp.max(jnp.abs(g.astype(jnp.float32) - w)) / jnp.max(jnp.abs(w)))
                  for g, w in zip(got, want, strict=True)]
        parts.append(f"{jnp.dtype(dtype).name} " + "/".join(f"{e:.1e}" for e in errors))
    return (f"kernel check {shape}: largest error of out/dq/dk/dv relative to the largest entry of float32 "
            f"dense attention's: " + "; ".join(parts))


GPU_HEADER = ["candidate", "step", "tokens/s", "/ autodiff", "/ vjpkit", "/ cuDNN", "/ A (A/A)",
              "memory", "attention residuals / layer"]


def write_results(out_dir, preamble, sections, records):
    """The tables as Markdown and the figures as JSON, in ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    lines = [*preamble, ""]
    for title, rows, notes in sections:
        cells = [GPU_HEADER, *[[str(c) for c in row] for row in rows]]
        widths = [max(len(r[i]) for r in cells) for i in range(len(GPU_HEADER))]
        lines += [f"### {title}", ""]
        for k, row in enumerate(cells):
            lines.append("| " + " | ".join(c.ljust(w) if i == 0 else c.rjust(w)
                                           for i, (c, w) in enumerate(zip(row, widths, strict=True))) + " |")
            if k == 0:
                lines.append("|" + "|".join("-" * (w + 2) if i == 0 else "-" * (w + 1) + ":"
                                            for i, w in enumerate(widths)) + "|")
        lines += [*(f"- {note}" for note in notes), ""]
    (out / "transformer_gpu.md").write_text("\n".join(lines))
    (out / "transformer_gpu.json").write_text(json.dumps({"preamble": preamble, "results": records}, indent=1))


def gpu_main(args):
    # JAX and PyTorch share the GPU: JAX takes memory as it needs it, not 75% of it at start. Read when
    # JAX starts its GPU client, at the first jax.devices() below (nothing before it touched a device).
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    devices = jax.devices()
    if devices[0].platform != "gpu" and not args.allow_cpu:
        sys.exit(f"--device gpu: JAX's default device is {devices[0].platform}, not a GPU "
                 f"(--allow-cpu runs the same code there, for a smoke test)")
    from importlib import metadata

    versions = [f"jax {jax.__version__}"]
    for package in ("jaxlib", "jax-cuda13-plugin", "jax-cuda12-plugin"):
        try:
            versions.append(f"{package} {metadata.version(package)}")
        except metadata.PackageNotFoundError:
            pass
    try:
        import torch

        versions.append(f"torch {torch.__version__} (CUDA {torch.version.cuda}, "
                        f"{torch.cuda.get_device_name() if torch.cuda.is_available() else 'no CUDA device'})")
        torch.set_float32_matmul_precision("high")  # TF32, as XLA's default precision for float32 dots
    except ImportError:
        args.no_torch = True
        versions.append("torch not installed")
    try:
        import triton

        versions.append(f"triton {triton.__version__}")
    except ImportError:
        pass
    global GPU_CONFIG
    GPU_CONFIG = GPU_CONFIG._replace(**{k: v for k, v in (("layers", args.layers), ("width", args.width),
                                                          ("heads", args.heads)) if v is not None})
    preamble = [
        f"device: {devices[0].device_kind} ({devices[0].platform}); {', '.join(versions)}; "
        f"Python {sys.version.split()[0]}",
        f"model: {GPU_CONFIG.layers} layers, width {GPU_CONFIG.width}, {GPU_CONFIG.heads} heads, "
        f"{GPU_TOKENS} tokens a step, one AdamW step; median of {args.steps} interleaved steps",
    ]
    try:
        preamble.append(check_flash_kernels() if devices[0].platform == "gpu" else check_flash_kernels((1, 2, 64, 16)))
    except Exception as error:  # the timings still run; vjpkit's row will say what failed
        preamble.append(f"kernel check: failed: {first_line(error)}")
    for line in preamble:
        print(line)
    deadline = START + args.budget_s
    out_dir = args.out or os.environ.get("OUT")
    sections, records, last = [], [], None
    configurations = [(c, d) for d in args.dtypes for c in args.contexts]
    configurations.sort(key=lambda cd: (cd[0] >= 16384, GPU_DTYPES.index(cd[1]) if cd[1] in GPU_DTYPES else 9,
                                        cd[0]))
    for context, dtype_name in configurations:
        batch = max(1, GPU_TOKENS // context)
        title = f"context {context}, {dtype_name}, batch {batch}"
        left = deadline - time.perf_counter()
        if last is not None and left < last:
            note = f"skipped: {left:.0f} s of the time budget left, the last configuration took {last:.0f} s"
            print(f"\n{title}: {note}")
            sections.append((title, [], [note]))
            continue
        began = time.perf_counter()
        try:
            rows, notes, found = run_gpu_configuration(context, dtype_name, args, deadline)
        except Exception as error:  # while timing: the other configurations still run
            rows, notes, found = [], [f"failed: {first_line(error)}"], []
        last = time.perf_counter() - began
        notes.append(f"this configuration took {last:.0f} s (compiling included)")
        print_table(title, GPU_HEADER, rows)
        for note in notes:
            print(f"- {note}")
        sections.append((title, rows, notes))
        records += found
        if out_dir:
            write_results(out_dir, preamble, sections, records)
        jax.clear_caches()
        if not args.no_torch:
            import torch

            torch.cuda.empty_cache()
    print("\nstep: median; ratios: medians of paired per-step ratios; memory: XLA's planned temporaries (plan) "
          "or PyTorch's peak allocation during a step above what was allocated before it (peak)")
    print(f"whole run: {time.perf_counter() - START:.0f} s")
    if out_dir:
        write_results(out_dir, preamble, sections, records)
        print(f"results: {out_dir}/transformer_gpu.md, {out_dir}/transformer_gpu.json")


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
    parser.add_argument("--device", choices=("cpu", "gpu"), default="cpu",
                        help="gpu: the GPU comparison (cuDNN, PyTorch SDPA), contexts 1024 to 16384")
    gpu = parser.add_argument_group("--device gpu")
    gpu.add_argument("--steps", type=int, help="timed steps per candidate (default 10, --quick 4)")
    gpu.add_argument("--contexts", type=int, nargs="+", default=list(GPU_CONTEXTS))
    gpu.add_argument("--dtypes", nargs="+", default=list(GPU_DTYPES), choices=GPU_DTYPES)
    gpu.add_argument("--budget-s", type=float, default=210.0,
                     help="seconds from start after which configurations are skipped")
    gpu.add_argument("--torch-compile-static", action="store_true",
                     help="torch.compile each shape (default: dynamic=True, one graph per dtype)")
    gpu.add_argument("--compile-reserve-s", type=float, default=30.0,
                     help="torch.compile is skipped with less of the budget left")
    gpu.add_argument("--torch-originals", action="store_true", help="add the torch.autograd.Function originals")
    gpu.add_argument("--with-scan", action="store_true", help="add vjpkit with the lax.scan attention (CPU path)")
    gpu.add_argument("--out", help="folder for transformer_gpu.md and .json (default: $OUT, if set)")
    gpu.add_argument("--allow-cpu", action="store_true", help="run --device gpu's code without a GPU (smoke test)")
    gpu.add_argument("--layers", type=int, help=argparse.SUPPRESS)
    gpu.add_argument("--width", type=int, help=argparse.SUPPRESS)
    gpu.add_argument("--heads", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.device == "gpu":
        args.steps = args.steps or (4 if args.quick else 10)
        return gpu_main(args)
    steps = args.steps or (5 if args.quick else 20)

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
