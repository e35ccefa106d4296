"""Every ported Function equals its PyTorch original run unported through ``vjpkit.from_torch``.

Each ``test_port_*.py`` module lists its cases in ``FROM_TORCH_CASES``: the
original, the port, the arguments (arrays are traced, the rest static) and
optionally ``argnums`` (default: every floating array), ``second_order``,
``in_axes`` (and ``vmap_args``, batched inputs for them), ``atol``,
``from_torch`` (the options the original needs, ``reentrant=True`` or
``copy_inputs=True``: :func:`through_from_torch` passes them, in every mode)
and ``process_group`` (the original calls ``torch.distributed``: it runs on a
one-rank gloo group, the ``needs`` fixture of ``conftest.py``). Both run in one jitted program
(``assert_port_matches_original``), under ``jax.jit(jax.grad)`` and, with
``in_axes``, under ``jax.vmap``.
"""

import importlib
import pathlib

import pytest

import vjpkit
from vjpkit.testing import assert_port_matches_original

MODULES = sorted(p.stem for p in pathlib.Path(__file__).parent.glob("test_port_*.py"))
CASES = [
    pytest.param(case, id=f"{name.removeprefix('test_port_')}-{case['original'].__name__}-{k}")
    for name in MODULES
    for k, case in enumerate(getattr(importlib.import_module(name), "FROM_TORCH_CASES", []))
]


def through_from_torch(case, mode="callback"):
    """The case's original through ``vjpkit.from_torch`` in ``mode``, with the options the case gives."""
    return vjpkit.from_torch(case["original"], mode=mode, **case.get("from_torch", {}))


# torch's reentrant checkpoint warns when it runs without gradients, as from_torch's forward-only callback runs it.
pytestmark = pytest.mark.filterwarnings("ignore:None of the inputs have requires_grad=True:UserWarning")


@pytest.mark.parametrize("case", CASES)
def test_original_through_from_torch_matches_port_under_jit_grad(case, needs):
    assert_port_matches_original(case["port"], through_from_torch(case), *case["args"], argnums=case.get("argnums"),
                                 second_order=case.get("second_order", False), atol=case.get("atol", 1e-6))


@pytest.mark.parametrize("case", [c for c in CASES if "in_axes" in c.values[0]])
def test_original_through_from_torch_matches_port_under_vmap(case, needs):
    args = case.get("vmap_args", case["args"])
    assert_port_matches_original(case["port"], through_from_torch(case), *args, argnums=case.get("argnums"),
                                 in_axes=case["in_axes"], atol=case.get("atol", 1e-6))


def test_every_port_module_lists_its_from_torch_cases():
    missing = [m for m in MODULES if not getattr(importlib.import_module(m), "FROM_TORCH_CASES", [])]
    assert missing == []
