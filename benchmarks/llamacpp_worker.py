"""One contender of benchmarks/bench_llamacpp.py in one process: llama.cpp (its `llama-perplexity` tool or the
`llama-cpp-python` bindings) or apcscore's Engine, on the default model's GGUF file.

    python benchmarks/llamacpp_worker.py MODE --output OUT [options]

Modes (the same work as the apcscore contender beside it; docs/benchmarks.md, "Against llama.cpp"):
  tool       run the `llama-perplexity` binary (--exe) on --text with `-c N_CTX --chunks N -t THREADS`, parse its
             output (the final PPL, its own prompt-eval timings) and write them as JSON
  ppl        llama-perplexity's computation through the bindings: the text tokenized by llama.cpp, cut into
             --chunks chunks of --n-ctx tokens (no BOS: the file's add_bos_token is false), each evaluated on
             its own (cache cleared) with all logits; the log-softmax of positions n_ctx/2 .. n_ctx-2 scores the
             tokens n_ctx/2+1 .. n_ctx-1 of the chunk; PPL = exp(mean NLL) over all chunks
  score      prompt logprobs of every record of --data ({"id", "prompt_token_ids"}): each record evaluated on its
             own with all logits, log-softmax of every position, each next token's logprob and the argmax
  tokens     llama.cpp's token ids of --text (a JSON list), to check that both sides score the same tokens
  apcscore   llama-perplexity's computation in apcscore's Engine (Python API): one request per chunk of --data,
             scored from position n_ctx/2 + 1 (`Request.score_from`), logprob only (no ranks); fp32

The last stdout line is `BENCH_REPORT {json}` (benchmarks/harness.py): load_s, compute_s, output and, for
perplexity, ppl and the scored token count. The llama modes import only numpy and llama_cpp (the `bench` extra);
`tool` imports nothing outside the standard library.
"""

from __future__ import annotations

import time

T_START = time.perf_counter()

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import re  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

REPORT_PREFIX = "BENCH_REPORT "
_FINAL = re.compile(r"Final estimate: PPL = ([0-9.]+) \+/- ([0-9.]+)")
_CHUNKS = re.compile(r"(?:calculating perplexity|computing) over (\d+) chunks, n_ctx=(\d+), batch_size=(\d+), "
                     r"n_seq=(\d+)")
# the log prefix of llama.cpp's tools: minutes.seconds.milliseconds.microseconds since the start, then a level letter
_STAMP = r"(?<![\d.])(\d+)\.(\d{2})\.(\d{3})\.(\d{3}) [A-Z] (?:perplexity: )?"
_PERF = re.compile(r"llama_perf_context_print:\s+(load|prompt eval|eval|total) time =\s+([0-9.]+) ms"
                   r"(?: /\s+(\d+) (?:tokens|runs))?")


def _stamp(output: str, line_start: str) -> float | None:
    """Seconds since the tool's start of the first log line beginning with line_start (None: no such line)."""
    m = re.search(_STAMP + re.escape(line_start), output)
    if m is None:
        return None
    minutes, seconds, ms, us = map(int, m.groups())
    return minutes * 60 + seconds + ms / 1e3 + us / 1e6


def parse_llama_perplexity(output: str) -> dict[str, Any]:
    """What `llama-perplexity` printed: ppl and its error, chunks, n_ctx, batch, n_seq; compute_s, from its log
    timestamps, from the start of the perplexity loop to the final estimate; and, where it prints them
    (llama_perf_context_print), its own timings (s) and token counts. Raises ValueError when it printed no final
    estimate."""
    final = _FINAL.search(output)
    if final is None:
        raise ValueError("llama-perplexity printed no 'Final estimate: PPL = ...' line; its output ends with:\n"
                         + output[-1500:])
    out: dict[str, Any] = {"ppl": float(final.group(1)), "ppl_err": float(final.group(2))}
    chunks = _CHUNKS.search(output)
    if chunks:
        out.update(zip(("chunks", "n_ctx", "batch_size", "n_seq"), map(int, chunks.groups())))
    start, end = _stamp(output, "calculating perplexity over"), _stamp(output, "Final estimate")
    if start is not None and end is not None:
        out["compute_s"] = round(end - start, 6)
    for name, ms, count in _PERF.findall(output):
        key = name.replace(" ", "_")
        out[f"{key}_s"] = float(ms) / 1000
        if count:
            out[f"{key}_tokens"] = int(count)
    return out


def log_softmax(logits: Any) -> Any:
    """Row-wise log-softmax of [N, V] float32 logits, the sum in float64 (as llama-perplexity's)."""
    import numpy as np

    x = np.asarray(logits, dtype=np.float64)
    shifted = x - x.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def scored_span(n_ctx: int) -> tuple[int, int]:
    """llama-perplexity's scored part of a chunk: (first, count): logits of positions first .. first+count-1 score
    the tokens first+1 .. n_ctx-1 (first = n_ctx // 2)."""
    first = n_ctx // 2
    return first, n_ctx - 1 - first


def _report(payload: dict[str, Any]) -> None:
    print(REPORT_PREFIX + json.dumps(payload), flush=True)


