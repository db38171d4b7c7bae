"""OpenAI Batch request lines -> our records (the input side of `--input-format openai-batch`).

A request line is ``{"custom_id", "method": "POST", "url": "/v1/chat/completions" | "/v1/completions",
"body": {...}}`` (the OpenAI Batch API's input file, also what ``vllm run-batch`` reads). `to_record` turns one
parsed line into the record our schemas check (`io/schemas.check_record`: a messages, prompt or
prompt_token_ids record with generate's sampling overrides) and `BatchLine`, what the result line needs later
(endpoint, echo, how many logprobs the body asked for, its model). Every body field either maps onto one of
ours or is refused: a field that would change the result and that we do not implement is never ignored. Which
field maps onto what, which are harmless and which are accepted at a neutral value only: the constants below and
docs/decisions.md, "OpenAI Batch files" and "OpenAI Batch fidelity".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from apcscore.config import RECORD_FIELDS
from apcscore.errors import shown as _show
from apcscore.io.schemas import is_int

CHAT_URL = "/v1/chat/completions"
COMPLETIONS_URL = "/v1/completions"
ENDPOINTS = {CHAT_URL: "chat", COMPLETIONS_URL: "completions"}
LINE_KEYS = ("custom_id", "method", "url", "body")
INPUT_FORMATS = ("auto", "apcscore", "openai-batch")
OUTPUT_FORMATS = ("parquet", "openai-batch")

_SAMPLING = tuple(RECORD_FIELDS)  # a body's sampling fields are a generate record's
_HARMLESS = {"model", "user", "metadata", "store", "service_tier", "stream", "stream_options"}
# fields we do not implement, accepted only at the value that changes nothing
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "frequency_penalty": (0, 0.0), "presence_penalty": (0, 0.0), "repetition_penalty": (1, 1.0),
    "logit_bias": ({},), "best_of": (1,), "suffix": ("",), "tools": ([],), "tool_choice": ("none",),
    "response_format": ({"type": "text"},), "min_p": (0, 0.0), "min_tokens": (0,), "ignore_eos": (False,),
    "parallel_tool_calls": (True, False), "functions": ([],), "function_call": ("none",),
    "n": (1,), "stream": (False,),
}
_OWN = {"chat": {"messages", "logprobs", "top_logprobs", "max_completion_tokens"},
        "completions": {"prompt", "logprobs", "echo"}}


def is_batch_line(obj: Any) -> bool:
    """Does this parsed line look like an OpenAI Batch request line (what `--input-format auto` tests)?"""
    return isinstance(obj, dict) and all(k in obj for k in LINE_KEYS)


@dataclass(frozen=True)
class BatchLine:
    """What the result line of one request needs besides the row (kept in the record's fields["openai"])."""

    endpoint: str  # chat | completions
    echo: bool = False
    logprobs: int | None = None  # top-K per generated token (chat: top_logprobs, 0 without it); None: none
    prompt_logprobs: int | None = None  # top-K computed per prompt token: the larger of the two below
    model: str | None = None  # the body's model, when it gives one
    vllm_prompt_logprobs: int | None = None  # top-K of vLLM's prompt_logprobs the body asked for (None: none)
    echo_logprobs: int | None = None  # completions with echo and logprobs: top-K of the echoed prompt tokens


@dataclass
class Converted:
    custom_id: str | None
    record: dict | None  # our record (what check_record reads), None when the line cannot become one
    line: BatchLine | None
    problems: list[str]


def _content(v: Any) -> tuple[Any, str | None]:
    """A message's content as a string: a string, or a list of text parts joined with "\\n" as vLLM joins them
    (other parts refused)."""
    if not isinstance(v, list):
        return v, None
    texts = []
    for part in v:
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            return v, (f"a message content part must be {{\"type\": \"text\", \"text\": str}} (apcscore reads text "
                       f"only), got {_show(part)}")
        texts.append(part["text"])
    return "\n".join(texts), None


def _prompt(v: Any) -> tuple[dict | None, str | None]:
    """A completions `prompt` as our record's field: {"prompt": str} or {"prompt_token_ids": [...]}."""
    if isinstance(v, list) and len(v) == 1 and (isinstance(v[0], str) or isinstance(v[0], list)):
        v = v[0]  # one prompt in a list
    if isinstance(v, str):
        return {"prompt": v}, None
    if isinstance(v, list) and v and all(is_int(t) for t in v):
        return {"prompt_token_ids": v}, None
    if isinstance(v, list) and len(v) > 1 and all(isinstance(p, (str, list)) for p in v):
        return None, (f"'prompt' holds {len(v)} prompts; apcscore answers one prompt per line — write each prompt "
                      "as its own request line with its own custom_id")
    return None, f"'prompt' must be a string or a list of token ids, got {_show(v)}"


def to_record(obj: dict, command: str, *, max_logprobs: int, model_names: frozenset[str] | None) -> Converted:
    """One request line as our record, or the problems that keep it from being one.

    `command` is generate (every request) or score (only echo requests with max_tokens 0, which score the
    prompt); `model_names` the names the body's model may have (None: --ignore-body-model)."""
    if not isinstance(obj, dict):
        return Converted(None, None, None, [f"the line is {_show(obj)}, not a JSON object (a request line is "
                                            f"{{{', '.join(map(repr, LINE_KEYS))}}})"])
    problems: list[str] = []
    cid = obj.get("custom_id")
    if not isinstance(cid, str) or not cid:
        problems.append(f"'custom_id' must be a non-empty string, got {_show(cid)}")
        cid = None
    extra = sorted(obj.keys() - set(LINE_KEYS))
    if extra:
        problems.append(f"unknown field{'s' if len(extra) > 1 else ''} {', '.join(map(repr, extra))} in the request "
                        f"line (a line is {{{', '.join(map(repr, LINE_KEYS))}}})")
    if obj.get("method") != "POST":
        problems.append(f"'method' must be \"POST\", got {_show(obj.get('method'))}")
    endpoint = ENDPOINTS.get(obj.get("url"))  # type: ignore[arg-type]
    if endpoint is None:
        problems.append(f"'url' {_show(obj.get('url'))} is not an endpoint apcscore answers (use {CHAT_URL} or "
                        f"{COMPLETIONS_URL})")
    body = obj.get("body")
    if not isinstance(body, dict):
        problems.append(f"'body' must be a JSON object, got {_show(body)}")
    if problems or endpoint is None or not isinstance(body, dict):
        return Converted(cid, None, None, problems)

    own = _OWN[endpoint]
    for key in sorted(body):
        value = body[key]
        if key in own or key in _SAMPLING or key in ("prompt_logprobs",) or value is None:
            continue
        if key in _NEUTRAL:
            if key == "stream" and value is not False:
                problems.append(f"body field 'stream' = {_show(value)}: a batch answers each request whole, without "
                                "streaming — remove it (or set it to false)")
            elif value not in _NEUTRAL[key] or (isinstance(value, bool) != isinstance(_NEUTRAL[key][0], bool)):
                problems.append(f"body field {key!r} = {_show(value)} would change the result, and apcscore does "
                                f"not implement it — remove it (or set it to {_show(_NEUTRAL[key][0])})")
        elif key not in _HARMLESS:
            problems.append(f"body field {key!r} is not supported by apcscore ({endpoint} requests read "
                            f"{', '.join(sorted(own | set(_SAMPLING) | {'prompt_logprobs'}))}) — remove it")
    if body.get("stream_options") is not None:
        problems.append("body field 'stream_options' needs stream, and a batch answers without streaming — remove it")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        problems.append(f"body field 'model' must be a string, got {_show(model)}")
    elif model is not None and model_names is not None and model not in model_names:
        problems.append(f"the body's model {model!r} is not this run's model ({' / '.join(sorted(model_names))}) — "
                        "run with --model set to it, or pass --ignore-body-model to answer every line with --model")

    record: dict = {key: body[key] for key in _SAMPLING if body.get(key) is not None}
    if is_int(record.get("top_k")) and record["top_k"] == -1:
        record["top_k"] = 0  # the API's (and vLLM's) "off" is our 0, not --top-k: the body says it is off
    if endpoint == "chat" and body.get("max_completion_tokens") is not None:
        mct = body["max_completion_tokens"]
        if "max_tokens" in record and record["max_tokens"] != mct:
            problems.append(f"'max_tokens' {_show(record['max_tokens'])} and 'max_completion_tokens' {_show(mct)} "
                            "disagree — give one of them")
        record["max_tokens"] = mct

    logprobs = prompt_logprobs = echo_logprobs = None
    echo = False
    usable = True  # False: the line has no prompt we could check further
    if endpoint == "chat":
        messages = body.get("messages")
        if messages is None:
            problems.append("a chat request needs 'messages' (a list of {\"role\", \"content\"} objects)")
            usable = False
        if isinstance(messages, list):
            fixed = []
            for i, m in enumerate(messages):
                extra = sorted(k for k in m if k not in ("role", "content") and m[k] is not None) \
                    if isinstance(m, dict) else []
                if extra:
                    problems.append(f"'messages' item {i} has {', '.join(map(repr, extra))}, which apcscore does not "
                                    "give the chat template (it reads role and content) — remove "
                                    f"{'it' if len(extra) == 1 else 'them'}")
                if isinstance(m, dict) and "content" in m:
                    content, why = _content(m["content"])
                    if why:
                        problems.append(f"'messages' {why}")
                    m = {**m, "content": content}
                if isinstance(m, dict) and m.get("role") == "developer":
                    m = {**m, "role": "system"}  # OpenAI's newer name for the system message; templates know system
                fixed.append(m)
            messages = fixed
        record["messages"] = messages
        lp, top = body.get("logprobs"), body.get("top_logprobs")
        if lp is not None and not isinstance(lp, bool):
            problems.append(f"'logprobs' of a chat request must be true or false, got {_show(lp)}")
        if top is not None and (not is_int(top) or top < 0):
            problems.append(f"'top_logprobs' must be an integer >= 0, got {_show(top)}")
        elif top is not None and not lp:
            problems.append("'top_logprobs' needs 'logprobs': true — set it too")
        if lp is True:
            logprobs = top if is_int(top) else 0
    else:
        if "prompt" not in body or body["prompt"] is None:
            problems.append("a completions request needs 'prompt' (a string or a list of token ids)")
            usable = False
        else:
            fields, why = _prompt(body["prompt"])
            if why:
                problems.append(why)
                usable = False
            else:
                record.update(fields or {})
        lp = body.get("logprobs")
        if lp is not None and (not is_int(lp) or lp < 0):
            problems.append(f"'logprobs' of a completions request must be an integer >= 0 (top-K), got {_show(lp)}")
        elif lp is not None:
            logprobs = lp
        echo = body.get("echo")
        if echo is not None and not isinstance(echo, bool):
            problems.append(f"'echo' must be true or false, got {_show(echo)}")
        echo = echo is True
        if echo and logprobs is not None:
            prompt_logprobs = echo_logprobs = logprobs
    plp = body.get("prompt_logprobs")
    if plp is not None:
        if not is_int(plp) or plp < 0:
            problems.append(f"'prompt_logprobs' must be an integer >= 0, got {_show(plp)}")
        else:
            prompt_logprobs = max(plp, prompt_logprobs or 0)
    vllm_prompt = plp if is_int(plp) and plp >= 0 else None
    for name, k in (("logprobs" if endpoint == "completions" else "top_logprobs", logprobs),
                    ("prompt_logprobs", prompt_logprobs)):
        if is_int(k) and k > max_logprobs:
            problems.append(f"{name!r} {k} is above the cap max_logprobs = {max_logprobs}; ask for at most "
                            f"{max_logprobs}, or raise the cap with --max-logprobs {k}")

    if command == "score":
        if endpoint != "completions" or not echo or record.get("max_tokens") != 0:
            problems.append("score answers only scoring requests: /v1/completions with \"echo\": true and "
                            "\"max_tokens\": 0 (the prompt's logprobs) — run generation requests with apcscore "
                            "generate")
            usable = False
        record = {k: v for k, v in record.items() if k in ("prompt", "prompt_token_ids")}
        prompt_logprobs = prompt_logprobs if prompt_logprobs is not None else logprobs
        logprobs = None
    line = BatchLine(endpoint, echo, logprobs, prompt_logprobs, model, vllm_prompt, echo_logprobs)
    return Converted(cid, record if usable else None, line, problems)


def defaults_note(records: list[Any], max_tokens: int, temperature: float) -> str | None:
    """The note a generate run of request lines prints once: how many lines give no `max_tokens` / `temperature`
    and what they get instead (ours, not the API's); None when every line gives both. `records` are the run's
    valid records (`io/schemas.Record`)."""
    n = len(records)
    no_max = sum(r.fields.get("max_tokens") is None for r in records)
    no_temp = sum(r.fields.get("temperature") is None for r in records)
    parts = []
    if no_max:
        parts.append(f"{no_max} of {n} request lines give no max_tokens: they stop at --max-tokens {max_tokens} "
                     "(the API's chat default: until the context ends)")
    if no_temp:
        parts.append(f"{no_temp} of {n} request lines give no temperature: they use --temperature {temperature:g}"
                     + (" (greedy)" if temperature == 0 else "") + " (the API's default: 1)")
    return "; ".join(parts) + " — set them in the bodies or on the command line" if parts else None
