"""vjpkit beside any JAX from 0.4.38 on: one package knows the differences,
and a JAX that lacks an internal vjpkit needs fails at import, naming it."""

import pathlib
import re
import subprocess
import sys

import functions
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import vjpkit

# The package that runs (an installed wheel's, or a checkout's src/).
SRC = pathlib.Path(vjpkit.__file__).resolve().parent
INTERNALS = SRC / "_jax_internals"  # the package that knows JAX's internals and versions


def _internals_source() -> str:
    return "\n".join(path.read_text() for path in sorted(INTERNALS.glob("*.py")))


def _import_error_after(setup: str) -> str:
    """Runs ``setup`` (which removes something from JAX), then ``import vjpkit``, in a fresh process.

    The import must fail: returns the last line of the error it prints.
    """
    code = f"{setup}\nimport vjpkit\n"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode != 0
    return run.stderr.strip().splitlines()[-1]


def _newest_tested_jax() -> str:
    text = _internals_source()
    return re.search(r'^NEWEST_TESTED_JAX = "([0-9.]+)"', text, re.MULTILINE).group(1)


def test_missing_internal_name_fails_import_naming_it_and_the_newest_tested_jax():
    last = _import_error_after("import jax._src.core as core\ndel core.trace_ctx")
    assert last.startswith("ImportError: vjpkit needs jax._src.core.trace_ctx, which JAX ")
    assert f"tested with JAX 0.4.38 to {_newest_tested_jax()}" in last


def test_missing_internal_module_fails_import_naming_it():
    # jax.extend.core is the one module vjpkit imports that `import jax` has not.
    last = _import_error_after("import sys, jax.extend.core\nsys.modules['jax._src.interpreters.partial_eval'] = None")
    assert last.startswith("ImportError: vjpkit needs the module jax._src.interpreters.partial_eval, which JAX ")
    assert f"tested with JAX 0.4.38 to {_newest_tested_jax()}" in last


def test_missing_public_interpreter_name_fails_import_naming_it():
    last = _import_error_after("import jax.interpreters.ad as ad\ndel ad.primitive_transposes")
    assert last.startswith("ImportError: vjpkit needs jax.interpreters.ad.primitive_transposes")


@pytest.mark.parametrize(
    "path", sorted(str(p.relative_to(SRC)) for p in SRC.rglob("*.py") if INTERNALS not in p.parents)
)
def test_only_the_internals_package_reaches_into_jax_src_or_reads_the_jax_version(path):
    text = (SRC / path).read_text()
    assert not re.search(r"^\s*(from|import)\s+jax\._src", text, re.MULTILINE), path
    assert not re.search(r"\bjax\.(__version__|version\b)|jaxlib\.version", text), path


def test_every_private_jax_module_the_internals_package_uses_is_in_its_table():
    text = _internals_source()
    table = vjpkit._jax_internals.__doc__  # internals on purpose: this file tests that package
    modules = set(re.findall(r'_require_module\("jax\._src\.(?:interpreters\.)?([a-z_]+)"\)', text))
    assert modules, "no private module found: the test no longer reads the lookups"
    for module in modules:
        assert re.search(rf"^{module}\.\w+", table, re.MULTILINE), module


def test_vjpkit_replaces_the_code_of_no_jax_function():
    # detect_anomaly joins JAX's trace caches' key through public means on every JAX (XLA metadata before 0.8).
    from jax._src import config

    with vjpkit.detect_anomaly():
        jax.jit(functions.Square.apply)(jnp.ones(2)).block_until_ready()
    code = getattr(config.trace_context, "__code__", None)  # JAX 0.8 on: a compiled function
    assert code is None or pathlib.Path(code.co_filename).resolve() == pathlib.Path(config.__file__).resolve()
    assert not re.search(r"__code__\s*=[^=]", "\n".join(p.read_text() for p in SRC.rglob("*.py")))


def test_vjpkit_reads_no_frame_and_no_code_object():
    # Which differentiation or which vmap runs a rule is told by JAX (the call's own rules), never read from
    # the callers' frames, their code objects or the constants of JAX's code.
    source = "\n".join(p.read_text() for p in SRC.rglob("*.py"))
    assert not re.findall(r"_getframe|f_code|co_consts|__code__ *=", source)


class Linear(functions.Linear):
    """Its backward returns None for an input not differentiated."""

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        return (g @ w if ctx.needs_input_grad[0] else None), (g.T @ x if ctx.needs_input_grad[1] else None)


def test_jacrev_after_grad_of_all_inputs_differentiates_one_input_again():
    # JAX 0.5 to 0.7 call one backward rule again here, with other inputs
    # differentiated, and require the same result structure both times.
    x, w = jnp.arange(6.0).reshape(2, 3), jnp.ones((4, 3))
    jax.grad(lambda x, w: Linear.apply(x, w).sum(), argnums=(0, 1))(x, w)
    got = jax.jacrev(Linear.apply, argnums=1)(x, w)
    np.testing.assert_allclose(got, jax.jacrev(lambda x, w: x @ w.T, argnums=1)(x, w))
