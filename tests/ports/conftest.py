"""The ports compare vjpkit with PyTorch: without torch they are not collected.

``test_torch_available.py`` then reports one skip, which CI (where torch is
installed and a skip fails) never sees.
"""

import importlib.util

if importlib.util.find_spec("torch") is None:
    collect_ignore_glob = ["test_port_*.py", "test_ports_from_torch.py", "test_ports_traced.py", "port_checks.py",
                           "megatron_script.py",
                           "allgather_script.py"]
