"""The stop rule of a completion, shared by both engines: `stop_tokens` (end-of-sequence and stop token ids) and
`stop_string_cut` (stop strings, through the incremental detokenizer)."""

from __future__ import annotations

from apcscore.engine.detokenizer import IncrementalDetokenizer, find_stop
from apcscore.engine.step import SamplingParams


def stop_tokens(params: SamplingParams, eos_token_ids: set[int]) -> set[int]:
    """The token ids that end a completion: its stop_token_ids, and the model's end-of-sequence ids unless
    ignore_eos. The stopping token is part of the completion (finish reason "stop")."""
    return set(params.stop_token_ids) | (set() if params.ignore_eos else eos_token_ids)


def stop_string_cut(detokenizer: IncrementalDetokenizer, token_ids: list[int], prompt_len: int,
                    stop: tuple[str, ...]) -> int | None:
    """Where the completion's text ends at its first stop string, or None: decodes only the new tokens' window
    (engine/detokenizer.py), so a whole completion costs O(n). token_ids: prompt and completion so far."""
    searched = len(detokenizer.text)
    detokenizer.update(token_ids, start=prompt_len)
    return find_stop(detokenizer.text, stop, searched)
