"""`apcscore generate`: completions with sampling options; reuses prefix-cached KV."""

from __future__ import annotations

import hashlib
from typing import Any

import pyarrow as pa

from apcscore.config import RECORD_FIELDS
from apcscore.engine.step import Request, RequestOutput, SamplingParams
from apcscore.errors import ApcscoreError
from apcscore.io.schemas import Record
from apcscore.jobs.base import COMMON_FIELDS, TOKEN_FIELDS, Job, RecordPlan, token_columns
from apcscore.options.commands import GenerateOptions

SAMPLING_KEYS = tuple(RECORD_FIELDS)  # the per-record overrides

COMPLETION_LOGPROB_FIELDS = [
    pa.field("completion_logprobs", pa.list_(pa.float32())),
    pa.field("completion_ranks", pa.list_(pa.int64())),
    pa.field("completion_top_ids", pa.list_(pa.list_(pa.int64()))),
    pa.field("completion_top_logprobs", pa.list_(pa.list_(pa.float32()))),
]


class GenerateJob(Job):
    command = "generate"

    def __init__(self, tokenizer: Any, max_model_len: int, options: GenerateOptions) -> None:
        super().__init__(tokenizer, max_model_len, options)
        # --seed is the base seed: a record without its own seed gets one derived from it and the record's
        # position in the dataset (so a resumed or --limit run samples each record as a whole run does)
        self.base_seed = int(options.engine.seed or 0)
        self.defaults = {k: getattr(options, k) for k in SAMPLING_KEYS
                         if k != "seed" and getattr(options, k) is not None}
        self.logprobs = options.logprobs
        self.prompt_logprobs = options.prompt_logprobs
        self._completion_tokens = 0
        self._cached = 0
        self._prompt_tokens = 0
        self._finish: dict[str, int] = {}

    def schema(self) -> pa.Schema:
        fields = COMMON_FIELDS + [
            pa.field("completion", pa.string()),
            pa.field("completion_token_ids", pa.list_(pa.int64())),
            pa.field("finish_reason", pa.string()),
            pa.field("num_prompt_tokens", pa.int64()),
            pa.field("num_cached_tokens", pa.int64()),
        ]
        if self.logprobs is not None:
            fields += COMPLETION_LOGPROB_FIELDS
        if self.prompt_logprobs is not None:
            fields += TOKEN_FIELDS
        return pa.schema(fields)

    def sampling_params(self, record: Record) -> SamplingParams:
        values = dict(self.defaults)
        values.update({k: record.fields[k] for k in SAMPLING_KEYS if record.fields.get(k) is not None})
        if values.get("seed") is None:
            values["seed"] = record_seed(self.base_seed, record.index)
        batch_line = record.fields.get("openai")  # an OpenAI Batch request: its body says what logprobs it wants
        return SamplingParams(**values, logprobs=batch_line["logprobs"] if batch_line else self.logprobs)

    def prompt_ids(self, record: Record) -> list[int]:
        if record.kind == "prompt_token_ids":
            return list(record.fields["prompt_token_ids"])
        if record.kind == "messages":
            if not getattr(self.tokenizer, "chat_template", None):
                raise ApcscoreError("this model's tokenizer has no chat template; give a plain 'prompt' instead")
            text = self.tokenizer.apply_chat_template(record.fields["messages"], add_generation_prompt=True,
                                                      tokenize=False)
            return list(self.tokenizer(text, add_special_tokens=False).input_ids)
        return self.encode(record.fields["prompt"])

    def requests(self, record: Record) -> tuple[list[Request], RecordPlan]:
        sampling = self.sampling_params(record)
        # leave room to generate
        ids, dropped = self.fit_context(self.prompt_ids(record), reserve=sampling.max_tokens)
        batch_line = record.fields.get("openai")
        prompt_logprobs = batch_line["prompt_logprobs"] if batch_line else self.prompt_logprobs
        request = Request(None, ids, sampling=sampling, prompt_logprobs=prompt_logprobs)
        return [request], RecordPlan(record, dropped)

    def row(self, plan: RecordPlan, outputs: list[RequestOutput]) -> dict:
        out = outputs[0]
        row = {"id": plan.record.id, "status": "ok", "error": None, "completion": out.output_text,
               "completion_token_ids": out.output_token_ids,
               # max_tokens 0 generates nothing: it stopped at its length limit
               "finish_reason": out.finish_reason or "length",
               "num_prompt_tokens": len(out.prompt_token_ids), "num_cached_tokens": out.num_cached_tokens}
        if self.logprobs is not None and (lps := out.output_logprobs) is not None:
            row.update(completion_logprobs=lps.token_logprobs.tolist(), completion_ranks=lps.ranks.tolist(),
                       completion_top_ids=lps.top_ids.tolist(), completion_top_logprobs=lps.top_logprobs.tolist())
        if self.prompt_logprobs is not None and out.prompt_logprobs is not None:
            row.update(token_columns(out.prompt_token_ids, out.prompt_logprobs))
        return row

    def observe(self, row: dict) -> None:
        if row.get("status") != "ok":
            return
        self._completion_tokens += len(row["completion_token_ids"])
        self._prompt_tokens += row["num_prompt_tokens"]
        self._cached += row["num_cached_tokens"]
        self._finish[row["finish_reason"]] = self._finish.get(row["finish_reason"], 0) + 1

    def summary(self) -> list[tuple[str, str]]:
        lines = [("completion tokens", f"{self._completion_tokens:,}"),
                 ("prompt tokens (cached)", f"{self._prompt_tokens:,} ({self._cached:,})")]
        if self._finish:
            lines.append(("finish reasons", ", ".join(f"{k}: {v}" for k, v in sorted(self._finish.items(),
                                                                                     key=lambda kv: str(kv[0])))))
        return lines

    def metadata(self) -> dict:
        return {"sampling": self.defaults, "seed": self.base_seed, "logprobs": self.logprobs,
                "prompt_logprobs": self.prompt_logprobs}


def record_seed(base_seed: int, index: int) -> int:
    """The sampling seed of the record at dataset position `index` without a seed of its own: a 63-bit hash of
    (--seed, index), independent of arrival order, batch, --limit, error rows and resumption."""
    digest = hashlib.blake2b(f"{base_seed}/{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1
