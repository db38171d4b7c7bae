"""`score --reference-model` against scoring the candidate alone: time and peak memory (issue 55's goals: at most
2.2x the time; peak at most both models' weights + the KV pools + O(chunk x vocab)).

    .venv/bin/python benchmarks/bench_reference.py                       # sample prompts, 3 interleaved repeats
    .venv/bin/python benchmarks/bench_reference.py --data texts      # the sample texts in 12-line prompts
    .venv/bin/python benchmarks/bench_reference.py --data FILE.jsonl --repeats 5 --prompt-logprobs 5

The candidate is the default model's weights quantized to int8 per channel (scripts/compare_evidence.py's int8
candidate), the reference the default model. Both commands run as whole processes through the real CLI, alternated
(alone, paired, alone, ...), each on one dataset, with `--threads` torch threads (default 1); the script reports
the medians of the in-run time (the metadata's timings.run_seconds: the engine's steps, weights loaded), of the
whole process' wall time and CPU time (user + system: on a machine shared with other work, the figure contention
moves least), their ratios, and each process' peak RSS (the kernel's accounting of the finished child).
JSON: results/bench_reference.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from golden_digests import int8_copy  # noqa: E402  (the default model quantized to int8 per channel)


def texts_dataset(work: Path) -> Path:
    """datasets/sample_texts.jsonl cut into prompts of 12 lines (compare_evidence's prose records): ~5k tokens."""
    out = work / "texts.jsonl"
    records = []
    for text in (json.loads(line) for line in (ROOT / "datasets" / "sample_texts.jsonl").read_text().splitlines()):
        lines = [line for line in text["text"].splitlines() if line.strip()]
        records += [{"id": f"{text['id']}_{i // 12:02d}", "prompt": "\n".join(lines[i:i + 12])}
                    for i in range(0, len(lines), 12)]
    out.write_text("".join(json.dumps(r) + "\n" for r in records))
    return out


def run(args: list[str], out: Path, threads: int) -> dict:
    """One whole `apcscore score` process: its wall seconds, peak RSS (MiB) and the metadata's run seconds."""
    import pyarrow.parquet as pq

    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "apcscore", "score", *args, "--out", str(out), "--overwrite",
                             "--quiet"], env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": str(threads)})
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    if status != 0:
        raise SystemExit(f"apcscore score {' '.join(args)} failed (status {status})")
    meta = json.loads(pq.read_schema(out).metadata[b"apcscore"])
    return {"wall_s": wall, "run_s": meta["timings"]["run_seconds"], "load_s": meta["timings"]["load_seconds"],
            "cpu_s": usage.ru_utime + usage.ru_stime, "peak_rss_mib": usage.ru_maxrss / 1024}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", default=str(ROOT / "datasets" / "sample_prompts.jsonl"),
                    help="a JSONL file, or `texts` (the sample texts in 12-line prompts)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prompt-logprobs", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--work", type=Path, help="keep the candidate and the result files here")
    args = ap.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="apcscore-bench-reference-"))
    work.mkdir(parents=True, exist_ok=True)
    cand = int8_copy(work)
    data = texts_dataset(work) if args.data == "texts" else Path(args.data)
    common = [str(data), "--model", str(cand), "--prompt-logprobs", str(args.prompt_logprobs)]
    modes = {"alone": common, "paired": [*common, "--reference-model", "smollm2-135m"]}
    results: dict[str, list[dict]] = {m: [] for m in modes}
    run(modes["alone"], work / "warmup.parquet", args.threads)  # (page cache, the converted default model)
    for i in range(args.repeats):
        for mode, margs in modes.items():
            results[mode].append(run(margs, work / f"{mode}.parquet", args.threads))
            print(f"{mode} {i}: {results[mode][-1]}", file=sys.stderr)
    med = {m: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for m, rs in results.items()}
    summary = {"machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
               "data": str(data), "repeats": args.repeats, "median": med,
               "run_ratio": med["paired"]["run_s"] / med["alone"]["run_s"],
               "wall_ratio": med["paired"]["wall_s"] / med["alone"]["wall_s"],
               "cpu_ratio": med["paired"]["cpu_s"] / med["alone"]["cpu_s"], "threads": args.threads, "runs": results}
    out = ROOT / "results" / "bench_reference.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(summary, indent=2) + "\n")
    print("| mode | run s (median) | wall s | CPU s | load s | peak RSS MiB |\n| --- | --- | --- | --- | --- | --- |")
    for m, v in med.items():
        print(f"| {m} | {v['run_s']:.2f} | {v['wall_s']:.2f} | {v['cpu_s']:.2f} | {v['load_s']:.2f} | "
              f"{v['peak_rss_mib']:.0f} |")
    print(f"\nratio paired / alone: run {summary['run_ratio']:.2f}x, whole process {summary['wall_ratio']:.2f}x wall, "
          f"{summary['cpu_ratio']:.2f}x CPU")


if __name__ == "__main__":
    main()
