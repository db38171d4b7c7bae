"""The cost of portable bits (issue 39): this tree against an earlier commit, whole `apcscore` processes, one run.

    .venv/bin/python benchmarks/bench_portable.py --base bc66859 [--repeats 3] [--quick]

The earlier commit is checked out into a git worktree (results/bench_portable/base) and run with PYTHONPATH
pointing at it, with this tree's virtualenv: the same interpreter, torch and model cache, only apcscore differs.
Scenarios (the default model, fp32, the CLI as users run it):
  score        96 records of 20..400 tokens (Python's reference topics), `score --prompt-logprobs 5`
  perplexity   one 6,000-token text, `perplexity --window 1024 --stride 512`
  generate     32 prompts behind a shared 320-token prefix, 32 tokens each, seeded sampling
  choices      an eval shape: 200 four-way multiple-choice questions (datasets/sample_choices.jsonl's 40,
               five times), `score` (lm-eval's loglikelihood)
Every contender runs as its own process, interleaved (benchmarks/harness.py); medians of whole-process wall time.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

from bench_cpu import corpus_token_stream, score_records, shared_prefix_records, write_jsonl  # noqa: E402
from harness import Contender, Scenario, format_table, machine_info, run_scenario, write_json  # noqa: E402

SEED = 1234


def base_tree(rev: str, work: Path) -> Path:
    """A worktree of `rev` under work/base (made once; moved to rev if it exists)."""
    path = work / "base"
    if not path.exists():
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(path), rev], check=True,
                       capture_output=True)
    else:
        subprocess.run(["git", "-C", str(path), "checkout", "--detach", rev], check=True, capture_output=True)
    return path


def inputs(work: Path, quick: bool) -> dict[str, tuple[Path, int]]:
    """The scenarios' datasets and their work in tokens."""
    from apcscore.models.loading import load_tokenizer
    from apcscore.models.locate import resolve_model

    tok = load_tokenizer(resolve_model("smollm2-135m")[0])
    stream, _ = corpus_token_stream(tok)
    score = score_records(stream, 8 if quick else 96, 20, 400, SEED)
    gen = shared_prefix_records(stream, 8 if quick else 32, 320, SEED)
    text = tok.decode(stream[:1000 if quick else 6000])
    choices = [json.loads(line) for line in (ROOT / "datasets" / "sample_choices.jsonl").open()]
    mc = [{**c, "id": f"{c['id']}-{i}"} for i in range(1 if quick else 5) for c in choices]
    out = {}
    for name, records in [("score", score), ("generate", gen), ("perplexity", [{"id": "t", "text": text}]),
                          ("choices", mc)]:
        write_jsonl(work / f"{name}.jsonl", records)
    out["score"] = (work / "score.jsonl", sum(len(r["prompt_token_ids"]) for r in score))
    out["generate"] = (work / "generate.jsonl", len(gen) * (8 if quick else 32))
    out["perplexity"] = (work / "perplexity.jsonl", 1000 if quick else 6000)
    out["choices"] = (work / "choices.jsonl", len(mc))
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="portable bits against an earlier commit, whole processes")
    ap.add_argument("--base", required=True, help="the earlier commit (e.g. the one before the change)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--work-dir", type=Path, default=ROOT / "results" / "bench_portable")
    ap.add_argument("--scenarios", default="score,perplexity,generate,choices")
    args = ap.parse_args(argv)
    work = args.work_dir
    work.mkdir(parents=True, exist_ok=True)
    base = base_tree(args.base, work)
    data = inputs(work, args.quick)
    commands = {
        "score": ["score", "{data}", "--prompt-logprobs", "5"],
        "perplexity": ["perplexity", "{data}", "--window", "1024", "--stride", "512"],
        "generate": ["generate", "{data}", "--max-tokens", "8" if args.quick else "32", "--temperature", "0.8",
                     "--seed", "1", "--top-p", "0.95"],
        "choices": ["score", "{data}"],
    }
    units = {"score": "scored tokens", "perplexity": "text tokens", "generate": "generated tokens",
             "choices": "questions"}
    results = []
    for name in args.scenarios.split(","):
        path, work_tokens = data[name]
        contenders = []
        for label, tree, baseline in (("before", base, True), ("portable", ROOT, False)):
            out = work / f"{name}-{label}.parquet"
            cmd = [a.format(data=path) for a in commands[name]] + ["--dtype", "float32", "--out", str(out),
                                                                  "--overwrite", "--quiet"]
            contenders.append(Contender(f"apcscore {label}", ["env", f"PYTHONPATH={tree}", sys.executable, "-m",
                                                              "apcscore", *cmd], baseline=baseline,
                                        output=str(out)))
        results.append(run_scenario(Scenario(name, " ".join(commands[name]), work_tokens, units[name], contenders,
                                             target_ratio=1.05), args.repeats))
    print(format_table(results))
    write_json(work / "results.json", {"machine": machine_info(), "base": args.base, "results": results})


if __name__ == "__main__":
    main()
