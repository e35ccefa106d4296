"""PyTorch's OpInfo database (``op_db``) as ``from_torch``'s oracle.

Every sample input of an OpInfo (CPU; float32, float64, int64, uint8 and
bool; a bounded number per op and dtype, plus OpInfo's reference inputs
that hold a NaN or an infinity) runs through trace mode and through torch
eagerly, for the function, the method and the in-place variant. Values and
dtypes must agree, and so must first-order gradients (``torch.autograd.grad``
against ``jax.vjp``, one seeded cotangent) where the op is differentiable.
A case whose inputs hold a 64-bit tensor runs with x64 on; the others with
it off, as most JAX programs run.

Trace mode is evaluated op by op (``vjpkit._torch.traced.run_traced`` on arrays, no
``jit``): the table's rules are what is checked here, and compiling each
case would cost more than running it. Callback mode runs the same cases
through ``from_torch`` itself (``check_callback``).

Each case ends in one of:

- ``agree``: values, dtypes (and gradients) equal torch's;
- ``refused``: trace mode raised ``Untraceable`` (``mode="auto"`` runs the
  original by callbacks instead);
- ``wrong``: a silent difference (value, dtype, shape or gradient);
- ``crash``: any other exception from vjpkit (a bug: it should be a refusal);
- ``skip``: torch itself refuses the sample (an in-place variant that
  cannot cast its result into its input), or, for the ops of
  ``IMPLEMENTATION_DEFINED``, the outputs torch leaves unspecified.

``python tests/opinfo_oracle.py`` prints the summary; ``scripts/opinfo_table.py``
writes the table of ``docs/from_torch.md`` from it.
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
import warnings
from typing import Any, Callable, Iterator

import numpy as np

os.environ.setdefault("OMP_NUM_THREADS", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import torch  # noqa: E402
import torch.utils._pytree as torch_pytree  # noqa: E402

from vjpkit._jax_internals import enable_x64  # noqa: E402
from vjpkit._torch import trace as torch_trace  # noqa: E402
from vjpkit._torch import traced as torch_traced  # noqa: E402
from vjpkit._torch.ops import Untraceable  # noqa: E402

DTYPES = (torch.float32, torch.float64, torch.int64, torch.uint8, torch.bool)
SAMPLES_PER_DTYPE = 2  # sample_inputs taken per op and dtype
NONFINITE_PER_DTYPE = 1  # reference inputs holding a NaN or an infinity, per op and dtype
VARIANTS = ("function", "method", "inplace")

# Outputs torch leaves unspecified: compared only where they are defined.
IMPLEMENTATION_DEFINED = {
    "sort": "the order of equal elements (stable=False) and so the indices",
    "argsort": "the order of equal elements (stable=False)",
    "topk": "which of equal elements are taken, and their indices",
    "max.reduction_with_dim": "the index of a tie",
    "min.reduction_with_dim": "the index of a tie",
    "argmax": "the index of a tie",
    "argmin": "the index of a tie",
    "mode": "the index of a tie",
    "median": "the index of a tie",
    "nanmedian": "the index of a tie",
    "kthvalue": "the index of a tie",
    "msort": "the order of equal elements",
    "cummax": "the index of a tie",
    "cummin": "the index of a tie",
    "empty_like": "uninitialized memory",
    "new_empty": "uninitialized memory",
    "empty": "uninitialized memory",
    "new_empty_strided": "uninitialized memory",
    "empty_strided": "uninitialized memory",
    "empty_permuted": "uninitialized memory",
}
# Casts whose result for NaN and infinity torch leaves to the CPU (C++'s float-to-integer conversion).
NONFINITE_TO_INTEGER = {"byte", "char", "short", "int", "long"}
# The output positions that are unspecified (the indices), per op above; None: every output.
UNSPECIFIED_OUTPUTS = {"argsort": None, "argmax": None, "argmin": None, "empty_like": None, "new_empty": None,
                       "empty": None, "new_empty_strided": None, "empty_strided": None, "empty_permuted": None}


@dataclasses.dataclass
class Case:
    op: Any  # the OpInfo
    variant: str  # "function", "method", "inplace"
    dtype: Any
    index: int  # the sample's position among the ones taken for this op and dtype
    sample: Any
    gradient: bool  # whether to compare first-order gradients

    @property
    def name(self) -> str:
        return f"{full_name(self.op)}[{self.variant},{str(self.dtype).removeprefix('torch.')},{self.index}]"


@dataclasses.dataclass
class Outcome:
    kind: str  # agree, refused, wrong, crash, skip
    detail: str = ""


def full_name(op: Any) -> str:
    return op.name + (f".{op.variant_test_name}" if op.variant_test_name else "")


def op_db() -> list:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from torch.testing._internal.common_methods_invocations import op_db as db
    return db


def _has_nonfinite(sample: Any) -> bool:
    for leaf in torch_pytree.tree_leaves((sample.input, sample.args, sample.kwargs)):
        if isinstance(leaf, torch.Tensor) and leaf.dtype.is_floating_point and not bool(torch.isfinite(leaf).all()):
            return True
        if isinstance(leaf, float) and not math.isfinite(leaf):
            return True
    return False


def _samples(op: Any, dtype: Any) -> list:
    """The op's first sample inputs, then its first reference inputs with a NaN or an infinity."""
    taken: list = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # The generators themselves: OpInfo.sample_inputs wraps them in a tracker that
        # walks the Python stack (inspect.stack) for every sample, most of the time spent here.
        torch.manual_seed(0)
        for sample in op.sample_inputs_func(op, "cpu", dtype, False):
            if len(taken) == SAMPLES_PER_DTYPE:
                break
            taken.append(sample)
        if op.reference_inputs_func is not None and dtype.is_floating_point:
            nonfinite = 0
            torch.manual_seed(0)
            for sample in op.reference_inputs_func(op, "cpu", dtype, False):
                if nonfinite == NONFINITE_PER_DTYPE:
                    break
                if _has_nonfinite(sample):
                    taken.append(sample)
                    nonfinite += 1
    return taken


