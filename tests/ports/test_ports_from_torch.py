"""Every ported Function equals its PyTorch original run unported through ``vjpkit.from_torch``.

Each ``test_port_*.py`` module lists its cases in ``FROM_TORCH_CASES``: the
original, the port, the arguments (arrays are traced, the rest static) and
optionally ``argnums`` (default: every floating array), ``second_order``,
``in_axes`` (and ``vmap_args``, batched inputs for them), ``atol``, and
``process_group`` (the original calls ``torch.distributed``: it runs on a
one-rank gloo group). Both run in one jitted program
(``assert_port_matches_original``), under ``jax.jit(jax.grad)`` and, with
``in_axes``, under ``jax.vmap``.
"""

import importlib
import pathlib

import pytest
import torch

from vjpkit.testing import assert_port_matches_original

MODULES = sorted(p.stem for p in pathlib.Path(__file__).parent.glob("test_port_*.py"))
CASES = [
    pytest.param(case, id=f"{name.removeprefix('test_port_')}-{case['original'].__name__}-{k}")
    for name in MODULES
    for k, case in enumerate(getattr(importlib.import_module(name), "FROM_TORCH_CASES", []))
]


# torch's reentrant checkpoint warns when it runs without gradients, as from_torch's forward-only callback runs it.
pytestmark = pytest.mark.filterwarnings("ignore:None of the inputs have requires_grad=True:UserWarning")


@pytest.fixture(scope="module")
def process_group(tmp_path_factory):
    """A one-rank gloo process group, so that originals calling torch.distributed run in this process."""
    store = tmp_path_factory.mktemp("gloo") / "store"
    torch.distributed.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    yield
    torch.distributed.destroy_process_group()


@pytest.fixture
def needs(case, request):
    if case.get("process_group"):
        request.getfixturevalue("process_group")


@pytest.mark.parametrize("case", CASES)
def test_original_through_from_torch_matches_port_under_jit_grad(case, needs):
    assert_port_matches_original(case["port"], case["original"], *case["args"], argnums=case.get("argnums"),
                                 second_order=case.get("second_order", False), atol=case.get("atol", 1e-6))


@pytest.mark.parametrize("case", [c for c in CASES if "in_axes" in c.values[0]])
def test_original_through_from_torch_matches_port_under_vmap(case, needs):
    args = case.get("vmap_args", case["args"])
    assert_port_matches_original(case["port"], case["original"], *args, argnums=case.get("argnums"),
                                 in_axes=case["in_axes"], atol=case.get("atol", 1e-6))


def test_every_port_module_lists_its_from_torch_cases():
    missing = [m for m in MODULES if not getattr(importlib.import_module(m), "FROM_TORCH_CASES", [])]
    assert missing == []
