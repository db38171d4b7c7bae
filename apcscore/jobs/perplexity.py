"""`apcscore perplexity`: perplexity of long texts with rolling windows (token, word and byte level).

A record `{"id"?, "text": str}` becomes the sequence `S = [prefix] + tokens(text)` (prefix: BOS, else EOS), so each
of the N text tokens `S[1..N]` has a context and is scored exactly once. A window that scores `S[a:b]` is one
engine request of `S[max(0, b-1-window) : b]` (at most `window + 1` tokens), scored from its first new token; the
first scores `S[1 : min(window, N) + 1]`, each next one ends `stride` tokens further. How this matches lm-eval's
`loglikelihood_rolling` (stride = window) and the transformers perplexity guide (stride < window), the columns
and the summary's aggregation: docs/eval_jobs.md, "apcscore perplexity".
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace
from typing import Any

import pyarrow as pa

from apcscore.engine import numerics
from apcscore.engine.step import Request, RequestOutput, TokenLogprobs
from apcscore.errors import ApcscoreError
from apcscore.io.schemas import Record
from apcscore.jobs.base import COMMON_FIELDS, TOKEN_FIELDS, Job, RecordPlan, token_columns
from apcscore.jobs.loglikelihood import encode, prefix_token_id
from apcscore.options.commands import PerplexityOptions

DEFAULT_MAX_WINDOW = 4096


@dataclass(frozen=True)
class Window:
    """One rolling window over S: the request is S[start:end]; it scores S[end - num_scored : end]."""

    start: int
    end: int
    num_scored: int


def rolling_windows(num_tokens: int, window: int, stride: int) -> list[Window]:
    """The windows over S = [prefix] + `num_tokens` text tokens; together they score S[1:] exactly once."""
    if window < 1 or not 1 <= stride <= window:
        raise ValueError(f"need window >= 1 and 1 <= stride <= window, got window={window}, stride={stride}")
    n = num_tokens + 1  # len(S)
    a, b = 1, min(window + 1, n)
    windows = []
    while b > a:
        windows.append(Window(max(0, b - 1 - window), b, b - a))
        a, b = b, min(b + stride, n)
    return windows


def count_words(text: str) -> int:
    """lm-eval's word count: the pieces of `re.split(r"\\s+", text)` (empty edge pieces included)."""
    return len(re.split(r"\s+", text))


def default_window(max_model_len: int) -> int:
    """The model's context length less the one target token, capped at DEFAULT_MAX_WINDOW."""
    return min(DEFAULT_MAX_WINDOW, max_model_len - 1)


@dataclass(frozen=True)
class PerplexityPlan(RecordPlan):
    """A text's plan: its sequence S and the windows its requests score, in request order."""

    sequence: tuple[int, ...] = ()
    windows: tuple[Window, ...] = ()


