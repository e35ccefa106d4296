"""The bridge's one map between torch's dtypes and NumPy's (and so JAX's), both ways.

A torch dtype and a NumPy dtype correspond by name (``torch.float32`` and
``float32``, ``torch.bool`` and ``bool``); bfloat16, which NumPy lacks, is
JAX's (``ml_dtypes``). Torch is imported only by ``torch_dtype``, where a
caller already runs torch.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["jax_dtype", "numpy_dtype", "torch_dtype"]


def numpy_dtype(torch_dtype: Any) -> np.dtype:
    """The NumPy dtype of a torch dtype, exactly (``torch.float64`` is float64, with x64 or without)."""
    name = str(torch_dtype).removeprefix("torch.")
    return np.dtype(jnp.bfloat16 if name == "bfloat16" else name)


def jax_dtype(torch_dtype: Any) -> np.dtype:
    """The JAX dtype of a torch dtype, canonical (float64 is float32 without ``jax_enable_x64``)."""
    return np.dtype(jax.dtypes.canonicalize_dtype(numpy_dtype(torch_dtype)))


def torch_dtype(dtype: Any) -> Any:
    """The torch dtype of a NumPy or JAX dtype."""
    import torch

    return getattr(torch, np.dtype(dtype).name)
