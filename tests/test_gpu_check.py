"""`scripts/gpu_check.sh --dry-run` runs in CI, so the GPU check cannot go stale before a GPU is lent: every
part runs end to end on the CPU with tiny shapes, ends with rc 0 inside its own time limit, and the summary
says ok. The GPU run's own limits are checked too: the parts fit the whole check's budget, and no
subprocess the tests part starts may outlive that part's limit."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PARTS = ["env", "tests", "compare", "bench:smollm2-135m", "bench:llama-3.2-1b", "invariance"]


def load_gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_gpu_check_dry_run_passes_within_every_limit(tmp_path: Path) -> None:
    env = dict(os.environ, PYTHON=sys.executable, OUT=str(tmp_path / "out"))
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    proc = subprocess.run(["bash", "scripts/gpu_check.sh", "--dry-run"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    lines = [json.loads(ln) for ln in proc.stdout.splitlines() if ln.startswith("{")]
    assert lines, proc.stdout + proc.stderr
    ends = {ln["name"]: ln for ln in lines if ln["part"] == "end"}
    assert list(ends) == PARTS, lines
    for name, end in ends.items():
        assert end["rc"] == 0 and not end["timed_out"], (name, end.get("stderr_tail"))
        assert end["seconds"] <= end["limit_s"], end
        assert end["json_lines"] >= 1, end
    summary = lines[-1]
    assert summary["part"] == "summary" and summary["ok"] is True and summary["small"] is True, summary
    assert proc.returncode == 0, proc.stderr[-3000:]
    # the same lines went to $OUT/gpu_check.jsonl
    logged = (tmp_path / "out" / "gpu_check.jsonl").read_text().splitlines()
    assert [json.loads(ln) for ln in logged] == lines


def test_gpu_run_limits_fit_the_check() -> None:
    gpu_check = load_gpu_check()
    limits = gpu_check.PART_LIMITS_S
    assert set(limits) == set(PARTS) == set(gpu_check.SMALL_LIMITS_S)
    assert sum(limits.values()) <= gpu_check.TOTAL_LIMIT_S
    backstop = int(re.search(r"^limit=(\d+)", (ROOT / "scripts" / "gpu_check.sh").read_text(), re.M).group(1))
    assert gpu_check.TOTAL_LIMIT_S + 10 <= backstop  # the script's own deadline ends first
    # subprocesses of the GPU tests (the tests part) end before the part's limit does
    for path in ROOT.glob("tests/test_*.py"):
        text = path.read_text()
        if path.name == Path(__file__).name or ("pytest.mark.gpu" not in text and "pytest.mark.triton" not in text):
            continue
        for match in re.finditer(r"timeout=(\d+)", text):
            assert int(match.group(1)) < limits["tests"], (path.name, match.group(0))
