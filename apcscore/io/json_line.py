"""One line of a JSONL dataset: decoded as UTF-8 and parsed strictly (io/reader.py's conventions), and the
one check JSON itself cannot make, an unpaired UTF-16 surrogate escape."""
from __future__ import annotations

import json
import re
from typing import Any


class _BadConstant(ValueError):
    pass


def _reject_constant(name: str) -> None:
    raise _BadConstant(f"{name} is not valid JSON (write a number, a string or null instead)")


def _object_pairs(pairs: list[tuple[str, Any]]) -> dict:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen: set[str] = set()
        dup = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise _BadConstant(f"duplicate key {dup!r} in one object (keep only one of them)")
    return obj


_DECODER = json.JSONDecoder(parse_constant=_reject_constant, object_pairs_hook=_object_pairs)


class NotUtf8(ValueError):
    """A line that does not decode as UTF-8."""


# A \uD800..\uDFFF escape: JSON pairs a high and a low one into one character, but a lone one parses into a
# Python str that is not text (it cannot be encoded as UTF-8, so the tokenizer would refuse the whole batch).
# Only lines with such an escape need searching (a raw surrogate cannot be in a line that decodes as UTF-8).
SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
SURROGATE = re.compile("[\ud800-\udfff]")


def _lone_surrogate(obj: Any, where: str = "") -> str | None:
    """The place (`prompt`, `messages[0].content`, a key) of the first string holding an unpaired surrogate."""
    if isinstance(obj, str):
        return where or "the value" if SURROGATE.search(obj) else None
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else ()
    for key, value in items:
        if isinstance(key, str) and SURROGATE.search(key):
            return f"the key {key.encode('utf-8', 'backslashreplace').decode()!r}"
        place = f"{where}[{key}]" if isinstance(key, int) else f"{where}.{key}" if where else key
        found = _lone_surrogate(value, place)
        if found:
            return found
    return None


def surrogate_problem(obj: Any) -> str | None:
    """The problem of a parsed record holding an unpaired surrogate, else None."""
    place = _lone_surrogate(obj)
    return None if place is None else (
        f"{place} holds an unpaired UTF-16 surrogate escape (\\uD800..\\uDFFF without its pair), which is not "
        "text (write the character itself, or a complete pair)")


def parse_line(raw: bytes, file_offset: int) -> Any:
    """Decode and parse one line; raise ValueError (`NotUtf8` for a decoding error) with the message."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        bad = raw[e.start:e.start + 4].hex(" ")
        raise NotUtf8(f"invalid UTF-8 at byte offset {e.start} of the line "
                      f"(offset {file_offset + e.start} in the file; bytes {bad}) (save the file as UTF-8)") from None
    try:
        return _DECODER.decode(text)
    except json.JSONDecodeError as e:
        hint = "write each record as one complete JSON object on one line"
        if e.msg.startswith("Extra data"):
            rest = text[e.pos:]
            hint = "one record per line: put a line break between two objects"
            if not rest.strip():  # only space that JSON does not count as space (a form feed, U+00A0, ...)
                hint = (f"after the object the line holds {ascii(rest[0])[1:-1]}, which JSON does not count as "
                        "space: remove it")
        what = e.msg.removesuffix(" at") + (" there" if e.msg.endswith(" at") else "")  # "... starting at" + pos
        raise ValueError(f"invalid JSON at column {e.colno}: {what} ({hint})") from None
    except _BadConstant as e:
        raise ValueError(f"invalid JSON: {e}") from None
    except RecursionError:
        raise ValueError("invalid JSON: nested too deeply (flatten the record)") from None
