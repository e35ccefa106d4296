"""Every Python block of the README and the docs site runs.

Each page's ```python blocks run in page order in one namespace of their own,
so a later block may use what an earlier one defined, as a reader would. A
block whose first line is ``# not run: <reason>`` (a multi-host launch, say)
is only compiled. Pages with a runner of their own are left to it:
``docs/porting.md`` (tests/test_porting_doc.py), ``docs/errors.md``
(tests/test_misuse_catalogue.py) and ``docs/cookbook.md``
(tests/test_cookbook.py).
"""

from __future__ import annotations

import importlib
import inspect
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
OWN_RUNNER = {"porting.md", "errors.md", "cookbook.md"}
PAGES = [ROOT / "README.md"] + sorted(p for p in (ROOT / "docs").glob("*.md") if p.name not in OWN_RUNNER)
_BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
NOT_RUN = "# not run: "
# What a block may need that the README's first command does not install (CI installs it all).
OPTIONAL = ("torch", "equinox", "flax", "optax", "sklearn", "matplotlib")


def _blocks(page: pathlib.Path) -> list[str]:
    return [m.group(1) for m in _BLOCK.finditer(page.read_text())]


CASES = [(page, i) for page in PAGES for i in range(len(_BLOCK.findall(page.read_text())))]


def _ident(case: tuple) -> str:
    page, i = case
    return f"{page.relative_to(ROOT)}-block{i + 1}"


_namespaces: dict = {}
_missing: dict = {}  # page -> the optional module one of its blocks lacked


@pytest.mark.parametrize("case", CASES, ids=[_ident(c) for c in CASES])
def test_block_runs(case):
    page, index = case
    code = _blocks(page)[index]
    name = str(page.relative_to(ROOT))
    if code.startswith(NOT_RUN):
        assert len(code.splitlines()[0]) > len(NOT_RUN) + 10, f"{name}: say why the block is not run"
        compile(code, f"{name} (block {index + 1})", "exec")
        return
    if page in _missing:  # a later block builds on what the skipped one defined
        pytest.skip(f"{name} block {index + 1} follows a block that needs {_missing[page]}, which is not installed")
    namespace = _namespaces.setdefault(page, {"__name__": f"docs_{page.stem}"})
    try:
        exec(compile(code, f"{name} (block {index + 1})", "exec"), namespace)
    except ModuleNotFoundError as e:
        if e.name and e.name.split(".")[0] in OPTIONAL:
            _missing[page] = e.name
            pytest.skip(f"{name} block {index + 1} needs {e.name}, which is not installed")
        raise


def test_every_page_with_code_is_run_or_has_its_own_runner():
    for name in OWN_RUNNER:
        page = ROOT / "docs" / name
        if page.exists():
            runner = {"porting.md": "test_porting_doc.py", "errors.md": "test_misuse_catalogue.py",
                      "cookbook.md": "test_cookbook.py"}[name]
            assert (ROOT / "tests" / runner).exists(), f"docs/{name} has no runner"


# ---------------------------------------------------------------------------
# The docs name vjpkit's private modules and what is in them (`_tie._Tie`, `_torch/trace.py`): each must exist.

_PRIVATE_NAME = re.compile(r"`(_[a-z_]+(?:/[a-z_]+)*)(\.py|(?:\.[A-Za-z_][A-Za-z_0-9]*)+)`")
# torch's own private names, which the from_torch table lists by their torch name.
_TORCH_NAMES = {"_segment_reduce"}


def _private_names() -> list[tuple[str, str, str]]:
    return sorted({
        (page.name, module, rest)
        for page in sorted((ROOT / "docs").glob("*.md"))
        for module, rest in _PRIVATE_NAME.findall(page.read_text())
        if module not in _TORCH_NAMES and module not in {"__init__", "__main__"}
    })


def _has(value, name: str) -> bool:
    """Whether ``value`` has attribute ``name``: a class's own, or one its ``__init__`` sets (``self.name = ...``)."""
    if hasattr(value, name):
        return True
    init = getattr(value, "__init__", None) if isinstance(value, type) else None
    sets = re.compile(rf"self\.{name}\s*[:=]")
    return init is not None and hasattr(init, "__code__") and sets.search(inspect.getsource(init)) is not None


@pytest.mark.parametrize(("page", "module", "rest"), _private_names())
def test_a_private_name_the_docs_cite_exists(page, module, rest):
    src = ROOT / "src" / "vjpkit"
    if rest == ".py":  # a module, named by its file (in the table of its package)
        assert list(src.rglob(f"{module.rsplit('/', 1)[-1]}.py")), f"{page} names {module}.py, which is not in vjpkit"
        return
    assert (src / module).with_suffix(".py").is_file() or (src / module).is_dir(), (
        f"{page} names {module}{rest}, but vjpkit has no module {module}"
    )
    value = importlib.import_module("vjpkit." + module.replace("/", "."))
    for name in rest.lstrip(".").split("."):
        assert _has(value, name), f"{page} names {module}{rest}, but {name} is not in {value!r}"
        value = getattr(value, name, None)
