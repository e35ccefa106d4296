"""What a check checks (options), how far values may differ (tolerances), and how reports name things."""

from __future__ import annotations

from typing import Any, NamedTuple


class Options(NamedTuple):
    """What to check. Part of the compile-cache key (each changes the program)."""

    fast_mode: bool
    check_undefined_grad: bool
    check_batched_grad: bool
    check_forward_ad: bool
    check_backward_ad: bool


class Tolerances(NamedTuple):
    """Numbers the compiled program takes as arguments (no recompile when they change)."""

    eps: float
    atol: float
    rtol: float
    nondet_tol: float


class Naming(NamedTuple):
    """How reports name inputs and outputs: gradgradcheck renames both."""

    n_args: int | None = None  # set by gradgradcheck: inputs past it are grad_outputs

    def input(self, index: int, path: str) -> str:
        if self.n_args is not None and index >= self.n_args:
            return _join(f"grad_outputs[{index - self.n_args}]", path)
        return _join(f"input {index}", path)

    def output(self, index: int, path: str) -> str:
        if self.n_args is not None:
            return _join(f"the gradient of input {index}", path)
        return _join(f"output {index}", path)


DEFAULT_NAMING = Naming()


def _join(name: str, path: str) -> str:
    return f"{name} {path}" if path else name


def validate(options: Options, tolerances: Tolerances) -> None:
    if not (options.check_forward_ad or options.check_backward_ad):
        raise ValueError(
            "gradcheck: expected at least one of check_forward_ad or check_backward_ad "
            "to be True; with both False there is nothing to check."
        )
    if options.check_batched_grad and not options.check_backward_ad:
        raise ValueError(
            "gradcheck: check_batched_grad=True checks vmap of the VJP, so it requires "
            "check_backward_ad=True."
        )
    if not tolerances.eps > 0:
        raise ValueError(f"gradcheck: eps must be positive, got {tolerances.eps}.")
    for name in ("atol", "rtol", "nondet_tol"):
        value = getattr(tolerances, name)
        if not value >= 0:
            raise ValueError(f"gradcheck: {name} must be non-negative, got {value}.")


def as_args(inputs: Any) -> tuple:
    """PyTorch's rule: a tuple or list is the positional arguments, anything else one argument."""
    if isinstance(inputs, tuple):
        return inputs
    if isinstance(inputs, list):
        return tuple(inputs)
    return (inputs,)
