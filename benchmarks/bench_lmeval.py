"""lm-eval `hf` (batch size 8) against `apcscore eval`, whole processes, on lm-eval's own task shapes.

Scenarios (`--tasks`, comma-separated; default: the six real shapes):
- real lm-eval tasks, their YAML files and utils.py copied from lm-eval 0.4.13 into benchmarks/lmeval_tasks/
  with only the dataset location changed (each file's header says what), over documents in each dataset's
  schema that benchmarks/lmeval_data.py writes from datasets/ (seeded, distinct, realistic lengths),
  `--docs` per task:
  `hellaswag` (0-shot, 4 long endings), `arc_easy` (3-shot, multi-token choices), `winogrande` (0-shot,
  partial scoring: two contexts, one continuation), `lambada_openai` (0-shot, the last word), `gsm8k`
  (5-shot generate_until, `--gen-kwargs max_gen_toks=--max-gen-toks` on both sides, default 96, to keep runs
  affordable) and `mmlu` (lm-eval's mmlu group: `_default_template_yaml`, 20 subject YAMLs, 5 per category,
  the category groups and the `mmlu` group; `--num_fewshot 5`, each subject its own 5-shot prefix from its dev
  split, 4 choices A-D; `--docs` in all, spread over the subjects);
- the two synthetic tasks of the earlier benchmark: `bench_mc` (5-shot multiple choice built like MMLU, the
  same shots for all `--questions`) and `bench_ppl` (rolling perplexity of datasets/sample_texts.jsonl, max
  length 1024).

Contenders, each its own process (python start, imports, model load, evaluation), interleaved, `--repeats`
times: `python -m lm_eval --model hf --batch_size 8 --device cpu` (fp32), `apcscore eval` (recompute) and
`apcscore eval --exact-reuse`. The script prints each wall time with the load average, then per task the
medians and the ratios to hf.

Every run writes its per-sample records (hf `--log_samples --output_path`, apcscore `--log-samples --out`)
and each apcscore run is checked against the first hf run, per task: the metrics of results (relative or
absolute difference <= 1e-4), and per document (and filter) the prompts (`arguments`), targets, responses,
filtered responses and per-sample metrics; loglikelihoods within 1e-4 absolute (fp32, different kernels),
is_greedy, accuracies and generated text exactly equal. PASS/FAIL per task; the exit status is 1 on any FAIL.

    python benchmarks/bench_lmeval.py [--model DIR] [--repeats 3] [--docs 100] [--tasks hellaswag,...]
                                      [--skip-recompute] [--quick] [--json FILE]
"""


from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
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


TASKS_DIR = REPO / "benchmarks/lmeval_tasks"
REAL = ["lambada_openai", "winogrande", "hellaswag", "arc_easy", "mmlu", "gsm8k"]  # cheapest first
SYNTHETIC = ["bench_mc", "bench_ppl"]
FEWSHOT = {"arc_easy": 3, "mmlu": 5}  # lm-eval's YAML sets none for these (gsm8k's sets 5)
TOL = 1e-4  # --tol
WORST: list[tuple[float, float]] = []  # (absolute, relative) difference of every per-sample number compared