def run_tool(args: argparse.Namespace) -> None:
    cmd = [args.exe, "-m", args.gguf, "-f", str(args.text), "-c", str(args.n_ctx), "--chunks", str(args.chunks),
           "-t", str(args.threads), "-tb", str(args.threads)]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # one stream, in order
    text = proc.stdout
    if proc.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed (exit {proc.returncode}):\n{text[-3000:]}")
    parsed = parse_llama_perplexity(text)
    Path(args.output).write_text(json.dumps({**parsed, "argv": cmd}))
    _report({"ppl": parsed["ppl"], "output": str(args.output),
             **{k: parsed[k] for k in ("compute_s", "load_s") if k in parsed}})


def _llama(args: argparse.Namespace) -> Any:
    from llama_cpp import Llama

    return Llama(model_path=args.gguf, n_ctx=args.n_ctx, n_batch=args.n_ctx, n_threads=args.threads,
                 n_threads_batch=args.threads, logits_all=True, verbose=False)


def run_ppl(args: argparse.Namespace) -> None:
    import numpy as np

    t0 = time.perf_counter()
    llm = _llama(args)
    load_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    # as llama-perplexity's common_tokenize: BOS only where the vocabulary asks for it (not this file)
    tokens = llm.tokenize(Path(args.text).read_bytes(), add_bos=True, special=False)
    first, count = scored_span(args.n_ctx)
    nll, scored = 0.0, 0
    for i in range(args.chunks):
        chunk = tokens[i * args.n_ctx:(i + 1) * args.n_ctx]
        llm.reset()  # eval() drops the cache past n_tokens: each chunk starts empty
        llm.eval(chunk)
        lp = log_softmax(llm.scores[first:first + count])  # [count, V]
        nll -= float(lp[np.arange(count), chunk[first + 1:]].sum())
        scored += count
    compute_s = time.perf_counter() - t0
    result = {"ppl": math.exp(nll / scored), "scored": scored, "tokens": len(tokens)}
    Path(args.output).write_text(json.dumps(result))
    _report({"load_s": round(load_s, 3), "compute_s": round(compute_s, 3), "ppl": result["ppl"],
             "output": str(args.output)})


def run_tokens(args: argparse.Namespace) -> None:
    from llama_cpp import Llama

    llm = Llama(model_path=args.gguf, vocab_only=True, verbose=False)
    Path(args.output).write_text(json.dumps(llm.tokenize(Path(args.text).read_bytes(), add_bos=True)))


def run_score(args: argparse.Namespace) -> None:
    import numpy as np

    records = [json.loads(line) for line in Path(args.data).read_text().splitlines() if line.strip()]
    t0 = time.perf_counter()
    llm = _llama(args)
    load_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    logprobs, top1 = [], []
    for r in records:
        ids = r["prompt_token_ids"]
        llm.reset()
        llm.eval(ids)
        lp = log_softmax(llm.scores[:len(ids) - 1])  # position q scores token q + 1
        logprobs.append(lp[np.arange(len(ids) - 1), ids[1:]].astype(np.float32))
        top1.append(lp.argmax(axis=-1))
    compute_s = time.perf_counter() - t0
    np.savez(args.output, ids=np.array([r["id"] for r in records]),
             lengths=np.array([len(x) for x in logprobs], np.int64),
             logprobs=np.concatenate(logprobs), top_ids=np.concatenate(top1).astype(np.int64))
    _report({"load_s": round(load_s, 3), "compute_s": round(compute_s, 3), "output": str(args.output)})


def run_apcscore(args: argparse.Namespace) -> None:
    from apcscore.config import EngineConfig
    from apcscore.engine import load_engine
    from apcscore.engine.step import Request

    chunks = [json.loads(line)["prompt_token_ids"] for line in Path(args.data).read_text().splitlines() if line]
    t0 = time.perf_counter()
    engine = load_engine(args.model, EngineConfig(device="cpu", dtype="float32"))
    load_s = time.perf_counter() - t0
    first, count = scored_span(args.n_ctx)
    t0 = time.perf_counter()
    requests = [Request(i, ids, prompt_logprobs=0, score_from=first + 1, prompt_logprob_ranks=False)
                for i, ids in enumerate(chunks)]
    nll, scored = 0.0, 0
    for out in engine.run(requests):
        if out.error:
            sys.exit(f"chunk {out.request_id}: {out.error}")
        lps = out.prompt_logprobs.token_logprobs
        if len(lps) != count:
            sys.exit(f"chunk {out.request_id}: {len(lps)} scored tokens, expected {count}")
        nll -= float(lps.astype("float64").sum())
        scored += len(lps)
    compute_s = time.perf_counter() - t0
    result = {"ppl": math.exp(nll / scored), "scored": scored}
    Path(args.output).write_text(json.dumps(result))
    _report({"load_s": round(load_s, 3), "compute_s": round(compute_s, 3), "ppl": result["ppl"],
             "output": str(args.output)})


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("mode", choices=["tool", "ppl", "score", "apcscore", "tokens"])
    ap.add_argument("--output", required=True)
    ap.add_argument("--gguf", help="the GGUF file (llama.cpp modes)")
    ap.add_argument("--exe", help="tool: the llama-perplexity binary")
    ap.add_argument("--text", type=Path, help="tool, ppl: the text file")
    ap.add_argument("--data", type=Path, help="score, apcscore: records JSONL")
    ap.add_argument("--n-ctx", type=int, default=512)
    ap.add_argument("--chunks", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--model", default="smollm2-135m", help="apcscore: the model")
    args = ap.parse_args(argv)
    {"tool": run_tool, "ppl": run_ppl, "score": run_score, "apcscore": run_apcscore,
     "tokens": run_tokens}[args.mode](args)


if __name__ == "__main__":
    main(sys.argv[1:])
