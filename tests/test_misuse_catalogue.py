"""The misuse catalogue (docs/errors.md): every example on that page raises
exactly the message shown there.

docs/errors.md lists every error PyTorch raises for misusing a custom
Function with its vjpkit counterpart. Each ``### `id` `` section holds a
```python block (run after the page's first block, the prelude) and a
```text block: ``ExceptionType: message``, where ``[...]`` stands for a part
left out (JAX's report, a file and line). One test per section, named by its
id. Each message ends with a link to its own section
(``vjpkit._site.see_catalogue``), and every id the source links to is a
section (tests/test_site.py: an anchor of the built page, too).
"""

import ast
import pathlib
import re

import jax
import pytest

# Internals on purpose: a host Function's own exception, carried beside JAX's runtime error;
# and the link that ends each message.
from vjpkit import _callback_errors
from vjpkit._site import see_catalogue

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "errors.md"
SOURCE = ROOT / "src" / "vjpkit"

# Every misuse PyTorch reports for a custom Function (issue 7's list, and the
# rest of PyTorch's custom-Function errors) must keep its section.
REQUIRED = {
    "too-many-gradients", "too-few-gradients", "list-of-gradients", "non-array-gradient",
    "gradient-for-a-static-input", "wrong-shape", "mark-dirty-a-non-input", "save-a-non-array",
    "no-backward-under-grad", "no-jvp-under-forward-mode", "once-differentiable-differentiated-twice",
    "dirty-input-returned-unchanged", "ctx-used-after-the-call", "leaked-array-used-after-the-call",
    "save-for-forward-a-non-array", "mark-non-differentiable-a-non-array", "jvp-wrong-count",
    "jvp-wrong-shape", "jvp-non-array-tangent", "no-forward", "missing-ctx-attribute",
}

_BLOCK = re.compile(r"```(python|text)\n(.*?)```", re.S)
# JAX appends this to errors that pass through its API boundary.
_JAX_NOTE = "\n--------------------\nFor simplicity, JAX has removed its internal frames"


def parse(text: str) -> tuple[str, dict]:
    """(prelude, {id: (code, expected)}) from the page."""
    prelude = _BLOCK.search(text).group(2)
    entries = {}
    for section in re.split(r"^### ", text, flags=re.M)[1:]:
        ident = re.match(r"`([a-z0-9-]+)`", section).group(1)
        blocks = dict((kind, body) for kind, body in _BLOCK.findall(section))
        entries[ident] = (blocks["python"], blocks["text"].strip())
    return prelude, entries


def raised(prelude: str, code: str) -> str:
    """``ExceptionType: message`` of what the example raises."""
    namespace: dict = {"__name__": "errors_md"}
    exec(compile(prelude, "docs/errors.md (prelude)", "exec"), namespace)
    start = _callback_errors.mark()
    try:
        exec(compile(code, "docs/errors.md", "exec"), namespace)
    except Exception as e:  # noqa: BLE001 - the message is what is tested
        host = _callback_errors.carried_since(start, "host")
        if isinstance(e, jax.errors.JaxRuntimeError) and host:
            # A host Function's error: the host's own exception (the runtime's text around it differs by backend).
            return f"{type(host[-1]).__name__}: {host[-1]}"
        return f"{type(e).__name__}: {str(e).split(_JAX_NOTE)[0]}"
    return "(nothing raised)"


PRELUDE, ENTRIES = parse(DOC.read_text())


LEFT_OUT = "[...]"


def shown(expected: str, got: str) -> bool:
    """Whether ``got`` is the message ``expected`` shows, each ``[...]`` standing for any text."""
    pattern = ".*".join(map(re.escape, expected.split(LEFT_OUT)))
    return re.fullmatch(pattern, got, flags=re.S) is not None


@pytest.mark.parametrize("ident", sorted(ENTRIES))
def test_example_raises_the_documented_message(ident):
    code, expected = ENTRIES[ident]
    got = raised(PRELUDE, code)
    assert shown(expected, got), f"{ident}: raised\n{got}\nexpected\n{expected}"


# What may follow the link: JAX's report, quoted after vjpkit's text (a JAX error type's text ends with a link of
# JAX's own).
_QUOTED_AFTER = "\n\nJAX's report:\n"


@pytest.mark.parametrize("ident", sorted(ENTRIES))
def test_message_ends_with_the_link_to_its_own_section(ident):
    # The message shown is the one raised (the test above), so the raised one ends with it too.
    link = see_catalogue(ident)
    assert link == f"See https://vjpkit.github.io/vjpkit/errors/#{ident}"
    expected = ENTRIES[ident][1]
    assert expected.count(link) == 1, ident
    before, after = expected.split(link)
    assert before.endswith(" "), ident  # a sentence of its own
    assert after == "" or after.startswith(_QUOTED_AFTER), ident


def linked_ids() -> dict:
    """Every catalogue id the source links to (``see_catalogue("id")``), with where: {id: [file:line]}."""
    found: dict = {}
    for path in sorted(SOURCE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "see_catalogue":
                where = f"{path.relative_to(SOURCE)}:{node.lineno}"
                (argument,) = node.args
                assert isinstance(argument, ast.Constant) and isinstance(argument.value, str), (
                    f"{where}: see_catalogue takes the id as a literal string (this test reads it)")
                found.setdefault(argument.value, []).append(where)
    return found


def test_every_id_the_source_links_to_is_a_section():
    linked = linked_ids()
    assert len(linked) >= len(ENTRIES)  # the search found the calls
    assert {ident: where for ident, where in linked.items() if ident not in ENTRIES} == {}


def test_every_section_is_linked_from_the_source():
    assert sorted(set(ENTRIES) - set(linked_ids())) == []


def test_every_pytorch_misuse_has_a_section():
    assert REQUIRED <= set(ENTRIES), sorted(REQUIRED - set(ENTRIES))


_NAMES_THE_CLASS = re.compile(
    r"\b(Bad|Leaky|NoBackward|ReverseOnly|Square|Empty|NoArray|NoReturn|HostCode|Mul|NoCtx|Kw|Exp)\b"
)


@pytest.mark.parametrize("ident", sorted(set(ENTRIES) - {"unknown-decorator-option"}))
def test_message_names_the_function_class(ident):
    code, expected = ENTRIES[ident]
    defined = re.search(r"^class (\w+)", code, re.M).group(1)
    assert defined in expected, f"{ident}: the message does not name {defined}"
