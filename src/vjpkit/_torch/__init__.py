"""The torch bridge: ``from_torch``."""

from .callback import from_torch

__all__ = ["from_torch"]
