"""Result rows -> OpenAI Batch result lines (the output side of `--output-format openai-batch`).

One line per input record, in input order: ``{"id", "custom_id", "response": {"status_code": 200,
"request_id", "body": <chat.completion | text_completion>}, "error": null}``, or for an error row
``{"id", "custom_id", "response": null, "error": {"code", "message"}}`` (the Batch API's error shape).
The bodies follow the Batch API field for field, and vLLM where it adds to them (a completion's `top_logprobs`
with the token itself, `text_offset` from the start of `text`, `prompt_logprobs` and their ranks): docs/decisions.md,
"OpenAI Batch files" (its "Result lines") and "OpenAI Batch fidelity". A token's text is `tokenizer.decode([id])`
(a token that is part of a UTF-8 character reads U+FFFD there); the parquet results keep a non-finite logprob,
a result line writes `NONFINITE_LOGPROB`.
"""

from __future__ import annotations

import calendar
import hashlib
import json
import time
from itertools import accumulate
from typing import Any

from apcscore.io.result_tables import jsonable

CODE_INVALID = "invalid_request_error"  # a line refused before the run (what --skip-invalid turned into a row)
CODE_FAILED = "request_failed"  # a line that could not run (e.g. longer than the model's context)
NONFINITE_LOGPROB = -9999.0  # what a -inf / +inf / NaN logprob is written as (vLLM's floor for -inf)


def _digest(custom_id: str, index: int) -> str:
    """The request's ids' hex digits: of its `custom_id` and its line (0-based), so two lines that share a
    `custom_id` (the second an error line) still get ids of their own, and a rerun the same ids."""
    return hashlib.sha256(f"{index}:{custom_id}".encode("utf-8")).hexdigest()


def created_seconds(created: str | None) -> int:
    """The metadata's `created` (UTC, `%Y-%m-%dT%H:%M:%SZ`) as Unix seconds (now, if it is missing)."""
    if not created:
        return int(time.time())
    return calendar.timegm(time.strptime(created, "%Y-%m-%dT%H:%M:%SZ"))


def vllm_rank(rank: int | None, logprob: float, token: int, top_ids: list[int],
              top_logprobs: list[float]) -> int | None:
    """A token's rank in vLLM's convention, the number of vocabulary entries whose logprob is >= its own (ties take
    the worst rank), from ours, `rank` (1 + the number whose logit is strictly greater: ties share the best), and
    the row's stored top-K (`top_ids`, `top_logprobs`, every K the row holds): the larger of ours and the count of
    top-K entries at or above the token's logprob, plus the token itself if it is not among them. That is vLLM's
    rank unless the token's logprob is bitwise equal to that of a token outside the stored top-K, which the row
    does not know (the engine counts strictly greater logits only): there it is a lower bound (README.md, "Ranks")."""
    if rank is None:
        return None
    at_or_above = sum(v >= logprob for v in top_logprobs)  # (a NaN logprob compares false: ours stands)
    return max(rank, at_or_above + (token not in top_ids))