def cases(op: Any, dtypes: tuple = DTYPES) -> Iterator[Case]:
    supported = op.supported_dtypes("cpu")
    for dtype in dtypes:
        if dtype not in supported:
            continue
        try:
            samples = _samples(op, dtype)
        except Exception:  # noqa: BLE001 - OpInfo's own generator fails for this dtype on CPU
            continue
        for i, sample in enumerate(samples):
            for variant in VARIANTS:
                fn = variant_of(op, variant)
                if fn is None or (variant != "function" and not isinstance(sample.input, torch.Tensor)):
                    continue
                yield Case(op, variant, dtype, i, sample, gradient=variant == "function" and op.supports_autograd
                           and dtype.is_floating_point)


def variant_of(op: Any, variant: str) -> Callable | None:
    if variant == "function":
        return op.op
    if variant == "method":
        return op.method_variant
    return op.inplace_variant


# ---------------------------------------------------------------------------
# One case.


def _split(sample: Any) -> tuple[list, Callable]:
    """The sample's tensors, and how to call with others in their places."""
    leaves, spec = torch_pytree.tree_flatten((sample.input, sample.args, sample.kwargs))
    where = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]

    def rebuild(tensors: tuple) -> tuple:
        filled = list(leaves)
        for i, t in zip(where, tensors, strict=True):
            filled[i] = t
        return torch_pytree.tree_unflatten(filled, spec)

    return [leaves[i] for i in where], rebuild


def _call(case: Case, rebuild: Callable) -> Callable:
    fn = variant_of(case.op, case.variant)

    def call(*tensors: Any) -> Any:
        input, args, kwargs = rebuild(tensors)
        return fn(input, *args, **kwargs)

    return call


def _torch_outputs(out: Any) -> list:
    return [leaf for leaf in torch_pytree.tree_leaves(out)]


def _jax_outputs(out: Any) -> list:
    return jax.tree_util.tree_leaves(out)


def _tolerance(dtype: Any) -> tuple[float, float]:
    return (1e-4, 1e-5) if dtype in (np.float32, np.float16) else (1e-7, 1e-9)


