"""`apcscore score`: per-token prompt logprobs, ranks and top-K, and per-record NLL / perplexity; also the
loglikelihood of a continuation and multiple-choice accuracy (`apcscore.jobs.loglikelihood`).

Rows of every record kind (prompt, prompt_token_ids, continuation, choices) share one schema, null where a column
does not apply: docs/eval_jobs.md, "Mixed datasets and the score schema".
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import pyarrow as pa

from apcscore.jobs.base import COMMON_FIELDS, TOKEN_FIELDS, Job, RecordPlan, nll_summary, token_columns
from apcscore.jobs.reference_columns import NULL_COLUMNS, REFERENCE_FIELDS, reference_columns
from apcscore.jobs.loglikelihood import (LOGLIKELIHOOD_FIELDS, choice_columns, continuation_request,
                                         continuation_score, group_by_last_token, mean_stderr,
                                         prefix_token_id, trim_top)
from apcscore.engine import numerics
from apcscore.engine.step import Request, RequestOutput
from apcscore.io.schemas import Record
from apcscore.options.commands import ScoreOptions


@dataclass(frozen=True)
class ScorePlan(RecordPlan):
    """A score record's plan; a choices record also says which request scores each choice."""

    choices: tuple[tuple[int, int], ...] | None = None  # per choice: (its request's index, its last token)


