"""Token texts of a result file, for people to read (`apcscore show`, `compare --report-html`): where the run's
tokenizer is (its metadata), and each token's own piece of the text.

A result file stores token ids, not text. Callers load the tokenizer from where the run read it
(`models.loading.try_load_tokenizer`); io needs it only as an object with `decode`. When that folder is gone (a
file copied to another machine), they show ids (`id_pieces`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

Pieces = Callable[[list[int]], list[str]]  # token ids -> one text per token
_CONTEXT = 4  # tokens decoded before a token to get its own text right (a SentencePiece leading space)


def tokenizer_path(meta: dict[str, Any]) -> str | None:
    """The folder the run's tokenizer came from, as its metadata says (tokenizer.name_or_path, else model.path)."""
    for section, key in (("tokenizer", "name_or_path"), ("model", "path")):
        value = meta.get(section)
        value = value.get(key) if isinstance(value, dict) else None
        if isinstance(value, str) and value:
            return value
    return None


def token_pieces(tokenizer: Any, ids: list[int]) -> list[str]:
    """Each token's text: what decoding it after its few preceding tokens adds (special tokens kept), so a
    SentencePiece token keeps its leading space; `decode([id])` where that is not a clean extension (a byte-level
    token holding part of a character reads U+FFFD)."""
    out = []
    for i, t in enumerate(ids):
        context = ids[max(0, i - _CONTEXT):i]
        before = tokenizer.decode(context, skip_special_tokens=False) if context else ""
        after = tokenizer.decode(context + [t], skip_special_tokens=False)
        out.append(after[len(before):] if after.startswith(before) and not before.endswith("\ufffd")
                   else tokenizer.decode([t], skip_special_tokens=False))
    return out


def id_pieces(ids: list[int]) -> list[str]:
    """Token ids as placeholders, when no tokenizer is at hand."""
    return [f"⟨{t}⟩" for t in ids]


def pieces_for(tokenizer: Any | None) -> Pieces:
    """The token-text function of `tokenizer`, or ids when it is None."""
    return id_pieces if tokenizer is None else (lambda ids: token_pieces(tokenizer, ids))
