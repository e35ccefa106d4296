"""Under `jit`, a vjpkit model compiles to the same program as hand-written JAX.

    python benchmarks/jit_parity.py [--quick]

A 3-layer MLP training step (`value_and_grad` of a softmax cross-entropy +
SGD update, jitted), built twice: from vjpkit `Linear`/`ReLU` Functions, and
from hand-written `jax.custom_vjp` `linear`/`relu` with the same forward,
residuals and backward. Compared:

- the optimized HLO (`jax.jit(step).lower(...).compile().as_text()`): number
  of instructions in all computations, and per-opcode counts — must be equal
  (the script exits 1 otherwise); it also says whether the text is identical
  once source-location metadata is removed;
- the step time over interleaved repeats: median and minimum, and the ratio
  as the median of per-repeat ratios — target <= 1.05. A second copy of the
  hand-written step is timed too, as an A/A control for the machine's noise.
"""

import argparse
import collections
import re

import jax
import jax.numpy as jnp
import numpy as np
from _timing import Candidate, median, paired_ratio, print_table, time_interleaved

import vjpkit

# --- the model from vjpkit Functions ----------------------------------------


class Linear(vjpkit.Function):
    @staticmethod
    def forward(ctx, x, w, b):
        ctx.save_for_backward(x, w, b)
        return x @ w.T + b

    @staticmethod
    def backward(ctx, g):
        x, w, b = ctx.saved_tensors
        gx = g @ w if ctx.needs_input_grad[0] else None
        gw = g.T @ x if ctx.needs_input_grad[1] else None
        gb = g.sum(0) if ctx.needs_input_grad[2] else None
        return gx, gw, gb


@vjpkit.function
class ReLU:
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return jnp.maximum(x, 0)

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return jnp.where(x < 0, 0.0, g)


# --- the same model from hand-written jax.custom_vjp -------------------------


@jax.custom_vjp
def linear_by_hand(x, w, b):
    return x @ w.T + b


def linear_fwd(x, w, b):
    return x @ w.T + b, (x, w, b)


def linear_bwd(res, g):
    x, w, b = res
    return g @ w, g.T @ x, g.sum(0)


linear_by_hand.defvjp(linear_fwd, linear_bwd)


@jax.custom_vjp
def relu_by_hand(x):
    return jnp.maximum(x, 0)


def relu_fwd(x):
    return jnp.maximum(x, 0), x


def relu_bwd(x, g):
    return (jnp.where(x < 0, 0.0, g),)


relu_by_hand.defvjp(relu_fwd, relu_bwd)


# --- training step ------------------------------------------------------------


def make_step(linear, relu, learning_rate=1e-2):
    def loss(params, x, labels):
        h = x
        for w, b in params[:-1]:
            h = relu(linear(h, w, b))
        w, b = params[-1]
        logits = linear(h, w, b)
        log_probs = jax.nn.log_softmax(logits)
        return -jnp.take_along_axis(log_probs, labels[:, None], axis=1).mean()

    @jax.jit
    def step(params, x, labels):
        value, grads = jax.value_and_grad(loss)(params, x, labels)
        params = jax.tree.map(lambda p, g: p - learning_rate * g, params, grads)
        return params, value

    return step


def init_params(key, sizes):
    params = []
    for fan_in, fan_out, k in zip(sizes[:-1], sizes[1:], jax.random.split(key, len(sizes) - 1), strict=True):
        w = jax.random.normal(k, (fan_out, fan_in), jnp.float32) / np.sqrt(fan_in)
        params.append((w, jnp.zeros((fan_out,), jnp.float32)))
    return params


# An instruction inside any HLO computation: `[ROOT] %name = <shape> opcode(operands), ...`;
# the opcode is the first `word(` after the `=` (shapes, even tuple shapes, have none).
HLO_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*")
HLO_OPCODE = re.compile(r"(?:^|\s)([a-z][\w\-]*)\(")
# Source locations differ (vjpkit's frames vs this file's) and say nothing about the program.
METADATA = re.compile(r",? (?:metadata|stack_frame_id)=\{[^}]*\}")


