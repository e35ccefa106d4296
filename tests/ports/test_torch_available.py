import pytest


def test_torch_is_installed_for_the_ports_corpus():
    pytest.importorskip("torch", reason="the ports corpus compares with PyTorch: pip install torch==2.13.0")
