"""The public API's docstrings: each shows how it is used, in examples that run.

The ``Examples:`` sections are doctests (``>>>`` lines with their output),
which a plain ``python -m pytest`` runs (``--doctest-modules`` on
src/vjpkit, pyproject.toml; src/conftest.py). These tests check that every
public name has them, and that what the doctest run leaves out holds none.
"""

import inspect
import os
import pathlib
import re
import subprocess
import sys

import pytest

import vjpkit
from vjpkit import cpp_extension, testing

SOURCE = pathlib.Path(vjpkit.__file__).resolve().parent

PUBLIC = {f"vjpkit.{name}": getattr(vjpkit, name) for name in vjpkit.__all__
          if name not in ("cpp_extension", "testing")}
PUBLIC |= {f"vjpkit.testing.{name}": getattr(testing, name) for name in testing.__all__}
PUBLIC |= {"vjpkit.testing": testing}
# What users call or read on a Function class, and on its ctx.
MEMBERS = {f"vjpkit.Function.{name}": getattr(vjpkit.Function, name)
           for name in ("apply", "cache_info", "setup_context", "backward", "jvp")}
MEMBERS |= {f"vjpkit.FunctionCtx.{name}": inspect.getattr_static(vjpkit.FunctionCtx, name)
            for name in ("save_for_backward", "save_for_forward", "saved_tensors", "needs_input_grad",
                         "mark_non_differentiable", "set_materialize_grads", "mark_dirty")}


def examples(obj) -> str:
    """The docstring's ``Examples:`` section (Google style), or ""."""
    doc = inspect.getdoc(obj.fget if isinstance(obj, property) else obj) or ""
    found = re.search(r"^Examples:\n(.*?)(?=^\S|\Z)", doc, re.S | re.M)
    return found.group(1) if found else ""


@pytest.mark.parametrize("name", sorted(PUBLIC | MEMBERS))
def test_every_public_name_shows_a_runnable_example(name):
    assert ">>> " in examples((PUBLIC | MEMBERS)[name]), f"{name}: no Examples section with >>> lines"


# A compiled kernel needs a C++ compiler, and seconds to compile: these examples are fenced code, saying so.
NOT_DOCTESTS = {"vjpkit.cpp_extension": cpp_extension, "vjpkit.cpp_extension.FfiKernel": cpp_extension.FfiKernel,
                "vjpkit.cpp_extension.load_inline": cpp_extension.load_inline}


@pytest.mark.parametrize("name", sorted(NOT_DOCTESTS))
def test_an_example_that_is_no_doctest_says_why(name):
    doc = inspect.getdoc(NOT_DOCTESTS[name])
    assert re.search(r"not (?:run as )?a doctest\b.*C\+\+ compiler", doc, re.S), name


@pytest.mark.parametrize("name", sorted(PUBLIC | MEMBERS))
def test_no_public_docstring_keeps_a_fenced_example_of_use(name):
    # Examples of use are doctests now; "For example:" with a fenced block was the old form.
    obj = (PUBLIC | MEMBERS)[name]
    doc = inspect.getdoc(obj.fget if isinstance(obj, property) else obj) or ""
    assert "For example:" not in doc, name


# Imports every module of the package with torch blocked; prints those that fail for want of it.
_NEEDS_TORCH = """
import importlib, pathlib, sys
sys.modules["torch"] = None  # import torch raises ModuleNotFoundError
import vjpkit
root = pathlib.Path(vjpkit.__file__).parent
for path in sorted(root.rglob("*.py")):
    name = ".".join(("vjpkit", *path.relative_to(root).with_suffix("").parts)).removesuffix(".__init__")
    if path.name != "__main__.py":
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name != "torch":
                raise
            print(path.relative_to(root))
"""


def test_modules_that_need_torch_to_import_hold_no_examples():
    # Without torch, src/conftest.py leaves these modules out of the doctest run: nothing may be lost.
    done = subprocess.run([sys.executable, "-c", _NEEDS_TORCH], capture_output=True, text=True, check=True,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"})
    modules = done.stdout.split()
    assert "_torch/trace.py" in modules  # trace mode's modules need it
    assert [name for name in modules if ">>>" in (SOURCE / name).read_text()] == []
