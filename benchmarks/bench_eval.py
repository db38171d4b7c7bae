"""Evaluation benchmark: `apcscore perplexity` and multiple-choice `score` against plain transformers.

    .venv/bin/python benchmarks/bench_eval.py                 # full: 20,000 tokens / 200 questions, 3 repeats
    .venv/bin/python benchmarks/bench_eval.py --quick         # dry run: 1,000 tokens / 12 questions, 1 repeat
    .venv/bin/python benchmarks/bench_eval.py --scenarios perplexity --device cuda

Scenarios (inputs from datasets/, see datasets/README.md):
  perplexity  one text of ~20,000 tokens (the sample Shakespeare texts, repeated), window 512 = stride
              (lm-eval's rolling loglikelihood). transformers: the same windows (apcscore's
              `rolling_windows`, tested equal to lm-eval's), in batches of `--batch-size` with right padding,
              log_softmax of the scored rows. apcscore: the PerplexityJob through the Engine, and the CLI.
  choices     200 four-way questions (the 40 of sample_choices.jsonl, five times), one request per choice.
              transformers: lm-eval's `_loglikelihood_tokens` batching: requests sorted by length, longest
              first, batches of `--batch-size`, right padding, log_softmax, sum over the continuation.
              apcscore: the ScoreJob through the Engine, and the CLI.
  fewshot     5-shot multiple choice behind one ~330-token prefix (issue 13 (a)): recompute, --exact-reuse.
  sysprompt   `--prompts` prompts (default 200) sharing one `--system-tokens` (500) system prompt, scored at
              every position with `--prompt-logprobs 5` (issue 13 (b)): apcscore recompute is the baseline,
              --exact-reuse (the score store) the contender, goal >= 5x; the check: bitwise equal outputs.

Each contender runs as its own process (harness.py), repeated and interleaved; the table shows medians of
whole-process and compute time, tokens/s and ours / transformers. A check compares what the sides computed
(max |delta logprob|, perplexity, accuracy). Results go to results/bench_eval.json.

The same file is the worker: `bench_eval.py worker --side apcscore|transformers --task perplexity|choices
--data IN.jsonl --output OUT.npz [...]` prints one `BENCH_REPORT {json}` line.
"""

from __future__ import annotations

import time

T_START = time.perf_counter()

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import resource  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT))

REPORT_PREFIX = "BENCH_REPORT "
NO_INVARIANCE = "apcscore --no-batch-invariant"
EXACT_REUSE = "apcscore --exact-reuse"


