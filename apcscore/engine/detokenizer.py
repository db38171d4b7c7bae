"""Incremental detokenization of a completion, for stop strings: O(tokens) over a whole completion.

Decoding the whole completion after every new token (to look for stop strings) costs O(n^2). Like vLLM's
detokenizer, `IncrementalDetokenizer` decodes only a short trailing window: tokens [prefix, read) were
already turned into text and give the window its context (a SentencePiece leading space, a byte-level
token that completes a character), and the new text is what decoding [prefix, end) adds to decoding
[prefix, read). While the window ends inside a character (the decoded text ends with U+FFFD), the offsets
stay; the complete characters before it are still emitted. The text equals a full decode of the tokens
(tests/engine/test_detokenizer.py checks tricky tokenizations), and each token is decoded a bounded number of times.
"""

from __future__ import annotations

from typing import Any

REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """The text of a growing token list, extended token by token (`skip_special_tokens=True`, as the engine's
    completion text)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.text = ""
        self._prefix = 0  # window start: tokens [prefix, read) are context whose text is in self.text
        self._read = 0
        self._pending = 0  # characters of the unfinished window already in self.text

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True) if ids else ""

    def update(self, token_ids: list[int], start: int = 0) -> None:
        """Extend the text to all of `token_ids[start:]` (the completion; the same list as at the last call,
        grown at its end)."""
        first = start + self._prefix
        context = self._decode(token_ids[first:start + self._read])
        window = self._decode(token_ids[first:])
        if not window.startswith(context):  # a tokenizer that rewrites the context (rare): a longer window
            self._prefix = 0
            context = self._decode(token_ids[start:start + self._read])
            window = self._decode(token_ids[start:])
        new = window[len(context):]
        if new.endswith(REPLACEMENT):  # ends inside a character: emit what is complete, keep the window open
            stable = new.rstrip(REPLACEMENT)
            added = stable[self._pending:]
            self._pending = max(self._pending, len(stable))
        else:
            added = new[self._pending:]
            self._prefix, self._read, self._pending = self._read, len(token_ids) - start, 0
        self.text += added


def find_stop(text: str, stops: list[str], searched: int) -> int | None:
    """The first index where a stop string starts in `text`, looking only at matches that end past `searched`
    (text[:searched] was searched before and held none), or None."""
    hits = [i for s in stops if (i := text.find(s, max(0, searched - len(s) + 1))) >= 0]
    return min(hits) if hits else None
