"""docs/porting.md: every code block on the page runs.

Blocks fenced ```python are vjpkit code: they run in order in one namespace,
after the page's first block (the prelude), so a later block may use what an
earlier one defined. Blocks fenced ```python title="PyTorch" are the PyTorch originals:
they run in order in a namespace of their own, with the imports the PyTorch
docs assume. One test per block, named by its section heading.
"""

import pathlib
import re

import jax
import pytest

# The page's PyTorch originals run beside their ports (CI installs torch==2.13.0).
pytest.importorskip("torch", reason="the porting page's PyTorch originals need torch")

DOC = pathlib.Path(__file__).resolve().parent.parent / "docs" / "porting.md"
TORCH_PRELUDE = """
import torch
import torch.nn.functional as F
from torch.autograd import Function
from torch.autograd.function import once_differentiable
"""
_BLOCK = re.compile(r'^```python( title="PyTorch")?\n(.*?)^```', re.S | re.M)
_HEADING = re.compile(r"^#{2,3} (.+)$", re.M)


def blocks(text: str) -> list[tuple[str, str, str]]:
    """(id, kind, code) for every python block; kind is 'jax' or 'torch'."""
    found, seen = [], {}
    for match in _BLOCK.finditer(text):
        headings = _HEADING.findall(text, 0, match.start())
        section = re.sub(r"[^a-z0-9]+", "-", (headings[-1] if headings else "top").lower()).strip("-")
        kind = "torch" if match.group(1) else "jax"
        seen[(section, kind)] = seen.get((section, kind), 0) + 1
        found.append((f"{section}-{kind}-{seen[(section, kind)]}", kind, match.group(2)))
    return found


BLOCKS = blocks(DOC.read_text())


@pytest.fixture(scope="module")
def outcomes():
    """Runs every block in page order; maps block id to None or the error."""
    namespaces = {"jax": {"__name__": "porting_md"}, "torch": {"__name__": "porting_md_torch"}}
    exec(compile(TORCH_PRELUDE, "torch prelude", "exec"), namespaces["torch"])
    results = {}
    for ident, kind, code in BLOCKS:
        try:
            exec(compile(code, f"docs/porting.md ({ident})", "exec"), namespaces[kind])
            results[ident] = None
        except Exception as e:  # noqa: BLE001 - reported by the block's test
            results[ident] = f"{type(e).__name__}: {e}"
    return results


def test_the_page_has_both_kinds_of_block():
    kinds = [kind for _, kind, _ in BLOCKS]
    assert kinds[0] == "jax" and kinds.count("torch") >= 10 and kinds.count("jax") >= 25


@pytest.mark.parametrize("ident", [ident for ident, _, _ in BLOCKS])
def test_block_runs(ident, outcomes):
    source = next(code for i, _, code in BLOCKS if i == ident)
    if "jax.shard_map" in source and not hasattr(jax, "shard_map"):
        pytest.skip("this JAX lacks jax.shard_map (JAX 0.6 and later); the page shows the current API")
    assert outcomes[ident] is None, f"{ident}:\n{outcomes[ident]}"


def test_compute_and_select_recipe_is_the_double_where_whose_second_derivative_is_finite(outcomes):
    # A single jnp.where(mask, f(x), x) gives NaN second derivatives wherever f overflows off the mask.
    text = DOC.read_text()
    assert "`x = jnp.where(mask, f(jnp.where(mask, x, safe)), x)`" in text
    assert "`x = jnp.where(mask, f(x), x)`" not in text
    (ident,) = [i for i, _, code in BLOCKS if "def elu_like(double_where)" in code]
    assert outcomes[ident] is None, outcomes[ident]  # its asserts: finite with two wheres, NaN with one
