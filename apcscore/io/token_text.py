"""Token texts of a result file, for people to read (`apcscore show`, `compare --report-html`): where the run's
tokenizer is (its metadata), and the text of its tokens.

A result file stores token ids, not text. Callers load the tokenizer from where the run read it
(`models.loading.try_load_tokenizer`); io needs it only as an object with `convert_ids_to_tokens` and `decode`.
When that folder is gone (a file copied to another machine), they show ids (`id_texts`).

**Bytes, not decode() per token** (docs/compare.md, `--report-html`, says it for users). A byte-level BPE
tokenizer splits a character of several UTF-8 bytes across tokens (`ě` is `Ä` + `Ľ`, bytes C4 + 9B), each of which
decodes alone to U+FFFD (`hlavní m��sto`). So each token's *bytes* are read from its vocabulary string (GPT-2's
byte-to-unicode table; SentencePiece's `▁` and `<0xE8>` byte tokens), and consecutive tokens are merged into *spans*
whose bytes are whole UTF-8 characters. Where that mapping does not give back the tokenizer's own decode, tokens are
decoded one by one (`token_pieces`). A token that is part of a character, alone (a top-K alternative), shows its
whole characters as text and every other byte as `<0xE8>`: `Ġå` (bytes 20 E5) reads ` <0xE5>`.
"""

from __future__ import annotations

import codecs
import re
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

_CONTEXT = 4  # tokens decoded before a token to get its own text right (a SentencePiece leading space)
_MAX_SPAN = 8  # tokens of one span at most: bytes that stay incomplete longer are shown as bytes
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@dataclass(frozen=True)
class TokenTexts:
    """The texts of a sequence of tokens.

    pieces: one per token, its own text (bytes that are not whole characters written `<0xE8>`).
    spans: (start, stop, text) covering the tokens in order: runs of tokens whose bytes are whole UTF-8 characters
    (one token where it is whole by itself), with their text.
    """

    pieces: list[str]
    spans: list[tuple[int, int, str]]

    def span_of(self, position: int) -> tuple[int, int, str]:
        """The span that holds token `position`."""
        return next(s for s in self.spans if s[0] <= position < s[1])


Texts = Callable[[list[int]], TokenTexts]  # token ids -> their texts


def tokenizer_path(meta: dict[str, Any]) -> str | None:
    """The folder the run's tokenizer came from, as its metadata says (tokenizer.name_or_path, else model.path)."""
    for section, key in (("tokenizer", "name_or_path"), ("model", "path")):
        value = meta.get(section)
        value = value.get(key) if isinstance(value, dict) else None
        if isinstance(value, str) and value:
            return value
    return None


# ----------------------------------------------------------------------------------------------------------
# Token bytes
# ----------------------------------------------------------------------------------------------------------


@lru_cache(maxsize=1)
def byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, read backwards: the character a byte-level BPE vocabulary writes for each byte
    (printable bytes as themselves, the others shifted to U+0100 and up: a space is `Ġ`, a newline `Ċ`) -> the
    byte. The table of transformers' `bytes_to_unicode` (tests/show checks they agree)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    shifted = [b for b in range(256) if b not in printable]  # in byte order, to U+0100, U+0101, ...
    return {chr(b): b for b in printable} | {chr(256 + n): b for n, b in enumerate(shifted)}


def _added(tokenizer: Any) -> dict[int, str]:
    """Added tokens (special tokens such as <|im_end|>) -> their text, which is not byte-mapped."""
    added = getattr(tokenizer, "added_tokens_decoder", {})
    return {int(i): str(getattr(t, "content", t)) for i, t in added.items()}


def _byte_level(token: str) -> bytes | None:
    table = byte_decoder()
    return bytes(table[c] for c in token) if set(token) <= table.keys() else None


def _sentencepiece(token: str) -> bytes:
    m = _BYTE_TOKEN.fullmatch(token)
    return bytes([int(m.group(1), 16)]) if m else token.replace("▁", " ").encode("utf-8")