class ScoreJob(Job):
    command = "score"

    def __init__(self, tokenizer: Any, max_model_len: int, options: ScoreOptions) -> None:
        super().__init__(tokenizer, max_model_len, options)
        self.k = int(options.prompt_logprobs or 0)
        self._sum_logprob = 0.0
        self._scored = 0
        self._cont_logprob = 0.0
        self._cont_tokens = 0
        self._cont_greedy: list[float] = []
        self._correct: list[float] = []
        self._correct_norm: list[float] = []
        self.reference = options.reference_model  # score --reference-model: the divergence columns
        self._kl: list[float] = []  # with a reference: every scored token's KL
        self._agree = 0  # and how many of them have the reference's top-1

    def schema(self) -> pa.Schema:
        return pa.schema(COMMON_FIELDS + [
            pa.field("num_tokens", pa.int64()),
            pa.field("num_scored", pa.int64()),
            pa.field("sum_logprob", pa.float64()),
            pa.field("mean_nll", pa.float64()),
            pa.field("perplexity", pa.float64()),
        ] + LOGLIKELIHOOD_FIELDS + TOKEN_FIELDS + (REFERENCE_FIELDS if self.reference else []))

    @cached_property
    def prefix_id(self) -> int:
        return prefix_token_id(self.tokenizer)

    def requests(self, record: Record) -> tuple[list[Request], ScorePlan]:
        f = record.fields
        if record.kind == "continuation":
            req, dropped = self.fit_scoring(
                continuation_request(self.tokenizer, f["context"], f["continuation"], self.prefix_id, self.k))
            return [req], ScorePlan(record, dropped)
        if record.kind == "choices":  # top-K of choices is not stored: rank (for nothing) and logprob only
            built = [continuation_request(self.tokenizer, f["context"], c, self.prefix_id, 0) for c in f["choices"]]
            # the longest first: a record too long for the context is reported by its longest choice
            self.fit_scoring(max(built, key=lambda r: len(r.prompt_token_ids)))
            fitted = [self.fit_scoring(req) for req in built]
            separate = [req for req, _ in fitted]
            merged, owner = group_by_last_token(separate)  # one-token choices of the context share a request
            choices = tuple((o, r.prompt_token_ids[-1]) for o, r in zip(owner, separate))
            return merged, ScorePlan(record, max((d for _, d in fitted), default=0), choices)
        ids = list(f["prompt_token_ids"]) if record.kind == "prompt_token_ids" else self.encode(f["prompt"])
        ids, dropped = self.fit_context(ids)
        return [Request(None, ids, prompt_logprobs=self.record_k(record))], ScorePlan(record, dropped)

    def record_k(self, record: Record) -> int:
        """Top-K of a plain prompt: an OpenAI Batch request's own (its body's logprobs), else --prompt-logprobs."""
        batch_line = record.fields.get("openai")
        k = batch_line["prompt_logprobs"] if batch_line else None
        return self.k if k is None else int(k)

    def row(self, plan: RecordPlan, outputs: list[RequestOutput]) -> dict:
        record = plan.record
        base = {"id": record.id, "status": "ok", "error": None, **(NULL_COLUMNS if self.reference else {})}
        if record.kind == "choices":
            assert isinstance(plan, ScorePlan) and plan.choices is not None
            choices = plan.choices  # (its request, its last token) per choice
            scores = [continuation_score(outputs[o], last_token=last) for o, last in choices]
            return {**base, "num_tokens": sum(len(outputs[o].prompt_token_ids) for o, _ in choices),
                    "num_scored": sum(s.num_tokens for s in scores),
                    **choice_columns([s.logprob for s in scores], record.fields["choices"], record.fields["answer"])}
        out = outputs[0]
        lps = trim_top(out.prompt_logprobs, self.record_k(record))
        total = numerics.exact_sum(lps.token_logprobs) if lps is not None else 0.0
        n_scored = len(lps) if lps is not None else 0
        row = {**base, "num_tokens": len(out.prompt_token_ids), "num_scored": n_scored,
               **nll_summary(total, n_scored), **token_columns(out.prompt_token_ids, lps)}
        if self.reference:
            row.update(reference_columns(len(out.prompt_token_ids), lps))
        if record.kind == "continuation":
            score = continuation_score(out)
            row.update(continuation_logprob=score.logprob, continuation_num_tokens=score.num_tokens,
                       is_greedy=score.is_greedy)
        return row

    def observe(self, row: dict) -> None:
        if row.get("status") != "ok":
            return
        if row.get("token_kl"):
            self._kl += [v for v in row["token_kl"] if v is not None]
            self._agree += sum(1 for v in row["token_top1_agree"] if v)
        if row.get("choice_logprobs") is not None:
            self._correct.append(float(row["correct"]))
            self._correct_norm.append(float(row["correct_norm"]))
        elif row.get("continuation_logprob") is not None:
            self._cont_logprob += row["continuation_logprob"]
            self._cont_tokens += row["continuation_num_tokens"]
            self._cont_greedy.append(float(row["is_greedy"]))
        elif row.get("num_scored"):
            self._sum_logprob += row["sum_logprob"]
            self._scored += row["num_scored"]

    def summary(self) -> list[tuple[str, str]]:
        lines: list[tuple[str, str]] = []
        if self._scored:
            mean_nll = -self._sum_logprob / self._scored
            lines += [("scored tokens", f"{self._scored:,}"), ("mean NLL", f"{mean_nll:.4f}"),
                      ("perplexity", f"{numerics.exp(mean_nll):.3f}")]
        if self._cont_greedy:
            n = len(self._cont_greedy)
            lines += [("continuations", f"{n:,} ({int(sum(self._cont_greedy)):,} greedy), "
                                        f"{self._cont_tokens:,} tokens"),
                      ("continuation NLL / token", f"{-self._cont_logprob / self._cont_tokens:.4f}")]
        if self._correct:
            for label, values in (("accuracy", self._correct), ("acc_norm", self._correct_norm)):
                mean, err = mean_stderr(values)
                n = len(values)
                spread = f" ± {err:.4f}" if math.isfinite(err) else ""  # no standard error from one question
                lines.append((label, f"{mean:.4f}{spread} ({n:,} question{'s' if n != 1 else ''})"))
        if self._kl:
            lines += [("mean KL (exact, vs reference)", f"{math.fsum(self._kl) / len(self._kl):.6f}"),
                      ("same top-1 as reference", f"{100 * self._agree / len(self._kl):.2f}%")]
        return lines

    def metadata(self) -> dict:
        return {"prompt_logprobs": self.k}
