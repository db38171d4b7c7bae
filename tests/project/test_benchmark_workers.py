"""The benchmark's contenders run and agree on a tiny model (a smoke test: `make bench` must not rot).

Timings are not checked here; `make bench` measures them. This only runs each worker process once.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

WORKERS = Path(__file__).resolve().parents[2] / "benchmarks" / "workers.py"


def run_worker(model: Path, data: Path, out: Path, side: str, task: str) -> dict:
    cmd = [sys.executable, str(WORKERS), "--side", side, "--task", task, "--data", str(data), "--model", str(model),
           "--output", str(out), "--k", "3", "--batch-size", "2", "--max-new-tokens", "4"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1].removeprefix("BENCH_REPORT "))
    assert report["compute_s"] > 0 and report["peak_rss_mb"] > 0
    return report


@pytest.mark.slow
@pytest.mark.parametrize("task", ["score", "generate"])
def test_both_contenders_run_and_do_the_same_work(task, tiny_model_dir, tmp_path, write_jsonl):
    model = tiny_model_dir("llama")
    prefix = list(range(100, 140))
    data = write_jsonl(tmp_path / "data.jsonl", [{"id": f"r{i}", "prompt_token_ids": prefix + list(range(7 + i))}
                                                 for i in range(3)])
    reports = {side: run_worker(model, data, tmp_path / f"{side}.npz", side, task)
               for side in ("apcscore", "transformers")}
    ours, theirs = (np.load(tmp_path / f"{side}.npz") for side in ("apcscore", "transformers"))
    if task == "score":
        np.testing.assert_allclose(ours["logprobs"], theirs["logprobs"], atol=1e-4)
        assert reports["apcscore"]["engine"]["prompt_tokens"] == 3 * 40 + 7 + 8 + 9
    else:
        assert np.array_equal(ours["tokens"], theirs["tokens"])
        assert reports["apcscore"]["engine"]["cached_tokens"] > 0  # the shared prefix was hit
