"""docs/cookbook.md: every code block runs, by the porting page's rules.

Blocks fenced ```python are vjpkit code, run in page order in one namespace
after the page's first block; blocks fenced ```python title="PyTorch" are the
PyTorch originals, run in order in a namespace of their own. One test per
block, named by its section heading.
"""

import pathlib

import jax
import pytest

# The page's PyTorch originals run beside their ports (CI installs torch==2.13.0).
pytest.importorskip("torch", reason="the cookbook's PyTorch originals need torch")

from test_porting_doc import TORCH_PRELUDE, blocks  # noqa: E402  # one block reader for both pages

DOC = pathlib.Path(__file__).resolve().parent.parent / "docs" / "cookbook.md"
BLOCKS = blocks(DOC.read_text())
SECTIONS = [
    "autograd-inside-backward-one-jax-vjp",
    "parameter-gradients-delivered-by-side-effect",
    "randomness-a-key-argument-the-same-noise-in-backward",
    "distributed-collectives-under-shard-map",
    "custom-fwd-custom-bwd-and-autocast-cast-nothing",
    "implicit-differentiation-fixed-points-and-solvers",
    "surrogate-spikes-and-class-level-hyperparameters",
]


@pytest.fixture(scope="module")
def outcomes():
    """Runs every block in page order; maps block id to None or the error."""
    namespaces = {"jax": {"__name__": "cookbook_md"}, "torch": {"__name__": "cookbook_md_torch"}}
    exec(compile(TORCH_PRELUDE, "torch prelude", "exec"), namespaces["torch"])
    results = {}
    for ident, kind, code in BLOCKS:
        try:
            exec(compile(code, f"docs/cookbook.md ({ident})", "exec"), namespaces[kind])
            results[ident] = None
        except Exception as e:  # noqa: BLE001 - reported by the block's test
            results[ident] = f"{type(e).__name__}: {e}"
    return results


def test_every_section_has_a_pytorch_original_and_a_port():
    for section in SECTIONS:
        assert f"{section}-torch-1" in [ident for ident, _, _ in BLOCKS], section
        assert f"{section}-jax-1" in [ident for ident, _, _ in BLOCKS], section


def test_the_porting_page_links_here():
    porting = DOC.with_name("porting.md").read_text()
    assert "(cookbook.md)" in porting


@pytest.mark.parametrize("ident", [ident for ident, _, _ in BLOCKS])
def test_block_runs(ident, outcomes):
    source = next(code for i, _, code in BLOCKS if i == ident)
    if "jax.shard_map" in source and not hasattr(jax, "shard_map"):
        pytest.skip("this JAX lacks jax.shard_map (JAX 0.6 and later); the page shows the current API")
    assert outcomes[ident] is None, f"{ident}:\n{outcomes[ident]}"
