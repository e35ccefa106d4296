"""Command line gradient checks for CI: ``python -m vjpkit check MODULE:NAME``.

For example:

```python
python -m vjpkit check mypkg.ops:Linear --inputs "f64[20,20] f64[30,20]" --atol 1e-4
python -m vjpkit check mypkg.ops:Exp --inputs "f64[5]" --gradgrad
```

Imports ``NAME`` from ``MODULE`` (a vjpkit Function class, whose ``apply``
is checked, or any function of arrays; ``NAME`` may be dotted), runs
``vjpkit.gradcheck`` (and ``gradgradcheck`` with ``--gradgrad``) on seeded
random inputs of the given dtypes and shapes (see
``vjpkit.testing.random_inputs``), and prints a report.

Exit status: 0 when every check passes, 1 when a check fails (or the
function raises), 2 on bad arguments (unknown module, no such name,
malformed input spec), with a one-line error on stderr.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import time
import traceback
from typing import Any, Callable, Sequence

from .._function import reject_torch_function
from .api import gradcheck
from .gradgrad import gradgradcheck
from .random_inputs import random_inputs
from .report import GradcheckError

__all__ = ["main"]


class _UsageError(Exception):
    """Bad command-line arguments: reported in one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:  # argparse would print the usage too
        raise _UsageError(message)


def _parser() -> argparse.ArgumentParser:
    import vjpkit  # fully imported by the time the command line runs

    parser = _Parser(prog="python -m vjpkit", description="vjpkit command line tools.")
    parser.add_argument("--version", action="version", version=f"vjpkit {vjpkit.__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    check = commands.add_parser(
        "check",
        help="gradcheck a Function on seeded random inputs",
        description="Gradcheck MODULE:NAME on seeded random inputs; exit 0 (pass), 1 (fail), 2 (bad arguments).",
    )
    check.add_argument("target", metavar="MODULE:NAME", help="e.g. mypkg.ops:Linear")
    check.add_argument("--inputs", required=True, metavar="SPEC",
                       help='input dtypes and shapes, e.g. "f64[20,20] f64[30,20]"')
    check.add_argument("--seed", type=int, default=0, help="seed of the random inputs (default 0)")
    check.add_argument("--eps", type=float, default=1e-6, help="finite-difference step (default 1e-6)")
    check.add_argument("--atol", type=float, default=1e-5, help="absolute tolerance (default 1e-5)")
    check.add_argument("--rtol", type=float, default=1e-3, help="relative tolerance (default 1e-3)")
    check.add_argument("--fast", action="store_true", help="fast mode (random projections)")
    check.add_argument("--gradgrad", action="store_true", help="also run gradgradcheck")
    check.add_argument("--forward-ad", action="store_true", help="also check forward mode (jvp)")
    check.add_argument("--batched-grad", action="store_true", help="also check vmap of the VJP")
    check.add_argument("--no-undefined-grad", action="store_true",
                       help="skip the check of undefined output gradients")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the command line; returns the exit status."""
    try:
        args = _parser().parse_args(argv)
        fn = _resolve(args.target)
        try:
            inputs = random_inputs(args.inputs, seed=args.seed)
        except ValueError as e:
            raise _UsageError(str(e)) from None
    except _UsageError as e:
        print(f"vjpkit: error: {e}", file=sys.stderr)
        return 2
    options = dict(
        eps=args.eps, atol=args.atol, rtol=args.rtol, fast_mode=args.fast,
        check_forward_ad=args.forward_ad, check_batched_grad=args.batched_grad,
        check_undefined_grad=not args.no_undefined_grad,
    )
    print(f"vjpkit check {args.target} on {args.inputs} (seed {args.seed})")
    checks: list[tuple[str, Callable]] = [("gradcheck", gradcheck)]
    if args.gradgrad:
        checks.append(("gradgradcheck", gradgradcheck))
    status = 0
    for name, check in checks:
        start = time.perf_counter()
        try:
            check(fn, inputs, **options)
        except GradcheckError as e:
            print(f"{name}: FAILED\n{e}")
            status = 1
            continue
        except Exception as e:  # the function itself failed on these inputs
            traceback.print_exc()
            print(f"{name}: FAILED: {args.target} raised {type(e).__name__}: {e}")
            status = 1
            continue
        print(f"{name}: passed ({time.perf_counter() - start:.2f} s)")
    return status


def _resolve(target: str) -> Callable:
    """The function to check: ``NAME`` in ``MODULE``, or the ``apply`` of a Function class."""
    module_name, sep, name = target.partition(":")
    if not (sep and module_name and name):
        raise _UsageError(f"expected MODULE:NAME (e.g. mypkg.ops:Linear), got {target!r}")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())  # as `python -m` does, so local modules import
    try:
        obj: Any = importlib.import_module(module_name)
    except Exception as e:
        raise _UsageError(f"cannot import module {module_name!r}: {type(e).__name__}: {e}") from None
    for part in name.split("."):
        if not hasattr(obj, part):
            raise _UsageError(f"module {module_name!r} has no attribute {name!r}")
        obj = getattr(obj, part)
    try:
        reject_torch_function(obj, f"vjpkit check {target}")
    except TypeError as e:
        raise _UsageError(str(e)) from None
    apply = getattr(obj, "apply", None)
    if isinstance(obj, type) and callable(apply):
        return apply
    if not callable(obj):
        raise _UsageError(f"{target} is a {type(obj).__name__}, not a Function or a function")
    return obj
