"""The transformers fallback (`--model-backend transformers`): any causal LM that transformers runs, through
its own forward and `generate()`, with the same requests in and the same outputs out as `Engine`; without the
paged KV cache, the prefix cache, chunked prefill, continuous batching and the batch-invariance contract (so
`--exact-reuse` is refused). Every request runs alone, in arrival order, with a full recompute of its prompt:
- prompt logprobs: one forward over the whole prompt, fp32 logits, the native CPU path's logprob function
  (`apcscore.kernels.logprobs_torch.token_logprobs_torch`); last-token alternatives are more rows of the last one;
- generation: `model.generate()` with the request's temperature, top-k, top-p, max_tokens and stop tokens;
  a sampled request's RNG is seeded like the native path's (its own seed, or the engine seed and its arrival);
  stop strings cut the completion where the native engine would (the same incremental detokenizer), and
  `--logprobs` scores each generated token under the raw logits `generate()` returns.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any, Callable, Iterable, Iterator

import numpy as np
import torch

from apcscore.config import EngineConfig
from apcscore.engine.counters import EngineCounters
from apcscore.engine.detokenizer import IncrementalDetokenizer
from apcscore.engine.logprobs import chunked_token_logprobs, to_token_logprobs
from apcscore.engine.devices import device_and_dtype
from apcscore.models.loaded import LoadedModel, loaded
from apcscore.engine.context import context_length
from apcscore.engine.stopping import stop_string_cut, stop_tokens
from apcscore.engine.numerics import describe_numerics
from apcscore.engine.sampler import sampling_seed
from apcscore.engine.step import Request, RequestOutput, TokenLogprobs, request_problem
from apcscore.errors import ApcscoreError
from apcscore.kernels.logprobs_torch import token_logprobs_torch
from apcscore.models.loading import eos_token_ids

NO_CACHE_WARNING = ("this model runs through the transformers fallback (--model-backend transformers): full "
                    "recompute per request, without the prefix cache or the batch-invariance guarantee")


class TransformersEngine:
    """`Engine`'s interface (run, counters, info, tokenizer, ...) over a transformers AutoModelForCausalLM."""

    model_backend = "transformers"
    attention_backend = "transformers"  # what the run metadata's attention_backend records

    def __init__(self, model: Any, config: EngineConfig, info: LoadedModel, device: torch.device,
                 dtype: torch.dtype) -> None:
        """model: a transformers causal LM (moved to `device` here); info: the model it runs, its facts filled in
        here."""
        architecture = (getattr(model.config, "architectures", None) or [type(model).__name__])[0]
        if config.exact_reuse:
            raise ApcscoreError(f"--exact-reuse needs our native decoder (a paged KV cache to reuse); "
                                f"{architecture} runs on the transformers fallback, which recomputes every "
                                f"prompt: drop --exact-reuse")
        self.model = model.to(device).eval()
        self.tokenizer = info.tokenizer
        self.config = config
        self.info = replace(info, architecture=architecture, max_model_len=context_length(model.config, config),
                            num_parameters=sum(p.numel() for p in model.parameters()))
        self.device = device
        self.dtype = dtype
        self.numerics = describe_numerics(device, False, "the model's own transformers forward",
                                          None, "the transformers fallback path (one request at a time, library GEMM)")
        self.batch_invariant = False
        self.stats = EngineCounters()
        self._arrivals = 0
        self.eos_token_ids = eos_token_ids(self.model.config, self.tokenizer)

    # ---- construction --------------------------------------------------------------------------
    @classmethod
    def from_model(cls, model: LoadedModel | str, config: EngineConfig | None = None) -> "TransformersEngine":
        """Load `model` (a `load_model` value, or a spec for it) with transformers' own model class."""
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        from apcscore.models.loading import weights_fingerprint

        config = config or EngineConfig()
        device, dtype = device_and_dtype(config)
        model = loaded(model)
        hf_logging.disable_progress_bar()  # no "Loading weights" bar in the middle of the CLI's output
        hf_model = AutoModelForCausalLM.from_pretrained(str(model.path), dtype=dtype, local_files_only=True)
        return cls(hf_model, config, replace(model, fingerprint=weights_fingerprint(model.path)), device, dtype)

    @classmethod
    def from_parts(cls, hf_config: Any, state_dict: dict[str, torch.Tensor], tokenizer: Any,
                   config: EngineConfig | None = None) -> "TransformersEngine":
        """Build from a transformers config and state dict (tests, random weights)."""
        from transformers import AutoModelForCausalLM

        config = config or EngineConfig()
        device, dtype = device_and_dtype(config)
        model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
        missing, unexpected = model.load_state_dict(state_dict, strict=False)
        tied = {k for k in missing if k.endswith("lm_head.weight")} if getattr(
            hf_config, "tie_word_embeddings", False) else set()
        if set(missing) - tied or unexpected:
            raise ApcscoreError(f"the weights do not fit the {type(model).__name__}: missing "
                                f"{sorted(set(missing) - tied)[:5]}, unexpected {sorted(unexpected)[:5]}")
        model.tie_weights()
        return cls(model, config, LoadedModel("custom", None, hf_config, tokenizer, rope=None), device, dtype)

    def counters(self) -> EngineCounters:
        """This engine's counters since it was built (no prefix cache, no KV pool: those are 0)."""
        return EngineCounters.of(self.stats)

    # ---- running -------------------------------------------------------------------------------
    def run_recomputed(self, requests: Iterable[Request]) -> Iterator[RequestOutput]:
        """`run`: this engine has no prefix cache, so every position is always computed."""
        return self.run(requests)

    def run(self, requests: Iterable[Request], on_step: Callable[[Any], None] | None = None
            ) -> Iterator[RequestOutput]:
        """Run every request, one at a time; yield one RequestOutput per request, in arrival order."""
        started = time.perf_counter()
        try:
            for request in requests:
                problem = request_problem(request, self.info.max_model_len, self.info.vocab_size,
                                          self.config.max_logprobs)
                arrival = self._arrivals
                self._arrivals += 1
                if problem:
                    self.stats.errors += 1
                    yield RequestOutput(request.request_id, list(request.prompt_token_ids),
                                        finish_reason="error", error=problem)
                    continue
                out = self._run_one(request, arrival)
                self.stats.steps += 1
                self.stats.finished += 1
                self.stats.seconds = time.perf_counter() - started
                yield out
                if on_step is not None:
                    on_step(self)
        finally:
            self.stats.seconds = time.perf_counter() - started

    @torch.inference_mode()
    def _run_one(self, request: Request, arrival: int) -> RequestOutput:
        ids = list(request.prompt_token_ids)
        self.stats.prompt_tokens += len(ids)
        prompt_lps, alternatives = self._prompt_logprobs(request) if request.prompt_logprobs is not None \
            else (None, None)
        out = RequestOutput(request.request_id, ids, prompt_logprobs=prompt_lps, finish_reason=None,
                            last_token_alternatives=alternatives)
        if request.max_tokens:
            self._generate(request, arrival, out)
        return out

    def _prompt_logprobs(self, request: Request) -> tuple[TokenLogprobs, TokenLogprobs | None]:
        """Row q of the prompt's logits predicts token q + 1: rows score_from - 1 .. n - 2 are scored, and the
        last row again for each of the request's last-token alternatives."""
        ids = request.prompt_token_ids
        n, k = len(ids), request.prompt_logprobs
        first = max(request.score_from, 1)
        alts = list(request.last_token_alternatives)
        if first >= n:
            lps = TokenLogprobs.concat([], k)
        else:
            x = torch.tensor([ids], dtype=torch.int64, device=self.device)
            logits = self.model(input_ids=x, use_cache=False).logits[0, first - 1:n - 1].float()  # [m, V]
            logits = torch.cat([logits, logits[-1:].expand(len(alts), -1)])  # [m + alternatives, V]
            targets = torch.tensor(ids[first:] + alts, dtype=torch.int64, device=self.device)
            lps = chunked_token_logprobs(lambda rows: rows, logits, targets, k, self.config.logprobs_chunk_size,
                                         token_logprobs_torch, ranks=request.prompt_logprob_ranks)
        m = max(0, n - first)  # scored prompt rows; the alternatives' rows follow
        prompt = replace(lps.rows(0, m), positions=np.arange(first, first + m, dtype=np.int64))
        return prompt, (lps.rows(m, len(lps)) if alts else None)

    def _generate(self, request: Request, arrival: int, out: RequestOutput) -> None:
        p = request.sampling
        ids = list(request.prompt_token_ids)
        # a prompt of the whole context still predicts one token (its last position's logits), as natively
        budget = min(p.max_tokens, max(1, self.info.max_model_len - len(ids)))
        stop_ids = sorted(stop_tokens(p, self.eos_token_ids))
        kwargs: dict[str, Any] = dict(max_new_tokens=budget, min_new_tokens=0, do_sample=p.temperature > 0,
                                      output_logits=True, return_dict_in_generate=True,
                                      eos_token_id=stop_ids or None,
                                      pad_token_id=(stop_ids or [0])[0], num_beams=1)
        if p.temperature > 0:
            kwargs.update(temperature=p.temperature, top_k=p.top_k, top_p=p.top_p)
        else:
            kwargs.update(temperature=None, top_k=None, top_p=None)
        x = torch.tensor([ids], dtype=torch.int64, device=self.device)
        with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
            torch.manual_seed(sampling_seed(p, self.config.seed, arrival))
            result = self.model.generate(input_ids=x, attention_mask=torch.ones_like(x), **kwargs)
        tokens = result.sequences[0, len(ids):].tolist()
        raw = [step[0] for step in result.logits]  # [V] each, the model's logits before any processing
        reason, tokens, text = self._finish(ids, tokens, request)
        raw = raw[:len(tokens)]
        self.stats.generated_tokens += len(tokens)
        out.output_token_ids, out.output_text, out.finish_reason = tokens, text, reason
        if p.logprobs is not None:  # (tokens is never empty: generate() gives at least one, _finish keeps it)
            targets = torch.tensor(tokens, device=self.device)
            out.output_logprobs = to_token_logprobs(targets, *token_logprobs_torch(torch.stack(raw).float(), targets,
                                                                                   p.logprobs))

    def _finish(self, prompt: list[int], tokens: list[int], request: Request) -> tuple[str, list[int], str]:
        """The finish reason, tokens and text of the completion, cut where the native engine would stop."""
        p = request.sampling
        stops = stop_tokens(p, self.eos_token_ids)
        detok = IncrementalDetokenizer(self.tokenizer) if p.stop else None
        seq = list(prompt)
        for i, tok in enumerate(tokens):
            seq.append(tok)
            if tok in stops:
                return "stop", tokens[:i + 1], self._decode(tokens[:i + 1])
            if detok is not None:
                cut = stop_string_cut(detok, seq, len(prompt), p.stop)
                if cut is not None:
                    return "stop", tokens[:i + 1], detok.text[:cut]
        return "length", tokens, self._decode(tokens)

    def _decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)
