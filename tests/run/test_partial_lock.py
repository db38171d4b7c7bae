"""One run per `<out>.partial` (issue 46, item 5), checked with real processes: a run B started on the partial of a
run A still going is refused and leaves it untouched, A then finishes whole; a run killed outright (SIGKILL) leaves
no stale lock behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from apcscore.cli import app
from apcscore.errors import ApcscoreError
from apcscore.io.partial import lock_partial

REPO = Path(__file__).resolve().parents[2]
runner = CliRunner()
N = 48  # records; with --max-tokens 32 run A takes seconds on the tiny model, long enough to be stopped mid-run


def one_line(res) -> str:
    return " ".join(res.output.split())


def start_run(data: Path, out: Path, tiny: str) -> subprocess.Popen:
    """`apcscore generate` as a process of its own (run A), once it holds the lock on out's partial (run.json is
    written after the lock is taken)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-m", "apcscore", "generate", str(data), "--model", tiny, "--out",
                             str(out), "--max-tokens", "32", "-q"], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    run_file = out.with_name(out.name + ".partial") / "run.json"
    deadline = time.monotonic() + 180
    while not run_file.exists():
        assert proc.poll() is None, f"run A ended before its partial was seen: {proc.communicate()[0]}"
        assert time.monotonic() < deadline, "run A did not start its partial within 180 s"
        time.sleep(0.01)
    return proc


def snapshot(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


@pytest.mark.slow
def test_a_second_run_on_a_partial_another_process_writes_is_refused_and_the_first_finishes(
        tmp_path, write_jsonl, tiny):
    data = write_jsonl(tmp_path / "d.jsonl", [{"id": f"r{i}", "prompt": f"Story {i}: once upon a time"}
                                              for i in range(N)])
    out = tmp_path / "o.parquet"
    partial = out.with_name(out.name + ".partial")
    a = start_run(data, out, tiny)
    try:
        a.send_signal(signal.SIGSTOP)  # run A is still going, frozen so that B certainly meets it
        before = snapshot(partial)
        for flag in ("--resume", "--overwrite"):  # the 'unfinished run' error advises --resume
            res = runner.invoke(app, ["generate", str(data), "--model", tiny, "--out", str(out), "--max-tokens", "32",
                                      flag, "-q"])
            assert res.exit_code == 2 and "Traceback" not in res.output, res.output
            assert f"{partial} is in use by another apcscore run that is still going" in one_line(res)
            assert res.output.count("\n") == 1 and snapshot(partial) == before and not out.exists()
    finally:
        a.send_signal(signal.SIGCONT)
    output, _ = a.communicate(timeout=600)
    assert a.returncode == 0, output  # it used to fail: "partial ... is inconsistent"
    table = pq.read_table(out)
    assert table.column("id").to_pylist() == [f"r{i}" for i in range(N)]
    assert set(table.column("status").to_pylist()) == {"ok"} and not partial.exists()


@pytest.mark.slow
def test_a_run_killed_outright_leaves_no_stale_lock(tmp_path, write_jsonl, tiny):
    data = write_jsonl(tmp_path / "d.jsonl", [{"id": f"r{i}", "prompt": f"Story {i}: once upon a time"}
                                              for i in range(N)])
    out = tmp_path / "o.parquet"
    a = start_run(data, out, tiny)
    a.kill()  # SIGKILL: no finally runs; the kernel drops the flock with the process
    a.communicate(timeout=60)
    res = runner.invoke(app, ["generate", str(data), "--model", tiny, "--out", str(out), "--max-tokens", "32",
                              "--resume", "-q"])
    assert res.exit_code == 0, res.output
    assert pq.read_table(out).column("id").to_pylist() == [f"r{i}" for i in range(N)]


def test_a_partial_removed_before_it_is_locked_is_a_clear_refusal(tmp_path):
    """Run B saw the partial, then run A finished and removed it before B's lock: one line, not
    FileNotFoundError."""
    partial = tmp_path / "o.parquet.partial"
    with pytest.raises(ApcscoreError, match="was removed by another apcscore run a moment ago"):
        lock_partial(partial)