def _compare(got: Any, want: Any, what: str, grad: bool = False) -> str:
    """'' where ``got`` (JAX) equals ``want`` (a torch tensor or Python value); else the difference."""
    if isinstance(want, torch.Tensor):
        want_np = want.numpy(force=True)
        got_np = np.asarray(got)
        want_dtype = jax.dtypes.canonicalize_dtype(want_np.dtype)
        if got_np.dtype != want_dtype:
            return f"{what}: dtype {got_np.dtype}, torch {want_np.dtype}"
        if got_np.shape != want_np.shape:
            return f"{what}: shape {got_np.shape}, torch {want_np.shape}"
        if got_np.dtype.kind in "fc":
            rtol, atol = _tolerance(got_np.dtype)
            if grad:
                rtol, atol = rtol * 10, atol * 10
            scale = np.max(np.abs(want_np[np.isfinite(want_np)]), initial=1.0)
            close = np.isclose(got_np, want_np, rtol=rtol, atol=atol * scale, equal_nan=True)
            if not close.all():
                k = int(np.argmin(close.reshape(-1)))
                return (f"{what}: {int((~close).sum())}/{close.size} values differ, e.g. at {k}: "
                        f"{got_np.reshape(-1)[k]!r}, torch {want_np.reshape(-1)[k]!r}")
            return ""
        if not np.array_equal(got_np, want_np.astype(got_np.dtype)):
            k = int(np.argmax((got_np != want_np).reshape(-1)))
            return f"{what}: values differ, e.g. at {k}: {got_np.reshape(-1)[k]!r}, torch {want_np.reshape(-1)[k]!r}"
        return ""
    if isinstance(got, jax.Array):
        return f"{what}: an array where torch gives {type(want).__name__} {want!r}"
    if got != want and not (isinstance(want, float) and math.isnan(want) and math.isnan(got)):
        return f"{what}: {got!r}, torch {want!r}"
    return ""


def _is_64_bit(tensors: list) -> bool:
    return any(t.dtype in (torch.float64, torch.int64, torch.complex128) for t in tensors)


def _to_jax(t: torch.Tensor) -> Any:
    return jnp.asarray(t.detach().resolve_conj().resolve_neg().numpy())


def run_case(case: Case) -> Outcome:
    """Trace mode against torch eager on one case."""
    tensors, rebuild = _split(case.sample)
    if not tensors:
        return Outcome("skip", "no tensor among the arguments")
    if any(t.is_complex() or t.layout != torch.strided or t.dtype in (torch.float16, torch.bfloat16)
           for t in tensors):
        return Outcome("skip", "complex, sparse or half-precision inputs")
    call = _call(case, rebuild)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            want = call(*[t.clone() for t in tensors])
    except Exception as e:  # noqa: BLE001 - torch refuses this sample for this variant
        return Outcome("skip", f"torch raised {type(e).__name__}")
    with enable_x64(_is_64_bit(tensors)):
        return _run_traced(case, tensors, call, want)


def _run_traced(case: Case, tensors: list, call: Callable, want: Any) -> Outcome:
    arrays = [_to_jax(t) for t in tensors]
    if any(a.dtype != jax.dtypes.canonicalize_dtype(t.numpy().dtype) for a, t in zip(arrays, tensors, strict=True)):
        return Outcome("skip", "a 64-bit input without x64")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = torch_traced.run_traced(call, case.name, tuple(arrays), {})
    except Untraceable as e:
        return Outcome("refused", e.op)
    except Exception as e:  # noqa: BLE001 - reported as a crash
        return Outcome("crash", f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300])
    want_leaves, got_leaves = _torch_outputs(want), _jax_outputs(got)
    if len(want_leaves) != len(got_leaves):
        return Outcome("wrong", f"{len(got_leaves)} outputs, torch {len(want_leaves)}: {got!r}")
    unspecified = case.op.name in IMPLEMENTATION_DEFINED or full_name(case.op) in IMPLEMENTATION_DEFINED
    cast = case.op.name in NONFINITE_TO_INTEGER and _has_nonfinite(case.sample)
    for k, (g, w) in enumerate(zip(got_leaves, want_leaves, strict=True)):
        if unspecified and _unspecified_output(case, k, w) or cast:
            continue
        diff = _compare(g, w, f"output {k}")
        if diff:
            return Outcome("wrong", diff)
    # Derivatives at NaN and infinity are conventions (torch's and JAX's differ): finite samples only.
    if case.gradient and not unspecified and not _has_nonfinite(case.sample):
        return _compare_gradients(case, tensors, arrays, call)
    return Outcome("agree")


