"""`scripts/gpu_check.sh --dry-run` runs in CI, so the GPU check cannot go stale before a GPU is lent: every
part runs end to end on the CPU with tiny shapes, ends with rc 0 inside its own time limit, and the summary
says ok. The GPU run's own limits are checked too: the parts fit the whole check's budget, and no
subprocess the tests part starts may outlive that part's limit."""

from __future__ import annotations

import pytest

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PARTS = ["env", "tests", "sweep", "exactness", "tax", "bench:llama-3.2-1b", "eval", "8b", "reference", "long",
         "profile"]
# what each part must have printed besides its end line: (part, key) pairs of its JSON lines
EXPECTED = {"exactness": {"budgets", "exact_reuse", "last_token_alternatives", "greedy_generation", "silu_mul",
                          "shared_prefix_decode"},
            "eval": {"5-shot multiple choice", "8-token continuations"}, "8b": {"score", "generate"}}


def load_gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
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
    by_part = {}
    for ln in lines:
        by_part.setdefault(ln["part"], []).append(ln)
    assert {ln["check"] for ln in by_part["exactness"]} == EXPECTED["exactness"]
    assert all(ln["ok"] for ln in by_part["exactness"]), by_part["exactness"]  # bitwise on the CPU too
    assert {ln["task"] for ln in by_part["eval"]} == EXPECTED["eval"]
    assert by_part["eval"][0]["exact_reuse_bitwise_recompute"] is True
    assert {ln["task"] for ln in by_part["8b"]} == EXPECTED["8b"]
    # MFU counts the weights a token is multiplied by: the 8B's untied embedding (a lookup) is left out, the
    # 1B's tied one is its LM head
    assert all(ln["params"] - ln["mfu_params"] == 1024 * 64 for ln in by_part["8b"]), by_part["8b"]  # TINY
    (reference,) = by_part["reference"]  # the pair's KL: finite, and the same bits one prompt at a time
    assert reference["ok"] and reference["bitwise_one_at_a_time"] and reference["mean_kl"] > 0, reference
    setup = next(ln for ln in by_part["bench"] if ln["task"] == "setup")
    assert setup["mfu_params"] == setup["params"], setup
    assert [(ln["prompts"], ln["ok"]) for ln in by_part["long"]] == [(4, True), (2, True)]
    profile = {(ln["task"], ln["side"]): ln for ln in by_part["profile"]}
    assert set(profile) == {(t, s) for t in ("score", "generate") for s in ("invariant", "library")}, profile
    assert all(0 < ln["kernel_s"] and ln["groups_s"] and ln["top"] for ln in profile.values()), profile
    tax = by_part["tax"][0]
    assert tax["score_ratio"] > 0 and tax["generate_ratio"] > 0
    sweep = by_part["sweep"]
    assert len(sweep) == 6 and "proposed_table" in sweep[-1]  # 5 tiny (N, K) (the 3 models coincide), the table
    assert all(row["proposed"] and all(row["invariant"].values()) for row in sweep[:-1]), sweep
    assert all(len(row["relative_error"]) == len(row["invariant"]) and max(row["relative_error"].values()) < 1e-4
               for row in sweep[:-1]), sweep  # every candidate right too (fp32 on the CPU)
    proposed = sweep[-1]["non_default"]  # the later parts ran with the sweep's proposal in the table
    assert [ends[p].get("swept_table_entries") for p in PARTS[3:]] == [proposed] * len(PARTS[3:]), ends
    summary = lines[-1]
    assert summary["part"] == "summary" and summary["ok"] is True and summary["small"] is True, summary
    assert proc.returncode == 0, proc.stderr[-3000:]
    # the same lines went to $OUT/gpu_check.jsonl
    logged = (tmp_path / "out" / "gpu_check.jsonl").read_text().splitlines()
    assert [json.loads(ln) for ln in logged] == lines
    markdown = (tmp_path / "out" / "gpu_check_summary.md").read_text()
    for title in ("Exactness end to end", "Invariance tax", "Matmul configurations per (N, K)", "Eval-shaped work",
                  "Llama-3.1-8B shape", "A reference model in the run", "Long prompts", "Where the time goes"):
        assert f"### {title}" in markdown
    assert "no lines" not in markdown, markdown


