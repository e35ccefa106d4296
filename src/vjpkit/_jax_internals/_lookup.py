"""Looking up what vjpkit needs in JAX: an ImportError naming anything missing, and the modules looked in."""

from __future__ import annotations

import importlib
from typing import Any

import jax

# The newest JAX that vjpkit's whole test suite passed with (the oldest is
# pyproject.toml's floor, 0.4.38).
NEWEST_TESTED_JAX = "0.12.0.1"

# The running JAX's release, for cache keys only (a library compiled against
# one JAX's FFI headers is rebuilt for another); vjpkit compares no versions.
JAX_RELEASE: str = jax.__version__


def _missing(what: str) -> ImportError:
    return ImportError(
        f"vjpkit needs {what}, which JAX {jax.__version__} does not have. vjpkit was "
        f"tested with JAX 0.4.38 to {NEWEST_TESTED_JAX}: install a JAX in that range "
        f"(pip install 'jax<={NEWEST_TESTED_JAX}'), or a vjpkit release that supports this JAX."
    )


def _require(owner: Any, name: str, where: str) -> Any:
    """``owner.name``, or an ImportError that says what is missing and what was tested."""
    try:
        return getattr(owner, name)
    except AttributeError:
        raise _missing(f"{where}.{name}") from None


def _require_module(path: str) -> Any:
    try:
        return importlib.import_module(path)
    except ImportError:
        raise _missing(f"the module {path}") from None


# Public in every supported JAX: the primitive machinery _call.py, _linear_call.py
# and _tie.py build on, checked here so that their loss is reported as the others'.
ad = _require_module("jax.interpreters.ad")
batching = _require_module("jax.interpreters.batching")
mlir = _require_module("jax.interpreters.mlir")
Primitive = _require(_require_module("jax.extend.core"), "Primitive", "jax.extend.core")
for _module, _where, _names in (
    (ad, "jax.interpreters.ad", ("Zero", "instantiate_zeros", "is_undefined_primal", "primitive_jvps",
                                 "primitive_transposes")),
    (batching, "jax.interpreters.batching", ("fancy_primitive_batchers", "bdim_at_front")),
    (mlir, "jax.interpreters.mlir", ("register_lowering", "lower_fun")),
    (jax.core, "jax.core", ("ShapedArray",)),
):
    for _name in _names:
        _require(_module, _name, _where)
ShapedArray = jax.core.ShapedArray

_core = _require_module("jax._src.core")
_config = _require_module("jax._src.config")
_pe = _require_module("jax._src.interpreters.partial_eval")
_ad = _require_module("jax._src.interpreters.ad")
_pjit = _require_module("jax._src.pjit")

