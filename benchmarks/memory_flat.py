"""Host memory over a long scoring run: is it flat, or does it grow with the dataset?

Runs `apcscore score` in a subprocess on N short records (a tiny random-weight Llama by default, so the
run is about the pipeline: records, engine, results writer) and samples the process's RSS every 0.2 s.
Prints RSS at 25/50/75/100% of the run's scoring phase and the growth between 25% and 100%.

    python benchmarks/memory_flat.py --records 100000            # the figure in docs/benchmarks.md
    python benchmarks/memory_flat.py --records 100000 --model smollm2-135m
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pyarrow.parquet as pq

WORDS = "the of and to in is was for on that with as by at from his an were are which this be".split()


def rss_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except FileNotFoundError:
        return None
    return None


def make_tiny_model(path: Path) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from apcscore.models.loading import load_tokenizer

    from apcscore.models.locate import resolve_model

    tokenizer = load_tokenizer(resolve_model("smollm2-135m")[0])
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    LlamaForCausalLM(cfg).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def measure(records: int, model: str | None, workdir: Path, interval: float = 0.2) -> dict:
    data = workdir / "long.jsonl"
    with data.open("w") as f:
        for i in range(records):
            text = " ".join(WORDS[(i * 7 + j) % len(WORDS)] for j in range(5 + i % 11))
            f.write(json.dumps({"id": i, "prompt": text}) + "\n")
    model = model or str(make_tiny_model(workdir / "tiny-llama"))
    out = workdir / "long.parquet"
    cmd = [sys.executable, "-m", "apcscore", "score", str(data), "--model", model, "--prompt-logprobs", "5",
           "--out", str(out), "--quiet", "--overwrite", "--num-kv-blocks", "512"]
    started = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    samples: list[tuple[float, float, int]] = []  # (seconds, rss MB, rows in part files)
    partial = out.with_name(out.name + ".partial")
    part_rows: dict[Path, int] = {}
    while proc.poll() is None:
        rss = rss_mb(proc.pid)
        if rss is not None:
            rows = -1
            if partial.is_dir():
                for part in partial.glob("part-*.parquet"):
                    if part not in part_rows:
                        try:
                            part_rows[part] = pq.read_metadata(part).num_rows
                        except OSError:  # renamed away by the final assembly
                            part_rows[part] = 0
                rows = sum(part_rows.values())
            samples.append((time.perf_counter() - started, rss, rows))
        time.sleep(interval)
    output = proc.stdout.read()
    if proc.returncode != 0:
        raise RuntimeError(f"apcscore failed ({proc.returncode}):\n{output}")
    # the scoring phase: from 256 rows on disk (past the warm-up; the writer now writes a part every second,
    # so "the first part file" would fall inside the warm-up) to the last sample before the final assembly
    running = [s for s in samples if s[2] >= min(256, records // 4)]
    if len(running) < 4:
        running = samples[len(samples) // 4:]

    def at(q: float) -> float:
        return running[min(len(running) - 1, int(q * (len(running) - 1)))][1]

    return {
        "records": records, "model": model if not model.endswith("tiny-llama") else "tiny random Llama",
        "seconds": round(time.perf_counter() - started, 1),
        "rss_mb": {"25%": round(at(0.25), 1), "50%": round(at(0.5), 1), "75%": round(at(0.75), 1),
                   "100%": round(at(1.0), 1)},
        "peak_rss_mb": round(max(s[1] for s in samples), 1),
        "growth_25_to_100_mb": round(at(1.0) - at(0.25), 1),
        # retained memory: the RSS floor of each quarter of the scoring phase (transient logprob chunks only
        # add spikes on top; a leak raises the floor; the first quarter includes the warm-up)
        "floor_by_quarter_mb": [round(min(r[1] for r in running[q * len(running) // 4:(q + 1) * len(running) // 4]), 1)
                                for q in range(4)],
        "rows_written": pq.read_metadata(out).num_rows,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=100_000)
    parser.add_argument("--model", default=None, help="default: a tiny random-weight Llama")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        print(json.dumps(measure(args.records, args.model, Path(tmp))))


if __name__ == "__main__":
    main()
