"""The one domain exception: a problem the user can fix, shown as a clear error by the CLI; and `shown`,
how a user's value appears in such a message."""

import json
from typing import Any


class ApcscoreError(Exception):
    """A user-facing error: bad input, bad option, unsupported model. The CLI prints it and exits.

    `exit_code` is 2 for input and usage errors (nothing was run), 1 otherwise.
    """

    def __init__(self, message: str, exit_code: int = 2) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def shown(v: Any) -> str:
    """A value as the user wrote it: JSON for scalars, the JSON type for containers."""
    if isinstance(v, dict):
        return "an object" if v else "an empty object"
    if isinstance(v, (list, tuple)):
        return "a list" if v else "an empty list"
    try:
        text = json.dumps(v, ensure_ascii=False)
    except TypeError:  # not a JSON value (a value given from Python)
        text = repr(v)
    return text if len(text) <= 40 else text[:37] + "..."


def count(n: int, noun: str) -> str:
    """`n` and the noun, plural unless n is 1: `count(1, "row")` is "1 row", `count(2_000, "row")` "2,000 rows"."""
    return f"{n:,} {noun}" if n == 1 else f"{n:,} {noun}s"


def a(word: str) -> str:
    """The word after its indefinite article: "a score", "an eval"."""
    return f"{'an' if word[:1].lower() in 'aeiou' else 'a'} {word}"
