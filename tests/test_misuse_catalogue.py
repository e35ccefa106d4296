"""The misuse catalogue (docs/errors.md): every example on that page raises
exactly the message shown there.

docs/errors.md lists every error PyTorch raises for misusing a custom
Function with its vjpkit counterpart. Each ``### `id` `` section holds a
```python block (run after the page's first block, the prelude) and a
```text block: ``ExceptionType: message``, or its beginning followed by
``...``. One test per section, named by its id.
"""

import pathlib
import re

import jax
import pytest

# Internals on purpose: a host Function's own exception, carried beside JAX's runtime error.
from vjpkit import _callback_errors

DOC = pathlib.Path(__file__).resolve().parent.parent / "docs" / "errors.md"

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


@pytest.mark.parametrize("ident", sorted(ENTRIES))
def test_example_raises_the_documented_message(ident):
    code, expected = ENTRIES[ident]
    got = raised(PRELUDE, code)
    if expected.endswith("..."):
        assert got.startswith(expected[:-3]), f"{ident}: raised\n{got}\nexpected\n{expected}"
    else:
        assert got == expected, f"{ident}: raised\n{got}\nexpected\n{expected}"


def test_every_pytorch_misuse_has_a_section():
    assert REQUIRED <= set(ENTRIES), sorted(REQUIRED - set(ENTRIES))


_NAMES_THE_CLASS = re.compile(
    r"\b(Bad|Leaky|NoBackward|ReverseOnly|OnlyForward|Square|Empty|NoArray|NoReturn|HostCode|Mul|NoCtx|Kw|Exp)\b"
)


@pytest.mark.parametrize("ident", sorted(set(ENTRIES) - {"unknown-decorator-option"}))
def test_message_names_the_function_class(ident):
    code, expected = ENTRIES[ident]
    defined = re.search(r"^class (\w+)", code, re.M).group(1)
    assert defined in expected, f"{ident}: the message does not name {defined}"
