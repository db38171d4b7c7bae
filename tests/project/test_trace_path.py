"""scripts/trace_path.py (issue 54's "frames and classes" figures, docs/notes/issue54-measures.md) still runs, so
the figures can be measured again after the engine is restructured."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_trace_path_prints_the_stack_to_engine_run_and_the_classes_met(tiny) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "scripts/trace_path.py", "--model", tiny, "--list"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    stack = re.search(r"frames from the CLI command to Engine\.run: (\d+) .*?\n((?:  .*\n)+)", out)
    assert stack, out
    frames = stack.group(2).splitlines()
    assert int(stack.group(1)) == len(frames)
    assert frames[0].split()[1].startswith("apcscore/cli.py") and frames[-1].endswith("Engine.run")
    assert "frames from the CLI command to attention forward" in out
    met = re.search(r"the project's own classes met: (\d+), (\d+) without the model's layers", out)
    assert met and int(met.group(1)) > int(met.group(2)) > 0
    assert "  apcscore.engine.engine.Engine" in out.splitlines()
