"""A run interrupted by SIGINT keeps what it finished, exits 130, and --resume completes it exactly."""

from __future__ import annotations

import pytest

import json
import os
import signal
import subprocess
import sys
import time

import pyarrow.parquet as pq


def apcscore(*args, **kw) -> subprocess.Popen:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.Popen([sys.executable, "-m", "apcscore", *map(str, args)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env, **kw)


@pytest.mark.slow
def test_sigint_then_resume_equals_an_uninterrupted_run(tmp_path, write_jsonl, tiny_model_dir):
    model = tiny_model_dir("llama")
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()
    records = [{"id": f"r{i}", "prompt": " ".join(words[j % 12] for j in range(i % 37 + 3))} for i in range(600)]
    data = write_jsonl(tmp_path / "d.jsonl", records)
    common = ["score", data, "--model", model, "--prompt-logprobs", 2, "--quiet"]
    slow = ["--max-num-seqs", 1, "--max-batch-tokens", 16]  # so that the interrupt lands mid-run

    out = tmp_path / "interrupted.parquet"
    proc = apcscore(*common, *slow, "--out", out)
    partial = tmp_path / "interrupted.parquet.partial"
    deadline = time.time() + 120
    while not (partial / "run.json").exists() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.1)
    time.sleep(1.0)  # let it finish some records
    proc.send_signal(signal.SIGINT)
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 130, output
    assert "--resume" in output
    assert not out.exists() and partial.is_dir()
    saved = sum(pq.read_metadata(p).num_rows for p in partial.glob("part-*.parquet"))
    assert 0 < saved < len(records), f"saved {saved} rows: the interrupt came too late or too early"

    # a resume with other job options is refused
    proc = apcscore(*[a if a != 2 else 3 for a in common], "--out", out, "--resume")
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 2 and "job" in output, output

    proc = apcscore(*common, "--out", out, "--resume")
    output, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, output
    resumed = pq.read_table(out)

    ref_out = tmp_path / "uninterrupted.parquet"
    proc = apcscore(*common, "--out", ref_out)
    output, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, output
    reference = pq.read_table(ref_out)
    assert resumed.num_rows == len(records)
    assert resumed.column("id").to_pylist() == [r["id"] for r in records]
    # every value, in dataset order, bitwise (the engine settings differed: results do not depend on them)
    assert resumed.equals(reference)
    meta = json.loads(resumed.schema.metadata[b"apcscore"])
    assert meta["dataset"]["num_records"] == len(records)
