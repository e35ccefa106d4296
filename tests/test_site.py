"""The docs site as a reader sees it: built with mkdocs, read back as HTML.

A strict build catches broken links and docstrings that cannot be parsed,
but not a page that builds and renders wrong: a fence the renderer does not
know shows its code as prose, reST markup shows literally, and the API
reference can list private names. These tests read the rendered pages.
"""

import html
import inspect
import pathlib
import re
import subprocess
import sys

import pytest

import vjpkit

pytest.importorskip("mkdocs", reason="building the site needs the docs extra")
pytest.importorskip("mkdocstrings", reason="building the site needs the docs extra")

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """The site built strictly into a temporary folder: page name -> HTML."""
    out = tmp_path_factory.mktemp("site")
    subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "--site-dir", str(out)],
                   cwd=ROOT, check=True, env={"NO_MKDOCS_2_WARNING": "1", "PATH": "", "PYTHONPATH": str(ROOT / "src")})
    pages = {}
    for page in DOCS.glob("*.md"):
        name = page.stem
        rendered = out / ("index.html" if name == "index" else f"{name}/index.html")
        pages[name] = rendered.read_text()
    return pages


def prose(page_html):
    """The page's text outside code blocks and inline code."""
    body = re.sub(r"<pre.*?</pre>|<code.*?</code>", " ", page_html, flags=re.S)
    return html.unescape(re.sub(r"<[^>]+>", " ", body))


def test_no_page_shows_a_fence_as_text(site):
    # Anywhere: in prose (an unknown fence) or inside a code block (a fence nested in an indented block).
    shown = {name: html.unescape(page).count("```") for name, page in site.items()}
    assert {name: n for name, n in shown.items() if n} == {}


def test_no_page_shows_restructuredtext_markup(site):
    markup = re.compile(r"Usage::|:(?:class|func|meth|attr|mod):`")
    found = {name: markup.findall(prose(page)) for name, page in site.items()}
    assert {name: m for name, m in found.items() if m} == {}


def test_every_code_block_of_a_page_renders_as_code(site):
    for name, page in site.items():
        source = (DOCS / f"{name}.md").read_text()
        fences = len(re.findall(r"^\s*```\w", source, flags=re.M))  # an opening fence names its language
        rendered = len(re.findall(r'<div class="(?:language-[\w-]+ )?highlight">', page))
        assert rendered >= fences, (name, fences, rendered)


def test_the_pytorch_originals_render_as_code_titled_pytorch(site):
    for name in ("porting", "cookbook"):
        titled = re.findall(r'<span class="filename">PyTorch</span>', site[name])
        assert len(titled) == (DOCS / f"{name}.md").read_text().count('```python title="PyTorch"') > 0, name


def test_the_api_reference_shows_only_public_names(site):
    anchors = re.findall(r'id="(vjpkit\.[^"]*)"', site["api"])
    assert anchors
    private = [a for a in anchors if any(part.startswith("_") for part in a.split(".")[1:])]
    assert private == []


def section(page_html, anchor):
    """The HTML of one object's own docstring on the API page: from its heading to the next object's."""
    start = page_html.index(f'id="{anchor}"')
    following = re.search(r'id="vjpkit\.', page_html[start + len(anchor) + 5:])
    return page_html[start:start + len(anchor) + 5 + following.start()] if following else page_html[start:]


