"""The ports compare vjpkit with PyTorch: without torch they are not collected.

``test_torch_available.py`` then reports one skip, which CI (where torch is
installed and a skip fails) never sees.
"""

import importlib.util

import pytest

if importlib.util.find_spec("torch") is None:
    collect_ignore_glob = ["test_port_*.py", "test_ports_from_torch.py", "test_ports_traced.py", "port_checks.py",
                           "megatron_script.py",
                           "allgather_script.py"]


@pytest.fixture(scope="session")
def process_group(tmp_path_factory):
    """A one-rank gloo process group, so that originals calling torch.distributed run in this process."""
    import torch

    store = tmp_path_factory.mktemp("gloo") / "store"
    torch.distributed.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    yield
    torch.distributed.destroy_process_group()


@pytest.fixture
def needs(case, request):
    """What a ``FROM_TORCH_CASES`` case asks for (``process_group=True``), set up around its test."""
    if case.get("process_group"):
        request.getfixturevalue("process_group")