def token_bytes(tokenizer: Any, ids: list[int]) -> list[bytes] | None:
    """Each token's bytes, read from the vocabulary (byte-level BPE, or SentencePiece with `<0x..>` byte tokens);
    None when neither mapping gives back the tokenizer's own decode of `ids` (another kind of tokenizer)."""
    if not ids:
        return []
    try:
        tokens = tokenizer.convert_ids_to_tokens(list(ids))
    except Exception:  # noqa: BLE001 - a tokenizer object without a vocabulary of strings: decode per token
        return None
    if not all(isinstance(t, str) for t in tokens):
        return None
    added = _added(tokenizer)
    want = tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)
    for read in (_byte_level, _sentencepiece):
        out = [added[i].encode("utf-8") if i in added else read(t) for i, t in zip(ids, tokens)]
        if any(b is None for b in out):
            continue
        text = b"".join(out).decode("utf-8", errors="replace")
        # SentencePiece drops the space it put before the first word (its `▁`)
        if text == want or (read is _sentencepiece and text.startswith(" ") and text[1:] == want):
            return out  # type: ignore[return-value]
    return None


# ----------------------------------------------------------------------------------------------------------
# Texts from bytes
# ----------------------------------------------------------------------------------------------------------


def _hex_bytes(err: UnicodeDecodeError) -> tuple[str, int]:
    return "".join(f"<0x{b:02X}>" for b in err.object[err.start:err.end]), err.end


codecs.register_error("apcscore-hex", _hex_bytes)


def piece(b: bytes) -> str:
    """A token's own text: its whole UTF-8 characters as text, every other byte as <0xE8>."""
    return b.decode("utf-8", errors="apcscore-hex")


def spans(pieces_bytes: list[bytes]) -> list[tuple[int, int, str]]:
    """Runs of consecutive tokens whose bytes are whole UTF-8 characters, with their text. A run whose bytes stay
    incomplete for _MAX_SPAN tokens, or turn invalid, ends there and shows its bytes (`piece`)."""
    out: list[tuple[int, int, str]] = []
    start, buf = 0, b""
    for j, b in enumerate(pieces_bytes):
        buf += b
        try:
            text = buf.decode("utf-8")
        except UnicodeDecodeError as e:
            if e.reason == "unexpected end of data" and j + 1 - start < _MAX_SPAN and j + 1 < len(pieces_bytes):
                continue  # the next token may complete the character
            text = piece(buf)
        out.append((start, j + 1, text))
        start, buf = j + 1, b""
    return out


def token_pieces(tokenizer: Any, ids: list[int]) -> list[str]:
    """Each token's text by decoding it after its few preceding tokens (special tokens kept), so a SentencePiece
    token keeps its leading space; `decode([id])` where that is not a clean extension. The fallback of
    `token_texts` for tokenizers whose vocabulary is not bytes (a token holding part of a character reads U+FFFD)."""
    out = []
    for i, t in enumerate(ids):
        context = ids[max(0, i - _CONTEXT):i]
        before = tokenizer.decode(context, skip_special_tokens=False) if context else ""
        after = tokenizer.decode(context + [t], skip_special_tokens=False)
        out.append(after[len(before):] if after.startswith(before) and not before.endswith("\ufffd")
                   else tokenizer.decode([t], skip_special_tokens=False))
    return out


def token_texts(tokenizer: Any, ids: list[int]) -> TokenTexts:
    """The tokens' texts: from their bytes, merged into spans of whole characters (see the module's docstring), or
    decoded one by one where the tokenizer's vocabulary is not bytes."""
    raw = token_bytes(tokenizer, ids)
    if raw is None:
        own = token_pieces(tokenizer, ids)
        return TokenTexts(own, [(i, i + 1, p) for i, p in enumerate(own)])
    return TokenTexts([piece(b) for b in raw], spans(raw))


def id_texts(ids: list[int]) -> TokenTexts:
    """Token ids as placeholders, when no tokenizer is at hand."""
    own = [f"⟨{t}⟩" for t in ids]
    return TokenTexts(own, [(i, i + 1, p) for i, p in enumerate(own)])


def texts_for(tokenizer: Any | None) -> Texts:
    """The token-text function of `tokenizer`, or ids when it is None."""
    return id_texts if tokenizer is None else (lambda ids: token_texts(tokenizer, ids))
