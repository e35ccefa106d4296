"""The core of vjpkit does not know that checking exists: only the public front imports it."""

import ast
import pathlib

import vjpkit

PACKAGE = pathlib.Path(vjpkit.__file__).parent
FRONT = {"__init__.py", "testing.py", "__main__.py"}  # re-export the checking package's public names


def imported_modules(path):
    """Every module (and, for ``from X import Y``, every ``X.Y``) that a source file imports."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = "." * node.level + (node.module or "")
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return names


def test_no_core_module_imports_the_checking_package():
    importers = sorted(
        path.name for path in PACKAGE.glob("*.py")
        if path.name not in FRONT and any("_checking" in name for name in imported_modules(path))
    )
    assert importers == []


def test_the_checking_package_modules_stay_small():
    sizes = {path.name: len(path.read_text().splitlines()) for path in (PACKAGE / "_checking").glob("*.py")}
    assert {name: n for name, n in sizes.items() if n > 700} == {}
