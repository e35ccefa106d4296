"""What a torch original returns, learned before it runs: its outputs' structure, shapes and dtypes.

JAX fixes every shape while it traces, so ``from_torch`` runs the original
once per compiled signature on torch's ``meta`` tensors, else on sample
values; an output whose shape depends on values is refused here, naming the
operation, never learned from the samples.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable

import numpy as np

from .dtypes import torch_dtype


def infer_outputs(program: Any, run: Callable, out_info: dict) -> tuple[list, Any]:
    """forward's output structure, shapes and dtypes: run on meta tensors, else on sample values.

    Meta tensors cost nothing but fail on data-dependent code (``.item()``,
    ``if torch.any(...)``, NumPy); then forward runs on seeded sample values
    (floats uniform in [0.5, 1.5], else in [-1.5, 1.5]; zero integers).

    An operation whose output shape depends on values (``nonzero``,
    ``masked_select``, a boolean mask index, ``unique``) makes the shapes
    learned from samples worthless where they reach an output: forward then
    runs once more with each such result one row longer, and an output shape
    that follows is refused here, naming the operation. (Every callback also
    checks its outputs' shapes against these, ``callback._TorchComputation._to_numpy``.)
    """
    torch = program.origin.torch
    meta = [torch.empty(shape, dtype=torch_dtype(dtype), device="meta") for shape, dtype in program.in_kinds]
    ran_on = meta
    try:
        # Warnings about these made-up calls (torch's checkpoint: "None of the inputs have
        # requires_grad=True") would surface at trace time for calls the user never made.
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            run(meta, False)
    except Exception:
        # Positive values first (steps, scales, norms), then both signs; torch's error from the last.
        for low in (0.5, -1.5):
            out_info.clear()
            rng = np.random.default_rng(0)
            samples = ran_on = [torch.from_dlpack(sample(rng, shape, dtype, low)) for shape, dtype in program.in_kinds]
            watch = _ValueDependentShapes(torch)
            try:
                with torch.no_grad(), warnings.catch_warnings(), watch:
                    warnings.simplefilter("ignore")
                    program.guarded(run, samples, False)
                break
            except Exception:
                if low != -1.5:
                    continue
                raise
        if watch.seen:
            program.value_dependent = ", ".join(watch.seen)
            _refuse_value_dependent_shapes(program, run, samples, out_info)
    # An original that writes into its inputs is refused here, before a run on JAX's own buffers could.
    program.check_unchanged(ran_on, [0] * len(ran_on))
    leaves = out_info["leaves"]
    treedef = out_info["treedef"]
    out_info.pop("leaves")
    return leaves, treedef


FIXED_SHAPES = (
    "JAX fixes every array's shape when it traces, so vjpkit.from_torch cannot run it: return a "
    "fixed shape instead (torch.where(mask, x, 0) for x[mask] or torch.masked_select; indices "
    "padded to a fixed count for torch.nonzero, as jnp.nonzero(x, size=n) does in JAX)."
)


def _refuse_value_dependent_shapes(program: Any, run: Callable, samples: list, out_info: dict) -> None:
    """Raises where an output's shape follows an operation whose output shape depends on values."""
    torch = program.origin.torch
    shapes = [tuple(leaf.shape) for leaf in out_info["leaves"] if isinstance(leaf, torch.Tensor)]
    try:
        with torch.no_grad(), warnings.catch_warnings(), _ValueDependentShapes(torch, grow=True):
            warnings.simplefilter("ignore")
            grown = [tuple(t.shape) for t in run(samples, False)]
    except Exception:  # noqa: BLE001 - the longer results broke the original: each callback still checks
        return
    for k, (shape, other) in enumerate(zip(shapes, grown, strict=True)):
        if shape != other:
            raise ValueError(
                f"{program.method} (run by vjpkit.from_torch): the shape of its output {k} depends on its "
                f"inputs' values, through {program.value_dependent}. " + FIXED_SHAPES
            )


class _ValueDependentShapes:
    """Records the torch operations run inside it whose output shapes depend on values.

    With ``grow``, each such result comes out one row longer (a row of zeros:
    valid indices), so that a caller can see which outputs' shapes follow it.
    Operations are named as the original called them (``torch.argwhere``, not
    the ``aten::nonzero`` underneath).
    """

    _modes: tuple | None = None

    def __init__(self, torch: Any, grow: bool = False):
        self.torch = torch
        self.grow = grow
        self.seen: list[str] = []
        self.calls: list = []  # the torch function being run, as the original called it
        self._entered: list = []

    def __enter__(self) -> _ValueDependentShapes:
        names, shapes = self._classes(self.torch)
        self._entered = [names(self), shapes(self)]
        for mode in self._entered:
            mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        for mode in reversed(self._entered):
            mode.__exit__(*exc)

    def record(self, func: Any, args: tuple, kwargs: dict, out: Any) -> Any:
        rows = _growing_rows(self.torch, func, args, kwargs)
        if rows is None:
            return out
        call = self.calls[-1] if self.calls else None
        name = self.torch.overrides.resolve_name(call) if call is not None else None
        if name and getattr(self.torch, name.rsplit(".", 1)[-1], None) is call:  # torch.functional.unique
            name = "torch." + name.rsplit(".", 1)[-1]
        name = name or f"aten::{func.overloadpacket.__name__}"
        if func.overloadpacket.__name__ == "index":
            name += " with a boolean mask"
        if name not in self.seen:
            self.seen.append(name)
        if not self.grow or not rows:
            return out
        outs = list(out) if isinstance(out, tuple) else [out]
        for k, dim in rows:
            t = outs[k]
            extra = list(t.shape)
            extra[dim] = 1
            outs[k] = self.torch.cat([t, t.new_zeros(extra)], dim)
        return tuple(outs) if isinstance(out, tuple) else outs[0]

    @classmethod
    def _classes(cls, torch: Any) -> tuple:
        if cls._modes is None:
            from torch.overrides import TorchFunctionMode
            from torch.utils._python_dispatch import TorchDispatchMode

            class Names(TorchFunctionMode):
                def __init__(self, watch: _ValueDependentShapes):
                    super().__init__()
                    self.watch = watch

                def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
                    self.watch.calls.append(func)
                    try:
                        return func(*args, **(kwargs or {}))
                    finally:
                        self.watch.calls.pop()

            class Shapes(TorchDispatchMode):
                def __init__(self, watch: _ValueDependentShapes):
                    super().__init__()
                    self.watch = watch

                def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
                    kwargs = kwargs or {}
                    return self.watch.record(func, args, kwargs, func(*args, **kwargs))

            cls._modes = (Names, Shapes)
        return cls._modes


def _growing_rows(torch: Any, func: Any, args: tuple, kwargs: dict) -> list | None:
    """For an operation whose output shape depends on values: (output, dim) of each such size, else None."""
    if torch.Tag.dynamic_output_shape not in getattr(func, "tags", ()):
        return None
    name = func.overloadpacket.__name__
    if name == "index":  # only a boolean mask's result depends on values
        indices = list(args[1]) if len(args) > 1 else list(kwargs.get("indices", ()))
        used = [k for k, i in enumerate(indices) if i is not None]
        if not any(i is not None and i.dtype in (torch.bool, torch.uint8) for i in indices):
            return None
        # Advanced indices side by side keep their place in the result; apart, they go first.
        return [(0, used[0] if used[-1] - used[0] + 1 == len(used) else 0)]
    if name == "one_hot":
        classes = args[1] if len(args) > 1 else kwargs.get("num_classes", -1)
        return None if classes != -1 else [(0, -1)]
    if name == "repeat_interleave" and kwargs.get("output_size") is not None:
        return None
    rows = {"nonzero": [(0, 0)], "masked_select": [(0, 0)], "bincount": [(0, 0)], "repeat_interleave": [(0, 0)],
            "_unique": [(0, 0)], "_unique2": [(0, 0), (2, 0)], "unique_consecutive": [(0, 0), (2, 0)]}
    if name == "unique_dim":
        return [(0, args[1] if len(args) > 1 else kwargs.get("dim", 0)), (2, 0)]
    return rows.get(name, [])  # another such operation: named, not grown


def sample(rng: np.random.Generator, shape: tuple, dtype: np.dtype, low: float) -> np.ndarray:
    if dtype.kind in "fc":
        return rng.uniform(low, 1.5, shape).astype(dtype)
    return np.zeros(shape, dtype)