def hlo_instructions(hlo_text):
    """Every instruction of every computation in `hlo_text`, without its source metadata."""
    return [METADATA.sub("", line.strip()) for line in hlo_text.splitlines() if HLO_INSTRUCTION.match(line)]


def hlo_opcodes(instructions):
    """Counter of opcodes over `instructions`."""
    matches = (HLO_OPCODE.search(line, line.index("=") + 1) for line in instructions)
    return collections.Counter(op.group(1) for op in matches if op)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats, for a smoke run")
    args = parser.parse_args()
    number, repeat = (5, 11) if args.quick else (10, 101)

    sizes, batch = (256, 512, 512, 10), 128
    kp, kx, ky = jax.random.split(jax.random.key(0), 3)
    params = init_params(kp, sizes)
    x = jax.random.normal(kx, (batch, sizes[0]), jnp.float32)
    labels = jax.random.randint(ky, (batch,), 0, sizes[-1])

    steps = {
        "hand-written jax.custom_vjp": make_step(linear_by_hand, relu_by_hand),
        "vjpkit Function": make_step(Linear.apply, ReLU.apply),
        # A/A control: a second, separately jitted copy of the reference shows
        # how far apart two identical programs time on this machine right now.
        "hand-written, second copy": make_step(linear_by_hand, relu_by_hand),
    }
    print(f"jax {jax.__version__} on {jax.devices()[0].platform}; MLP {sizes}, batch {batch}, float32")

    # Same numbers first: a fast wrong program would prove nothing.
    ref_name, got_name, control_name = steps
    (p_ref, v_ref), (p_got, v_got) = (steps[name](params, x, labels) for name in (ref_name, got_name))
    np.testing.assert_allclose(v_got, v_ref, rtol=1e-6)
    for got, ref in zip(jax.tree.leaves(p_got), jax.tree.leaves(p_ref), strict=True):
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)

    lowered = {name: step.lower(params, x, labels) for name, step in steps.items()}
    optimized = {name: hlo_instructions(low.compile().as_text()) for name, low in lowered.items()}
    unoptimized = {name: hlo_instructions(low.as_text(dialect="hlo")) for name, low in lowered.items()}
    opcodes = {name: hlo_opcodes(optimized[name]) for name in steps}
    candidates = [Candidate(name, lambda step=step: step(params, x, labels)) for name, step in steps.items()]
    samples = time_interleaved(candidates, number=number, repeat=repeat)
    ratios = {name: paired_ratio(samples, name, ref_name) for name in steps}

    print_table(None, ["training step", "optimized HLO instructions", "unoptimized HLO", "median µs/step",
                       "min µs/step", "ratio"],
                [(name, len(optimized[name]), len(unoptimized[name]), f"{median(samples[name]) * 1e6:.1f}",
                  f"{min(samples[name]) * 1e6:.1f}", f"{ratios[name]:.3f}") for name in steps])
    print("(ratio: median over repeats of the step time / the hand-written step time in the same repeat)")

    same_hlo = opcodes[got_name] == opcodes[ref_name]
    ratio = ratios[got_name]
    print(f"\noptimized HLO: same instruction count per opcode: {same_hlo}; "
          f"identical text (source metadata removed): {optimized[got_name] == optimized[ref_name]}")
    if not same_hlo:
        diff = (opcodes[got_name] - opcodes[ref_name]) + (opcodes[ref_name] - opcodes[got_name])
        for op in sorted(diff):
            print(f"  {op}: vjpkit {opcodes[got_name][op]}, hand-written {opcodes[ref_name][op]}")
    verdict = "met" if ratio <= 1.05 else "NOT met"
    print(f"step time vjpkit / hand-written: {ratio:.3f}  (target <= 1.05: {verdict}; "
          f"A/A control: {ratios[control_name]:.3f})")
    if not same_hlo:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
