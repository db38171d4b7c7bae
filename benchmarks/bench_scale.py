"""1 process against 1 and 2 Ray replicas on this machine (issue 17, docs/scale-out.md).

A generate workload of shared-prefix groups (G groups x M prompts: a ~P-word shared preamble, a short
question each), greedy, T new tokens, on the default model. Runs, each a fresh `apcscore` process:
one process; `--ray local --replicas 1`; `--ray local --replicas 2` (prefix-aware); the same with
`--partition random`. Prints wall time (the whole command: Ray start, model loads, run), the run's own seconds,
tokens/s and the prefix-cache hit rate from the metadata, and checks that every file's completions equal the
single process's.

    python benchmarks/bench_scale.py [--groups 8 --per-group 8 --tokens 32 --model smollm2-135m]
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pyarrow.parquet as pq

WORDS = ("the of and to in is was for on that with as by at from his her an are were which this be or had "
         "model cache token block prefix batch engine score record replica shard cluster").split()


def dataset(path: Path, groups: int, per_group: int, words: int) -> Path:
    rng = random.Random(0)
    rows = []
    for g in range(groups):
        preamble = f"System {g}: " + " ".join(rng.choice(WORDS) for _ in range(words))
        rows += [{"id": f"g{g}-{k}", "prompt": f"{preamble}\nQuestion {k}: what is {rng.randrange(100)} plus "
                                                f"{rng.randrange(100)}?\nAnswer:"} for k in range(per_group)]
    rng.shuffle(rows)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--per-group", type=int, default=8)
    ap.add_argument("--words", type=int, default=150)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--model", default="smollm2-135m")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-scale-"))
    data = dataset(tmp / "d.jsonl", args.groups, args.per_group, args.words)
    base = [sys.executable, "-m", "apcscore", "generate", str(data), "--model", args.model, "--max-tokens",
            str(args.tokens), "--num-kv-blocks", "2048", "-q"]
    runs = {"1 process": [],
            "ray, 1 replica (2 CPUs)": ["--ray", "local", "--replicas", "1", "--cpus-per-replica", "2"],
            "ray, 2 replicas (1 CPU each), prefix-aware": ["--ray", "local", "--replicas", "2"],
            "ray, 2 replicas (1 CPU each), random": ["--ray", "local", "--replicas", "2", "--partition", "random"]}
    print(f"{args.groups} groups x {args.per_group} prompts, ~{args.words}-word shared preamble, {args.tokens} "
          f"generated tokens, model {args.model}")
    print("| run | wall s (whole command) | run s | tok/s | prefix-cache hit rate | completions = 1 process |")
    print("|---|---|---|---|---|---|")
    ref = None
    for name, extra in runs.items():
        out = tmp / f"{len(extra)}-{'random' if 'random' in extra else 'p'}.parquet"
        start = time.perf_counter()
        proc = subprocess.run([*base, *extra, "--out", str(out)], capture_output=True, text=True)
        wall = time.perf_counter() - start
        if proc.returncode != 0:
            print(f"| {name} | failed: {proc.stderr.strip().splitlines()[-1:]} |")
            continue
        meta = json.loads(pq.read_schema(out).metadata[b"apcscore"])
        t = meta["timings"]
        table = pq.read_table(out, columns=["id", "completion_token_ids"])
        ref = table if ref is None else ref
        print(f"| {name} | {wall:.1f} | {t['run_seconds']:.1f} | {t['tokens_per_second']:.0f} | "
              f"{t['prefix_cache']['hit_rate']:.3f} | {table.equals(ref)} |")


if __name__ == "__main__":
    main()