def test_gpu_run_limits_fit_the_check() -> None:
    gpu_check = load_gpu_check()
    limits = gpu_check.PART_LIMITS_S
    assert set(limits) == set(PARTS) == set(gpu_check.SMALL_LIMITS_S)
    assert sum(limits.values()) <= gpu_check.TOTAL_LIMIT_S
    backstop = int(re.search(r"^limit=(\d+)", (ROOT / "scripts" / "gpu_check.sh").read_text(), re.M).group(1))
    assert gpu_check.TOTAL_LIMIT_S + 10 <= backstop  # the script's own deadline ends first
    # subprocesses of the GPU tests (the tests part) end before the part's limit does
    for path in ROOT.glob("tests/**/test_*.py"):
        text = path.read_text()
        if path.name == Path(__file__).name or ("pytest.mark.gpu" not in text and "pytest.mark.triton" not in text):
            continue
        for match in re.finditer(r"timeout=(\d+)", text):
            assert int(match.group(1)) < limits["tests"], (path.name, match.group(0))


def test_parts_after_the_sweep_run_its_proposal(tmp_path: Path, monkeypatch) -> None:
    """The sweep's proposal file, written shape by shape, is what a later part's matmul table holds: its
    entries, and DEFAULT for every other shape, also one the committed table has an entry for."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import gpu_check_sweep

    from apcscore.kernels import matmul_configs

    path = tmp_path / "matmul_table.json"
    monkeypatch.setenv(gpu_check_sweep.SWEPT_TABLE_ENV, str(path))
    committed = matmul_configs.MatmulConfig(64, 64, 64, 8, 4, 4, tma_persistent=True)
    monkeypatch.setattr(matmul_configs, "TABLE", {("sm90", "bfloat16", 2048, 2048): committed})
    # no sweep ran: the committed table stays
    assert gpu_check_sweep.apply_swept_table() == 0 and gpu_check_sweep.read_table(path) == []
    assert matmul_configs.config_for("sm90", "bfloat16", 2048, 2048) == committed
    tma = matmul_configs.MatmulConfig(128, 256, 64, 8, 8, 3, tma_persistent=True)
    gpu_check_sweep.write_table(path, [["sm90", "bfloat16", 3072, 2048, vars(tma)]])
    assert len(gpu_check_sweep.read_table(path)) == 1 and gpu_check_sweep.apply_swept_table() == 1
    assert matmul_configs.config_for("sm90", "bfloat16", 3072, 2048) == tma
    assert matmul_configs.config_for("sm90", "bfloat16", 2048, 2048) == matmul_configs.DEFAULT


@pytest.mark.slow
def test_the_two_gpu_part_runs_small_on_the_cpu() -> None:
    """scripts/gpu_check_tp.py (tensor parallelism over NCCL, for a machine with two GPUs) is not in
    gpu_check.py's plan (the lent machines have one GPU); its --small form runs the same checks over gloo on the
    CPU, so it cannot go stale either."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run([sys.executable, "scripts/gpu_check_tp.py", "--small"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    lines = {ln["check"]: ln for ln in map(json.loads, filter(lambda s: s.startswith("{"), proc.stdout.splitlines()))}
    assert proc.returncode == 0 and lines.get("end", {}).get("ok") is True, proc.stdout + proc.stderr[-3000:]
    assert lines["exactness"]["ok"] is True and lines["exactness"]["budgets_and_alone_differ"] == []
    assert 0 < lines["agreement"]["max_abs_logprob_diff"] <= 1e-5


SLOW_TESTS = '''
import os, subprocess, sys, time

def test_passes():
    pass

def test_fails():
    assert 1 == 2

def test_outlives_the_limit(tmp_path_factory):
    child = subprocess.Popen(["sleep", "120"])
    with open(os.environ["CHILD_PID_FILE"], "w") as f:
        f.write(str(child.pid))
    child.wait()

def test_never_reached():
    pass
'''


def gone(pid: int, within_s: float = 10.0) -> bool:
    """Whether process `pid` has ended (or been reaped) within `within_s` seconds."""
    import time

    end = time.monotonic() + within_s
    while time.monotonic() < end:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False


@pytest.mark.slow
def test_a_tests_run_cut_short_reports_the_tests_it_finished(tmp_path: Path) -> None:
    """The tests part stops pytest before the part's limit (SIGINT, then SIGKILL) and still reports each test
    that finished, from pytest's per-test lines; nothing a test started outlives the run."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import gpu_check_basic

    (tmp_path / "test_slow.py").write_text(SLOW_TESTS)
    pid_file = tmp_path / "child.pid"
    env = dict(os.environ, CHILD_PID_FILE=str(pid_file))
    result = gpu_check_basic.run_pytest(["test_slow.py", "-p", "no:cacheprovider", "-rfE"], tmp_path, env,
                                        stop_after_s=4)
    assert result["interrupted"] is True and result["rc"] != 0, result
    assert result.get("passed") == 1 and result.get("failed") == 1, result
    assert result["failed_tests"] == ["FAILED test_slow.py::test_fails"], result
    assert result["seconds"] < 4 + gpu_check_basic.PYTEST_GRACE_S + 5, result
    assert gone(int(pid_file.read_text())), "the test's child outlived the stopped run"


def test_a_killed_tests_part_takes_pytest_with_it(tmp_path: Path) -> None:
    """The orchestrator kills a part's process group at its limit; pytest runs in a group of its own (so that the
    stop's SIGINT reaches pytest alone), and the part's SIGTERM handler ends that group too."""
    import signal
    import time

    (tmp_path / "test_slow.py").write_text(SLOW_TESTS)
    pid_file = tmp_path / "child.pid"
    script = (f"import sys; sys.path.insert(0, {str(ROOT / 'scripts')!r}); import gpu_check_basic; "
              f"gpu_check_basic.run_pytest(['test_slow.py', '-p', 'no:cacheprovider'], {str(tmp_path)!r}, "
              "dict(__import__('os').environ), None)")
    part = subprocess.Popen([sys.executable, "-c", script], env=dict(os.environ, CHILD_PID_FILE=str(pid_file)),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    end = time.monotonic() + 60
    while not (pid_file.exists() and pid_file.read_text()) and time.monotonic() < end:
        time.sleep(0.1)
    assert pid_file.exists(), "the slow test never started"
    os.killpg(part.pid, signal.SIGTERM)  # as gpu_check.run_part does at a part's limit
    assert part.wait(timeout=20) == 128 + signal.SIGTERM
    assert gone(int(pid_file.read_text())), "the test's child outlived its killed part"


def test_only_runs_those_parts_of_the_plan_and_refuses_others(tmp_path: Path) -> None:
    """`--only` (a short second call in a lease) runs the named parts in the plan's order, and refuses a name that
    is not a part before anything runs."""
    env = dict(os.environ, PYTHON=sys.executable, OUT=str(tmp_path / "out"))
    run = lambda only: subprocess.run(["bash", "scripts/gpu_check.sh", "--dry-run", "--only", only],  # noqa: E731
                                      cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    refused = run("env,tax,nonsense")
    assert refused.returncode == 2 and "no such part nonsense" in refused.stderr, refused.stderr
    assert not refused.stdout.strip()
    proc = run("env")
    lines = [json.loads(ln) for ln in proc.stdout.splitlines() if ln.startswith("{")]
    assert [ln["name"] for ln in lines if ln["part"] == "end"] == ["env"], lines
    assert lines[-1]["part"] == "summary" and lines[-1]["ok"] is True and proc.returncode == 0, proc.stderr[-2000:]