def _unspecified_output(case: Case, k: int, want: Any) -> bool:
    positions = UNSPECIFIED_OUTPUTS.get(case.op.name, "indices")
    if positions is None:
        return True
    return isinstance(want, torch.Tensor) and not want.dtype.is_floating_point


def _compare_gradients(case: Case, tensors: list, arrays: list, call: Callable) -> Outcome:
    at = [i for i, t in enumerate(tensors) if t.dtype.is_floating_point]
    if not at:
        return Outcome("agree")
    leaves = [t.detach().clone().requires_grad_(i in at) for i, t in enumerate(tensors)]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            outs = [o for o in _torch_outputs(call(*leaves))
                    if isinstance(o, torch.Tensor) and o.dtype.is_floating_point and o.requires_grad]
            if not outs:
                return Outcome("agree")
            rng = np.random.default_rng(0)
            cts = [torch.from_numpy(rng.standard_normal(o.shape).astype(o.detach().numpy().dtype)) for o in outs]
            want = torch.autograd.grad(outs, [leaves[i] for i in at], cts, allow_unused=True)
    except Exception:  # noqa: BLE001 - torch cannot differentiate this sample: values only
        return Outcome("agree")

    def traced(*diff: Any) -> list:
        full = list(arrays)
        for i, d in zip(at, diff, strict=True):
            full[i] = d
        out = _jax_outputs(torch_traced.run_traced(call, case.name, tuple(full), {}))
        return [o for o in out if isinstance(o, jax.Array) and jnp.issubdtype(o.dtype, jnp.floating)]

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out, pullback = jax.vjp(traced, *[arrays[i] for i in at])
            if len(out) != len(outs):
                return Outcome("agree")  # an output torch does not differentiate (an integer-valued float)
            got = pullback([jnp.asarray(c.numpy()) for c in cts])
    except Untraceable as e:
        return Outcome("refused", f"{e.op} (its gradient)")
    except Exception as e:  # noqa: BLE001
        return Outcome("crash", f"gradient: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300])
    for i, g, w in zip(at, got, want, strict=True):
        if w is None:
            w = torch.zeros_like(tensors[i])
        diff = _compare(g, w, f"gradient of input {i}", grad=True)
        if diff:
            return Outcome("wrong", diff)
    return Outcome("agree")


# ---------------------------------------------------------------------------
# Callback mode: the same cases through from_torch itself.


def run_callback_case(case: Case) -> Outcome:
    """Callback mode (``vjpkit.from_torch(call)``) against torch eager on one case, values and gradients."""
    import vjpkit

    tensors, rebuild = _split(case.sample)
    if not tensors or any(t.is_complex() or t.layout != torch.strided or t.dtype in (torch.float16, torch.bfloat16)
                          for t in tensors):
        return Outcome("skip", "no tensor, or complex, sparse or half-precision inputs")
    call = _call(case, rebuild)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            want = call(*[t.clone() for t in tensors])
    except Exception as e:  # noqa: BLE001
        return Outcome("skip", f"torch raised {type(e).__name__}")
    with enable_x64(_is_64_bit(tensors)):
        arrays = [_to_jax(t) for t in tensors]
        fn = vjpkit.from_torch(call, copy_inputs=case.variant == "inplace")
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                got = fn(*arrays)
        except ValueError as e:
            if "depends on its inputs' values" in str(e):  # callback mode's refusal of a value-dependent shape
                return Outcome("refused", str(e).splitlines()[0][:300])
            return Outcome("crash", f"ValueError: {str(e).splitlines()[0] if str(e) else ''}"[:300])
        except Exception as e:  # noqa: BLE001
            return Outcome("crash", f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300])
        want_leaves, got_leaves = _torch_outputs(want), _jax_outputs(got)
        if len(want_leaves) != len(got_leaves):
            return Outcome("wrong", f"{len(got_leaves)} outputs, torch {len(want_leaves)}")
        for k, (g, w) in enumerate(zip(got_leaves, want_leaves, strict=True)):
            diff = _compare(g, w, f"output {k}")
            if diff:
                return Outcome("wrong", diff)
    return Outcome("agree")


# ---------------------------------------------------------------------------
# The whole database.


