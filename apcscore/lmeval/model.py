"""The lm-eval model backend "apcscore": lm-eval's requests through apcscore's Engine.

Importing this module registers `ApcscoreLM` as lm-eval model "apcscore", after `import lm_eval.models`: lm-eval
imports its built-in models only while its registry is empty, so registering first would hide `--model hf`.

Everything that decides numbers is HFLM's (lm-eval's `hf` backend), reused or copied, so the two agree:
`tok_encode` (special tokens unless `add_bos_token` says otherwise, none after a BOS text), TemplateLM's
context/continuation split (an empty context becomes `prefix_token_id`), left truncation to `max_length + 1`
tokens, `is_greedy` (argmax, ties to the lowest id), the rolling windows of `loglikelihood_rolling`, and
`generate_until`'s kwargs, stop sequences (EOS text added), context truncation and cut at the first stop string.
Results come back in input order."""

from __future__ import annotations

import itertools
import lm_eval.models  # noqa: F401  (fills the registry with the built-ins before ours is added)
from typing import Any, Callable

import jinja2
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window, simple_parse_args_string
from tqdm import tqdm

from apcscore.config import EngineConfig
from apcscore.engine.step import Request, RequestOutput, SamplingParams
from apcscore.errors import ApcscoreError
from apcscore.jobs.generate import record_seed
from apcscore.jobs.loglikelihood import continuation_score, group_by_last_token
from apcscore.options.commands import engine_config
from apcscore.lmeval.model_args import check_model_args, device_args
from apcscore.lmeval.store import generation_key, loglikelihood_key

DEFAULT_MAX_GEN_TOKS = 256  # HFLM's
# generation kwargs lm-eval tasks set that change nothing here (HF generate's own switches)
_IGNORED_GEN_KWARGS = frozenset({"do_sample", "use_cache", "num_beams"})
# every generation kwarg the backend takes (`sampling_params`); others are refused
GEN_KWARGS = frozenset({"until", "max_gen_toks", "temperature", "top_p", "top_k", "seed"}) | _IGNORED_GEN_KWARGS


