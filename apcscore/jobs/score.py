"""`apcscore score`: per-token prompt logprobs, ranks and top-K, and per-record NLL / perplexity."""

from __future__ import annotations

import math

import pyarrow as pa

from apcscore.jobs.base import COMMON_FIELDS, TOKEN_FIELDS, Job, nll_summary, sum_logprobs, token_columns
from apcscore.records import Record
from apcscore.sequence import Request, RequestOutput


class ScoreJob(Job):
    command = "score"

    def __init__(self, engine, options: dict) -> None:
        super().__init__(engine, options)
        self.k = int(options.get("prompt_logprobs") or 0)
        self._sum_logprob = 0.0
        self._scored = 0

    def schema(self) -> pa.Schema:
        return pa.schema(COMMON_FIELDS + [
            pa.field("num_tokens", pa.int64()),
            pa.field("num_scored", pa.int64()),
            pa.field("sum_logprob", pa.float64()),
            pa.field("mean_nll", pa.float64()),
            pa.field("perplexity", pa.float64()),
        ] + TOKEN_FIELDS)

    def requests(self, record: Record) -> list[Request]:
        if record.kind == "prompt_token_ids":
            ids = list(record.fields["prompt_token_ids"])
        else:
            ids = self.encode(record.fields["prompt"])
        return [Request(None, ids, prompt_logprobs=self.k)]

    def row(self, record: Record, outputs: list[RequestOutput]) -> dict:
        out = outputs[0]
        lps = out.prompt_logprobs
        total = sum_logprobs(lps)
        n_scored = len(lps) if lps is not None else 0
        return {"id": record.id, "status": "ok", "error": None, "num_tokens": len(out.prompt_token_ids),
                "num_scored": n_scored, **nll_summary(total, n_scored),
                **token_columns(out.prompt_token_ids, lps)}

    def observe(self, row: dict) -> None:
        if row.get("status") == "ok" and row.get("num_scored"):
            self._sum_logprob += row["sum_logprob"]
            self._scored += row["num_scored"]

    def summary(self) -> list[tuple[str, str]]:
        if not self._scored:
            return []
        mean_nll = -self._sum_logprob / self._scored
        return [("scored tokens", f"{self._scored:,}"), ("mean NLL", f"{mean_nll:.4f}"),
                ("perplexity", f"{math.exp(mean_nll):.3f}")]

    def metadata(self) -> dict:
        return {"prompt_logprobs": self.k}
