"""How vjpkit's modules stand on each other.

The core does not know that checking exists (only the public front imports
it), nor what is built on it: ``from_torch``'s bridge (the subpackage
``_torch``) and ``cpp_extension``, which use the core's names without an
underscore. No module imports itself back through others, and none imports an
underscore name from a module of another package.
"""

import ast
import pathlib

import vjpkit

PACKAGE = pathlib.Path(vjpkit.__file__).parent
FRONT = {"__init__.py", "testing.py", "__main__.py"}  # re-export the checking package's public names


def module_name(path):
    """``vjpkit._torch.ops.base`` for its file; a package by its ``__init__.py``."""
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(path): path for path in PACKAGE.rglob("*.py")}


def package_of(module):
    """The package a module belongs to: a package's ``__init__.py`` belongs to the package itself."""
    return module if MODULES[module].name == "__init__.py" else module.rsplit(".", 1)[0]


def imports(module):
    """``(imported module, name or None)`` for every vjpkit import statement in ``module``, at any depth.

    ``from X import y`` imports module ``X.y`` where that is a module, else the name ``y`` of ``X``.
    """
    found = []
    for node in ast.walk(ast.parse(MODULES[module].read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package_of(module).split(".")
                base = base[:len(base) - node.level + 1] + ([node.module] if node.module else [])
                source = ".".join(base)
            else:
                source = node.module or ""
            for alias in node.names:
                child = f"{source}.{alias.name}"
                found.append((child, None) if child in MODULES else (source, alias.name))
        elif isinstance(node, ast.Import):
            found.extend((alias.name, None) for alias in node.names)
    return [(source, name) for source, name in found if source in MODULES]


GRAPH = {module: sorted({source for source, _ in imports(module)}) for module in MODULES}


def test_no_core_module_imports_the_checking_package():
    importers = sorted(
        str(path.relative_to(PACKAGE)) for path in PACKAGE.rglob("*.py")
        if path.name not in FRONT and "_checking" not in path.parts
        and any(source.startswith("vjpkit._checking") for source in GRAPH[module_name(path)])
    )
    assert importers == []


def test_no_import_cycles():
    """Every import statement counts, at module level or inside a function."""
    cycles, done = [], set()

    def visit(module, path):
        if module in path:
            cycles.append(" -> ".join(path[path.index(module):] + [module]))
            return
        if module in done:
            return
        for imported in GRAPH[module]:
            visit(imported, path + [module])
        done.add(module)

    for module in sorted(MODULES):
        visit(module, [])
    assert cycles == []


def test_no_private_names_imported_across_packages():
    """A module of another package (``vjpkit._torch.device`` of ``vjpkit._host``) takes names without an
    underscore; a private module itself may be imported (``from .. import _host``)."""
    reached = sorted(
        f"{module} imports {name} from {source}"
        for module in MODULES for source, name in imports(module)
        if name is not None and name.startswith("_") and not name.startswith("__")
        and package_of(source) != package_of(module)
    )
    assert reached == []


# The core from top to bottom, as a call meets it: the front, the dispatch, the program, the
# user-method runner, the class's description (and host Functions' methods), the ctx, outputs
# and residuals, the tie, the linear_call primitive, then the helpers everything shares. Each
# imports only modules below it.
CORE = [
    "_function", "_dispatch", "_program", "_call", "_runner", "_spec", "_host", "_ctx", "_outputs", "_tie",
    "_linear_call",
    "_anomaly", "_once", "_args", "_sharding", "_tree", "_caches", "_callback_errors", "_jax_internals", "_site",
]
# Built on the core, with the core's names without an underscore: C++ kernels, and from_torch's bridge.
BUILT_ON_THE_CORE = ["_torch", "cpp_extension"]
# The bridge (``vjpkit._torch``) from top to bottom: ``from_torch`` (its ``__init__``), trace mode's fronts,
# callback mode, its callbacks on XLA's buffers, its output shapes, trace mode's dispatching stand-in, the calls
# it answers without a rule, what a stand-in holds, the op table, the original read once, the dtype map. Each
# imports only modules below it.
BRIDGE = ["__init__", "traced", "callback", "device", "shapes", "trace", "special", "standin", "ops", "origin",
          "dtypes"]


def unit(module, package):
    """``module``'s place in ``package``'s order: its first name under ``package`` (a subpackage is one)."""
    if module == package:
        return "__init__"
    if not module.startswith(package + "."):
        return None
    return module[len(package) + 1:].split(".")[0]


def units_imported_by(name, package, order):
    """The units of ``order`` (in ``package``) that unit ``name``'s modules import."""
    own = [m for m in MODULES if unit(m, package) == name]
    return {unit(source, package) for m in own for source in GRAPH[m]} & set(order) - {name}


def test_every_module_has_a_place_in_an_order():
    top = {m.removeprefix("vjpkit.") for m in MODULES if m.count(".") == 1} - {"testing", "__main__"}
    assert sorted(top - {"_checking"}) == sorted(CORE + BUILT_ON_THE_CORE)
    assert sorted({unit(m, "vjpkit._torch") for m in MODULES if unit(m, "vjpkit._torch")}) == sorted(BRIDGE)


def test_core_modules_import_only_modules_below_them():
    upward = [
        f"{name} imports {above}"
        for at, name in enumerate(CORE)
        for above in sorted(units_imported_by(name, "vjpkit", CORE) & set(CORE[:at]))
    ]
    assert upward == []


def test_no_core_module_imports_what_is_built_on_it():
    reached = sorted(
        f"{module} imports {source}"
        for module in MODULES if unit(module, "vjpkit") in CORE
        for source in GRAPH[module] if unit(source, "vjpkit") in BUILT_ON_THE_CORE
    )
    assert reached == []


def test_what_is_built_on_the_core_takes_its_names_without_an_underscore():
    reached = sorted(
        f"{module} imports {name} from {source}"
        for module in MODULES if unit(module, "vjpkit") in BUILT_ON_THE_CORE
        for source, name in imports(module)
        if name is not None and name.startswith("_") and unit(source, "vjpkit") in CORE
    )
    assert reached == []


def test_bridge_modules_import_only_modules_below_them():
    upward = [
        f"{name} imports {above}"
        for at, name in enumerate(BRIDGE)
        for above in sorted(units_imported_by(name, "vjpkit._torch", BRIDGE) & set(BRIDGE[:at]))
    ]
    assert upward == []


def test_every_module_stays_small():
    sizes = {str(path.relative_to(PACKAGE)): len(path.read_text().splitlines()) for path in PACKAGE.rglob("*.py")}
    assert {name: n for name, n in sizes.items() if n > 700} == {}
