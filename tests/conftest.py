"""Shared pytest configuration: hypothesis profiles.

``default`` keeps the property-based tests (tests/test_properties.py) within
CI's time budget: a fixed number of derandomized examples, so CI runs are
reproducible. ``thorough`` runs at least 10,000 examples of each property:

    VJPKIT_HYPOTHESIS_PROFILE=thorough python -m pytest tests/test_properties.py
"""

import os

from hypothesis import HealthCheck, settings

# JAX compiles on first use of a program: per-example times vary by orders of
# magnitude, which is not slowness of the data generation.
_JAX = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

settings.register_profile("default", max_examples=150, derandomize=True, print_blob=True, **_JAX)
settings.register_profile("thorough", max_examples=10_000, print_blob=True, **_JAX)
settings.load_profile(os.environ.get("VJPKIT_HYPOTHESIS_PROFILE", "default"))