def run_all(ops: list | None = None, progress: bool = False) -> dict:
    """``{full op name: [(case name, Outcome), ...]}`` for ``ops`` (all of op_db by default)."""
    results: dict = {}
    for op in ops if ops is not None else op_db():
        results[full_name(op)] = [(case.name, _guarded(case)) for case in cases(op)]
        if progress:
            for case_name, o in results[full_name(op)]:
                print(o.kind, case_name, o.detail, flush=True)
    return results


def _guarded(case: Case) -> Outcome:
    try:
        return run_case(case)
    except Exception as e:  # noqa: BLE001 - the oracle's own failure on an odd sample: reported, not fatal
        return Outcome("skip", f"oracle: {type(e).__name__}: {e}"[:200])


def summary(results: dict) -> dict:
    counts: dict = {}
    for outcomes in results.values():
        for _, o in outcomes:
            counts[o.kind] = counts.get(o.kind, 0) + 1
    return counts


if __name__ == "__main__":
    import time

    names = sys.argv[1:]
    ops = [op for op in op_db() if not names or full_name(op) in names or op.name in names]
    start = time.perf_counter()
    res = run_all(ops, progress=True)
    print(summary(res), f"{time.perf_counter() - start:.1f} s")


# ---------------------------------------------------------------------------
# The table of docs/from_torch.md.

TABLE_START, TABLE_END = "<!-- opinfo-table:start -->", "<!-- opinfo-table:end -->"


def torch_name(op: Any) -> str:
    """The name trace mode knows the OpInfo's function by (``-`` for a Python function torch does not
    name, a lambda of OpInfo's own or a composite such as ``torch.masked.sum``, traced through what it calls)."""
    if torch.overrides.resolve_name(op.op) is None:
        return "-"
    return torch_trace.torch_name(op.op)


def mapped_names() -> set:
    """Every torch function and method trace mode has a rule or an answer for."""
    from vjpkit._torch.ops import RULES

    return set(RULES) | set(torch_trace.SPECIAL) | set(torch_trace.METADATA)


def status(outcomes: list, mapped: bool) -> str:
    kinds = {o.kind for _, o in outcomes} - {"skip"}
    if "wrong" in kinds or "crash" in kinds:
        return "WRONG" if "wrong" in kinds else "CRASH"
    if not kinds:
        return "not run"
    if kinds == {"agree"}:
        return "traced"
    if "agree" in kinds:
        return "partly"
    return "refused by its rule" if mapped else "refused"


def table_rows(results: dict) -> list[tuple[str, str, str, str]]:
    """(OpInfo, torch name, status, agreeing cases / cases run) per OpInfo, in op_db's order."""
    names = {full_name(op): torch_name(op) for op in op_db()}
    mapped = mapped_names()
    rows = []
    for op_name, outcomes in results.items():
        run = [o for _, o in outcomes if o.kind != "skip"]
        agree = sum(o.kind == "agree" for o in run)
        rows.append((op_name, names[op_name], status(outcomes, names[op_name] in mapped), f"{agree}/{len(run)}"))
    return rows


def table_markdown(rows: list) -> str:
    covered = sum(r[2] in ("traced", "partly") for r in rows)
    lines = [TABLE_START, "",
             f"Trace mode traces {covered} of {len(rows)} OpInfos (every sample, or some: *partly*; the others "
             "are refused, and `mode=\"auto\"` runs them by callbacks). Generated by "
             f"`python scripts/opinfo_table.py` from `tests/opinfo_oracle.py`, {versions()}.", "",
             "| OpInfo | torch name | trace mode | cases agreeing |", "|---|---|---|---|"]
    lines += [f"| `{a}` | `{b}` | {c} | {d} |" if b != "-" else f"| `{a}` | - | {c} | {d} |" for a, b, c, d in rows]
    return "\n".join([*lines, "", TABLE_END])


def versions() -> str:
    """The versions a table was made with: another JAX or torch may trace a few ops more or fewer."""
    return f"torch {torch.__version__.split('+')[0]}, JAX {jax.__version__}"


def read_table(markdown: str) -> list[tuple[str, str, str, str]]:
    """The rows of the table written in ``markdown``."""
    start, end = markdown.index(TABLE_START), markdown.index(TABLE_END)
    rows = []
    for line in markdown[start:end].splitlines():
        if line.startswith("| `"):
            cells = [c.strip().strip("`") for c in line.strip("|").split("|")]
            rows.append(tuple(cells))
    return rows
