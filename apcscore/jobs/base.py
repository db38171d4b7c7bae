"""What every job shares: the record -> requests -> row contract, common columns, per-token columns."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import pyarrow as pa

from apcscore.engine import numerics
from apcscore.engine.step import TokenLogprobs, Request, RequestOutput
from apcscore.errors import ApcscoreError
from apcscore.io.schemas import Record
from apcscore.options.commands import RunOptions

COMMON_FIELDS = [
    pa.field("id", pa.string()),
    pa.field("status", pa.string()),  # ok | error
    pa.field("error", pa.string()),
]

TOKEN_FIELDS = [
    pa.field("token_ids", pa.list_(pa.int64())),
    pa.field("token_logprobs", pa.list_(pa.float32())),
    pa.field("token_ranks", pa.list_(pa.int64())),
    pa.field("top_ids", pa.list_(pa.list_(pa.int64()))),
    pa.field("top_logprobs", pa.list_(pa.list_(pa.float32()))),
]


@dataclass(frozen=True)
class RecordPlan:
    """What `Job.row` needs of one record besides its requests' outputs; `Job.requests` builds it, the runner
    keeps it until the record's outputs are in. Jobs that need more subclass it (score's choices, perplexity's
    windows)."""

    record: Record
    num_truncated_tokens: int = 0  # tokens --truncate left dropped (several requests: the most any dropped)


class Job:
    """A command's logic between records and rows. Subclasses set `command` and the methods below.

    A job is pure: it needs only the tokenizer and the model's context length, and keeps no state per record
    (what `row` needs travels in the plan that `requests` returns). It aggregates finished rows for the
    summary (`observe`), so give each run a job of its own."""

    command: str = ""

    def __init__(self, tokenizer: Any, max_model_len: int, options: RunOptions) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = int(max_model_len)
        self.options = options
        self.truncate = getattr(options, "truncate", None)  # None | "left"

    def schema(self) -> pa.Schema:
        raise NotImplementedError

    def requests(self, record: Record) -> tuple[list[Request], RecordPlan]:
        """The engine requests of one record (request ids are filled in by the runner) and its plan, what
        `row` needs later. Raises ApcscoreError when the record cannot be run (it becomes an error row)."""
        raise NotImplementedError

    def row(self, plan: RecordPlan, outputs: list[RequestOutput]) -> dict:
        """The result row of one record from its plan and its requests' outputs (all without error), in the
        order `requests` returned the requests."""
        raise NotImplementedError

    def summary(self) -> list[tuple[str, str]]:
        """(label, value) lines for the end-of-run table, from the rows seen by `observe`."""
        return []

    def observe(self, row: dict) -> None:
        """See each finished row (for the summary)."""

    def metadata(self) -> dict:
        """Job options recorded in the run metadata."""
        return {}

    # ---- shared helpers ------------------------------------------------------------------------
    def output_schema(self) -> pa.Schema:
        """schema() plus the columns every job adds under common options (--truncate)."""
        schema = self.schema()
        if self.truncate:
            schema = schema.append(pa.field("num_truncated_tokens", pa.int64()))
        return schema

    def fit_context(self, ids: list[int], reserve: int = 0) -> tuple[list[int], int]:
        """(a prompt that fits the model's context, the tokens dropped). Without --truncate a prompt that fits
        stays whole and one longer than the context is an error (raised here, so the message can name the
        option). With --truncate left a prompt keeps its newest tokens wherever it would leave less than
        `reserve` of the context for generated tokens (at least one prompt token stays), so a shorter prompt
        never gets fewer new tokens than a longer one."""
        max_len = self.max_model_len
        keep = max(1, max_len - reserve) if self.truncate == "left" else max_len
        if len(ids) <= keep:
            return ids, 0
        if self.truncate != "left":
            raise ApcscoreError(f"the prompt has {len(ids)} tokens, more than the model's context of {max_len} "
                                "tokens — shorten it, or pass --truncate left to drop its oldest tokens")
        return ids[len(ids) - keep:], len(ids) - keep

    def fit_scoring(self, request: Request) -> tuple[Request, int]:
        """(a continuation request (context + scored tokens from `score_from`) that fits the context, the
        tokens dropped): with --truncate left the context loses its oldest tokens; the scored tokens are
        never cut."""
        ids, max_len = request.prompt_token_ids, self.max_model_len
        drop = len(ids) - max_len
        if drop <= 0:
            return request, 0
        if self.truncate != "left":
            raise ApcscoreError(f"context and continuation have {len(ids)} tokens, more than the model's context "
                                f"of {max_len} tokens — shorten the context, or pass --truncate left to drop "
                                "its oldest tokens")
        if drop >= request.score_from:
            raise ApcscoreError(f"the continuation alone has {len(ids) - request.score_from:,} tokens: with at least "
                                f"one token of context it cannot fit the model's context of {max_len:,} tokens, "
                                "even with --truncate left — shorten the continuation")
        return replace(request, prompt_token_ids=ids[drop:], score_from=request.score_from - drop), drop

    def finish_row(self, row: dict, plan: RecordPlan | None = None) -> dict:
        """Add the common columns to a row: a job's row with its record's plan, or an error row (whose
        record may have no plan: invalid, or its requests could not be built)."""
        if self.truncate:
            dropped = plan.num_truncated_tokens if plan is not None else 0
            row["num_truncated_tokens"] = dropped if row["status"] == "ok" else None
        return row

    def error_row(self, record_id: str, message: str) -> dict:
        return {"id": record_id, "status": "error", "error": message}

    def encode(self, text: str) -> list[int]:
        """Token ids with the tokenizer's default special tokens (what AutoTokenizer(text).input_ids gives)."""
        return list(self.tokenizer(text).input_ids)


def token_columns(token_ids: list[int], lps: TokenLogprobs | None) -> dict:
    """Per-token columns aligned with `token_ids`; null where a position was not scored (always position 0)."""
    n = len(token_ids)
    logprobs: list[float | None] = [None] * n
    ranks: list[int | None] = [None] * n
    top_ids: list[list[int] | None] = [None] * n
    top_lps: list[list[float] | None] = [None] * n
    if lps is not None:
        for i, pos in enumerate(lps.positions.tolist()):
            logprobs[pos] = float(lps.token_logprobs[i])
            ranks[pos] = int(lps.ranks[i])
            top_ids[pos] = lps.top_ids[i].tolist()
            top_lps[pos] = lps.top_logprobs[i].tolist()
    return {"token_ids": list(token_ids), "token_logprobs": logprobs, "token_ranks": ranks,
            "top_ids": top_ids, "top_logprobs": top_lps}


def nll_summary(sum_logprob: float, count: int) -> dict:
    """sum_logprob, mean_nll and perplexity of `count` scored tokens (null when nothing was scored, e.g. a
    one-token prompt: its only token has no context)."""
    if not count:
        return {"sum_logprob": sum_logprob, "mean_nll": None, "perplexity": None}
    mean_nll = -sum_logprob / count
    return {"sum_logprob": sum_logprob, "mean_nll": mean_nll, "perplexity": numerics.exp(mean_nll)}
