"""A Function's ops carry its class and method name in the compiled program's metadata.

Profilers (``jax.profiler``, TensorBoard, Perfetto) show each op's
``op_name``; under an outer ``jit`` a Function's forward, backward and jvp
ops must be findable there as ``MyFunction.forward``, ``.backward``, ``.jvp``.
"""

import re

import jax
import jax.numpy as jnp
from functions import Sin, SinWithJvp, fresh

X = jnp.array([0.5, -1.0, 2.0])


# Named for these tests: the names are what the tests look for.
MyFunction = fresh(Sin, "MyFunction")
WithJvp = fresh(SinWithJvp, "WithJvp")


def _op_names(fn, *args) -> dict[str, set[str]]:
    """op_name metadata of the optimized HLO, by the op's own name (its last part)."""
    text = jax.jit(fn).lower(*args).compile().as_text()
    names: dict[str, set[str]] = {}
    for name in re.findall(r'op_name="([^"]*)"', text):
        names.setdefault(name.rsplit("/", 1)[-1], set()).add(name)
    return names


def _named(names: set[str], scope: str) -> bool:
    return any(scope in name for name in names)


def test_forward_and_backward_ops_carry_the_class_and_method_name():
    names = _op_names(jax.value_and_grad(lambda x: MyFunction.apply(x).sum()), X)
    assert _named(names["sin"], "MyFunction.forward"), names
    assert _named(names["cos"], "MyFunction.backward"), names


def test_backward_ops_of_a_function_with_jvp_carry_the_name():
    names = _op_names(jax.value_and_grad(lambda x: WithJvp.apply(x).sum()), X)
    assert _named(names["sin"], "WithJvp.forward"), names
    assert _named(names["cos"], "WithJvp.backward"), names


def test_jvp_ops_carry_the_class_and_method_name():
    names = _op_names(lambda x: jax.jvp(WithJvp.apply, (x,), (jnp.ones(3),)), X)
    assert _named(names["sin"], "WithJvp.forward"), names
    assert _named(names["cos"], "WithJvp.jvp"), names
