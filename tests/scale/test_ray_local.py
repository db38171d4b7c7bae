"""`--ray local` asking for resources the machine does not have (issue 46, item 7), as a user runs it: its own
process, a Ray instance it starts itself. It waited forever without a word; now one error line and exit 2."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

try:
    import ray
except ImportError:  # pragma: no cover - the extra is installed by `make install`
    ray = None

pytestmark = [pytest.mark.ray, pytest.mark.slow,
              pytest.mark.skipif(ray is None, reason="Ray is not installed (pip install 'apcscore[ray]')")]
REPO = Path(__file__).resolve().parents[2]


def test_ray_local_with_a_gpu_per_replica_on_a_machine_without_one_is_refused(tmp_path, write_jsonl, tiny):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: --gpus-per-replica 1 can be placed here")
    data = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "Hello"}])
    out = tmp_path / "o.parquet"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
           "COLUMNS": "300"}
    try:
        proc = subprocess.run([sys.executable, "-m", "apcscore", "score", str(data), "--model", tiny, "--ray", "local",
                               "--gpus-per-replica", "1", "--out", str(out), "-q"], env=env, capture_output=True,
                              text=True, timeout=300)
    except subprocess.TimeoutExpired:
        pytest.fail("--ray local --gpus-per-replica 1 on a machine without a GPU still waits (300 s)")
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert len(errors) == 1, proc.stderr
    assert errors[0].startswith("error: --gpus-per-replica 1: the Ray cluster has 0 GPUs in all"), proc.stderr
    assert "--gpus-per-replica 0 runs on the CPU" in errors[0] and not out.exists()
    assert not out.with_name(out.name + ".partial").exists()
