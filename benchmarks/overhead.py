"""Per-call overhead of a vjpkit Function, against hand-written JAX and PyTorch.

    python benchmarks/overhead.py [--quick] [--paths]

1. Eager forward: `Exp.apply(x)` on a 3-element float32 array, against a
   hand-written `jax.jit(jax.custom_vjp)` of the same math and, when torch is
   importable, `torch.autograd.Function.apply` of the same Function. With 3
   elements the work is nothing; what is timed is the Python path plus JAX's
   dispatch. Target: vjpkit / hand-written <= 1.2.
2. A jitted gradient step, `jax.jit(jax.grad(loss))`, against torch's
   forward + backward of the same Function.
3. Every call path of `apply` (keywords, NumPy inputs, static scalars,
   parameters left to their defaults, pytrees of arrays, a mix; 1, 10 and 100
   array arguments), each against the hand-written `jax.jit(jax.custom_vjp)`
   called the same way (static arguments through `static_argnums`), with its
   own A/A row (a second copy of the hand-written one). Target: each ratio
   <= 1.2. Then the Python floor: stand-ins for `apply` that only forward
   their arguments to the jit, or also look the argument types up in a dict
   (what any dispatch on the call's shape reads first). `--paths` prints
   only these two tables.

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
    parser.add_argument("--paths", action="store_true", help="only the table of call paths (3.)")
    args = parser.parse_args()
    number, repeat = (200, 21) if args.quick else (500, 201)

    print(f"jax {jax.__version__} on {jax.devices()[0].platform}, python {platform.python_version()}"
          + (f", torch {torch.__version__} ({torch.get_num_threads()} threads)" if torch else ", torch not installed"))
    print(f"{repeat} repeats of {number} calls each")
    if args.paths:
        call_path_table(number, repeat)
        return

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

    # --- 3. every call path, and the Python floor ----------------------------
    call_path_table(number, repeat)


# ---------------------------------------------------------------------------
# 3. Every call path of apply, against the same call of a hand-written jit.


class MulConstant(vjpkit.Function):
    @staticmethod
    def forward(ctx, x, c):
        ctx.c = c
        return x * c

    @staticmethod
    def backward(ctx, g):
        return g * ctx.c, None


class Linear(vjpkit.Function):
    @staticmethod
    def forward(ctx, x, w, b=None):
        ctx.save_for_backward(x, w)
        y = x @ w.T
        return y if b is None else y + b

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        return g @ w, g.T @ x, None if ctx.needs_input_grad[2] is False else g.sum(0)


class Affine(vjpkit.Function):
    """A pytree of parameters, a keyword-only static scale and a default."""

    @staticmethod
    def forward(ctx, params, x, *, scale=1.0, shift=None):
        ctx.save_for_backward(params["w"], x)
        ctx.scale = scale
        y = scale * (x @ params["w"].T + params["b"])
        return y if shift is None else y + shift

    @staticmethod
    def backward(ctx, g):
        w, x = ctx.saved_tensors
        g = ctx.scale * g
        return {"w": g.T @ x, "b": g.sum(0)}, g @ w


class Sum(vjpkit.Function):
    @staticmethod
    def forward(ctx, *xs):
        ctx.n = len(xs)
        out = xs[0]
        for x in xs[1:]:
            out = out + x
        return out

    @staticmethod
    def backward(ctx, g):
        return (g,) * ctx.n


def _custom_vjp(fun, fwd, bwd, nondiff_argnums=()):
    f = jax.custom_vjp(fun, nondiff_argnums=nondiff_argnums)
    f.defvjp(fwd, bwd)
    return f


mul_by_hand = _custom_vjp(
    lambda x, c: x * c, lambda x, c: (x * c, None), lambda c, _, g: (g * c,), nondiff_argnums=(1,)
)


def _linear(x, w, b=None):
    y = x @ w.T
    return y if b is None else y + b


def _linear_bwd(res, g):
    x, w, has_b = res
    return g @ w, g.T @ x, g.sum(0) if has_b else None


linear_by_hand = _custom_vjp(_linear, lambda x, w, b=None: (_linear(x, w, b), (x, w, b is not None)), _linear_bwd)


def _affine(params, x, scale=1.0, shift=None):
    y = scale * (x @ params["w"].T + params["b"])
    return y if shift is None else y + shift


def _affine_bwd(scale, res, g):
    w, x = res
    g = scale * g
    return {"w": g.T @ x, "b": g.sum(0)}, g @ w, None


affine_by_hand = _custom_vjp(
    lambda params, x, scale, shift: _affine(params, x, scale, shift),
    lambda params, x, scale, shift: (_affine(params, x, scale, shift), (params["w"], x)),
    _affine_bwd,
    nondiff_argnums=(2,),
)


def _sum(*xs):
    out = xs[0]
    for x in xs[1:]:
        out = out + x
    return out


sum_by_hand = _custom_vjp(_sum, lambda *xs: (_sum(*xs), len(xs)), lambda n, g: (g,) * n)


def call_paths():
    """Per row: the path, the vjpkit call, ``make_jit(jit)`` -> the hand-written jit, ``call(f)`` -> its call."""
    x = jnp.array([0.0, 0.5, 1.0], dtype=jnp.float32)
    np_x = np.asarray(x)
    a = jnp.ones((4, 3), jnp.float32)
    np_a = np.asarray(a)
    w = jnp.ones((2, 3), jnp.float32)
    b = jnp.ones(2, jnp.float32)
    params = {"w": w, "b": b}

    def exp(make):
        return make(exp_by_hand)

    def affine_jit(make):
        return make(lambda params, x, scale=1.0, shift=None: affine_by_hand(params, x, scale, shift),
                    static_argnames="scale")

    rows = [
        ("Exp.apply(x)", lambda: Exp.apply(x), exp, lambda f: lambda: f(x)),
        ("Exp.apply(x=x) keyword", lambda: Exp.apply(x=x), exp, lambda f: lambda: f(x=x)),
        ("Exp.apply(np_x) NumPy input", lambda: Exp.apply(np_x), exp, lambda f: lambda: f(np_x)),
        ("MulConstant.apply(x, 2.0) static scalar", lambda: MulConstant.apply(x, 2.0),
         lambda make: make(mul_by_hand, static_argnums=1), lambda f: lambda: f(x, 2.0)),
        ("Linear.apply(a, w, b)", lambda: Linear.apply(a, w, b),
         lambda make: make(linear_by_hand), lambda f: lambda: f(a, w, b)),
        ("Linear.apply(a, w) (b=None default)", lambda: Linear.apply(a, w),
         lambda make: make(linear_by_hand), lambda f: lambda: f(a, w)),
        ("Affine.apply({w, b}, a) pytree, defaults", lambda: Affine.apply(params, a),
         affine_jit, lambda f: lambda: f(params, a)),
        ("Affine.apply({w, b}, np_a, scale=2.0, shift=b) mix",
         lambda: Affine.apply(params, np_a, scale=2.0, shift=b),
         affine_jit, lambda f: lambda: f(params, np_a, scale=2.0, shift=b)),
    ]
    for n in (1, 10, 100):
        xs = tuple(x + i for i in range(n))
        rows.append((f"Sum.apply(*xs), {n} array argument{'s' if n > 1 else ''}", lambda xs=xs: Sum.apply(*xs),
                     lambda make: make(sum_by_hand), lambda f, xs=xs: lambda: f(*xs)))
    return rows


def call_path_table(number, repeat):
    """One group of three candidates per path: hand-written, vjpkit, A/A copy; returns the ratios."""
    ratios, rows = {}, []
    for path, vjpkit_call, make_jit, call_by_hand in call_paths():
        by_hand, copy = make_jit(jax.jit), make_jit(jax.jit)
        np.testing.assert_allclose(vjpkit_call(), call_by_hand(by_hand)(), rtol=1e-6)
        n = max(10, number // 5) if "100 array" in path else number
        candidates = [
            Candidate("hand-written", call_by_hand(by_hand), number=n),
            Candidate("vjpkit", vjpkit_call, number=n),
            Candidate("A/A", call_by_hand(copy), number=n),
        ]
        samples = time_interleaved(candidates, repeat=repeat, warmup=max(10, n // 10))
        ratio = ratios[path] = paired_ratio(samples, "vjpkit", "hand-written")
        rows.append((f"`{path}`", f"{median(samples['vjpkit']) * 1e6:.2f}",
                     f"{median(samples['hand-written']) * 1e6:.2f}", f"{ratio:.2f}",
                     f"{paired_ratio(samples, 'A/A', 'hand-written'):.2f}"))
    print_table(f"Every call path of apply, eager, against the same call of a hand-written "
                f"jax.jit(jax.custom_vjp) (µs per call, medians over {repeat} repeats; "
                f"ratio: median of per-repeat ratios)",
                ["call", "vjpkit µs", "hand-written µs", "ratio", "A/A ratio"], rows)
    worst = max(ratios, key=ratios.get)
    # The targets: the plain call (Exp.apply(x)) at most 1.2x, every other path at most 1.3x.
    verdict = "met" if ratios[worst] <= 1.3 else "NOT met"
    print(f"\nworst call path: {worst} at {ratios[worst]:.3f} (target <= 1.3 on every path: {verdict})")
    python_floor(number, repeat)
    return ratios


def python_floor(number, repeat):
    """What any Python-level dispatch in front of the jit costs: the call itself, and a key of the argument types.

    Two stand-ins for ``apply`` around the same hand-written jit: one that
    only forwards its arguments (``def f(*args, **kwargs)``), and one that
    also looks up the types of its arguments and the keyword names in a dict
    (what a dispatch on the call's shape must read before anything else).
    """
    x = jnp.array([0.0, 0.5, 1.0], dtype=jnp.float32)
    by_hand = jax.jit(exp_by_hand)
    inner = jax.jit(exp_by_hand)
    shapes = {(type(x),): inner}

    def forward_only(*args, **kwargs):
        return inner(*args, **kwargs)

    def type_key(*args, **kwargs):
        return shapes.get((*map(type, args), *kwargs))(*args)

    candidates = [
        Candidate("hand-written", lambda: by_hand(x)),
        Candidate("def f(*args, **kwargs) -> jit", lambda: forward_only(x)),
        Candidate("+ dict of argument types -> jit", lambda: type_key(x)),
        Candidate("vjpkit Exp.apply", lambda: Exp.apply(x)),
    ]
    samples = time_interleaved(candidates, number=number, repeat=repeat, warmup=max(10, number // 10))
    table("The Python floor of a dispatch in front of the jit, Exp on 3 float32", samples, "hand-written")

    # A pytree argument: its leaves' types can be read only by flattening it in Python (JAX's jit
    # would trace a Python scalar or bool leaf, which vjpkit keeps static).
    a, params = jnp.ones((4, 3), jnp.float32), {"w": jnp.ones((2, 3), jnp.float32), "b": jnp.ones(2, jnp.float32)}
    affine_by_hand_jit = jax.jit(lambda params, x: affine_by_hand(params, x, 1.0, None))
    affine_flat = jax.jit(lambda b, w, x: affine_by_hand({"w": w, "b": b}, x, 1.0, None))
    flatten = jax.tree_util.default_registry.flatten  # as apply does: tree_flatten without its Python frame
    leaves, treedef = flatten((params, a))
    shapes = {(dict, type(a)): None}
    structures = {(treedef, *map(type, leaves)): affine_flat}

    def flattened(*args, **kwargs):
        shapes.get((*map(type, args), *kwargs))
        leaves, treedef = flatten(args)
        return structures.get((treedef, *map(type, leaves)))(*leaves)

    candidates = [
        Candidate("hand-written jit(params, a)", lambda: affine_by_hand_jit(params, a)),
        Candidate("jit of the leaves (b, w, a)", lambda: affine_flat(params["b"], params["w"], a)),
        Candidate("+ argument types, flatten, structure and leaf types", lambda: flattened(params, a)),
        Candidate("vjpkit Affine.apply(params, a)", lambda: Affine.apply(params, a)),
    ]
    samples = time_interleaved(candidates, number=number, repeat=repeat, warmup=max(10, number // 10))
    table("The Python floor with a pytree argument, Affine({w, b}, a)", samples, "hand-written jit(params, a)")


if __name__ == "__main__":
    main()
