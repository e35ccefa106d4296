"""The doctests of vjpkit's docstrings: pytest's configuration for src/.

A plain ``python -m pytest`` collects src/vjpkit with ``--doctest-modules``
(pyproject.toml), so every ``>>>`` example of the public API's docstrings
runs, with NORMALIZE_WHITESPACE and ELLIPSIS (an expected message may be
wrapped over several lines). This file is not part of the package (not in the
wheel). What it adds:

- Without torch, the modules that cannot be imported without it (trace
  mode's) are not collected. They hold no examples
  (tests/test_docstrings.py checks it), so nothing is left out.
- An example that imports torch is skipped where torch is not installed, with
  that reason, except with ``CI=true``: CI installs torch and allows no skip
  (tests/conftest.py), so there it runs, and fails if torch is missing.
- While an example runs, JAX's traceback filtering is off: with it on, JAX
  adds a note to an exception passing through a transformation (on Python
  3.11 and newer), which would be part of the message the example shows.
- Where the vjpkit imported is not this folder's (the tests run from an
  unpacked sdist against the installed wheel, as CI does), pytest would refuse
  to import these files as a second copy of the modules; there the doctests
  run from the installed modules, the same release's docstrings.
"""

import importlib.util
import os
import pathlib
import re

import jax
import pytest

import vjpkit

HERE = pathlib.Path(__file__).resolve().parent
_EXAMPLE_IMPORTS_TORCH = re.compile(r"^\s*(?:import torch\b|from torch\b)", re.M)


def needs_torch(path: pathlib.Path) -> bool:
    """Whether importing the module at ``path`` (a file of src/vjpkit) fails for want of torch."""
    name = ".".join(path.relative_to(HERE).with_suffix("").parts).removesuffix(".__init__")
    try:
        importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name != "torch":
            raise
        return True
    return False


if importlib.util.find_spec("torch") is None:
    collect_ignore = [str(path.relative_to(HERE)) for path in sorted((HERE / "vjpkit").rglob("*.py"))
                      if path.name != "__main__.py" and needs_torch(path)]

if pathlib.Path(vjpkit.__file__).resolve().parent != HERE / "vjpkit":
    # pytest's own switch (_pytest/pathlib.py): use the module already imported under that name.
    os.environ["PY_IGNORE_IMPORTMISMATCH"] = "1"


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Skips an example that needs torch where torch is not installed, except in CI."""
    if not isinstance(item, pytest.DoctestItem) or item.dtest is None:
        return
    needs_torch = any(_EXAMPLE_IMPORTS_TORCH.search(example.source) for example in item.dtest.examples)
    if needs_torch and importlib.util.find_spec("torch") is None and os.environ.get("CI") != "true":
        pytest.skip("this example needs torch, which is not installed")


@pytest.fixture(autouse=True)
def exceptions_as_raised():
    """JAX's traceback filtering off for one example: an exception's text is its message alone."""
    before = jax.config.jax_traceback_filtering
    jax.config.update("jax_traceback_filtering", "off")
    try:
        yield
    finally:
        jax.config.update("jax_traceback_filtering", before)