# Objects of the API page whose docstrings have doctest examples (tests/test_docstrings.py holds them all to it).
WITH_EXAMPLES = [
    "vjpkit.Function", "vjpkit.Function.setup_context", "vjpkit.Function.backward", "vjpkit.Function.jvp",
    "vjpkit.Function.apply", "vjpkit.Function.cache_info", "vjpkit.function", "vjpkit.FunctionCtx",
    "vjpkit.FunctionCtx.saved_tensors", "vjpkit.FunctionCtx.needs_input_grad",
    "vjpkit.FunctionCtx.save_for_backward", "vjpkit.FunctionCtx.save_for_forward",
    "vjpkit.FunctionCtx.mark_non_differentiable", "vjpkit.FunctionCtx.set_materialize_grads",
    "vjpkit.FunctionCtx.mark_dirty", "vjpkit.once_differentiable", "vjpkit.from_torch", "vjpkit.VmapInfo",
    "vjpkit.CacheInfo", "vjpkit.clear_caches", "vjpkit.gradcheck", "vjpkit.gradgradcheck", "vjpkit.GradcheckError",
    "vjpkit.JacobianMismatch", "vjpkit.detect_anomaly", "vjpkit.testing.assert_gradcheck",
    "vjpkit.testing.assert_gradgradcheck", "vjpkit.testing.assert_matches_torch",
    "vjpkit.testing.assert_port_matches_original", "vjpkit.testing.port_differences", "vjpkit.testing.random_inputs",
]
_PYCON = re.compile(r'<div class="language-pycon highlight"><pre>.*?</pre></div>', re.S)


def code_text(block_html):
    return html.unescape(re.sub(r"<[^>]+>", "", block_html))


def doctest_chunks(anchor):
    """The docstring's doctest examples, as the source has them: each run of lines from a ``>>>`` line
    to the next blank line (the prompts, their continuations and the expected output)."""
    obj = vjpkit
    for part in anchor.split(".")[1:]:
        obj = inspect.getattr_static(obj, part)
    doc = inspect.getdoc(obj.fget if isinstance(obj, property) else getattr(obj, "__func__", obj))
    chunks = re.findall(r"^(>>> .*?)(?:\n\s*\n|\Z)", inspect.cleandoc(re.sub(r"^ +", "", doc, flags=re.M)),
                        re.S | re.M)
    assert chunks, anchor
    return chunks


@pytest.mark.parametrize("anchor", WITH_EXAMPLES)
def test_the_api_page_shows_each_doctest_example_as_code_with_its_output(site, anchor):
    rendered = "\n".join(code_text(block) for block in _PYCON.findall(section(site["api"], anchor)))
    assert rendered, f"{anchor}: no Python console block"
    for chunk in doctest_chunks(anchor):
        assert chunk in rendered, f"{anchor}: not shown as code:\n{chunk}"


def test_the_api_page_shows_the_outputs_of_the_function_example(site):
    (first, *_) = [code_text(block) for block in _PYCON.findall(section(site["api"], "vjpkit.Function"))]
    assert ">>> jax.grad(lambda x: Cube.apply(x).sum())(x).tolist()\n[3.0, 12.0, 27.0]\n" in first


def test_no_prompt_shows_outside_code_on_the_api_page(site):
    assert ">>>" not in prose(site["api"])


def attributes_table(section_html):
    """The names listed in a docstring's Attributes section, as the page shows them (a table)."""
    found = re.search(r"<p>(?:<[^>]+>)*Attributes:(?:</[^>]+>)*</p>\s*<table>(.*?)</table>", section_html, re.S)
    assert found, "no Attributes table"
    rows = re.findall(r'<tr class="doc-section-item">\s*<td>(.*?)</td>', found.group(1), re.S)
    return [html.unescape(re.sub(r"<[^>]+>", "", row)).strip() for row in rows]


@pytest.mark.parametrize(("anchor", "names"), [
    ("vjpkit.CacheInfo", ["programs", "maxsize", "hits", "misses"]),
    ("vjpkit.VmapInfo", ["batch_size", "randomness"]),
    ("vjpkit.FunctionCtx", ["needs_input_grad", "saved_tensors"]),
    ("vjpkit.Function", ["jit", "cache_size", "host", "vmap_method", "generate_vmap_rule"]),
    ("vjpkit.GradcheckError", ["mismatches"]),
])
def test_the_api_page_lists_the_attributes_of_a_class(site, anchor, names):
    assert attributes_table(section(site["api"], anchor)) == names


def test_every_catalogue_id_the_source_links_to_is_an_anchor_of_the_errors_page(site):
    from test_misuse_catalogue import linked_ids  # noqa: PLC0415 - the ids in src/, read by that test's helper

    anchors = set(re.findall(r'<h3 id="([^"]+)"', site["errors"]))
    linked = linked_ids()
    assert linked
    assert {ident: where for ident, where in linked.items() if ident not in anchors} == {}