class PerplexityJob(Job):
    command = "perplexity"

    def __init__(self, tokenizer: Any, max_model_len: int, options: PerplexityOptions) -> None:
        super().__init__(tokenizer, max_model_len, options)
        max_len = self.max_model_len
        window = default_window(max_len) if options.window is None else int(options.window)
        if window < 1:
            raise ApcscoreError(f"--window must be at least 1, not {window}")
        if window + 1 > max_len:
            raise ApcscoreError(
                f"--window {window} is too long for the model: a window feeds {window} tokens of context plus "
                f"the token it predicts last ({window + 1} in all), and the model's context is {max_len} "
                f"tokens; use --window {max_len - 1} or less")
        stride = window if options.stride is None else int(options.stride)
        if not 1 <= stride <= window:
            raise ApcscoreError(f"--stride must be between 1 and the window ({window}), not {stride} "
                                "(a stride above the window would leave tokens unscored)")
        self.window, self.stride = window, stride
        self.k = options.prompt_logprobs
        self.prefix_id = prefix_token_id(self.tokenizer)
        self._totals = {"sum_logprob": 0.0, "num_tokens": 0, "num_words": 0, "num_bytes": 0, "records": 0}

    def schema(self) -> pa.Schema:
        fields = COMMON_FIELDS + [
            pa.field("num_tokens", pa.int64()),
            pa.field("num_words", pa.int64()),
            pa.field("num_bytes", pa.int64()),
            pa.field("num_windows", pa.int64()),
            pa.field("sum_logprob", pa.float64()),
            pa.field("perplexity", pa.float64()),
            pa.field("word_perplexity", pa.float64()),
            pa.field("byte_perplexity", pa.float64()),
            pa.field("bits_per_byte", pa.float64()),
        ]
        return pa.schema(fields + (TOKEN_FIELDS if self.k is not None else []))

    def requests(self, record: Record) -> tuple[list[Request], PerplexityPlan]:
        seq = [self.prefix_id] + encode(self.tokenizer, record.fields["text"])  # S
        if len(seq) == 1:
            raise ApcscoreError("the text is empty: it has no tokens to score (remove the record or give it text)")
        windows = tuple(rolling_windows(len(seq) - 1, self.window, self.stride))
        # without per-token columns only the logprobs are summed: no ranks needed
        ranks = self.k is not None
        requests = [Request(None, seq[w.start:w.end], prompt_logprobs=self.k or 0,
                            score_from=w.end - w.start - w.num_scored, prompt_logprob_ranks=ranks)
                    for w in windows]
        return requests, PerplexityPlan(record, sequence=tuple(seq), windows=windows)

    def row(self, plan: RecordPlan, outputs: list[RequestOutput]) -> dict:
        assert isinstance(plan, PerplexityPlan)
        record, seq, windows = plan.record, list(plan.sequence), plan.windows
        text = record.fields["text"]
        parts = []  # each window's logprobs, positions moved from the request to S
        for w, out in zip(windows, outputs, strict=True):
            lps = out.prompt_logprobs
            assert len(lps) == w.num_scored, "the engine scored other positions than the window asked for"
            parts.append(replace(lps, positions=lps.positions + w.start))
        merged = TokenLogprobs.concat(parts, self.k or 0)
        total = numerics.exact_sum(merged.token_logprobs)
        n, words, nbytes = len(seq) - 1, count_words(text), len(text.encode("utf-8"))
        row = {"id": record.id, "status": "ok", "error": None, "num_tokens": n, "num_words": words,
               "num_bytes": nbytes, "num_windows": len(windows), "sum_logprob": total,
               **_per_unit(total, n, words, nbytes)}
        if self.k is not None:
            row.update(token_columns(seq, merged))
        return row

    def observe(self, row: dict) -> None:
        if row.get("status") != "ok":
            return
        t = self._totals
        t["records"] += 1
        for key in ("sum_logprob", "num_tokens", "num_words", "num_bytes"):
            t[key] += row[key]

    def summary(self) -> list[tuple[str, str]]:
        t = self._totals
        if not t["records"]:
            return []
        u = _per_unit(t["sum_logprob"], t["num_tokens"], t["num_words"], t["num_bytes"])
        return [("window / stride", f"{self.window:,} / {self.stride:,} tokens"),
                ("scored", f"{t['num_tokens']:,} tokens, {t['num_words']:,} words, {t['num_bytes']:,} bytes"),
                ("token perplexity", f"{u['perplexity']:.4f}"),
                ("word perplexity", f"{u['word_perplexity']:.4f}"),
                ("byte perplexity", f"{u['byte_perplexity']:.4f}"),
                ("bits per byte", f"{u['bits_per_byte']:.4f}")]

    def metadata(self) -> dict:
        return {"window": self.window, "stride": self.stride, "prefix_token_id": self.prefix_id,
                "prompt_logprobs": self.k}


def _per_unit(sum_logprob: float, tokens: int, words: int, nbytes: int) -> dict:
    """Token, word and byte perplexity and bits per byte of a total loglikelihood (lm-eval's aggregation)."""
    def ppl(count: int) -> float:
        return numerics.exp(-sum_logprob / count) if count else math.nan

    return {"perplexity": ppl(tokens), "word_perplexity": ppl(words), "byte_perplexity": ppl(nbytes),
            "bits_per_byte": -sum_logprob / nbytes / numerics.log(2.0) if nbytes else math.nan}
