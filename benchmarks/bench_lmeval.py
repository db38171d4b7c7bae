"""lm-eval `hf` (batch size 8) against `apcscore eval`, whole process, on two local tasks.

Tasks (written to a temporary folder from the repository's sample datasets, no hub):
- `bench_mc`: 5-shot multiple choice built like lm-eval's MMLU tasks: a task `description` (a header plus
  sample prose, ~330 tokens with the shots) and the same 5 worked examples for every question
  (`fewshot_config: sampler: first_n`, from a dev split of the first 5 questions of
  datasets/sample_choices.jsonl), then `--questions` test questions (the other 35, repeated with a round
  number in "Question N:" so that every question is distinct) x 4 choices;
- `bench_ppl`: rolling perplexity (like wikitext) of the texts of datasets/sample_texts.jsonl, max_length 1024.

Each command runs as its own process (python start, imports, model load, evaluation), `--repeats` times,
alternating hf and apcscore; the script prints each wall time, the medians, the ratio apcscore / hf and the
load average. `--exact-reuse` adds apcscore runs with that option (needs the engine support of issue 13).

    python benchmarks/bench_lmeval.py [--model DIR] [--repeats 3] [--exact-reuse [--skip-recompute]]
                                      [--tasks bench_mc,bench_ppl] [--questions 100]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent

MC_YAML = """task: bench_mc
dataset_path: json
dataset_kwargs:
  data_files: {{train: {train}, test: {test}}}
output_type: multiple_choice
fewshot_split: train
fewshot_config:
  sampler: first_n
test_split: test
num_fewshot: 5
description: {description}
doc_to_text: "{{{{context.rstrip()}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list: [{{metric: acc}}, {{metric: acc_norm}}]
"""
PPL_YAML = """task: bench_ppl
dataset_path: json
dataset_kwargs:
  data_files: {{test: {test}}}
output_type: loglikelihood_rolling
test_split: test
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list: [{{metric: word_perplexity}}, {{metric: byte_perplexity}}, {{metric: bits_per_byte}}]
"""


def description(words: int = 150) -> str:
    """MMLU-style header plus the first `words` words of sample prose (~330 tokens together with the shots)."""
    prose = json.loads((REPO / "datasets/sample_texts.jsonl").read_text().splitlines()[0])["text"].split()
    header = "The following are multiple choice questions (with answers) about general knowledge."
    return f"{header}\n\n{' '.join(prose[:words])}\n\n"


def write_tasks(folder: Path, questions: int) -> None:
    rows = [json.loads(line) for line in (REPO / "datasets/sample_choices.jsonl").read_text().splitlines()]
    rest = rows[5:]
    test = []
    for i in range(questions):  # every question distinct (a repeat would be one cached context for both sides)
        row, rnd = rest[i % len(rest)], i // len(rest)
        context = row["context"].replace("Question:", f"Question {rnd + 1}:", 1) if rnd else row["context"]
        test.append({**row, "id": f"{row['id']}-{rnd}", "context": context})
    (folder / "mc_train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:5]))
    (folder / "mc_test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in test))
    # a JSON string is a valid YAML double-quoted scalar
    (folder / "bench_mc.yaml").write_text(MC_YAML.format(train=folder / "mc_train.jsonl", test=folder / "mc_test.jsonl",
                                                         description=json.dumps(description())))
    (folder / "bench_ppl.yaml").write_text(PPL_YAML.format(test=REPO / "datasets/sample_texts.jsonl"))


def timed(cmd: list[str], env: dict[str, str]) -> float:
    start = time.perf_counter()
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"failed: {' '.join(cmd)}\n{done.stderr[-3000:]}")
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="HF model directory (default: the converted smollm2-135m)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tasks", default="bench_mc,bench_ppl")
    parser.add_argument("--exact-reuse", action="store_true")
    parser.add_argument("--skip-recompute", action="store_true",
                        help="run apcscore only with --exact-reuse (large --questions: saves the slowest runs)")
    parser.add_argument("--questions", type=int, default=100, help="bench_mc test questions (4 choices each)")
    args = parser.parse_args()
    if args.model is None:
        sys.path.insert(0, str(REPO))
        from apcscore.models.locate import resolve_model

        args.model = str(resolve_model("smollm2-135m").path)
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        write_tasks(folder, args.questions)
        for task in args.tasks.split(","):
            max_len = ",max_length=1024" if task == "bench_ppl" else ""
            cmds = {
                "hf": [str(BIN / "python"), "-m", "lm_eval", "--model", "hf", "--model_args",
                       f"pretrained={args.model},dtype=float32{max_len}", "--batch_size", "8", "--device", "cpu",
                       "--tasks", task, "--include_path", str(folder)],
                "apcscore": [str(BIN / "python"), "-m", "apcscore", "eval", "--model", args.model, "--dtype",
                             "float32", "--device", "cpu", "--tasks", task, "--include-path", str(folder),
                             "--out", str(folder / "out"), "--overwrite", "--quiet"]
                            + (["--max-length", "1024"] if max_len else []),
            }
            if args.exact_reuse:
                cmds["apcscore --exact-reuse"] = cmds["apcscore"] + ["--exact-reuse"]
                if args.skip_recompute:
                    del cmds["apcscore"]
            times: dict[str, list[float]] = {name: [] for name in cmds}
            for _ in range(args.repeats):
                for name, cmd in cmds.items():
                    times[name].append(timed(cmd, env))
                    print(f"{task} {name}: {times[name][-1]:.1f} s (load {os.getloadavg()[0]:.2f})", flush=True)
            base = statistics.median(times["hf"])
            for name, values in times.items():
                med = statistics.median(values)
                print(f"{task} {name}: median {med:.1f} s, {med / base:.2f}x hf, runs {[round(v, 1) for v in values]}")


if __name__ == "__main__":
    main()
