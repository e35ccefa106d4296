"""Gradient checks that read well in a test suite.

For example:

```python
from vjpkit.testing import assert_gradcheck, assert_gradgradcheck, random_inputs

def test_linear_gradients():
    x, w = random_inputs("f64[20,20] f64[30,20]")
    assert_gradcheck(Linear.apply, (x, w), atol=1e-4)

def test_exp_second_derivative():
    assert_gradgradcheck(Exp.apply, random_inputs("f64[5]"))

def test_linear_port_matches_pytorch():
    assert_matches_torch(TorchLinear, Linear, random_inputs("f64[4,3] f64[2,3]"))
```

The key difference to calling ``vjpkit.gradcheck`` directly is that a
failure is an ``AssertionError`` carrying the full report (the mismatching
output and input, the worst element, both Jacobians), so a test runner shows
it as a test failure with the report as its message. None of these needs
pytest: they work in any test runner, or none.
"""

from ._checking.assertions import assert_gradcheck, assert_gradgradcheck
from ._checking.port_check import assert_port_matches_original, port_differences
from ._checking.random_inputs import random_inputs
from ._checking.torch_parity import assert_matches_torch

__all__ = [
    "assert_gradcheck",
    "assert_gradgradcheck",
    "assert_matches_torch",
    "assert_port_matches_original",
    "port_differences",
    "random_inputs",
]
