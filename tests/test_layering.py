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
        str(path.relative_to(PACKAGE)) for path in PACKAGE.rglob("*.py")
        if path.name not in FRONT and "_checking" not in path.parts
        and any("_checking" in name for name in imported_modules(path))
    )
    assert importers == []


# The core from top to bottom, as a call meets it: the front, the dispatch, the program, the
# user-method runner (and host Functions' methods), the ctx, outputs and residuals, the tie, the
# linear_call primitive, then the helpers everything shares. Each imports only modules below it.
CORE = [
    "_function", "_dispatch", "_program", "_runner", "_host", "_ctx", "_outputs", "_tie", "_linear_call",
    "_anomaly", "_once", "_args", "_sharding", "_tree", "_caches", "_callback_errors", "_jax_internals", "_site",
]
OUTSIDE_THE_CORE = {"_from_torch.py", "_torch_device.py", "_torch_original.py", "_torch_shapes.py", "_torch_trace.py",
                    "_torch_special.py", "_torch_traced.py", "_torch_ops.py", "_torch_ops_shapes.py",
                    "cpp_extension.py"}  # built on the core


def source_files(name):
    """The files of core module ``name``: one, or a package's (``_jax_internals``)."""
    path = PACKAGE / name
    return sorted(path.glob("*.py")) if path.is_dir() else [PACKAGE / f"{name}.py"]


def core_modules_imported_by(name):
    """The core modules that ``name``'s source imports (``from . import _x``, ``from ._x import y``)."""
    found = set()
    for imported in set().union(*map(imported_modules, source_files(name))):
        for part in imported.split("."):
            if part in CORE:
                found.add(part)
    return found - {name}


def test_every_core_module_has_a_place_in_the_order():
    modules = {path.name for path in PACKAGE.glob("*.py")} - FRONT - OUTSIDE_THE_CORE
    modules |= {path.parent.name for path in PACKAGE.glob("*/__init__.py")} - {"_checking"}
    assert sorted(modules) == sorted(name if (PACKAGE / name).is_dir() else f"{name}.py" for name in CORE)


def test_core_modules_import_only_modules_below_them():
    upward = [
        f"{name} imports {above}"
        for at, name in enumerate(CORE)
        for above in sorted(core_modules_imported_by(name) & set(CORE[:at]))
    ]
    assert upward == []


def test_every_module_stays_small():
    sizes = {str(path.relative_to(PACKAGE)): len(path.read_text().splitlines()) for path in PACKAGE.rglob("*.py")}
    assert {name: n for name, n in sizes.items() if n > 700} == {}