class LineWriter:
    """Turns the rows of one run into result lines; `tokenizer` decodes token ids (any object with
    `decode(ids)`), `records` maps a dataset position to its record's fields (valid records only); the lines
    at the positions `no_custom_id` gave none (their rows' id is a stand-in), so their `custom_id` is null."""

    def __init__(self, tokenizer: Any, model: str, created: int, records: dict[int, dict],
                 invalid: set[int], no_custom_id: frozenset[int] = frozenset()) -> None:
        self.tokenizer = tokenizer
        self.no_custom_id = no_custom_id
        self.model = model
        self.created = created
        self.records = records
        self.invalid = invalid
        self._texts: dict[int, str] = {}

    def text(self, token_id: int) -> str:
        if token_id not in self._texts:
            self._texts[token_id] = self.tokenizer.decode([token_id])
        return self._texts[token_id]

    def line(self, index: int, row: dict) -> str:
        """The result line (JSON, no newline) of the row of dataset position `index`."""
        cid = row["id"]
        h = _digest(cid, index)
        out: dict[str, Any] = {"id": f"batch_req_{h[:32]}",
                               "custom_id": None if index in self.no_custom_id else cid}
        fields = self.records.get(index)
        if row.get("status") != "ok" or fields is None:
            code = CODE_INVALID if index in self.invalid else CODE_FAILED
            out.update(response=None, error={"code": code, "message": row.get("error") or "the request failed"})
        else:
            out.update(response={"status_code": 200, "request_id": f"req_{h[32:64]}",
                                 "body": self.body(row, fields, h)}, error=None)
        try:
            return json.dumps(out, ensure_ascii=False, allow_nan=False)
        except ValueError:  # a non-finite logprob: only such lines pay for the walk
            return json.dumps(jsonable(out, NONFINITE_LOGPROB), ensure_ascii=False, allow_nan=False)

    def body(self, row: dict, fields: dict, h: str) -> dict:
        batch = fields["openai"]
        chat = batch["endpoint"] == "chat"
        completion_ids = row.get("completion_token_ids") or []
        prompt_tokens = row["num_prompt_tokens"] if "num_prompt_tokens" in row else row["num_tokens"]
        usage: dict[str, Any] = {"prompt_tokens": prompt_tokens, "completion_tokens": len(completion_ids),
                                 "total_tokens": prompt_tokens + len(completion_ids)}
        if row.get("num_cached_tokens") is not None:
            usage["prompt_tokens_details"] = {"cached_tokens": row["num_cached_tokens"]}
        finish = row.get("finish_reason") or "length"  # score: max_tokens 0 stops at its length limit
        completion = row.get("completion") or ""
        body: dict[str, Any] = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{h[:32]}",
                                "object": "chat.completion" if chat else "text_completion",
                                "created": self.created, "model": batch.get("model") or self.model}
        if chat:
            logprobs = self.chat_logprobs(row, batch["logprobs"]) if batch["logprobs"] is not None else None
            choice = {"index": 0, "message": {"role": "assistant", "content": completion, "refusal": None},
                      "logprobs": logprobs, "finish_reason": finish}
        else:
            prefix = self.prompt_text(row, fields) if batch["echo"] else ""
            # the legacy object only where the body's logprobs asked for it (vLLM's prompt_logprobs alone: null)
            logprobs = self.completion_logprobs(row, batch) if (
                batch["logprobs"] is not None or batch["echo_logprobs"] is not None) else None
            choice = {"index": 0, "text": prefix + completion, "logprobs": logprobs, "finish_reason": finish}
        body.update(choices=[choice], usage=usage, system_fingerprint=None)
        if (k := batch["vllm_prompt_logprobs"]) is not None:  # vLLM's place: a completion's choice, a chat response
            (body if chat else choice)["prompt_logprobs"] = self.vllm_prompt_logprobs(row, k)
        return body

    def prompt_text(self, row: dict, fields: dict) -> str:
        """The echoed prompt: the body's, or where --truncate left dropped tokens, the tokens that ran."""
        if row.get("num_truncated_tokens") and row.get("token_ids"):
            return self.tokenizer.decode(row["token_ids"])
        if "prompt" in fields:
            return fields["prompt"]
        return self.tokenizer.decode(fields["prompt_token_ids"])

    def chat_logprobs(self, row: dict, k: int) -> dict:
        content = []
        ids = row.get("completion_token_ids") or []
        lps = row.get("completion_logprobs") or [None] * len(ids)
        top_ids = row.get("completion_top_ids") or [[]] * len(ids)
        top_lps = row.get("completion_top_logprobs") or [[]] * len(ids)
        for tid, lp, tids, tlps in zip(ids, lps, top_ids, top_lps):
            text = self.text(tid)
            content.append({"token": text, "logprob": lp, "bytes": list(text.encode("utf-8")),
                            "top_logprobs": [{"token": self.text(t), "logprob": v,
                                              "bytes": list(self.text(t).encode("utf-8"))}
                                             for t, v in zip(tids[:k], tlps[:k])]})
        return {"content": content, "refusal": None}

    def completion_logprobs(self, row: dict, batch: dict) -> dict:
        tokens: list[str] = []
        token_lps: list[float | None] = []
        tops: list[dict | None] = []
        # the echoed prompt's tokens (top-K: the body's logprobs, though the row may hold more), then the completion's
        for k, prefix, logprobs in ((batch["echo_logprobs"], "", "token_logprobs"),
                                    (batch["logprobs"], "completion_", "completion_logprobs")):
            if k is None:
                continue
            ids = row.get(prefix + "token_ids") or []
            lps = row.get(logprobs) or [None] * len(ids)
            for pos, tid in enumerate(ids):
                tokens.append(self.text(tid))
                token_lps.append(lps[pos])
                tops.append(None if lps[pos] is None else self._top(
                    tid, lps[pos], row[prefix + "top_ids"][pos][:k], row[prefix + "top_logprobs"][pos][:k]))
        offsets = list(accumulate(map(len, tokens), initial=0))[:-1]  # where each token starts in the text
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}

    def vllm_prompt_logprobs(self, row: dict, k: int) -> list[dict | None]:
        """vLLM's `prompt_logprobs`: per prompt position None (the first) or {token id: {logprob, rank,
        decoded_token}}, as vLLM's logprobs processor makes it: the prompt's token first with its rank (vLLM's
        convention, `vllm_rank`), then the top-K with ranks 1..K (the token among them takes its place's rank)."""
        out: list[dict | None] = []
        for pos, tid in enumerate(row.get("token_ids") or []):
            lp = row["token_logprobs"][pos]
            if lp is None:
                out.append(None)
                continue
            top_ids, top_lps = row["top_ids"][pos] or [], row["top_logprobs"][pos] or []
            rank = vllm_rank(row["token_ranks"][pos], lp, tid, top_ids, top_lps)
            entry = {str(tid): {"logprob": lp, "rank": rank, "decoded_token": self.text(tid)}}
            entry.update({str(t): {"logprob": v, "rank": r + 1, "decoded_token": self.text(t)}
                          for r, (t, v) in enumerate(zip(top_ids[:k], top_lps[:k]))})
            out.append(entry)
        return out

    def _top(self, tid: int, lp: float, ids: list[int], lps: list[float]) -> dict:
        top = {self.text(t): v for t, v in zip(ids, lps)}
        top.setdefault(self.text(tid), lp)  # the token itself, as vLLM adds it
        return top
