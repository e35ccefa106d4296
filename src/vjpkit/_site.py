"""The docs site's addresses that vjpkit's messages point to: the one place that builds them.

Every error of the misuse catalogue (``docs/errors.md``, one ``### `id` ``
section per misuse) ends with ``see_catalogue(id)``: a link to its own
section on the site. tests/test_misuse_catalogue.py checks that each
section's message ends with its link, and that every id linked from the
source is a section of the page (tests/test_site.py: an anchor of the built
page).
"""

SITE = "https://vjpkit.github.io/vjpkit/"


def page(name: str) -> str:
    """The address of a page of the site: ``page("porting")`` is ``https://vjpkit.github.io/vjpkit/porting/``."""
    return f"{SITE}{name}/"


def see_catalogue(entry: str) -> str:
    """The sentence that ends the message of the catalogue's ``entry``: ``See <its address>``.

    No punctuation follows the address, so that a terminal's link ends where
    the address does. Call it with the id as a literal string: the tests
    find the ids in the source.
    """
    return f"See {page('errors')}#{entry}"
