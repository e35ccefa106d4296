"""Trace mode's op table: the JAX rule of each torch function and method, by ``resolve_name``'s name.

The table is its parts together: ``arithmetic.py`` (elementwise maths and
activations, reductions, linear algebra, norms) and ``shapes.py`` (shapes,
views, indexing, gather/scatter, sorting). Each part fills its own ``Table``
(``base.py``, with the helpers the rules share); no part knows another.
"""

from __future__ import annotations

from typing import Callable

from . import arithmetic, shapes
from .base import Untraceable
from .shapes import set_item

__all__ = ["RULES", "VIEWS", "Untraceable", "set_item"]

RULES: dict[str, Callable] = {**arithmetic.RULES, **shapes.RULES}
# The names whose results are views of an argument in torch (an in-place write through one would alias).
VIEWS: frozenset[str] = frozenset(arithmetic.VIEWS | shapes.VIEWS)