def read_jsonl(path: Path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def write_jsonl(path: Path, records: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")


# ================================================================================================
# worker: one side, one task, in one process
# ================================================================================================
def load_side(side: str, model: str, device: str, dtype: str, batch_invariant: bool = True,
              exact_reuse: bool = False) -> Any:
    import torch

    if side == "apcscore":
        from apcscore.config import EngineConfig
        from apcscore.engine import load_engine

        return load_engine(model, EngineConfig(device=device, dtype=dtype, batch_invariant=batch_invariant,
                                               exact_reuse=exact_reuse))
    from transformers import AutoModelForCausalLM

    from apcscore.models.loading import load_tokenizer

    from apcscore.models.locate import resolve_model

    path = resolve_model(model)[0]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).to(device).eval()
    hf.bench_tokenizer = load_tokenizer(path)
    return hf


def run_job(engine: Any, job_name: str, options: Any, records: list[dict]) -> list[dict]:
    """Rows of `records` through a job and the engine, all requests batched together (as the CLI runs)."""
    from apcscore.io.schemas import Record

    from apcscore.jobs.perplexity import PerplexityJob
    from apcscore.jobs.score import ScoreJob

    job = (PerplexityJob if job_name == "perplexity" else ScoreJob)(engine.tokenizer, engine.info.max_model_len,
                                                                    options)
    kind = {"perplexity": "text", "prompts": "prompt"}.get(job_name, "choices")
    recs = [Record(i, i + 1, r["id"], kind, {k: v for k, v in r.items() if k != "id"})
            for i, r in enumerate(records)]
    counts, requests, plans = [], [], []
    for rec in recs:
        reqs, plan = job.requests(rec)
        counts.append(len(reqs))
        plans.append(plan)
        for j, q in enumerate(reqs):
            q.request_id = (rec.index, j)
            requests.append(q)
    outs = {}
    for out in engine.run(requests):
        if out.error:
            raise RuntimeError(f"request {out.request_id}: {out.error}")
        outs[out.request_id] = out
    return [job.row(plan, [outs[(plan.record.index, j)] for j in range(n)]) for plan, n in zip(plans, counts)]


def batched_logprobs(model: Any, items: list[tuple[list[int], int]], batch_size: int, device: str) -> list[Any]:
    """transformers, lm-eval style: each item (tokens, n_scored) -> logprobs of its last n_scored tokens.

    Items run longest first in batches of `batch_size`, right padded (causal: padding after a sequence does
    not change it); one forward per batch, fp32 log_softmax of the rows that score a token.
    """
    import torch

    results: list[Any] = [None] * len(items)
    order = sorted(range(len(items)), key=lambda i: -len(items[i][0]))
    with torch.inference_mode():
        for b in range(0, len(order), batch_size):
            idx = order[b:b + batch_size]
            seqs = [items[i][0] for i in idx]
            width = max(map(len, seqs)) - 1  # the last token is only a target
            ids = torch.zeros((len(seqs), width), dtype=torch.long)  # [B, W]
            mask = torch.zeros((len(seqs), width), dtype=torch.long)
            for row, s in enumerate(seqs):
                ids[row, :len(s) - 1] = torch.tensor(s[:-1])
                mask[row, :len(s) - 1] = 1
            logits = model(input_ids=ids.to(device), attention_mask=mask.to(device)).logits  # [B, W, V]
            for row, i in enumerate(idx):
                s, n = items[i]
                rows = logits[row, len(s) - 1 - n:len(s) - 1].float()  # [n, V]
                lp = torch.log_softmax(rows, dim=-1)
                results[i] = lp.gather(1, torch.tensor(s[-n:], device=lp.device)[:, None])[:, 0].cpu().numpy()
            del logits
    return results


def transformers_perplexity(model: Any, records: list[dict], window: int, batch_size: int, device: str) -> list[dict]:
    from apcscore.jobs.loglikelihood import encode, prefix_token_id
    from apcscore.jobs.perplexity import rolling_windows

    tok = model.bench_tokenizer
    items, spans = [], []
    for r in records:
        seq = [prefix_token_id(tok)] + encode(tok, r["text"])
        first = len(items)
        items += [(seq[w.start:w.end], w.num_scored) for w in rolling_windows(len(seq) - 1, window, window)]
        spans.append((first, len(items)))
    lps = batched_logprobs(model, items, batch_size, device)
    return [{"token_logprobs": np.concatenate(lps[a:b])} for a, b in spans]


def transformers_choices(model: Any, records: list[dict], batch_size: int, device: str) -> list[dict]:
    from apcscore.jobs.loglikelihood import choice_columns, encode_pair, prefix_token_id

    tok = model.bench_tokenizer
    prefix = prefix_token_id(tok)
    items, spans = [], []
    for r in records:
        first = len(items)
        for c in r["choices"]:
            ctx, cont = encode_pair(tok, r["context"], c, prefix)
            items.append((ctx + cont, len(cont)))
        spans.append((first, len(items)))
    lps = batched_logprobs(model, items, batch_size, device)
    return [choice_columns([float(np.sum(lps[i], dtype=np.float64)) for i in range(a, b)], r["choices"], r["answer"])
            for r, (a, b) in zip(records, spans)]


def save(path: Path, task: str, rows: list[dict]) -> None:
    if task == "prompts":  # every scored position's logprob, rank and top-K (position 0 is never scored)
        np.savez(path, **prompt_arrays(rows))
    elif task == "perplexity":
        lps = [np.asarray([x for x in r["token_logprobs"] if x is not None], np.float32) for r in rows]
        np.savez(path, lengths=np.array([len(x) for x in lps]), logprobs=np.concatenate(lps))
    else:
        np.savez(path, choice_logprobs=np.array([x for r in rows for x in r["choice_logprobs"]]),
                 pred=np.array([r["pred"] for r in rows]), pred_norm=np.array([r["pred_norm"] for r in rows]),
                 correct=np.array([r["correct"] for r in rows]),
                 correct_norm=np.array([r["correct_norm"] for r in rows]))


def prompt_arrays(rows: list[dict]) -> dict[str, np.ndarray]:
    """The per-token columns of `score` rows on prompts, concatenated (for a bitwise check)."""
    return {"lengths": np.array([len(r["token_ids"]) for r in rows]),
            "logprobs": np.array([x for r in rows for x in r["token_logprobs"][1:]], np.float32),
            "ranks": np.array([x for r in rows for x in r["token_ranks"][1:]], np.int64),
            "top_ids": np.array([x for r in rows for x in r["top_ids"][1:]], np.int64),
            "top_logprobs": np.array([x for r in rows for x in r["top_logprobs"][1:]], np.float32)}


def worker(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(prog="bench_eval.py worker")
    ap.add_argument("--side", choices=["apcscore", "transformers"], required=True)
    ap.add_argument("--task", choices=["perplexity", "choices", "prompts"], required=True)
    ap.add_argument("--data", type=Path, required=True)
    ap.add_argument("--output", type=Path, required=True)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--no-batch-invariant", action="store_true", help="apcscore: library GEMMs (the tax contender)")
    ap.add_argument("--exact-reuse", action="store_true", help="apcscore: scoring reads the prefix cache (issue 13)")
    args = ap.parse_args(argv)
    import torch

    import_s = time.perf_counter() - T_START
    records = read_jsonl(args.data)
    t0 = time.perf_counter()
    side = load_side(args.side, args.model, args.device, args.dtype, batch_invariant=not args.no_batch_invariant,
                     exact_reuse=args.exact_reuse)
    load_s = time.perf_counter() - t0
    t0, cpu0 = time.perf_counter(), time.process_time()
    if args.side == "apcscore":
        # prompt_logprobs 0: per-token logprobs (and ranks) for the check; the CLI contender writes sums only
        from apcscore.options.commands import PerplexityOptions, ScoreOptions

        options = PerplexityOptions(window=args.window, prompt_logprobs=0) if args.task == "perplexity" else \
            ScoreOptions(prompt_logprobs=5 if args.task == "prompts" else 0)
        rows = run_job(side, args.task, options, records)
    elif args.task == "perplexity":
        rows = transformers_perplexity(side, records, args.window, args.batch_size, args.device)
    else:
        rows = transformers_choices(side, records, args.batch_size, args.device)
    if args.device.startswith("cuda"):
        torch.cuda.synchronize()
    compute_s, compute_cpu_s = time.perf_counter() - t0, time.process_time() - cpu0
    save(args.output, args.task, rows)
    report = {"side": args.side, "task": args.task, "import_s": round(import_s, 3), "load_s": round(load_s, 3),
              "compute_s": round(compute_s, 3), "threads": torch.get_num_threads(),
              # CPU seconds of the compute (all threads): less sensitive than wall time to a shared machine's load
              "compute_cpu_s": round(compute_cpu_s, 3),
              "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
              "output": str(args.output)}
    if args.side == "apcscore":
        s = side.stats
        pc = side.block_manager.stats
        report["engine"] = {"steps": s.steps, "prompt_tokens": s.prompt_tokens, "cache_hit_tokens": pc.hit_tokens,
                            "reusable_tokens": pc.reusable_tokens, "score_store_hits": pc.score_store_hits,
                            "num_kv_blocks": side.block_manager.num_blocks}
    print(REPORT_PREFIX + json.dumps(report), flush=True)


# ================================================================================================
# driver: inputs, scenarios, checks, table
# ================================================================================================
def perplexity_text(tokenizer: Any, tokens: int) -> tuple[str, int]:
    """The sample texts joined by blank lines, repeated, cut at the first line end past `tokens` tokens."""
    texts = [r["text"] for r in read_jsonl(ROOT / "datasets" / "sample_texts.jsonl")]
    lines: list[str] = []
    count, i = 0, 0
    while count < tokens:
        lines += (texts[i % len(texts)].rstrip("\n") + "\n\n").splitlines(keepends=True)
        count = len(tokenizer("".join(lines), add_special_tokens=False).input_ids)
        i += 1
    lo, hi = 1, len(lines)  # fewest lines with >= `tokens` tokens
    while lo < hi:
        mid = (lo + hi) // 2
        if len(tokenizer("".join(lines[:mid]), add_special_tokens=False).input_ids) >= tokens:
            hi = mid
        else:
            lo = mid + 1
    text = "".join(lines[:lo])
    return text, len(tokenizer(text, add_special_tokens=False).input_ids)


def choice_records(n: int) -> list[dict]:
    base = read_jsonl(ROOT / "datasets" / "sample_choices.jsonl")
    return [{**base[i % len(base)], "id": f"{base[i % len(base)]['id']}-{i // len(base)}"} for i in range(n)]


def fewshot_records(tokenizer: Any, n: int, prefix_tokens: int = 330) -> tuple[list[dict], int]:
    """A 5-shot multiple-choice set built like MMLU's: a description plus five worked examples, the same
    for every question, then the question; 4 choices each. The description is sample prose cut so that the
    shared prefix is about `prefix_tokens` tokens. Returns the records and the prefix's token count."""
    base = read_jsonl(ROOT / "datasets" / "sample_choices.jsonl")
    shots = "".join(f"{q['context']}{q['choices'][q['answer']]}\n\n" for q in base[:5])
    header = "The following are multiple choice questions (with answers) about general knowledge.\n\n"
    prose = read_jsonl(ROOT / "datasets" / "sample_texts.jsonl")[0]["text"]
    words = prose.split()
    budget = prefix_tokens - len(tokenizer(header + shots, add_special_tokens=False).input_ids)
    lo, hi = 0, len(words)  # most words of prose that keep the prefix within `prefix_tokens`
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if len(tokenizer(" ".join(words[:mid]) + "\n\n", add_special_tokens=False).input_ids) <= budget:
            lo = mid
        else:
            hi = mid - 1
    prefix = header + " ".join(words[:lo]) + "\n\n" + shots
    questions = base[5:]
    recs = [{**q, "id": f"{q['id']}-{i // len(questions)}", "context": prefix + q["context"]}
            for i, q in enumerate(questions[i % len(questions)] for i in range(n))]
    return recs, len(tokenizer(prefix, add_special_tokens=False).input_ids)


def _load(path: str) -> dict[str, np.ndarray]:
    if path.endswith(".parquet"):
        import pyarrow.parquet as pq

        t = pq.read_table(path).to_pydict()
        if "top_ids" in t and all(x is None for x in t.get("choice_logprobs") or []):  # score on prompts
            return prompt_arrays([dict(zip(t, vals)) for vals in zip(*t.values())])
        if "choice_logprobs" in t:
            return {"choice_logprobs": np.array([x for r in t["choice_logprobs"] for x in r]),
                    **{k: np.array(t[k]) for k in ("pred", "pred_norm", "correct", "correct_norm")}}
        return {"sum_logprob": np.array(t["sum_logprob"]), "num_tokens": np.array(t["num_tokens"])}
    with np.load(path) as z:
        return {k: z[k] for k in z.files}


def check_perplexity(outputs: dict[str, str]) -> dict[str, Any]:
    ref = _load(outputs["transformers"])
    n = int(ref["lengths"].sum())
    ref_sum = float(np.sum(ref["logprobs"], dtype=np.float64))
    out: dict[str, Any] = {"transformers: perplexity": round(math.exp(-ref_sum / n), 4)}
    for name, path in outputs.items():
        if name == "transformers":
            continue
        got = _load(path)
        if "logprobs" in got:
            out[f"{name}: max |dlogprob|"] = float(f"{np.abs(got['logprobs'] - ref['logprobs']).max():.2e}")
            s, count = float(np.sum(got["logprobs"], dtype=np.float64)), int(got["lengths"].sum())
        else:
            s, count = float(got["sum_logprob"].sum()), int(got["num_tokens"].sum())
        out[f"{name}: tokens equal"] = count == n
        out[f"{name}: |dsum| per 1,000 tokens"] = float(f"{abs(s - ref_sum) / n * 1000:.2e}")
        out[f"{name}: perplexity"] = round(math.exp(-s / count), 4)
    return out


def check_choices(outputs: dict[str, str]) -> dict[str, Any]:
    ref = _load(outputs["transformers"])
    out: dict[str, Any] = {"transformers: acc": f"{ref['correct'].mean():.4f}",
                           "transformers: acc_norm": f"{ref['correct_norm'].mean():.4f}"}
    for name, path in outputs.items():
        if name == "transformers":
            continue
        got = _load(path)
        out[f"{name}: max |dlogprob| per choice"] = float(
            f"{np.abs(got['choice_logprobs'] - ref['choice_logprobs']).max():.2e}")
        out[f"{name}: pred equal"] = f"{np.mean(got['pred'] == ref['pred']):.2%}"
        out[f"{name}: acc"] = f"{got['correct'].mean():.4f}"
        out[f"{name}: acc_norm"] = f"{got['correct_norm'].mean():.4f}"
    for reuse, recompute in ((EXACT_REUSE, "apcscore"), ("apcscore CLI --exact-reuse", "apcscore CLI")):
        if reuse in outputs and recompute in outputs:  # issue 13: not close, the same bits
            a, b = _load(outputs[reuse]), _load(outputs[recompute])
            out[f"{reuse}: bitwise equal to {recompute}"] = all(np.array_equal(a[k], b[k]) for k in b)
    return out


def check_prompts(outputs: dict[str, str]) -> dict[str, Any]:
    """Every contender against the recompute baseline: the same bits in every per-token column."""
    ref = _load(outputs["apcscore"])
    out: dict[str, Any] = {"scored positions": int(len(ref["logprobs"]))}
    for name, path in outputs.items():
        if name != "apcscore":
            got = _load(path)
            out[f"{name}: bitwise equal to apcscore (recompute)"] = all(
                got[k].shape == ref[k].shape and np.array_equal(got[k], ref[k]) for k in ref)
    return out


def sysprompt_records(tokenizer: Any, n: int, system_tokens: int) -> tuple[list[dict], int]:
    """`n` prompts behind one system prompt of about `system_tokens` tokens (sample prose), each then a
    distinct question (the sample questions, numbered). Returns the records and the system prompt's tokens."""
    prose = " ".join(r["text"] for r in read_jsonl(ROOT / "datasets" / "sample_texts.jsonl")).split()
    lo, hi = 0, len(prose)  # most words within `system_tokens` tokens
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if len(tokenizer("System: " + " ".join(prose[:mid]) + "\n\n", add_special_tokens=False).input_ids) \
                <= system_tokens:
            lo = mid
        else:
            hi = mid - 1
    system = "System: " + " ".join(prose[:lo]) + "\n\n"
    questions = read_jsonl(ROOT / "datasets" / "sample_choices.jsonl")
    recs = [{"id": f"p{i}", "prompt": f"{system}User {i}: {questions[i % len(questions)]['context']}"}
            for i in range(n)]
    return recs, len(tokenizer(system, add_special_tokens=False).input_ids)


def format_prefill(results: list[dict]) -> str:
    """Prefill token counts of the apcscore workers beside their times (issue 13)."""
    lines = []
    for res in results:
        for row in res["rows"]:
            eng = (row.get("report") or {}).get("engine")
            if eng:
                lines.append(f"- {res['scenario']} / {row['contender']}: {eng['prompt_tokens']:,} tokens prefilled, "
                             f"{eng.get('cache_hit_tokens', 0):,} served from the cache"
                             + (f" ({eng['reusable_tokens']:,} reusable with --exact-reuse)"
                                if eng.get("reusable_tokens") else "")
                             + (f", {eng['score_store_hits']:,} scored positions from the score store"
                                if eng.get("score_store_hits") else "")
                             + f"; {row['wall_s']:.2f} s whole process, {row['compute_s']:.2f} s compute")
    return "\n".join(lines)


def build_scenarios(args: argparse.Namespace, work: Path) -> list[Any]:
    from harness import Contender, Scenario

    from apcscore.jobs.loglikelihood import encode_pair, prefix_token_id
    from apcscore.models.loading import load_tokenizer
    from apcscore.models.locate import resolve_model

    tok = load_tokenizer(resolve_model(args.model)[0])
    py, me = sys.executable, str(Path(__file__).resolve())
    dev = ["--device", args.device, "--dtype", args.dtype]
    wanted = set(args.scenarios.split(","))
    unknown = wanted - {"perplexity", "choices", "fewshot", "sysprompt"}
    if unknown:
        raise SystemExit(f"unknown scenario(s) {', '.join(sorted(unknown))}; known: perplexity, choices, fewshot, "
                         f"sysprompt")
    scenarios = []

    def contenders(task: str, data: Path, extra: list[str], cli: list[str], name: str = "",
                   exact: bool = False) -> list[Any]:
        common = ["--task", task, "--data", str(data), "--model", args.model, *dev, *extra]
        task = name or task  # file names
        cli_out = work / f"{task}_cli.parquet"
        exact_out = work / f"{task}_cli_exact.parquet"
        # issue 13: scoring reads cached contexts, bitwise equal to recompute (first of ours: the target's row)
        reuse = [
            Contender(EXACT_REUSE, [py, me, "worker", "--side", "apcscore", *common, "--exact-reuse",
                                    "--output", str(work / f"{task}_apcscore_exact.npz")]),
            Contender("apcscore CLI --exact-reuse", [py, "-m", "apcscore", *cli, str(data), "--model", args.model,
                                                     "--out", str(exact_out), "--overwrite", "--quiet",
                                                     "--exact-reuse", *dev], output=str(exact_out)),
        ] if exact else []
        return [
            Contender("transformers", [py, me, "worker", "--side", "transformers", *common,
                                       "--output", str(work / f"{task}_transformers.npz")], baseline=True),
            *reuse,
            Contender("apcscore", [py, me, "worker", "--side", "apcscore", *common,
                                   "--output", str(work / f"{task}_apcscore.npz")]),
            # the invariance tax: the same worker with library GEMMs (issue 12 asks for <= 10%)
            Contender(NO_INVARIANCE, [py, me, "worker", "--side", "apcscore", *common, "--no-batch-invariant",
                                      "--output", str(work / f"{task}_apcscore_plain.npz")]),
            Contender("apcscore CLI", [py, "-m", "apcscore", *cli, str(data), "--model", args.model,
                                       "--out", str(cli_out), "--overwrite", "--quiet", *dev], output=str(cli_out)),
        ]

    if "perplexity" in wanted:
        text, n = perplexity_text(tok, args.tokens)
        data = work / "perplexity.jsonl"
        write_jsonl(data, [{"id": "text", "text": text}])
        windows = math.ceil(n / args.window)
        scenarios.append(Scenario(
            name="perplexity", work_tokens=n, work_unit="text tokens",
            description=f"one text of {n:,} tokens, window = stride = {args.window} ({windows} windows)",
            contenders=contenders("perplexity", data, ["--window", str(args.window), "--batch-size",
                                                       str(args.batch_size)],
                                  ["perplexity", "--window", str(args.window)]),
            check=check_perplexity,
            info={"tokens": n, "window": args.window, "windows": windows, "transformers_batch": args.batch_size},
        ))
    def choice_work(recs: list[dict]) -> tuple[int, int]:
        """Tokens fed (context + continuation of every choice, lm-eval's encoding) and the number of choices."""
        prefix = prefix_token_id(tok)
        fed = sum(len(a) + len(b) for r in recs for a, b in (encode_pair(tok, r["context"], c, prefix)
                                                               for c in r["choices"]))
        return fed, sum(len(r["choices"]) for r in recs)

    if "choices" in wanted:
        recs = choice_records(args.questions)
        data = work / "choices.jsonl"
        write_jsonl(data, recs)
        fed, nchoices = choice_work(recs)
        scenarios.append(Scenario(
            name="choices", work_tokens=fed, work_unit="prompt tokens",
            description=f"{len(recs)} questions, {nchoices} choices (one request each), {fed:,} tokens fed",
            contenders=contenders("choices", data, ["--batch-size", str(args.batch_size)], ["score"]),
            check=check_choices,
            info={"questions": len(recs), "requests": nchoices, "tokens": fed, "transformers_batch": args.batch_size},
        ))
    if "fewshot" in wanted:
        recs, prefix_len = fewshot_records(tok, args.questions)
        data = work / "fewshot.jsonl"
        write_jsonl(data, recs)
        fed, nchoices = choice_work(recs)
        scenarios.append(Scenario(
            name="fewshot", work_tokens=fed, work_unit="prompt tokens", target_ratio=0.1,  # issue 13: >= 10x
            description=(f"5-shot multiple choice: {len(recs)} questions behind one {prefix_len}-token prefix, "
                         f"{nchoices} choices (one request each; recompute, and --exact-reuse), {fed:,} tokens fed"),
            contenders=contenders("choices", data, ["--batch-size", str(args.batch_size)], ["score"], "fewshot",
                                  exact=True),
            check=check_choices,
            info={"questions": len(recs), "requests": nchoices, "tokens": fed, "prefix_tokens": prefix_len,
                  "transformers_batch": args.batch_size},
        ))
    if "sysprompt" in wanted:
        recs, system_len = sysprompt_records(tok, args.prompts, args.system_tokens)
        data = work / "sysprompt.jsonl"
        write_jsonl(data, recs)
        fed = sum(len(tok(r["prompt"], add_special_tokens=False).input_ids) for r in recs)
        common = ["--task", "prompts", "--data", str(data), "--model", args.model, *dev]
        cli = [py, "-m", "apcscore", "score", str(data), "--model", args.model, "--prompt-logprobs", "5",
               "--overwrite", "--quiet", *dev]
        scenarios.append(Scenario(
            name="sysprompt", work_tokens=fed, work_unit="prompt tokens", target_ratio=0.2,  # issue 13 (b): >= 5x
            description=(f"{len(recs)} prompts behind one {system_len}-token system prompt, --prompt-logprobs 5 at "
                         f"every position, {fed:,} tokens; baseline: apcscore recompute"),
            contenders=[
                Contender("apcscore", [py, me, "worker", "--side", "apcscore", *common,
                                       "--output", str(work / "sysprompt_apcscore.npz")], baseline=True),
                Contender(EXACT_REUSE, [py, me, "worker", "--side", "apcscore", *common, "--exact-reuse",
                                        "--output", str(work / "sysprompt_apcscore_exact.npz")]),
                Contender("apcscore CLI --exact-reuse", [*cli, "--exact-reuse", "--out",
                                                         str(work / "sysprompt_cli_exact.parquet")],
                          output=str(work / "sysprompt_cli_exact.parquet")),
                Contender("apcscore CLI", [*cli, "--out", str(work / "sysprompt_cli.parquet")],
                          output=str(work / "sysprompt_cli.parquet")),
            ],
            check=check_prompts,
            info={"prompts": len(recs), "system_tokens": system_len, "tokens": fed, "prompt_logprobs": 5},
        ))
    return scenarios


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description="apcscore perplexity / multiple choice vs plain transformers.")
    ap.add_argument("--quick", action="store_true", help="dry run: 1,000 tokens, 12 questions, 1 repeat")
    ap.add_argument("--scenarios", default="perplexity,choices,fewshot,sysprompt",
                    help="comma-separated: perplexity,choices,fewshot,sysprompt")
    ap.add_argument("--repeats", type=int, help="runs per contender, interleaved (default 3; --quick 1)")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tokens", type=int, help="tokens of the perplexity text (default 20,000; --quick 1,000)")
    ap.add_argument("--window", type=int, default=512, help="perplexity window (= stride)")
    ap.add_argument("--questions", type=int, help="multiple-choice questions (default 200; --quick 12)")
    ap.add_argument("--batch-size", type=int, default=8, help="transformers batch size")
    ap.add_argument("--prompts", type=int, help="sysprompt: prompts behind the system prompt (default 200; "
                                                "--quick 12)")
    ap.add_argument("--system-tokens", type=int, default=500, help="sysprompt: tokens of the shared system prompt")
    ap.add_argument("--device", default="cpu", help="cpu | cuda (both sides)")
    ap.add_argument("--dtype", default="float32", help="float32 | bfloat16 | float16 (both sides)")
    ap.add_argument("--only", help="comma-separated contender names to run besides the baseline (transformers), "
                                   "e.g. 'apcscore --exact-reuse,apcscore CLI --exact-reuse' (default: all)")
    ap.add_argument("--work-dir", type=Path, default=ROOT / "results" / "bench_eval_work")
    ap.add_argument("--out", type=Path, help="results JSON (default results/bench_eval.json; --quick: "
                                             "results/bench_eval.quick.json)")
    args = ap.parse_args(argv)
    q = args.quick
    args.repeats = args.repeats or (1 if q else 3)
    args.tokens = args.tokens or (1000 if q else 20000)
    args.questions = args.questions or (12 if q else 200)
    args.prompts = args.prompts or (12 if q else 200)
    args.out = args.out or ROOT / "results" / ("bench_eval.quick.json" if q else "bench_eval.json")
    return args


def main(argv: list[str]) -> None:
    if argv[:1] == ["worker"]:
        return worker(argv[1:])
    from harness import format_checks, format_table, format_taxes, machine_info, run_scenario, write_json

    args = parse_args(argv)
    started = time.perf_counter()
    machine = machine_info()
    scenarios = build_scenarios(args, args.work_dir)
    if args.only:
        keep = set(args.only.split(","))
        for sc in scenarios:
            sc.contenders = [c for c in sc.contenders if c.baseline or c.name in keep]
    results = []
    for sc in scenarios:
        print(f"{sc.name}: {sc.description}", flush=True)
        results.append(run_scenario(sc, args.repeats, log=lambda s: print(s, flush=True)))
    command = " ".join(["benchmarks/bench_eval.py", *argv])
    m = machine
    text = "\n".join([
        f"command: `{command}`",
        f"machine: {m['cpu']}, {m['cpu_count']} cores, load average at start {m['load_avg_at_start'][0]:.2f}; "
        f"torch {m['torch']} ({m['torch_threads']} threads), transformers {m['transformers']}; {m['date_utc']}",
        f"model: {args.model} ({args.dtype}, {args.device}); transformers batch {args.batch_size}; "
        f"{args.repeats} repeats per contender, interleaved; medians",
        "", *[f"- {r['scenario']}: {r['description']}" for r in results], "",
        format_table(results), "", "Same work on both sides:", format_checks(results), "",
        "Batch-invariance tax (apcscore over apcscore --no-batch-invariant, medians):", format_taxes(results),
        "", "Prefill work:", format_prefill(results),
    ])
    print("\n" + text)
    write_json(args.out, {"command": command, "quick": args.quick, "model": args.model, "device": args.device,
                          "dtype": args.dtype, "repeats": args.repeats, "machine": machine, "results": results,
                          "seconds": round(time.perf_counter() - started, 1)})
    print(f"\nresults: {args.out}")


if __name__ == "__main__":
    main(sys.argv[1:])