def write_real_tasks(folder: Path, docs: int) -> Path:
    """Data under folder/data, the task copies (with @DATA@ replaced) under folder/tasks; returns the latter."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    from lmeval_data import write_all

    write_all(folder / "data", docs)
    tasks = folder / "tasks"
    for src in TASKS_DIR.rglob("*"):
        if src.is_file() and "__pycache__" not in src.parts:
            dst = tasks / src.relative_to(TASKS_DIR)
            dst.parent.mkdir(parents=True, exist_ok=True)
            text = src.read_text()
            dst.write_text(text.replace("@DATA@", str(folder / "data")) if src.suffix != ".py" else text)
    return tasks


def commands(task: str, model: str, include: Path, out: Path, max_gen_toks: int) -> dict[str, list[str]]:
    py = str(BIN / "python")
    hf_args = f"pretrained={model},dtype=float32" + (",max_length=1024" if task == "bench_ppl" else "")
    hf = [py, "-m", "lm_eval", "--model", "hf", "--model_args", hf_args, "--batch_size", "8", "--device", "cpu",
          "--tasks", task, "--include_path", str(include), "--log_samples"]
    ap = [py, "-m", "apcscore", "eval", "--model", model, "--dtype", "float32", "--device", "cpu", "--tasks", task,
          "--include-path", str(include), "--log-samples", "--overwrite", "--quiet"]
    if task == "bench_ppl":
        ap += ["--max-length", "1024"]
    if task in FEWSHOT:
        hf += ["--num_fewshot", str(FEWSHOT[task])]
        ap += ["--num-fewshot", str(FEWSHOT[task])]
    if task == "gsm8k":
        hf += ["--gen_kwargs", f"max_gen_toks={max_gen_toks}"]
        ap += ["--gen-kwargs", f"max_gen_toks={max_gen_toks}"]
    # the output folder last: main() gives each run its own
    return {"hf": hf + ["--output_path", str(out / "hf")], "apcscore": ap + ["--out", str(out / "apcscore")],
            "apcscore --exact-reuse": ap + ["--exact-reuse", "--out", str(out / "exact")]}


def timed(cmd: list[str], env: dict[str, str]) -> float:
    start = time.perf_counter()
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise RunFailed(f"failed: {' '.join(cmd)}\n{done.stderr[-3000:]}")
    return seconds


class RunFailed(Exception):
    pass


def engine_work(folder: Path) -> dict:
    """An apcscore run's engine counters (results.json's apcscore.timing): prompt tokens computed, prompt tokens
    asked for (queried: what hf computes too, its padding aside), served by the prefix cache, generated."""
    timing = json.loads((folder / "results.json").read_text())["apcscore"]["timing"]
    pc = timing.get("prefix_cache", {})
    return {"computed": timing.get("prompt_tokens"), "queried": pc.get("queried_tokens"),
            "hit": pc.get("hit_tokens"), "generated": timing.get("generated_tokens"),
            "load_s": timing.get("load_seconds"), "run_s": timing.get("run_seconds")}


# ---- the equality check ----

def load_run(folder: Path) -> tuple[dict, dict[str, list[dict]]]:
    """(results, {task: sample records}) of an hf --output_path folder or an apcscore --out folder."""
    results_files = sorted(folder.rglob("results*.json"))
    if len(results_files) != 1:
        raise SystemExit(f"{folder}: expected one results file, found {results_files}")
    samples = {}
    for path in folder.rglob("samples_*.jsonl"):
        m = re.fullmatch(r"samples_(.+?)(_\d{4}-\d{2}-\d{2}T[\d.\-]+)?\.jsonl", path.name)
        samples[m.group(1)] = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return json.loads(results_files[0].read_text()), samples


def _number(x) -> float | None:
    try:
        return float(x)
    except (TypeError, ValueError):
        return None


def differences(a, b, where: str, rel: bool = False, strict: bool = False) -> list[str]:
    """Where `a` and `b` differ: numbers beyond TOL (absolute; with `rel`, relative or absolute), the rest exactly.
    lm-eval's samples files hold loglikelihoods as strings ("-2.27..."): unless `strict` (generations), two
    strings that are both numbers compare as numbers."""
    if isinstance(a, str) and isinstance(b, str) and a != b and not strict:
        x, y = _number(a), _number(b)
        if x is not None and y is not None:
            return differences(x, y, where, rel)
    if isinstance(a, bool) or isinstance(b, bool) or isinstance(a, str) or isinstance(b, str) or a is None or b is None:
        return [] if a == b else [f"{where}: {a!r} != {b!r}"]
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        if isinstance(a, int) and isinstance(b, int):
            return [] if a == b else [f"{where}: {a} != {b}"]
        if not rel:  # the per-sample numbers (loglikelihoods), not the results' aggregates
            WORST.append((abs(a - b), abs(a - b) / max(abs(a), abs(b), 1e-30)))
        ok = math.isclose(a, b, rel_tol=TOL, abs_tol=TOL) if rel else abs(a - b) <= TOL
        return [] if ok or (math.isnan(a) and math.isnan(b)) else [f"{where}: {a!r} != {b!r}"]
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return [f"{where}: {len(a)} != {len(b)} items"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in differences(x, y, f"{where}[{i}]", rel, strict)]
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            return [f"{where}: keys {sorted(set(a) ^ set(b))} on one side only"]
        return [d for k in a for d in differences(a[k], b[k], f"{where}.{k}", rel, strict)]
    return [] if a == b else [f"{where}: {a!r} != {b!r}"]


SAMPLE_FIELDS = ["arguments", "target", "resps", "filtered_resps", "doc_hash", "prompt_hash", "target_hash"]


def compare(hf_dir: Path, ap_dir: Path) -> tuple[dict[str, int], list[str]]:
    """({task: documents compared}, differences) of an apcscore run against an hf run (WORST gets the sizes)."""
    (hf_res, hf_samples), (ap_res, ap_samples) = load_run(hf_dir), load_run(ap_dir)
    diffs, counts = [], {}
    for name in sorted(set(hf_res["results"]) | set(ap_res["results"])):
        a, b = hf_res["results"].get(name), ap_res["results"].get(name)
        if a is None or b is None:
            diffs.append(f"results: {name} on one side only")
            continue
        diffs += differences(a, b, f"results.{name}", rel=True)
    if set(hf_samples) != set(ap_samples):
        diffs.append(f"samples files: {sorted(set(hf_samples) ^ set(ap_samples))} on one side only")
    for task in sorted(set(hf_samples) & set(ap_samples)):
        keyed = [{(r["doc_id"], r.get("filter")): r for r in recs} for recs in (hf_samples[task], ap_samples[task])]
        if set(keyed[0]) != set(keyed[1]) or len(keyed[0]) != len(hf_samples[task]):
            diffs.append(f"{task}: documents/filters differ")
            continue
        counts[task] = len({doc for doc, _ in keyed[0]})
        strict = hf_res.get("configs", {}).get(task, {}).get("output_type") == "generate_until"
        for key, r in keyed[0].items():
            s = keyed[1][key]
            for field in SAMPLE_FIELDS + sorted(set(r.get("metrics", [])) | set(s.get("metrics", []))):
                if field in r or field in s:
                    diffs += differences(r.get(field), s.get(field), f"{task} doc {key[0]} {key[1]} {field}",
                                         strict=strict)
    return counts, diffs


# ---- the benchmark ----

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="HF model directory (default: the converted smollm2-135m)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tasks", default=",".join(REAL), help=f"of {','.join(REAL + SYNTHETIC)}")
    parser.add_argument("--docs", type=int, default=100, help="documents per real task (mmlu: in all)")
    parser.add_argument("--max-gen-toks", type=int, default=96, help="gsm8k's generation length, both sides")
    parser.add_argument("--exact-reuse", action="store_true", help="(kept for old command lines: always run now)")
    parser.add_argument("--skip-recompute", action="store_true",
                        help="run apcscore only with --exact-reuse (large workloads: saves the slowest runs)")
    parser.add_argument("--questions", type=int, default=100, help="bench_mc test questions (4 choices each)")
    parser.add_argument("--quick", action="store_true", help="--docs 8 --questions 8 --repeats 1 --max-gen-toks 32")
    parser.add_argument("--tol", type=float, default=1e-4,
                        help="largest absolute difference of a loglikelihood (and relative, of a result metric)")
    parser.add_argument("--json", default=None, help="also write the runs and checks to this JSON file")
    args = parser.parse_args()
    if args.quick:
        args.docs, args.questions, args.repeats, args.max_gen_toks = 8, 8, 1, 32
    global TOL
    TOL = args.tol
    tasks = args.tasks.split(",")
    unknown = set(tasks) - set(REAL + SYNTHETIC)
    if unknown:
        parser.error(f"unknown tasks {sorted(unknown)}")
    if args.model is None:
        sys.path.insert(0, str(REPO))
        from apcscore.models.locate import resolve_model

        args.model = str(resolve_model("smollm2-135m")[0])
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    report, failed = [], False
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        write_tasks(folder, args.questions)  # the synthetic tasks, in folder itself
        real_tasks = write_real_tasks(folder / "real", args.docs)
        for task in tasks:
            include = real_tasks if task in REAL else folder
            out = folder / "out" / task
            cmds = commands(task, args.model, include, out, args.max_gen_toks)
            if args.skip_recompute:
                del cmds["apcscore"]
            times: dict[str, list[float]] = {name: [] for name in cmds}
            checks: dict[str, list[str]] = {}
            WORST.clear()
            counts: dict[str, int] = {}
            work: dict[str, list[dict]] = {}  # per apcscore contender, per run: engine_work()
            loads = []
            for rep in range(args.repeats):
                for name, cmd in cmds.items():
                    cmd = list(cmd)
                    cmd[-1] = f"{cmd[-1]}-{rep}"  # the output folder of this run
                    try:
                        times[name].append(timed(cmd, env))
                    except RunFailed as exc:  # reported as a FAIL of the task; the other tasks still run
                        print(exc, flush=True)
                        checks.setdefault(name, []).append(str(exc).splitlines()[0])
                        times[name].append(math.nan)
                        continue
                    loads.append(os.getloadavg()[0])
                    print(f"{task} {name}: {times[name][-1]:.1f} s (load {loads[-1]:.2f})", flush=True)
                    if name != "hf":
                        try:
                            n, diffs = compare(out / "hf-0", Path(cmd[-1]))
                        except (Exception, SystemExit) as exc:  # a run's files unreadable: a FAIL, not a crash
                            n, diffs = {}, [f"comparison failed: {exc!r}"]
                        counts.update(n)
                        checks.setdefault(name, []).extend(diffs)
                        try:
                            work.setdefault(name, []).append(engine_work(Path(cmd[-1])))
                            print(f"{task} {name} run {rep}: engine {work[name][-1]}", flush=True)
                        except (OSError, KeyError, ValueError) as exc:
                            print(f"{task} {name} run {rep}: no engine counters ({exc!r})", flush=True)
                        print(f"{task} {name} run {rep}: {'PASS' if not diffs else 'FAIL'} against hf "
                              f"({len(diffs)} differences)", flush=True)  # now: a stopped run keeps its verdicts
                    if rep or name != "hf":  # keep the first hf run: the reference of the checks
                        shutil.rmtree(cmd[-1], ignore_errors=True)
            base = statistics.median(times["hf"])
            worst_abs = max(WORST, default=(0.0, 0.0))
            worst_rel = max(WORST, default=(0.0, 0.0), key=lambda w: w[1])
            row = {"task": task, "docs": counts, "seconds": times, "load": loads, "checks": checks,
                   "worst_abs": worst_abs, "worst_rel": worst_rel, "work": work}
            for name, values in times.items():
                med = statistics.median(values)
                print(f"{task} {name}: median {med:.1f} s, {med / base:.2f}x hf, runs {[round(v, 1) for v in values]}")
            for name, diffs in checks.items():
                verdict = "PASS" if not diffs else "FAIL"
                failed |= bool(diffs)
                print(f"{task} equality {name} vs hf: {verdict} ({sum(counts.values())} documents in "
                      f"{len(counts)} task(s), {len(diffs)} differences; largest numeric difference "
                      f"{worst_abs[0]:.2g} absolute ({worst_abs[1]:.2g} relative), largest relative "
                      f"{worst_rel[1]:.2g})" + "".join(f"\n    {d}" for d in diffs[:10]))
            report.append(row)
            if args.json:  # after every task: a long run that stops keeps what it measured
                Path(args.json).write_text(json.dumps(report, indent=1))
    print("\n| task | docs | hf s | apcscore | --exact-reuse | prompt tokens computed / asked (exact) | equal | "
          "largest abs (rel) difference | load |\n| --- | ---: | ---: | ---: | ---: | ---: | --- | --- | --- |")
    for row in report:
        base = statistics.median(row["seconds"]["hf"])
        cell = {n: f"{statistics.median(v):.1f} s ({statistics.median(v) / base:.2f}x)"
                for n, v in row["seconds"].items()}
        equal = "PASS" if not any(row["checks"].values()) else "FAIL"
        w = (row["work"].get("apcscore --exact-reuse") or [{}])[-1]
        tokens = f"{w['computed']:,} / {w['queried']:,}" if w.get("queried") else "-"
        print(f"| {row['task']} | {sum(row['docs'].values())} | {base:.1f} | {cell.get('apcscore', '-')} | "
              f"{cell['apcscore --exact-reuse']} | {tokens} | {equal} | "
              f"{row['worst_abs'][0]:.2g} ({row['worst_abs'][1]:.2g}) | "
              f"{min(row['load']):.1f}-{max(row['load']):.1f} |")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
