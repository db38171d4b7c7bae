"""The record schemas of each command: which record kinds it reads, their fields and how each is checked.

`check_record` validates one parsed JSON value for a command and says what is wrong in words a user can act
on; the reader (apcscore.io.reader) adds the FILE:LINE. generate's per-record sampling overrides are
checked by SamplingParams' own checks (apcscore.config.RECORD_FIELDS), declared once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from apcscore.config import RECORD_FIELDS
from apcscore.errors import shown as _show

COMMANDS = ("score", "generate", "perplexity")
CHAT_ROLES = ("system", "user", "assistant", "tool")  # the roles of OpenAI-style chat messages


@dataclass(frozen=True, slots=True)
class Record:
    """One valid record of the dataset.

    index: 0-based position among the dataset's records (blank lines are not records).
    line: 1-based line number in the file.
    id: the record's "id" (a string or an int in the file, stored as str), else str(line).
    kind: which record kind matched ("prompt", "prompt_token_ids", "continuation", "choices",
        "messages", "text").
    fields: the validated fields of that kind (and generate's per-record overrides); never "id",
        never a null value.
    """

    index: int
    line: int
    id: str
    kind: str
    fields: dict


@dataclass(frozen=True, slots=True)
class InvalidRecord:
    """A record that cannot run; `message` is ``FILE:LINE: what is wrong (what to do)``."""

    index: int
    line: int
    id: str
    message: str


# ---------------------------------------------------------------- field checks (None = fine, else problem)

def is_int(v: Any) -> bool:
    """An int, not a bool."""
    return isinstance(v, int) and not isinstance(v, bool)


def _string(v: Any) -> str | None:
    return None if isinstance(v, str) else f"must be a string, got {_show(v)}"


def _nonempty_string(v: Any) -> str | None:
    if not isinstance(v, str):
        return f"must be a non-empty string, got {_show(v)}"
    return None if v else "must not be empty"


def _token_ids(v: Any) -> str | None:
    if not isinstance(v, list):
        return f"must be a list of token ids (integers >= 0), got {_show(v)}"
    if not v:
        return "must not be empty (give at least one token id)"
    for i, t in enumerate(v):
        if not is_int(t) or t < 0:
            return f"must hold integers >= 0, but item {i} is {_show(t)}"
    return None


def _choices(v: Any) -> str | None:
    if not isinstance(v, list):
        return f"must be a list of at least 2 non-empty strings, got {_show(v)}"
    if len(v) < 2:
        return f"must hold at least 2 choices, got {len(v)}"
    for i, c in enumerate(v):
        if not isinstance(c, str) or not c:
            return f"must hold non-empty strings, but item {i} is {_show(c)}"
    return None


def _index(v: Any) -> str | None:
    return None if is_int(v) else f"must be an integer index into 'choices', got {_show(v)}"


def _messages(v: Any) -> str | None:
    if not isinstance(v, list) or not v:
        return f"must be a non-empty list of {{\"role\": str, \"content\": str}} objects, got {_show(v)}"
    for i, m in enumerate(v):
        if not isinstance(m, dict):
            return f"item {i} must be an object {{\"role\": str, \"content\": str}}, got {_show(m)}"
        if not isinstance(m.get("role"), str) or not m["role"]:
            return f"item {i} needs a non-empty string 'role', got {_show(m.get('role'))}"
        if m["role"] not in CHAT_ROLES:
            return (f"item {i} has the role {_show(m['role'])}, which chat templates do not know "
                    f"(use one of {', '.join(CHAT_ROLES)})")
        if not isinstance(m.get("content"), str):
            return f"item {i} needs a string 'content', got {_show(m.get('content'))}"
    return None


Check = Callable[[Any], "str | None"]


# every field of a record kind -> (its check, how a kind's example writes it)
_FIELDS: dict[str, tuple[Check, str]] = {
    "prompt": (_string, "str"),
    "prompt_token_ids": (_token_ids, "[int, ...]"),
    "context": (_string, "str"),
    "continuation": (_nonempty_string, "str"),
    "choices": (_choices, "[str, ...]"),
    "answer": (_index, "int"),
    "messages": (_messages, '[{"role": str, "content": str}, ...]'),
    "text": (_string, "str"),
}
# record kind -> its fields, in the order a user would write them; each field but "context" (which continuation
# and choices share) says "this record is of this kind"
_KINDS = {"prompt": ("prompt",), "prompt_token_ids": ("prompt_token_ids",), "continuation": ("context", "continuation"),
          "choices": ("context", "choices", "answer"), "messages": ("messages",), "text": ("text",)}
_SIGNATURES = {kind: frozenset(fields) - {"context"} for kind, fields in _KINDS.items()}
_EXAMPLES = {kind: "{" + ", ".join(f'"{f}": {_FIELDS[f][1]}' for f in fields) + "}" for kind, fields in _KINDS.items()}
_COMMAND_KINDS = {
    "score": ("prompt", "prompt_token_ids", "continuation", "choices"),
    "generate": ("prompt", "prompt_token_ids", "messages"),
    "perplexity": ("text",),
}
# Per-record overrides of the command's sampling options, checked by SamplingParams' own checks.
_OPTIONAL = {
    "score": {},
    "perplexity": {},
    "generate": RECORD_FIELDS,
}

_KIND_FIELDS = {c: frozenset(f for k in kinds for f in _KINDS[k]) for c, kinds in _COMMAND_KINDS.items()}
# Fields many datasets name what a command reads as its text ("text" in most Hugging Face corpora, "instruction"
# in Alpaca-style sets): a record that matches no kind but has one gets the --columns hint that reads it.
_COLUMN_HINTS = {"prompt": ("text", "input", "instruction", "question"), "text": ("prompt", "content", "document")}
_KNOWN = {c: _KIND_FIELDS[c] | _OPTIONAL[c].keys() | {"id"} for c in COMMANDS}


def known_fields(command: str) -> frozenset[str]:
    """Every field a record of `command` may have (the targets `--columns` may map to)."""
    return frozenset(_KNOWN[command])


def accepted_kinds(command: str) -> str:
    """The record kinds `command` accepts, as one line for messages and help texts."""
    kinds = " | ".join(_EXAMPLES[k] for k in _COMMAND_KINDS[command])
    extra = f", each with optional {', '.join(_OPTIONAL[command])}" if _OPTIONAL[command] else ""
    return f'{kinds} (all with an optional "id"{extra})'


# ---------------------------------------------------------------- one record

_MESSAGE_KEYS = {"messages[].role", "messages[].content"}


def _column_hint(obj: dict, command: str) -> str:
    """`; to read the prompt from 'text', pass --columns prompt=text` where the record has a string field that
    datasets often use for the command's text field (_COLUMN_HINTS), else ""."""
    field = "prompt" if "prompt" in _KIND_FIELDS[command] else "text"
    column = next((c for c in _COLUMN_HINTS[field] if isinstance(obj.get(c), str)), None)
    return "" if column is None else f"; to read the {field} from {column!r}, pass --columns {field}={column}"


def check_record(obj: Any, command: str) -> tuple[str | None, str | None, dict, list[str]]:
    """Validate one parsed JSON value against the record kinds of `command`: (its id, None when it has no usable
    one; its kind, None when it matches none; its validated fields, empty unless it is valid; its problems)."""
    if not isinstance(obj, dict):
        return None, None, {}, [
            f"the record is {_show(obj)}, not a JSON object (write one object per line: {accepted_kinds(command)})"]
    problems: list[str] = []
    rid = None
    raw_id = obj.get("id")
    if raw_id is not None:
        if is_int(raw_id) or (isinstance(raw_id, str) and raw_id):
            rid = str(raw_id)
        else:
            problems.append(f"'id' must be a non-empty string or an integer, got {_show(raw_id)} "
                            "(fix the id or remove it to use the line number)")

    kinds = _COMMAND_KINDS[command]
    optional = _OPTIONAL[command]
    kind_fields = _KIND_FIELDS[command]
    present = {k for k, v in obj.items() if v is not None}
    claimed = [k for k in kinds if not _SIGNATURES[k].isdisjoint(present)]

    kind = None
    if not claimed:
        partial = sorted(present & kind_fields)
        have = f"it has only {', '.join(repr(f) for f in partial)}" if partial else \
            f"it has none of their fields (fields present: {', '.join(repr(f) for f in sorted(present)) or 'none'})"
        problems.append(f"the record matches no {command} record kind: {have}{_column_hint(obj, command)} "
                        f"(write one of: {accepted_kinds(command)})")
    elif len(claimed) > 1:
        parts = [f"{k} ({', '.join(repr(f) for f in sorted(_SIGNATURES[k] & present))})" for k in claimed]
        problems.append(f"the record has fields of two kinds at once: {' and '.join(parts)} "
                        f"(a record is exactly one of: {accepted_kinds(command)})")
    else:
        kind = claimed[0]
        required, example = _KINDS[kind], _EXAMPLES[kind]
        foreign = sorted(present & (kind_fields - set(required)))
        if foreign:
            problems.append(f"the record has fields of two kinds at once: it is a {kind} record "
                            f"({example}) but also has {', '.join(repr(f) for f in foreign)} "
                            f"(remove {'it' if len(foreign) == 1 else 'them'} or split the record)")
        missing = [f for f in required if f not in present]
        if missing:
            problems.append(f"a {kind} record needs {', '.join(repr(f) for f in missing)} "
                            f"(write it as {example})")
        for name in required:
            if name in present and (why := _FIELDS[name][0](obj[name])) is not None:
                problems.append(f"'{name}' {why} (a {kind} record is {example})")
        if (kind == "choices" and "answer" in present and _index(obj["answer"]) is None
                and _choices(obj.get("choices")) is None and not 0 <= obj["answer"] < len(obj["choices"])):
            problems.append(f"'answer' {obj['answer']} is not an index into the {len(obj['choices'])} "
                            f"choices (use 0 to {len(obj['choices']) - 1}; 0 is the first choice)")
    for name, check in optional.items():
        if name in present and (why := check(obj[name])) is not None:
            problems.append(f"'{name}' {why} (fix it, or remove it to use the command-line setting)")

    fields: dict = {}
    if kind is not None and not problems:
        fields = {name: obj[name] for name in _KINDS[kind]} | {name: obj[name] for name in optional if name in present}
        if kind == "messages":  # keep only what we read, so ignored keys cannot leak into templates
            fields["messages"] = [{"role": m["role"], "content": m["content"]} for m in obj["messages"]]
    return rid, kind, fields, problems


def unknown_fields(obj: Any, command: str, fields: dict) -> list[str]:
    """The fields of the record `obj` that `command` does not read (warned about, then ignored); of a valid
    messages record (`fields`, check_record's) also its messages' keys other than role and content."""
    if not isinstance(obj, dict):
        return []
    unknown = sorted(obj.keys() - _KNOWN[command])
    if "messages" in fields:
        unknown += sorted({f"messages[].{k}" for m in obj["messages"] for k in m} - _MESSAGE_KEYS)
    return unknown
