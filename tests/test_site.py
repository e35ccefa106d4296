"""The docs site as a reader sees it: built with mkdocs, read back as HTML.

A strict build catches broken links and docstrings that cannot be parsed,
but not a page that builds and renders wrong: a fence the renderer does not
know shows its code as prose, reST markup shows literally, and the API
reference can list private names. These tests read the rendered pages.
"""

import html
import pathlib
import re
import subprocess
import sys

import pytest

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