@register_model("apcscore")
class ApcscoreLM(TemplateLM):
    """An lm-eval model backed by apcscore's Engine (paged KV cache, prefix caching, batch invariance).

    pretrained: model alias, Hugging Face directory or .gguf file; max_length: most tokens a scored sequence feeds
    the model (default: the context length - 1); max_gen_toks, add_bos_token: as HFLM's; seed: the base of each
    sampled generation's seed. engine: an already built Engine (tests, a merge's stand-in); config: the EngineConfig
    to load one with (apcscore eval); else the other keyword arguments are engine settings. batch_size is ignored."""

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None) -> "ApcscoreLM":
        return cls.create_from_arg_obj(simple_parse_args_string(arg_string), additional_config)  # lm-eval's parse

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict, additional_config: dict | None = None) -> "ApcscoreLM":
        return super().create_from_arg_obj(arg_dict, device_args(additional_config, arg_dict))

    def __init__(self, pretrained: str = "smollm2-135m", max_length: int | None = None,
                 max_gen_toks: int = DEFAULT_MAX_GEN_TOKS, add_bos_token: bool | None = None, seed: int = 0,
                 engine: Any = None, batch_size: Any = None, progress: bool = True, config: EngineConfig | None = None,
                 **engine_options: Any) -> None:
        super().__init__()
        if config is not None and not isinstance(config, EngineConfig):  # a model_args key: refused as before
            engine_options, config = {**engine_options, "config": config}, None
        check_model_args(engine_options)
        if engine is None:  # the one place an eval's engine is loaded (config: apcscore eval's; else model_args)
            from apcscore.engine.loader import load_engine

            engine = load_engine(str(pretrained), config if config is not None else engine_config(engine_options))
        self.engine = engine
        self.tokenizer = engine.tokenizer
        limit = engine.info.max_model_len - 1  # the engine holds the last (only predicted) token too
        if max_length is not None and not 1 <= int(max_length) <= limit:
            raise ApcscoreError(f"max_length must be between 1 and {limit} for this model, not {max_length}")
        self.max_length = int(max_length) if max_length is not None else limit
        self.max_gen_toks = int(max_gen_toks)
        self.add_bos_token = add_bos_token
        self.seed = int(seed)
        self.progress = progress
        self.chat_template_args: dict[str, Any] = {}
        self._generation_index = 0
        self.store: Any = None  # lmeval/store.ResponseStore (use_store)
        self.mine: Callable[[list[list[int]], list[int]], list[bool]] | None = None  # use_store's
        self.strict = False
        self.on_step: Callable[[Any], None] | None = None  # called by the engine after each step (SIGINT checks)
        self.computed = self.reused = self.skipped = 0  # lm-eval requests: run by the engine, read, not ours
        self._next_request_id = 0  # engine request ids are unique across calls (`_run`)

    # ---- what lm-eval asks of a model ---------------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        """BOS, else EOS (HFLM's): the context of an empty context and of the first rolling window."""
        bos = self.tokenizer.bos_token_id
        return bos if bos is not None else self.tokenizer.eos_token_id

    @property
    def tokenizer_name(self) -> str:
        return str(self.tokenizer.name_or_path).replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: bool | None = None,
                   left_truncate_len: int | None = None, **kwargs: Any) -> list[int]:
        """HFLM's `tok_encode`: the tokenizer's default special tokens unless told (or `add_bos_token`), none
        when the string already starts with the BOS text."""
        special: dict[str, bool] = {}
        if add_special_tokens is not None:
            special["add_special_tokens"] = add_special_tokens
        elif self.add_bos_token is not None:
            special["add_special_tokens"] = self.add_bos_token
        if add_special_tokens is None and string.startswith(self.tokenizer.decode(self.prefix_token_id)):
            special["add_special_tokens"] = False
        ids = list(self.tokenizer.encode(string, **special))
        return ids[-left_truncate_len:] if left_truncate_len else ids

    def generation_prompt(self, context: str) -> list[int]:
        """A generation context's tokens as HFLM's `tok_batch_encode` makes them (BOS checked by its text)."""
        bos = self.tokenizer.bos_token
        if bos is not None and context.startswith(bos):
            return list(self.tokenizer.encode(context, add_special_tokens=False))
        if self.add_bos_token is not None:
            return list(self.tokenizer.encode(context, add_special_tokens=self.add_bos_token))
        return list(self.tokenizer.encode(context))

    def tok_decode(self, tokens: Any, skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """HFLM's: the tokenizer's chat template as text; without the system turn if the template refuses it."""
        kwargs = dict(tokenize=False, add_generation_prompt=add_generation_prompt,
                      continue_final_message=not add_generation_prompt, **self.chat_template_args)
        try:
            return self.tokenizer.apply_chat_template(chat_history, **kwargs)
        except jinja2.exceptions.TemplateError:
            history = [m for m in chat_history if m["role"] != "system"]
            return self.tokenizer.apply_chat_template(history, **kwargs)

    # ---- running requests ---------------------------------------------------------------------------
    def use_store(self, store: Any, mine: Callable[[list[list[int]], list[int]], list[bool]] | None = None,
                  strict: bool = False) -> None:
        """Answer from `store` (lmeval/store.ResponseStore) what it holds and put every computed response into it.
        mine (`eval --shard`: run/eval.shard_split): compute only those requests, placeholders for the others;
        strict: every response must be in the store (a merge computes nothing)."""
        self.store, self.mine, self.strict = store, mine, strict

    def _run(self, requests: list[Request], desc: str, disable_tqdm: bool, sizes: list[int],
             done: Callable[[int, RequestOutput], None], total: int) -> None:
        """Run `requests` through the engine, calling `done(i, output)` as each finishes; requests[i] stands for
        sizes[i] of the call's `total` lm-eval requests (the progress bar). Request ids go on from the last call's,
        so an output of another call is caught as an internal error before anything is stored."""
        if not requests:
            return
        base, self._next_request_id = self._next_request_id, self._next_request_id + len(requests)
        for i, r in enumerate(requests):
            r.request_id = base + i
        answered = [False] * len(requests)
        with tqdm(total=total, initial=total - sum(sizes), desc=desc,
                  disable=disable_tqdm or not self.progress) as bar:
            for out in self.engine.run(requests, on_step=self.on_step):
                i = out.request_id - base if isinstance(out.request_id, int) else -1
                if not 0 <= i < len(requests) or answered[i]:
                    raise RuntimeError(f"{desc}: internal error: the engine gave request id {out.request_id!r}, not "
                                       f"one of this call's unanswered requests ({base}..{base + len(requests) - 1})")
                answered[i] = True
                if out.finish_reason == "abort":  # not run (run/ray_engine.py: a Ray chunk that failed)
                    raise ApcscoreError(f"{out.error}; the responses finished so far are kept: fix the cause (e.g. "
                                        "memory) and rerun the same command with --resume", exit_code=1)
                if out.error is not None:
                    raise ApcscoreError(f"{desc}: request {i} failed in the engine: {out.error}")
                done(i, out)
                bar.update(sizes[i])
        if not all(answered):
            raise RuntimeError(f"the engine returned {sum(answered)} outputs for {len(requests)} requests: this is a "
                               "bug")
        self.computed += sum(sizes)

    def _lookup(self, keys: list[str], prompts: list[list[int]], loads: list[int], placeholder: Any
                ) -> tuple[list[Any], list[int]]:
        """Each key's stored value, or `placeholder` where this shard does not compute it (`mine` of the prompts and
        their loads; all are computed without a shard); and the positions left to compute."""
        mask = [True] * len(keys) if self.mine is None else self.mine(prompts, loads)
        values: list[Any] = [None] * len(keys)
        todo = []
        for i, key in enumerate(keys):
            if self.store is not None and key in self.store:
                values[i] = self.store.get(key)
                self.reused += 1
            elif mask[i]:
                todo.append(i)
            else:
                values[i] = placeholder
                self.skipped += 1
        if todo and self.strict:
            raise ApcscoreError(f"{len(todo)} of {len(keys)} requests have no response in the shards' stores: a "
                                "shard is missing or unfinished (rerun it with --resume), or the shards were run "
                                "with other tasks or options")
        return values, todo

    def _loglikelihood_tokens(self, requests: list[tuple[Any, list[int], list[int]]], disable_tqdm: bool = False,
                              **kwargs: Any) -> list[tuple[float, bool]]:
        """(loglikelihood, is_greedy) of each (_, context tokens, continuation tokens), in input order.

        Sequences that differ only in their last token share one engine request (`last_token_alternatives`, bitwise
        the values of separate requests). Stored responses are read; computed ones are stored as they finish."""
        separate = []
        for _, context, continuation in requests:
            if not context or not continuation:
                raise ApcscoreError("a loglikelihood request needs context and continuation tokens")
            if len(continuation) > self.max_length:
                raise ApcscoreError(f"a continuation of {len(continuation)} tokens is longer than max_length "
                                    f"{self.max_length}")
            tokens = (context + continuation)[-(self.max_length + 1):]  # HFLM's left truncation
            separate.append(Request(None, tokens, prompt_logprobs=1, score_from=len(tokens) - len(continuation),
                                    prompt_logprob_ranks=False))
        keys = [loglikelihood_key(r.prompt_token_ids, r.score_from) for r in separate]
        # the last token left out of the split: a context's one-token choices stay in one shard, one request
        values, todo = self._lookup(keys, [r.prompt_token_ids[:-1] for r in separate],
                                    [len(r.prompt_token_ids) for r in separate], [0.0, False])
        merged, owner = group_by_last_token([separate[i] for i in todo])
        members: list[list[int]] = [[] for _ in merged]
        for j, o in enumerate(owner):
            members[o].append(todo[j])

        def done(m: int, out: RequestOutput) -> None:
            for i in members[m]:
                score = continuation_score(out, last_token=separate[i].prompt_token_ids[-1])
                values[i] = [score.logprob, score.is_greedy]
                if self.store is not None:
                    self.store.put(keys[i], values[i])

        self._run(merged, "apcscore loglikelihood", disable_tqdm, [len(m) for m in members], done, len(keys))
        return [(float(v[0]), bool(v[1])) for v in values]

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        """Sum of the loglikelihoods of lm-eval's disjoint rolling windows over each text; one float each."""
        windows: list[tuple[Any, list[int], list[int]]] = []
        counts = []
        for req in requests:
            (text,) = req.args
            pairs = [make_disjoint_window(w) for w in get_rolling_token_windows(
                token_list=self.tok_encode(text), prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length, context_len=1)]
            windows.extend((None, ctx, pred) for ctx, pred in pairs)
            counts.append(len(pairs))
        scores = iter(self._loglikelihood_tokens(windows, disable_tqdm=disable_tqdm) if windows else [])
        totals = [float(sum(s for s, _ in itertools.islice(scores, n))) for n in counts]  # each text's windows
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    def sampling_params(self, gen_kwargs: dict[str, Any], index: int) -> tuple[SamplingParams, list[str]]:
        """SamplingParams and stop strings of one request's generation kwargs (lm-eval's normalisation)."""
        kwargs = dict(normalize_gen_kwargs(gen_kwargs, self.max_gen_toks))
        until = handle_stop_sequences(kwargs.pop("until", None), eos=self.tok_decode(self.eot_token_id,
                                                                                     skip_special_tokens=False))
        max_gen_toks = int(kwargs.pop("max_gen_toks"))
        sample = bool(kwargs.get("do_sample"))
        temperature = float(kwargs.pop("temperature", 0.0) or 0.0) if sample else 0.0
        kwargs.pop("temperature", None)
        top_p = float(kwargs.pop("top_p", 1.0) or 1.0)
        top_k = int(kwargs.pop("top_k", 0) or 0)
        seed = kwargs.pop("seed", None)
        unknown = sorted(set(kwargs) - _IGNORED_GEN_KWARGS)
        if unknown:
            raise ApcscoreError(f"generation kwargs the apcscore backend does not support: {unknown}")
        if sample and "temperature" not in gen_kwargs:
            temperature = 1.0  # transformers' generate default when sampling
        params = SamplingParams(max_tokens=max_gen_toks, temperature=temperature, top_p=top_p, top_k=top_k,
                                seed=int(seed) if seed is not None else record_seed(self.seed, index),
                                stop=tuple(s for s in until if s))
        return params, until

    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        """Completions of each (context, gen_kwargs), cut at the first `until` string; in input order.
        Generations in the store (their token ids, keyed by prompt and sampling settings) are read."""
        engine_requests, stops = [], []
        for i, req in enumerate(requests):
            context, gen_kwargs = req.args
            params, until = self.sampling_params(gen_kwargs, self._generation_index + i)
            max_ctx = self.max_length - params.max_tokens
            if max_ctx <= 0:
                raise ApcscoreError(f"max_gen_toks {params.max_tokens} leaves no room for a context within "
                                    f"max_length {self.max_length}")
            prompt = self.generation_prompt(context)[-max_ctx:]
            engine_requests.append(Request(i, prompt, sampling=params))
            stops.append(until)
        self._generation_index += len(requests)
        keys = [generation_key(r.prompt_token_ids, r.sampling) for r in engine_requests]
        tokens, todo = self._lookup(keys, [r.prompt_token_ids for r in engine_requests],
                                    [len(r.prompt_token_ids) + r.sampling.max_tokens for r in engine_requests], [])
        run = [engine_requests[i] for i in todo]

        def done(j: int, out: RequestOutput) -> None:
            i = todo[j]
            tokens[i] = [int(t) for t in out.output_token_ids]
            if self.store is not None:
                self.store.put(keys[i], tokens[i])

        self._run(run, "apcscore generate_until", disable_tqdm, [1] * len(run), done, len(keys))
        results = []
        for req, ids, until in zip(requests, tokens, stops):
            text = postprocess_generated_text(self.tok_decode(ids), until, None)
            self.cache_hook.add_partial("generate_until", req.args, text)
            results.append(text)
        return results

    def get_model_info(self) -> dict[str, Any]:
        """What lm-eval records about the model in its results."""
        info = self.engine.info
        return {"model_name": info.name, "model_path": str(info.path or ""),
                "model_num_parameters": info.num_parameters, "model_dtype": str(self.engine.dtype),
                "model_fingerprint": info.fingerprint}
